#!/usr/bin/env bash
# The wheels scripts/bench_accelerator.sh installs on a GPU machine that
# reaches no package index: a transformers whose assisted generation works
# (the GPU image's 5.17 fails in it: a TypeError cropping an unfilled
# assistant cache layer; 5.24 works), what 5.24 needs beyond what 5.17's
# environment has (huggingface-hub >= 1.31 where 5.17 needed >= 1.5, and
# that hub's click >= 8.4.2 and hf-xet >= 1.5.2), and gin-config (the
# runner's configs). About 19 MB, under the device tool's 64 MiB carry.
#
#   bash scripts/fetch_bench_wheels.sh [DIR]   # default: wheels/ (gitignored)
#
# Then carry DIR to the device machine (the device tool's carry: ["wheels"]).
# Pure-Python wheels but hf-xet's, which is for Linux x86_64 (where it does
# not fit, bench_accelerator.sh installs the others without it).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-wheels}"
mkdir -p "$dir"
pip=(python -m pip download --disable-pip-version-check --no-deps --dest "$dir")
"${pip[@]}" transformers==5.24.0 huggingface-hub==1.31.0 click==8.5.1 gin-config==0.5.0
"${pip[@]}" --only-binary=:all: --platform manylinux_2_17_x86_64 --python-version 3.12 \
  hf-xet==1.8.0
ls -l "$dir"
du -sh "$dir"
