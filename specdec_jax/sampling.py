"""Standardized sampling (paper §2.2): argmax, temperature, top-k and top-p as one
distribution (``standardize``), shared by the baseline, p and q. T5X semantics:
T = 0 is argmax; ``topk`` keeps k (ties by index); ``topp`` the smallest
most-probable prefix reaching it (ties kept); both at once are an error."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Sampling settings (paper §2.2). Frozen and hashable: a static jit argument.

  temperature: the temperature the logits are divided by, >= 0 (0: argmax).
  topk: keep only the k most probable tokens (0: off).
  topp: keep the most probable tokens whose probabilities add up to topp, in (0, 1] (0: off).

  Setting both topk and topp raises ``ValueError``.
  """

  temperature: float = 0.0
  topk: int = 0
  topp: float = 0.0

  def __post_init__(self):
    if not self.temperature >= 0:  # also rejects NaN
      raise ValueError(f"temperature must be >= 0 (0 means argmax), got {self.temperature}")
    if self.topk < 0:
      raise ValueError(f"topk must be >= 0 (0 means off), got {self.topk}")
    if not 0.0 <= self.topp <= 1.0:
      raise ValueError(f"topp must be in (0, 1] (or 0 for off), got {self.topp}")
    if self.topk and self.topp:
      raise ValueError(f"topk ({self.topk}) and topp ({self.topp}) cannot both be set "
                       "(as in T5X temperature_sample): choose one")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def argmax(x: Array) -> Array:
  """x [..., V] -> [...] int32, the first maximum, as a max and a min reduction
  (XLA:CPU lowers ``argmax`` to a scalar loop)."""
  v = x.shape[-1]
  m = jnp.max(x, axis=-1, keepdims=True)
  idx = jnp.min(jnp.where(x == m, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
  return jnp.minimum(idx, v - 1)  # all-NaN rows: stay in range


def _topk_mask(logits: Array, k: int) -> Array:
  k = min(k, logits.shape[-1])
  _, idx = jax.lax.top_k(logits, k)
  keep = jnp.zeros(logits.shape, bool)
  return jnp.put_along_axis(keep, idx, True, axis=-1, inplace=False)


def _topp_mask(logits: Array, p: float) -> Array:
  sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
  cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
  # First sorted index whose cumulative mass reaches p (clipped for rounding).
  cut = jnp.minimum(jnp.sum(cum < p, axis=-1, keepdims=True), logits.shape[-1] - 1)
  threshold = jnp.take_along_axis(sorted_logits, cut, axis=-1)
  return logits >= threshold


def standardize(logits: Array, config: SamplingConfig) -> Array:
  """logits [..., V] -> the distribution sampled from, [..., V] float32 (§2.2):
  one-hot of the first argmax at T = 0, else the softmax of the scaled logits on
  the top-k / top-p set. One meaning of p throughout (docs/exactness.md, section 1)."""
  logits = logits.astype(jnp.float32)
  if config.greedy:
    return jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
  scaled = logits / config.temperature
  if config.topk:
    scaled = jnp.where(_topk_mask(scaled, config.topk), scaled, -jnp.inf)
  elif config.topp:
    scaled = jnp.where(_topp_mask(scaled, config.topp), scaled, -jnp.inf)
  return jax.nn.softmax(scaled, axis=-1)


def sample(key: Array, probs: Array, config: SamplingConfig) -> Array:
  """One token per row from probs [..., V] -> [...] int32 (argmax needs no key)."""
  return argmax(probs) if config.greedy else sample_any(key, probs)


def sample_with(u: Array | None, probs: Array, config: SamplingConfig) -> Array:
  """``sample`` with given uniforms u [...] in [0, 1) (None at T = 0)."""
  return argmax(probs) if config.greedy else inverse_cdf(probs, u)


def _block_size(v: int) -> int:
  """A divisor of V near sqrt(V) (a free reshape), else 128 with zero padding."""
  divisors = [d for d in range(16, min(v, 1024) + 1) if v % d == 0]
  if not divisors:
    return 128
  return min(divisors, key=lambda d: d + v // d)


def _first(cond: Array, fallback: Array) -> Array:
  """Index of the first True along the last axis; ``fallback`` where none."""
  n = cond.shape[-1]
  idx = jnp.min(jnp.where(cond, jnp.arange(n, dtype=jnp.int32), n), axis=-1)
  return jnp.where(idx < n, idx, fallback)


def _last_positive(x: Array) -> Array:
  return jnp.max(jnp.where(x > 0, jnp.arange(x.shape[-1], dtype=jnp.int32), 0), axis=-1)


def sample_any(key: Array, probs: Array) -> Array:
  """Sample from an unnormalized nonnegative probs [..., V] -> [...] int32:
  two-level inverse CDF over ``_block_size(V)`` blocks, one uniform per row;
  zero entries are never drawn."""
  return inverse_cdf(probs, jax.random.uniform(key, probs.shape[:-1]))


def inverse_cdf(probs: Array, u: Array) -> Array:
  """The first token whose cumulative mass exceeds u · sum(probs), u [...] in [0, 1)."""
  probs = probs.astype(jnp.float32)
  v = probs.shape[-1]
  block = _block_size(v)
  nb = -(-v // block)
  if nb * block > v:
    probs = jnp.pad(probs, [(0, 0)] * (probs.ndim - 1) + [(0, nb * block - v)])
  blocks = probs.reshape(probs.shape[:-1] + (nb, block))
  mass = jnp.sum(blocks, axis=-1)                                   # [..., nb]
  cdf = jnp.cumsum(mass, axis=-1)
  u = u.astype(jnp.float32)[..., None] * cdf[..., -1:]
  j = _first((cdf > u) & (mass > 0), _last_positive(mass))         # the block u is in
  inner = jnp.take_along_axis(blocks, j[..., None, None], axis=-2)[..., 0, :]
  # Mass before block j: the boundary the block search compared u against.
  below = jnp.where(j > 0, jnp.take_along_axis(cdf, jnp.maximum(j - 1, 0)[..., None], axis=-1)[
      ..., 0], 0.0)
  within = jnp.cumsum(inner, axis=-1)
  m = _first((within > (u[..., 0] - below)[..., None]) & (inner > 0), _last_positive(inner))
  return jnp.minimum(j * block + m, v - 1).astype(jnp.int32)
