"""Beam search against speculative beam search (paper Appendix A.4) on one pair.

Loads the pair and the examples of a runner config (default: the demo pair,
``configs/demo_beam.gin``), compiles beam search and speculative beam search
at every (u, γ) of the sweep for every input width, then per example times
the baseline and every setting in turn (interleaved, so that load on the
machine falls on all alike) and checks that every beam and the step count
equal the baseline's. Prints a markdown table and writes the numbers as JSON.

The cost model's prediction prices a round with the round-cost model
(``dryrun.costs.RoundCost``) on a roofline per pass (weights and caches read
once per call, 2 flops per weight per position; no launch or per-op cost):
a baseline step is a target call over w beams, a round γ draft calls over u
beams and one target pass over w + uγ nodes. A draft that cannot run beam
search (``--gin_bindings "Experiment.draft_name = 'prompt_lookup'"``, or a
shortlist) proposes each beam's greedy chain: u = w whatever the sweep says,
and a draft without a T5 model is priced at no cost. Run from the repository
root:

  python lab/bench_beam.py --num_examples 100 --sweep 4:1,4:2,8:2 --out /tmp/beam.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec_jax import beam  # noqa: E402
from specdec_jax.dryrun.chips import CHIPS  # noqa: E402
from specdec_jax.dryrun.costs import RoundCost  # noqa: E402
from specdec_jax.run import beam_run  # noqa: E402
from specdec_jax.run.cli import parse_config  # noqa: E402
from specdec_jax.run.programs import pad_batch  # noqa: E402
from specdec_jax.run.setup import load_data, load_models  # noqa: E402
from specdec_jax.timing import timed  # noqa: E402

from lab import common  # noqa: E402

# One H200 (SXM): NVIDIA's published figures, dense bfloat16 and HBM3e.
H200 = dict(name="H200", peak_flops=989e12, hbm_bandwidth=4.8e12,
            source="https://www.nvidia.com/en-us/data-center/h200/")


def pass_seconds(cfg, chip: dict, positions: int, rows: int, cache_len: int,
                 input_len: int) -> float:
  """Roofline seconds of one decoder call scoring ``positions`` positions over
  ``rows`` cache rows of ``cache_len`` slots (bfloat16 weights and caches)."""
  nbytes = common.step_bytes(cfg, None, "bfloat16", "bfloat16", rows, input_len, cache_len)
  flops = 2.0 * common.step_params(cfg) * positions
  return max(flops / chip["peak_flops"], nbytes / chip["hbm_bandwidth"])


def predicted_speedup(target_cfg, draft_cfg, chip: dict, w: int, u: int, gamma: int,
                      steps_per_round: float, max_len: int, input_len: int) -> float:
  """Speedup of speculative beam search over beam search on ``chip`` at the
  measured steps per round, by ``RoundCost``: a round is γ draft calls and
  one target pass over w + uγ nodes; a beam step one target call over w."""
  region = max_len + u * gamma + 1
  step_s = pass_seconds(target_cfg, chip, w, w, max_len, input_len)
  draft_s = 0.0 if draft_cfg is None else pass_seconds(draft_cfg, chip, u, 1, w * region,
                                                        input_len)
  nodes = w + u * gamma
  pass_s = pass_seconds(target_cfg, chip, nodes, 1, w * region, input_len)
  cost = RoundCost(nodes - 1, draft_s / step_s, pass_s / step_s, draft_calls=gamma)
  return float(cost.speedup(steps_per_round))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="configs/demo_beam.gin")
  ap.add_argument("--num_examples", type=int, default=100)
  ap.add_argument("--sweep", default="4:1,4:2,8:1,8:2,16:2",
                  help="draft beam widths and draft steps, u:gamma,...")
  ap.add_argument("--out", default="", help="JSON file for the numbers")
  ap.add_argument("--gin_bindings", action="append", default=[],
                  help="extra bindings, e.g. \"Experiment.draft_checkpoint = '...'\"")
  args = ap.parse_args()
  exp = parse_config([args.config], [f"Experiment.num_examples = {args.num_examples}"]
                     + args.gin_bindings)
  exp.validate()
  d = load_data(exp)
  setup = load_models(exp, d)
  target, tparams = setup.target, setup.target_params
  dmodel, dparams = beam_run.draft_model(setup)
  w, m = exp.beam_size, exp.max_decode_len
  sweep = [tuple(int(v) for v in s.split(":")) for s in args.sweep.split(",")]
  if dparams is None:  # greedy chains, one per beam: u = w
    sweep = sorted({(w, g) for _, g in sweep})
  dcfg = getattr(getattr(dmodel, "model", dmodel), "config", None)
  kw = dict(beam_size=w, alpha=exp.beam_alpha, max_decode_len=m, eos_id=target.config.eos_id)
  base_fn = lambda x: beam.beam_search(target, tparams, x, **kw)
  spec_fns = {(u, g): (lambda x, u=u, g=g: beam.speculative_beam_search(
      target, tparams, dmodel, dparams, x, draft_beam_size=u, gamma=g, **kw)) for u, g in sweep}
  todo = list(range(exp.num_warmup, len(setup.examples)))
  batches = [pad_batch(setup.inputs, [i], 1, exp.input_buckets) for i in todo]
  widths = {}
  for x in batches:
    widths.setdefault(x.shape[1], x)
  t0 = time.perf_counter()
  for x in widths.values():
    jax.block_until_ready([base_fn(x)] + [f(x) for f in spec_fns.values()])
  print(f"compiled {1 + len(sweep)} programs for {len(widths)} widths in "
        f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
  base_s, steps = [], []
  rec = {k: dict(s=[], rounds=[], same=0, diff=0.0, hist=None) for k in spec_fns}
  for n, x in enumerate(batches):
    want, t = timed(lambda: base_fn(x))
    want = jax.tree.map(np.asarray, want)
    base_s.append(t)
    steps.append(int(want.steps[0]))
    for k, f in spec_fns.items():
      (out, st), t = timed(lambda: f(x))
      out, st = jax.tree.map(np.asarray, (out, st))
      r = rec[k]
      r["s"].append(t)
      r["rounds"].append(int(st.rounds[0]))
      r["same"] += int(np.array_equal(out.sequences, want.sequences)
                       and np.array_equal(out.steps, want.steps))
      r["diff"] = max(r["diff"], float(np.max(np.abs(out.scores - want.scores))))
      r["hist"] = st.steps_per_round[0] if r["hist"] is None else r["hist"] + st.steps_per_round[0]
    print(f"[{n + 1}/{len(batches)}]", file=sys.stderr, flush=True)
  total_steps = sum(steps)
  input_len = max(widths)
  rows = []
  for (u, g), r in rec.items():
    calls = sum(r["rounds"])
    spr = total_steps / calls
    rows.append(dict(
        u=u, gamma=g, examples=len(batches), identical=r["same"], max_score_diff=r["diff"],
        beam_steps=total_steps, target_calls=calls, target_calls_per_step=calls / total_steps,
        steps_per_round=spr, steps_per_round_histogram=[int(v) for v in r["hist"]],
        baseline_s=float(sum(base_s)), speculative_s=float(sum(r["s"])),
        speedup=float(sum(base_s) / sum(r["s"])),
        predicted_v4=predicted_speedup(target.config, dcfg, vars(CHIPS["v4"]), w, u, g, spr, m,
                                       input_len),
        predicted_h200=predicted_speedup(target.config, dcfg, H200, w, u, g, spr, m,
                                         input_len)))
  head = (f"draft {exp.labels[1]}, w = {w}, alpha = {exp.beam_alpha}, {len(batches)} examples, "
          f"{platform.processor() or platform.machine()}, jax {jax.__version__}, "
          f"{jax.devices()[0].platform}")
  print(head)
  print("| u | γ | identical (all beams) | target calls per beam step | steps per round "
        "(histogram 0..γ+1) | baseline s | speculative s | speedup | predicted: one TPU v4 | "
        "predicted: one H200 |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['u']} | {r['gamma']} | {r['identical']}/{r['examples']} | "
          f"{r['target_calls_per_step']:.3f} | {r['steps_per_round']:.2f} "
          f"({', '.join(map(str, r['steps_per_round_histogram']))}) | {r['baseline_s']:.1f} | "
          f"{r['speculative_s']:.1f} | {r['speedup']:.2f}x | {r['predicted_v4']:.2f}x | "
          f"{r['predicted_h200']:.2f}x |")
  if args.out:
    Path(args.out).write_text(json.dumps(dict(setting=head, rows=rows), indent=1))


if __name__ == "__main__":
  main()
