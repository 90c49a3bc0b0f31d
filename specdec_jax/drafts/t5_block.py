"""A T5 draft that proposes a block of γ tokens in one decoder call (c·γ -> c):
the uncached committed tokens (positions n − γ .. n) and γ − 1 mask positions
(pad embedding + a learned ``decoder/mask_embedding`` [1, d_model] in
``block_draft.npz``, trained by ``specdec_jax.distill``); output n + i is
q_{i+1}. Exact (§2.3; docs/exactness.md, section 12): a q_i independent of
x_{<i} is a valid conditional. The next round re-feeds mask slots before
reading them, so ``commit`` does nothing. With the feature bridge position t
reads h_s K + e_j, s = min(t, n) − 1, j = t − min(t, n) (DFlash); without, PARD."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec_jax.drafts import bridge as bridge_lib
from specdec_jax.drafts import feature_bridge as feature_lib
from specdec_jax.drafts.base import (drawn_probability, fill_children, gather_positions,
                                     stop_count, top_probability)
from specdec_jax.drafts.t5_draft import FeatureState, T5Draft
from specdec_jax.models.t5 import DecoderCache, T5Model
from specdec_jax.partitioning import Partitioner, constrain_cache
from specdec_jax.sampling import SamplingConfig, sample_with, standardize
from specdec_jax.tree import TreeShape

Array = jax.Array
FILENAME = "block_draft.npz"
MASK_NAME = "decoder/mask_embedding"


def zeros(draft: T5Model) -> dict:
  """A zero mask embedding {'mask_embedding': [1, d_model]}: masks read pad alone."""
  return {"mask_embedding": jnp.zeros((1, draft.config.d_model), jnp.float32)}


def save(directory: str, block: Any) -> None:
  """Writes ``directory/block_draft.npz`` (float32, ``decoder/mask_embedding``)."""
  bridge_lib.save_arrays(directory, FILENAME, {MASK_NAME: block["mask_embedding"]})


def load(directory: str) -> Optional[dict]:
  """The stored mask embedding (local or ``gs://``), or None if not a block draft."""
  out = bridge_lib.load_arrays(directory, FILENAME, (MASK_NAME,), "block draft mask embedding")
  return None if out is None else {"mask_embedding": out[MASK_NAME]}


def check(block: Any, draft: T5Model, source: str) -> None:
  """The mask embedding must be one row of the draft's width."""
  shape = tuple(np.shape(block["mask_embedding"]))
  if shape != (1, draft.config.d_model):
    raise ValueError(f"{source}: block draft mask embedding has shape {shape}; this draft "
                     f"(d_model {draft.config.d_model}) needs (1, {draft.config.d_model})")


def block_positions(length: Array, gamma: int, catch_up: int) -> Array:
  """Positions [B, catch_up + γ − 1]: n − catch_up + 1 .. n, then n + 1 .. n + γ − 1."""
  offsets = jnp.arange(1 - catch_up, gamma, dtype=jnp.int32)
  return length[:, None] + offsets[None]


def block_extra(mask: Array, positions: Array, length: Array,
                feature: Any = None, projected: Optional[Array] = None) -> Array:
  """The extra [B, k, d] at ``positions``: the mask embedding past ``length``, plus
  h_s K + e_j from ``projected`` [B, L, d] with the feature bridge."""
  n = length[:, None]
  is_mask = positions > n
  extra = jnp.where(is_mask[..., None], mask.astype(jnp.float32)[0], 0.0)
  if feature is None:
    return extra
  start = jnp.minimum(positions, n)
  s = start - 1
  h = jnp.take_along_axis(projected, jnp.clip(s, 0, projected.shape[1] - 1)[..., None], axis=1)
  j = jnp.where(s >= 0, positions - start, -1)
  return extra + feature_lib.add_staleness(feature, h, j)


def teacher_forced_block(dec_in: Array, cuts: Array, gamma: int, mask: Array, pad_id: int,
                         feature: Any = None, target_hidden: Optional[Array] = None
                         ) -> tuple[Array, Array, Array]:
  """A block objective's draft input (``specdec_jax.distill``): dec_in [R, T]
  with positions n + 1 .. n + γ − 1 masked, n = cuts [R]; target_hidden [R, T,
  d_p] enters as in decoding. -> (tokens [R, T], extra [R, T, d], block [R, T]
  bool: positions n .. n + γ − 1, whose outputs are q_1..q_γ)."""
  r, t = dec_in.shape
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (r, t))
  n = cuts[:, None].astype(jnp.int32)
  tokens = jnp.where(pos > n, pad_id, dec_in)
  projected = None
  if feature is not None:
    projected = feature_lib.project_states(feature, target_hidden)
  extra = block_extra(mask, pos, cuts.astype(jnp.int32), feature, projected)
  block = (pos >= n) & (pos < n + gamma)
  return tokens, extra, block


@struct.dataclass
class T5BlockDraft:
  """M_q = a T5 draft proposing γ tokens from one call. ``t5``: the underlying
  ``T5Draft`` (``init``, ``commit_with_target`` are its own); ``mask`` [1, d_model].
  No shortlists (the output layer runs at all γ positions)."""

  t5: T5Draft
  mask: Any

  @property
  def vocab_size(self) -> int:
    return self.t5.vocab_size

  @property
  def wants_target_states(self) -> bool:
    return self.t5.wants_target_states

  def proposal_steps(self, gamma: int) -> int:
    """Draft calls a chain proposal of γ tokens costs: one."""
    del gamma
    return 1

  def init(self, inputs: Array, cache_len: int) -> Any:
    return self.t5.init(inputs, cache_len)

  def init_with_target(self, inputs: Array, cache_len: int, target_encoded: Array | None) -> Any:
    return self.t5.init_with_target(inputs, cache_len, target_encoded)

  def commit(self, state: Any, seq: Array, length: Array) -> Any:
    del seq, length  # position-indexed cache: the next block overwrites the masks
    return state

  def commit_with_target(self, state: Any, seq: Array, length: Array, hidden: Array,
                         positions: Array) -> Any:
    return self.t5.commit_with_target(state, seq, length, hidden, positions)

  def _split(self, state: Any) -> tuple[DecoderCache, Optional[Array]]:
    if self.t5.feature is None:
      return state, None
    return state.cache, state.target_states

  def _join(self, cache: DecoderCache, states: Optional[Array]) -> Any:
    return cache if states is None else FeatureState(cache, states)

  def block_logits(self, state: Any, seq: Array, length: Array, gamma: int) -> tuple[Array, Any]:
    """The one call: logits [B, γ, V] at n .. n + γ − 1 and the state."""
    cache, states = self._split(state)
    catch_up = gamma + 1  # a round commits at most γ + 1 tokens
    pos = block_positions(length, gamma, catch_up)                     # [B, 2γ]
    tokens = jnp.where(pos > length[:, None], self.t5.model.config.pad_id,
                       gather_positions(seq, pos))
    extra = block_extra(self.mask, pos, length, self.t5.feature, states)
    model, params = self.t5.model, self.t5.params
    if model.config.decode_kernel == "pallas":  # the fused kernels output every position's logits
      logits, cache = model.decode(params, tokens, pos, cache, extra)
      logits = logits[:, catch_up - 1:]
    else:
      # Only the γ block positions go through the output layer (XLA drops the rest).
      _, cache, hidden = model.decode(params, tokens, pos, cache, extra, return_hidden=True)
      logits = model.output_logits(params, hidden[:, catch_up - 1:])
    cache = constrain_cache(cache, self.t5.partitioner, "draft cache")
    return logits, self._join(cache, states)

  def _draw(self, logits: Array, sampling: SamplingConfig, key: Array) -> tuple[Array, Array]:
    """x_i ~ q_i independently: logits [B, γ, V] -> (tokens [B, γ], q [B, γ, V])."""
    q = standardize(logits, sampling)
    u = (None if sampling.greedy else jax.random.uniform(key, logits.shape[:2]))
    return sample_with(u, q, sampling), q

  def propose(self, state: Any, seq: Array, length: Array, gamma: int,
              sampling: SamplingConfig, key: Array) -> tuple[Array, Array, Any]:
    """γ tokens from one call (``block_logits``), each drawn from its own q_i."""
    logits, state = self.block_logits(state, seq, length, gamma)
    tokens, q = self._draw(logits, sampling, key)
    return tokens, q, state

  def propose_adaptive(self, state: Any, seq: Array, length: Array, gamma: int,
                       sampling: SamplingConfig, key: Array, limit: Array, threshold: float,
                       skip_below: float | None = None, cumulative: bool = False,
                       drawn: bool = False) -> tuple[Array, Array, Array, Array, Any]:
    """``propose`` at γ_max, counts by ``base.stop_count``; steps is 1."""
    logits, state = self.block_logits(state, seq, length, gamma)
    tokens, q = self._draw(logits, sampling, key)
    top = top_probability(q, logits, sampling)
    conf = drawn_probability(q, logits, tokens, sampling) if drawn else top
    count = stop_count(conf, limit, threshold, skip_below, cumulative, first_top=top[:, 0])
    return tokens, q, count, jnp.asarray(1, jnp.int32), state

  def tree_unsupported(self, tree: TreeShape) -> str | None:
    del tree
    return None

  def propose_tree(self, state: Any, seq: Array, length: Array, tree: TreeShape,
                   sampling: SamplingConfig, key: Array) -> tuple[Array, Array, Array, Array, Any]:
    """A token tree from one block call of depth D: depth d's nodes take tokens from
    q_d (independent of the path above), first child drawn, later children next-best
    with one-hot q (``base.fill_children``; docs/exactness.md, sections 10-11)."""
    depth = tree.max_depth
    logits, state = self.block_logits(state, seq, length, depth)
    q_all = standardize(logits, sampling)                              # [B, D, V]
    b, n_nodes, v = length.shape[0], tree.num_nodes, self.vocab_size
    us = (jnp.zeros((b, n_nodes), jnp.float32) if sampling.greedy
          else jax.random.uniform(key, (b, n_nodes)))
    tokens = jnp.zeros((b, n_nodes), jnp.int32)
    q = jnp.zeros((b, n_nodes, v), jnp.float32)
    valid = jnp.ones((b, n_nodes), bool)
    parents: tuple[int, ...] = (0,)
    for d in range(1, depth + 1):
      m = len(parents)
      first_child = [int(tree.children_table[j, 0]) for j in parents]
      q_d = jnp.broadcast_to(q_all[:, d - 1:d], (b, m, v))
      first = sample_with(us[:, first_child], q_d, sampling)         # [B, m]
      scores = jnp.broadcast_to(logits[:, d - 1:d], (b, m, v))
      tokens, q, valid = fill_children(tree, parents, first, q_d, scores, -jnp.inf, tokens, q,
                                       valid)
      parents = tree.nodes_at(d, with_children=True)
      if not parents:
        break
    return tokens, q, valid, jnp.asarray(1, jnp.int32), state


def build(model: T5Model, params: Any, mask: Any, partitioner: Partitioner | None = None,
          bridge: Any = None, target_model: T5Model | None = None, target_params: Any = None,
          feature: Any = None) -> T5BlockDraft:
  """A ``T5BlockDraft`` over a T5 checkpoint and its mask embedding [1, d]."""
  mask = jnp.asarray(mask["mask_embedding"] if isinstance(mask, dict) else mask, jnp.float32)
  check({"mask_embedding": mask}, model, "t5_block")
  t5 = T5Draft(params=params, model=model, partitioner=partitioner, bridge=bridge,
               target_params=target_params, target_model=target_model, feature=feature)
  return T5BlockDraft(t5=t5, mask=mask)
