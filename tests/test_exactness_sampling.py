"""The exactness matrix, T > 0 half: whole-sequence distributions and the
test's power (the T = 0 half and the whole description: tests/test_exactness.py)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from exactness_cases import (SEQ_EOS, SEQ_KEY, SEQ_LEN, SETTINGS, SIGNIFICANCE, Cell, alpha,
                             block, bridged, exact_sequence_distribution, featured, lookup_t5,
                             quantized, seq_inputs, seq_models, sequence_pvalue, shortlisted)
from specdec_jax import drafts
from specdec_jax import tree as tree_lib
from specdec_jax.decoding import (AdaptiveConfig, speculative_decode, temperature_sample,
                                  tree_speculative_decode)
from specdec_jax.models.t5 import T5Model
from specdec_jax.sampling import standardize
from specdec_jax.tree import DynamicTree, TreeShape

from exactness_matrix import THRESHOLD, cell_param, decode

# ------------------------------------------------------------------- T > 0

def seq_draft(name: str, model: T5Model, target: Any, draft_params: Any) -> Any:
  """The T > 0 drafts over the vocab-8 pair. With vocab 8 and a 5-token input
  nearly every context has a 1-gram match, so lookup + T5 rounds mix copied
  (one-hot q) and T5 positions; the shortlist {EOS, 3} (without the input's
  tokens) leaves out 6 of the 8 tokens, so the target's tokens outside it can
  come only from the rejection's residual."""
  t5 = lambda: drafts.T5Draft(params=draft_params, model=model)  # noqa: E731
  builders = {
      "t5": t5,
      "lookup_t5": lambda: lookup_t5(t5()),
      "t5_bridge": lambda: bridged(model, draft_params, model, target, seed=1, scale=1.0),
      "t5_feature": lambda: featured(model, draft_params, model, target, seed=1, scale=1.0),
      "t5_shortlist": lambda: shortlisted(model, draft_params, np.array([SEQ_EOS, 3]), False),
      "t5_int8": lambda: drafts.T5Draft(params=quantized(draft_params, "int8"), model=model),
      # Block drafts: x_2.. from mask positions, drawn independently of x_1.
      "block": lambda: block(model, draft_params, scale=1.0),
      "block_feature": lambda: block(model, draft_params, (model, target), seed=1, scale=1.0),
  }
  return builders[name]()


# Tokens the shortlisted draft never proposes.
NEVER_PROPOSED = {"t5_shortlist": [0, 2, 4, 5, 6, 7]}
SEQ_FULL = TreeShape.parse("full:2,2")    # 7 nodes, depth 2
SEQ_SPINE = TreeShape.parse("spine:3,2")  # 6 nodes, depth 2
SEQ_DYNAMIC = DynamicTree.parse("dynamic:2,3")  # 6 nodes, depth 2, parents chosen per round

# Adaptive cells run γ_max = 3 (widths 1, 2, 3) with thresholds chosen per
# setting so that rounds of several lengths occur (asserted): rows stop early
# while others in the batch go on and take their bonus from p_{c+1}, c < the
# width. The cumulative rule's level is a product of confidences, so lower;
# confidence='drawn' reads q_i(x_i), and skip_below still q_1's top.
SEQ_CELLS = [
    cell_param(Cell("chain", "lookup_t5", 2, setting="temp1_topp0.8", expect=("alpha",)),
           "lookup_t5-temp1_topp0.8"),
    cell_param(Cell("chain", "t5_bridge", 2, setting="temp0.7_topk3", expect=("alpha",)),
           "t5_bridge-temp0.7_topk3"),
    cell_param(Cell("chain", "t5_feature", 2, setting="temp1", expect=("alpha",)),
           "t5_feature-temp1"),
    cell_param(Cell("chain", "t5_shortlist", 2, setting="temp1", expect=("residual",)),
           "t5_shortlist-temp1"),
    # A weight-only int8 draft (Experiment.draft_quantization): q is its own.
    cell_param(Cell("chain", "t5_int8", 2, setting="temp1", expect=("alpha",)), "t5_int8-temp1"),
    # Every target call at a fixed 4 positions (Experiment.fixed_positions).
    cell_param(Cell("chain", "t5", 2, setting="temp1", expect=("alpha",), fixed=4),
               "t5-temp1-fixed4", slow=True),
    cell_param(Cell("chain", "t5", 2, setting="temp1", expect=("alpha",), fused=True),
               "t5-temp1-fused", slow=True),
    cell_param(Cell("adaptive", "t5", 3, THRESHOLD(0.5, skip_below=0.5), setting="temp0.7_topk3",
                expect=("alpha", "skips")), "t5-threshold0.5-skip0.5-temp0.7_topk3"),
    cell_param(Cell("adaptive", "t5", 3, AdaptiveConfig("cumulative", 0.2, skip_below=0.3,
                                                    confidence="drawn"),
                setting="temp1_topp0.8", expect=("alpha", "skips")),
           "t5-cumulative_drawn0.2-skip0.3-temp1_topp0.8"),
    cell_param(Cell("adaptive", "t5", 3, AdaptiveConfig("schedule", initial_gamma=1),
                setting="temp1", expect=("alpha",)), "t5-schedule-temp1"),
    cell_param(Cell("adaptive", "t5", 3, AdaptiveConfig("schedule", initial_gamma=1),
                setting="temp1", expect=("alpha",), fixed=4), "t5-schedule-temp1-fixed4",
               slow=True),
    cell_param(Cell("adaptive", "lookup_t5", 3, AdaptiveConfig("cumulative", 0.5),
                setting="temp1_topp0.8"), "lookup_t5-cumulative0.5-temp1_topp0.8",
               slow=True),
    cell_param(Cell("tree", "t5", shape=SEQ_FULL, setting="temp1_topp0.8"), "t5-full-temp1_topp0.8"),
    cell_param(Cell("tree", "lookup_t5", shape=SEQ_SPINE, setting="temp0.7_topk3"),
           "lookup_t5-spine-temp0.7_topk3"),
    cell_param(Cell("tree", "t5_feature", shape=SEQ_FULL, setting="temp1"),
        "t5_feature-full-temp1", slow=True),
    # Block drafts (one call a round), with and without the feature bridge.
    cell_param(Cell("chain", "block", 2, setting="temp1", expect=("alpha", "block_positions")),
               "block-temp1"),
    cell_param(Cell("chain", "block_feature", 2, setting="temp0.7_topk3",
                    expect=("alpha", "block_positions")), "block_feature-temp0.7_topk3"),
    cell_param(Cell("adaptive", "block", 3, THRESHOLD(0.35),
                    setting="temp1_topp0.8", expect=("alpha",)),
               "block-threshold0.35-temp1_topp0.8"),
    cell_param(Cell("tree", "block", shape=SEQ_FULL, setting="temp1"), "block-full-temp1"),
    cell_param(Cell("tree", "block_feature", shape=SEQ_SPINE, setting="temp1_topp0.8"),
               "block_feature-spine-temp1_topp0.8", slow=True),
    cell_param(Cell("tree", "t5", shape=SEQ_DYNAMIC, setting="temp1_topp0.8"),
               "t5-dynamic-temp1_topp0.8"),
    cell_param(Cell("tree", "t5", shape=SEQ_DYNAMIC, setting="temp0.7_topk3"),
               "t5-dynamic-temp0.7_topk3", slow=True),
    cell_param(Cell("tree", "lookup_t5", shape=SEQ_DYNAMIC, setting="temp1"),
               "lookup_t5-dynamic-temp1", slow=True),
]


@pytest.fixture(scope="module")
def seq_pair():
  return seq_models()


@pytest.fixture(scope="module")
def seq_dist(seq_pair):
  """setting -> the target's enumerated distribution over outputs (once each)."""
  model, target, _ = seq_pair
  cache: dict[str, dict] = {}

  def get(setting: str) -> dict:
    if setting not in cache:
      cache[setting] = exact_sequence_distribution(model, target, SETTINGS[setting])
      assert abs(sum(cache[setting].values()) - 1) < 1e-5
    return cache[setting]
  return get


def sample(cell: Cell, seq_pair: tuple, draft: Any):
  model, target, _ = seq_pair
  return decode(cell, model, target, draft, seq_inputs(), SEQ_KEY, SEQ_EOS, SEQ_LEN,
                SETTINGS[cell.setting])


@pytest.mark.parametrize("cell", SEQ_CELLS)
def test_sequence_distribution_is_exact(seq_pair, seq_dist, cell):
  model, target, draft_params = seq_pair
  out = sample(cell, seq_pair, seq_draft(cell.draft, model, target, draft_params))
  st = jax.tree_util.tree_map(np.asarray, out.stats)
  tokens = np.asarray(out.tokens)
  # The draft must actually be rejected sometimes, or the test proves little.
  if "alpha" in cell.expect:
    assert 0.1 < alpha(st) < 0.95, alpha(st)
  if "block_positions" in cell.expect:  # x_2 (a mask position's) accepted and rejected
    assert 0 < st.accepted_at[:, 1].sum() < st.evaluated_at[:, 1].sum(), st.accepted_at.sum(0)
  if "residual" in cell.expect:
    assert 0.05 < alpha(st) < 0.95, alpha(st)
    # The target's tokens outside the shortlist do occur: only the residual can give them.
    assert np.isin(tokens, NEVER_PROPOSED[cell.draft]).mean() > 0.05
  if cell.loop == "adaptive":
    hist = st.gamma_hist.sum(0)
    assert (hist[1:] > hist.sum() // 20).sum() >= 2, hist  # γ really varies
    if "skips" in cell.expect:  # rows unsure of x_1 proposed nothing (width 0)
      assert hist[0] > hist.sum() // 20, hist
  if cell.loop == "tree":
    # Siblings were tried and sometimes won, and rounds were sometimes cut short.
    assert int(st.rank_hist[:, 1:].sum()) > 0, st.rank_hist.sum(0)
    assert int(st.depth_hist[:, 0].sum()) > 0
  assert sequence_pvalue(tokens, seq_dist(cell.setting)) > SIGNIFICANCE


# ------------------------------------------------------------------- power

@struct.dataclass
class PeekingDraft:
  """A deliberately wrong adaptive rule: it asks the target and proposes only
  the leading drafts with p(x_i) >= q(x_i) (those sure to be accepted). The
  decision depends on x_i and p, so given "proposed" x_i is not ~ q_i."""

  inner: drafts.T5Draft
  target_params: Any
  target: T5Model = struct.field(pytree_node=False)

  @property
  def vocab_size(self) -> int:
    return self.inner.vocab_size

  def init(self, inputs, cache_len):
    return self.inner.init(inputs, cache_len), inputs

  def propose(self, state, seq, length, gamma, sampling, key):
    tokens, q, inner = self.inner.propose(state[0], seq, length, gamma, sampling, key)
    return tokens, q, (inner, state[1])

  def propose_adaptive(self, state, seq, length, gamma, sampling, key, limit, threshold):
    tokens, q, (inner, inputs) = self.propose(state, seq, length, gamma, sampling, key)
    offs = jnp.arange(gamma)[None]
    full = seq.at[jnp.arange(seq.shape[0])[:, None], length[:, None] + 1 + offs].set(tokens)
    p = standardize(self.target(self.target_params, inputs, full), sampling)
    p = jnp.take_along_axis(p, (length[:, None] + offs)[..., None], axis=1)   # p_1..p_γ
    px, qx = (jnp.take_along_axis(d, tokens[..., None], -1)[..., 0] for d in (p, q))
    safe = jnp.sum(jnp.cumprod((px >= qx).astype(jnp.int32), axis=1), axis=1)
    return tokens, q, jnp.minimum(safe, limit), jnp.asarray(gamma, jnp.int32), (inner, inputs)

  def commit(self, state, seq, length):
    return state


@struct.dataclass
class OneUniformBlock:
  """A deliberately wrong block draft: every position's token is drawn with
  the same uniform, so each x_i still follows its q_i alone but x_2 given x_1
  does not follow q_2 — Algorithm 1 needs x_i ~ q_i given x_1..x_{i-1}."""

  inner: Any

  @property
  def vocab_size(self) -> int:
    return self.inner.vocab_size

  def init(self, inputs, cache_len):
    return self.inner.init(inputs, cache_len)

  def propose(self, state, seq, length, gamma, sampling, key):
    from specdec_jax.sampling import inverse_cdf
    logits, state = self.inner.block_logits(state, seq, length, gamma)
    q = standardize(logits, sampling)
    u = jax.random.uniform(key, (seq.shape[0], 1))
    return inverse_cdf(q, jnp.broadcast_to(u, q.shape[:2])), q, state

  def commit(self, state, seq, length):
    return state


def test_the_distribution_test_rejects_correlated_block_draws(seq_pair, seq_dist):
  """Power for the block draft: the same draft with one uniform for all its
  positions (each x_i's marginal is q_i; the joint is not their product) is
  caught, while the independent draws pass (``block-temp1`` above)."""
  model, target, draft_params = seq_pair
  bad = OneUniformBlock(block(model, draft_params, scale=1.0))
  out = speculative_decode(model, target, bad, seq_inputs(), SEQ_KEY, gamma=2,
                           max_decode_len=SEQ_LEN, sampling=SETTINGS["temp1"], eos_id=SEQ_EOS)
  assert sequence_pvalue(np.asarray(out.tokens), seq_dist("temp1")) < SIGNIFICANCE


@pytest.mark.parametrize("loop", ["chain", pytest.param("adaptive", marks=pytest.mark.slow),
                                  pytest.param("tree", marks=pytest.mark.slow)])
def test_the_distribution_test_rejects_an_inexact_engine(seq_pair, seq_dist, monkeypatch, loop):
  """Power, once per loop kind, with the T5 draft at temperature 1: the
  chain loop with lenience 0.3 (and the baseline itself passes: the enumeration is
  right); an adaptive rule that peeks at the target's p; the tree rule that
  forgets the residual update after a rejected sibling (the next sibling
  tested against p itself)."""
  model, target, draft_params = seq_pair
  t5 = drafts.T5Draft(params=draft_params, model=model)
  sampling, dist = SETTINGS["temp1"], seq_dist("temp1")
  inputs = seq_inputs()
  if loop == "chain":
    bad = speculative_decode(model, target, t5, inputs, SEQ_KEY, gamma=2,
                             max_decode_len=SEQ_LEN, sampling=sampling, eos_id=SEQ_EOS,
                             lenience=0.3)
    base = temperature_sample(model, target, inputs, jax.random.PRNGKey(6),
                              max_decode_len=SEQ_LEN, sampling=sampling, eos_id=SEQ_EOS)
    assert sequence_pvalue(np.asarray(base.tokens), dist) > SIGNIFICANCE
  elif loop == "adaptive":
    bad = speculative_decode(model, target, PeekingDraft(t5, target, model), inputs, SEQ_KEY,
                             gamma=3, max_decode_len=SEQ_LEN, sampling=sampling,
                             eos_id=SEQ_EOS, adaptive=THRESHOLD(0.0))
  else:
    monkeypatch.setattr(tree_lib, "residual", lambda r, q: r)
    # JAX caches traces by function: drop them so that the loop is traced with
    # the wrong rule here, and again after, so that no later test reuses it.
    jax.clear_caches()
    try:
      bad = tree_speculative_decode(model, target, t5, inputs, SEQ_KEY, tree=SEQ_FULL,
                                    max_decode_len=SEQ_LEN, sampling=sampling, eos_id=SEQ_EOS)
    finally:
      monkeypatch.undo()
      jax.clear_caches()
  assert sequence_pvalue(np.asarray(bad.tokens), dist) < SIGNIFICANCE
