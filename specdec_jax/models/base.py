"""What the decoding loops need from a target model M_p (``TargetModel``).

The loops in ``specdec_jax.decoding`` reach the target only through the five
methods below, as T5X's ``temperature_sample`` reaches its model only through
a ``tokens_to_logits`` callback; everything else they do with it (a tree
pass, moving an accepted path into place, padding rows) is derived from those
five in this module, once. ``models.t5.T5Model`` satisfies the interface; any
other encoder-decoder that keeps the contracts below (and is hashable: it is
a static argument of ``jax.jit``) runs in every loop unchanged.

Shapes: B rows, S input tokens, k new positions, N tree nodes, D the tree's
depth, V the vocabulary; a decode cache holds ``cache_len`` slots per row.

* ``encode`` and ``init_cache`` run once per example: the encoder output, and
  a fixed-shape cache (cross-attention keys/values and an empty
  self-attention cache).
* ``decode`` scores k tokens in one pass (Algorithm 1's parallel run of M_p
  over [y_{n-1}, x_1..x_γ], paper §2.3), causal within the k and over the
  cache. A query at position t reads slots 0..t only, so rollback is the
  caller moving its per-row length back. It writes the k new rows into the
  cache, or with ``write=False`` only reads the cache and returns the rows
  (for passes of several widths under one ``lax.switch``, where a branch that
  wrote the cache would copy all of it: the rows are written once after the
  switch); with a ``tree`` the k tokens are a token tree's nodes, scored with
  tree attention and written at scratch slots (``models.t5``'s slot
  convention).
* ``read_rows`` and ``write_rows`` read and write cache rows at given slots
  (``decode``'s rows: a pytree of [B, k, ...] arrays).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import jax
import jax.numpy as jnp

from specdec_jax.partitioning import Partitioner, constrain_cache
from specdec_jax.tree import TreeShape

Array = jax.Array
Cache = Any  # a pytree of fixed shape, e.g. ``models.t5.DecoderCache``
Rows = Any   # cache rows, a pytree of [B, k, ...] arrays


class TargetModel(Protocol):
  """Structural type of a target model M_p (see the module docstring).

  ``config`` has ``vocab_size`` (V, which the draft's q must cover) and
  ``decoder_start_id`` (the decoder input before y_1).
  """

  config: Any

  def encode(self, params: Any, inputs: Array) -> Array:
    """inputs [B, S] int32 (0 = pad) -> encoded [B, S, d]."""
    ...

  def init_cache(self, params: Any, encoded: Array, inputs: Array, cache_len: int) -> Cache:
    """An empty decode cache of ``cache_len`` slots per row for these inputs."""
    ...

  def decode(self, params: Any, tokens: Array, positions: Array, cache: Cache, *,
             return_hidden: bool = False, write: bool = True,
             tree: Optional[TreeShape] = None) -> tuple:
    """tokens [B, k] at positions [B, k] -> (logits [B, k, V] float32, the cache
    with the k rows written); ``return_hidden`` appends the final decoder
    states [B, k, d] (for drafts that read them).

    ``write=False``: the cache is only read (the queries see its slots before
    positions[:, 0], which must be consecutive per row) and the k new rows
    come back in its place. ``tree``: the k = N tokens are the tree's nodes,
    node 0 the last committed token at positions[:, 0] = the row's length n
    and node j at n + depth(j); node j is written at scratch slot n + j and
    sees the committed prefix and its ancestors."""
    ...

  def read_rows(self, cache: Cache, slots: Array) -> Rows:
    """The rows at slots [B, k] (clipped to the cache)."""
    ...

  def write_rows(self, cache: Cache, rows: Rows, slots: Array) -> Cache:
    """Writes rows at slots [B, k] (negative slots are dropped)."""
    ...


def score(target: TargetModel, params: Any, tokens: Array, positions: Array, cache: Cache, *,
          write: bool = True, hidden: bool = False) -> tuple[Array, Any, Optional[Array]]:
  """``decode`` with one return shape: (logits [B, k, V], the cache written
  (or with ``write=False`` the new rows), final decoder states [B, k, d] if
  ``hidden`` else None)."""
  out = target.decode(params, tokens, positions, cache, return_hidden=hidden, write=write)
  return out[0], out[1], (out[2] if hidden else None)


def pad_rows(rows: Rows, slots: Array, width: int) -> tuple[Rows, Array]:
  """Rows [B, k, ...] and their slots [B, k] padded to ``width`` rows (slot
  -1: ``write_rows`` drops them), so that branches of a ``lax.switch`` at
  different k return one shape."""
  extra = width - slots.shape[1]
  pad = lambda r: jnp.pad(r, ((0, 0), (0, extra)) + ((0, 0),) * (r.ndim - 2))
  return jax.tree.map(pad, rows), jnp.pad(slots, ((0, 0), (0, extra)), constant_values=-1)


def decode_tree(target: TargetModel, params: Any, tokens: Array, lengths: Array, tree: TreeShape,
                cache: Cache, *, hidden: bool = False,
                partitioner: Optional[Partitioner] = None) -> tuple[Array, Cache, Optional[Array]]:
  """One pass over a token tree (SpecInfer's tree attention): tokens [B, N] of
  the tree's nodes (node 0 the last committed token) at committed lengths [B]
  -> (logits [B, N, V] float32, cache with node j at slot lengths + j, final
  decoder states [B, N, d] if ``hidden`` else None). With a ``partitioner``
  the cache is pinned to its layout, as the loops pin a decode's."""
  offsets = jnp.asarray(tree.position_offsets, jnp.int32)[None]
  positions = lengths.astype(jnp.int32)[:, None] + offsets
  out = target.decode(params, tokens, positions, cache, return_hidden=hidden, tree=tree)
  return out[0], constrain_cache(out[1], partitioner, "tree cache"), (out[2] if hidden else None)


def commit_path(target: TargetModel, cache: Cache, lengths: Array, path: Array,
                num_accepted: Array, partitioner: Optional[Partitioner] = None) -> Cache:
  """Moves an accepted tree path's rows into place after ``decode_tree``.

  lengths [B]: the committed lengths the tree pass ran at; path [B, D]: the
  accepted nodes at depths 1..D (-1 past a row's count; ``tree.TreeOutput``);
  num_accepted [B]: a, 0..D. For d = 1..a, slot lengths + d <- slot lengths +
  path[:, d - 1] (all rows read before any is written); the root stays at
  slot lengths, so slots 0..lengths+a hold the committed decoder inputs at
  slot = position again, as a chain decode of the path would have left them.
  """
  depth = jnp.arange(1, path.shape[1] + 1, dtype=jnp.int32)[None]
  lengths = lengths.astype(jnp.int32)[:, None]
  src = lengths + jnp.maximum(path, 0)
  dst = jnp.where(depth <= num_accepted[:, None], lengths + depth, -1)
  cache = target.write_rows(cache, target.read_rows(cache, src), dst)
  return constrain_cache(cache, partitioner, "tree cache")
