"""Choosing γ by measurement: the paper's §3.5 with this machine's costs.

Section 3.5 picks the γ that maximizes Theorem 3.8's expected improvement
given α and c. On real hardware the target's pass over γ + 1 tokens is not
free (its cost relative to a one-token step is v(γ), see ``timing``), so the
choice maximizes the v-generalized form

    (1 - α^(γ+1)) / ((1 - α)(γ c(γ) + v(γ)))

over γ = 1..γ_max, with α estimated on the warm-up examples (Corollary 3.6:
α = E[Σ_x min(p(x), q(x))] along the target's own outputs, which has lower
variance than counting acceptances) and c(γ), v(γ) timed with the jitted
pieces the loop runs.
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
from specdec_jax.decoding import temperature_sample
from specdec_jax.models.t5 import T5Model, shift_right
from specdec_jax.sampling import SamplingConfig, standardize
from specdec_jax.timing import Costs, measure_costs

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


@functools.partial(jax.jit, static_argnames=("target", "sampling"))
def min_pq_along(target: T5Model, params: Any, draft: Any, inputs: Array, tokens: Array,
                 lengths: Array, sampling: SamplingConfig) -> Array:
  """Σ_t Σ_x min(p_t(x), q_t(x)) per row over the first ``lengths`` tokens.

  p from one teacher-forced target pass, q from the draft fed the same
  prefix; both standardized as in decoding (§2.2). Divided by the token count
  this is the α estimate of Corollary 3.6 (paper §4.2's method).
  """
  p = standardize(target(params, inputs, shift_right(tokens)), sampling)
  q = _draft_q_along(draft, inputs, tokens, sampling)
  mask = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
  return jnp.sum(jnp.where(mask, jnp.sum(jnp.minimum(p, q), -1), 0.0), 1)


@dataclasses.dataclass(frozen=True)
class GammaChoice:
  """The outcome of ``choose_gamma``: what was measured and what it implies."""

  gamma: int
  alpha: float                       # Σmin(p, q) / tokens on the warm-up outputs
  tokens: int                        # tokens α was estimated on
  c: dict[int, float]
  v: dict[int, float]
  predicted: dict[int, float]        # v-generalized Theorem 3.8 per γ

  @property
  def costs(self) -> dict[int, float]:
    return {"c": self.c[self.gamma], "v": self.v[self.gamma]}

  def as_record(self) -> dict:
    """JSON-ready (string keys), for examples.jsonl and summary.json."""
    per = lambda d: {str(g): float(x) for g, x in sorted(d.items())}
    return {"gamma": self.gamma, "alpha_warmup": self.alpha, "alpha_tokens": self.tokens,
            "c": per(self.c), "v": per(self.v), "predicted": per(self.predicted)}


def estimate_alpha(target: T5Model, params: Any, draft: Any,
                   batches: Sequence[tuple[Array, int]], key: Array, sampling: SamplingConfig,
                   max_decode_len: int, partitioner: Any = None) -> tuple[float, int]:
  """(α, tokens) from the target's own outputs for ``batches`` of
  (inputs [B, S], number of real rows: the rest is padding and not counted)."""
  total, tokens = 0.0, 0
  for i, (inputs, n) in enumerate(batches):
    k = jax.random.fold_in(key, i)
    out = temperature_sample(target, params, inputs, k, max_decode_len=max_decode_len,
                             sampling=sampling, eos_id=target.config.eos_id,
                             partitioner=partitioner)
    sums = min_pq_along(target, params, draft, inputs, out.tokens, out.length, sampling)
    total += float(np.sum(np.asarray(sums)[:n]))
    tokens += int(np.sum(np.asarray(out.length)[:n]))
  return total / max(tokens, 1), tokens


def choose_gamma(target: T5Model, params: Any, draft: Any,
                 batches: Sequence[tuple[Array, int]], key: Array, sampling: SamplingConfig,
                 max_decode_len: int, gamma_max: int, partitioner: Any = None,
                 costs: Optional[dict[int, Costs]] = None) -> GammaChoice:
  """α on ``batches`` (the warm-up examples, see ``estimate_alpha``), c(γ) and
  v(γ) for γ = 1..γ_max (timed on the first batch), and the γ that maximizes
  the v-generalized Theorem 3.8 (``theory.best_gamma_measured``).

  ``costs`` reuses measurements already made (e.g. by a sweep); missing γ
  are measured here, each at the loop's cache length max_decode_len + γ + 1.
  """
  if gamma_max < 1:
    raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
  alpha, tokens = estimate_alpha(target, params, draft, batches, key, sampling,
                                 max_decode_len, partitioner)
  costs = dict(costs or {})
  for g in range(1, gamma_max + 1):
    if g not in costs:
      costs[g] = measure_costs(target, params, draft, batches[0][0], g, sampling,
                               cache_len=max_decode_len + g + 1)
  c = {g: costs[g].c for g in range(1, gamma_max + 1)}
  v = {g: costs[g].v for g in range(1, gamma_max + 1)}
  gamma, curve = theory.best_gamma_measured(alpha, c, v)
  if tokens < MIN_ALPHA_TOKENS:
    # Tokens of one sequence are correlated, so the true error is larger still.
    logging.warning("gamma='auto': alpha estimated on only %d target tokens (standard error "
                    "at least %.3f); the choice may be off on a flat curve. Raise "
                    "Experiment.num_warmup (>= %d tokens recommended)", tokens,
                    float(np.sqrt(alpha * (1 - alpha) / max(tokens, 1))), MIN_ALPHA_TOKENS)
  logging.info("gamma='auto': alpha %.3f on %d warm-up tokens; predicted improvement by "
               "gamma: %s -> gamma %d", alpha, tokens,
               ", ".join(f"{g}: {s:.2f}x" for g, s in curve.items()), gamma)
  if curve[gamma] <= 1.0:
    logging.warning("gamma='auto': no gamma in 1..%d is predicted to beat plain decoding "
                    "(best %.2fx at gamma %d; alpha %.3f, c %.3f, v %.2f)", gamma_max,
                    curve[gamma], gamma, alpha, c[gamma], v[gamma])
  return GammaChoice(gamma, alpha, tokens, c, v, curve)
