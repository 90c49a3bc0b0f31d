#!/usr/bin/env bash
# Reproduces the demo's Table 3-style alpha table (docs/benchmarks.md) with the
# experiment runner: --alpha_only (TOKENS target tokens each, default 5000)
# for bigram (estimated on the train split), prompt lookup (NGRAM_DRAFTS
# overrides; add unigram there) and the T5 drafts, at T=0 and T=1. (The Table
# 4-style table comes from scripts/bench_speculative.py.)
# Usage: bash scripts/demo_alpha_table.sh [OUT_DIR]   (default runs/demo_alpha, relative to
# the working directory; runs from any directory once the package is installed: pip install -e .)
# DRAFTS="dir ..." overrides the T5 drafts measured (e.g. to add undistilled
# ones: their label is "<parent>/<name>"). COMBO_DRAFTS="dir ..." (default
# draft_small; " " for none) adds lookup_t5 rows: prompt lookup on a full
# max-n-gram match, that T5 draft elsewhere. Every row runs without
# demo.gin's vocabulary shortlist, and one more row with it: demo.gin's draft
# as the main command runs it.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the comment above
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT=${1:-runs/demo_alpha}
PY=${PYTHON:-python}
# alpha-only times nothing, so examples are decoded 32 at a time.
run() { "$PY" -m specdec_jax.run --config=configs/demo.gin \
  --gin_bindings="Experiment.draft_shortlist = ''" "$@" \
  --gin_bindings="Experiment.batch_size = ${BATCH:-32}" \
  --gin_bindings="Experiment.alpha_only_tokens = ${TOKENS:-5000}"; }

# One alpha-only row: draft name, checkpoint ('' for none), label, temperature,
# extra bindings.
row() {
  local name=$1 path=$2 label=$3 t=$4; shift 4
  run --alpha_only --workdir="$OUT/alpha/${label//[\/+]/_}_t$t" \
    --gin_bindings="Experiment.draft_name = '$name'" \
    --gin_bindings="Experiment.draft_checkpoint = '$path'" \
    --gin_bindings="Experiment.draft_label = '$label'" \
    --gin_bindings="SamplingConfig.temperature = $t.0" \
    --gin_bindings="Experiment.num_examples = 500" "$@"
}

for t in 0 1; do
  for d in ${NGRAM_DRAFTS:-bigram prompt_lookup}; do
    row "$d" "" "$d" "$t" --gin_bindings="Experiment.ngram_corpus = 'data/bible/train.tsv'"
  done
  T5_DRAFTS="checkpoints/demo/draft_small checkpoints/demo/draft_tiny"
  for path in ${DRAFTS:-$T5_DRAFTS checkpoints/demo/draft_tiny_feat}; do
    row t5 "$path" "$(basename "$(dirname "$path")")/$(basename "$path")" "$t"
  done
  for path in ${COMBO_DRAFTS:-checkpoints/demo/draft_small}; do
    row lookup_t5 "$path" "lookup_t5+$(basename "$path")" "$t"
  done
  if [ -z "${NO_SHORTLIST:-}" ]; then
    row t5 checkpoints/demo/draft_tiny_feat "demo/draft_tiny_feat+shortlist" "$t" \
      --gin_bindings="Experiment.draft_shortlist = 'checkpoints/demo/draft_shortlist.json'"
  fi
done

"$PY" "$HERE/make_tables.py" "$OUT"/alpha/*/summary.json \
  --out "$OUT/tables.md"
cat "$OUT/tables.md"
