"""Algorithm 1's kernel and the two-level sampler against direct transcriptions
(the cuts that the round profile, lab.rounds, measured).

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

from specdec_jax.sampling import _block_size, argmax, inverse_cdf, sample_any
from specdec_jax.speculative import KernelOutput, greedy_kernel, speculative_sampling
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


@pytest.mark.parametrize("one_hot_q", [True, False])
def test_greedy_kernel_from_argmax_equals_the_kernel(one_hot_q):
  """The engine's T=0 path (``greedy_kernel``, from the target's argmax
  tokens alone) gives the general kernel's outputs on the one-hot p, field
  for field, with and without per-row proposal counts."""
  for seed in range(3):
    x, q, p, _ = _greedy_case(seed, one_hot_q)
    best = argmax(p)
    for proposed in (None, jnp.asarray(np.arange(B) % (GAMMA + 1), jnp.int32)):
      want = speculative_sampling(jax.random.PRNGKey(seed), x, q, p, 1.0, True,
                                  proposed=proposed)
      _assert_same(greedy_kernel(x, q, best, proposed), want)
      assert len(set(np.asarray(want.num_accepted).tolist())) == GAMMA + 1
