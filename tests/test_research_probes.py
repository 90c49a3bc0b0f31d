"""Acceptance probes (lab.probes): the engine's rounds read
right, the AUC, and acceptance heads that find what the hidden state knows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import drafts
from specdec_jax.decoding import speculative_decode
from specdec_jax.models.t5 import shift_right
from lab.probes import (EngineRecords, along_outputs, auc, confidence_auc,
                        engine_records, head_auc)
from specdec_jax.sampling import SamplingConfig


def _noisy(params, scale: float = 0.3, seed: int = 5):
  """``params`` with Gaussian noise of ``scale`` × each leaf's std: a draft
  that agrees with the target often but not always."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree_util.tree_unflatten(treedef, [
      a + scale * jnp.std(a) * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])


def test_engine_records_follow_the_rounds(tiny_target):
  """``engine_records`` + ``along_outputs`` at T=0 read the engine's own
  rounds right: at every output position a draft step saw, the recorded
  confidence is the draft's own softmax maximum teacher-forced along the
  output and the verdict is whether its argmax is the output's token (at
  T=0 that is Algorithm 1's test); the walk over the positions reproduces
  the engine's accepted/rejected counts; the hidden states are the draft's
  width. The draft is the target with noise on its weights, so that both
  verdicts occur."""
  model, params = tiny_target
  dp = _noisy(params)
  draft = drafts.T5Draft(params=dp, model=model)
  x = jax.random.randint(jax.random.PRNGKey(4), (3, 10), 2, 64)
  gamma = 2
  rec = engine_records(model, params, draft, x, jax.random.PRNGKey(0), gamma, SamplingConfig(),
                       max_decode_len=12)
  assert rec.hidden.shape == (len(rec.top), model.config.d_model)
  conf, ok, seen = along_outputs(rec)
  assert len(conf) == 3
  verdicts = []
  for i, (c, o, m) in enumerate(zip(conf, ok, seen)):
    out = speculative_decode(model, params, draft, x[i:i + 1], jax.random.PRNGKey(0),
                             gamma=gamma, max_decode_len=12, sampling=SamplingConfig(), eos_id=1)
    n = int(out.length[0])
    y = out.tokens[:, :n]
    logits = model(dp, x[i:i + 1], shift_right(y, model.config.decoder_start_id))[0]
    prob = np.asarray(jax.nn.softmax(logits, -1))
    k = len(c)  # the last round is left out
    assert 0 < k < n
    np.testing.assert_allclose(c[:k][m], prob.max(-1)[:k][m], atol=2e-4)
    np.testing.assert_array_equal(o[m], (prob.argmax(-1) == np.asarray(y[0]))[:k][m])
    assert np.all(o[~m]) and np.all(c[~m] == 1.0)
    verdicts.extend(o[m])
    # Replaying the rounds over the positions: x_1.. accepted while ok, the
    # round ends at the first rejection or after γ acceptances (+ bonus).
    t, acc, rej, rounds = 0, 0, 0, 0
    while t < k:
      run = 0
      while run < gamma and o[t + run]:
        run += 1
      acc += run
      rej += int(run < gamma)
      t += run + 1
      rounds += 1
    assert t == k
    # The left-out last round: one more target call, up to γ more
    # acceptances and at most one more rejection.
    assert rounds == int(out.stats.target_calls[0]) - 1
    assert acc <= int(out.stats.accepted[0]) <= acc + gamma
    assert rej <= int(out.stats.rejected[0]) <= rej + 1
  assert any(verdicts) and not all(verdicts), verdicts


def test_head_auc_finds_what_the_hidden_state_knows():
  """``head_auc``: when acceptance depends on the top probability and on
  one hidden unit, the predictor with the hidden state ranks better than
  the one on the softmax statistics, which ranks like the top probability
  alone; with no hidden signal the hidden state adds nothing (fixed seed;
  4000 positions each, where the AUC's standard error is about 0.007)."""
  rng = np.random.default_rng(0)

  def records(n, signal):
    top = rng.uniform(0.05, 1.0, n)
    second = (1 - top) * rng.uniform(0, 1, n)
    hidden = rng.normal(size=(n, 8)).astype(np.float32)
    logit = 4 * (top - 0.5) + signal * hidden[:, 0]
    accepted = rng.uniform(size=n) < 1 / (1 + np.exp(-logit))
    return EngineRecords(example=np.zeros(n, int), round=np.arange(n), index=rng.integers(0, 3, n),
                         hidden=hidden, top=top, second=second, entropy=-np.log(top),
                         accepted=accepted, gamma=3)

  a = head_auc(records(4000, 2.0), records(4000, 2.0))
  assert a["hidden"] > a["scalars"] + 0.05, a
  assert abs(a["scalars"] - a["top"]) < 0.02, a
  b = head_auc(records(4000, 0.0), records(4000, 0.0))
  assert abs(b["hidden"] - b["scalars"]) < 0.02, b


def test_auc_counts_ties_half():
  assert auc([1, 2, 3, 4], [0, 0, 1, 1]) == 1.0 and auc([1, 2, 3, 4], [1, 1, 0, 0]) == 0.0
  assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == 0.75
  assert auc([1, 1, 1, 1], [0, 1, 0, 1]) == 0.5 and auc([2, 2, 1], [1, 0, 0]) == 0.75
  assert np.isnan(auc([1, 2], [1, 1]))


def test_confidence_auc_reads_the_rounds_verdicts(tiny_target, tiny_draft):
  """``scripts/confidence_auc.py``: a draft equal to the target has every evaluated
  proposal accepted (q = p passes Algorithm 1's test surely), so the counts
  read off successive rounds' starts are right; the target with noise on
  its weights is rejected at times, and both confidences are scored."""
  model, params = tiny_target
  dm, dp = tiny_draft
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
  noisy = jax.tree_util.tree_unflatten(treedef, [
      a + 0.3 * jnp.std(a) * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])
  x = jax.random.randint(jax.random.PRNGKey(3), (4, 10), 2, 64)
  t1 = SamplingConfig(temperature=1.0)
  same = confidence_auc(model, params, drafts.T5Draft(params=params, model=model), x,
                        jax.random.PRNGKey(0), 3, t1, max_decode_len=16)
  assert same.rounds > 0 and same.acceptance == [1.0, 1.0, 1.0]
  other = confidence_auc(model, params, drafts.T5Draft(params=noisy, model=model), x,
                         jax.random.PRNGKey(0), 3, t1, max_decode_len=16)
  assert other.rounds > same.rounds and 0.05 < other.acceptance[0] < 0.95, other
  assert all(0 <= other.auc[k] <= 1 for k in ("top", "drawn")), other.auc
  with pytest.raises(ValueError, match="T > 0"):
    confidence_auc(model, params, drafts.T5Draft(params=dp, model=dm), x,
                   jax.random.PRNGKey(0), 3, SamplingConfig(), max_decode_len=16)
