"""Measuring α, the acceptance rate (paper §3.1, Corollary 3.6, §4.2).

α = E[Σ_x min(p(x), q(x))] along the target's own outputs (Corollary 3.6):
the expected acceptance of one draft token, with lower variance than counting
acceptances. ``min_pq_along`` computes the sums along fixed outputs (one
teacher-forced target pass, the draft fed the same prefixes); a draft whose q
depends on where a round starts (one that reads the target's decoder states)
is measured in the engine's own rounds instead (``min_pq_in_rounds``).
``estimate_alpha`` puts either over a few batches, with the standard error of
the ratio (``alpha_standard_error``).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.decoding import SpecOutput, speculative_decode, temperature_sample
from specdec_jax.drafts.base import capabilities
from specdec_jax.models.t5 import T5Model, shift_right
from specdec_jax.sampling import SamplingConfig, standardize

Array = jax.Array


def _draft_q_along(draft: Any, inputs: Array, tokens: Array, sampling: SamplingConfig) -> Array:
  """q_t [B, T, V] for every position t of fixed outputs tokens [B, T] (γ = 1
  proposals, each from the true prefix)."""
  b, t = tokens.shape
  seq = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), tokens, jnp.zeros((b, 1), jnp.int32)], 1)
  state = draft.init(inputs, t + 2)

  def step(state, i):
    _, q, state = draft.propose(state, seq, jnp.full((b,), i, jnp.int32), 1, sampling,
                                jax.random.PRNGKey(0))
    return state, q[:, 0]

  _, qs = jax.lax.scan(step, state, jnp.arange(t, dtype=jnp.int32))
  return jnp.moveaxis(qs, 0, 1)


def alpha_batches(inputs: np.ndarray, n: int, batch_size: int) -> list[tuple[Array, int]]:
  """The first ``n`` rows of ``inputs`` (at least one) as ``estimate_alpha``'s
  (inputs [batch_size, S], real rows) batches; a short last batch repeats its
  last row, which is not counted."""
  out = []
  for start in range(0, max(n, 1), batch_size):
    rows = list(range(start, min(start + batch_size, max(n, 1))))
    padded = rows + [rows[-1]] * (batch_size - len(rows))
    out.append((jnp.asarray(np.asarray(inputs)[padded]), len(rows)))
  return out


@functools.partial(jax.jit, static_argnames=("target", "sampling"))
def min_pq_along(target: T5Model, params: Any, draft: Any, inputs: Array, tokens: Array,
                 lengths: Array, sampling: SamplingConfig) -> Array:
  """Σ_t Σ_x min(p_t(x), q_t(x)) per row [B] over the first ``lengths`` [B]
  tokens of tokens [B, T].

  p from one teacher-forced target pass, q from the draft fed the same
  prefix; both standardized as in decoding (§2.2). Divided by the token count
  this is the α estimate of Corollary 3.6 (paper §4.2's method).
  """
  if capabilities(draft).target_states:
    raise ValueError("this draft reads the target's decoder states (feature bridge): its q "
                     "depends on where a round starts, so α is measured in the engine's "
                     "rounds (min_pq_in_rounds), not along fixed outputs")
  p = standardize(target(params, inputs, shift_right(tokens)), sampling)
  q = _draft_q_along(draft, inputs, tokens, sampling)
  mask = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
  return jnp.sum(jnp.where(mask, jnp.sum(jnp.minimum(p, q), -1), 0.0), 1)


def min_pq_in_rounds(target: T5Model, params: Any, draft: Any, inputs: Array, key: Array,
                     gamma: int, max_decode_len: int, sampling: SamplingConfig,
                     partitioner: Any = None) -> tuple[SpecOutput, np.ndarray, np.ndarray]:
  """(outputs, Σ min(p, q) per row [B], evaluated positions per row [B]) of
  the engine's own rounds at ``gamma``: α for a draft whose q depends on where
  a round starts (one that reads the target's decoder states,
  ``feature_bridge``), for which ``min_pq_along`` is undefined. The sums run
  over the positions the target evaluated (``SpecStats``), so sum / evaluated
  is Corollary 3.6's estimate in the rounds decoding actually runs."""
  out = speculative_decode(target, params, draft, inputs, key, gamma=gamma,
                           max_decode_len=max_decode_len, sampling=sampling,
                           eos_id=target.config.eos_id, partitioner=partitioner)
  return (out, np.asarray(out.stats.min_pq_sum),
          np.asarray(out.stats.evaluated_at).sum(1))


def alpha_by_position_in_rounds(target: T5Model, params: Any, draft: Any,
                                batches: Sequence[tuple[Array, int]], key: Array, gamma: int,
                                sampling: SamplingConfig, max_decode_len: int,
                                partitioner: Any = None) -> list[float]:
  """α_i, i = 1..γ: the rate at which the engine's rounds at ``gamma``
  accept proposal i given proposals 1..i−1 were accepted (``SpecStats``'s
  accepted_at / evaluated_at over the batches' real rows; 0 where a position
  was never evaluated). For a draft whose acceptance falls with the position
  (a block draft, ``specdec_jax.drafts.t5_block``), where one α does not
  describe a round."""
  acc = np.zeros(gamma)
  ev = np.zeros(gamma)
  for i, (inputs, n) in enumerate(batches):
    out = speculative_decode(target, params, draft, inputs, jax.random.fold_in(key, i),
                             gamma=gamma, max_decode_len=max_decode_len, sampling=sampling,
                             eos_id=target.config.eos_id, partitioner=partitioner)
    acc += np.asarray(out.stats.accepted_at)[:n].sum(0)
    ev += np.asarray(out.stats.evaluated_at)[:n].sum(0)
  return [float(a / e) if e else 0.0 for a, e in zip(acc, ev)]


def alpha_standard_error(sums: np.ndarray, tokens: np.ndarray) -> float:
  """Standard error of α = Σ sums / Σ tokens, with sequences as clusters.

  Tokens of one sequence are correlated (a hard verse is hard throughout), so
  the binomial sqrt(α(1-α)/n) understates the error; this is the usual
  linearized variance of a ratio estimator over m sequences,
  m/(m-1) Σ_i (s_i - α n_i)² / (Σ n_i)², and never below the binomial one.
  """
  sums, tokens = np.asarray(sums, float), np.asarray(tokens, float)
  n = tokens.sum()
  if n <= 0:
    return 0.0
  alpha = sums.sum() / n
  binomial = float(np.sqrt(max(alpha * (1 - alpha), 0.0) / n))
  m = len(sums)
  if m < 2:
    return binomial
  cluster = float(np.sqrt(m / (m - 1) * np.sum((sums - alpha * tokens) ** 2)) / n)
  return max(cluster, binomial)


def estimate_alpha(target: T5Model, params: Any, draft: Any,
                   batches: Sequence[tuple[Array, int]], key: Array, sampling: SamplingConfig,
                   max_decode_len: int, partitioner: Any = None,
                   rounds_gamma: int = 4) -> tuple[float, int, float]:
  """(α, tokens, standard error) from the target's own outputs for ``batches``
  of (inputs [B, S], number of real rows: the rest is padding and not counted).
  A draft that reads the target's decoder states is measured in the engine's
  rounds at ``rounds_gamma`` instead (``min_pq_in_rounds``; tokens are then
  the evaluated positions)."""
  sums, lengths = [], []
  in_rounds = capabilities(draft).target_states
  for i, (inputs, n) in enumerate(batches):
    k = jax.random.fold_in(key, i)
    if in_rounds:
      _, row_sums, counts = min_pq_in_rounds(target, params, draft, inputs, k, rounds_gamma,
                                             max_decode_len, sampling, partitioner)
    else:
      out = temperature_sample(target, params, inputs, k, max_decode_len=max_decode_len,
                               sampling=sampling, eos_id=target.config.eos_id,
                               partitioner=partitioner)
      row_sums = min_pq_along(target, params, draft, inputs, out.tokens, out.length, sampling)
      counts = out.length
    sums += np.asarray(row_sums)[:n].tolist()
    lengths += np.asarray(counts)[:n].tolist()
  tokens = int(np.sum(lengths))
  return (float(np.sum(sums)) / max(tokens, 1), tokens,
          alpha_standard_error(np.asarray(sums), np.asarray(lengths)))
