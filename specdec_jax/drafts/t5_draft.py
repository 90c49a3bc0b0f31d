"""A T5 of any size as the approximation model (the paper's T5-small/base/large)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.drafts import base as base_lib
from specdec_jax.drafts import bridge as bridge_lib
from specdec_jax.drafts import feature_bridge as feature_lib
from specdec_jax.drafts import shortlist as shortlist_lib
from specdec_jax.drafts.base import (Level, drawn_probability, expand_level, fill_children,
                                     gather_positions, skip_unsure, top_probability)
from specdec_jax.models.t5 import DecoderCache, T5Model
from specdec_jax.partitioning import Partitioner, constrain_cache
from specdec_jax.sampling import SamplingConfig, sample_with, standardize
from specdec_jax.tree import DynamicTree, RoundTree, TreeShape

Array = jax.Array
# (i, q_i, x_i) -> (x_i, q_i, certain): see T5Draft.propose.
Override = Callable[[Any, Array, Array], tuple[Array, Array, Array]]


def _no_override(i: Any, q: Array, x: Array) -> tuple[Array, Array, Array]:
  del i
  return x, q, jnp.zeros(x.shape, bool)


class FeatureState(struct.PyTreeNode):
  """A feature-bridged draft's state: its cache and h_s K [B, cache_len, d_draft]."""
  cache: DecoderCache
  target_states: Array


class ShortlistState(struct.PyTreeNode):
  """A draft's state (cache or ``FeatureState``) with S's per-example part."""
  inner: Any
  part: shortlist_lib.InputPart


@struct.dataclass
class T5Draft:
  """M_q = a T5 encoder-decoder with its own encoder and KV cache.

  A round's first step feeds positions n-1 and n; stale entries are never read,
  so nothing rolls back. Options: ``partitioner``; ``bridge`` (``drafts.bridge``);
  ``feature`` ({'kernel' [d_target, d_draft], 'staleness' [J, d_draft]},
  ``drafts.feature_bridge``); ``shortlist`` (``drafts.shortlist``); ``observe``
  (profiling: called each step with the last hidden state [B, d] and logits)."""

  params: Any
  model: T5Model = struct.field(pytree_node=False)
  partitioner: Partitioner | None = struct.field(pytree_node=False, default=None)
  bridge: Any = None
  target_params: Any = None
  target_model: T5Model | None = struct.field(pytree_node=False, default=None)
  feature: Any = None
  shortlist: Any = None
  observe: Callable[[Array, Array], None] | None = struct.field(pytree_node=False, default=None)

  @property
  def vocab_size(self) -> int:
    return self.model.config.vocab_size

  @property
  def wants_target_states(self) -> bool:
    """Only a feature-bridged draft reads the target's decoder states."""
    return self.feature is not None

  def init(self, inputs: Array, cache_len: int) -> Any:
    return self.init_with_target(inputs, cache_len, None)

  def init_with_target(self, inputs: Array, cache_len: int, target_encoded: Array | None) -> Any:
    """``init`` given the target's encoder output (None: encode if the bridge needs it)."""
    extra = None
    if self.bridge is not None:
      if target_encoded is None:
        target_encoded = self.target_model.encode(self.target_params, inputs)
      extra = bridge_lib.project(self.bridge, target_encoded)
    encoded = self.model.encode(self.params, inputs, extra)
    cache = constrain_cache(self.model.init_cache(self.params, encoded, inputs, cache_len),
                            self.partitioner, "draft cache")
    states = None
    if self.feature is not None:
      d_draft = self.feature["kernel"].shape[1]
      states = jnp.zeros((inputs.shape[0], cache_len, d_draft), jnp.float32)
    part = (shortlist_lib.for_inputs(self.model, self.params, inputs)
            if self._with_inputs else None)
    return self._join(cache, states, part)

  @property
  def _with_inputs(self) -> bool:
    return self.shortlist is not None and self.shortlist.with_inputs

  def _split(self, state: Any) -> tuple[DecoderCache, Array | None, Any]:
    """state -> (cache, projected target states or None, S's input part or None)."""
    part = None
    if self._with_inputs:
      state, part = state.inner, state.part
    if self.feature is None:
      return state, None, part
    return state.cache, state.target_states, part

  def _join(self, cache: DecoderCache, states: Array | None, part: Any = None) -> Any:
    state = cache if states is None else FeatureState(cache, states)
    return state if part is None else ShortlistState(state, part)

  def _decode(self, tokens: Array, positions: Array, cache: DecoderCache, extra: Array | None,
              part: Any) -> tuple[Array, DecoderCache]:
    """Decode tokens [B, k] -> (logits [B, V] at the last position, cache); with a
    shortlist only over S (XLA drops the full output layer)."""
    if self.shortlist is None and self.observe is None:
      logits, cache = self.model.decode(self.params, tokens, positions, cache, extra)
      return logits[:, -1], cache
    logits, cache, hidden = self.model.decode(self.params, tokens, positions, cache, extra,
                                              return_hidden=True)
    if self.shortlist is None:
      logits = logits[:, -1]
    else:
      logits = shortlist_lib.logits(self.shortlist, part, hidden[:, -1:], self.vocab_size)[:, 0]
    if self.observe is not None:
      jax.debug.callback(self.observe, hidden[:, -1], logits, ordered=True)
    return logits, cache

  def _extra(self, states: Array | None, length: Array, positions: Array) -> Array | None:
    """The feature bridge's extra [B, k, d] at positions [B, k] of a round at n:
    the state at s = min(t, n) - 1, staleness t - n (0 for n - 1)."""
    if states is None:
      return None
    start = jnp.minimum(positions, length[:, None])
    s = start - 1
    h = jnp.take_along_axis(states, jnp.clip(s, 0, states.shape[1] - 1)[..., None], axis=1)
    j = jnp.where(s >= 0, positions - start, -1)
    return feature_lib.add_staleness(self.feature, h, j)

  def _uniforms(self, key: Array, gamma: int, length: Array, sampling: SamplingConfig):
    """The γ steps' uniforms [γ, B], drawn at once (zeros at T = 0, never read)."""
    if sampling.greedy:
      return jnp.zeros((gamma,) + length.shape, jnp.float32)
    return jax.random.uniform(key, (gamma,) + length.shape)

  def _feed(self, cache: DecoderCache, tokens: Array, pos: Array, sampling: SamplingConfig,
            u: Array, states: Array | None, length: Array, part: Any):
    """Feeds tokens [B, k] at pos [B, k] -> (logits, q, next token ~ u [B], cache)."""
    logits, cache = self._decode(tokens, pos, cache, self._extra(states, length, pos), part)
    cache = constrain_cache(cache, self.partitioner, "draft cache")
    q = standardize(logits, sampling)
    return logits, q, sample_with(u, q, sampling), cache

  def _first_step(self, cache: DecoderCache, seq: Array, length: Array, sampling: SamplingConfig,
                  u: Array, states: Array | None = None, part: Any = None):
    """Feeds positions n-1 (-1 on the first round: dropped) and n."""
    pos = length[:, None] + jnp.arange(-1, 1, dtype=jnp.int32)[None, :]
    return self._feed(cache, gather_positions(seq, pos), pos, sampling, u, states, length, part)

  def _step(self, cache: DecoderCache, x: Array, position: Array, sampling: SamplingConfig,
            u: Array, states: Array | None = None, length: Array | None = None, part: Any = None):
    """Feeds x [B] at position [B]."""
    return self._feed(cache, x[:, None], position[:, None], sampling, u, states, length, part)

  def propose(self, state: Any, seq: Array, length: Array, gamma: int, sampling: SamplingConfig,
              key: Array, override: Override | None = None) -> tuple[Array, Array, Any]:
    """γ draft steps. ``override(i, q_i, x_i) -> (x_i, q_i, certain)`` may replace
    each token and its distribution before the next step (``LookupT5Draft``
    copies there), decided without the target; ``certain`` [B] marks one-hot q_i."""
    us = self._uniforms(key, gamma, length, sampling)
    override = override or _no_override
    cache, states, part = self._split(state)
    _, q1, x1, cache = self._first_step(cache, seq, length, sampling, us[0], states, part)
    x1, q1, _ = override(0, q1, x1)

    def step(carry, inp):
      cache, x = carry
      i, u = inp
      _, q, nxt, cache = self._step(cache, x, length + i, sampling, u, states, length, part)
      nxt, q, _ = override(i, q, nxt)
      return (cache, nxt), (nxt, q)

    # Unrolled: a nested loop carries the weights as loop state, and where the
    # first and later steps want different kernel layouts (T5-small on a TPU v4)
    # the compiler would convert them every round.
    (cache, _), (xs, qs) = jax.lax.scan(step, (cache, x1),
                                        (jnp.arange(1, gamma, dtype=jnp.int32), us[1:]),
                                        unroll=True)
    tokens = jnp.concatenate([x1[:, None], jnp.moveaxis(xs, 0, 1)], axis=1)
    q = jnp.concatenate([q1[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
    return tokens, q, self._join(cache, states, part)

  def propose_adaptive(self, state: Any, seq: Array, length: Array, gamma: int,
                       sampling: SamplingConfig, key: Array, limit: Array, threshold: float,
                       skip_below: float | None = None, cumulative: bool = False,
                       override: Override | None = None, drawn: bool = False
                       ) -> tuple[Array, Array, Array, Array, Any]:
    """Up to γ proposals per row with real early exit: a ``lax.while_loop`` that
    ends once no row is proposing. Confidence as in ``base.stop_count`` from the
    model's logits (a ``certain`` row's is 1). Row b matches ``propose`` with the
    same key up to count[b]; stopped rows only write positions rewritten later."""
    b = length.shape[0]
    us = self._uniforms(key, gamma, length, sampling)
    override = override or _no_override

    def confidence_of(q, logits, x, certain):
      conf = (drawn_probability(q, logits, x, sampling) if drawn
              else top_probability(q, logits, sampling))
      return jnp.where(certain, 1.0, conf)

    cache, states, part = self._split(state)
    logits, q1, x1, cache = self._first_step(cache, seq, length, sampling, us[0], states, part)
    x1, q1, certain = override(0, q1, x1)
    tokens = jnp.zeros((b, gamma), jnp.int32).at[:, 0].set(x1)
    qs = jnp.zeros((b, gamma) + q1.shape[-1:], q1.dtype).at[:, 0].set(q1)
    running = confidence_of(q1, logits, x1, certain)  # the rule's statistic after x_1
    # Skipping x_1 may depend on q_1 only, never on x_1 itself (base.skip_unsure).
    first_top = (jnp.where(certain, 1.0, top_probability(q1, logits, sampling)) if drawn
                 else running)
    count = skip_unsure(jnp.minimum(limit, 1), first_top, skip_below)
    going = (count > 0) & (limit > 1) & (running > threshold)

    def cond(c):
      i, going = c[0], c[-1]
      return (i < gamma) & jnp.any(going)

    def body(c):
      i, cache, x, tokens, qs, count, running, going = c
      # x = x_i (1-based), fed at position n + i; yields q_{i+1} and x_{i+1}.
      logits, q, nxt, cache = self._step(cache, x, length + i, sampling, us[i], states,
                                         length, part)
      nxt, q, certain = override(i, q, nxt)
      tokens = tokens.at[:, i].set(nxt)
      qs = qs.at[:, i].set(q)
      count = count + going
      conf = confidence_of(q, logits, nxt, certain)
      running = running * conf if cumulative else conf
      going = going & (i + 1 < limit) & (running > threshold)
      return i + 1, cache, nxt, tokens, qs, count, running, going

    steps, cache, _, tokens, qs, count, _, _ = jax.lax.while_loop(
        cond, body, (jnp.asarray(1, jnp.int32), cache, x1, tokens, qs, count, running, going))
    return tokens, qs, count, steps, self._join(cache, states, part)

  def tree_unsupported(self, tree: TreeShape) -> str | None:
    """Why this draft cannot propose ``tree`` (None: it can, any shape)."""
    del tree
    if self.observe is not None:
      return "an observed T5 draft (profiling) proposes chains only"
    return None

  def _decode_tree(self, tokens: Array, length: Array, tree: TreeShape | RoundTree,
                   cache: DecoderCache, nodes: tuple[int, ...], states: Array | None,
                   part: Any) -> tuple[Array, DecoderCache]:
    """``T5Model.decode_tree`` of tokens [B, m] -> (logits [B, m, V], cache), with
    shortlist and feature extra."""
    offsets = jnp.asarray(tree.depths, jnp.int32)               # [N] or [B, N]
    positions = length[:, None] + offsets[..., list(nodes)]
    extra = self._extra(states, length, positions)
    if self.shortlist is None:
      return self.model.decode_tree(self.params, tokens, length, tree, cache, nodes=nodes,
                                    partitioner=self.partitioner, extra=extra)
    _, cache, hidden = self.model.decode_tree(self.params, tokens, length, tree, cache,
                                              nodes=nodes, return_hidden=True,
                                              partitioner=self.partitioner, extra=extra)
    return shortlist_lib.logits(self.shortlist, part, hidden, self.vocab_size), cache

  def _tree_root(self, state: Any, seq: Array, length: Array, skeleton: TreeShape, n_nodes: int,
                 sampling: SamplingConfig, key: Array) -> tuple:
    """A tree round's start: the nodes' uniforms [B, N] and the root's logits [B, V]
    (positions n-1 and n fed), with ``state`` split."""
    why = self.tree_unsupported(skeleton)
    if why:
      raise ValueError(f"T5Draft cannot propose a token tree: {why}")
    b = length.shape[0]
    us = (jnp.zeros((b, n_nodes), jnp.float32) if sampling.greedy
          else jax.random.uniform(key, (b, n_nodes)))
    cache, states, part = self._split(state)
    pos = length[:, None] + jnp.arange(-1, 1, dtype=jnp.int32)[None, :]
    logits, cache = self._decode(gather_positions(seq, pos), pos, cache,
                                 self._extra(states, length, pos), part)
    return us, logits, cache, states, part

  def propose_tree(self, state: Any, seq: Array, length: Array, tree: TreeShape,
                   sampling: SamplingConfig, key: Array) -> tuple[Array, Array, Array, Array, Any]:
    """A token tree, one draft call per depth (EAGLE-2's expansion): after the
    root, each call feeds the depth's nodes with children through
    ``T5Model.decode_tree``. A first child is drawn from q (argmax at T = 0),
    later children are the next-best logits with one-hot q (``fill_children``),
    so the tree verifies exactly (docs/exactness.md, section 10). -> (tokens
    [B, N], q [B, N, V], valid [B, N], steps = D, state)."""
    b, n_nodes, v = length.shape[0], tree.num_nodes, self.vocab_size
    us, logits, cache, states, part = self._tree_root(state, seq, length, tree, n_nodes,
                                                      sampling, key)
    tokens = jnp.zeros((b, n_nodes), jnp.int32)
    q = jnp.zeros((b, n_nodes, v), jnp.float32)
    valid = jnp.ones((b, n_nodes), bool)
    logits, fed = logits[:, None], (0,)
    for depth in range(1, tree.max_depth + 1):
      first_child = [int(tree.children_table[j, 0]) for j in fed]
      q_fed = standardize(logits, sampling)                            # [B, m, V]
      first = sample_with(us[:, first_child], q_fed, sampling)         # [B, m]
      tokens, q, valid = fill_children(tree, fed, first, q_fed, logits, -jnp.inf, tokens, q, valid)
      fed = tree.nodes_at(depth, with_children=True)
      if not fed:
        break
      logits, cache = self._decode_tree(tokens[:, list(fed)], length, tree, cache, fed, states,
                                        part)
    cache = constrain_cache(cache, self.partitioner, "draft cache")
    steps = jnp.asarray(tree.max_depth, jnp.int32)
    return tokens, q, valid, steps, self._join(cache, states, part)

  def propose_dynamic_tree(self, state: Any, seq: Array, length: Array, tree: DynamicTree,
                           sampling: SamplingConfig, key: Array,
                           copy: tuple[Array, Array] | None = None
                           ) -> tuple[Array, Array, Array, Array, Array, Any]:
    """A token tree chosen this round (EAGLE-2), one draft call per depth:
    ``base.expand_level`` keeps the W_d best children by cumulative draft
    probability and ``decode_tree`` feeds them (parents as data). ``copy`` =
    (tokens [B, D], copy [B, D] bool) (``LookupT5Draft``): a copied path's next
    copy is its first child, one-hot. -> (tokens, q, valid, parents [B, N],
    steps = D, state)."""
    b, n_nodes, v = length.shape[0], tree.num_nodes, self.vocab_size
    us, logits, cache, states, part = self._tree_root(state, seq, length, tree.skeleton, n_nodes,
                                                      sampling, key)
    level = Level.empty(b, n_nodes, v)
    on_copy = jnp.zeros((b, n_nodes), bool).at[:, 0].set(copy is not None)
    logits = logits[:, None]
    for depth in range(1, tree.max_depth + 1):
      f0, f1 = tree.level(depth - 1)
      q_f = standardize(logits, sampling)                                  # [B, m, V]
      probs = jax.nn.softmax(logits.astype(jnp.float32), -1) if sampling.greedy else q_f
      first = sample_with(us[:, f0:f1], q_f, sampling)                     # [B, m]
      first_q, first_value = q_f, jnp.take_along_axis(probs, first[..., None], -1)[..., 0]
      first_score = base_lib.first_child_score(probs, first)
      copied = jnp.zeros(first.shape, bool)
      if copy is not None:
        copied = on_copy[:, f0:f1] & copy[1][:, depth - 1:depth]
        cont = jnp.broadcast_to(copy[0][:, depth - 1:depth], first.shape)
        first = jnp.where(copied, cont, first)
        first_q = jnp.where(copied[..., None], jax.nn.one_hot(cont, v, dtype=q_f.dtype), q_f)
        first_score = jnp.where(copied, 1.0, first_score)
        first_value = jnp.where(copied, 1.0, first_value)
      level = expand_level(tree, depth, level, probs, first, first_q, first_score, first_value)
      c0, c1 = tree.level(depth)
      par = level.parents[:, c0:c1]
      on_copy = on_copy.at[:, c0:c1].set(
          jnp.take_along_axis(copied, par - f0, 1) & (level.rank[:, c0:c1] == 0))
      if depth < tree.max_depth:
        shape = RoundTree.from_parents(level.parents, tree.max_depth, tree.max_branching)
        logits, cache = self._decode_tree(level.tokens[:, c0:c1], length, shape, cache,
                                          tuple(range(c0, c1)), states, part)
    cache = constrain_cache(cache, self.partitioner, "draft cache")
    steps = jnp.asarray(tree.max_depth, jnp.int32)
    return (level.tokens, level.q, level.valid, level.parents, steps,
            self._join(cache, states, part))

  def commit_tree(self, state: Any, seq: Array, length: Array, start: Array, path: Array,
                  num_accepted: Array) -> Any:
    """``commit`` after a tree round: the accepted path moves into place
    (``T5Model.commit_path``)."""
    del seq, length
    cache, states, part = self._split(state)
    cache = T5Model.commit_path(cache, start, path, num_accepted, self.partitioner)
    return self._join(cache, states, part)

  def commit(self, state: Any, seq: Array, length: Array) -> Any:
    del seq, length  # position-indexed cache: rollback is implicit
    return state

  def commit_with_target(self, state: Any, seq: Array, length: Array, hidden: Array,
                         positions: Array) -> Any:
    """``commit``, storing the target's final states hidden [B, k, d_target] at
    positions [B, k] (negatives dropped); rejected ones are never read."""
    state = self.commit(state, seq, length)
    if self.feature is None:
      return state
    cache, states, part = self._split(state)
    write = lambda buf, new, pos: buf.at[pos].set(new, mode="drop")
    pos = jnp.where(positions < 0, states.shape[1], positions)  # padding: out of range
    states = jax.vmap(write)(states, feature_lib.project_states(self.feature, hidden), pos)
    return self._join(cache, states, part)
