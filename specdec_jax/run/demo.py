"""The embedded demo pair (``checkpoints/demo/``) and its test split: the
defaults every benchmark script starts from, named once."""

import argparse

TARGET = "checkpoints/demo/target"
# configs/demo.gin's draft: draft_tiny distilled further with an encoder bridge
# (it also reads the target's encoder output, specdec_jax.drafts.bridge) and a feature
# bridge (its decoder reads the target's decoder states, specdec_jax.drafts.feature_bridge).
DRAFT = "checkpoints/demo/draft_tiny_feat"
# The same draft before the bridges: a plain T5, for comparisons that need
# identical weights elsewhere (Hugging Face cannot run the bridges).
PLAIN_DRAFT = "checkpoints/demo/draft_tiny"
# configs/demo.gin's draft vocabulary shortlist (specdec_jax.drafts.shortlist): the
# 1000 most frequent tokens of the training references.
SHORTLIST = "checkpoints/demo/draft_shortlist.json"
VOCAB = "checkpoints/demo/spm.model"
SOURCE = "data/bible/test.tsv"
ALPHA_SOURCE = "data/bible/validation.tsv"   # held out too; for tuning (γ), never for results
TASK = "bible_modernize"


def add_pair_arguments(parser: argparse.ArgumentParser, draft: str = DRAFT) -> None:
  """--target, --draft, --vocab and --source, defaulting to the demo pair on the
  held-out test chapters (``draft``: the --draft default)."""
  parser.add_argument("--target", default=TARGET, help="target (M_p) checkpoint")
  parser.add_argument("--draft", default=draft, help="draft (M_q) checkpoint")
  parser.add_argument("--vocab", default=VOCAB, help="SentencePiece model")
  parser.add_argument("--source", default=SOURCE, help="TSV/JSONL of inputs")


def add_shortlist_argument(parser: argparse.ArgumentParser) -> None:
  """--draft_shortlist; resolve it with ``shortlist_for`` after parsing."""
  parser.add_argument("--draft_shortlist", default=None,
                      help="the draft's vocabulary shortlist (Experiment.draft_shortlist); "
                           f"default: {SHORTLIST} for the default --draft (as configs/demo.gin), "
                           "none for any other; '' for none")


def shortlist_for(args: argparse.Namespace) -> str:
  """The --draft_shortlist to use: as given, or the demo's for the demo draft
  (a T5 draft: --draft_name 't5', where the script has that flag)."""
  if args.draft_shortlist is not None:
    return args.draft_shortlist
  return SHORTLIST if args.draft == DRAFT and getattr(args, "draft_name", "t5") == "t5" else ""
