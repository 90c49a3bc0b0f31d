"""Prompt lookup where the context has a match, a T5 draft elsewhere.

On copy-heavy tasks (translation into a close language, modernization,
summarization) part of the output repeats the input. Prompt lookup (§3.6
style, c ≈ 0) proposes those stretches; a T5 draft knows the rest. This draft
combines them per position: while the committed context ends in an n-gram
(n >= ``min_ngram``) that occurs earlier in the context, the draft proposes
the tokens that followed it, with q = one-hot; from the first position where
the copy has no valid continuation, it proposes from the T5 draft's q.

Exactness (Algorithm 1 needs each x_i drawn from the q_i it reports): whether
position i copies depends only on the input and the committed prefix (and, for
i > 1, on x_1..x_{i-1}, which are the copied tokens themselves), never on the
target; a copied x_i is drawn from its one-hot q_i with probability 1, and a
T5 position is drawn from the T5 draft's standardized q_i as in ``T5Draft``.
So the output distribution is the target's, whatever the mix.

Cost: the T5 draft runs every step (it must see the proposed tokens to keep
its cache, see ``T5Draft``), so c is the T5 draft's; the lookup adds a few
vector ops over [B, S + T] per round.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.drafts.prompt_lookup import lookup_continuation
from specdec_jax.drafts.t5_draft import T5Draft
from specdec_jax.models.t5 import DecoderCache
from specdec_jax.sampling import SamplingConfig

Array = jax.Array


class LookupT5State(struct.PyTreeNode):
  inputs: Array          # [B, S] encoder inputs, searched by the lookup
  cache: DecoderCache    # the T5 draft's


@struct.dataclass
class LookupT5Draft:
  """Copy while the context has a match of length >= ``min_ngram`` (up to
  ``max_ngram``), else the T5 draft ``t5`` (module docstring)."""

  t5: T5Draft
  max_ngram: int = struct.field(pytree_node=False, default=3)
  min_ngram: int = struct.field(pytree_node=False, default=1)

  @property
  def vocab_size(self) -> int:
    return self.t5.vocab_size

  def init(self, inputs: Array, cache_len: int) -> LookupT5State:
    return LookupT5State(inputs, self.t5.init(inputs, cache_len))

  def copy_plan(self, state: LookupT5State, seq: Array, length: Array,
                gamma: int) -> tuple[Array, Array]:
    """(tokens [B, γ], copy [B, γ] bool): which leading positions copy, and what."""
    cont, matched, ok = lookup_continuation(state.inputs, seq, length, gamma, self.max_ngram)
    copy = ok & (matched >= self.min_ngram)[:, None]
    # Prefix-closed: once a position falls back to the T5 draft, the context
    # no longer follows the matched occurrence, so later positions do too.
    return cont, jnp.cumprod(copy.astype(jnp.int32), axis=1).astype(bool)

  def propose(self, state: LookupT5State, seq: Array, length: Array, gamma: int,
              sampling: SamplingConfig, key: Array) -> tuple[Array, Array, LookupT5State]:
    cont, copy_at = self.copy_plan(state, seq, length, gamma)

    def copy(i, q, x):
      """Position i's token and q: the copy (one-hot) or the T5 draft's own."""
      one_hot = jax.nn.one_hot(cont[:, i], q.shape[-1], dtype=q.dtype)
      return (jnp.where(copy_at[:, i], cont[:, i], x),
              jnp.where(copy_at[:, i, None], one_hot, q))

    tokens, q, cache = self.t5.propose(state.cache, seq, length, gamma, sampling, key,
                                       override=copy)
    return tokens, q, state.replace(cache=cache)

  def commit(self, state: LookupT5State, seq: Array, length: Array) -> LookupT5State:
    return state.replace(cache=self.t5.commit(state.cache, seq, length))
