"""The chain-versus-tree study (``lab.trees``) on the tiny pair: counts
that add up, the rank rates the acceptance trees are built from, and the
roofline model's limits."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specdec_jax import drafts
from specdec_jax.models.t5 import get_config
from lab import trees
from specdec_jax.dryrun.chips import CHIPS
from specdec_jax.sampling import SamplingConfig
from specdec_jax.tree import TreeShape

INPUTS = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (3, 10), 2, 64), np.int32)


def test_compare_counts_and_rank_rates(tiny_target):
  model, params = tiny_target
  draft = drafts.T5Draft(params=params, model=model)  # the target itself: every token accepted
  shapes = {"chain:2": 2, "full:2,1": TreeShape.parse("full:2,1")}
  rows, base_s = trees.compare(model, params, draft, INPUTS, shapes, SamplingConfig(), 12)
  chain, tree = rows
  assert base_s > 0 and chain.width == 3 and tree.width == 5 and tree.depth == 2
  # A draft equal to the target: every round accepts its whole depth (the
  # last round may stop at the length limit).
  assert chain.tokens == tree.tokens == 3 * 12
  assert chain.tokens_per_call == pytest.approx(tree.tokens_per_call)
  assert tree.sibling_wins == 0 and tree.tokens_per_call > 2.5
  assert trees.summary(rows, {2: "chain:2"})[1]["gain_vs_chain"] == pytest.approx(0.0)
  rates = trees.rank_rates(model, params, draft, INPUTS, 12, ranks=4)
  assert rates[0] == pytest.approx(1.0) and sum(rates[1:]) == 0


def test_roofline_model_is_memory_bound_at_small_widths():
  big, small = get_config("t5_1_1_base"), get_config("t5_1_1_small")
  chip = CHIPS["v5e"]
  one = trees.pass_seconds(big, chip, 8, 1, 256, 512)
  assert trees.pass_seconds(big, chip, 8, 16, 256, 512) == pytest.approx(one)  # weights dominate
  assert trees.pass_seconds(big, chip, 8, 4096, 256, 512) > 2 * one        # compute-bound
  row = trees.Row("chain:3", 4, 3, 30, 10, 30, 0, 24, 1.0)
  # The draft is replicated on each of the 8 chips, the target split over
  # them: T5 1.1 XXL as the target, as the engine's rows run.
  model = trees.roofline_speedup(row, get_config("t5_1_1_xxl"), small, chip, 8)
  assert model["v"] == pytest.approx(1.0) and 0 < model["c"] < 1  # the draft is the smaller
  assert model["speedup"] == pytest.approx(3.0 / (3 * model["c"] + 1.0))


def test_the_draft_is_priced_replicated():
  """The engine replicates the draft and splits the target: on 8 chips the
  draft's step costs what it costs on one, so c is 8 times one chip's."""
  xxl, small = get_config("t5_1_1_xxl"), get_config("t5_1_1_small")
  row = trees.Row("chain:3", 4, 3, 30, 10, 30, 0, 24, 1.0)
  one = trees.roofline_speedup(row, xxl, small, CHIPS["v5e"], 1)
  eight = trees.roofline_speedup(row, xxl, small, CHIPS["v5e"], 8)
  assert eight["c"] == pytest.approx(8 * one["c"], rel=1e-6)


def test_best_tree_under_the_cost_model():
  """The positional model's expected tokens of a chain are Corollary 3.6's,
  and the best tree of <= 64 nodes under the calibrated cost model does at
  least as well as the chain at the paper's γ (a chain is one of the trees
  searched)."""
  from specdec_jax import theory  # pylint: disable=import-outside-toplevel
  rates = trees.geometric_rates(0.75)
  assert rates[0] == 0.75 and sum(rates) <= 1 and rates == sorted(rates, reverse=True)
  assert trees.expected_tokens(TreeShape.chain(7), rates) == pytest.approx(
      float(theory.expected_tokens(0.75, 7)))
  model = trees.step_model(CHIPS["v4"], 1, "small")
  chain = model.speedup(TreeShape.chain(7), rates)
  tree, speedup = trees.best_tree(model, rates, max_nodes=16)
  assert tree.num_nodes <= 16 and speedup >= chain > 1
  scaled = trees.scaled_rates(0.75)
  assert scaled[0] == 0.75 and scaled == sorted(scaled, reverse=True)
  assert trees.best_tree(model, scaled, max_nodes=16)[1] >= model.speedup(TreeShape.chain(7),
                                                                          scaled)
