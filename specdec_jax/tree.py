"""Token trees: static shapes, trees as data, and the exact multi-candidate rule.

Several candidates per position, all scored by one target pass with a tree mask
(SpecInfer, Miao et al. 2023; static shapes as Medusa). Node 0 is the root (the
last committed token); parents precede children, tried in index order.
``tree_speculative_sampling`` (T > 0) is §2.3 applied per sibling with the
residual norm(max(0, r - q_c)) (docs/exactness.md, section 10);
``tree_greedy_kernel`` (T = 0) takes the deepest path agreeing with the argmax."""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec_jax.sampling import argmax, inverse_cdf

Array = jax.Array

MAX_NODES = 64


def scaled_rank_rates(alpha: float, profile: Sequence[float]) -> list[float]:
  """Rank rates α x profile[k] (e.g. ``measured.DEMO_RANK_PROFILE``): an ASSUMPTION."""
  return [alpha * p for p in profile]


def _frozen(x: np.ndarray) -> np.ndarray:
  x.setflags(write=False)
  return x


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """A static token tree by parent indices (hashable: a static jit argument).

  parents: N ints, parents[0] = -1, 0 <= parents[i] < i, 2 <= N <= ``MAX_NODES``;
    sibling order is the order of preference."""

  parents: tuple[int, ...]

  def __post_init__(self):
    parents = tuple(int(x) for x in self.parents)
    object.__setattr__(self, "parents", parents)
    n = len(parents)
    if n < 2:
      raise ValueError(f"a token tree needs the root and at least one proposed node, got "
                       f"{n} node(s) (parents={parents})")
    if n > MAX_NODES:
      raise ValueError(f"a token tree has at most {MAX_NODES} nodes (the root included), got {n}")
    if parents[0] != -1:
      raise ValueError(f"node 0 is the root and must have parent -1, got {parents[0]}")
    for i, par in enumerate(parents[1:], start=1):
      if not 0 <= par < i:
        raise ValueError(f"node {i}'s parent {par} does not precede it: every parent index "
                         f"must be in [0, {i}) (parents={parents})")

  @classmethod
  def from_branching(cls, branching: Sequence[int]) -> TreeShape:
    """The full tree with ``branching[d]`` children per depth-d node, breadth first."""
    branching = tuple(branching)
    if not branching:
      raise ValueError("empty branching: give the number of children per depth, e.g. (3, 2, 1)")
    if any(not isinstance(k, (int, np.integer)) or k < 1 for k in branching):
      raise ValueError(f"every branching factor must be an integer >= 1, got {branching}")
    total = 1 + sum(int(np.prod(branching[:d + 1])) for d in range(len(branching)))
    if total > MAX_NODES:
      raise ValueError(f"branching {branching} gives {total} nodes; a token tree has at most "
                       f"{MAX_NODES} (the root included)")
    parents, level = [-1], [0]
    for k in branching:
      nxt = []
      for par in level:
        for _ in range(k):
          nxt.append(len(parents))
          parents.append(par)
      level = nxt
    return cls(tuple(parents))

  @classmethod
  def spine(cls, widths: Sequence[int]) -> TreeShape:
    """A chain with sibling leaves: ``widths[d - 1]`` children under the spine node
    at depth d - 1, the first continuing the spine (fillable from one ``propose``)."""
    widths = tuple(widths)
    if not widths or any(not isinstance(k, (int, np.integer)) or k < 1 for k in widths):
      raise ValueError(f"spine widths must be a non-empty list of integers >= 1, got {widths}")
    if 1 + sum(widths) > MAX_NODES:
      raise ValueError(f"spine widths {widths} give {1 + sum(widths)} nodes; a token tree has "
                       f"at most {MAX_NODES} (the root included)")
    parents, node = [-1], 0
    for k in widths:
      first = len(parents)
      parents.extend([node] * int(k))
      node = first
    return cls(tuple(parents))

  @classmethod
  def from_acceptance(cls, rates: Sequence[float], num_nodes: int,
                      max_depth: int | None = None) -> TreeShape:
    """The ``num_nodes``-node tree with the most expected accepted tokens when
    the target's token is the draft's k-th choice with probability ``rates[k - 1]``
    at every node (Sequoia's positional model, Chen et al. 2024): the nodes of
    largest path product, chosen greedily, at most ``max_depth`` deep, numbered
    breadth first in rank order."""
    rates = [float(r) for r in rates]
    if not rates or any(not 0 < r <= 1 for r in rates) or sum(rates) > 1 + 1e-6:
      raise ValueError(f"acceptance rates must be in (0, 1] with sum <= 1 (the target's token "
                       f"is the draft's k-th choice with probability rates[k-1]), got {rates}")
    if any(a < b for a, b in zip(rates, rates[1:])):
      raise ValueError(f"acceptance rates must not increase with the rank, got {rates}")
    if not 2 <= num_nodes <= MAX_NODES:
      raise ValueError(f"a token tree has 2..{MAX_NODES} nodes (the root included), got "
                       f"{num_nodes}")
    # (−path product, insertion order, parent, rank, depth): a max-heap by product.
    heap, order, chosen = [(-rates[0], 0, 0, 0, 1)], 1, [(0, -1, -1, 0)]  # (id, parent, rank, d)
    while heap and len(chosen) < num_nodes:
      neg, _, parent, rank, depth = heapq.heappop(heap)
      node = len(chosen)
      chosen.append((node, parent, rank, depth))
      if max_depth is None or depth < max_depth:
        heapq.heappush(heap, (neg * rates[0], order, node, 0, depth + 1))
        order += 1
      if rank + 1 < len(rates):
        parent_product = -neg / rates[rank]
        heapq.heappush(heap, (-parent_product * rates[rank + 1], order, parent, rank + 1, depth))
        order += 1
    if len(chosen) < num_nodes:
      raise ValueError(f"only {len(chosen)} nodes fit {len(rates)} ranks within depth "
                       f"{max_depth}; ask for fewer nodes")
    # Renumber breadth first: by depth, then the parent's new index, then rank.
    new, parents, level = {0: 0}, [-1], [0]
    while level:
      nxt = []
      for old in level:
        kids = sorted((c for c in chosen[1:] if c[1] == old), key=lambda c: c[2])
        for node, _, _, _ in kids:
          new[node] = len(parents)
          parents.append(new[old])
          nxt.append(node)
      level = nxt
    return cls(tuple(parents))

  @classmethod
  def parse(cls, text: str) -> TreeShape:
    """A shape from text (``Experiment.tree``): 'chain:4', 'spine:4,2,2,1',
    'full:3,2,1', 'parents:-1,0,0,1' or 'acceptance:16:0.7,0.1,0.04[:D]'."""
    kind, sep, rest = str(text).partition(":")
    if kind.strip() == "acceptance":
      parts = rest.split(":")
      try:
        nodes, rates = int(parts[0]), [float(r) for r in parts[1].split(",")]
        depth = int(parts[2]) if len(parts) > 2 else None
      except (ValueError, IndexError):
        raise ValueError(f"tree {text!r}: expected 'acceptance:N:r1,r2,...[:D]'") from None
      return cls.from_acceptance(rates, nodes, depth)
    makers = {"chain": lambda v: cls.chain(_one(v, text)), "spine": cls.spine,
              "full": cls.from_branching, "parents": cls}
    if not sep or kind.strip() not in makers:
      raise ValueError(f"tree {text!r}: expected 'chain:G', 'spine:W1,W2,...', "
                       "'full:B1,B2,...', 'parents:-1,0,...' or 'acceptance:N:r1,r2,...'")
    try:
      values = tuple(int(v) for v in rest.split(","))
    except ValueError:
      raise ValueError(f"tree {text!r}: {rest!r} is not a comma-separated list of "
                       "integers") from None
    return makers[kind.strip()](values)

  @classmethod
  def chain(cls, gamma: int) -> TreeShape:
    """The chain of γ proposals (Algorithm 1's round) as a tree."""
    return cls.from_branching((1,) * gamma)

  @property
  def num_nodes(self) -> int:
    """N, the root included: the width of the target's verification pass."""
    return len(self.parents)

  @functools.cached_property
  def depths(self) -> np.ndarray:
    """[N] int32: depth of each node (root 0); node i sits at prefix length + depth(i)."""
    d = np.zeros(self.num_nodes, np.int32)
    for i in range(1, self.num_nodes):
      d[i] = d[self.parents[i]] + 1
    return _frozen(d)

  @property
  def max_depth(self) -> int:
    """D: the most proposals one round can accept (it emits up to D + 1 tokens)."""
    return int(self.depths.max())

  @functools.cached_property
  def ancestor_mask(self) -> np.ndarray:
    """[N, N] bool: [i, j] iff j is i or an ancestor of i (SpecInfer's tree mask)."""
    m = np.zeros((self.num_nodes, self.num_nodes), bool)
    for i in range(self.num_nodes):
      m[i, i] = True
      if i:
        m[i] |= m[self.parents[i]]
    return _frozen(m)

  @functools.cached_property
  def ancestors_by_depth(self) -> np.ndarray:
    """[N, D+1] int32: node i's ancestor at depth d, -1 for d > depth(i)."""
    a = np.full((self.num_nodes, self.max_depth + 1), -1, np.int32)
    for i in range(self.num_nodes):
      j = i
      while j >= 0:
        a[i, self.depths[j]] = j
        j = self.parents[j]
    return _frozen(a)

  @functools.cached_property
  def sibling_groups(self) -> tuple[tuple[int, ...], ...]:
    """The children of every node that has any, in index order, by parent."""
    groups: dict[int, list[int]] = {}
    for i in range(1, self.num_nodes):
      groups.setdefault(self.parents[i], []).append(i)
    return tuple(tuple(groups[k]) for k in sorted(groups))

  @property
  def max_branching(self) -> int:
    """K: the most children any node has."""
    return max(len(g) for g in self.sibling_groups)

  @functools.cached_property
  def children_table(self) -> np.ndarray:
    """[N, K] int32: [i, k] = node i's k-th child, -1 past its last child."""
    t = np.full((self.num_nodes, self.max_branching), -1, np.int32)
    for g in self.sibling_groups:
      t[self.parents[g[0]], :len(g)] = g
    return _frozen(t)

  @functools.cached_property
  def sibling_rank(self) -> np.ndarray:
    """[N] int32: a node's place among its siblings (0 = tried first; root 0)."""
    r = np.zeros(self.num_nodes, np.int32)
    for g in self.sibling_groups:
      r[list(g)] = np.arange(len(g))
    return _frozen(r)

  def expected_tokens(self, rates: Sequence[float]) -> float:
    """Expected tokens per round under the positional model
    (``from_acceptance``): 1 + the sum over nodes of their path's rate product.
    A chain at rates[0] = α gives Corollary 3.6's (1 - α^(γ+1)) / (1 - α)."""
    rank = self.sibling_rank
    prob = [1.0] * self.num_nodes
    for j in range(1, self.num_nodes):
      r = int(rank[j])
      prob[j] = prob[self.parents[j]] * (float(rates[r]) if r < len(rates) else 0.0)
    return 1.0 + sum(prob[1:])

  @functools.cached_property
  def earlier_siblings(self) -> np.ndarray:
    """[N, max(K-1, 1)] int32: [i] = the siblings tried before node i, -1 padded."""
    e = np.full((self.num_nodes, max(self.max_branching - 1, 1)), -1, np.int32)
    for g in self.sibling_groups:
      for k, c in enumerate(g):
        e[c, :k] = g[:k]
    return _frozen(e)

  @functools.cached_property
  def spine_nodes(self) -> tuple[int, ...]:
    """The first-child chain from the root: [node at depth 1, 2, ...]."""
    out, node = [], 0
    while self.children_table[node, 0] >= 0:
      node = int(self.children_table[node, 0])
      out.append(node)
    return tuple(out)

  @property
  def is_spine(self) -> bool:
    """Whether every node off the first-child chain is a leaf (``spine``)."""
    on = {0, *self.spine_nodes}
    return all(p in on for p in self.parents[1:])

  @property
  def is_fan(self) -> bool:
    """Whether only the root branches (a fan of chains, e.g. prompt-lookup matches)."""
    return all(len(g) == 1 for g in self.sibling_groups if self.parents[g[0]] != 0)

  def nodes_at(self, depth: int, with_children: bool = False) -> tuple[int, ...]:
    """Nodes at ``depth`` in index order (``with_children``: only those with children)."""
    inner = set(self.parents[1:])
    return tuple(i for i in range(self.num_nodes) if self.depths[i] == depth
                 and (not with_children or i in inner))

  @functools.cached_property
  def leaves(self) -> tuple[int, ...]:
    """Nodes without children, in index order."""
    has_child = set(self.parents[1:])
    return tuple(i for i in range(self.num_nodes) if i not in has_child)

  @functools.cached_property
  def paths(self) -> tuple[tuple[int, ...], ...]:
    """Root-to-leaf paths (node indices, each starting at 0), one per leaf."""
    a = self.ancestors_by_depth
    return tuple(tuple(int(j) for j in a[leaf, :self.depths[leaf] + 1]) for leaf in self.leaves)

  def cache_len(self, max_decode_len: int) -> int:
    """Cache slots per row: max_decode_len + N (a round at L writes L .. L+N-1)."""
    self.check_room(max_decode_len)
    return max_decode_len + self.num_nodes

  def check_room(self, max_decode_len: int) -> None:
    """Raise ``ValueError`` unless the depth is <= ``max_decode_len``."""
    if max_decode_len < 1:
      raise ValueError(f"max_decode_len must be >= 1, got {max_decode_len}")
    if self.max_depth > max_decode_len:
      raise ValueError(f"the token tree ({self.num_nodes} nodes, depth {self.max_depth}) does "
                       f"not fit max_decode_len {max_decode_len}: a round can commit at most "
                       f"max_decode_len tokens, so depth must be <= {max_decode_len}")


def _one(values: tuple[int, ...], text: str) -> int:
  if len(values) != 1:
    raise ValueError(f"tree {text!r}: a chain takes one γ, e.g. 'chain:4'")
  return values[0]


class TreeOutput(NamedTuple):
  """Result of verifying one token tree per row (D = the tree's max depth).

  num_accepted: [B] int32, n in 0..D, the proposals committed.
  path:         [B, D] int32, the accepted nodes at depths 1..n; -1 after n.
  path_tokens:  [B, D] int32, their tokens; 0 after n.
  next_token:   [B] int32, the correction or bonus token emitted after the path.
  last_node:    [B] int32, the path's end (0 when n = 0)."""

  num_accepted: Array
  path: Array
  path_tokens: Array
  next_token: Array
  last_node: Array


def _check_inputs(shape: "TreeShape | RoundTree", tokens: Array, *dists: Array) -> None:
  if tokens.ndim != 2 or tokens.shape[1] != shape.num_nodes:
    raise ValueError(f"tokens must be [B, {shape.num_nodes}] (one per node of the tree), got "
                     f"{tokens.shape}")
  for d in dists:
    if d.shape[:2] != tokens.shape or d.ndim != 3:
      raise ValueError(f"distributions must be [B, N, V] = {tokens.shape + ('V',)}, got "
                       f"{d.shape}")


def _finish(tokens: Array, path: Array, n: Array, next_token: Array, last: Array) -> TreeOutput:
  rows = jnp.arange(tokens.shape[0])[:, None]
  path_tokens = jnp.where(path >= 0, tokens[rows, jnp.maximum(path, 0)], 0)
  return TreeOutput(n.astype(jnp.int32), path.astype(jnp.int32), path_tokens.astype(jnp.int32),
                    next_token.astype(jnp.int32), last.astype(jnp.int32))


def residual(r: Array, q: Array) -> Array:
  """norm(max(0, r - q)) over the last axis (§2.3's p'(x)); r where no mass is left."""
  res = jnp.maximum(r - q, 0.0)
  mass = jnp.sum(res, axis=-1, keepdims=True)
  return jnp.where(mass > 0, res / jnp.where(mass > 0, mass, 1.0), r)


def tree_speculative_sampling(key: Array, shape: TreeShape | RoundTree, tokens: Array, q: Array,
                              p: Array, valid: Array | None = None) -> TreeOutput:
  """Multi-candidate speculative sampling over a token tree, batched.

  key: one uniform per node is drawn. shape: the static tree, or this round's
  ``RoundTree``. tokens [B, N] int32 (node 0 unused). q [B, N, V]: the
  distribution node c's token was drawn from (i.i.d. siblings: the draft's at
  c's parent; without replacement: ``without_replacement`` of that). p [B, N,
  V]: the target's distribution after node i's path. valid [B, N] bool or None:
  invalid nodes (decided before x_c is drawn) and their subtrees are never
  tested. Returns ``TreeOutput``, distributed exactly as the target
  (docs/exactness.md, section 10)."""
  return tree_sampling_with(jax.random.uniform(key, tokens.shape), shape, tokens, q, p, valid)


def tree_sampling_with(u: Array, shape: TreeShape | RoundTree, tokens: Array, q: Array, p: Array,
                       valid: Array | None = None) -> TreeOutput:
  """``tree_speculative_sampling`` given uniforms u [B, N] in [0, 1): child c is
  accepted when (1 - u[:, c]) * q_c(x_c) <= r(x_c) > 0; the emitted token is
  ``inverse_cdf(r, u[:, 0])``."""
  _check_inputs(shape, tokens, q, p)
  b, n_nodes = tokens.shape
  rows = jnp.arange(b)
  shape = round_tree(shape, b)
  q = q.astype(jnp.float32)
  p = p.astype(jnp.float32)
  coin = 1.0 - u.astype(jnp.float32)  # in (0, 1]
  valid = jnp.ones((b, n_nodes), bool) if valid is None else valid.astype(bool)
  children = shape.children_table                                    # [B, N, K]
  k_max, depth = shape.max_branching, shape.max_depth

  def level(d, carry):
    cur, live, r, path, n = carry
    kids = children[rows, cur]                                      # [B, K]

    def sibling(k, inner):
      found, chosen, r = inner
      c = kids[:, k]
      cc = jnp.maximum(c, 0)
      test = live & ~found & (c >= 0) & valid[rows, cc]
      x = tokens[rows, cc]
      qc = q[rows, cc]                                              # [B, V]
      rx = r[rows, x]
      acc = test & (coin[rows, cc] * qc[rows, x] <= rx) & (rx > 0)
      # After a rejected child the target's remaining mass is the residual.
      r = jnp.where((test & ~acc)[:, None], residual(r, qc), r)
      return found | acc, jnp.where(acc, c, chosen), r

    found, chosen, r = jax.lax.fori_loop(0, k_max, sibling, (jnp.zeros((b,), bool), cur, r))
    r = jnp.where(found[:, None], p[rows, chosen], r)
    path = jax.lax.dynamic_update_slice(path, jnp.where(found, chosen, -1)[:, None], (0, d))
    return chosen, found, r, path, n + found

  init = (jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool), p[:, 0],
          jnp.full((b, depth), -1, jnp.int32), jnp.zeros((b,), jnp.int32))
  last, _, r, path, n = jax.lax.fori_loop(0, depth, level, init)
  return _finish(tokens, path, n, inverse_cdf(r, u[:, 0]), last)


def tree_greedy_kernel(shape: TreeShape | RoundTree, tokens: Array, target_tokens: Array,
                       valid: Array | None = None) -> TreeOutput:
  """Tree verification at T = 0 from the target's argmax tokens [B, N]: the deepest
  agreeing node (first in index order) and the argmax there, as the greedy
  baseline emits (the sampling walk takes the first of two equal siblings)."""
  _check_inputs(shape, tokens)
  b = tokens.shape[0]
  rows = jnp.arange(b)
  shape = round_tree(shape, b)
  parents = jnp.maximum(shape.parents, 0)
  match = tokens == jnp.take_along_axis(target_tokens, parents, axis=1)
  if valid is not None:
    match &= valid.astype(bool)
  match = match.at[:, 0].set(True)
  agree = ~jnp.any(shape.ancestor_mask & ~match[:, None, :], axis=-1)     # [B, N]
  depths = shape.depths
  best = argmax(jnp.where(agree, depths, -1))
  path = shape.ancestors_by_depth[rows, best][:, 1:]
  return _finish(tokens, path, depths[rows, best], target_tokens[rows, best], best)


def without_replacement(shape: TreeShape | RoundTree, q: Array, tokens: Array) -> Array:
  """Per-node q [B, N, V] for siblings drawn in index order without replacement
  (e.g. Gumbel top-k): the parent's q with earlier siblings' tokens removed and
  renormalized (recursive rejection sampling, Jeon et al. 2024; Sequoia). A node
  with no mass left is all zeros and must be marked invalid."""
  _check_inputs(shape, tokens, q)
  b, n_nodes, v = q.shape
  rows = jnp.arange(b)[:, None, None]
  earlier = round_tree(shape, b).earlier_siblings                      # [B, N, K-1]
  drop = jnp.where(earlier >= 0, tokens[rows, jnp.maximum(earlier, 0)], v)  # [B, N, K-1]
  nodes = jnp.arange(n_nodes)[None, :, None]
  q = q.astype(jnp.float32).at[rows, nodes, drop].set(0.0, mode="drop")
  mass = jnp.sum(q, axis=-1, keepdims=True)
  return jnp.where(mass > 0, q / jnp.where(mass > 0, mass, 1.0), 0.0)


@struct.dataclass
class RoundTree:
  """One round's token tree as data (per row; ``DynamicTree``'s per-round trees),
  with N, a depth bound D and a branching bound K static. ``RoundTree.of`` gives
  a static ``TreeShape``'s.

  parents:            [B, N] int32, parents[:, 0] = -1, 0 <= parents[:, i] < i.
  depths:             [B, N] int32, each node's depth (root 0), <= D.
  ancestor_mask:      [B, N, N] bool, [b, i, j] iff j is i or an ancestor of i.
  ancestors_by_depth: [B, N, D+1] int32, i's ancestor at depth d, -1 past depth(i).
  children_table:     [B, N, K] int32, i's k-th child, -1 past the last.
  sibling_rank:       [B, N] int32, a node's place among its siblings (root 0).
  earlier_siblings:   [B, N, max(K-1, 1)] int32, siblings tried before a node, -1 padded."""

  parents: Array
  depths: Array
  ancestor_mask: Array
  ancestors_by_depth: Array
  children_table: Array
  sibling_rank: Array
  earlier_siblings: Array

  @property
  def num_nodes(self) -> int:
    return self.parents.shape[1]

  @property
  def max_depth(self) -> int:
    return self.ancestors_by_depth.shape[2] - 1

  @property
  def max_branching(self) -> int:
    return self.children_table.shape[2]

  @classmethod
  def of(cls, shape: TreeShape, batch: int) -> RoundTree:
    """A static ``TreeShape``'s tables, the same for every row."""
    tile = lambda x: jnp.broadcast_to(jnp.asarray(x), (batch,) + np.shape(x))
    return cls(tile(np.asarray(shape.parents, np.int32)), tile(shape.depths),
               tile(shape.ancestor_mask), tile(shape.ancestors_by_depth),
               tile(shape.children_table), tile(shape.sibling_rank), tile(shape.earlier_siblings))

  @classmethod
  def from_parents(cls, parents: Array, max_depth: int, max_branching: int) -> RoundTree:
    """The tables of parents [B, N] int32 (depth <= ``max_depth``, <=
    ``max_branching`` children per node)."""
    parents = jnp.asarray(parents, jnp.int32)
    b, n = parents.shape
    idx = jnp.arange(n, dtype=jnp.int32)
    par = parents.at[:, 0].set(-1)
    # Ancestor mask row by row: row i = {i} | row parent(i) (parents precede).
    mask = jnp.zeros((b, n, n), bool).at[:, 0, 0].set(True)
    rows = jnp.arange(b)
    for i in range(1, n):
      mask = mask.at[:, i].set(mask[rows, jnp.maximum(par[:, i], 0)].at[:, i].set(True))
    depths = jnp.sum(mask, axis=-1).astype(jnp.int32) - 1                      # [B, N]
    at_depth = mask[:, :, None, :] & (depths[:, None, None, :]
                                      == jnp.arange(max_depth + 1)[None, None, :, None])
    by_depth = jnp.where(jnp.any(at_depth, -1), jnp.argmax(at_depth, -1), -1).astype(jnp.int32)
    is_child = (par[:, None, :] == idx[None, :, None]) & (idx[None, None, :] > 0)  # [B, P, I]
    order = jnp.cumsum(is_child, axis=-1) - 1                                  # rank among kids
    slot = is_child[:, :, None, :] & (order[:, :, None, :]
                                      == jnp.arange(max_branching)[None, None, :, None])
    children = jnp.where(jnp.any(slot, -1), jnp.argmax(slot, -1), -1).astype(jnp.int32)
    rank = jnp.take_along_axis(order, jnp.maximum(par, 0)[:, None, :], axis=1)[:, 0]
    rank = jnp.where(idx[None] > 0, rank, 0).astype(jnp.int32)                # [B, N]
    k1 = max(max_branching - 1, 1)
    sib = children[rows[:, None], jnp.maximum(par, 0)]                        # [B, N, K]
    sib = jnp.pad(sib, ((0, 0), (0, 0), (0, max(k1 - max_branching, 0))), constant_values=-1)
    earlier = jnp.where(jnp.arange(k1)[None, None] < rank[..., None], sib[..., :k1], -1)
    earlier = jnp.where(idx[None, :, None] > 0, earlier, -1).astype(jnp.int32)
    return cls(par, depths, mask, by_depth, children, rank, earlier)


def round_tree(shape: TreeShape | RoundTree, batch: int) -> RoundTree:
  """``shape`` as a ``RoundTree`` (a static shape's tables broadcast to the batch)."""
  return shape if isinstance(shape, RoundTree) else RoundTree.of(shape, batch)


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """EAGLE-2-style draft trees chosen per round under a fixed node budget.

  widths: (W_1, ..., W_D), W_d nodes at depth d (N = 1 + ΣW_d, static). Each
    round the draft keeps the W_d children of highest cumulative draft
    probability; the parents become data (``RoundTree``). Nodes of depth d sit at
    1 + ΣW_{<d} .. ΣW_{≤d}, by parent then rank: the layout of
    ``TreeShape.spine(widths)`` (the ``skeleton``). Exactness:
    docs/exactness_trees.md."""

  widths: tuple[int, ...]

  def __post_init__(self):
    widths = tuple(int(w) for w in self.widths)
    object.__setattr__(self, "widths", widths)
    TreeShape.spine(widths)  # validates: non-empty, >= 1 each, <= MAX_NODES nodes

  @classmethod
  def parse(cls, text: str) -> DynamicTree:
    """'dynamic:W1,W2,...' (nodes per depth)."""
    kind, _, rest = str(text).partition(":")
    try:
      assert kind.strip() == "dynamic"
      widths = tuple(int(v) for v in rest.split(","))
    except (AssertionError, ValueError):
      raise ValueError(f"tree {text!r}: expected 'dynamic:W1,W2,...' (nodes per depth, "
                       "integers >= 1)") from None
    return cls(widths)

  @functools.cached_property
  def skeleton(self) -> TreeShape:
    """The static tree of the same layout (``TreeShape.spine(widths)``)."""
    return TreeShape.spine(self.widths)

  @property
  def num_nodes(self) -> int:
    return 1 + sum(self.widths)

  @property
  def max_depth(self) -> int:
    return len(self.widths)

  @property
  def max_branching(self) -> int:
    return max(self.widths)

  @property
  def parents(self) -> tuple[int, ...]:
    return self.skeleton.parents

  def level(self, depth: int) -> tuple[int, int]:
    """(first, end) node indices of ``depth`` (0: the root)."""
    first = 1 + sum(self.widths[:depth - 1]) if depth else 0
    return first, first + (self.widths[depth - 1] if depth else 1)

  def cache_len(self, max_decode_len: int) -> int:
    return self.skeleton.cache_len(max_decode_len)

  def check_room(self, max_decode_len: int) -> None:
    self.skeleton.check_room(max_decode_len)


def parse_tree(text: str) -> TreeShape | DynamicTree:
  """``TreeShape.parse``, or 'dynamic:W1,W2,...' (``DynamicTree``)."""
  if str(text).partition(":")[0].strip() == "dynamic":
    return DynamicTree.parse(text)
  return TreeShape.parse(text)
