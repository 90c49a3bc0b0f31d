"""The per-round profile (specdec_jax.research.profile) and the cuts it measured.

The kernel's temperature-0 path skips the random draws and the residual
distribution (paper §2.3: with one-hot p both are determined); these tests
pin that its outputs are those of the general Algorithm 1 rule, written out
below as the reference, on every field, for one-hot p with one-hot or
arbitrary q; and that the sampling path is unchanged, key for key.
``sample_any`` now takes its inverse CDF in two levels (blocks, then within
a block): its draws are checked against the distribution over several
blocks, with zero-probability tokens and whole zero blocks, with and without
padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import drafts
from specdec_jax.research.profile import (RoundProfile, cache_contention, compare_acceptance,
                                 contention_markdown, decode_working_set_mb, markdown,
                                 profile_round)
from specdec_jax.sampling import SamplingConfig, _block_size, argmax, inverse_cdf, sample_any
from specdec_jax.speculative import KernelOutput, speculative_sampling
from stat_tests import pooled_chisquare_pvalue


def reference_kernel(key, draft_tokens, q, p, lenience=1.0, greedy=False, p_raw=None):
  """Algorithm 1 as a direct transcription: r ~ U(0, 1] for every position,
  the residual max(0, p - l q) normalized for the next token (argmax of it
  when greedy), q_{γ+1} := 0. The uniforms as the kernel draws them: one
  [B, γ+1] draw, r_i = 1 - u_i and u_{γ+1} for the next token."""
  b, gamma = draft_tokens.shape
  u = jax.random.uniform(key, (b, gamma + 1))
  px = jnp.take_along_axis(p[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
  qx = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
  if greedy and lenience < 1.0:
    raw_x = jnp.take_along_axis(p_raw, draft_tokens[..., None], axis=-1)[..., 0]
    accept = raw_x >= lenience * jnp.max(p_raw, axis=-1)
  else:
    r = 1.0 - u[:, :gamma]
    accept = (r * (lenience * qx) <= px) & (px > 0)
  accepted = jnp.cumprod(accept.astype(jnp.int32), axis=-1).astype(bool)
  n = jnp.sum(accepted, axis=-1).astype(jnp.int32)
  q_ext = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
  q_n = jnp.take_along_axis(q_ext, n[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(p_n - lenience * q_n, 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
  next_token = argmax(residual) if greedy else inverse_cdf(residual, u[:, gamma])
  min_pq = jnp.sum(jnp.minimum(p[:, :gamma], q), axis=-1)
  return KernelOutput(n, next_token, accepted, min_pq)


def _assert_same(out: KernelOutput, ref: KernelOutput):
  for name, a, b in zip(KernelOutput._fields, out, ref):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


B, GAMMA, V = 64, 4, 11


def _greedy_case(seed: int, one_hot_q: bool):
  """Rows with every acceptance count 0..γ: drafts copy p's argmax for a
  random prefix, then (usually) differ."""
  rng = np.random.default_rng(seed)
  best = rng.integers(0, V, (B, GAMMA + 1))
  p = np.eye(V, dtype=np.float32)[best]
  prefix = rng.integers(0, GAMMA + 1, B)
  x = np.where(np.arange(GAMMA)[None] < prefix[:, None], best[:, :GAMMA],
               rng.integers(0, V, (B, GAMMA)))
  if one_hot_q:
    q = np.eye(V, dtype=np.float32)[x]
  else:  # any distribution giving x positive mass
    q = rng.dirichlet(np.ones(V), (B, GAMMA)).astype(np.float32)
    np.put_along_axis(q, x[..., None], 0.5 + 0.5 * rng.random((B, GAMMA, 1)), -1)
    q = (q / q.sum(-1, keepdims=True)).astype(np.float32)
  p_raw = rng.dirichlet(np.ones(V), (B, GAMMA)).astype(np.float32)
  return jnp.asarray(x, jnp.int32), jnp.asarray(q), jnp.asarray(p), jnp.asarray(p_raw)


@pytest.mark.parametrize("one_hot_q", [True, False])
@pytest.mark.parametrize("lenience", [1.0, 0.6])
def test_greedy_kernel_equals_algorithm_1(one_hot_q, lenience):
  for seed in range(3):
    x, q, p, p_raw = _greedy_case(seed, one_hot_q)
    key = jax.random.PRNGKey(seed)
    out = speculative_sampling(key, x, q, p, lenience, True, p_raw)
    _assert_same(out, reference_kernel(key, x, q, p, lenience, True, p_raw))
    if lenience == 1.0:
      assert len(set(np.asarray(out.num_accepted).tolist())) == GAMMA + 1  # all counts seen


@pytest.mark.parametrize("lenience", [1.0, 0.5])
def test_sampling_kernel_unchanged_key_for_key(lenience):
  rng = np.random.default_rng(5)
  p = jnp.asarray(rng.dirichlet(np.ones(V), (B, GAMMA + 1)), jnp.float32)
  q = jnp.asarray(rng.dirichlet(np.ones(V) * 0.3, (B, GAMMA)), jnp.float32)
  q = q.at[:7].set(p[:7, :GAMMA])  # q = p rows: all accepted, bonus from p_{γ+1}
  x = jnp.asarray(rng.integers(0, V, (B, GAMMA)), jnp.int32)
  for seed in range(3):
    key = jax.random.PRNGKey(seed)
    _assert_same(speculative_sampling(key, x, q, p, lenience),
                 reference_kernel(key, x, q, p, lenience))


@pytest.mark.parametrize("v", [1000, 1031])
def test_two_level_inverse_cdf_is_the_distribution(v):
  """Several blocks (V = 1000: 40 blocks of 25; V = 1031, prime: padded to
  blocks of 128): half the tokens zero, two whole blocks zero, a zero tail,
  positive mass on block edges; unnormalized; batch dims kept."""
  n, block = 200_000, _block_size(v)
  rng = np.random.default_rng(0)
  probs = rng.random(v) ** 3
  probs[rng.random(v) < 0.5] = 0
  probs[block:3 * block] = 0
  probs[-5:] = 0
  for edge in (0, block - 1, 3 * block, 4 * block - 1, v - 6):
    probs[edge] = 0.01
  draw = jax.jit(jax.vmap(lambda k: sample_any(k, jnp.asarray(7.3 * probs, jnp.float32))))
  tokens = np.asarray(draw(jax.random.split(jax.random.PRNGKey(3), n)))
  assert tokens.shape == (n,)
  # Fails outright if a zero-probability token was drawn.
  assert pooled_chisquare_pvalue(np.bincount(tokens, minlength=v), probs / probs.sum()) > 1e-3
  rows = sample_any(jax.random.PRNGKey(0), jnp.asarray(np.tile(probs, (2, 3, 1)), jnp.float32))
  assert rows.shape == (2, 3) and np.all(probs[np.asarray(rows)] > 0)


def test_two_level_inverse_cdf_one_hot_and_small_vocab():
  for v, t in ((5, 3), (128, 127), (129, 128), (1031, 1030), (8000, 0), (8000, 7999)):
    p = jnp.zeros((4, v)).at[:, t].set(1.0)
    np.testing.assert_array_equal(sample_any(jax.random.PRNGKey(v), p), [t] * 4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_profile_round_runs_and_adds_up(tiny_target, tiny_draft, temperature):
  model, params = tiny_target
  dm, dp = tiny_draft
  draft = drafts.build("t5", model=dm, params=dp)
  examples = [jax.random.randint(jax.random.PRNGKey(i), (1, 8), 2, 64).astype(jnp.int32)
              for i in range(2)]
  r = profile_round(model, params, draft, examples, 2, SamplingConfig(temperature=temperature),
                    max_decode_len=12, position=3, inner=2, repeats=1)
  assert isinstance(r, RoundProfile) and r.gamma == 2 and r.temperature == temperature
  for v in (r.draft_ms, r.standardize_q_ms, r.target_ms, r.kernel_ms, r.chained_ms):
    assert v > 0  # timed directly
  # round_ms is (decode - prefill) per round, a difference of two timings: on
  # these micro models under load it can come out <= 0 (seen in CI), so only
  # its arithmetic is checked.
  assert np.isfinite(r.round_ms)
  assert r.rounds >= 2 and r.tokens >= r.rounds
  assert r.pieces_ms + r.rest_ms == pytest.approx(r.round_ms)
  assert r.interplay_ms + r.bookkeeping_ms == pytest.approx(r.rest_ms)
  table = markdown([r]).splitlines()
  assert len(table) == 3 and table[2].startswith(f"| {temperature:g} | 2 |")


@pytest.mark.parametrize("tied", [False, True])
def test_decode_working_set_counts_what_a_decode_step_reads(tied):
  """The MB figure equals 4 bytes x the parameters one cached decode step
  touches: every decoder-layer kernel but the cross-attention K/V projections
  (used once per example), plus the logits matrix (the embedding when tied)."""
  from specdec_jax.models.t5 import T5Config, param_shapes
  cfg = T5Config(vocab_size=96, d_model=24, num_heads=2, head_dim=8, num_encoder_layers=2,
                 num_decoder_layers=3, d_ff=40, version="1.0" if tied else "1.1")
  flat = jax.tree_util.tree_flatten_with_path(param_shapes(cfg))[0]
  names = ["/".join(str(getattr(k, "key", k)) for k in path) for path, _ in flat]
  read = 0
  for name, (_, leaf) in zip(names, flat):
    in_layer = name.startswith("decoder/layers_") and "norm" not in name
    cross_kv = "encoder_decoder_attention/key" in name or "encoder_decoder_attention/value" in name
    logits = name.startswith("decoder/logits_dense") or (tied and name.startswith("token_embedder"))
    if (in_layer and not cross_kv) or logits:
      read += int(np.prod(leaf.shape))
  assert read > 0
  assert decode_working_set_mb(cfg) == pytest.approx(4 * read / 2 ** 20)


def test_cache_contention_rows(tiny_target):
  model, params = tiny_target
  inputs = jax.random.randint(jax.random.PRNGKey(0), (1, 8), 2, 64).astype(jnp.int32)
  rows = cache_contention(model, params, inputs, [1, 2], [0.25], cache_len=12, position=3,
                          inner=2, repeats=1)
  assert [(r.k, r.megabytes) for r in rows] == [(1, 0.0), (1, 0.25), (2, 0.0), (2, 0.25)]
  for r in rows:
    assert r.alone_ms > 0 and np.isfinite(r.pass_ms)
    assert (r.read_ms > 0) == (r.megabytes > 0)
    if r.megabytes == 0:
      assert r.slowdown == 1.0
  assert len(contention_markdown(rows).splitlines()) == 2 + len(rows)


def test_compare_acceptance_against_a_revision():
  """The old kernel is loaded from git with its own sampler and timed beside
  the current one; at T = 0 their outputs must agree whatever the revision."""
  rows = compare_acceptance("HEAD", vocab_size=64, gammas=[2], temperatures=[0.0, 1.0],
                            inner=2, repeats=1)
  assert [r["what"] for r in rows] == ["standardize p + kernel"] * 2 + [
      "softmax + sample_any (one row)"]
  assert all(r["rev_us"] > 0 and r["now_us"] > 0 for r in rows)
  assert rows[0]["temperature"] == 0.0 and rows[0]["identical"] == [True] * 4


def test_adaptive_pieces_times_both_paths(tiny_target, tiny_draft):
  """``--adaptive_pieces``: one row per k with all four pieces timed; the
  switch branch computes what ``decode`` does (checked in test_model), so here
  only that every piece ran and was timed."""
  from specdec_jax.research.profile import adaptive_pieces, adaptive_pieces_markdown
  model, params = tiny_target
  dm, dp = tiny_draft
  draft = drafts.T5Draft(params=dp, model=dm)
  x = jax.random.randint(jax.random.PRNGKey(2), (1, 10), 2, 64)
  rows = adaptive_pieces(model, params, draft, x, [1, 3], 3, SamplingConfig(), cache_len=48,
                         inner=2, repeats=2)
  assert [r.k for r in rows] == [1, 3]
  assert all(v > 0 for r in rows for v in r[1:])
  table = adaptive_pieces_markdown(rows)
  assert table.count("\n") == 3 and "switch branch + write ms" in table


def test_adaptive_replay_reproduces_the_rules_rounds(tiny_target, tiny_draft):
  """``--adaptive_replay``: the rule's recorded widths, replayed as a fixed
  schedule, give the same tokens and widths (``adaptive_replay`` raises
  otherwise; checked here against a schedule that is *not* the rule's, so the
  check can fail), and every setting is timed."""
  from specdec_jax.decoding import AdaptiveConfig, speculative_decode
  from specdec_jax.research.profile import WidthSchedule, adaptive_replay, adaptive_replay_markdown
  model, params = tiny_target
  dm, dp = tiny_draft
  draft = drafts.T5Draft(params=dp, model=dm)
  x = jax.random.randint(jax.random.PRNGKey(3), (2, 10), 2, 64)
  # skip_below: rounds that propose nothing (width 0) are replayed too.
  rule = AdaptiveConfig("cumulative", threshold=0.7, skip_below=0.8)
  result = adaptive_replay(model, params, draft, x, jax.random.PRNGKey(0), rule, 3,
                           SamplingConfig(temperature=1.0), max_decode_len=12, repeats=1)
  names = [r.setting for r in result.rows]
  assert names == ["rule", "replay", "shuffled", "width 0", "width 1", "width 2", "width 3",
                   "fixed 1", "fixed 2", "fixed 3"]
  assert all(r.ms_per_round > 0 and r.tokens_per_call >= 1 for r in result.rows)
  hist = result.gamma_hist
  assert sum(hist) > 0 and result.predicted_ms > 0
  # The rule's tokens per call equal the replay's (same rounds).
  assert result.rows[0].tokens_per_call == result.rows[1].tokens_per_call
  assert "predicted" in adaptive_replay_markdown(result)
  # The rule's rounds used at least two widths, so reproducing them by a
  # schedule is not the trivial constant case.
  assert sum(h > 0 for h in hist) >= 2, hist


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
  from specdec_jax.decoding import speculative_decode
  from specdec_jax.models.t5 import shift_right
  from specdec_jax.research.profile import along_outputs, engine_records
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
  from specdec_jax.research.profile import EngineRecords, head_auc
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
  from specdec_jax.research.profile import auc
  assert auc([1, 2, 3, 4], [0, 0, 1, 1]) == 1.0 and auc([1, 2, 3, 4], [1, 1, 0, 0]) == 0.0
  assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == 0.75
  assert auc([1, 1, 1, 1], [0, 1, 0, 1]) == 0.5 and auc([2, 2, 1], [1, 0, 0]) == 0.75
  assert np.isnan(auc([1, 2], [1, 1]))


def test_confidence_auc_reads_the_rounds_verdicts(tiny_target, tiny_draft):
  """``--confidence_auc``: a draft equal to the target has every evaluated
  proposal accepted (q = p passes Algorithm 1's test surely), so the counts
  read off successive rounds' starts are right; the target with noise on
  its weights is rejected at times, and both confidences are scored."""
  from specdec_jax.research.profile import confidence_auc
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


@pytest.mark.parametrize("one_hot_q", [True, False])
def test_greedy_kernel_from_argmax_equals_the_kernel(one_hot_q):
  """The engine's T=0 path (``greedy_kernel``, from the target's argmax
  tokens alone) gives the general kernel's outputs on the one-hot p, field
  for field, with and without per-row proposal counts."""
  from specdec_jax.speculative import greedy_kernel
  for seed in range(3):
    x, q, p, _ = _greedy_case(seed, one_hot_q)
    best = argmax(p)
    for proposed in (None, jnp.asarray(np.arange(B) % (GAMMA + 1), jnp.int32)):
      want = speculative_sampling(jax.random.PRNGKey(seed), x, q, p, 1.0, True,
                                  proposed=proposed)
      _assert_same(greedy_kernel(x, q, best, proposed), want)
      assert len(set(np.asarray(want.num_accepted).tolist())) == GAMMA + 1


def test_round_counting_drafts_reuse_the_targets_encoding():
  """``WidthSchedule`` (and the other round-counting wrappers) hand the
  engine's target encoding to the inner draft: before, they had only
  ``init``, so a bridged draft ran the target's encoder a second time in
  every replayed example and the replay timed it as rounds."""
  from specdec_jax.drafts.base import init_draft
  from specdec_jax.research.profile import WidthSchedule

  class Inner:
    def init(self, inputs, cache_len):
      raise AssertionError("init called: the target's encoding was dropped")

    def init_with_target(self, inputs, cache_len, target_encoded):
      return ("state", cache_len, target_encoded)

  state = init_draft(WidthSchedule(Inner(), jnp.ones((3,), jnp.int32)), jnp.ones((1, 4)), 9,
                     "encoded")
  assert state[0] == ("state", 9, "encoded") and int(state[1]) == 0
