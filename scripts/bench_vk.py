r"""The verification-cost table v(k) (paper §3.4: the target scores γ+1 positions
in one pass, and Theorem 3.8 assumes that pass costs one step): at batch 1, the model's k-token cached ``decode`` at a
mid-sequence position over a cache as long as the runner's
(max_decode_len + γ + 1), relative to k = 1, next to the same ratio for bare
XLA matmuls of the same weights at the same shapes (every decoder kernel a
step multiplies by, chained layer by layer, plus the logits matrix; k rows).
The difference of the two is what the model adds on top of its matmuls
(attention over the cache, cache writes, norms, softmax). Each piece runs
``--vk-inner`` times inside one jitted ``fori_loop`` (the cache carried from
one call to the next as in the decoding loops, positions alternating so
that nothing is loop-invariant), one timed call per piece and repeat,
interleaved; medians. ``--vk-compare FILE`` adds the rows of another
``models/t5.py`` (e.g. ``git show HEAD~1:specdec_jax/models/t5.py``) to the
same interleaving, for a before/after in one process:

  python scripts/bench_vk.py --vk-models demo,small
"""

from __future__ import annotations

import sys
from pathlib import Path

from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab.bench import decode  # noqa: E402


def main() -> None:
  ap = script_args.new_parser(__doc__)
  ap.add_argument("--vk-models", default="demo,small",
                  help="comma list of: " + ", ".join(f"{k} ({v})"
                                                    for k, v in decode.VK_MODELS.items()))
  ap.add_argument("--vk-ks", default="1,2,4,8", help="tokens per decode call (must include 1)")
  ap.add_argument("--vk-cache-len", type=int, default=136,
                  help="self-attention cache length (runner: max_decode_len + gamma + 1)")
  ap.add_argument("--vk-position", type=int, default=64, help="first position written")
  ap.add_argument("--vk-inner", type=int, default=16, help="calls per timed jit call")
  ap.add_argument("--vk-dtype", default="float32", choices=("float32", "bfloat16"),
                  help="weights and activations of the random --vk-models (the demo "
                       "target keeps its checkpoint's float32)")
  ap.add_argument("--vk-compare", default="",
                  help="another models/t5.py whose decode is timed alongside")
  ap.add_argument("--repeats", type=int, default=5, help="timed calls per piece (medians)")
  ap.add_argument("--input-len", type=int, default=64, help="encoder input length")
  decode.vk_report(script_args.parse(ap))


if __name__ == "__main__":
  script_args.run_main(main)
