#!/usr/bin/env bash
# The accelerator rows of docs/benchmarks.md, in one command. Compilation is
# excluded from every timing it prints. Two sets of sections, each in order
# of value (every section runs even if an earlier one failed):
#
# The default, the GPU benchmark (scripts/bench_gpu.py, one process per
# section; about 7 minutes on one H100 or H200 by estimate, a 460 s budget):
#   1. bandwidth    the card's achievable memory bandwidth (a device-to-device copy);
#   2. targets      T5 1.1 XXL- and XL-sized targets with random bfloat16 weights,
#                   batch 1: the one-token step, v(k) for k = 1, 2, 4, 8, 16, the
#                   steps of small/base/large-sized drafts and c, each pass as a
#                   % of its weight-bytes floor at that bandwidth; Theorem 3.8's
#                   speedup at the paper's α (Table 2, EnDe, T = 0, γ 7);
#   3. hf           Hugging Face transformers on the same card and weights: the
#                   XXL-sized target's step and greedy generate tokens/s, beside ours;
#   4. hf_compiled  HF generate with the static cache, which transformers compiles on a GPU;
#   5. demo         the demo pair end to end: ours against HF generate and HF
#                   assisted generation with the same draft, outputs compared;
#   6. exactness    T = 0 mismatches of speculative vs baseline on the demo pair at
#                   float32 default and 'highest' matmul precision and in bfloat16.
#   7. profile      a per-kernel profile (jax.profiler) of the drafts' one-token steps
#                   and the XL-sized target's step beside its 2-position pass.
# Each prints its table as it finishes and adds it to bench_gpu.json and
# bench_gpu.md in the output folder (below).
#
# --runner, the earlier set (6 minutes on one H200, a 420 s budget):
#   1. the demo pair's runner rows at T = 0 and T = 1 (configs/demo.gin,
#      configs/demo_t1.gin: 100 held-out verses each, as on the CPU);
#   2. v(k), the cost of scoring k positions in one pass relative to one step
#      (paper §3.4), for a T5 1.1 XL-sized target with random bfloat16 weights,
#      k = 1, 2, 3, 4, 6, 8, 12, 16, beside the bare matmuls
#      (scripts/bench_decode.py --vk);
#   3. a γ sweep (1, 2, 3, 4, 6, 8) on the demo pair, T = 0 then T = 1, 20
#      verses each, inputs padded to 128 tokens (one compiled program per γ)
#      (scripts/bench_speculative.py).
#
#   bash scripts/bench_accelerator.sh                     # the GPU benchmark
#   bash scripts/bench_accelerator.sh --smoke             # every section at toy sizes (a CPU test)
#   bash scripts/bench_accelerator.sh --runner [--smoke]  # the earlier set
#
# Time budget: BENCH_BUDGET_S seconds in all (default 460, --runner 420,
# --smoke 3600). Each section runs under `timeout` with what is left of it,
# less a reserve kept for the sections after it; a section that fails or
# runs out prints '# section NAME failed (exit N)' and the next one starts.
# The exit status is 1 if any section failed or was skipped, else 0.
#
# Output goes to $BENCH_WORKDIR/bench_accelerator if set, else
# $OUT/bench_accelerator if OUT is set (the device machine's output folder),
# else a temporary directory: bench_gpu.json, bench_gpu.md and a copy of
# everything printed (bench_accelerator.log); --runner writes the runner's
# workdirs there instead of the first two.
set -uo pipefail
cd "$(dirname "$0")/.."
smoke=0
set_=gpu
for arg in "$@"; do
  case $arg in
    --smoke) smoke=1 ;;
    --runner) set_=runner ;;
    *) echo "usage: bash scripts/bench_accelerator.sh [--runner] [--smoke]" >&2; exit 2 ;;
  esac
done
work="${BENCH_WORKDIR:-${OUT:-$(mktemp -d)}}/bench_accelerator"
mkdir -p "$work" || exit 1
exec > >(tee -a "$work/bench_accelerator.log") 2> >(tee -a "$work/bench_accelerator.log" >&2)
default_budget=$([[ $set_ == gpu ]] && echo 460 || echo 420)
budget="${BENCH_BUDGET_S:-$([[ $smoke == 1 ]] && echo 3600 || echo "$default_budget")}"
start=$SECONDS
failed=()

# section NAME RESERVE_S COMMAND...: COMMAND under a time limit of what is
# left of the budget minus RESERVE_S; its failure is reported, not fatal.
section() {
  local name=$1 reserve=$2; shift 2
  local left=$(( budget - (SECONDS - start) - reserve ))
  if (( left < 20 )); then
    echo "# section $name skipped: the time budget ($budget s) is spent"
    failed+=("$name"); return 0
  fi
  local t0=$SECONDS rc=0
  # bash -c: COMMAND may be an exported function; timeout signals its whole
  # process group, so the python under it stops too.
  timeout -k 15 "$left" bash -c '"$@"' bash "$@" || rc=$?
  if (( rc != 0 )); then
    echo "# section $name failed (exit $rc)$( (( rc == 124 || rc == 137 )) && echo "; stopped at its limit of $left s")"
    failed+=("$name")
  fi
  echo "# section $name took $(( SECONDS - t0 )) s (run so far: $(( SECONDS - start )) s)"
}

# The runner's headline numbers from a workdir's summary.json, in one line.
summary_py='import json, sys
s = json.load(open(sys.argv[1]))
s.setdefault("mismatches_vs_baseline", None)
print("# summary: {num_examples} examples, T = {temperature:g}, γ {gamma}: baseline {b:.1f} tok/s, "
      "speculative {p:.1f} tok/s, speedup {speedup:.3f}x, α {alpha:.3f}, c {c:.4f}, v {v:.3f}, "
      "target step {target_step_ms:.4f} ms, EXP (Thm 3.8) {expected_speedup:.2f}x, "
      "EXP (with v) {expected_speedup_v:.2f}x, mismatches {mismatches_vs_baseline}".format(
          b=1e3 / s["baseline_ms_per_token"], p=1e3 / s["speculative_ms_per_token"], **s))'

# runner CONFIG EXTRA_ARGS...: one runner row, then its summary line.
runner() {
  local config=$1; shift
  python -m specdec_jax.run --config="configs/$config.gin" --workdir="$work/$config" "$@" &&
    python -c "$summary_py" "$work/$config/summary.json"
}
export work summary_py
export -f runner

section devices 0 python -c "import jax; d = jax.devices()[0]; print(f'# accelerator: {d.device_kind} x {jax.device_count()} ({jax.default_backend()}), jax {jax.__version__}')"

if [[ $set_ == gpu ]]; then
  gpu=(--out="$work")
  [[ $smoke == 1 ]] && gpu+=(--smoke)
  # NAME RESERVE_S TITLE, in order of value; the reserve keeps time for the
  # sections after it (their expected length on one H100).
  while read -r name reserve title; do
    echo "## $title"
    section "$name" "$reserve" python scripts/bench_gpu.py --section="$name" "${gpu[@]}" </dev/null
  done <<'SECTIONS'
bandwidth 360 memory bandwidth (device-to-device copy)
targets 200 T5 1.1 XXL- and XL-sized targets: step, v(k), c, % of the bandwidth floor, Theorem 3.8
hf 160 Hugging Face on the same card and weights: the XXL-sized step and generate
hf_compiled 110 Hugging Face generate with the static cache (compiled on a GPU)
demo 50 the demo pair end to end: ours vs Hugging Face generate and assisted generation
exactness 40 T = 0 mismatches, speculative vs baseline: float32 default, float32 highest, bfloat16
profile 0 per-kernel profile of the drafts' steps and the XL-sized target's step and 2-position pass
SECTIONS
else
  if [[ $smoke == 1 ]]; then
    vk=(--vk-models=demo --vk-ks=1,2 --repeats=1 --vk-inner=1)
    runner_args=(--gin_bindings="Experiment.num_warmup = 1" --gin_bindings="Experiment.num_examples = 1"
                 --gin_bindings="Experiment.cost_repeats = 1" --gin_bindings="Experiment.input_buckets = ()")
    sweep=(--gammas=2 --num_examples=1 --auto_alpha_examples=0 --input_buckets=none)
    runner_configs=(demo)   # demo_t1 is the same path at T = 1
    sweep_temps=(0)
    vk_what="the demo target (smoke)"
  else
    vk=(--vk-models=xl --vk-dtype=bfloat16 --vk-ks=1,2,3,4,6,8,12,16 --repeats=5 --vk-inner=8)
    runner_args=()
    runner_configs=(demo demo_t1)
    sweep=(--gammas=1,2,3,4,6,8 --num_examples=20 --input_buckets=none --auto_alpha_examples=0)
    sweep_temps=(0 1)
    vk_what="T5 1.1 XL-sized target, random bfloat16 weights"
  fi
  for config in "${runner_configs[@]}"; do
    echo "## runner: configs/$config.gin"
    section "runner $config" "$([[ $config == demo ]] && echo 120 || echo 0)" runner "$config" "${runner_args[@]}"
  done
  echo "## v(k): $vk_what, batch 1"
  section "v(k)" 60 python scripts/bench_decode.py --vk "${vk[@]}"
  for t in "${sweep_temps[@]}"; do
    echo "## γ sweep on the demo pair, T = $t"
    section "γ sweep T=$t" 0 python scripts/bench_speculative.py --temperatures="$t" "${sweep[@]}"
  done
fi

echo "# total $(( SECONDS - start )) s"
if (( ${#failed[@]} )); then
  echo "# failed or skipped: $(IFS=,; echo "${failed[*]}")"
  exit 1
fi
