r"""Our speculative decoding vs Hugging Face assisted generation, side by side.

  python scripts/bench_vs_hf.py                     # the demo checkpoints
  python scripts/bench_vs_hf.py --target=/tmp/rt --draft=/tmp/rd \
      --num_examples=5 --temperatures=0            # random-weight stand-ins

The same weights (our checkpoints, exported with ``lab.hf_export`` to a
temporary directory and loaded with ``T5ForConditionalGeneration``), the same
held-out inputs and the same maximum number of new tokens, at batch 1. For
every example all methods run back to back (interleaved, so drift on a noisy
machine hits them alike):

  hf_greedy    HF ``generate`` with the target (greedy or sampling)
  hf_assisted  HF assisted generation, ``assistant_model=`` the exported draft,
               a constant γ draft tokens per round (schedule 'constant', the
               confidence-threshold early stop switched off)
  hf_default   (--hf_default) HF assisted generation with HF's own defaults:
               up to 20 draft tokens per round, cut short when the draft's
               probability of its token drops below 0.4 (a threshold HF tunes
               online only when scikit-learn is installed: see the header line)
  hf_asis      (--hf_as_shipped) hf_assisted without the workaround below
  ours_base    ``decoding.temperature_sample``
  ours_spec    ``decoding.speculative_decode`` with the T5 draft, the same γ

HF runs in torch float32 with ``torch.set_num_threads(--torch_threads)``,
``model.eval()`` and ``torch.inference_mode()``; ours are jitted (compiled in
the warm-up examples, which are not timed) and timed to ``block_until_ready``.
HF gets the unpadded input ids (what a HF user passes); ours are padded to the
smallest of --input_buckets that holds them (or to --max_input_len), so that
shapes, and hence the compiled programs, are few and fixed.

Workaround for transformers 5.23 with an encoder-decoder assistant: unless
``generate`` gets a ``decoder_attention_mask``, the assistant's prefill in
each round cannot tell which decoder tokens its cache already holds
(``GenerationMixin._prefill`` slices the new tokens only when the mask length
equals the input length), so it re-feeds the whole decoded prefix on top of
its cache; every draft after the first round then sees a corrupted cache
(outputs stay correct, acceptance drops: fewer tokens per target call). The
hf_assisted / hf_default rows pass ``decoder_attention_mask`` = ones for the
decoder start token, which makes HF crop and slice the assistant's cache
correctly (with the target as its own draft: one target call per γ+1 tokens,
see tests/test_bench_vs_hf.py); hf_asis shows HF as shipped.

At temperature 0 every method must produce the same tokens: the sequences up
to and including EOS are compared with hf_greedy's and mismatches printed.
At temperature 1 HF samples with top_k=0, top_p=1.0 (HF's default top_k=50
would truncate the distribution); outputs then differ by randomness only.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from specdec_jax import data
from specdec_jax.scripting import script_args

from lab import common
from lab.bench.vs_hf import (METHODS, TABLE_HEAD, bench_setting, export_for_hf,
                             load_hf, load_ours, machine_line, setting_table, summary_lines)
from lab.common import parse_input_buckets


def main(argv: Optional[Sequence[str]] = None) -> None:
  p = script_args.new_parser(__doc__)
  # HF cannot run an encoder bridge: the demo's draft before its bridges.
  script_args.add_pair_arguments(p, draft=script_args.PLAIN_DRAFT, task=False)
  p.add_argument("--prefix", default="modernize: ", help="task prefix added to each input")
  p.add_argument("--num_examples", type=int, default=20, help="timed examples")
  p.add_argument("--num_warmup", type=int, default=2, help="untimed examples first")
  p.add_argument("--gamma", type=int, default=2,
                 help="draft tokens per round, ours and HF's constant schedule alike")
  common.add_decoding_arguments(p)
  p.add_argument("--hf_default", type=int, default=1,
                 help="1: also time HF assisted generation with HF's default schedule")
  p.add_argument("--hf_as_shipped", type=int, default=1,
                 help="1: also time HF assisted generation without the cache workaround")
  p.add_argument("--torch_threads", type=int, default=2)
  p.add_argument("--hf_dir", default=None,
                 help="where to export the HF copies (default: a temporary directory)")
  p.add_argument("--markdown_out", default=None, help="also write the table here")
  script_args.add_shortlist_argument(
      p, demo_default=False,
      note=f"e.g. {script_args.SHORTLIST}; Hugging Face's draft keeps the full vocabulary")
  args = script_args.parse(p, argv)

  ours, tp, tcfg, dp, dcfg = load_ours(args.target, args.draft, args.draft_shortlist)
  vocab = data.SentencePieceVocab(args.vocab)
  examples = data.load_local(args.source)[:args.num_warmup + args.num_examples]
  if len(examples) <= args.num_warmup:
    raise SystemExit(f"{args.source}: only {len(examples)} examples")
  inputs, truncated = data.encode_batch(vocab, [e.input for e in examples], args.max_input_len,
                                        prefix=args.prefix)
  ids = [e.id for e in examples]

  tmp = None
  hf_root = args.hf_dir
  if hf_root is None:
    tmp = tempfile.TemporaryDirectory(prefix="bench_vs_hf_")
    hf_root = tmp.name
  try:
    hf_target = load_hf(export_for_hf(tp, tcfg, os.path.join(hf_root, "target")),
                        args.torch_threads)
    hf_draft = load_hf(export_for_hf(dp, dcfg, os.path.join(hf_root, "draft")),
                       args.torch_threads)
  finally:
    if tmp is not None:
      tmp.cleanup()  # weights are in memory now

  methods = [m for m in METHODS if (m != "hf_default" or args.hf_default)
             and (m != "hf_asis" or args.hf_as_shipped)]
  cmd = "python scripts/bench_vs_hf.py " + " ".join(sys.argv[1:] if argv is None else argv)
  print(f"# {cmd}")
  machine = machine_line()  # load average at the start of the run
  print(f"# {machine}")
  print(f"# target={args.target} draft={args.draft} shortlist={args.draft_shortlist or 'none'} "
        f"γ={args.gamma} max_decode_len="
        f"{args.max_decode_len} input_buckets={args.input_buckets} examples={args.num_examples} "
        f"(+{args.num_warmup} warm-up) "
        f"truncated inputs={truncated}")
  settings = []
  buckets = parse_input_buckets(args.input_buckets, args.max_input_len)
  for temp in script_args.comma_list(args.temperatures, float):
    settings.append(bench_setting(ours, hf_target, hf_draft, inputs, ids, temperature=temp,
                                  gamma=args.gamma, max_decode_len=args.max_decode_len,
                                  num_warmup=args.num_warmup, seed=args.seed, methods=methods,
                                  input_buckets=buckets))
  lines = [script_args.markdown_header(TABLE_HEAD)]
  for s in settings:
    lines += setting_table(s)
  lines += [""] + summary_lines(settings)
  text = "\n".join(lines)
  print(text)
  if args.markdown_out:
    Path(args.markdown_out).write_text(f"`{cmd}`\n\n{machine}\n\n{text}\n")
