#!/usr/bin/env bash
# The accelerator rows of docs/benchmarks.md, in one command (6 minutes on one
# H200 GPU; compilation is excluded from every timing it prints). Sections,
# in order of value (each one runs even if an earlier one failed):
#   1. the demo pair's runner rows at T = 0 and T = 1 (configs/demo.gin,
#      configs/demo_t1.gin: 100 held-out verses each, as on the CPU);
#   2. v(k), the cost of scoring k positions in one pass relative to one step
#      (paper §3.4), for a T5 1.1 XL-sized target with random bfloat16 weights,
#      k = 1, 2, 3, 4, 6, 8, 12, 16 (scripts/bench_decode.py --vk);
#   3. a γ sweep (1, 2, 3, 4, 6, 8) on the demo pair, T = 0 then T = 1, 20
#      verses each, inputs padded to 128 tokens (one compiled program per γ)
#      (scripts/bench_speculative.py).
#
#   bash scripts/bench_accelerator.sh            # the rows
#   bash scripts/bench_accelerator.sh --smoke    # the same commands at toy sizes (a CPU test)
#
# Time budget: BENCH_BUDGET_S seconds in all (default 420; --smoke: 3600).
# Each section runs under `timeout` with what is left of it, less a reserve
# kept for the sections after it that matter most; a section that fails or
# runs out prints '# section NAME failed (exit N)' and the next one starts.
# The exit status is 1 if any section failed or was skipped, else 0.
#
# Runner workdirs go to $BENCH_WORKDIR/bench_accelerator if set, else
# $OUT/bench_accelerator if OUT is set (the device machine's output folder),
# else a temporary directory; everything printed is the report.
set -uo pipefail
cd "$(dirname "$0")/.."
smoke=0
if [[ "${1:-}" == "--smoke" ]]; then smoke=1; elif [[ $# -gt 0 ]]; then
  echo "usage: bash scripts/bench_accelerator.sh [--smoke]" >&2; exit 2
fi
work="${BENCH_WORKDIR:-${OUT:-$(mktemp -d)}}/bench_accelerator"
mkdir -p "$work" || exit 1
budget="${BENCH_BUDGET_S:-$([[ $smoke == 1 ]] && echo 3600 || echo 420)}"
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

if [[ $smoke == 1 ]]; then
  vk=(--vk-models=demo --vk-ks=1,2 --repeats=1 --vk-inner=1)
  runner_args=(--gin_bindings="Experiment.num_warmup = 1" --gin_bindings="Experiment.num_examples = 1"
               --gin_bindings="Experiment.cost_repeats = 1")
  sweep=(--gammas=2 --num_examples=1 --auto_alpha_examples=0)
  sweep_temps=(0)
  vk_what="the demo target (smoke)"
else
  vk=(--vk-models=xl --vk-dtype=bfloat16 --vk-ks=1,2,3,4,6,8,12,16 --repeats=5 --vk-inner=8)
  runner_args=()
  sweep=(--gammas=1,2,3,4,6,8 --num_examples=20 --input_buckets=none --auto_alpha_examples=0)
  sweep_temps=(0 1)
  vk_what="T5 1.1 XL-sized target, random bfloat16 weights"
fi

section devices 0 python -c "import jax; d = jax.devices()[0]; print(f'# accelerator: {d.device_kind} x {jax.device_count()} ({jax.default_backend()}), jax {jax.__version__}')"
echo "## runner: configs/demo.gin"
section "runner demo" 120 runner demo "${runner_args[@]}"
echo "## runner: configs/demo_t1.gin"
section "runner demo_t1" 0 runner demo_t1 "${runner_args[@]}"
echo "## v(k): $vk_what, batch 1"
section "v(k)" 60 python scripts/bench_decode.py --vk "${vk[@]}"
for t in "${sweep_temps[@]}"; do
  echo "## γ sweep on the demo pair, T = $t"
  section "γ sweep T=$t" 0 python scripts/bench_speculative.py --temperatures="$t" "${sweep[@]}"
done

echo "# total $(( SECONDS - start )) s"
if (( ${#failed[@]} )); then
  echo "# failed or skipped: $(IFS=,; echo "${failed[*]}")"
  exit 1
fi
