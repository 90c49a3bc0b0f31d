#!/usr/bin/env bash
# The accelerator rows of docs/benchmarks.md, in one command (about 8 minutes
# on one GPU; compilation is excluded from every timing it prints):
#   1. v(k), the cost of scoring k positions in one pass relative to one step
#      (paper §3.4), for a T5 1.1 XL-sized target with random bfloat16 weights,
#      k = 1..16 (scripts/bench_decode.py --vk);
#   2. the demo pair's runner rows at T = 0 and T = 1 (configs/demo.gin,
#      configs/demo_t1.gin: 100 held-out verses each);
#   3. a γ sweep 1..8 on the demo pair at T = 0 and T = 1
#      (scripts/bench_speculative.py).
#
#   bash scripts/bench_accelerator.sh            # the rows
#   bash scripts/bench_accelerator.sh --smoke    # the same commands at toy sizes (a CPU test)
#
# Workdirs go to $OUT if set (the device machine's output folder), else a
# temporary directory; everything printed is the report.
set -euo pipefail
cd "$(dirname "$0")/.."
smoke=0
if [[ "${1:-}" == "--smoke" ]]; then smoke=1; elif [[ $# -gt 0 ]]; then
  echo "usage: bash scripts/bench_accelerator.sh [--smoke]" >&2; exit 2
fi
work="${OUT:-$(mktemp -d)}/bench_accelerator"
mkdir -p "$work"
python -c "import jax; d = jax.devices()[0]; print(f'# accelerator: {d.device_kind} x {jax.device_count()} ({jax.default_backend()}), jax {jax.__version__}')"

if [[ $smoke == 1 ]]; then
  vk=(--vk-models=demo --vk-ks=1,2 --repeats=1 --vk-inner=1)
  runner=(--gin_bindings="Experiment.num_warmup = 1" --gin_bindings="Experiment.num_examples = 1"
          --gin_bindings="Experiment.cost_repeats = 1")
  sweep=(--gammas=2 --temperatures=0 --num_examples=1 --auto_alpha_examples=0)
else
  vk=(--vk-models=xl --vk-dtype=bfloat16 --vk-ks=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16
      --repeats=5 --vk-inner=8)
  runner=()
  sweep=(--gammas=1,2,3,4,5,6,7,8 --temperatures=0,1 --num_examples=40)
fi

echo "## v(k): $([[ $smoke == 1 ]] && echo 'the demo target (smoke)' || echo 'T5 1.1 XL-sized target, random bfloat16 weights'), batch 1"
python scripts/bench_decode.py --vk "${vk[@]}"
for config in demo demo_t1; do
  echo "## runner: configs/$config.gin"
  python -m specdec_jax.run --config="configs/$config.gin" --workdir="$work/$config" "${runner[@]}"
done
echo "## γ sweep on the demo pair"
python scripts/bench_speculative.py "${sweep[@]}"
