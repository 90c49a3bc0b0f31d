"""What the studies share besides ``timing``'s loop (``timing.repeat``) and
interleaving (``timing.interleaved_times``): picking one of two stacked input
sets inside a timed loop, so that no input is loop-invariant (every study
times a piece of Algorithm 1's round, paper §2.3, this way), and the flags and
set-up of the scripts that run a study on a pair of models."""

from __future__ import annotations

import argparse
from typing import Any

import jax

from specdec_jax.run import Experiment, Setup, prepare
from specdec_jax.scripting import script_args

Array = jax.Array


def pick(stack: Any, i: Array) -> Any:
  """Element i % 2 of a pytree of arrays stacked on a leading axis of 2."""
  return jax.tree_util.tree_map(lambda a: a[i % 2], stack)


def study_parser(doc: str, gammas: str = "1,3,5") -> argparse.ArgumentParser:
  """The flags every study of a round shares: the pair (``script_args``'s demo
  defaults), its shortlist, --gammas, --temperatures, the decode lengths,
  --num_examples, --repeats, --inner and --position."""
  p = script_args.new_parser(doc)
  script_args.add_pair_arguments(p)
  script_args.add_shortlist_argument(p)
  script_args.add_decoding_arguments(p, gammas=gammas, input_buckets=False, seed=False)
  p.add_argument("--num_examples", type=int, default=8, help="examples (the first warms up)")
  p.add_argument("--repeats", type=int, default=5, help="interleaved passes (medians)")
  p.add_argument("--inner", type=int, default=8, help="runs of a piece per timed call")
  p.add_argument("--position", type=int, default=32, help="decoder position of the pieces")
  return p


def prepare_pair(args: argparse.Namespace) -> tuple[Experiment, Setup]:
  """The experiment of a ``study_parser``'s flags (a T5 draft, γ = max of
  --gammas, the first example a warm-up) and its loaded models and inputs."""
  exp = Experiment(task=args.task, source=args.source, vocab_path=args.vocab,
                   target_checkpoint=args.target, draft_name="t5", draft_checkpoint=args.draft,
                   draft_shortlist=args.draft_shortlist, max_input_len=args.max_input_len,
                   max_decode_len=args.max_decode_len, num_warmup=1,
                   num_examples=args.num_examples,
                   gamma=max(script_args.comma_list(args.gammas, int)))
  return exp, prepare(exp)
