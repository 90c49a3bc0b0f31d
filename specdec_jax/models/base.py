"""What the decoding loops need from a target model M_p (``TargetModel``).

The loops reach the target only through five methods (as T5X through
``tokens_to_logits``); tree passes, path moves and padding are derived here.
``encode`` and ``init_cache`` run once per example; ``decode`` scores k tokens
in one pass (§2.3), causal over the cache (a query at t reads slots 0..t, so
rollback is moving the length); ``read_rows``/``write_rows`` move cache rows.
Shapes: B rows, k new positions, N tree nodes, D depth."""

from __future__ import annotations

from typing import Any, Optional, Protocol

import jax
import jax.numpy as jnp

from specdec_jax.partitioning import Partitioner, constrain_cache
from specdec_jax.tree import RoundTree, TreeShape

Array = jax.Array
Cache = Any  # a pytree of fixed shape, e.g. ``models.t5.DecoderCache``
Rows = Any   # cache rows, a pytree of [B, k, ...] arrays


class TargetModel(Protocol):
  """Structural type of M_p; ``config`` has ``vocab_size`` and ``decoder_start_id``."""

  config: Any

  def encode(self, params: Any, inputs: Array) -> Array:
    """inputs [B, S] int32 (0 = pad) -> encoded [B, S, d]."""
    ...

  def init_cache(self, params: Any, encoded: Array, inputs: Array, cache_len: int) -> Cache:
    """An empty decode cache of ``cache_len`` slots per row for these inputs."""
    ...

  def decode(self, params: Any, tokens: Array, positions: Array, cache: Cache, *,
             return_hidden: bool = False, write: bool = True,
             tree: Optional[TreeShape | RoundTree] = None) -> tuple:
    """tokens [B, k] at positions [B, k] -> (logits [B, k, V] float32, cache);
    ``return_hidden`` appends final states [B, k, d]. ``write=False`` only reads
    the cache (positions consecutive per row) and returns the new rows instead (a
    ``lax.switch`` branch that wrote the cache would copy it all). ``tree``: the
    N nodes, node j at position n + depth(j) and scratch slot n + j, seeing the
    prefix and its ancestors."""
    ...

  def read_rows(self, cache: Cache, slots: Array) -> Rows:
    """The rows at slots [B, k] (clipped to the cache)."""
    ...

  def write_rows(self, cache: Cache, rows: Rows, slots: Array) -> Cache:
    """Writes rows at slots [B, k] (negative slots are dropped)."""
    ...


def score(target: TargetModel, params: Any, tokens: Array, positions: Array, cache: Cache, *,
          write: bool = True, hidden: bool = False) -> tuple[Array, Any, Optional[Array]]:
  """``decode`` with one return shape: (logits, cache or rows, states or None)."""
  out = target.decode(params, tokens, positions, cache, return_hidden=hidden, write=write)
  return out[0], out[1], (out[2] if hidden else None)


def pad_rows(rows: Rows, slots: Array, width: int) -> tuple[Rows, Array]:
  """Rows [B, k, ...] and slots padded to ``width`` (slot -1: dropped)."""
  extra = width - slots.shape[1]
  pad = lambda r: jnp.pad(r, ((0, 0), (0, extra)) + ((0, 0),) * (r.ndim - 2))
  return jax.tree.map(pad, rows), jnp.pad(slots, ((0, 0), (0, extra)), constant_values=-1)


def decode_tree(target: TargetModel, params: Any, tokens: Array, lengths: Array,
                tree: TreeShape | RoundTree, cache: Cache, *, hidden: bool = False,
                partitioner: Optional[Partitioner] = None) -> tuple[Array, Cache, Optional[Array]]:
  """One pass over a token tree (SpecInfer's tree attention): tokens [B, N] at
  committed lengths [B] -> (logits [B, N, V] float32, cache with node j at slot
  lengths + j, states [B, N, d] if ``hidden`` else None). A ``RoundTree`` places
  nodes at their per-row depths."""
  offsets = jnp.asarray(tree.depths, jnp.int32)          # [N] or [B, N]
  positions = lengths.astype(jnp.int32)[:, None] + offsets
  out = target.decode(params, tokens, positions, cache, return_hidden=hidden, tree=tree)
  return out[0], constrain_cache(out[1], partitioner, "tree cache"), (out[2] if hidden else None)


def commit_path(target: TargetModel, cache: Cache, lengths: Array, path: Array,
                num_accepted: Array, partitioner: Optional[Partitioner] = None) -> Cache:
  """Moves an accepted path into place after ``decode_tree``: slot lengths + d <-
  lengths + path[:, d - 1] for d = 1..num_accepted (all read before written), so
  slot = position again. path [B, D]: ``tree.TreeOutput.path``."""
  depth = jnp.arange(1, path.shape[1] + 1, dtype=jnp.int32)[None]
  lengths = lengths.astype(jnp.int32)[:, None]
  src = lengths + jnp.maximum(path, 0)
  dst = jnp.where(depth <= num_accepted[:, None], lengths + depth, -1)
  cache = target.write_rows(cache, target.read_rows(cache, src), dst)
  return constrain_cache(cache, partitioner, "tree cache")
