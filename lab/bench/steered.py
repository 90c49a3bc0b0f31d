"""An approximation model whose acceptance is steered to a given α, to time
the real decoding loops at the paper's acceptance rates with random weights.

``SteeredDraft`` runs a real draft (a ``T5Draft``: its steps, its cache, its
cost) and then, independently per proposed position with probability α,
proposes the token the baseline decoder emitted at that position instead of
the draft's own. At T = 0 the committed prefix of an exact speculative loop
always equals the baseline's output, so that token is the target's argmax
there and is accepted, and any other token is rejected: every evaluated
position is accepted with probability α, independently, as Theorem 3.8
assumes (paper §3.1). A draft's own token that happens to equal the
baseline's is replaced by the next token id, so that acceptance is exactly
the steer's (random weights make this rare).

The proposal is deterministic given the row, its position and a seed: q is
the one-hot of the proposed token (``drafts/base.py``: the distribution the
token was drawn from), so Algorithm 1 stays exact whatever is proposed. The
steer's coin for output position j of row b is a uniform keyed by (seed, b,
j): a position is evaluated at most once (accepted, or rejected and then
committed from the target), so the coins of evaluated positions are i.i.d.

Token trees (``propose_tree``): the draft fills the tree, then at each depth
the children of every node hold the baseline's token at the child of rank k
with probability ``rates[k]`` (one coin per depth: only one node per depth
lies on the accepted path), and none with 1 - sum(rates): the positional
acceptance model of ``TreeShape.from_acceptance`` that picks the tree.

A benchmark device, never registered with ``specdec_jax.drafts``: it reads
the baseline's output, which no real draft has.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.drafts import T5Draft
from specdec_jax.drafts.base import gather_positions
from specdec_jax.sampling import SamplingConfig
from specdec_jax.tree import TreeShape

Array = jax.Array


def steer_coins(seed: Array, positions: Array) -> Array:
  """Uniforms [B, m] in [0, 1), one per (row, output position): positions
  [B, m] int32; the same (seed, row, position) always gives the same coin."""
  rows = jnp.broadcast_to(jnp.arange(positions.shape[0], dtype=jnp.int32)[:, None],
                          positions.shape)

  def coin(r, p):
    return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(seed, r), p))
  return jax.vmap(jax.vmap(coin))(rows, positions)


def winning_rank(coins: Array, rates: Array) -> Array:
  """The rank whose child holds the target's token, from coins [...] and
  rank rates [K] (sum <= 1): k where cumsum(rates)[k-1] <= coin <
  cumsum(rates)[k], or K (none) past their sum."""
  return jnp.sum(coins[..., None] >= jnp.cumsum(rates), axis=-1).astype(jnp.int32)


@struct.dataclass
class SteeredDraft:
  """A ``T5Draft`` whose proposals are steered to acceptance ``rates[0]``
  (α) at T = 0 (module docstring). Fields: the draft; ``reference`` [B, L]
  int32, the baseline's output tokens for the same inputs (EOS ignored);
  ``rates`` [K] float32, the tree's rank rates with rates[0] = α (a chain
  uses rates[0] only); ``seed``, a PRNG key for the coins. Values, not
  shapes: one compiled loop serves every α."""

  draft: T5Draft
  reference: Array
  rates: Array
  seed: Array

  @classmethod
  def build(cls, draft: T5Draft, reference: Array, rates: Sequence[float],
            seed: int = 0) -> "SteeredDraft":
    rates = [float(r) for r in rates]
    if not rates or any(r < 0 for r in rates) or sum(rates) > 1 + 1e-6:
      raise ValueError(f"steer rates must be >= 0 with sum <= 1, got {rates}")
    return cls(draft, jnp.asarray(reference, jnp.int32), jnp.asarray(rates, jnp.float32),
               jax.random.PRNGKey(seed))

  @property
  def vocab_size(self) -> int:
    return self.draft.vocab_size

  def tree_unsupported(self, tree: TreeShape) -> str | None:
    return self.draft.tree_unsupported(tree)

  def init(self, inputs: Array, cache_len: int) -> Any:
    return self.draft.init(inputs, cache_len)

  def init_with_target(self, inputs: Array, cache_len: int, target_encoded: Array) -> Any:
    return self.draft.init_with_target(inputs, cache_len, target_encoded)

  def commit(self, state: Any, seq: Array, length: Array) -> Any:
    return self.draft.commit(state, seq, length)

  def commit_tree(self, state: Any, seq: Array, length: Array, start: Array, path: Array,
                  num_accepted: Array) -> Any:
    return self.draft.commit_tree(state, seq, length, start, path, num_accepted)

  def _steer(self, own: Array, positions: Array, wins: Array) -> Array:
    """The proposed tokens: the baseline's at output ``positions`` [B, m]
    where ``wins`` [B, m], else the draft's ``own`` [B, m], moved off the
    baseline's token where it equals it."""
    ref = gather_positions(self.reference, positions)
    other = jnp.where(own == ref, (own + 1) % self.vocab_size, own)
    return jnp.where(wins, ref, other)

  @staticmethod
  def _check(sampling: SamplingConfig) -> None:
    if not sampling.greedy:
      raise ValueError("SteeredDraft steers acceptance at temperature 0 only (it proposes "
                       "the baseline's argmax tokens)")

  def propose(self, state: Any, seq: Array, length: Array, gamma: int,
              sampling: SamplingConfig, key: Array) -> tuple[Array, Array, Any]:
    """The draft's γ steps; each token, before the next step is fed it
    (``T5Draft.propose``'s override), steered. Proposal i (from 0) of a
    round at committed length n is output position n + i."""
    self._check(sampling)
    positions = length[:, None] + jnp.arange(gamma, dtype=jnp.int32)[None]
    wins = steer_coins(self.seed, positions) < self.rates[0]                # --> [B, γ]
    v = self.vocab_size

    def override(i, q, x):
      pick = jax.lax.dynamic_index_in_dim(positions, i, axis=1)             # [B, 1]
      win = jax.lax.dynamic_index_in_dim(wins, i, axis=1)
      x = self._steer(x[:, None], pick, win)[:, 0]
      return x, jax.nn.one_hot(x, v, dtype=q.dtype), jnp.ones(x.shape, bool)

    return self.draft.propose(state, seq, length, gamma, sampling, key, override=override)

  def propose_tree(self, state: Any, seq: Array, length: Array, tree: TreeShape,
                   sampling: SamplingConfig, key: Array
                   ) -> tuple[Array, Array, Array, Array, Any]:
    """The draft's tree (``T5Draft.propose_tree``: one call per depth),
    then each non-root node j steered: at depth d, output position n + d -
    1, it holds the baseline's token iff its rank among its siblings is the
    depth's winning rank (module docstring)."""
    self._check(sampling)
    tokens, q, valid, steps, state = self.draft.propose_tree(state, seq, length, tree,
                                                             sampling, key)
    depth = jnp.asarray(tree.depths, jnp.int32)                              # [N]
    positions = length[:, None] + jnp.maximum(depth - 1, 0)[None]            # --> [B, N]
    level = length[:, None] + jnp.arange(tree.max_depth, dtype=jnp.int32)[None]
    rank = winning_rank(steer_coins(self.seed, level), self.rates)           # --> [B, D]
    node_rank = jnp.asarray(tree.sibling_rank, jnp.int32)[None]
    wins = (jnp.take_along_axis(rank, jnp.maximum(depth - 1, 0)[None]
                                .repeat(length.shape[0], 0), axis=1) == node_rank)
    wins = wins & (depth > 0)[None]
    tokens = self._steer(tokens, positions, wins).at[:, 0].set(tokens[:, 0])
    q = jax.nn.one_hot(tokens, self.vocab_size, dtype=q.dtype).at[:, 0].set(q[:, 0])
    return tokens, q, valid | wins, steps, state
