"""The speculative sampling kernel (paper §2.3, Algorithm 1; lenience, App. A.5).
Batched; the emitted tokens follow p exactly for any q (App. A.1;
docs/exactness.md, sections 2-4, lenience: section 9)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdec_jax.sampling import argmax, inverse_cdf
from specdec_jax.tree import residual

Array = jax.Array


class KernelOutput(NamedTuple):
  """Result of one Algorithm 1 acceptance step.

  num_accepted: [B] int32, n in Algorithm 1 (0..γ).
  next_token:   [B] int32, t ~ p' (the correction, or the bonus token if n = γ).
  accepted:     [B, γ] bool, position i accepted (prefix-closed: i < n).
  min_pq:       [B, γ] float32, sum_x min(p_i(x), q_i(x)) = β_i (Theorem 3.5).
  """

  num_accepted: Array
  next_token: Array
  accepted: Array
  min_pq: Array


def _leading(accept: Array, proposed: Array | None) -> tuple[Array, Array]:
  """Verdicts [B, γ] -> (the leading run, prefix-closed; n [B]); past ``proposed``: fail."""
  if proposed is not None:
    accept = accept & (jnp.arange(accept.shape[1])[None] < proposed[:, None])
  accepted = jnp.cumprod(accept.astype(jnp.int32), axis=-1).astype(bool)
  return accepted, jnp.sum(accepted, axis=-1).astype(jnp.int32)


def speculative_sampling(key: Array, draft_tokens: Array, q: Array, p: Array, lenience: float = 1.0,
                         greedy: bool = False, p_raw: Array | None = None,
                         proposed: Array | None = None) -> KernelOutput:
  """Algorithm 1's acceptance and correction (paper §2.3), batched.

  draft_tokens [B, γ]: x_1..x_γ, drawn from q [B, γ, V]; p [B, γ+1, V]: the
  target's p_1..p_{γ+1}. x_i passes when r_i ~ U(0, 1] gives
  r_i * l * q_i(x_i) <= p_i(x_i) and p_i(x_i) > 0; n is the number of leading
  passes; t ~ norm(max(0, p_{n+1} - l q_{n+1})) if n < γ, else t ~ p_{γ+1}.
  lenience l in (0, 1] (A.5; l < 1 is inexact). greedy: p is one-hot and
  ``key`` unused; with l < 1 x passes when p_raw(x) >= l * max p_raw (p_raw
  [B, γ, V], the unstandardized softmax). proposed [B]: c_b <= γ, Algorithm 1
  for γ = c_b (adaptive rounds). Exactness: docs/exactness.md, sections 2-3.
  """
  b, gamma = draft_tokens.shape
  px = jnp.take_along_axis(p[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
  if greedy:
    # p is one-hot, so for any r in (0, 1], l <= 1, q(x) <= 1 the rule below
    # accepts x iff p(x) = 1: the same verdicts without drawing r.
    if lenience < 1.0:
      raw_x = jnp.take_along_axis(p_raw, draft_tokens[..., None], axis=-1)[..., 0]
      accept = raw_x >= lenience * jnp.max(p_raw, axis=-1)
    else:
      accept = px > 0
  else:
    # One PRNG draw for the round: r_1..r_γ and the next token's uniform.
    u = jax.random.uniform(key, (b, gamma + 1))
    qx = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    # r in (0, 1]: a token with p(x) = 0 can never pass, even at r's extreme.
    r = 1.0 - u[:, :gamma]
    accept = (r * (lenience * qx) <= px) & (px > 0)
  accepted, n = _leading(accept, proposed)

  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
  if greedy:
    # p_n one-hot at a: the normalized residual is one-hot at a too (or falls
    # back to p_n), so skip its passes over the vocabulary.
    next_token = argmax(p_n)
  else:
    # p' without a branch: q_{c+1} := 0, so n = c (all passed) gives the bonus
    # p_{c+1}; gathered at min(n, γ-1) and zeroed rather than copying q.
    q_n = jnp.take_along_axis(q, jnp.minimum(n, gamma - 1)[:, None, None], axis=1)[:, 0]
    q_n = jnp.where((n < (gamma if proposed is None else proposed))[:, None], q_n, 0.0)
    # Rejection when p == q up to rounding leaves no mass: ``residual`` falls back to p.
    next_token = inverse_cdf(residual(p_n, lenience * q_n), u[:, gamma])
  min_pq = jnp.sum(jnp.minimum(p[:, :gamma], q), axis=-1)
  return KernelOutput(n, next_token, accepted, min_pq)


def greedy_kernel(draft_tokens: Array, q: Array, target_tokens: Array,
                  proposed: Array | None = None) -> KernelOutput:
  """``speculative_sampling`` at T = 0, l = 1 from the target's argmax tokens
  [B, γ+1] alone: x_i passes iff x_i = t_i, min_pq = q_i(t_i) (docs/exactness.md,
  section 4); no one-hot p is built."""
  gamma = draft_tokens.shape[1]
  accepted, n = _leading(draft_tokens == target_tokens[:, :gamma], proposed)
  next_token = jnp.take_along_axis(target_tokens, n[:, None], axis=1)[:, 0]
  min_pq = jnp.take_along_axis(q, target_tokens[:, :gamma, None], axis=-1)[..., 0]
  return KernelOutput(n, next_token, accepted, min_pq.astype(jnp.float32))
