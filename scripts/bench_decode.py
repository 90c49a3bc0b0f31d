r"""Baseline decode speed vs the memory-bandwidth bound, on this machine.

For T5 1.1 small- and base-sized models with random weights, batch 1, greedy
``temperature_sample`` forced to run ``--steps`` steps (eos_id=-1 never
matches), this prints a markdown table with:

* ms/token end to end: median wall time of one whole call (encoder, cross K/V,
  the decode loop) divided by the number of generated tokens;
* ms/step: the decode loop alone, (end-to-end - prefill) / steps, where
  prefill = median time of a jitted ``encode`` + ``init_cache`` for the same
  input;
* MB/step: bytes of weights one decode step must read (accounting below);
* implied GB/s = MB/step / ms/step, next to the machine's measured memory read
  bandwidth (the fastest read pass of ``lab.bench.common.Bandwidth``, the
  accelerator benchmark's measurement);
* ratio = ms/step / (bytes / bandwidth): 1.0 means the step runs at the speed
  of streaming its weights from memory once. The machine may be shared, so
  each timed decode call is followed by one bandwidth pass (the reader that
  was fastest in the initial measurement) and the ratio is the median of the
  per-pair ratios.

Weight accounting per decode step (batch 1), ``memory.step_weight_bytes``:
every decoder parameter except the cross-attention key/value kernels (their
outputs are computed once per example by ``init_cache``), the logits matrix
included. Encoder weights are excluded. Parameters are float32 in both activation dtypes (the
model keeps params in f32 and casts inside the step), so bytes are the same for
bf16 runs. The KV caches (self and cross, activations) are reported separately
(column "KV MB"), not included in the ratio.

Compile time is excluded: each configuration runs once to compile, then
``--repeats`` timed runs with ``block_until_ready``.

  python scripts/bench_decode.py --sizes small,base \
      --dtypes float32,bfloat16 --steps 64 --repeats 5

The verification-cost table v(k) is ``scripts/bench_vk.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab.bench import decode  # noqa: E402


def main() -> None:
  ap = script_args.new_parser(__doc__)
  ap.add_argument("--sizes", default="small,base", help="comma list of: small, base")
  ap.add_argument("--dtypes", default="float32,bfloat16", help="activation dtypes")
  ap.add_argument("--steps", type=int, default=64, help="generated tokens per call")
  ap.add_argument("--repeats", type=int, default=5, help="timed runs (median reported)")
  ap.add_argument("--input-len", type=int, default=64)
  ap.add_argument("--bandwidth-mb", type=int, default=1024, help="array size for bandwidth")
  decode.ratio_report(script_args.parse(ap))


if __name__ == "__main__":
  script_args.run_main(main)
