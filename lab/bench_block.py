"""The block draft against the autoregressive draft, side by side in one run.

On the demo pair (checkpoints/demo/), at T = 0 and T = 1, each loop decodes
the same test verses at batch 1 beside the baseline (``temperature_sample``):

* ``ar chain``: the autoregressive draft (``--ar_draft``, γ ``--ar_gamma``),
* ``block chain``: the block draft (``--block_draft``, γ ``--block_gamma``),
* ``block tree``: the block draft's token tree (``--block_tree``), one call a round.

Per loop: acceptance by position α_i (given 1..i−1 accepted; a tree's by
depth), tokens per target call, the draft's milliseconds per round (its
proposal timed alone), the measured speedup over the baseline and the theory's
tokens per round 1 + Σ_i Π_{j≤i} α_j. Then the block proposal's cost in draft
steps at γ 3..8 (one call over γ + 1 catch-up and γ − 1 mask positions, over
one cached one-token step of the same network), and the cost model's
PREDICTION for the paper's Table 2 EnDe T = 0 rows on one TPU v4 chip and one
H200, with the demo's per-position acceptance ratio block/autoregressive
applied to the paper's α (c: Table 4's on a TPU v4 chip, ``--h200_c`` on an
H200; v = 1, the paper's accounting).

  python lab/bench_block.py --num_examples=30            # from the repository root
  python lab/bench_block.py --json=runs/bench_block.json  # also the numbers as JSON

Timings on a shared CPU are inflated and noisy; every loop of one
temperature runs interleaved with its baseline, example by example.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specdec_jax import checkpoints, data, drafts, paper, theory  # noqa: E402
from specdec_jax.decoding import (speculative_decode, temperature_sample,  # noqa: E402
                                  tree_speculative_decode)
from specdec_jax.drafts import bridge as bridge_lib  # noqa: E402
from specdec_jax.drafts import feature_bridge as feature_lib  # noqa: E402
from specdec_jax.drafts import t5_block  # noqa: E402
from specdec_jax.models.t5 import T5Model  # noqa: E402
from specdec_jax.sampling import SamplingConfig  # noqa: E402
from specdec_jax.tree import TreeShape  # noqa: E402

WIDTH = 96          # every verse padded to one input width: one compile per loop


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--target", default="checkpoints/demo/target")
  p.add_argument("--ar_draft", default="checkpoints/demo/draft_tiny_feat")
  p.add_argument("--block_draft", default="checkpoints/demo/draft_tiny_block")
  p.add_argument("--ar_gamma", type=int, default=3)
  p.add_argument("--block_gamma", type=int, default=6)
  p.add_argument("--block_tree", default="full:2,2,1,1")
  p.add_argument("--source", default="data/bible/test.tsv")
  p.add_argument("--num_examples", type=int, default=30)
  p.add_argument("--max_decode_len", type=int, default=128)
  p.add_argument("--temperatures", default="0,1")
  p.add_argument("--cost_gammas", default="3,4,5,6,7,8")
  p.add_argument("--repeats", type=int, default=15)
  p.add_argument("--h200_c", type=float, default=0.517 / 4.054,
                 help="a T5-small-sized draft step over a T5-XXL-sized target step on one "
                      "H200 (docs/benchmarks.md: 0.517 ms / 4.054 ms); one TPU v4 chip: the "
                      "paper's Table 4 c of each row's draft")
  p.add_argument("--json", default=None, help="also write the numbers to this file")
  return p.parse_args(argv)


def path(p: str) -> str:
  return p if os.path.isabs(p) else os.path.join(REPO, p)


def load_draft(where: str, target: T5Model, target_params: Any, block: bool) -> Any:
  """A draft checkpoint with whatever bridges it has, as ``t5`` or ``t5_block``."""
  params, config = checkpoints.load_checkpoint(path(where))
  model = T5Model(config)
  kw: dict = dict(model=model, params=params)
  kernel = bridge_lib.load(path(where))
  features = feature_lib.load(path(where))
  if kernel is not None or features is not None:
    kw.update(target_model=target, target_params=target_params)
  if kernel is not None:
    kw["bridge"] = jnp.asarray(kernel)
  if features is not None:
    kw["feature"] = jax.tree.map(jnp.asarray, features)
  if block:
    kw["block"] = t5_block.load(path(where))
  return drafts.build("t5_block" if block else "t5", **kw)


def encode_inputs(source: str, n: int) -> list[np.ndarray]:
  vocab = data.get_vocabulary(path("checkpoints/demo/spm.model"))
  out = []
  for e in data.load_examples(path(source), max_examples=4 * n):
    ids = vocab.encode(data.PREFIXES["bible_modernize"] + e.input) + [vocab.eos_id]
    if len(ids) <= WIDTH:
      out.append(np.pad(np.asarray(ids, np.int32), (0, WIDTH - len(ids)))[None])
    if len(out) == n:
      break
  return out


def by_position(stats: Any, tree: bool) -> list[float]:
  """α_i over all examples' stats (chain: accepted_at / evaluated_at; tree:
  from the depth histogram)."""
  if tree:
    hist = np.sum([np.asarray(s.depth_hist).sum(0) for s in stats], 0).astype(float)
    reached = np.cumsum(hist[::-1])[::-1]
    return [float(reached[d] / reached[d - 1]) if reached[d - 1] else float("nan")
            for d in range(1, len(hist))]
  acc = np.sum([np.asarray(s.accepted_at).sum(0) for s in stats], 0).astype(float)
  ev = np.sum([np.asarray(s.evaluated_at).sum(0) for s in stats], 0).astype(float)
  return [float(a / e) if e else float("nan") for a, e in zip(acc, ev)]


def timed(fn, *args) -> tuple[float, Any]:
  t = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return time.perf_counter() - t, out


def run_loops(args, target, tparams, loops: dict, inputs, sampling) -> dict:
  """Each loop and the baseline over the verses, interleaved example by example."""
  eos = target.config.eos_id
  key = jax.random.PRNGKey(0)
  base = jax.jit(lambda x, k: temperature_sample(target, tparams, x, k,
                                                 max_decode_len=args.max_decode_len,
                                                 sampling=sampling, eos_id=eos))
  fns = {"baseline": base}
  for name, (draft, kind, shape) in loops.items():
    if kind == "tree":
      fns[name] = jax.jit(lambda x, k, d=draft, t=shape: tree_speculative_decode(
          target, tparams, d, x, k, tree=t, max_decode_len=args.max_decode_len,
          sampling=sampling, eos_id=eos))
    else:
      fns[name] = jax.jit(lambda x, k, d=draft, g=shape: speculative_decode(
          target, tparams, d, x, k, gamma=g, max_decode_len=args.max_decode_len,
          sampling=sampling, eos_id=eos))
  for fn in fns.values():  # compile
    jax.block_until_ready(fn(jnp.asarray(inputs[0]), key))
  secs = {n: 0.0 for n in fns}
  stats: dict = {n: [] for n in loops}
  tokens = {n: 0 for n in fns}
  mismatches = {n: 0 for n in loops}
  for i, x in enumerate(inputs):
    k = jax.random.fold_in(key, i)
    outs = {}
    for name, fn in fns.items():
      dt, out = timed(fn, jnp.asarray(x), k)
      secs[name] += dt
      tokens[name] += int(out.length[0])
      outs[name] = out
      if name in loops:
        stats[name].append(out.stats)
    if sampling.greedy:
      for name in loops:
        n = int(outs["baseline"].length[0])
        same = (int(outs[name].length[0]) == n and np.array_equal(
            np.asarray(outs[name].tokens[0, :n]), np.asarray(outs["baseline"].tokens[0, :n])))
        mismatches[name] += not same
  res = {}
  for name, (draft, kind, shape) in loops.items():
    calls = sum(int(np.asarray(s.target_calls).sum()) for s in stats[name])
    dcalls = sum(int(np.asarray(s.draft_calls).sum()) for s in stats[name])
    alphas = by_position(stats[name], kind == "tree")
    res[name] = {"alpha_by_position": alphas,
                 "tokens_per_target_call": tokens[name] / max(calls, 1),
                 "tokens_per_round_theory": theory.expected_tokens_by_position(alphas),
                 "draft_calls_per_round": dcalls / max(calls, 1),
                 "speedup": secs["baseline"] / secs[name],
                 "ms_per_token": 1e3 * secs[name] / max(tokens[name], 1),
                 "mismatches_vs_baseline": mismatches[name] if sampling.greedy else None}
  res["baseline_ms_per_token"] = 1e3 * secs["baseline"] / max(tokens["baseline"], 1)
  return res


def proposal_ms(loops: dict, target, tparams, x, sampling, repeats: int) -> dict:
  """Median milliseconds of each loop's proposal (a round's draft work) after
  a prefill, at committed length 8, the loops timed interleaved."""
  cache_len = 160
  seq = jnp.zeros((1, cache_len + 1), jnp.int32).at[0, 1:9].set(jnp.arange(3, 11))
  length = jnp.array([8], jnp.int32)
  key = jax.random.PRNGKey(1)
  fns, states = {}, {}
  for name, (draft, kind, shape) in loops.items():
    states[name] = drafts.base.init_draft(draft, x, cache_len, target.encode(tparams, x))
    if kind == "tree":
      fns[name] = jax.jit(lambda s, k, d=draft, t=shape: d.propose_tree(s, seq, length, t,
                                                                       sampling, k)[:3])
    else:
      fns[name] = jax.jit(lambda s, k, d=draft, g=shape: d.propose(s, seq, length, g,
                                                                  sampling, k)[:2])
    jax.block_until_ready(fns[name](states[name], key))
  times: dict = {name: [] for name in loops}
  for _ in range(repeats):
    for name, fn in fns.items():
      times[name].append(timed(fn, states[name], key)[0])
  return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def block_cost_in_steps(block, target, tparams, x, gammas, repeats: int) -> dict:
  """The block call at each γ over one cached one-token step of the same
  network (its decoder, extra included), timed interleaved; and the call's
  decoder layers alone (its 2γ positions' final states, no output layer), in
  the same steps: what the positions cost beside the γ output-layer rows; and
  a plain pass over the same positions with the output layer at every one
  (what the call computed before it kept only the block's rows)."""
  model, params = block.t5.model, block.t5.params
  cache_len = 160
  state = drafts.base.init_draft(block, x, cache_len, target.encode(tparams, x))
  cache = state.cache if hasattr(state, "cache") else state
  seq = jnp.zeros((1, cache_len + 1), jnp.int32).at[0, 1:9].set(jnp.arange(3, 11))
  length = jnp.array([8], jnp.int32)
  d = model.config.d_model
  step = jax.jit(lambda c: model.decode(params, seq[:, 8:9], length[:, None], c,
                                        jnp.zeros((1, 1, d)))[0])
  calls = {g: jax.jit(lambda s, g=g: block.block_logits(s, seq, length, g)[0]) for g in gammas}
  pos = {g: t5_block.block_positions(length, g, g + 1) for g in gammas}
  toks = {g: jnp.take_along_axis(seq, jnp.maximum(pos[g], 0), 1) for g in gammas}
  layers = {g: jax.jit(lambda c, g=g: model.decode(
      params, toks[g], pos[g], c, jnp.zeros((1, 2 * g, d)), return_hidden=True)[2])
      for g in gammas}
  every = {g: jax.jit(lambda c, g=g: model.decode(  # the output layer at all 2γ positions
      params, toks[g], pos[g], c, jnp.zeros((1, 2 * g, d)))[0]) for g in gammas}
  jax.block_until_ready(step(cache))
  for g in gammas:
    jax.block_until_ready(calls[g](state))
    jax.block_until_ready(layers[g](cache))
    jax.block_until_ready(every[g](cache))
  t_step, t_call, t_layers = [], {g: [] for g in gammas}, {g: [] for g in gammas}
  t_every = {g: [] for g in gammas}
  for _ in range(repeats):
    t_step.append(timed(step, cache)[0])
    for g in gammas:
      t_call[g].append(timed(calls[g], state)[0])
      t_layers[g].append(timed(layers[g], cache)[0])
      t_every[g].append(timed(every[g], cache)[0])
  s = statistics.median(t_step)
  return {"step_ms": 1e3 * s,
          "steps": {g: statistics.median(t_call[g]) / s for g in gammas},
          "layers_steps": {g: statistics.median(t_layers[g]) / s for g in gammas},
          "every_position_steps": {g: statistics.median(t_every[g]) / s for g in gammas}}


def best_block(alpha: float, ratio: list[float], c: float, block_steps: float
               ) -> tuple[float, int]:
  """Theorem 3.8's speedup (v = 1) of a block draft whose acceptance at
  position i is α ratio_i, priced at one call of ``block_steps`` draft steps,
  at the γ ≤ len(ratio) that maximizes it (ties: the shortest) -> (speedup, γ)."""
  best = (0.0, -1)
  for g in range(1, len(ratio) + 1):
    alphas = [min(1.0, alpha * r) for r in ratio[:g]]
    s = theory.RoundCost(g, c * block_steps, 1.0, draft_calls=1).speedup(
        theory.expected_tokens_by_position(alphas))
    best = max(best, (float(s), -g))
  return best[0], -best[1]


def predictions(ratio: list[float], block_steps: float, args) -> list[dict]:
  """Table 2's EnDe T = 0 rows: the paper's α and γ for the autoregressive
  chain (Theorem 3.8, v = 1) and a PREDICTION for a block draft whose
  acceptance at position i is the paper's α times the demo's ratio
  block/autoregressive at i, priced at one call of ``block_steps`` draft steps
  (and of 1.5), at the γ (≤ the measured profile's length) that maximizes it;
  the ceiling: the paper's α at every position (up to γ 8)."""
  out = []
  for row in paper.TABLE2:
    if row.task != "ende" or row.temperature != 0:
      continue
    chips = [("TPU v4", row.c)]
    if row.draft == "small":   # the one draft step measured on an H200
      chips.append(("H200", args.h200_c))
    for chip, c in chips:
      chain = theory.RoundCost(row.gamma, c, 1.0).predicted(row.alpha)
      pred, gamma = best_block(row.alpha, ratio, c, block_steps)
      pred_15, gamma_15 = best_block(row.alpha, ratio, c, 1.5)
      ceiling, gamma_c = best_block(row.alpha, [1.0] * 8, c, block_steps)
      out.append({"row": f"EnDe {row.draft} T=0", "chip": chip, "alpha": row.alpha,
                  "c": c, "paper": row.speedup, "chain_gamma": row.gamma,
                  "chain_theorem_3_8": float(chain), "block_predicted": pred,
                  "block_gamma": gamma, "block_predicted_at_1_5_steps": pred_15,
                  "block_gamma_at_1_5_steps": gamma_15, "ceiling": ceiling,
                  "ceiling_gamma": gamma_c})
  return out


def fmt(x: Any) -> str:
  if x is None:
    return "-"
  if isinstance(x, list):
    return " ".join("-" if (v is None or np.isnan(v)) else f"{v:.2f}" for v in x)
  return f"{x:.2f}" if isinstance(x, float) else str(x)


def main(argv=None) -> int:
  args = parse_args(argv)
  tparams, tcfg = checkpoints.load_checkpoint(path(args.target))
  target = T5Model(tcfg)
  ar = load_draft(args.ar_draft, target, tparams, block=False)
  block = load_draft(args.block_draft, target, tparams, block=True)
  tree = TreeShape.parse(args.block_tree)
  loops = {"ar chain": (ar, "chain", args.ar_gamma),
           "block chain": (block, "chain", args.block_gamma),
           "block tree": (block, "tree", tree)}
  inputs = encode_inputs(args.source, args.num_examples)
  x0 = jnp.asarray(inputs[0])
  report: dict = {"machine": f"{jax.devices()[0].device_kind} ({os.cpu_count()} CPUs seen)",
                  "date": time.strftime("%Y-%m-%d"), "examples": len(inputs), "loops": {}}
  for temp in [float(t) for t in args.temperatures.split(",")]:
    sampling = SamplingConfig(temperature=temp)
    res = run_loops(args, target, tparams, loops, inputs, sampling)
    for name, ms in proposal_ms(loops, target, tparams, x0, sampling, args.repeats).items():
      res[name]["draft_ms_per_round"] = ms
    report["loops"][f"T={temp:g}"] = res
    print(f"\nT = {temp:g}: {len(inputs)} test verses, batch 1; baseline "
          f"{res['baseline_ms_per_token']:.2f} ms/token")
    print("| loop | α by position | tokens / target call | 1 + Σ Π α_j | draft calls / round "
          "| draft ms / round | speedup | mismatches |")
    print("|---|---|---|---|---|---|---|---|")
    for name in loops:
      r = res[name]
      label = f"{name} ({args.block_tree if name == 'block tree' else 'γ ' + str(loops[name][2])})"
      print(f"| {label} | {fmt(r['alpha_by_position'])} | {r['tokens_per_target_call']:.2f} | "
            f"{r['tokens_per_round_theory']:.2f} | {r['draft_calls_per_round']:.2f} | "
            f"{r['draft_ms_per_round']:.2f} | {r['speedup']:.2f}x | "
            f"{fmt(r['mismatches_vs_baseline'])} |")
  gammas = [int(g) for g in args.cost_gammas.split(",")]
  cost = block_cost_in_steps(block, target, tparams, x0, gammas, args.repeats)
  report["block_cost"] = cost
  print(f"\nThe block proposal in draft steps (one cached one-token step of the block "
        f"draft's network: {cost['step_ms']:.3f} ms)")
  print("| γ | " + " | ".join(str(g) for g in gammas) + " |")
  print("|---|" + "---|" * len(gammas))
  print("| steps | " + " | ".join(f"{cost['steps'][g]:.2f}" for g in gammas) + " |")
  print("| a pass over the same positions, output layer at all of them | "
        + " | ".join(f"{cost['every_position_steps'][g]:.2f}" for g in gammas) + " |")
  print("| its decoder layers alone, no output layer | "
        + " | ".join(f"{cost['layers_steps'][g]:.2f}" for g in gammas) + " |")
  print("| positions (a step: 1) | " + " | ".join(str(2 * g) for g in gammas) + " |")
  print("| output-layer rows (a step: 1) | " + " | ".join(str(g) for g in gammas) + " |")
  t0 = report["loops"]["T=0"] if "T=0" in report["loops"] else next(iter(report["loops"].values()))
  ar_a, bl_a = t0["ar chain"]["alpha_by_position"], t0["block chain"]["alpha_by_position"]
  ar_mean = float(np.nanmean(ar_a))
  ratio = [float(b / ar_mean) if not np.isnan(b) else 0.0 for b in bl_a]
  # On a memory-bound accelerator one call over 2γ positions costs about one
  # step (the weights are read once); the CPU's measured cost is above.
  block_steps = 1.0
  preds = predictions(ratio, block_steps, args)
  report["ratio"], report["predictions"] = ratio, preds
  print(f"\nPREDICTION (cost model, v = 1): the paper's α times the demo's block/autoregressive "
        f"acceptance ratio by position ({fmt(ratio)}), one block call = one draft step")
  print("| row | chip | c | α | paper | chain γ 7 (Theorem 3.8) | block, predicted (γ) | "
        "at 1.5 steps a call (γ) | ceiling: α at every position (γ) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for p in preds:
    print(f"| {p['row']} | {p['chip']} | {p['c']:.3f} | {p['alpha']:.2f} | {p['paper']:.1f}x | "
          f"{p['chain_theorem_3_8']:.2f}x | {p['block_predicted']:.2f}x ({p['block_gamma']}) | "
          f"{p['block_predicted_at_1_5_steps']:.2f}x ({p['block_gamma_at_1_5_steps']}) | "
          f"{p['ceiling']:.2f}x ({p['ceiling_gamma']}) |")
  report["block_steps_used"] = block_steps
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
