"""Write a draft vocabulary shortlist (thin wrapper over specdec_jax.drafts.shortlist).

  python scripts/make_shortlist.py --source=data/bible/train.tsv \\
      --vocab=checkpoints/demo/spm.model --size=2000 --output=checkpoints/demo/draft_shortlist.json

--source: training data only (never the split you will measure on): a TSV/JSONL
of examples or ``seqio:<task>`` with --split (their references are counted), or
a distillation's target_outputs.jsonl (the target's own outputs). Use it with
``Experiment.draft_shortlist``. --output is relative to the working directory.
For WMT EnDe and a T5 vocabulary (the seqio extra: pip install -e ".[seqio]"):

  python scripts/make_shortlist.py --source=seqio:specdec_wmt_ende --split=train \
      --max_examples=200000 --vocab=/path/to/cc_all.32000/sentencepiece.model \
      --vocab_extra_ids=100 --size=4000 --output=ckpts/ende_shortlist.json
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from specdec_jax import data
from specdec_jax.drafts import shortlist
from specdec_jax.scripting import script_args


def main(argv: Optional[Sequence[str]] = None) -> None:
  p = script_args.new_parser(__doc__)
  p.add_argument("--source", required=True,
                 help="TSV/JSONL of examples, seqio:<task>, or target outputs (JSONL); "
                      "relative: the working directory, else the repository root")
  p.add_argument("--split", default="train", help="the seqio split (seqio sources only)")
  p.add_argument("--max_examples", type=int, default=None, help="examples to count (default: all)")
  p.add_argument("--vocab", required=True,
                 help="the target's SentencePiece model (found as --source is)")
  p.add_argument("--vocab_extra_ids", type=int, default=0, help="as Experiment.vocab_extra_ids")
  p.add_argument("--size", type=int, required=True, help="tokens in the shortlist (EOS included)")
  p.add_argument("--output", required=True, help="JSON file to write")
  p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
  args = script_args.parse(p, argv)
  if args.size < 1:
    p.error(f"--size must be >= 1, got {args.size}")
  if os.path.exists(args.output) and not args.overwrite:
    p.error(f"--output {args.output} exists; pass --overwrite to replace it")
  if not args.source.startswith("seqio:") and not os.path.isfile(args.source):
    p.error(f"--source {args.source} not found")
  vocab = data.get_vocabulary(args.vocab, args.vocab_extra_ids)
  seqs = list(shortlist.sequences_from(args.source, vocab, args.split, args.max_examples))
  ids = shortlist.frequent(seqs, args.size, vocab.vocab_size, always=(vocab.eos_id,))
  counted = sum(len(s) for s in seqs)
  kept = set(ids.tolist())
  covered = sum(t in kept for s in seqs for t in s) / max(counted, 1)
  shortlist.save(args.output, ids, vocab.vocab_size, source=args.source,
                 split=args.split if args.source.startswith("seqio:") else None, vocab=args.vocab,
                 sequences=len(seqs), tokens_counted=counted, coverage_of_source=covered)
  print(f"wrote {args.output}: {ids.size} tokens covering {covered:.4f} of the {counted} "
        f"tokens in {len(seqs)} sequences of {args.source}")


if __name__ == "__main__":
  script_args.run_main(main)
