"""Choosing γ by measurement: the paper's §3.5 with this machine's costs.

Section 3.5 picks the γ that maximizes Theorem 3.8's expected improvement
given α and c. On real hardware the target's pass over γ + 1 tokens is not
free (its cost relative to a one-token step is v(γ), see ``timing``), so the
choice maximizes the v-generalized form

    (1 - α^(γ+1)) / ((1 - α)(γ c(γ) + v(γ)))

over γ = 1..γ_max, with α estimated on the warm-up examples (Corollary 3.6:
α = E[Σ_x min(p(x), q(x))] along the target's own outputs, which has lower
variance than counting acceptances) and c(γ), v(γ) timed with the jitted
pieces the loop runs, scaled by what the two cost together when they
alternate as in a round (``timing.Costs.interplay``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from specdec_jax import theory
from specdec_jax.decoding import speculative_decode, temperature_sample
from specdec_jax.models.t5 import T5Model, shift_right
from specdec_jax.sampling import SamplingConfig, standardize
from specdec_jax.timing import Costs, measure_costs_many

Array = jax.Array

# Below this many target tokens the α estimate is too noisy to choose γ on a
# flat curve: on the demo pair, 80 warm-up tokens gave α 0.725 against 0.63 on
# 100 examples, and 'auto' chose γ = 5 (0.75X) over γ = 1 (0.92X).
MIN_ALPHA_TOKENS = 500


def _draft_q_along(draft: Any, inputs: Array, tokens: Array, sampling: SamplingConfig) -> Array:
  """q_t for every position t of fixed outputs [B, T] (γ = 1 proposals)."""
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
  """Σ_t Σ_x min(p_t(x), q_t(x)) per row over the first ``lengths`` tokens.

  p from one teacher-forced target pass, q from the draft fed the same
  prefix; both standardized as in decoding (§2.2). Divided by the token count
  this is the α estimate of Corollary 3.6 (paper §4.2's method).
  """
  if getattr(draft, "wants_target_states", False):
    raise ValueError("this draft reads the target's decoder states (feature bridge): its q "
                     "depends on where a round starts, so α is measured in the engine's "
                     "rounds (min_pq_in_rounds), not along fixed outputs")
  p = standardize(target(params, inputs, shift_right(tokens)), sampling)
  q = _draft_q_along(draft, inputs, tokens, sampling)
  mask = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
  return jnp.sum(jnp.where(mask, jnp.sum(jnp.minimum(p, q), -1), 0.0), 1)


def min_pq_in_rounds(target: T5Model, params: Any, draft: Any, inputs: Array, key: Array,
                     gamma: int, max_decode_len: int, sampling: SamplingConfig,
                     partitioner: Any = None) -> tuple[Any, np.ndarray, np.ndarray]:
  """(outputs, Σ min(p, q) per row, evaluated positions per row) of the
  engine's own rounds at ``gamma``: α for a draft whose q depends on where a
  round starts (one that reads the target's decoder states,
  ``feature_bridge``), for which ``min_pq_along`` is undefined. The sums run
  over the positions the target evaluated (``SpecStats``), so sum / evaluated
  is Corollary 3.6's estimate in the rounds decoding actually runs."""
  out = speculative_decode(target, params, draft, inputs, key, gamma=gamma,
                           max_decode_len=max_decode_len, sampling=sampling,
                           eos_id=target.config.eos_id, partitioner=partitioner)
  return (out, np.asarray(out.stats.min_pq_sum),
          np.asarray(out.stats.evaluated_at).sum(1))


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


@dataclasses.dataclass(frozen=True)
class GammaChoice:
  """The outcome of ``choose_gamma``: what was measured and what it implies."""

  gamma: int
  alpha: float                       # Σmin(p, q) / tokens on the warm-up outputs
  tokens: int                        # tokens α was estimated on
  alpha_se: float                    # its standard error (``alpha_standard_error``)
  c: dict[int, float]                # in context (``timing.Costs.c_in_context``)
  v: dict[int, float]                # in context (``timing.Costs.v_in_context``)
  predicted: dict[int, float]        # v-generalized Theorem 3.8 per γ
  gap_se: dict[int, float]           # s.e. of predicted[best] - predicted[γ]
  argmax: int                        # the curve's argmax (gamma is within gap_se of it)

  @property
  def costs(self) -> dict[int, float]:
    return {"c": self.c[self.gamma], "v": self.v[self.gamma]}

  def as_record(self) -> dict:
    """JSON-ready (string keys), for examples.jsonl and summary.json."""
    per = lambda d: {str(g): float(x) for g, x in sorted(d.items())}
    return {"gamma": self.gamma, "alpha_warmup": self.alpha, "alpha_tokens": self.tokens,
            "alpha_se": self.alpha_se, "c": per(self.c), "v": per(self.v),
            "predicted": per(self.predicted), "argmax": self.argmax,
            "gap_se": per(self.gap_se)}


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
  in_rounds = bool(getattr(draft, "wants_target_states", False))
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


def choose_gamma(target: T5Model, params: Any, draft: Any,
                 batches: Sequence[tuple[Array, int]], key: Array, sampling: SamplingConfig,
                 max_decode_len: int, gamma_max: int, partitioner: Any = None,
                 costs: Optional[dict[int, Costs]] = None) -> GammaChoice:
  """α on ``batches`` (the warm-up examples, see ``estimate_alpha``), c(γ) and
  v(γ) for γ = 1..γ_max (timed on the first batch), and the γ that maximizes
  the v-generalized Theorem 3.8 (``theory.best_gamma_measured``) — the
  smallest γ within one standard error of the maximum, the errors being α's
  (over warm-up sequences) and the timings' (over repeats).

  ``costs`` reuses measurements already made (e.g. by a sweep; pass all of
  1..γ_max from one ``measure_costs_many`` so they are comparable); missing γ
  are measured here together, in one interleaved measurement.
  """
  if gamma_max < 1:
    raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
  # A state-reading draft's α depends a little on γ (the staleness of what it
  # reads); it is measured in rounds at γ_max, the longest rounds considered.
  alpha, tokens, alpha_se = estimate_alpha(target, params, draft, batches, key, sampling,
                                           max_decode_len, partitioner, rounds_gamma=gamma_max)
  costs = dict(costs or {})
  missing = [g for g in range(1, gamma_max + 1) if g not in costs]
  if missing:
    costs.update(measure_costs_many(target, params, draft, batches[0][0], missing, sampling,
                                    cache_len=max_decode_len + gamma_max + 1,
                                    partitioner=partitioner))
  # In-context costs: the two models timed alternating, as a round runs them
  # (``timing.Costs.interplay``). The interplay grows with γ where the draft's
  # steps evict the target's weights, so ignoring it favours long γ.
  c = {g: costs[g].c_in_context for g in range(1, gamma_max + 1)}
  v = {g: costs[g].v_in_context for g in range(1, gamma_max + 1)}
  c_se = {g: costs[g].c_se * costs[g].interplay for g in c}
  v_se = {g: costs[g].v_se * costs[g].interplay for g in v}
  gamma, argmax, curve, gap_se = theory.gamma_curve(alpha, c, v, alpha_se, c_se, v_se)
  if tokens < MIN_ALPHA_TOKENS:
    # Tokens of one sequence are correlated, so the true error is larger still.
    logging.warning("gamma='auto': alpha estimated on only %d target tokens (standard error "
                    "at least %.3f); the choice may be off on a flat curve. Raise "
                    "Experiment.num_warmup (>= %d tokens recommended)", tokens,
                    float(np.sqrt(alpha * (1 - alpha) / max(tokens, 1))), MIN_ALPHA_TOKENS)
  logging.info("gamma='auto': alpha %.3f +- %.3f on %d warm-up tokens; predicted "
               "improvement by gamma (+- s.e. of its gap to the best): %s -> argmax %d, "
               "chosen %d (the smallest within one s.e.)", alpha, alpha_se, tokens,
               ", ".join(f"{g}: {s:.2f}x +- {gap_se[g]:.2f}" for g, s in curve.items()),
               argmax, gamma)
  if curve[argmax] <= 1.0:
    logging.warning("gamma='auto': no gamma in 1..%d is predicted to beat plain decoding "
                    "(best %.2fx at gamma %d; alpha %.3f, c %.3f, v %.2f in context)",
                    gamma_max, curve[argmax], argmax, alpha, c[argmax], v[argmax])
  return GammaChoice(gamma, alpha, tokens, alpha_se, c, v, curve, gap_se, argmax)
