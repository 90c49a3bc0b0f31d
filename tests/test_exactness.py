"""The exactness matrix, T = 0 half: drafts × loop (chain, adaptive, tree).
The T > 0 half (distribution and power) is tests/test_exactness_sampling.py;
the two files run on separate test workers.

The whole matrix: drafts × sampling × loop (chain, adaptive, tree).

Two properties (paper §2.3, Theorem 1; docs/exactness.md):

* temperature 0: the output equals the baseline (``temperature_sample``)
  token for token, lengths included, on a batch whose rows stop at different
  EOS positions and one runs to the length limit; plus each loop's statistics
  invariants (``check_chain``, ``check_adaptive``, ``check_tree``).
* temperature > 0: the whole-sequence distribution equals the target's,
  enumerated (vocab 8, 3 tokens; 20k samples, fixed seed, chi-square at
  significance 1e-3; ``exactness_cases``). Power: the same test rejects an
  inexact engine once per loop kind (lenience 0.3; an adaptive rule that peeks
  at the target's p; the tree rule without the residual update after a
  rejected sibling).

The cells cover every draft kind, sampling setting, adaptive rule and tree
shape kind at least once, not every combination; each cell's fixed γ,
threshold or shape is a static argument, so a cell compiles its own loop.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from exactness_cases import (INPUTS, KEY, MAX_LEN, Cell, block, bridged, check_adaptive,
                             check_chain, check_tree, featured, lookup_t5, trained_block,
                             noisy, noisy_output_layer, pick_greedy_case, quantized,
                             shortlisted)
from specdec_jax import drafts
from specdec_jax.decoding import (AdaptiveConfig)
from specdec_jax.drafts.base import check_tree as check_tree_interface
from specdec_jax.drafts.base import proposal_steps
from specdec_jax.sampling import SamplingConfig
from specdec_jax.tree import DynamicTree, TreeShape

from exactness_matrix import THRESHOLD, cell_param, decode

GREEDY = SamplingConfig()


# ------------------------------------------------------------------- T = 0

def greedy_draft(name: str, target: tuple, small: tuple) -> Any:
  """The T = 0 drafts over the tiny target's vocabulary (64). ``small`` is the
  1-layer T5 draft ('t5_int8' / 't5_int4': its kernels quantized); 'near' is the target with noise on every weight (α ≈ 0.5:
  rounds end both by rejection and by stopping); 'near_out' the target with
  noise on its output layer only (argmax often agrees, the runner-up sometimes
  wins: trees go deep and through siblings)."""
  model, params = target
  dm, dp = small
  near = lambda: drafts.T5Draft(params=noisy(params, 0.2), model=model)  # noqa: E731
  near_out = lambda: noisy_output_layer(params, 0.7, 3)  # noqa: E731
  builders = {
      "t5": lambda: drafts.build("t5", model=dm, params=dp),
      "bigram": lambda: drafts.build(
          "bigram", corpus=np.asarray(jax.random.randint(jax.random.PRNGKey(3), (50, 20), 0,
                                                         64)), vocab_size=64),
      "prompt_lookup": lambda: drafts.build("prompt_lookup", vocab_size=64),
      "lookup_t5": lambda: lookup_t5(drafts.build("t5", model=dm, params=dp)),
      "t5_bridge": lambda: bridged(dm, dp, model, params),
      "t5_feature": lambda: featured(dm, dp, model, params),
      "lookup_t5_feature": lambda: featured(dm, dp, model, params, name="lookup_t5"),
      "near": near,
      "lookup_near": lambda: drafts.LookupT5Draft(t5=near()),
      "near_out": lambda: drafts.T5Draft(params=near_out(), model=model),
      "lookup_near_out": lambda: lookup_t5(drafts.T5Draft(params=near_out(), model=model)),
      "feature_near_out": lambda: featured(model, near_out(), model, params, scale=0.05),
      "shortlist_near_out": lambda: shortlisted(model, near_out(), SHORTLIST_IDS),
      # Weight-only quantized drafts (Experiment.draft_quantization): q is
      # whatever the int8 / int4 draft computes.
      "t5_int8": lambda: drafts.build("t5", model=dm, params=quantized(dp, "int8")),
      "t5_int4": lambda: drafts.build("t5", model=dm, params=quantized(dp, "int4")),
      # Block drafts (one call a round): trained briefly so that mask
      # positions are both accepted and rejected; random with the feature bridge.
      "block_trained": lambda: _trained(target, small),
      "block_feature": lambda: block(dm, dp, target),
  }
  return builders[name]()


_TRAINED: dict = {}


def _trained(target: tuple, small: tuple) -> Any:
  """``trained_block`` once per session (several cells share it)."""
  if "block" not in _TRAINED:
    _TRAINED["block"] = trained_block(target, small)
  return _TRAINED["block"]


SHORTLIST_IDS = np.arange(0, 64, 2)      # half the vocabulary
FULL = TreeShape.parse("full:2,2,1")     # 1 + 2 + 4 + 4 = 11 nodes, depth 3
SPINE = TreeShape.parse("spine:3,2,2")   # 1 + 7 nodes, depth 3
FAN = TreeShape.parse("parents:-1,0,0,0,1,2,3,4,5,6")  # three chains of 3 from the root
DYNAMIC = DynamicTree.parse("dynamic:3,3,3")  # 10 nodes, depth 3, parents chosen per round


GREEDY_CELLS = [
    # Chain: γ 1, 3, 7; the feature bridge inside the lookup combination with
    # γ longer (5) than its staleness table (3; shorter: the T > 0 cell).
    cell_param(Cell("chain", "t5", 1), "t5-g1"),
    cell_param(Cell("chain", "bigram", 7), "bigram-g7"),
    cell_param(Cell("chain", "prompt_lookup", 3), "prompt_lookup-g3"),
    cell_param(Cell("chain", "t5_bridge", 3), "t5_bridge-g3"),
    cell_param(Cell("chain", "lookup_t5_feature", 5), "lookup_t5_feature-g5"),
    cell_param(Cell("chain", "t5_int8", 3), "t5_int8-g3"),
    cell_param(Cell("chain", "t5_int4", 3), "t5_int4-g3", slow=True),  # int8's twin
    # Every target call at a fixed 8 positions (Experiment.fixed_positions).
    cell_param(Cell("chain", "t5", 3, fixed=8), "t5-g3-fixed8"),
    # The target's q/k/v and wi_0/wi_1 fused (Experiment.fused_projections).
    cell_param(Cell("chain", "t5", 3, fused=True), "t5-g3-fused", slow=True),
    # Adaptive: every rule, skipping, prompt lookup's own rule, lookup + T5's,
    # and the feature bridge (γ_max 4: rounds shorter and longer than its
    # staleness table).
    cell_param(Cell("adaptive", "near", 4, THRESHOLD(0.9, skip_below=0.8),
                expect=("alpha", "varies", "skips")), "near-threshold0.9-skip0.8-g4"),
    cell_param(Cell("adaptive", "near", 7, AdaptiveConfig("cumulative", 0.6),
                expect=("alpha", "varies")), "near-cumulative0.6-g7"),
    cell_param(Cell("adaptive", "near", 7, AdaptiveConfig("schedule", initial_gamma=1),
                expect=("alpha", "schedule_from_1")), "near-schedule-g7-from1"),
    cell_param(Cell("adaptive", "prompt_lookup", 4, THRESHOLD(0.4, skip_below=0.5),
                expect=("skips_some",)), "prompt_lookup-threshold0.4-skip0.5-g4", slow=True),
    cell_param(Cell("adaptive", "lookup_near", 7, AdaptiveConfig("cumulative", 0.6),
                expect=("varies_in_total",)), "lookup_near-cumulative0.6-g7", slow=True),
    cell_param(Cell("adaptive", "t5_feature", 4, THRESHOLD(0.4)), "t5_feature-threshold0.4-g4"),
    # Fixed positions: the switch's cache-only passes attend as a write does.
    cell_param(Cell("adaptive", "near", 4, THRESHOLD(0.9, skip_below=0.8), fixed=5,
                expect=("alpha", "varies", "skips")), "near-threshold0.9-skip0.8-g4-fixed5",
               slow=True),
    # Tree: full, spine and fan shapes; T5 drafts go deep and (but for
    # lookup + T5, whose copies are one-hot) through runner-up siblings; the
    # shortlist (half the vocabulary, plus the inputs' tokens) leaves out
    # tokens the target emits.
    cell_param(Cell("tree", "near_out", shape=FULL, expect=("deep", "siblings")), "near_out-full"),
    cell_param(Cell("tree", "lookup_near_out", shape=SPINE, expect=("deep", "no_siblings")),
           "lookup_near_out-spine", slow=True),
    cell_param(Cell("tree", "prompt_lookup", shape=SPINE), "prompt_lookup-spine"),
    cell_param(Cell("tree", "near_out", shape=FULL, expect=("deep", "siblings"), fixed=12),
               "near_out-full-fixed12", slow=True),
    cell_param(Cell("tree", "prompt_lookup", shape=FAN, expect=("siblings",)),
        "prompt_lookup-fan", slow=True),
    cell_param(Cell("tree", "feature_near_out", shape=FULL, expect=("deep", "siblings")),
           "feature_near_out-full"),
    cell_param(Cell("tree", "shortlist_near_out", shape=SPINE,
                expect=("deep", "siblings", "shortlist_misses")), "shortlist_near_out-spine"),
    # Block drafts: γ tokens from one call; the feature bridge's table (3
    # rows) shorter than the block (5).
    cell_param(Cell("chain", "block_trained", 4, expect=("block_positions",)),
               "block_trained-g4"),
    cell_param(Cell("chain", "block_feature", 5), "block_feature-g5", slow=True),
    cell_param(Cell("adaptive", "block_trained", 4, THRESHOLD(0.6),
                    expect=("block_positions", "one_call")), "block_trained-threshold0.6-g4"),
    cell_param(Cell("tree", "block_trained", shape=FULL, expect=("deep", "siblings")),
               "block_trained-full"),
    cell_param(Cell("tree", "block_feature", shape=SPINE), "block_feature-spine", slow=True),
    # Trees chosen per round (parents as data): T5 drafts, lookup + T5 (the
    # copy always kept, T5 alternatives around it), prompt lookup (no
    # per-round choice: the static layout), the target at fixed positions.
    cell_param(Cell("tree", "near_out", shape=DYNAMIC, expect=("deep", "siblings")),
               "near_out-dynamic"),
    cell_param(Cell("tree", "lookup_near_out", shape=DYNAMIC, expect=("deep",)),
               "lookup_near_out-dynamic", slow=True),
    cell_param(Cell("tree", "prompt_lookup", shape=DYNAMIC), "prompt_lookup-dynamic", slow=True),
    cell_param(Cell("tree", "feature_near_out", shape=DYNAMIC, expect=("deep", "siblings")),
               "feature_near_out-dynamic", slow=True),
    cell_param(Cell("tree", "near_out", shape=DYNAMIC, expect=("deep", "siblings"), fixed=12),
               "near_out-dynamic-fixed12", slow=True),
]


@pytest.fixture(scope="module")
def greedy_case(tiny_target):
  """(eos, baseline) on ``INPUTS``: rows end at different EOS positions."""
  return pick_greedy_case(*tiny_target)


@pytest.mark.parametrize("cell", GREEDY_CELLS)
def test_greedy_identical_to_baseline(tiny_target, tiny_draft, greedy_case, cell):
  model, params = tiny_target
  eos, base = greedy_case
  draft = greedy_draft(cell.draft, tiny_target, tiny_draft)
  if cell.loop == "tree":
    check_tree_interface(cell.draft, draft, cell.shape)
  if "feature" in cell.draft:  # the draft really reads the target's decoder states
    assert draft.wants_target_states
  if "shortlist_misses" in cell.expect:
    ids = SHORTLIST_IDS
    outside = ~np.isin(np.asarray(base.tokens), np.union1d(ids, np.asarray(INPUTS)))
    assert outside.sum() >= 5, "the shortlist must leave out tokens the target emits"
  out = decode(cell, model, params, draft, INPUTS, KEY, eos, MAX_LEN, GREEDY)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(base.tokens))
  np.testing.assert_array_equal(np.asarray(out.length), np.asarray(base.length))
  st = jax.tree_util.tree_map(np.asarray, out.stats)
  if cell.loop == "chain":
    check_chain(st, base, cell.gamma, proposal_steps(draft, cell.gamma))
  elif cell.loop == "adaptive":
    check_adaptive(st, cell)
  else:
    check_tree(st, out, cell)
  if "block_positions" in cell.expect:
    # Proposals from mask positions were accepted and rejected: the identity
    # holds with every position of the block in play.
    later = st.evaluated_at[:, 1:].sum()
    assert 0 < st.accepted_at[:, 1:].sum() < later, (st.accepted_at.sum(0),
                                                    st.evaluated_at.sum(0))
  if "one_call" in cell.expect:  # one draft call a round, whatever the count
    np.testing.assert_array_equal(st.draft_calls, st.target_calls)
    assert (st.gamma_hist.sum(0)[1:] > 0).sum() >= 2, st.gamma_hist
