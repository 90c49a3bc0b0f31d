"""A T5 of any size as the approximation model (the paper's T5-small/base/large)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.drafts.base import gather_positions
from specdec_jax.models.t5 import DecoderCache, T5Model
from specdec_jax.partitioning import Partitioner, constrain_cache
from specdec_jax.sampling import SamplingConfig, sample, standardize

Array = jax.Array


@struct.dataclass
class T5Draft:
  """M_q = a T5 encoder-decoder with its own encoder and KV cache.

  Cache bookkeeping: after a round that committed up to output length n, the
  cache holds valid keys/values for decoder positions 0..n-2 at least (position
  n-1 is missing only when all γ drafts were accepted, because x_γ itself was
  never fed). So each round's first draft step feeds the two tokens at
  positions n-1 and n in one call — nearly free in a memory-bound step — and
  the remaining γ-1 steps feed one token each. Nothing needs rolling back:
  stale entries past a position are never read by a query at that position.

  With a ``partitioner`` the params are expected on its mesh and the cache is
  pinned to its layout, like the target's.
  """

  params: Any
  model: T5Model = struct.field(pytree_node=False)
  partitioner: Partitioner | None = struct.field(pytree_node=False, default=None)

  @property
  def vocab_size(self) -> int:
    return self.model.config.vocab_size

  def init(self, inputs: Array, cache_len: int) -> DecoderCache:
    encoded = self.model.encode(self.params, inputs)
    return constrain_cache(self.model.init_cache(self.params, encoded, inputs, cache_len),
                           self.partitioner, "draft cache")

  def propose(self, state: DecoderCache, seq: Array, length: Array, gamma: int,
              sampling: SamplingConfig, key: Array) -> tuple[Array, Array, DecoderCache]:
    keys = jax.random.split(key, gamma)
    # Position n-1 is -1 on the first round: the model drops negative writes.
    pos = length[:, None] + jnp.arange(-1, 1, dtype=jnp.int32)[None, :]
    logits, cache = self.model.decode(self.params, gather_positions(seq, pos), pos, state)
    cache = constrain_cache(cache, self.partitioner, "draft cache")
    q1 = standardize(logits[:, -1], sampling)
    x1 = sample(keys[0], q1, sampling)

    def step(carry, inp):
      cache, x = carry
      i, k = inp
      logits, cache = self.model.decode(self.params, x[:, None], (length + i)[:, None], cache)
      cache = constrain_cache(cache, self.partitioner, "draft cache")
      q = standardize(logits[:, 0], sampling)
      nxt = sample(k, q, sampling)
      return (cache, nxt), (nxt, q)

    (cache, _), (xs, qs) = jax.lax.scan(step, (cache, x1),
                                        (jnp.arange(1, gamma, dtype=jnp.int32), keys[1:]))
    tokens = jnp.concatenate([x1[:, None], jnp.moveaxis(xs, 0, 1)], axis=1)
    q = jnp.concatenate([q1[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
    return tokens, q, cache

  def commit(self, state: DecoderCache, seq: Array, length: Array) -> DecoderCache:
    del seq, length  # position-indexed cache: rollback is implicit
    return state
