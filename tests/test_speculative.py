"""The speculative sampling kernel (§2.3, Algorithm 1) and lenience (A.5).

Monte Carlo tests use a fixed seed and a chi-square goodness-of-fit test at
significance 1e-3 (so a correct kernel fails a given check with probability
0.001 over seeds; with the fixed seed the outcome is deterministic). Power:
with N = 100k draws, a shift of 0.01 in any cell of probability <= 0.5 is a
>= 6 sigma effect, detected with probability > 0.999. A broken kernel (no
residual correction) is run through the same test to show it fails.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.speculative import speculative_sampling
from stat_tests import pooled_chisquare_pvalue

N = 100_000
SIGNIFICANCE = 1e-3


def chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
  return pooled_chisquare_pvalue(np.bincount(samples, minlength=len(probs)), probs)


@functools.partial(jax.jit, static_argnames=("lenience",))
def _first_tokens(key, p, q, lenience=1.0):
  """Run the kernel N times with γ=1 on fixed p [2,V], q [V]; first emitted token."""
  keys = jax.random.split(key, 2)
  x = jax.random.categorical(keys[0], jnp.log(q), shape=(N,)).astype(jnp.int32)[:, None]
  qb = jnp.broadcast_to(q, (N, 1, q.shape[-1]))
  pb = jnp.broadcast_to(p, (N,) + p.shape)
  out = speculative_sampling(keys[1], x, qb, pb, lenience=lenience)
  first = jnp.where(out.num_accepted >= 1, x[:, 0], out.next_token)
  return first, out


def _dist(rng, v, zeros=()):
  d = rng.dirichlet(np.ones(v))
  d[list(zeros)] = 0
  return d / d.sum()


V = 6
_rng = np.random.default_rng(0)
P1 = _dist(_rng, V)
P2 = _dist(_rng, V)
CASES = {
    "random": _dist(_rng, V),
    "q_zero_where_p_positive": _dist(_rng, V, zeros=(0, 1)),
    "q_equals_p": P1,
    "q_one_hot": np.eye(V)[3],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_emitted_token_is_distributed_as_p(case):
  q = CASES[case]
  p = np.stack([P1, P2])
  first, out = _first_tokens(jax.random.PRNGKey(1), jnp.asarray(p, jnp.float32),
                             jnp.asarray(q, jnp.float32))
  assert chi2_pvalue(np.asarray(first), P1) > SIGNIFICANCE
  # When the single draft token was accepted, the bonus token ~ p_2.
  bonus = np.asarray(out.next_token)[np.asarray(out.num_accepted) == 1]
  if len(bonus) > 1000:
    assert chi2_pvalue(bonus, P2) > SIGNIFICANCE
  # Acceptance rate matches beta = sum min(p, q) (Theorem 3.5), within 5 sigma.
  beta = np.minimum(P1, q).sum()
  rate = np.asarray(out.num_accepted).mean()
  assert abs(rate - beta) < 5 * np.sqrt(beta * (1 - beta) / N) + 1e-9
  np.testing.assert_allclose(np.asarray(out.min_pq)[0, 0], beta, rtol=1e-5)


def test_broken_kernel_is_detected():
  """Power check: emitting the draft token or a fresh p sample (no residual)
  is not p-distributed; the same chi-square test must reject it."""
  q = jnp.asarray(CASES["random"], jnp.float32)
  p = jnp.asarray(np.stack([P1, P2]), jnp.float32)
  first, out = _first_tokens(jax.random.PRNGKey(1), p, q)
  fresh = jax.random.categorical(jax.random.PRNGKey(2), jnp.log(p[0]), shape=(N,))
  broken = np.where(np.asarray(out.num_accepted) >= 1, np.asarray(first), np.asarray(fresh))
  assert chi2_pvalue(broken, P1) < SIGNIFICANCE


def test_prefix_acceptance_and_bonus_with_gamma_3():
  """n counts leading acceptances only; with q = p everything is accepted and
  the bonus comes from p_{γ+1}; a zero-probability draft token is rejected."""
  v, gamma = 5, 3
  p = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), (2, gamma + 1, v)))
  q = p[:, :gamma]
  x = jnp.array([[0, 1, 2], [3, 4, 0]], jnp.int32)
  out = speculative_sampling(jax.random.PRNGKey(3), x, q, p)
  np.testing.assert_array_equal(out.num_accepted, [3, 3])
  # Zero out p_2(x_2) for row 0: n must stop at 1 and t != x_2.
  p0 = p.at[0, 1, 1].set(0.0)
  p0 = p0.at[0, 1].set(p0[0, 1] / p0[0, 1].sum())
  out = speculative_sampling(jax.random.PRNGKey(3), x, q, p0)
  assert int(out.num_accepted[0]) == 1
  assert int(out.next_token[0]) != 1
  np.testing.assert_array_equal(out.accepted[0], [True, False, False])


def test_greedy_kernel_is_argmax_matching():
  v = 7
  logits = jax.random.normal(jax.random.PRNGKey(0), (1, 4, v))
  p = jax.nn.one_hot(jnp.argmax(logits, -1), v)
  best = jnp.argmax(logits, -1)[0]
  x = jnp.array([[best[0], best[1], (best[2] + 1) % v]], jnp.int32)
  q = jax.nn.one_hot(x, v)
  out = speculative_sampling(jax.random.PRNGKey(0), x, q, p, greedy=True)
  assert int(out.num_accepted[0]) == 2
  assert int(out.next_token[0]) == int(best[2])


def test_lenience_bounds_each_token_by_p_over_l():
  """App. A.5: with l < 1 no token's probability exceeds p(x)/l (checked at 5
  sigma); the output is no longer p (the test shows it moves)."""
  p_vec = np.array([0.05, 0.05, 0.3, 0.6])
  q_vec = np.array([0.7, 0.2, 0.05, 0.05])  # q loves tokens p finds rare
  p = jnp.asarray(np.stack([p_vec, p_vec]), jnp.float32)
  for lenience in (0.5, 0.2):
    first, _ = _first_tokens(jax.random.PRNGKey(4), p, jnp.asarray(q_vec, jnp.float32),
                             lenience=lenience)
    freq = np.bincount(np.asarray(first), minlength=4) / N
    bound = np.minimum(p_vec / lenience, 1.0)
    assert np.all(freq <= bound + 5 * np.sqrt(bound * (1 - bound) / N) + 1e-12), (freq, bound)
    assert chi2_pvalue(np.asarray(first), p_vec) < SIGNIFICANCE  # not exact any more
  first, _ = _first_tokens(jax.random.PRNGKey(4), p, jnp.asarray(q_vec, jnp.float32),
                           lenience=1.0)
  assert chi2_pvalue(np.asarray(first), p_vec) > SIGNIFICANCE


def test_greedy_lenience_accepts_near_max_tokens():
  """Argmax lenience is applied before standardization: x is accepted when
  p_raw(x) >= l * max p_raw; with l = 1 only the argmax itself is."""
  p_raw = jnp.array([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]])  # [1, γ=2, V]
  p = jnp.concatenate([jax.nn.one_hot(jnp.argmax(p_raw, -1), 3), jnp.eye(3)[None, :1]], 1)
  x = jnp.array([[1, 2]], jnp.int32)  # 0.3/0.5 = 0.6 ; 0.3/0.6 = 0.5
  q = jax.nn.one_hot(x, 3)
  k = jax.random.PRNGKey(0)
  exact = speculative_sampling(k, x, q, p, 1.0, True, p_raw)
  assert int(exact.num_accepted[0]) == 0 and int(exact.next_token[0]) == 0
  le = speculative_sampling(k, x, q, p, 0.55, True, p_raw)
  assert int(le.num_accepted[0]) == 1 and int(le.next_token[0]) == 1
  le = speculative_sampling(k, x, q, p, 0.5, True, p_raw)
  assert int(le.num_accepted[0]) == 2
