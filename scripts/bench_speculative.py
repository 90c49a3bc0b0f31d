r"""Speculative decoding vs the baseline at several γ, side by side in one run.

  python scripts/bench_speculative.py                       # the demo pair
  python scripts/bench_speculative.py --target=... --draft=... --source=... \
      --gammas=1,2,3,5,7,auto --temperatures=0,1 --num_examples=20
  python scripts/bench_speculative.py --gammas=1,2,3,4,5,6,7,auto --adaptive --gamma_max=7
  python scripts/bench_speculative.py --gammas=3,5 --gamma_max=7 \
      --adaptive_rule=threshold,cumulative --adaptive_threshold=0.6,0.5 --adaptive_skip_below=0.3
  python scripts/bench_speculative.py --gammas=3,4 --drafts_name=t5,t5,prompt_lookup \
      --drafts_checkpoint=checkpoints/demo/draft_small,checkpoints/demo/draft_tiny,
  python scripts/bench_speculative.py --gammas=3 --drafts_name=t5 --drafts_label=full,sl \
      --drafts_checkpoint=checkpoints/demo/draft_tiny_feat \
      --drafts_shortlist=,checkpoints/demo/draft_shortlist.json

For every example the baseline and each γ are timed back to back (interleaved,
so drift on a noisy machine hits all columns alike); compile time is excluded
(one warm-up example); every call ends in ``block_until_ready``; the table
reports totals (tokens / total seconds) and the median per-example speedup.
``--drafts_<field>`` (``lab.sweep.DraftRow``'s fields, one value per draft
or one for all) compares several approximation models the same way: all of
them, every γ, interleaved per example beside one baseline, in place of
--draft/--draft_name. Every draft x setting x input bucket is its own
compiled loop, dropped only after each temperature: many of them can exhaust
the process's memory maps (vm.max_map_count); compare drafts on a few
settings, or with --input_buckets=none. Adaptive settings
(``AdaptiveConfig``, γ_max = ``--gamma_max``) are its fields as flags,
``--adaptive_<field>``, each with one value per setting or one for all.
The measuring loop lives in ``lab.sweep``.

Columns: tokens/s of each; speedup; measured α (both estimators); tokens per
target call; c (draft time per token / target step); v (target pass over γ+1
tokens / target step); the prediction of Theorem 3.8 generalized by v,
(1 - α^(γ+1)) / ((1 - α)(γc + v)); and measured / predicted (the engine's
overhead: 1.0 means none).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

from specdec_jax import drafts
from specdec_jax.decoding import AdaptiveConfig
from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab import common, sweep  # noqa: E402


def parser() -> argparse.ArgumentParser:
  """The script's flags."""
  p = script_args.new_parser(__doc__)
  script_args.add_pair_arguments(p)
  p.add_argument("--draft_name", default="t5",
                 help=f"the approximation model (registered: {', '.join(sorted(drafts.REGISTRY))})")
  script_args.add_shortlist_argument(p)
  sweep.many_flags(p, sweep.DraftRow, prefix="drafts_")
  p.add_argument("--ngram_corpus", default=None,
                 help="training data of the n-gram drafts (Experiment.ngram_corpus)")
  common.add_decoding_arguments(
      p, gammas="1,2,3,5,7,auto",
      gammas_help="'auto' adds the row of the γ chosen by specdec_jax.run.autogamma (§3.5 "
                  "with measured c and v); adaptive settings: the --adaptive_<field> flags")
  p.add_argument("--gamma_max", type=int, default=8,
                 help="largest γ 'auto' considers; γ_max of the adaptive settings")
  p.add_argument("--auto_alpha_source", default=script_args.ALPHA_SOURCE,
                 help="examples 'auto' estimates α on (held out from --source: the demo's "
                      "validation chapters)")
  p.add_argument("--auto_alpha_examples", type=int, default=32,
                 help="how many of them; 0: the warm-up example alone")
  p.add_argument("--adaptive", action="store_true",
                 help="six adaptive settings, as if given by their flags: "
                      + "; ".join(f"--adaptive_{k}={v}" for k, v in sweep.ADAPTIVE_PRESET.items()))
  sweep.many_flags(p, AdaptiveConfig, prefix="adaptive_", skip=("widths",))
  p.add_argument("--adaptive_widths", default="all",
                 help="verification widths the adaptive settings compile: 'all' (1..γ_max: "
                      "a round verifies exactly its longest proposal, what batch 1 wants "
                      "where v(k) grows with k, as on a CPU), 'default' (powers of two and "
                      "γ_max: fewer compilations), or a list such as 1,2,4,7 "
                      "(AdaptiveConfig.widths)")
  p.add_argument("--num_examples", type=int, default=20, help="timed examples")
  p.add_argument("--dtype", default="float32", help="activation dtype")
  return p


def main(argv: list[str] | None = None) -> None:
  args = script_args.parse(parser(), argv, paths=("auto_alpha_source", "ngram_corpus"))
  who = (f"drafts={args.drafts_name}:{args.drafts_checkpoint}" if args.drafts_name
         else f"draft={args.draft_name}:{args.draft}")
  print(f"# bench_speculative: target={args.target} {who} "
        f"examples={args.num_examples} device={jax.devices()[0].device_kind} "
        f"backend={jax.default_backend()}")
  print(sweep.report(args))


if __name__ == "__main__":
  script_args.run_main(main)
