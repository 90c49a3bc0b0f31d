"""The embedded demo pair (``checkpoints/demo/``) and its test split: the
defaults every benchmark script starts from, named once."""

import argparse

TARGET = "checkpoints/demo/target"
DRAFT = "checkpoints/demo/draft_tiny"   # configs/demo.gin's draft: the faster one here
VOCAB = "checkpoints/demo/spm.model"
SOURCE = "data/bible/test.tsv"
ALPHA_SOURCE = "data/bible/validation.tsv"   # held out too; for tuning (γ), never for results
TASK = "bible_modernize"


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
  """--target, --draft, --vocab and --source, defaulting to the demo pair on the
  held-out test chapters."""
  parser.add_argument("--target", default=TARGET, help="target (M_p) checkpoint")
  parser.add_argument("--draft", default=DRAFT, help="draft (M_q) checkpoint")
  parser.add_argument("--vocab", default=VOCAB, help="SentencePiece model")
  parser.add_argument("--source", default=SOURCE, help="TSV/JSONL of inputs")
