"""What the decoding loops need from a target model M_p (``TargetModel``).

The loops in ``specdec_jax.decoding`` reach the target only through these
members, as T5X's ``temperature_sample`` reaches its model only through a
``tokens_to_logits`` callback. ``models.t5.T5Model`` satisfies the interface;
any other encoder-decoder that keeps the contracts below (and is hashable: it
is a static argument of ``jax.jit``) runs in every loop unchanged.

Shapes: B rows, S input tokens, k new positions, N tree nodes, D the tree's
depth, V the vocabulary; a decode cache holds ``cache_len`` slots per row.

* ``encode`` and ``init_cache`` run once per example: the encoder output, and
  a fixed-shape cache (cross-attention keys/values and an empty
  self-attention cache).
* Score k positions (Algorithm 1's one parallel pass over
  [y_{n-1}, x_1..x_γ], paper §2.3): ``decode`` writes the k new keys/values
  into the cache and returns logits for all k, causal within the k and over
  the cache. A query at position t reads slots 0..t only, so rollback is the
  caller moving its per-row length back.
* The same scoring without writing, for passes of several widths under one
  ``lax.switch`` (the adaptive loop): ``decode_rows`` returns the new
  rows, ``pad_rows`` pads them to one width, ``write_rows`` writes them once
  after the switch. ``decode_rows`` + ``write_rows`` equals ``decode`` to float
  rounding.
* Score a tree (one pass over all N nodes with tree attention) and commit a
  path (move the accepted nodes' keys/values to slot = position):
  ``decode_tree`` and ``commit_path``, with the slot convention of
  ``models.t5``'s module docstring.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import jax

from specdec_jax.partitioning import Partitioner
from specdec_jax.tree import TreeShape

Array = jax.Array
Cache = Any  # a pytree of fixed shape, e.g. ``models.t5.DecoderCache``
Rows = Any   # new cache rows, a pytree of [B, k, ...] arrays


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
             return_hidden: bool = False) -> tuple:
    """tokens [B, k] at positions [B, k] -> (logits [B, k, V] float32, cache
    with the k rows written); ``return_hidden`` appends the final decoder
    states [B, k, d] (for drafts that read them)."""
    ...

  def decode_rows(self, params: Any, tokens: Array, positions: Array, cache: Cache, *,
                  return_hidden: bool = False) -> tuple:
    """``decode`` that only reads the cache: -> (logits [B, k, V], rows[, states])."""
    ...

  def pad_rows(self, rows: Rows, positions: Array, width: int) -> tuple[Rows, Array]:
    """``decode_rows``'s rows and positions [B, k] padded to ``width`` (position -1)."""
    ...

  def write_rows(self, cache: Cache, rows: Rows, positions: Array) -> Cache:
    """Writes rows at positions [B, k] (negative positions are dropped)."""
    ...

  def decode_tree(self, params: Any, tokens: Array, lengths: Array, tree: TreeShape,
                  cache: Cache, *, return_hidden: bool = False,
                  partitioner: Optional[Partitioner] = None) -> tuple:
    """tokens [B, N] of the tree's nodes (node 0 the last committed token) at
    committed lengths [B] -> (logits [B, N, V] float32, cache[, states [B, N, d]])."""
    ...

  def commit_path(self, cache: Cache, lengths: Array, path: Array, num_accepted: Array,
                  partitioner: Optional[Partitioner] = None) -> Cache:
    """Moves the accepted nodes path [B, D] (-1 past num_accepted [B]) from
    their scratch slots to slots lengths + 1 .. lengths + num_accepted."""
    ...
