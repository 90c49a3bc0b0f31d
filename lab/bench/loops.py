"""The paper's T = 0 rows (Table 2) timed with the real compiled loops at the
paper's size, one section per task (``loops``: EnDe, the rows the paper
leads with; ``loops_cnndm``: CNN/DM, which a tight time budget can cut): a T5 1.1 XXL-sized target and small/base/large-sized drafts,
random bfloat16 weights, batch 1, EOS ignored, ``Sizes.new_tokens`` new
tokens, acceptance steered to each row's α (``steered.SteeredDraft``).

Per row: ``temperature_sample`` (the baseline), ``speculative_decode`` at the
row's γ and ``tree_speculative_decode`` with the row's best tree under the
one-TPU-v4 cost model of ``scripts/best_trees.py`` (``lab.trees``), all
three timed interleaved (medians); beside them Theorem 3.8 with the measured
α, c (a draft step over the target's) and v(γ + 1) (the target's γ + 1
pass over its step), timed as pieces in the same process.

The target's weights are drawn once and serve every row; α is a value of
the steered draft, not a shape, so rows that share a draft and γ would
share one compiled loop; the baseline's tokens are recorded once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from specdec_jax import paper, theory
from specdec_jax.decoding import speculative_decode, temperature_sample, tree_speculative_decode
from specdec_jax.drafts import T5Draft
from specdec_jax.dryrun.chips import CHIPS
from specdec_jax.models.t5 import T5Model
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting import script_args
from specdec_jax.timing import interleaved_medians_ms, timed

from lab import trees
from lab.bench.common import (Model, Sizes, describe, draft_seed, log,
                              random_inputs, random_params, record)
from lab.bench.steered import SteeredDraft

GREEDY = SamplingConfig(temperature=0.0)
# The tree of each row: the best under the cost model of one TPU v4 chip,
# the paper's hardware (scripts/best_trees.py's first column).
TREE_CHIP = "v4"

HEAD = ["row", "paper α", "γ", "measured α", "c", "v(γ+1)", "Thm 3.8 (measured α, c, v)",
        "chain speedup", "tree (N, depth)", "tree tokens per call (model)", "tree speedup",
        "paper speedup", "outputs vs baseline"]


def best_tree(row: paper.Row, max_nodes: int):
  """(the row's best tree, its modelled speedup) on one TPU v4 chip under
  the rank rates scaled from the row's α (``scripts/best_trees.py``)."""
  rates = trees.scaled_rates(row.alpha)
  return trees.best_tree(trees.step_model(CHIPS[TREE_CHIP], 1, row.draft), rates, max_nodes)


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
  diff = np.nonzero(np.asarray(a) != np.asarray(b))[0]
  return int(diff[0]) if len(diff) else None


def verdict(out: Any, reference: np.ndarray) -> str:
  d = first_difference(np.asarray(out.tokens[0]), reference)
  return "identical" if d is None else f"first differs at token {d}"


def section_name(task: str) -> str:
  """'loops' for EnDe (Table 2's first rows), 'loops_cnndm' for CNN/DM."""
  return "loops" if task == "ende" else f"loops_{task}"


def section_loops(task: str, sz: Sizes, out: Path, smoke: bool = False) -> None:
  """The rows of ``task`` among ``sz.loop_rows`` (module docstring)."""
  del smoke
  rows = [paper.table2_row(t, draft, 0) for t, draft in sz.loop_rows if t == task]
  if not rows:
    raise ValueError(f"no T = 0 rows of task {task!r} in {sz.loop_rows}")
  section = section_name(task)
  tcfg = sz.targets["xxl"]
  target = T5Model(tcfg)
  t0 = time.perf_counter()
  params = random_params(target, jax.random.PRNGKey(0), "bfloat16")
  drafts = {}
  for name in dict.fromkeys(r.draft for r in rows):
    dmodel = T5Model(sz.drafts[name])
    drafts[name] = T5Draft(params=random_params(dmodel, jax.random.PRNGKey(draft_seed(name)),
                                                "bfloat16"), model=dmodel)
  jax.block_until_ready((params, [d.params for d in drafts.values()]))
  log(f"loops: random weights in {time.perf_counter() - t0:.1f} s")
  inputs = random_inputs(tcfg, 1, sz.input_len, seed=1)
  key = jax.random.PRNGKey(2)
  n = sz.new_tokens

  def baseline():
    return temperature_sample(target, params, inputs, key, max_decode_len=n, sampling=GREEDY,
                              eos_id=-1)
  first, base_s = timed(baseline)
  reference = np.asarray(first.tokens[0])
  log(f"loops: baseline compiled and run once in {base_s:.1f} s")

  # c and v(γ + 1): the target's step and passes, each draft's step, as
  # pieces over a random cache (the weights above), timed interleaved.
  gammas = sorted({r.gamma for r in rows})
  tpieces = Model.random("target xxl", tcfg, sz, seed=0, params=params)
  pieces = {("target", k): tpieces.piece(k, sz)[0] for k in [1] + [g + 1 for g in gammas]}
  for name, d in drafts.items():
    pieces[("draft", name)] = Model.random(f"draft {name}", d.model.config, sz, seed=7,
                                           params=d.params).piece(1, sz)[0]
  piece_ms = interleaved_medians_ms(pieces, sz.repeats, sz.inner)
  step = piece_ms[("target", 1)]
  lines = [f"T5 1.1 XXL-sized target ({describe(tcfg)}) with small/base/large-sized drafts, "
           f"random bfloat16 weights, batch 1, {sz.input_len} random input tokens, {n} new "
           f"tokens (EOS ignored), T = 0; acceptance steered to each row's α (the draft's own "
           f"step, then the baseline's token with probability α per position); trees: the best "
           f"of at most {sz.tree_max_nodes} nodes for the row on one TPU {TREE_CHIP} "
           f"(scripts/best_trees.py). Loops timed interleaved, medians of {sz.loop_repeats}; "
           f"c and v from pieces of {sz.inner} passes, medians of {sz.repeats}. Target step "
           f"{step:.3f} ms; " + ", ".join(
               f"{name} draft step {piece_ms[('draft', name)]:.3f} ms" for name in drafts) + ".",
           "", script_args.markdown_header(HEAD)]
  print("\n".join(lines), flush=True)
  done: list[dict] = []
  for row in rows:
    done.append(loop_row(row, sz, target, params, drafts[row.draft], inputs, key, reference,
                         baseline, piece_ms))
    lines.append(script_args.markdown_row(done[-1]["cells"]))
    print(lines[-1], flush=True)
    record(out, section, dict(rows=done, step_ms=step, pieces_ms={
        f"{kind} {what}": ms for (kind, what), ms in piece_ms.items()},
        baseline_first_call_s=base_s, new_tokens=n), None)
  lines += ["", "Speedups are over our baseline (`temperature_sample`, same weights and "
            "input) in the same process; 'paper speedup' is Table 2's on one TPU-v4."]
  record(out, section, dict(rows=done, step_ms=step, pieces_ms={
      f"{kind} {what}": ms for (kind, what), ms in piece_ms.items()},
      baseline_first_call_s=base_s, new_tokens=n), "\n".join(lines))


def loop_row(row: paper.Row, sz: Sizes, target: T5Model, params: Any, draft: T5Draft,
             inputs: jax.Array, key: jax.Array, reference: np.ndarray, baseline,
             piece_ms: dict) -> dict:
  """One row of Table 2 at T = 0: the chain and the tree beside the
  baseline, timed interleaved; the row's cells and figures."""
  n = sz.new_tokens
  rates = trees.scaled_rates(row.alpha)
  steered = SteeredDraft.build(draft, reference[None], rates, seed=3)
  tree, modelled = best_tree(row, sz.tree_max_nodes)

  def chain():
    return speculative_decode(target, params, steered, inputs, key, gamma=row.gamma,
                              max_decode_len=n, sampling=GREEDY, eos_id=-1)

  def tree_loop():
    return tree_speculative_decode(target, params, steered, inputs, key, tree=tree,
                                   max_decode_len=n, sampling=GREEDY, eos_id=-1)
  c_out, c_first = timed(chain)
  t_out, t_first = timed(tree_loop)
  log(f"loops {row.task} {row.draft}: chain compiled and run in {c_first:.1f} s, tree "
      f"({tree.num_nodes} nodes) in {t_first:.1f} s")
  ms = interleaved_medians_ms({"baseline": baseline, "chain": chain, "tree": tree_loop},
                              sz.loop_repeats)
  st = c_out.stats
  accepted, rejected = int(st.accepted[0]), int(st.rejected[0])
  alpha = accepted / max(accepted + rejected, 1)
  c = piece_ms[("draft", row.draft)] / piece_ms[("target", 1)]
  v = piece_ms[("target", row.gamma + 1)] / piece_ms[("target", 1)]
  exp = theory.walltime_improvement(min(alpha, 1.0), row.gamma, c, v)
  tree_tokens = int(t_out.length[0]) / max(int(t_out.stats.target_calls[0]), 1)
  expected = tree.expected_tokens(rates)
  outputs = f"chain {verdict(c_out, reference)}, tree {verdict(t_out, reference)}"
  speed, tspeed = ms["baseline"] / ms["chain"], ms["baseline"] / ms["tree"]
  cells = [f"{row.task} {row.draft}", row.alpha, row.gamma, f"{alpha:.3f} ({accepted + rejected})",
           f"{c:.3f}", f"{v:.2f}", f"{exp:.2f}X", f"**{speed:.2f}X**",
           f"{tree.num_nodes}, {tree.max_depth}", f"{tree_tokens:.2f} ({expected:.2f})",
           f"**{tspeed:.2f}X**", f"{row.speedup}X", outputs]
  return dict(task=row.task, draft=row.draft, paper_alpha=row.alpha, gamma=row.gamma,
              alpha=alpha, evaluated=accepted + rejected, c=c, v=v, exp=exp,
              chain_speedup=speed, tree_speedup=tspeed, tree_parents=list(tree.parents),
              tree_modelled_speedup=modelled, tree_tokens_per_call=tree_tokens,
              tree_expected_tokens=expected, paper_speedup=row.speedup, ms=ms,
              chain_first_call_s=c_first, tree_first_call_s=t_first,
              chain_identical=first_difference(np.asarray(c_out.tokens[0]), reference) is None,
              tree_identical=first_difference(np.asarray(t_out.tokens[0]), reference) is None,
              cells=cells)
