"""Prompt lookup where the context has a match, a T5 draft elsewhere: while the
context ends in an n-gram (n >= ``min_ngram``) seen earlier, copy what followed
(one-hot q), else the T5 draft's q. Exact: copying depends only on the context
(docs/exactness.md, sections 3 and 5); the T5 draft runs every step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.drafts.prompt_lookup import lookup_continuation
from specdec_jax.drafts.t5_draft import T5Draft
from specdec_jax.sampling import SamplingConfig
from specdec_jax.tree import DynamicTree

Array = jax.Array


class LookupT5State(struct.PyTreeNode):
  inputs: Array          # [B, S] encoder inputs, searched by the lookup
  cache: Any            # the T5 draft's state (its cache, or a FeatureState)
  tree_round: Array = None  # [] bool: the last proposal decoded a tree into the cache


@struct.dataclass
class LookupT5Draft:
  """Copy while the context has a match (``min_ngram``..``max_ngram``), else ``t5``."""

  t5: T5Draft
  max_ngram: int = struct.field(pytree_node=False, default=3)
  min_ngram: int = struct.field(pytree_node=False, default=1)

  @property
  def vocab_size(self) -> int:
    return self.t5.vocab_size

  def init(self, inputs: Array, cache_len: int) -> LookupT5State:
    return LookupT5State(inputs, self.t5.init(inputs, cache_len), jnp.asarray(False))

  def init_with_target(self, inputs: Array, cache_len: int,
                       target_encoded: Array | None) -> LookupT5State:
    return LookupT5State(inputs, self.t5.init_with_target(inputs, cache_len, target_encoded),
                         jnp.asarray(False))

  def copy_plan(self, state: LookupT5State, seq: Array, length: Array,
                gamma: int) -> tuple[Array, Array]:
    """(tokens [B, γ], copy [B, γ] bool): which leading positions copy, and what."""
    cont, matched, ok = lookup_continuation(state.inputs, seq, length, gamma, self.max_ngram)
    copy = ok & (matched >= self.min_ngram)[:, None]
    # Prefix-closed: once a position falls back to the T5 draft, the context
    # no longer follows the matched occurrence, so later positions do too.
    return cont, jnp.cumprod(copy.astype(jnp.int32), axis=1).astype(bool)

  def _override(self, state: LookupT5State, seq: Array, length: Array, gamma: int):
    """``T5Draft``'s override: the copy (one-hot, certain) where ``copy_plan`` says."""
    cont, copy_at = self.copy_plan(state, seq, length, gamma)

    def copy(i, q, x):
      one_hot = jax.nn.one_hot(cont[:, i], q.shape[-1], dtype=q.dtype)
      return (jnp.where(copy_at[:, i], cont[:, i], x),
              jnp.where(copy_at[:, i, None], one_hot, q), copy_at[:, i])
    return copy

  def propose(self, state: LookupT5State, seq: Array, length: Array, gamma: int,
              sampling: SamplingConfig, key: Array) -> tuple[Array, Array, LookupT5State]:
    tokens, q, cache = self.t5.propose(state.cache, seq, length, gamma, sampling, key,
                                       override=self._override(state, seq, length, gamma))
    return tokens, q, state.replace(cache=cache, tree_round=jnp.asarray(False))

  def propose_dynamic_tree(self, state: LookupT5State, seq: Array, length: Array,
                           tree: DynamicTree, sampling: SamplingConfig, key: Array
                           ) -> tuple[Array, Array, Array, Array, Array, LookupT5State]:
    """``T5Draft.propose_dynamic_tree`` with the copy as every depth's first child."""
    plan = self.copy_plan(state, seq, length, tree.max_depth)
    *out, cache = self.t5.propose_dynamic_tree(state.cache, seq, length, tree, sampling, key,
                                               copy=plan)
    return (*out, state.replace(cache=cache, tree_round=jnp.asarray(True)))

  def commit_tree(self, state: LookupT5State, seq: Array, length: Array, start: Array,
                  path: Array, num_accepted: Array) -> LookupT5State:
    """After a dynamic tree, ``T5Draft.commit_tree``; a chain's cache is in place."""
    moved = self.t5.commit_tree(state.cache, seq, length, start, path, num_accepted)
    cache = jax.tree.map(lambda a, b: jnp.where(state.tree_round, a, b), moved,
                         self.t5.commit(state.cache, seq, length))
    return state.replace(cache=cache)

  def propose_adaptive(self, state: LookupT5State, seq: Array, length: Array, gamma: int,
                       sampling: SamplingConfig, key: Array, limit: Array, threshold: float,
                       skip_below: float | None = None, cumulative: bool = False,
                       drawn: bool = False) -> tuple[Array, Array, Array, Array, LookupT5State]:
    """``T5Draft``'s early exit with copied positions at confidence 1."""
    tokens, q, count, steps, cache = self.t5.propose_adaptive(
        state.cache, seq, length, gamma, sampling, key, limit, threshold,
        skip_below=skip_below, cumulative=cumulative, drawn=drawn,
        override=self._override(state, seq, length, gamma))
    return tokens, q, count, steps, state.replace(cache=cache, tree_round=jnp.asarray(False))

  def commit(self, state: LookupT5State, seq: Array, length: Array) -> LookupT5State:
    return state.replace(cache=self.t5.commit(state.cache, seq, length))

  @property
  def wants_target_states(self) -> bool:
    return self.t5.wants_target_states

  def commit_with_target(self, state: LookupT5State, seq: Array, length: Array,
                         hidden: Array, positions: Array) -> LookupT5State:
    return state.replace(cache=self.t5.commit_with_target(state.cache, seq, length, hidden,
                                                          positions))
