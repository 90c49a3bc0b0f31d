"""Speculative decoding end to end: exact at temp 0 (token for token) and in
distribution at temp > 0 (whole output sequences vs the enumerated target)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import drafts
from specdec_jax.decoding import alpha_estimates, speculative_decode, temperature_sample
from specdec_jax.models.t5 import T5Config, T5Model, shift_right
from specdec_jax.sampling import SamplingConfig, standardize
from stat_tests import pooled_chisquare_pvalue

MAX_LEN = 20
INPUTS = jax.random.randint(jax.random.PRNGKey(1), (4, 12), 2, 64).astype(jnp.int32)
KEY = jax.random.PRNGKey(0)


@pytest.fixture(scope="module")
def greedy_case(tiny_target):
  """A batch whose rows end at different EOS positions, and its baseline."""
  model, params = tiny_target
  free = temperature_sample(model, params, INPUTS, KEY, max_decode_len=MAX_LEN, eos_id=-1)
  toks = np.asarray(free.tokens)
  # Pick as EOS a token whose first occurrence differs across rows, and that
  # leaves at least one row running to max length (the cut is tested too).
  best = None
  for tok in np.unique(toks):
    first = [int(np.argmax(r == tok)) if (r == tok).any() else MAX_LEN for r in toks]
    if len(set(first)) >= 3 and max(first) == MAX_LEN and min(first) >= 2:
      best = int(tok)
      break
  assert best is not None, toks
  base = temperature_sample(model, params, INPUTS, KEY, max_decode_len=MAX_LEN, eos_id=best)
  lengths = np.asarray(base.length)
  assert len(set(lengths.tolist())) >= 3 and lengths.max() == MAX_LEN
  return best, base


def _drafts(tiny_draft):
  dm, dp = tiny_draft
  corpus = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (50, 20), 0, 64))
  return {
      "t5": drafts.build("t5", model=dm, params=dp),
      "bigram": drafts.build("bigram", corpus=corpus, vocab_size=64),
      "prompt_lookup": drafts.build("prompt_lookup", vocab_size=64),
      # min_ngram 1: copies wherever any token repeats, so the mix is exercised.
      "lookup_t5": drafts.LookupT5Draft(t5=drafts.build("t5", model=dm, params=dp),
                                        max_ngram=2, min_ngram=1),
  }


@pytest.mark.parametrize("gamma", [1, 3, 7])
def test_greedy_identical_to_baseline(tiny_target, tiny_draft, greedy_case, gamma):
  model, params = tiny_target
  eos, base = greedy_case
  for name, draft in _drafts(tiny_draft).items():
    out = speculative_decode(model, params, draft, INPUTS, KEY, gamma=gamma,
                             max_decode_len=MAX_LEN, eos_id=eos)
    np.testing.assert_array_equal(out.tokens, base.tokens, err_msg=f"{name} gamma={gamma}")
    np.testing.assert_array_equal(out.length, base.length, err_msg=name)
    st = out.stats
    # Every target call commits >= 1 token and at most γ+1.
    assert np.all(st.target_calls >= np.ceil(base.length / (gamma + 1)))
    assert np.all(st.target_calls <= base.length)
    assert np.all(st.draft_calls == gamma * st.target_calls)
    assert np.all(st.accepted_at.sum(1) == st.accepted)


def test_rows_advance_independently(tiny_target, tiny_draft, greedy_case):
  """Per-row acceptance: each row's tokens and stats equal running it alone."""
  model, params = tiny_target
  eos, _ = greedy_case
  draft = _drafts(tiny_draft)["prompt_lookup"]
  out = speculative_decode(model, params, draft, INPUTS, KEY, gamma=3, max_decode_len=MAX_LEN,
                           eos_id=eos)
  calls = np.asarray(out.stats.target_calls)
  assert len(set(calls.tolist())) > 1  # rows really advanced at different rates
  for i in range(INPUTS.shape[0]):
    one = speculative_decode(model, params, draft, INPUTS[i:i + 1], KEY, gamma=3,
                             max_decode_len=MAX_LEN, eos_id=eos)
    np.testing.assert_array_equal(one.tokens[0], out.tokens[i])
    assert int(one.stats.target_calls[0]) == calls[i]
    assert int(one.stats.accepted[0]) == int(out.stats.accepted[i])


def _bridged(draft_model, draft_params, target_model, target_params, seed=0, scale=0.5):
  """A T5 draft whose encoder also reads the target's (``specdec_jax.drafts.bridge``),
  with a random, clearly non-zero bridge kernel."""
  shape = (target_model.config.d_model, draft_model.config.d_model)
  kernel = scale * jax.random.normal(jax.random.PRNGKey(seed), shape)
  return drafts.build("t5", model=draft_model, params=draft_params, bridge=kernel,
                      target_model=target_model, target_params=target_params)


def test_bridged_draft_identical_to_baseline(tiny_target, tiny_draft, greedy_case):
  """A draft reading the target's encoder output stays exact at T=0, and the
  bridge really changes what it proposes (or the test would prove nothing)."""
  model, params = tiny_target
  eos, base = greedy_case
  dm, dp = tiny_draft
  bridged = _bridged(dm, dp, model, params)
  out = speculative_decode(model, params, bridged, INPUTS, KEY, gamma=3,
                           max_decode_len=MAX_LEN, eos_id=eos)
  np.testing.assert_array_equal(out.tokens, base.tokens)
  np.testing.assert_array_equal(out.length, base.length)
  plain = drafts.build("t5", model=dm, params=dp)
  seq = jnp.zeros((INPUTS.shape[0], MAX_LEN + 5), jnp.int32)
  length = jnp.zeros((INPUTS.shape[0],), jnp.int32)
  greedy = SamplingConfig(temperature=0.0)
  proposals = [d.propose(d.init(INPUTS, MAX_LEN + 4), seq, length, 3, greedy, KEY)[1]
               for d in (plain, bridged)]
  assert float(jnp.max(jnp.abs(proposals[0] - proposals[1]))) > 0.5
  # The engine hands the draft the target's encoder output (no second encode).
  alone = bridged.init(INPUTS, MAX_LEN + 4)
  given = bridged.init_with_target(INPUTS, MAX_LEN + 4, model.encode(params, INPUTS))
  np.testing.assert_allclose(alone.cross_k[0], given.cross_k[0], rtol=1e-6, atol=1e-6)


def _featured(draft_model, draft_params, target_model, target_params, seed=0, scale=0.5,
              staleness=3, name="t5"):
  """A T5 draft whose decoder also reads the target's decoder states
  (``specdec_jax.drafts.feature_bridge``), with random, clearly non-zero weights."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  d_p, d_q = target_model.config.d_model, draft_model.config.d_model
  feature = {"kernel": scale * jax.random.normal(k1, (d_p, d_q)),
             "staleness": scale * jax.random.normal(k2, (staleness, d_q))}
  return drafts.build(name, model=draft_model, params=draft_params, feature=feature,
                      target_model=target_model, target_params=target_params, max_ngram=2)


@pytest.mark.parametrize("name", ["t5", "lookup_t5"])
def test_feature_bridged_draft_identical_to_baseline(tiny_target, tiny_draft, greedy_case, name):
  """A draft reading the target's decoder states stays exact at T=0 for
  γ shorter and longer than its staleness table, alone and inside the
  lookup combination, with fixed γ and an adaptive rule."""
  from specdec_jax.decoding import AdaptiveConfig
  model, params = tiny_target
  eos, base = greedy_case
  dm, dp = tiny_draft
  featured = _featured(dm, dp, model, params, name=name)
  assert featured.wants_target_states
  for gamma, adaptive in ((2, None), (5, None), (4, AdaptiveConfig("threshold", threshold=0.4))):
    out = speculative_decode(model, params, featured, INPUTS, KEY, gamma=gamma,
                             max_decode_len=MAX_LEN, eos_id=eos, adaptive=adaptive)
    np.testing.assert_array_equal(out.tokens, base.tokens, err_msg=f"{name} γ={gamma}")
    np.testing.assert_array_equal(out.length, base.length)


def test_feature_bridge_reads_what_distillation_trains_on(tiny_target, tiny_draft):
  """The engine's draft step at position t reads the target state at s = t-1-j
  with staleness j, the indexing ``feature_bridge.teacher_forced_extra``
  trains: a round's q, after ``commit_with_target``, equals the draft run
  teacher-forced with those extras built by hand. (If the engine read one
  position off, or the wrong staleness, the logits would differ.)"""
  from specdec_jax.drafts import feature_bridge
  model, params = tiny_target
  dm, dp = tiny_draft
  gamma, n1 = 3, 2
  featured = _featured(dm, dp, model, params)
  b = INPUTS.shape[0]
  cache_len = 16
  seq = jnp.zeros((b, cache_len + 1), jnp.int32)
  y = jax.random.randint(jax.random.PRNGKey(4), (b, 6), 2, 64).astype(jnp.int32)
  seq = seq.at[:, 1:7].set(y)                       # decoder inputs 0..6: start, y_1..y_6
  _, hidden = model(params, INPUTS, seq[:, :7], return_hidden=True)
  t1 = SamplingConfig(temperature=1.0)
  propose = jax.jit(lambda d, *a: d.propose(*a, gamma, t1, KEY))  # one compile, three calls
  state = featured.init(INPUTS, cache_len)
  _, _, state = propose(featured, state, seq, jnp.zeros((b,), jnp.int32))
  # Round 1's target pass covered positions 0..γ; n1 of its tokens committed.
  pos = jnp.broadcast_to(jnp.arange(gamma + 1, dtype=jnp.int32), (b, gamma + 1))
  length = jnp.full((b,), n1, jnp.int32)
  state = featured.commit_with_target(state, seq, length, hidden[:, :gamma + 1], pos)
  xs, q, _ = propose(featured, state, seq, length)
  # By hand: positions < n1-1 were computed in round 1 (no state yet: no
  # extra), n1-1 is re-fed reading h_{n1-2} at staleness 0, and n1+i reads
  # h_{n1-1} at staleness i.
  dec_in = jnp.concatenate([seq[:, :n1 + 1], xs[:, :gamma - 1]], axis=1)
  t = dec_in.shape[1]
  src = jnp.asarray([0] * (n1 - 1) + [n1 - 2] + [n1 - 1] * gamma)[:t]
  j = jnp.asarray([-1] * (n1 - 1) + [0] + list(range(gamma)))[:t]
  extra = feature_bridge.project(featured.feature, hidden[:, src], jnp.broadcast_to(j, (b, t)))
  logits = dm(dp, INPUTS, dec_in, decoder_extra=extra)
  want = standardize(logits[:, n1:], t1)
  np.testing.assert_allclose(q, want, rtol=1e-4, atol=1e-6)
  # The states matter: a draft given other states proposes otherwise.
  other = featured.commit_with_target(
      propose(featured, featured.init(INPUTS, cache_len), seq, jnp.zeros((b,), jnp.int32))[2],
      seq, length, hidden[:, :gamma + 1] * 0, pos)
  q_other = propose(featured, other, seq, length)[1]
  assert float(jnp.max(jnp.abs(q_other[:, 0] - q[:, 0]))) > 1e-3


def test_alpha_of_a_state_reading_draft_is_measured_in_rounds(tiny_target):
  """Its q depends on where a round starts, so α along fixed outputs is
  refused, and ``estimate_alpha`` (``gamma='auto'``) and ``--alpha_only``
  measure it in the engine's rounds: at T=0, Σ min(p, q) over the evaluated
  positions is exactly the accepted count of the engine's statistics."""
  from specdec_jax import alpha as alpha_lib
  model, params = tiny_target
  # The target itself plus a small feature bridge: mostly accepted, not always.
  featured = _featured(model, params, model, params, scale=0.3)
  greedy = SamplingConfig(temperature=0.0)
  out, sums, evaluated = alpha_lib.min_pq_in_rounds(model, params, featured, INPUTS, KEY, 3,
                                                    MAX_LEN, greedy)
  np.testing.assert_allclose(sums, np.asarray(out.stats.accepted), atol=1e-5)
  assert evaluated.sum() > sums.sum() > 0  # some accepted, some rejected
  alpha, tokens, _ = alpha_lib.estimate_alpha(model, params, featured, [(INPUTS, 4)], KEY,
                                              greedy, MAX_LEN, rounds_gamma=3)
  assert tokens == evaluated.sum() and alpha == pytest.approx(sums.sum() / evaluated.sum())
  with pytest.raises(ValueError, match="min_pq_in_rounds"):
    alpha_lib.min_pq_along(model, params, featured, INPUTS, out.tokens, out.length, greedy)


def test_input_buckets_cut_only_padding(tiny_target, tiny_draft):
  """data.fit_to_bucket: inputs cut from width 24 to their bucket (16) give the
  same tokens and log-probabilities (padding is masked everywhere), baseline
  and speculative alike; one row longer than a bucket keeps the full width."""
  from specdec_jax import data
  model, params = tiny_target
  wide = np.zeros((2, 24), np.int32)
  wide[:, :12] = np.asarray(INPUTS[:2])
  wide[1, 9:12] = 0                             # rows of different lengths
  cut = data.fit_to_bucket(wide, (8, 16))
  assert cut.shape == (2, 16) and np.array_equal(cut, wide[:, :16])
  assert data.fit_to_bucket(wide, ()) is wide
  assert data.by_width([cut, wide, cut]) == {16: [0, 2], 24: [1]}
  full = wide.copy()
  full[0, -1] = 5                               # a row using every position
  assert data.fit_to_bucket(full, (8, 16)).shape == (2, 24)
  kw = dict(max_decode_len=MAX_LEN, eos_id=-1)
  a = temperature_sample(model, params, jnp.asarray(wide), KEY, **kw)
  b = temperature_sample(model, params, jnp.asarray(cut), KEY, **kw)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.log_prob, b.log_prob, rtol=1e-5)
  draft = drafts.build("t5", model=tiny_draft[0], params=tiny_draft[1])
  spec = speculative_decode(model, params, draft, jnp.asarray(cut), KEY, gamma=3, **kw)
  np.testing.assert_array_equal(spec.tokens, a.tokens)
  with pytest.raises(ValueError, match=r"input_buckets must be strictly increasing ints in "
                                       r"\[1, max_input_len=16\], got \(8, 32\)"):
    data.check_input_buckets((8, 32), 16)
  with pytest.raises(ValueError, match="strictly increasing"):
    data.check_input_buckets((16, 8), 16)
  assert data.parse_input_buckets("8,16", 16) == (8, 16)
  assert data.parse_input_buckets("none", 16) == ()
  with pytest.raises(ValueError, match=r"--input_buckets must be a comma-separated list of ints "
                                       r"or 'none', got '8,x'"):
    data.parse_input_buckets("8,x", 16)


def test_draft_equal_to_target_accepts_everything(tiny_target, greedy_case):
  model, params = tiny_target
  eos, base = greedy_case
  gamma = 3
  out = speculative_decode(model, params, drafts.T5Draft(params=params, model=model), INPUTS,
                           KEY, gamma=gamma, max_decode_len=MAX_LEN, eos_id=eos)
  np.testing.assert_array_equal(out.tokens, base.tokens)
  a = alpha_estimates(out.stats)
  np.testing.assert_array_equal(a["alpha"], 1.0)
  np.testing.assert_allclose(a["alpha_min_pq"], 1.0)
  assert np.all(out.stats.rejected == 0)
  np.testing.assert_array_equal(out.stats.target_calls, np.ceil(base.length / (gamma + 1)))


def test_greedy_lenience(tiny_target, tiny_draft, greedy_case):
  """l = 1 is exact; l < 1 accepts at least as much and (here) changes outputs."""
  model, params = tiny_target
  eos, base = greedy_case
  draft = _drafts(tiny_draft)["t5"]
  kw = dict(gamma=3, max_decode_len=MAX_LEN, eos_id=eos)
  exact = speculative_decode(model, params, draft, INPUTS, KEY, lenience=1.0, **kw)
  np.testing.assert_array_equal(exact.tokens, base.tokens)
  lenient = speculative_decode(model, params, draft, INPUTS, KEY, lenience=1e-4, **kw)
  a_exact = float(alpha_estimates(exact.stats)["alpha"].mean())
  a_len = float(alpha_estimates(lenient.stats)["alpha"].mean())
  assert a_len > a_exact
  assert not np.array_equal(lenient.tokens, base.tokens)


def test_bad_arguments(tiny_target, tiny_draft):
  model, params = tiny_target
  draft = _drafts(tiny_draft)["prompt_lookup"]
  with pytest.raises(ValueError, match="gamma"):
    speculative_decode(model, params, draft, INPUTS, KEY, gamma=0, max_decode_len=MAX_LEN)
  with pytest.raises(ValueError, match="lenience"):
    speculative_decode(model, params, draft, INPUTS, KEY, gamma=2, max_decode_len=MAX_LEN,
                       lenience=0.0)
  with pytest.raises(ValueError, match="vocab"):
    speculative_decode(model, params, drafts.build("prompt_lookup", vocab_size=65), INPUTS, KEY,
                       gamma=2, max_decode_len=MAX_LEN)


# ---------------------------------------------------------------- temp > 0
# Whole-sequence exactness on a tiny model: vocab 8, 3 output tokens, EOS = 1.
# All 8^3 paths are enumerated to get the target's exact distribution over
# outputs (tokens after EOS are 0). 20k sequences are drawn in one batch with a
# fixed seed and compared by a chi-square test at significance 1e-3 (cells with
# expected count < 5 pooled): a correct engine fails with probability 0.001 per
# setting over seeds. The same test rejects a lenient (inexact) engine, which
# shows it has power against a real distortion.

SEQ_V, SEQ_LEN, SEQ_N, SEQ_EOS = 8, 3, 20_000, 1
SEQ_CFG = T5Config(vocab_size=SEQ_V, d_model=16, num_heads=2, head_dim=8, num_encoder_layers=1,
                   num_decoder_layers=1, d_ff=16)
SEQ_INPUT = jnp.array([[3, 5, 2, 7, 4]], jnp.int32)


@pytest.fixture(scope="module")
def seq_models():
  model = T5Model(SEQ_CFG)
  target = model.init(jax.random.PRNGKey(11))
  draft = model.init(jax.random.PRNGKey(12))
  # Spread the target's logits a little so distributions are not near-uniform.
  target["decoder"]["logits_dense"]["kernel"] = target["decoder"]["logits_dense"]["kernel"] * 3
  return model, target, draft


def exact_sequence_distribution(model, params, sampling):
  """{output tuple: probability} under the target alone (EOS-terminated)."""
  paths = np.array(list(itertools.product(range(SEQ_V), repeat=SEQ_LEN)), np.int32)
  logits = model(params, jnp.repeat(SEQ_INPUT, len(paths), 0), shift_right(jnp.asarray(paths)))
  probs = np.asarray(standardize(logits, sampling), np.float64)
  dist: dict[tuple, float] = {}
  for path, pr in zip(paths, probs):
    total, out = 1.0, []
    for t, tok in enumerate(path):
      total *= pr[t, tok]
      out.append(int(tok))
      if tok == SEQ_EOS:
        break
    if len(out) < len(path) and any(path[len(out):]):
      continue  # count each EOS-terminated output once (the all-zero tail)
    key = tuple(out + [0] * (SEQ_LEN - len(out)))
    dist[key] = dist.get(key, 0.0) + total
  return dist


def sequence_pvalue(samples: np.ndarray, dist: dict) -> float:
  keys = list(dist)
  index = {k: i for i, k in enumerate(keys)}
  counts = np.zeros(len(keys))
  for row in map(tuple, samples.tolist()):
    assert row in index, f"impossible output {row}"
    counts[index[row]] += 1
  return pooled_chisquare_pvalue(counts, np.array([dist[k] for k in keys]))


SETTINGS = {
    "temp1": SamplingConfig(temperature=1.0),
    "temp0.7_topk3": SamplingConfig(temperature=0.7, topk=3),
    "temp1_topp0.8": SamplingConfig(temperature=1.0, topp=0.8),
}


def _seq_draft(name, model, draft_params, target_params):
  if name == "t5_bridge":
    return _bridged(model, draft_params, model, target_params, seed=1, scale=1.0)
  if name == "t5_feature":
    return _featured(model, draft_params, model, target_params, seed=1, scale=1.0)
  t5 = drafts.T5Draft(params=draft_params, model=model)
  # With vocab 8 and a 5-token input nearly every context has a 1-gram match,
  # so most rounds mix copied (one-hot q) and T5 positions.
  return t5 if name == "t5" else drafts.LookupT5Draft(t5=t5, max_ngram=2, min_ngram=1)


@pytest.mark.parametrize("setting,draft_name", [(s, "t5") for s in sorted(SETTINGS)]
                         + [("temp1", "lookup_t5"), ("temp1", "t5_bridge"),
                            ("temp1", "t5_feature")])
def test_sequence_distribution_is_exact(seq_models, setting, draft_name):
  model, target, draft_params = seq_models
  sampling = SETTINGS[setting]
  dist = exact_sequence_distribution(model, target, sampling)
  assert abs(sum(dist.values()) - 1) < 1e-5
  inputs = jnp.repeat(SEQ_INPUT, SEQ_N, 0)
  draft = _seq_draft(draft_name, model, draft_params, target)
  out = speculative_decode(model, target, draft, inputs, jax.random.PRNGKey(5), gamma=2,
                           max_decode_len=SEQ_LEN, sampling=sampling, eos_id=SEQ_EOS)
  # The draft must actually be rejected sometimes, or the test proves little.
  a = float(alpha_estimates(out.stats)["alpha"].mean())
  assert 0.1 < a < 0.95, a
  assert sequence_pvalue(np.asarray(out.tokens), dist) > 1e-3
  if setting == "temp1" and draft_name == "t5":
    # Power: the same test rejects an engine that is not exact.
    bad = speculative_decode(model, target, draft, inputs, jax.random.PRNGKey(5), gamma=2,
                             max_decode_len=SEQ_LEN, sampling=sampling, eos_id=SEQ_EOS,
                             lenience=0.3)
    assert sequence_pvalue(np.asarray(bad.tokens), dist) < 1e-3
    # And the baseline itself passes it (the enumeration is right).
    base = temperature_sample(model, target, inputs, jax.random.PRNGKey(6),
                              max_decode_len=SEQ_LEN, sampling=sampling, eos_id=SEQ_EOS)
    assert sequence_pvalue(np.asarray(base.tokens), dist) > 1e-3
