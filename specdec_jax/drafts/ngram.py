"""Negligible-cost approximation models (paper §3.6, Table 3): unigram, bigram
(each token's ``top_m`` successors interpolated with the unigram)."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec_jax.drafts.base import gather_positions
from specdec_jax.sampling import sample, standardize

Array = jax.Array


def _unigram_logprobs(counts: np.ndarray, smoothing: float) -> np.ndarray:
  probs = (counts + smoothing) / (counts.sum() + smoothing * counts.size)
  return np.log(probs).astype(np.float32)


@struct.dataclass
class UnigramDraft:
  """q(x) = add-``smoothing`` unigram frequency, independent of the context."""

  logprobs: Array  # [V]

  @property
  def vocab_size(self) -> int:
    return self.logprobs.shape[-1]

  @classmethod
  def fit(cls, sequences: Iterable[Sequence[int]], vocab_size: int,
          smoothing: float = 0.1) -> "UnigramDraft":
    counts = np.zeros(vocab_size, np.float64)
    for s in sequences:
      np.add.at(counts, np.asarray(s, np.int64), 1)
    return cls(jnp.asarray(_unigram_logprobs(counts, smoothing)))

  def init(self, inputs: Array, cache_len: int) -> Any:
    return ()

  def propose(self, state, seq, length, gamma, sampling, key):
    b = seq.shape[0]
    q = standardize(jnp.broadcast_to(self.logprobs, (b, gamma, self.vocab_size)), sampling)
    tokens = jnp.stack([sample(k, q[:, i], sampling)
                        for i, k in enumerate(jax.random.split(key, gamma))], axis=1)
    return tokens, q, state

  def commit(self, state, seq, length):
    return state


@struct.dataclass
class BigramDraft:
  """q(x | prev) = (1 - λ) bigram_top_m(x | prev) + λ' unigram(x) (``next_ids``,
  ``next_probs`` [V, top_m])."""

  unigram: Array      # [V] probabilities
  next_ids: Array     # [V, M] int32
  next_probs: Array   # [V, M] float32, rows sum to <= 1 - backoff

  @property
  def vocab_size(self) -> int:
    return self.unigram.shape[-1]

  @classmethod
  def fit(cls, sequences: Iterable[Sequence[int]], vocab_size: int, top_m: int = 32,
          backoff: float = 0.1, smoothing: float = 0.1, start_id: int = 0) -> "BigramDraft":
    """Counts (prev, next) pairs; each sequence is preceded by ``start_id``."""
    uni = np.zeros(vocab_size, np.float64)
    pairs: dict[tuple[int, int], int] = {}
    for s in sequences:
      s = [start_id] + [int(t) for t in s]
      np.add.at(uni, np.asarray(s[1:], np.int64), 1)
      for a, b in zip(s[:-1], s[1:]):
        pairs[(a, b)] = pairs.get((a, b), 0) + 1
    unigram = np.exp(_unigram_logprobs(uni, smoothing)).astype(np.float64)
    ids = np.zeros((vocab_size, top_m), np.int32)
    probs = np.zeros((vocab_size, top_m), np.float64)
    by_prev: dict[int, list[tuple[int, int]]] = {}
    for (a, b), c in pairs.items():
      by_prev.setdefault(a, []).append((c, b))
    for a, lst in by_prev.items():
      total = sum(c for c, _ in lst)
      lst.sort(key=lambda cb: (-cb[0], cb[1]))
      top = lst[:top_m]
      ids[a, :len(top)] = [b for _, b in top]
      probs[a, :len(top)] = [(1 - backoff) * c / total for c, _ in top]
    return cls(jnp.asarray(unigram, jnp.float32), jnp.asarray(ids), jnp.asarray(probs, jnp.float32))

  def distribution(self, prev: Array) -> Array:
    """prev [B] -> q(. | prev) [B, V] (a proper distribution)."""
    ids, probs = self.next_ids[prev], self.next_probs[prev]
    rest = 1.0 - jnp.sum(probs, axis=-1, keepdims=True)
    dense = rest * self.unigram[None, :]
    rows = jnp.broadcast_to(jnp.arange(prev.shape[0])[:, None], ids.shape)
    return dense.at[rows, ids].add(probs)

  def init(self, inputs: Array, cache_len: int) -> Any:
    return ()

  def propose(self, state, seq, length, gamma, sampling, key):
    prev = gather_positions(seq, length[:, None])[:, 0]
    tokens, qs = [], []
    for k in jax.random.split(key, gamma):  # γ is small and static
      q = standardize(jnp.log(self.distribution(prev)), sampling)
      prev = sample(k, q, sampling)
      tokens.append(prev)
      qs.append(q)
    return jnp.stack(tokens, 1), jnp.stack(qs, 1), state

  def commit(self, state, seq, length):
    return state
