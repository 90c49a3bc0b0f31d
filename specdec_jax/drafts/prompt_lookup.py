"""Prompt lookup (paper §3.6): copy the continuation of a matching n-gram.
Parameter-free (c ≈ 0) and deterministic, so q is the one-hot of each token,
which keeps Algorithm 1 exact (docs/exactness.md, section 3)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.drafts.base import skip_unsure, spine_proposal
from specdec_jax.tree import TreeShape

Array = jax.Array


def _match_lengths(inputs: Array, seq: Array, length: Array,
                   max_ngram: int) -> tuple[Array, Array, Array]:
  """-> (context [B, C], valid [B, C], n [B, C]): inputs then committed outputs, and
  at each i the largest n <= max_ngram whose suffix match ends at i (0: none)."""
  b, s = inputs.shape
  t = seq.shape[1] - 1
  ctx = jnp.concatenate([inputs, seq[:, 1:]], axis=1)                # [B, S+T]
  valid = jnp.concatenate([inputs != 0, jnp.arange(t)[None] < length[:, None]], axis=1)
  pos = jnp.arange(s + t)
  end = s + length                                                  # [B] one past last token
  best = jnp.zeros((b, s + t), jnp.int32)
  for n in range(1, max_ngram + 1):                                 # longer n overrides
    suffix_idx = end[:, None] - n + jnp.arange(n)[None]            # [B, n]
    suffix = jnp.take_along_axis(ctx, jnp.clip(suffix_idx, 0), axis=1)
    match = jnp.ones((b, s + t), bool) & (length >= n)[:, None]
    for j in range(n):
      shifted = jnp.roll(ctx, n - 1 - j, axis=1)                     # ctx[i - (n-1-j)]
      vshift = jnp.roll(valid, n - 1 - j, axis=1)
      match &= (shifted == suffix[:, j:j + 1]) & vshift & (pos[None] >= n - 1 - j)
    match &= pos[None] < (end[:, None] - 1)
    best = jnp.where(match, n, best)
  return ctx, valid, best


def lookup_branches(inputs: Array, seq: Array, length: Array, gamma: int, max_ngram: int,
                    branches: int) -> tuple[Array, Array, Array]:
  """The γ tokens after each of the ``branches`` best matches of the suffix
  (by n, then recency). -> (tokens [B, K, γ], matched [B, K] (n, 0 if none),
  valid [B, K, γ]); context only, never the target."""
  ctx, valid, n = _match_lengths(inputs, seq, length, max_ngram)
  c = ctx.shape[1]
  score = jnp.where(n > 0, n * c + jnp.arange(c)[None], -1)
  top, at = jax.lax.top_k(score, branches)                           # [B, K]
  found = top >= 0
  idx = at[..., None] + 1 + jnp.arange(gamma)[None, None]            # [B, K, γ]
  flat = jnp.clip(idx, 0, c - 1).reshape(idx.shape[0], -1)
  cont = jnp.take_along_axis(ctx, flat, axis=1).reshape(idx.shape)
  ok = (found[..., None] & jnp.take_along_axis(valid, flat, axis=1).reshape(idx.shape) & (idx < c))
  matched = jnp.where(found, jnp.take_along_axis(n, at, axis=1), 0)
  return cont.astype(jnp.int32), matched.astype(jnp.int32), ok


def lookup_continuation(inputs: Array, seq: Array, length: Array, gamma: int,
                        max_ngram: int) -> tuple[Array, Array, Array]:
  """The γ tokens after the latest occurrence of the longest (n <= max_ngram)
  suffix of the context -> (tokens [B, γ], matched n [B], valid [B, γ])."""
  cont, matched, ok = lookup_branches(inputs, seq, length, gamma, max_ngram, 1)
  return cont[:, 0], matched[:, 0], ok[:, 0]


@struct.dataclass
class PromptLookupDraft:
  """Proposes what followed the longest suffix n-gram's latest occurrence
  (``lookup_continuation``), else repeats the last token."""

  vocab_size: int = struct.field(pytree_node=False)
  max_ngram: int = struct.field(pytree_node=False, default=3)

  def init(self, inputs: Array, cache_len: int) -> Any:
    return inputs

  def _proposal(self, state, seq, length, gamma):
    cont, _, cont_ok = lookup_continuation(state, seq, length, gamma, self.max_ngram)
    last_tok = jnp.take_along_axis(seq, length[:, None], axis=1)[:, 0]
    tokens = jnp.where(cont_ok, cont, last_tok[:, None]).astype(jnp.int32)
    return tokens, jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32), cont_ok

  def propose(self, state, seq, length, gamma, sampling, key):
    del key, sampling  # deterministic; q is one-hot whatever the sampling
    tokens, q, _ = self._proposal(state, seq, length, gamma)
    return tokens, q, state

  def propose_adaptive(self, state, seq, length, gamma, sampling, key, limit, threshold,
                       skip_below=None, cumulative=False, drawn=False):
    """A row proposes its copied run (confidence 1 per copy, 0 for the filler):
    x_1 always unless ``skip_below`` is set and x_1 is a filler; one token at
    threshold 1. ``cumulative`` and ``drawn`` change nothing. Context only: exact."""
    del key, sampling, cumulative, drawn
    tokens, q, copied = self._proposal(state, seq, length, gamma)
    run = jnp.sum(jnp.cumprod(copied.astype(jnp.int32), axis=-1), axis=-1)
    count = jnp.maximum(run, 1) if threshold < 1.0 else jnp.ones_like(run)
    count = skip_unsure(jnp.minimum(count, limit), copied[:, 0].astype(jnp.float32), skip_below)
    return tokens, q, count, jnp.asarray(gamma, jnp.int32), state

  def tree_unsupported(self, tree: TreeShape) -> str | None:
    """Spine trees (siblings unproposed) and fans (``TreeShape.is_fan``) only."""
    if tree.is_spine or tree.is_fan:
      return None
    return ("prompt lookup fills spine trees (its chain) and fans of chains from the root "
            "(one match per branch, e.g. 'parents:-1,0,0,1,2'), not trees that branch below "
            "the root")

  def propose_tree(self, state, seq, length, tree: TreeShape, sampling, key):
    """A fan (``TreeShape.is_fan``): branch k copies the k-th best match
    (``lookup_branches``), unmatched nodes invalid. A spine: the chain with
    siblings unproposed. q one-hot (docs/exactness.md, section 10)."""
    why = self.tree_unsupported(tree)
    if why:
      raise ValueError(f"PromptLookupDraft: {why}")
    depth = tree.max_depth
    if tree.is_spine and not tree.is_fan:
      chain, q, _ = self.propose(state, seq, length, depth, sampling, key)
      tokens, q, valid = spine_proposal(tree, chain, q)
      return tokens, q, valid, jnp.asarray(depth, jnp.int32), state
    heads = tree.children_table[0][tree.children_table[0] >= 0]
    cont, _, ok = lookup_branches(state, seq, length, depth, self.max_ngram, len(heads))
    b = length.shape[0]
    tokens = jnp.zeros((b, tree.num_nodes), jnp.int32)
    valid = jnp.zeros((b, tree.num_nodes), bool)
    for k, head in enumerate(heads):
      node, d = int(head), 0
      while node >= 0:  # down the branch's chain, one copied token per depth
        tokens = tokens.at[:, node].set(cont[:, k, d])
        valid = valid.at[:, node].set(ok[:, k, d])
        node, d = int(tree.children_table[node, 0]), d + 1
    # A node is proposed only under a proposed parent.
    anc = jnp.asarray(tree.ancestor_mask[:, 1:])
    valid = valid & ~jnp.any(anc[None] & ~valid[:, None, 1:], axis=-1)
    q = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
    return tokens, q, valid, jnp.asarray(depth, jnp.int32), state

  def commit(self, state, seq, length):
    return state
