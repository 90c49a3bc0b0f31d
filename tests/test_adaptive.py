"""Adaptive draft length (``decoding.AdaptiveConfig``): per-row γ each round,
beyond the exactness matrix (test_exactness.py, which holds the adaptive
loop's token-for-token and whole-sequence distribution cells and its power
cell). Here: the cost of rounds that stop early (narrowest covering
verification width, fewer draft steps; checked through SpecStats), the
schedule's growth, the fallback for drafts without ``propose_adaptive``, the
drafts' stopping rules against ``stop_count``, the capped kernel round, a
skip decided on the drawn token caught by the enumeration, threshold 0 equal
to the fixed-γ loop at T = 1, and bad configs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from specdec_jax import drafts
from specdec_jax.decoding import AdaptiveConfig, speculative_decode
from specdec_jax.drafts.base import (adaptive_proposal, drawn_probability, stop_count,
                                     top_probability)
from specdec_jax.sampling import SamplingConfig, standardize
from specdec_jax.speculative import speculative_sampling
from exactness_cases import (INPUTS, KEY, MAX_LEN, SEQ_EOS, SEQ_INPUT, SEQ_KEY, SEQ_LEN,
                             SETTINGS, SIGNIFICANCE, Cell, check_adaptive,
                             exact_sequence_distribution, noisy, pick_greedy_case, seq_inputs,
                             sequence_pvalue)
from exactness_cases import seq_models as build_seq_models
from test_speculative import chi2_pvalue


@pytest.fixture(scope="module")
def greedy_case(tiny_target):
  """(eos, baseline) on ``INPUTS``: rows end at different EOS positions."""
  return pick_greedy_case(*tiny_target)


@pytest.fixture(scope="module")
def seq_models():
  return build_seq_models()


@pytest.fixture(scope="module")
def near_draft(tiny_target):
  """The target with Gaussian noise (0.2 std) on every weight: α ≈ 0.5 at
  T = 0, so rounds end both by rejection and by stopping. Same model as the
  target, so a draft equal to the target shares its compilations."""
  model, params = tiny_target
  return drafts.T5Draft(params=noisy(params, 0.2), model=model)


def _greedy(tiny_target, draft, eos, gamma_max, adaptive, inputs=INPUTS):
  model, params = tiny_target
  return speculative_decode(model, params, draft, inputs, KEY, gamma=gamma_max,
                            max_decode_len=MAX_LEN, eos_id=eos, adaptive=adaptive)


def _widths(gamma_max):
  return AdaptiveConfig("threshold", 0.0).verify_widths(gamma_max)


# ------------------------------------------------------------------- T = 0

GREEDY = {
    "threshold0_g4": (4, AdaptiveConfig("threshold", 0.0)),
    "threshold1_g4": (4, AdaptiveConfig("threshold", 1.0)),
    "threshold0.9_g7": (7, AdaptiveConfig("threshold", 0.9)),
    "schedule_g7_from1": (7, AdaptiveConfig("schedule", initial_gamma=1)),
    "threshold0.9_skip0.8_g4": (4, AdaptiveConfig("threshold", 0.9, skip_below=0.8)),
}


@pytest.mark.parametrize("case,expect", [("threshold0_g4", ("alpha", "fixed_costs")),
                                         ("threshold1_g4", ("alpha", "one_step"))])
def test_thresholds_0_and_1_cost_the_fixed_loop_and_one_step(tiny_target, near_draft,
                                                            greedy_case, case, expect):
  """Threshold 0 never stops early: γ_max draft steps and γ_max + 1 target
  positions a round, the fixed-γ loop's costs. Threshold 1 stops every row
  after x_1: one draft step a round and the width-1 branch (2 target
  positions a call), though γ_max = 4. Both token for token the baseline."""
  eos, base = greedy_case
  gamma_max, adaptive = GREEDY[case]
  out = _greedy(tiny_target, near_draft, eos, gamma_max, adaptive)
  np.testing.assert_array_equal(out.tokens, base.tokens)
  np.testing.assert_array_equal(out.length, base.length)
  check_adaptive(jax.tree_util.tree_map(np.asarray, out.stats),
                 Cell("adaptive", "near", gamma_max, adaptive, expect=expect))


@pytest.mark.parametrize("case,widths", [("threshold0.9_g7", [1, 2, 4, 7]),
                                          ("threshold0.9_skip0.8_g4", [0, 1, 2, 4])])
def test_each_round_verifies_at_the_narrowest_covering_width(tiny_target, near_draft,
                                                             greedy_case, case, widths):
  """Rows run alone (batch 1): the draft runs exactly the row's proposals
  (early exit; a skipped round still ran the step that gave q_1) and each
  round's target pass has the smallest compiled width k >= γ_row (k + 1
  positions; a skipped round scores one); tokens equal the row's in the batch."""
  eos, base = greedy_case
  gamma_max, adaptive = GREEDY[case]
  assert list(adaptive.verify_widths(gamma_max)) == widths
  widths = np.array(widths)
  cover = np.array([widths[widths >= j].min() + 1 for j in range(gamma_max + 1)])
  batch = _greedy(tiny_target, near_draft, eos, gamma_max, adaptive)
  if case == "threshold0.9_g7":  # the threshold rule without skipping, vs the baseline
    np.testing.assert_array_equal(batch.tokens, base.tokens)
    np.testing.assert_array_equal(batch.length, base.length)
    check_adaptive(jax.tree_util.tree_map(np.asarray, batch.stats),
                   Cell("adaptive", "near", gamma_max, adaptive, expect=("alpha", "varies")))
  narrow = 0
  for i in range(INPUTS.shape[0]):
    one = _greedy(tiny_target, near_draft, eos, gamma_max, adaptive, INPUTS[i:i + 1])
    np.testing.assert_array_equal(one.tokens[0], batch.tokens[i])
    hist = np.asarray(one.stats.gamma_hist[0])
    steps = np.maximum(np.arange(gamma_max + 1), 1)
    assert int(one.stats.draft_calls[0]) == hist @ steps
    assert int(one.stats.target_positions[0]) == hist @ cover
    narrow += hist[:gamma_max].sum()
  assert narrow > 0  # some rounds really ran a width below γ_max


def test_schedule_grows_by_two_after_full_acceptance(tiny_target, greedy_case):
  """Draft = target: every round accepts all γ_row drafts, so γ_row runs
  1, 3, 5, 7, 7, ... (HF's +2, capped at γ_max)."""
  model, params = tiny_target
  eos, base = greedy_case
  gamma_max, adaptive = GREEDY["schedule_g7_from1"]
  out = _greedy(tiny_target, drafts.T5Draft(params=params, model=model), eos, gamma_max,
                adaptive)
  np.testing.assert_array_equal(out.tokens, base.tokens)
  assert np.all(out.stats.rejected == 0)
  for row, n in enumerate(np.asarray(base.length)):
    want, g, left = np.zeros(gamma_max + 1, int), 1, int(n)
    while left > 0:
      want[g] += 1
      left -= g + 1
      g = min(g + 2, gamma_max)
    np.testing.assert_array_equal(out.stats.gamma_hist[row], want, err_msg=f"row {row}")


@struct.dataclass
class _ProposeOnly:
  """A draft with init/propose/commit only (no propose_adaptive)."""
  inner: Any
  vocab_size: int = struct.field(pytree_node=False, default=64)

  def init(self, inputs, cache_len):
    return self.inner.init(inputs, cache_len)

  def propose(self, *args):
    return self.inner.propose(*args)

  def commit(self, state, seq, length):
    return self.inner.commit(state, seq, length)


def test_drafts_without_propose_adaptive_fall_back(tiny_target, greedy_case):
  """A draft without propose_adaptive: the fallback proposes γ_max and keeps
  γ_row of them (exact, no early exit: γ_max draft steps a round)."""
  eos, base = greedy_case
  draft = _ProposeOnly(drafts.build("prompt_lookup", vocab_size=64))
  assert not hasattr(draft, "propose_adaptive")
  out = _greedy(tiny_target, draft, eos, 4, AdaptiveConfig("schedule"))
  np.testing.assert_array_equal(out.tokens, base.tokens)
  st = out.stats
  np.testing.assert_array_equal(st.draft_calls, 4 * st.target_calls)
  assert np.asarray(st.gamma_hist)[:, :4].sum() > 0  # the schedule moved off γ_max


def test_lookup_t5_copies_count_as_certain(near_draft):
  """A copied position has confidence 1, a T5 position its model's own. With
  the T5 draft's final norm zeroed its logits are 0 (softmax 1/V, always
  unsure), so at threshold 0.5 a row proposes exactly its copied run and one
  T5 token after it (at T = 0, where every q is one-hot and only the
  ``certain`` flag tells a copy from a T5 guess)."""
  params = jax.tree_util.tree_map(lambda x: x, near_draft.params)
  params["decoder"]["decoder_norm"]["scale"] = jnp.zeros_like(
      params["decoder"]["decoder_norm"]["scale"])
  draft = drafts.LookupT5Draft(t5=near_draft.replace(params=params))
  b, gamma = INPUTS.shape[0], 4
  seq = jnp.zeros((b, 40), jnp.int32)
  # Row 0 ends in a bigram seen before, followed by 3 tokens: "5 6 7 8 9 5 6".
  seq = seq.at[0, 1:8].set(jnp.array([5, 6, 7, 8, 9, 5, 6]))
  length = jnp.full((b,), 7, jnp.int32)
  state = draft.init(INPUTS, 40)
  for cumulative in (False, True):
    _, _, count, _, _ = draft.propose_adaptive(
        state, seq, length, gamma, SamplingConfig(), KEY, jnp.full((b,), gamma), 0.5,
        cumulative=cumulative)
    _, copy_at = draft.copy_plan(state, seq, length, gamma)
    run = np.asarray(jnp.sum(jnp.cumprod(copy_at.astype(jnp.int32), 1), 1))
    assert run[0] >= 2 and run.min() < gamma - 1, run  # copies of several lengths
    np.testing.assert_array_equal(np.asarray(count), np.minimum(run + 1, gamma))


def _t1_start(draft, gamma=6):
  """A T = 1 round's inputs at length 0 for ``draft``: (sampling, γ, state,
  seq, length, limit = γ)."""
  b = INPUTS.shape[0]
  seq, length = jnp.zeros((b, 40), jnp.int32), jnp.zeros((b,), jnp.int32)
  return (SamplingConfig(temperature=1.0), gamma, draft.init(INPUTS, 40), seq, length,
          jnp.full((b,), gamma, jnp.int32))


def test_cumulative_matches_stop_count(near_draft):
  """T5Draft.propose_adaptive's running product stops where ``stop_count``
  (cumulative) says, from the same proposals' confidences (T = 1, same key)."""
  t1, gamma, state, seq, length, limit = _t1_start(near_draft)
  _, q, _ = near_draft.propose(state, seq, length, gamma, t1, KEY)
  conf = top_probability(q, None, t1)
  for threshold in (0.05, 0.2, 0.5):
    _, _, count, steps, _ = near_draft.propose_adaptive(
        state, seq, length, gamma, t1, KEY, limit, threshold, cumulative=True)
    want = stop_count(conf, limit, threshold, cumulative=True)
    np.testing.assert_array_equal(count, want, err_msg=str(threshold))
    assert int(steps) == int(jnp.max(want))  # early exit after the longest row
    assert np.all(np.asarray(want) <= np.asarray(stop_count(conf, limit, threshold)))


def test_drawn_confidence_matches_stop_count(near_draft):
  """confidence='drawn': T5Draft.propose_adaptive stops where ``stop_count``
  says from q_i(x_i) of the same proposals (T = 1, same key), which is not
  where max q_i would stop it, and the generic fallback agrees; skip_below
  still reads q_1's top probability."""
  t1, gamma, state, seq, length, limit = _t1_start(near_draft)
  tokens, q, _ = near_draft.propose(state, seq, length, gamma, t1, KEY)
  drawn, top = drawn_probability(q, None, tokens, t1), top_probability(q, None, t1)
  assert np.all(np.asarray(drawn) <= np.asarray(top) + 1e-6)
  # One compilation per (draft, skip, cumulative); the threshold is traced.
  counts = jax.jit(lambda d, threshold, skip, cumulative: adaptive_proposal(
      d, state, seq, length, gamma, t1, KEY, limit, threshold, skip, cumulative,
      drawn=True)[2], static_argnums=(2, 3))
  differ = 0
  for cumulative, skip in ((False, None), (True, 0.3)):
    for threshold in (0.05, 0.2, 0.5):
      want = stop_count(drawn, limit, threshold, skip, cumulative, first_top=top[:, 0])
      msg = f"{cumulative} {threshold} {skip}"
      np.testing.assert_array_equal(counts(near_draft, threshold, skip, cumulative), want,
                                    err_msg=msg)
      np.testing.assert_array_equal(counts(_ProposeOnly(near_draft), threshold, skip,
                                           cumulative), want, err_msg=msg)
      differ += int(np.any(np.asarray(want) != np.asarray(
          stop_count(top, limit, threshold, skip, cumulative))))
  assert differ >= 3, differ  # the two confidences really stop rows differently


def test_skip_below_needs_a_propose_adaptive_that_takes_it(near_draft):
  @struct.dataclass
  class Old:  # propose_adaptive written before skip_below existed
    inner: drafts.T5Draft
    vocab_size: int = struct.field(pytree_node=False, default=64)

    def propose_adaptive(self, state, seq, length, gamma, sampling, key, limit, threshold):
      return self.inner.propose_adaptive(state, seq, length, gamma, sampling, key, limit,
                                         threshold)

  old = Old(near_draft)
  state = near_draft.init(INPUTS, 30)
  seq, length = jnp.zeros((INPUTS.shape[0], 30), jnp.int32), jnp.zeros(INPUTS.shape[0], jnp.int32)
  args = (old, state, seq, length, 2, SamplingConfig(), KEY, length + 2, 0.5)
  assert adaptive_proposal(*args)[2].shape == (INPUTS.shape[0],)  # without skip_below: fine
  with pytest.raises(drafts.DraftInterfaceError, match="skip_below"):
    adaptive_proposal(*args, skip_below=0.3)
  with pytest.raises(drafts.DraftInterfaceError, match="cumulative"):
    adaptive_proposal(*args, cumulative=True)


# ------------------------------------------------------------- the kernel
# Monte Carlo as in test_speculative.py (chi-square at 1e-3, fixed seed):
# fixed, clearly different p_1..p_4 per position, so a token taken from the
# wrong position's distribution is a large effect at N = 100k.

KV, KN, KK = 6, 100_000, 3
_rng = np.random.default_rng(1)
KP = np.stack([_rng.dirichlet(np.ones(KV) * 0.5) for _ in range(KK + 1)])   # p_1..p_4
KQ = 0.5 * KP[:KK] + 0.5 * np.stack([_rng.dirichlet(np.ones(KV)) for _ in range(KK)])  # q_1..q_3


@jax.jit
def _capped_round(key):
  """One round of k = 3 drafts ~ KQ against KP, row b proposing only c_b = b % 4."""
  k_x, k_kernel = jax.random.split(key)
  q = jnp.broadcast_to(jnp.asarray(KQ, jnp.float32), (KN, KK, KV))
  p = jnp.broadcast_to(jnp.asarray(KP, jnp.float32), (KN, KK + 1, KV))
  x = jax.random.categorical(k_x, jnp.log(q)).astype(jnp.int32)
  proposed = jnp.arange(KN, dtype=jnp.int32) % (KK + 1)
  full = speculative_sampling(k_kernel, x, q, p)
  return x, proposed, speculative_sampling(k_kernel, x, q, p, proposed=proposed), full


def test_capped_round_takes_the_bonus_from_the_right_position():
  """Rows that proposed c of the k tested drafts: the first token is ~ p_1
  (bonus from p_1 when c = 0, Algorithm 1 otherwise), a row whose c drafts
  all passed takes its next token from p_{c+1}, and nothing past c counts."""
  x, proposed, out, full = _capped_round(jax.random.PRNGKey(2))
  x, proposed = np.asarray(x), np.asarray(proposed)
  n, nxt = np.asarray(out.num_accepted), np.asarray(out.next_token)
  assert np.all(n <= proposed)
  assert not np.asarray(out.accepted)[np.arange(1, KK + 1)[None] > proposed[:, None]].any()
  # Same uniforms: verdicts on the proposed positions are the full round's,
  # and rows that proposed all k drafts get the full round's next token.
  np.testing.assert_array_equal(n, np.minimum(np.asarray(full.num_accepted), proposed))
  every = proposed == KK
  np.testing.assert_array_equal(nxt[every], np.asarray(full.next_token)[every])
  for c in range(KK + 1):
    rows = proposed == c
    first = np.where(n[rows] >= 1, x[rows, 0], nxt[rows])
    assert chi2_pvalue(first, KP[0]) > SIGNIFICANCE, c
    passed = rows & (n == c)
    assert passed.sum() > 2000
    assert chi2_pvalue(nxt[passed], KP[c]) > SIGNIFICANCE, c


# ------------------------------------------------------------------- T > 0
# The enumeration of exactness_cases (20k sequences, chi-square at 1e-3,
# fixed seed 5), γ_max = 3 (widths 1, 2, 3).

SEQ_GAMMA_MAX = 3


def _seq_decode(seq_models, draft, sampling, adaptive):
  model, target, _ = seq_models
  return speculative_decode(model, target, draft, seq_inputs(), SEQ_KEY, gamma=SEQ_GAMMA_MAX,
                            max_decode_len=SEQ_LEN, sampling=sampling, eos_id=SEQ_EOS,
                            adaptive=adaptive)


@struct.dataclass
class SkipByDrawnDraft:
  """A deliberately wrong rule: it skips the round when x_1 is improbable
  under q_1 (q_1(x_1) <= 0.3), i.e. decides on x_1 from x_1 itself, so a
  proposed x_1 is not ~ q_1 (``drafts.base.skip_unsure``)."""

  inner: drafts.T5Draft

  @property
  def vocab_size(self) -> int:
    return self.inner.vocab_size

  def init(self, inputs, cache_len):
    return self.inner.init(inputs, cache_len)

  def propose(self, state, seq, length, gamma, sampling, key):
    return self.inner.propose(state, seq, length, gamma, sampling, key)

  def propose_adaptive(self, state, seq, length, gamma, sampling, key, limit, threshold,
                       skip_below=None):
    tokens, q, count, steps, state = self.inner.propose_adaptive(
        state, seq, length, gamma, sampling, key, limit, threshold, skip_below=skip_below)
    first = drawn_probability(q[:, 0], None, tokens[:, 0], sampling)
    return tokens, q, jnp.where(first > 0.3, count, 0), steps, state

  def commit(self, state, seq, length):
    return state


def test_a_skip_on_the_drawn_token_is_caught(seq_models):
  """Power: the enumeration test rejects skipping by q_1(x_1) (why skip_below
  reads q_1's top probability even with confidence='drawn')."""
  model, target, draft_params = seq_models
  sampling = SETTINGS["temp1"]
  draft = SkipByDrawnDraft(drafts.T5Draft(params=draft_params, model=model))
  out = _seq_decode(seq_models, draft, sampling,
                    AdaptiveConfig("threshold", 0.0, skip_below=0.0))
  hist = np.asarray(out.stats.gamma_hist).sum(0)
  assert hist[0] > hist.sum() // 20, hist  # rounds really were skipped
  dist = exact_sequence_distribution(model, target, sampling)
  assert sequence_pvalue(np.asarray(out.tokens), dist) < SIGNIFICANCE


def test_threshold_zero_is_the_fixed_gamma_loop_at_t1(seq_models):
  """Never stopping reproduces fixed γ = γ_max sample for sample (same key:
  T5Draft's adaptive proposals use propose's per-step keys, the kernel the
  same key, and a round using every position keeps the kernel's bonus)."""
  model, target, draft_params = seq_models
  draft = drafts.T5Draft(params=draft_params, model=model)
  kw = dict(gamma=SEQ_GAMMA_MAX, max_decode_len=SEQ_LEN, sampling=SETTINGS["temp1"],
            eos_id=SEQ_EOS)
  inputs = jnp.repeat(SEQ_INPUT, 1000, 0)
  fixed = speculative_decode(model, target, draft, inputs, KEY, **kw)
  adaptive = speculative_decode(model, target, draft, inputs, KEY,
                                adaptive=AdaptiveConfig("threshold", 0.0), **kw)
  np.testing.assert_array_equal(adaptive.tokens, fixed.tokens)
  for field in ("target_calls", "draft_calls", "accepted_at", "evaluated_at", "rejected",
                "gamma_hist", "target_positions"):
    np.testing.assert_array_equal(getattr(adaptive.stats, field), getattr(fixed.stats, field),
                                  err_msg=field)


# ----------------------------------------------------------- rules, errors


def test_stop_count_and_confidence():
  conf = jnp.array([[0.9, 0.2, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9], [0.1, 0.9, 0.9, 0.9],
                    [0.9, 0.9, 0.9, 0.9]])
  limit = jnp.array([4, 2, 4, 0])
  np.testing.assert_array_equal(stop_count(conf, limit, 0.5), [2, 2, 1, 0])
  np.testing.assert_array_equal(stop_count(conf, limit, 0.0), [4, 2, 4, 0])
  np.testing.assert_array_equal(stop_count(conf, limit, 1.0), [1, 1, 1, 0])
  np.testing.assert_array_equal(stop_count(conf[:, :1], jnp.array([1, 1, 1, 0]), 0.5),
                                [1, 1, 1, 0])
  # skip_below: a row unsure of x_1 proposes nothing; the rest is unchanged.
  np.testing.assert_array_equal(stop_count(conf, limit, 0.5, skip_below=0.5), [2, 2, 0, 0])
  np.testing.assert_array_equal(stop_count(conf, limit, 0.0, skip_below=0.95), [0, 0, 0, 0])
  np.testing.assert_array_equal(stop_count(conf, limit, 0.0, skip_below=0.0), [4, 2, 4, 0])
  # cumulative: the running product 0.9, 0.81, 0.729 crosses 0.75 after x_3.
  np.testing.assert_array_equal(stop_count(conf, limit, 0.75, cumulative=True), [2, 2, 1, 0])
  np.testing.assert_array_equal(stop_count(conf[1:2], jnp.array([4]), 0.75), [4])
  np.testing.assert_array_equal(stop_count(conf[1:2], jnp.array([4]), 0.75, cumulative=True),
                                [3])
  logits = jnp.log(jnp.array([[0.7, 0.2, 0.1]]))
  greedy, t1 = SamplingConfig(), SamplingConfig(temperature=1.0)
  q0 = standardize(logits, greedy)
  np.testing.assert_allclose(top_probability(q0, logits, greedy), [0.7], rtol=1e-6)
  np.testing.assert_allclose(top_probability(q0, None, greedy), [1.0])  # one-hot fallback
  np.testing.assert_allclose(top_probability(standardize(logits, t1), logits, t1), [0.7],
                             rtol=1e-6)


def test_check_interface_checks_propose_adaptive(near_draft):
  drafts.check_interface("t5", near_draft, INPUTS, 64, 4, 30, SamplingConfig(), concrete=False)

  @struct.dataclass
  class Broken:
    inner: drafts.T5Draft
    vocab_size: int = struct.field(pytree_node=False, default=64)

    def init(self, inputs, cache_len):
      return self.inner.init(inputs, cache_len)

    def propose(self, *args):
      return self.inner.propose(*args)

    def propose_adaptive(self, *args):
      tokens, q, count, steps, state = self.inner.propose_adaptive(*args)
      return tokens, q, count[:, None], steps, state  # count [B, 1]: wrong

    def commit(self, state, seq, length):
      return state

  with pytest.raises(drafts.DraftInterfaceError, match="propose_adaptive"):
    drafts.check_interface("broken", Broken(near_draft), INPUTS, 64, 4, 30, SamplingConfig(),
                           concrete=False)

  @struct.dataclass
  class BrokenCumulative(Broken):
    def propose_adaptive(self, state, seq, length, gamma, sampling, key, limit, threshold,
                         skip_below=None, cumulative=False):
      out = self.inner.propose_adaptive(state, seq, length, gamma, sampling, key, limit,
                                        threshold, skip_below=skip_below)
      if cumulative:  # declared, but broken only on this path
        return out[0], out[1], out[2][:, None], out[3], out[4]
      return out

  with pytest.raises(drafts.DraftInterfaceError, match="cumulative=True"):
    drafts.check_interface("broken", BrokenCumulative(near_draft), INPUTS, 64, 4, 30,
                           SamplingConfig(), concrete=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(rule="threshold", threshold=1.5), "1.5"),
    (dict(rule="threshold", threshold=-0.1), "-0.1"),
    (dict(rule="threshold", threshold=float("nan")), "nan"),
    (dict(rule="threshold"), "None"),
    (dict(rule="greedy", threshold=0.5), "'greedy'"),
    (dict(rule="schedule", threshold=0.5), "threshold"),
    (dict(rule="threshold", threshold=0.5, initial_gamma=2), "initial_gamma"),
    (dict(rule="schedule", initial_gamma=0), "initial_gamma must be >= 1, got 0"),
    (dict(rule="schedule", widths=(0, 2)), r"\(0, 2\)"),
    (dict(rule="threshold", threshold=0.5, widths=(0, 2)), "0 only with skip_below"),
    (dict(rule="threshold", threshold=0.5, skip_below=1.5), "skip_below must be in"),
    (dict(rule="threshold", threshold=0.5, skip_below=float("nan")), "nan"),
    (dict(rule="schedule", skip_below=0.2), "skip_below .* only, not 'schedule'"),
    (dict(rule="cumulative"), "'cumulative' needs a threshold"),
    (dict(rule="cumulative", threshold=1.2), "1.2"),
    (dict(rule="cumulative", threshold=0.5, initial_gamma=2), "initial_gamma"),
    (dict(rule="cumulative", threshold=0.5, confidence="sampled"), "'sampled'"),
    (dict(rule="schedule", confidence="drawn"), "'drawn' applies to rules .* not 'schedule'"),
])
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    AdaptiveConfig(**kwargs)


def test_bad_arguments_fail_before_any_work(tiny_target, near_draft):
  model, params = tiny_target
  kw = dict(max_decode_len=MAX_LEN)
  with pytest.raises(ValueError, match="gamma must be >= 1.*got 0"):
    speculative_decode(model, params, near_draft, INPUTS, KEY, gamma=0,
                       adaptive=AdaptiveConfig("threshold", 0.5), **kw)
  with pytest.raises(ValueError, match=r"initial_gamma \(5\) exceeds gamma .* 4"):
    speculative_decode(model, params, near_draft, INPUTS, KEY, gamma=4,
                       adaptive=AdaptiveConfig("schedule", initial_gamma=5), **kw)
  with pytest.raises(ValueError, match=r"widths \[8\] exceed gamma .* 4"):
    speculative_decode(model, params, near_draft, INPUTS, KEY, gamma=4,
                       adaptive=AdaptiveConfig("threshold", 0.5, widths=(2, 8)), **kw)
  with pytest.raises(ValueError, match="AdaptiveConfig"):
    speculative_decode(model, params, near_draft, INPUTS, KEY, gamma=4, adaptive="schedule",
                       **kw)
