"""Speculative decoding (the chain loop) beyond the exactness matrix
(test_exactness.py): rows advance independently, the bridges' draft-side
contracts, input buckets, a draft equal to the target, lenience at T = 0 and
bad arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exactness_cases as cases
from exactness_cases import INPUTS, KEY, MAX_LEN, pick_greedy_case
from lab.common import parse_input_buckets
from specdec_jax import drafts
from specdec_jax.decoding import alpha_estimates, speculative_decode, temperature_sample
from specdec_jax.sampling import SamplingConfig, standardize


@pytest.fixture(scope="module")
def greedy_case(tiny_target):
  """(eos, baseline) on ``INPUTS``: rows end at different EOS positions."""
  return pick_greedy_case(*tiny_target)


def test_rows_advance_independently(tiny_target, greedy_case):
  """Per-row acceptance: each row's tokens and stats equal running it alone."""
  model, params = tiny_target
  eos, _ = greedy_case
  draft = drafts.build("prompt_lookup", vocab_size=64)
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


def test_bridge_changes_proposals_and_reads_the_targets_encoding(tiny_target, tiny_draft):
  """A draft reading the target's encoder output (exact at T=0: the
  exactness matrix) really proposes otherwise than without the bridge (or
  the matrix would prove nothing), and the engine's way of building it from
  the target's encoder output equals its own encode (no second encode)."""
  model, params = tiny_target
  dm, dp = tiny_draft
  bridge = cases.bridged(dm, dp, model, params)
  plain = drafts.build("t5", model=dm, params=dp)
  seq = jnp.zeros((INPUTS.shape[0], MAX_LEN + 5), jnp.int32)
  length = jnp.zeros((INPUTS.shape[0],), jnp.int32)
  greedy = SamplingConfig(temperature=0.0)
  proposals = [d.propose(d.init(INPUTS, MAX_LEN + 4), seq, length, 3, greedy, KEY)[1]
               for d in (plain, bridge)]
  assert float(jnp.max(jnp.abs(proposals[0] - proposals[1]))) > 0.5
  # The engine hands the draft the target's encoder output (no second encode).
  alone = bridge.init(INPUTS, MAX_LEN + 4)
  given = bridge.init_with_target(INPUTS, MAX_LEN + 4, model.encode(params, INPUTS))
  np.testing.assert_allclose(alone.cross_k[0], given.cross_k[0], rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # 16 s; a training/decoding agreement, not an exactness property
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
  featured = cases.featured(dm, dp, model, params)
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
  featured = cases.featured(model, params, model, params, scale=0.3)
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
  assert parse_input_buckets("8,16", 16) == (8, 16)
  assert parse_input_buckets("none", 16) == ()
  with pytest.raises(ValueError, match=r"--input_buckets must be a comma-separated list of ints "
                                       r"or 'none', got '8,x'"):
    parse_input_buckets("8,x", 16)


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
  draft = drafts.build("t5", model=tiny_draft[0], params=tiny_draft[1])
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
  draft = drafts.build("prompt_lookup", vocab_size=64)
  with pytest.raises(ValueError, match="gamma"):
    speculative_decode(model, params, draft, INPUTS, KEY, gamma=0, max_decode_len=MAX_LEN)
  with pytest.raises(ValueError, match="lenience"):
    speculative_decode(model, params, draft, INPUTS, KEY, gamma=2, max_decode_len=MAX_LEN,
                       lenience=0.0)
  with pytest.raises(ValueError, match="vocab"):
    speculative_decode(model, params, drafts.build("prompt_lookup", vocab_size=65), INPUTS, KEY,
                       gamma=2, max_decode_len=MAX_LEN)


def test_the_loops_reach_the_target_through_its_five_methods():
  """Every call the decoding package makes on a target (``target.X(``,
  ``model.X(``, ``loop.target.X(``, ``self.target.X(``) is one of
  ``TargetModel``'s five methods; the rest is derived in models/base.py,
  whose functions call only those five too."""
  import ast  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top
  from pathlib import Path  # pylint: disable=g-import-not-at-top
  from specdec_jax import decoding  # pylint: disable=g-import-not-at-top
  from specdec_jax.models import base  # pylint: disable=g-import-not-at-top
  methods = {n for n, _ in inspect.getmembers(base.TargetModel, inspect.isfunction)
             if not n.startswith("_")}
  assert methods == {"encode", "init_cache", "decode", "read_rows", "write_rows"}
  files = list(Path(decoding.__file__).parent.glob("*.py")) + [Path(base.__file__)]
  called = set()
  for path in files:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        owner = node.func.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
        if name in ("target", "model"):
          called.add(node.func.attr)
  assert "decode" in called and called <= methods, called - methods
