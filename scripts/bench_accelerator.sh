#!/usr/bin/env bash
# The accelerator rows of docs/benchmarks.md, in one command. Compilation is
# excluded from every timing it prints. Two sets of sections, each in order
# of value (every section runs even if an earlier one failed):
#
# The default, the GPU benchmark (scripts/bench_gpu.py, one process per
# section; specdec_jax/research/bench says what each measures), within a
# 470 s budget. Estimated times on one H100 (no GPU run of these sections
# yet: mostly compilation, guessed at about 15 s per XXL-sized decoding loop;
# each section prints its programs' compile times):
#   1. loops             Table 2's EnDe rows at T = 0 with the real compiled
#                        loops: a T5 1.1 XXL-sized target and small/base/large-
#                        sized drafts (random bfloat16 weights, batch 1, 64 new
#                        tokens, EOS ignored), acceptance steered to the row's
#                        α; the chain at the paper's γ and the row's best tree
#                        against our baseline, Theorem 3.8 with the measured
#                        α, c and v beside them (about 160 s);
#   2. variant_pallas, variant_fixed_positions, variant_fused_projections,
#      variant_command_buffers: one section per kernel variant
#                        (specdec_jax/research/bench/variants.py VARIANTS):
#                        XXL and XL targets' step and 8-position pass and the
#                        drafts' steps with and without it, interleaved, as %
#                        of the bandwidth floor; for pallas and fixed_positions
#                        also T = 0 mismatches in bfloat16 with and without it
#                        (demo pair; 100 XXL-sized random inputs) (160 s each
#                        with the counts, 60 s without);
#   3. hf                an XXL-sized target on Hugging Face: our baseline vs
#                        HF generate (dynamic cache; static cache compiled),
#                        our speculative loop vs HF assisted generation with a
#                        small-sized assistant (110 s);
#   4. demo              the demo pair end to end: ours vs HF generate and HF
#                        assisted generation with the same draft (25 s);
#   5. loops_cnndm       Table 2's CNN/DM rows at T = 0, as loops (130 s).
# At these estimates the 470 s budget reaches about the first two variants;
# the rest run in a second call on the same warm machine (compiled programs
# are cached in .bench_jax_cache/):
#   bash scripts/bench_accelerator.sh --sections=variant_fused_projections,variant_command_buffers,hf,demo,loops_cnndm
# Each prints its table (or its rows) as it finishes and adds it to
# bench_gpu.json and bench_gpu.md in the output folder (below); a section cut
# by the budget keeps the rows it printed. --sections=NAME,... runs those
# instead, in that order; 'more' stands for the earlier tables (variant_min_rows,
# bandwidth, targets, exactness, profile), 'all' for the default ones then those.
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
#   bash scripts/bench_accelerator.sh --smoke             # the default sections at toy sizes
#   bash scripts/bench_accelerator.sh --sections=all --smoke   # every section (a CPU test)
#   bash scripts/bench_accelerator.sh --runner [--smoke]  # the earlier set
#   bash scripts/bench_accelerator.sh --block [--smoke]   # the block draft (below)
#
# --block: lab/bench_block.py on the accelerator (about 5 minutes, mostly
# compilation; not yet run on a card): the demo pair at T = 0 and T = 1, the
# autoregressive draft's chain vs the block draft's chain and tree side by
# side (acceptance by position, tokens per target call, draft ms per round,
# speedup), the block proposal's cost in draft steps at γ 3..8 (on a card
# the call over 2γ positions should cost about one step), and the cost
# model's prediction for Table 2's EnDe T = 0 rows; bench_block.json in the
# output folder.
#
# Wheels: on a GPU machine where $BENCH_WHEELS (default wheels/, filled by
# scripts/fetch_bench_wheels.sh: a transformers whose assisted generation
# works, what it needs, gin-config) holds wheels, they are installed without
# an index (the user site where there is one, else the environment); where
# that fails or there are none, the installed packages are used. The
# versions are printed first. Programs compiled by one section are kept for
# the next, and for a later command on the same machine, in a compilation
# cache ($JAX_COMPILATION_CACHE_DIR, else .bench_jax_cache/; --smoke: a
# temporary one).
#
# Time budget: BENCH_BUDGET_S seconds in all (default 470, --runner 420,
# --smoke 3600). Each section runs under `timeout` with what is left of it,
# less a reserve kept for the sections after it; a section that fails or
# runs out prints '# section NAME failed (exit N)' and the next one starts
# (the rows it printed and recorded before stay).
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
chosen=default
usage="usage: bash scripts/bench_accelerator.sh [--runner|--block] [--smoke] [--sections=default|more|all|NAME,...]"
for arg in "$@"; do
  case $arg in
    --smoke) smoke=1 ;;
    --runner) set_=runner ;;
    --block) set_=block ;;
    --sections=*) chosen=${arg#--sections=} ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
# The GPU benchmark's sections: NAME MIN_S TITLE, the default ones first in
# order of value, then the earlier tables ('more'). MIN_S is the time kept
# for a section while the ones before it run (its useful minimum on one H100).
sections_table=$(cat <<'SECTIONS'
loops 120 the paper's T = 0 rows (Table 2) with the real loops at XXL size, α steered
variant_pallas 100 kernel variant pallas (fused decoder-layer kernels): steps, passes and T = 0 mismatches with and without it
variant_fixed_positions 100 kernel variant fixed_positions 8: steps, passes and T = 0 mismatches with and without it
variant_fused_projections 40 kernel variant fused_projections: steps and passes with and without it
variant_command_buffers 40 kernel variant command_buffers (CUDA graphs): steps and passes with and without it
hf 50 Hugging Face on the same card: XXL-sized generate (static cache, compiled) and assisted generation
demo 20 the demo pair end to end: ours vs Hugging Face generate and assisted generation
loops_cnndm 100 the paper's T = 0 rows of CNN/DM with the real loops at XXL size, α steered
variant_min_rows 40 kernel variant min_rows 2: steps and passes with and without it
bandwidth 10 memory bandwidth (device-to-device copy)
targets 100 T5 1.1 XXL- and XL-sized targets: step, v(k), c, % of the bandwidth floor, Theorem 3.8
exactness 40 T = 0 mismatches, speculative vs baseline: float32 default, float32 highest, bfloat16
profile 40 per-kernel profile of the drafts' steps and the XL-sized target's step and 2-position pass
SECTIONS
)
default_sections="loops variant_pallas variant_fixed_positions variant_fused_projections variant_command_buffers hf demo loops_cnndm"
more_sections="variant_min_rows bandwidth targets exactness profile"
case $chosen in
  default) chosen=$default_sections ;;
  more) chosen=$more_sections ;;
  all) chosen="$default_sections $more_sections" ;;
  *) chosen=${chosen//,/ } ;;
esac
for name in $chosen; do
  if ! grep -q "^$name " <<<"$sections_table"; then
    echo "unknown section '$name'; sections: $(cut -d' ' -f1 <<<"$sections_table" | tr '\n' ' ')" >&2
    exit 2
  fi
done
work="${BENCH_WORKDIR:-${OUT:-$(mktemp -d)}}/bench_accelerator"
mkdir -p "$work" || exit 1
exec > >(tee -a "$work/bench_accelerator.log") 2> >(tee -a "$work/bench_accelerator.log" >&2)
default_budget=$([[ $set_ == gpu ]] && echo 470 || echo 420)
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

# On a GPU machine (the image's transformers may be one whose assisted
# generation fails), the wheels in $BENCH_WHEELS installed without an index
# or dependencies: into the user site where the interpreter reads one (it
# shadows the environment's), else into the environment; all at once, else
# without the platform-specific ones. None there, or none installed: the
# installed packages (the versions line says which).
wheels="${BENCH_WHEELS:-wheels}"
if [[ $smoke == 0 ]] && command -v nvidia-smi >/dev/null && compgen -G "$wheels/*.whl" >/dev/null; then
  where=()
  python -c "import site, sys; sys.exit(0 if site.ENABLE_USER_SITE else 1)" 2>/dev/null && where=(--user)
  pip_install() { python -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
                    --upgrade "${where[@]}" "$@"; }
  # An externally managed Python (PEP 668) takes them with --break-system-packages
  # (the device machine is a fresh one each time).
  if pip_install "$wheels"/*.whl || pip_install --break-system-packages "$wheels"/*.whl ||
     pip_install "$wheels"/*-none-any.whl; then
    echo "# wheels from $wheels installed (${where[*]:-into the environment})"
  else
    echo "# wheels from $wheels could not be installed: the installed packages are used"
  fi
elif [[ $smoke == 0 ]] && command -v nvidia-smi >/dev/null; then
  echo "# no wheels in $wheels (scripts/fetch_bench_wheels.sh): the installed packages are used"
fi
# Programs one section compiled, loaded (not compiled again) by the next
# section, and by a later command on the same machine (a gitignored folder).
cache=.bench_jax_cache
[[ $smoke == 1 ]] && cache=$(mktemp -d)
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$cache}"

versions_py='import importlib.metadata as m
import jax
d = jax.devices()[0]
print(f"# accelerator: {d.device_kind} x {jax.device_count()} ({jax.default_backend()}), jax {jax.__version__}")
def version(p):
  try:
    return m.version(p)
  except m.PackageNotFoundError:
    return "absent"
print("# " + ", ".join(f"{p} {version(p)}" for p in ("jaxlib", "flax", "torch", "transformers",
                                                     "huggingface-hub", "tokenizers", "gin-config")))'
section devices 0 python -c "$versions_py"

if [[ $set_ == block ]]; then
  block=(--json="$work/bench_block.json")
  [[ $smoke == 1 ]] && block+=(--num_examples=2 --repeats=2 --cost_gammas=3,8)
  echo "## the block draft on the demo pair (lab/bench_block.py)"
  section "block" 0 python lab/bench_block.py "${block[@]}"
elif [[ $set_ == gpu ]]; then
  gpu=(--out="$work")
  [[ $smoke == 1 ]] && gpu+=(--smoke)
  read -r -a names <<<"$chosen"
  for i in "${!names[@]}"; do
    name=${names[$i]}
    # Keep for the sections after this one their minimum times.
    reserve=0
    for later in "${names[@]:$((i + 1))}"; do
      reserve=$(( reserve + $(grep "^$later " <<<"$sections_table" | cut -d' ' -f2) ))
    done
    echo "## $(grep "^$name " <<<"$sections_table" | cut -d' ' -f3-)"
    section "$name" "$reserve" python scripts/bench_gpu.py --section="$name" "${gpu[@]}" </dev/null
  done
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
