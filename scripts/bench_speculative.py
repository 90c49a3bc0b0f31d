r"""Speculative decoding vs the baseline at several γ, side by side in one run.

  python scripts/bench_speculative.py                       # the demo pair
  python scripts/bench_speculative.py --target=... --draft=... --source=... \
      --gammas=1,2,3,5,7 --temperatures=0,1 --num_examples=20

For every example the baseline and each γ are timed back to back (interleaved,
so drift on a noisy machine hits all columns alike); compile time is excluded
(one warm-up example); every call ends in ``block_until_ready``; the table
reports totals (tokens / total seconds), which is the median-robust choice for
variable-length outputs, plus the median per-example speedup.

Columns: tokens/s of each; speedup; measured α (both estimators); tokens per
target call; c (draft time per token / target step); v (target pass over γ+1
tokens / target step); the prediction of Theorem 3.8 generalized by v,
(1 - α^(γ+1)) / ((1 - α)(γc + v)); and measured / predicted (the engine's
overhead: 1.0 means none).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec_jax import theory  # noqa: E402
from specdec_jax.decoding import speculative_decode, temperature_sample  # noqa: E402
from specdec_jax.run import Experiment, prepare  # noqa: E402
from specdec_jax.sampling import SamplingConfig  # noqa: E402
from specdec_jax.timing import block, measure_costs  # noqa: E402


def _timed(fn):
  t0 = time.perf_counter()
  out = block(fn())
  return out, time.perf_counter() - t0


def bench(args) -> str:
  gammas = [int(g) for g in args.gammas.split(",")]
  temps = [float(t) for t in args.temperatures.split(",")]
  exp = Experiment(task=args.task, source=args.source, vocab_path=args.vocab,
                   target_checkpoint=args.target, draft_name=args.draft_name,
                   draft_checkpoint=args.draft, max_input_len=args.max_input_len,
                   max_decode_len=args.max_decode_len, num_warmup=1,
                   num_examples=args.num_examples, dtype=args.dtype, gamma=max(gammas),
                   ngram_corpus=args.ngram_corpus)
  setup = prepare(exp)
  target, tp, draft = setup.target, setup.target_params, setup.draft
  eos = target.config.eos_id
  rows = []
  for temp in temps:
    sampling = SamplingConfig(temperature=temp)
    kw = dict(max_decode_len=exp.max_decode_len, sampling=sampling, eos_id=eos)
    base = lambda x, k: temperature_sample(target, tp, x, k, **kw)
    spec = {g: (lambda x, k, g=g: speculative_decode(target, tp, draft, x, k, gamma=g, **kw))
            for g in gammas}
    x0 = setup.inputs[:1]
    block(base(x0, jax.random.PRNGKey(0)))
    for g in gammas:
      block(spec[g](x0, jax.random.PRNGKey(0)))
    costs = {g: measure_costs(target, tp, draft, x0, g, sampling) for g in gammas}
    acc = {g: dict(s=0.0, tok=0, acc=0, rej=0, mpq=0.0, calls=0, ratios=[]) for g in gammas}
    b_s, b_tok = 0.0, 0
    for i in range(1, len(setup.examples)):
      x = setup.inputs[i:i + 1]
      key = jax.random.fold_in(jax.random.PRNGKey(args.seed), i)
      out, t = _timed(lambda: base(x, key))
      b_s += t
      b_tok += int(out.length[0])
      base_rate = int(out.length[0]) / t
      for g in gammas:
        o, ts = _timed(lambda: spec[g](x, key))
        a = acc[g]
        a["s"] += ts
        a["tok"] += int(o.length[0])
        a["acc"] += int(o.stats.accepted[0])
        a["rej"] += int(o.stats.rejected[0])
        a["mpq"] += float(o.stats.min_pq_sum[0])
        a["calls"] += int(o.stats.target_calls[0])
        a["ratios"].append((int(o.length[0]) / ts) / base_rate)
    for g in gammas:
      a, c = acc[g], costs[g]
      ev = max(a["acc"] + a["rej"], 1)
      alpha = a["acc"] / ev
      base_tps, spec_tps = b_tok / b_s, a["tok"] / a["s"]
      pred = float(theory.walltime_improvement(min(alpha, 0.999999), g, c.c, c.v))
      pred1 = float(theory.walltime_improvement(min(alpha, 0.999999), g, c.c))
      rows.append((temp, g, base_tps, spec_tps, spec_tps / base_tps,
                   statistics.median(a["ratios"]), alpha, a["mpq"] / ev, a["tok"] / a["calls"],
                   c.c, c.v, pred1, pred, (spec_tps / base_tps) / pred))
  head = ("| temp | γ | baseline tok/s | speculative tok/s | speedup | median per-example | "
          "α | α (Σmin(p,q)) | tokens/target call | c | v | EXP (Thm 3.8) | EXP (with v) | "
          "measured / EXP(v) |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    lines.append("| {:g} | {} | {:.1f} | {:.1f} | {:.2f}x | {:.2f}x | {:.3f} | {:.3f} | {:.2f} | "
                 "{:.3f} | {:.2f} | {:.2f}x | {:.2f}x | {:.2f} |".format(*r))
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="checkpoints/demo/target")
  p.add_argument("--draft", default="checkpoints/demo/draft_small")
  p.add_argument("--draft_name", default="t5")
  p.add_argument("--ngram_corpus", default=None)
  p.add_argument("--vocab", default="checkpoints/demo/spm.model")
  p.add_argument("--source", default="data/bible/test.tsv")
  p.add_argument("--task", default="bible_modernize")
  p.add_argument("--gammas", default="1,2,3,5,7")
  p.add_argument("--temperatures", default="0,1")
  p.add_argument("--num_examples", type=int, default=20)
  p.add_argument("--max_input_len", type=int, default=128)
  p.add_argument("--max_decode_len", type=int, default=128)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  print(f"# bench_speculative: target={args.target} draft={args.draft_name}:{args.draft} "
        f"examples={args.num_examples} device={jax.devices()[0].device_kind} "
        f"backend={jax.default_backend()}")
  print(bench(args))


if __name__ == "__main__":
  main()
