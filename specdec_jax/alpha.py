"""Measuring α, the acceptance rate (paper §3.1, Corollary 3.6, §4.2):
α = E[Σ_x min(p(x), q(x))] along the target's own outputs, with lower variance
than counting. ``min_pq_along`` uses one teacher-forced pass; a draft reading
the target's states is measured in the engine's rounds (``min_pq_in_rounds``)."""

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
  """q_t [B, T, V] at every position of fixed outputs [B, T] (γ = 1 from each prefix)."""
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
  """The first ``n`` rows as (inputs [batch_size, S], real rows) batches, the last
  padded with its last row."""
  out = []
  for start in range(0, max(n, 1), batch_size):
    rows = list(range(start, min(start + batch_size, max(n, 1))))
    padded = rows + [rows[-1]] * (batch_size - len(rows))
    out.append((jnp.asarray(np.asarray(inputs)[padded]), len(rows)))
  return out


@functools.partial(jax.jit, static_argnames=("target", "sampling"))
def min_pq_along(target: T5Model, params: Any, draft: Any, inputs: Array, tokens: Array,
                 lengths: Array, sampling: SamplingConfig) -> Array:
  """Σ_t Σ_x min(p_t(x), q_t(x)) per row [B] over the first ``lengths`` tokens of
  tokens [B, T]: p from one teacher-forced pass, q from the draft on the same
  prefix, both standardized (§2.2, §4.2's method)."""
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
  """(outputs, Σ min(p, q) [B], evaluated [B]) of the engine's rounds at ``gamma``."""
  out = speculative_decode(target, params, draft, inputs, key, gamma=gamma,
                           max_decode_len=max_decode_len, sampling=sampling,
                           eos_id=target.config.eos_id, partitioner=partitioner)
  return (out, np.asarray(out.stats.min_pq_sum), np.asarray(out.stats.evaluated_at).sum(1))


def alpha_by_position_in_rounds(target: T5Model, params: Any, draft: Any,
                                batches: Sequence[tuple[Array, int]], key: Array, gamma: int,
                                sampling: SamplingConfig, max_decode_len: int,
                                partitioner: Any = None) -> list[float]:
  """α_i = accepted_at / evaluated_at in the engine's rounds (0 if never
  evaluated), for block drafts."""
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
  """Standard error of α = Σ sums / Σ tokens with sequences as clusters: the
  linearized ratio variance m/(m-1) Σ_i (s_i - α n_i)² / (Σ n_i)², never below
  the binomial one."""
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


def estimate_alpha(target: T5Model, params: Any, draft: Any, batches: Sequence[tuple[Array, int]],
                   key: Array, sampling: SamplingConfig, max_decode_len: int,
                   partitioner: Any = None, rounds_gamma: int = 4) -> tuple[float, int, float]:
  """(α, tokens, standard error) over ``batches`` of (inputs, real rows)."""
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
