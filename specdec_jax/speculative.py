"""The speculative sampling kernel (paper §2.3, Algorithm 1; lenience, App. A.5).

Batched over rows; every row keeps its own prefix of the γ draft tokens. For any
draft distributions q, the emitted tokens follow the target's p exactly (App.
A.1); proof: docs/exactness.md, sections 2-4 (lenience l < 1: section 9).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdec_jax.sampling import argmax, inverse_cdf

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
  """Per-position verdicts [B, γ] -> (accepted: the leading run of passes,
  prefix-closed [B, γ]; n: its length [B]). Positions past a row's
  ``proposed`` count (if given) never pass."""
  if proposed is not None:
    accept = accept & (jnp.arange(accept.shape[1])[None] < proposed[:, None])
  accepted = jnp.cumprod(accept.astype(jnp.int32), axis=-1).astype(bool)
  return accepted, jnp.sum(accepted, axis=-1).astype(jnp.int32)


def speculative_sampling(key: Array, draft_tokens: Array, q: Array, p: Array,
                         lenience: float = 1.0, greedy: bool = False,
                         p_raw: Array | None = None,
                         proposed: Array | None = None) -> KernelOutput:
  """Algorithm 1's acceptance and correction (paper §2.3), batched.

  Args:
    key: PRNG key.
    draft_tokens: [B, γ] x_1..x_γ proposed by the draft.
    q: [B, γ, V] the (standardized) distributions the x_i were drawn from.
    p: [B, γ+1, V] the target's standardized distributions p_1..p_{γ+1}.
    lenience: l in (0, 1] (App. A.5). l = 1 is exact; any l < 1 changes the
      output distribution (each token's probability stays <= p(x)/l).
    greedy: argmax decoding: p must be one-hot (``standardize`` at
      temperature 0 makes it so), and then ``key`` is not used. With l < 1
      the paper's argmax rule applies before standardization: accept x when
      p_raw(x) >= l * max p_raw.
    p_raw: [B, γ, V] the target's unstandardized softmax, needed only for
      greedy with l < 1.
    proposed: [B] int32 c_b <= γ, or None (= γ): row b proposed only x_1..x_c
      (adaptive rounds, ``decoding.AdaptiveConfig``). Positions past c are
      not tested (accepted is False there), n <= c, and when all c pass the
      next token is the bonus drawn from p_{c+1}: Algorithm 1 for γ = c,
      with the same uniforms as the full round on positions 1..c, and the
      same draws as without ``proposed`` where c = γ.

  Sampling case: r_i ~ U(0, 1]; x_i is accepted when r_i * l * q_i(x_i) <=
  p_i(x_i) (i.e. r_i <= p_i(x_i) / (l q_i(x_i))) and p_i(x_i) > 0; n is the
  number of leading acceptances; t ~ norm(max(0, p_{n+1} - l q_{n+1})) if
  n < γ, else t ~ p_{γ+1}. The residual with l < 1 keeps P(x) <= p(x)/l.

  Returns:
    ``KernelOutput`` (shapes there). With l = 1, next_token given the accepted
    prefix is distributed exactly as p_{n+1} (docs/exactness.md, sections 2-3).
  """
  b, gamma = draft_tokens.shape
  px = jnp.take_along_axis(p[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
  if greedy:
    # p is one-hot (``standardize`` at temperature 0), so the sampling rule
    # below needs no random numbers: for any r in (0, 1], l <= 1 and
    # q(x) <= 1 it accepts x iff p(x) = 1, i.e. iff x is p's argmax. Same
    # verdicts as the general rule, without drawing r.
    if lenience < 1.0:
      raw_x = jnp.take_along_axis(p_raw, draft_tokens[..., None], axis=-1)[..., 0]
      accept = raw_x >= lenience * jnp.max(p_raw, axis=-1)
    else:
      accept = px > 0
  else:
    # One PRNG draw for the round: r_1..r_γ and the uniform of the next
    # token's inverse CDF.
    u = jax.random.uniform(key, (b, gamma + 1))
    qx = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    # r in (0, 1]: a token with p(x) = 0 can never pass, even at r's extreme.
    r = 1.0 - u[:, :gamma]
    accept = (r * (lenience * qx) <= px) & (px > 0)
  accepted, n = _leading(accept, proposed)

  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
  if greedy:
    # p_n is one-hot at a = argmax p_n: max(p_n - l q_n, 0) is 1 - l q_n(a)
    # at a and 0 elsewhere, so the normalized residual is one-hot at a (or,
    # with no mass left, falls back to p_n itself): its argmax is a. This
    # skips the residual's three passes over the vocabulary.
    next_token = argmax(p_n)
  else:
    # p' without a branch: q_{c+1} := 0, so n = c (all proposals passed;
    # c = γ without ``proposed``) gives p' = p_{c+1} (the bonus). Gathered at
    # min(n, γ-1) and zeroed, instead of concatenating a zero row to q (a
    # copy of all of q every round).
    q_n = jnp.take_along_axis(q, jnp.minimum(n, gamma - 1)[:, None, None], axis=1)[:, 0]
    q_n = jnp.where((n < (gamma if proposed is None else proposed))[:, None], q_n, 0.0)
    residual = jnp.maximum(p_n - lenience * q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # Rejection when p == q up to rounding leaves no mass: fall back to p itself.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
    next_token = inverse_cdf(residual, u[:, gamma])
  min_pq = jnp.sum(jnp.minimum(p[:, :gamma], q), axis=-1)
  return KernelOutput(n, next_token, accepted, min_pq)


def greedy_kernel(draft_tokens: Array, q: Array, target_tokens: Array,
                  proposed: Array | None = None) -> KernelOutput:
  """``speculative_sampling`` at temperature 0 and lenience 1 from the target's
  argmax tokens alone; returns the same ``KernelOutput``, field for field.

  draft_tokens [B, γ]; q [B, γ, V]; target_tokens [B, γ+1]: ``sampling.argmax``
  of the target's logits at each position, i.e. where ``standardize``'s one-hot
  p_i has its 1. Then x_i passes iff x_i = t_i, the next token is t_{n+1}, and
  Σ_x min(p_i, q_i) = q_i(t_i) (docs/exactness.md, section 4). No [B, γ+1, V]
  one-hot is built, so nothing is read over the vocabulary at temperature 0.
  ``proposed`` as in ``speculative_sampling``.
  """
  gamma = draft_tokens.shape[1]
  accepted, n = _leading(draft_tokens == target_tokens[:, :gamma], proposed)
  next_token = jnp.take_along_axis(target_tokens, n[:, None], axis=1)[:, 0]
  min_pq = jnp.take_along_axis(q, target_tokens[:, :gamma, None], axis=-1)[..., 0]
  return KernelOutput(n, next_token, accepted, min_pq.astype(jnp.float32))
