"""Speculative decoding over a token tree (``specdec_jax.tree``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.decoding.state import (Loop, SpecState, cut, finish, pin_state, round_keys,
                                        running, start)
from specdec_jax.drafts.base import (ApproximationModel, capabilities, commit_draft, commit_tree,
                                     dynamic_tree_proposal, gather_positions, tree_proposal)
from specdec_jax.models.base import TargetModel, commit_path, decode_tree
from specdec_jax.partitioning import Partitioner
from specdec_jax.sampling import SamplingConfig, argmax, standardize
from specdec_jax.tree import (DynamicTree, RoundTree, TreeOutput, TreeShape, tree_greedy_kernel,
                              tree_speculative_sampling)

Array = jax.Array


@struct.dataclass
class TreeStats:
  """Per-example statistics of one tree-speculative generation ([B] unless noted).

  target_calls, draft_calls: serial forward passes of M_p / M_q.
  accepted: proposals committed (Σ over rounds of the accepted depth).
  depth_hist [B, D + 1]: rounds whose accepted depth was j, at column j.
  rank_hist [B, K]: accepted nodes by their rank among siblings (0: first child).
  target_positions: positions the target scored (N per call)."""

  target_calls: Array
  draft_calls: Array
  accepted: Array
  depth_hist: Array
  rank_hist: Array
  target_positions: Array

  @classmethod
  def zeros(cls, batch: int, tree: TreeShape) -> "TreeStats":
    z = jnp.zeros((batch,), jnp.int32)
    return cls(z, z, z, jnp.zeros((batch, tree.max_depth + 1), jnp.int32),
               jnp.zeros((batch, tree.max_branching), jnp.int32), z)


class TreeSpecOutput(NamedTuple):
  tokens: Array   # [B, max_decode_len], 0 after EOS
  length: Array   # [B]
  stats: TreeStats


@dataclasses.dataclass(frozen=True)
class TreeLoop(Loop):
  """The tree loop's static record (``state.Loop``'s fields and):

  states_wanted: the draft reads the target's decoder states (``commit_with_target``).
  tree: the static ``TreeShape`` every round fills, or a ``DynamicTree``."""

  states_wanted: bool
  tree: TreeShape | DynamicTree


def _path_states(hidden: Array, n: Array, out: TreeOutput) -> tuple[Array, Array]:
  """The target's states of the root and accepted path [B, D+1, d], positions n..n+a."""
  b, depth = out.path.shape
  offsets = jnp.arange(depth + 1, dtype=jnp.int32)[None]
  nodes = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), out.path], axis=1)  # --> [B, D+1]
  states = jnp.take_along_axis(hidden, jnp.maximum(nodes, 0)[..., None], axis=1)
  return states, jnp.where(nodes >= 0, n[:, None] + offsets, -1)


def _tree_stats(st: TreeStats, tree: RoundTree, out: TreeOutput, live: Array, steps: Any,
                count: Array) -> TreeStats:
  """``TreeStats`` after one round over the committed nodes (count [B] from the cut)."""
  depth = tree.max_depth
  kept = jnp.minimum(out.num_accepted, count)
  on_path = live[:, None] & (jnp.arange(1, depth + 1)[None] <= kept[:, None])  # --> [B, D]
  ranks = jnp.take_along_axis(tree.sibling_rank, jnp.maximum(out.path, 0), axis=1)
  return TreeStats(
      target_calls=st.target_calls + live, draft_calls=st.draft_calls + live * steps,
      accepted=st.accepted + jnp.where(live, kept, 0),
      depth_hist=st.depth_hist + (live[:, None] & (jnp.arange(depth + 1, dtype=jnp.int32)[None]
                                                   == kept[:, None])),
      rank_hist=st.rank_hist + jnp.sum(
          on_path[:, :, None] & (ranks[:, :, None] == jnp.arange(tree.max_branching)), 1),
      target_positions=st.target_positions + live * tree.num_nodes)


def _tree_round(loop: TreeLoop, target_params: Any, draft: ApproximationModel,
                s: SpecState) -> SpecState:
  """One tree round: the draft fills the tree, ONE target pass, the kernel, commit."""
  target = loop.target
  b = s.seq.shape[0]
  key, k_draft, k_kernel = round_keys(s.key, loop.sampling.greedy, 3)
  n, live = s.length, ~s.done
  if isinstance(loop.tree, DynamicTree):  # this round's parents come from the draft
    tokens, q, valid, parents, steps, draft_state = dynamic_tree_proposal(
        draft, s.draft_state, s.seq, n, loop.tree, loop.sampling, k_draft)
    tree = RoundTree.from_parents(parents, loop.tree.max_depth, loop.tree.max_branching)
  else:
    tokens, q, valid, steps, draft_state = tree_proposal(draft, s.draft_state, s.seq, n,
                                                         loop.tree, loop.sampling, k_draft)
    tree = RoundTree.of(loop.tree, b)
  tokens = tokens.at[:, 0].set(gather_positions(s.seq, n[:, None])[:, 0])  # the root
  logits, target_cache, hidden = decode_tree(target, target_params, tokens, n, tree,
                                             s.target_cache, hidden=loop.states_wanted,
                                             partitioner=loop.partitioner)  # --> [B, N, V]
  if loop.sampling.greedy:
    out = tree_greedy_kernel(tree, tokens, argmax(logits), valid)
  else:
    out = tree_speculative_sampling(k_kernel, tree, tokens, q,
                                    standardize(logits, loop.sampling), valid)
  a = out.num_accepted
  target_cache = commit_path(target, target_cache, n, out.path, a, loop.partitioner)
  # Committed this round: the path's tokens, then next_token, at n+1 .. n+a+1.
  offsets = jnp.arange(tree.max_depth + 1, dtype=jnp.int32)[None]      # 0..D
  new_tok = jnp.concatenate([out.path_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
  new_tok = jnp.where(offsets == a[:, None], out.next_token[:, None], new_tok)  # --> [B, D+1]
  # Slots past n+a+1 get stale tokens, never read.
  seq = s.seq.at[jnp.arange(b)[:, None], n[:, None] + 1 + offsets].set(new_tok)
  length, done, count = cut(new_tok, a, n, s.done, loop.eos_id, loop.max_decode_len)
  draft_state = commit_tree(draft, draft_state, seq, length, n, out)
  if hidden is not None:
    draft_state = commit_draft(draft, draft_state, seq, length, _path_states(hidden, n, out))
  stats = _tree_stats(s.stats, tree, out, live, steps, count)
  return pin_state(SpecState(seq, length, done, target_cache, draft_state, key, stats),
                   loop.partitioner)


TREE_STATIC = ("target", "tree", "max_decode_len", "sampling", "eos_id", "partitioner")


@functools.partial(jax.jit, static_argnames=TREE_STATIC)
def tree_speculative_decode(target: TargetModel, target_params: Any, draft: ApproximationModel,
                            inputs: Array, key: Array, *, tree: TreeShape | DynamicTree,
                            max_decode_len: int,
                            sampling: SamplingConfig = SamplingConfig(), eos_id: int = 1,
                            partitioner: Partitioner | None = None) -> TreeSpecOutput:
  """Speculative decoding over a token tree (static or ``DynamicTree``): the
  draft fills the tree, ONE ``decode_tree`` pass scores its N nodes, the tree
  kernel keeps the accepted path and one token, ``commit_path``/``commit_tree``
  move it into place. Arguments as ``speculative_decode`` (no adaptive γ or
  lenience). -> ``TreeSpecOutput``. Exact (docs/exactness.md, section 10)."""
  if not isinstance(tree, (TreeShape, DynamicTree)):
    raise ValueError(f"tree must be a TreeShape or a DynamicTree, got {tree!r}")
  cache_len = tree.cache_len(max_decode_len)  # also checks that the tree fits
  loop = TreeLoop(target, sampling, eos_id, max_decode_len, partitioner,
                  capabilities(draft).target_states, tree)
  state = start(target, target_params, draft, inputs, key,
                buf_len=max_decode_len + tree.max_depth + 2, cache_len=cache_len,
                stats=TreeStats.zeros(inputs.shape[0], tree), partitioner=partitioner)
  state = jax.lax.while_loop(running, functools.partial(_tree_round, loop, target_params, draft),
                             state)
  return TreeSpecOutput(*finish(state, max_decode_len), state.stats)
