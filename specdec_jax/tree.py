"""Token trees: a static tree shape and the exact multi-candidate acceptance rule.

A chain of γ proposals (``speculative.speculative_sampling``, paper §2.3) uses
the target's verification pass only up to the first rejection. A token tree
offers several candidates per position and lets one target pass score them
all, each node attending to the committed prefix and its own ancestors (the
tree attention mask of SpecInfer, Miao et al. 2023). The shape is fixed per
run and described by parent indices, so everything compiles once (Medusa's
static trees, Cai et al. 2024).

Two pure functions verify a scored tree, batched with fixed shapes:

* ``tree_speculative_sampling`` (T > 0, any standardization): walk from the
  root; at the current node try its children in index order, accepting child c
  with probability min(1, r(x_c) / q_c(x_c)), where r starts as the target's p
  at the current node and becomes norm(max(0, r - q_c)) after each rejected
  child (SpecInfer's multi-step speculative sampling); descend on acceptance;
  when no child is accepted (or at a leaf) emit one token from r. Exact when
  every node's token was drawn from the q_c reported for it: siblings i.i.d.
  from the draft's distribution at their parent, or drawn in index order
  without replacement with q_c renormalized over the tokens left
  (``without_replacement``; recursive rejection sampling, Jeon et al. 2024).
  Proof: docs/exactness.md, section 10.
* ``tree_greedy_kernel`` (T = 0): the deepest path whose tokens equal the
  target's argmax at each step, plus the target's argmax after it.

Node 0 is the root: the last committed token, which the draft did not
propose. Node i > 0 carries a proposed token; its parent precedes it, so
index order is a topological order, and a node's children are tried in index
order.
"""

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


def geometric_rank_rates(alpha: float, ranks: int = 8) -> list[float]:
  """Rank acceptance rates from one α, for ``TreeShape.expected_tokens``:
  the target's token is the draft's first choice with probability α (the
  paper's α) and its k-th with α (1 - α)^(k - 1). An ASSUMPTION standing in
  for measured rates, which the paper does not publish; generous to the
  lower ranks (the rates sum to nearly 1)."""
  return [alpha * (1 - alpha) ** k for k in range(ranks)]


def scaled_rank_rates(alpha: float, profile: Sequence[float]) -> list[float]:
  """Rank acceptance rates with the paper's α first and the runner-ups
  falling off as ``profile`` (a measured pair's rates over its first-choice
  rate, e.g. ``measured.DEMO_RANK_PROFILE``) does: α x profile[k]. An
  ASSUMPTION: the paper's pairs' rank profile is not known;
  ``geometric_rank_rates`` is the generous alternative."""
  return [alpha * p for p in profile]


def _frozen(x: np.ndarray) -> np.ndarray:
  x.setflags(write=False)
  return x


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """A static token tree, given by its parent indices (hashable: a static jit
  argument; the derived tables below are computed once and read-only).

  parents: tuple of N ints. parents[0] = -1 (node 0 is the root, the last
    committed token); for i >= 1, 0 <= parents[i] < i. 2 <= N <= ``MAX_NODES``.

  Children of a node are tried in index order by the acceptance rule, so the
  order of siblings in ``parents`` is the order of preference. Any violation
  raises one ``ValueError`` naming the offending node.
  """

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
    """The full tree with ``branching[d]`` children under every node of depth d,
    numbered breadth first (so siblings are contiguous). (3, 2, 2, 1) has
    1 + 3 + 6 + 12 + 12 = 34 nodes and depth 4; (1,) * γ is the chain of γ."""
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
    """A chain with sibling leaves: ``widths[d - 1]`` children under the
    spine's node at depth d - 1, the first of them continuing the spine, the
    others leaves. (4, 2, 2, 1) has 1 + 9 nodes and depth 4. The shape any
    chain-proposing draft can fill from one ``propose`` of depth D (its
    token at each depth plus alternatives of the same q as siblings)."""
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
    """The tree of ``num_nodes`` nodes (root included) that accepts the most
    tokens per round in expectation when, at every node, the target's next
    token is the draft's k-th choice with probability ``rates[k - 1]``
    (depth- and history-independent: Sequoia's positional acceptance model,
    Chen et al. 2024). A node is on the accepted path with the product of
    the rates of the ranks along its path, and the expectation is the sum
    of those products over the tree, so the best tree holds the nodes of
    largest product: chosen greedily (every node's product is at most its
    parent's and its earlier sibling's, so the chosen set is a tree), at
    most ``max_depth`` deep. Children are numbered breadth first, in rank
    order. At temperature 0 the rates are the frequencies of the target's
    token among the draft's ranked choices (``lab.trees.rank_rates``)."""
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
    """A shape from its text form (``Experiment.tree``): 'chain:4' (the chain
    of γ = 4), 'spine:4,2,2,1' (``spine``), 'full:3,2,1'
    (``from_branching``), 'parents:-1,0,0,1' (parent indices) or
    'acceptance:16:0.7,0.1,0.04' (``from_acceptance`` with 16 nodes; a
    third part ':D' caps the depth)."""
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
    """[N] int32: depth of each node (root 0)."""
    d = np.zeros(self.num_nodes, np.int32)
    for i in range(1, self.num_nodes):
      d[i] = d[self.parents[i]] + 1
    return _frozen(d)

  @property
  def max_depth(self) -> int:
    """D: the most proposals one round can accept (it emits up to D + 1 tokens)."""
    return int(self.depths.max())

  @property
  def position_offsets(self) -> np.ndarray:
    """[N] int32: node i sits at position (prefix length + depth(i)), the position
    the same token would have in a chain, so T5's relative-position buckets
    match the chain's."""
    return self.depths

  @functools.cached_property
  def ancestor_mask(self) -> np.ndarray:
    """[N, N] bool: [i, j] iff j is i or an ancestor of i. Row i is what node i
    attends to among the tree's nodes (SpecInfer's tree attention mask; the
    committed prefix is visible to every node)."""
    m = np.zeros((self.num_nodes, self.num_nodes), bool)
    for i in range(self.num_nodes):
      m[i, i] = True
      if i:
        m[i] |= m[self.parents[i]]
    return _frozen(m)

  @functools.cached_property
  def ancestors_by_depth(self) -> np.ndarray:
    """[N, D+1] int32: [i, d] = node i's ancestor at depth d (i itself at
    d = depth(i), the root at d = 0), -1 for d > depth(i)."""
    a = np.full((self.num_nodes, self.max_depth + 1), -1, np.int32)
    for i in range(self.num_nodes):
      j = i
      while j >= 0:
        a[i, self.depths[j]] = j
        j = self.parents[j]
    return _frozen(a)

  @functools.cached_property
  def sibling_groups(self) -> tuple[tuple[int, ...], ...]:
    """The children of every node that has any, each group in index order (the
    order in which they are tried), groups ordered by their parent."""
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
    """Tokens one round yields in expectation under the positional model
    (``from_acceptance``: the target's token is the draft's k-th choice with
    probability ``rates[k - 1]`` at every node): the accepted path's length
    plus the target's own token, 1 + the sum over non-root nodes of the
    product of the rates along the node's path. For a chain at rates[0] = α
    this is Corollary 3.6's (1 - α^(γ+1)) / (1 - α)."""
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
    """Whether only the root branches: a fan of chains, one per root child
    (e.g. several prompt-lookup matches)."""
    return all(len(g) == 1 for g in self.sibling_groups if self.parents[g[0]] != 0)

  def nodes_at(self, depth: int, with_children: bool = False) -> tuple[int, ...]:
    """Nodes at ``depth`` in index order; with ``with_children`` only those that
    have children (the ones a draft must feed to expand the tree)."""
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
    """Self-attention cache slots per row for this tree: max_decode_len + N
    (the chain's max_decode_len + γ + 1 with N = γ + 1): a round starting at
    committed length L < max_decode_len writes the N nodes at slots L .. L+N-1."""
    self.check_room(max_decode_len)
    return max_decode_len + self.num_nodes

  def check_room(self, max_decode_len: int) -> None:
    """Raise ``ValueError`` unless ``max_decode_len`` leaves room for this tree:
    a round commits at most D + 1 tokens, so with D > max_decode_len the
    deepest levels could never be committed and every pass would score nodes
    for nothing."""
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

  num_accepted: [B] int32, n: the accepted depth (0..D), proposals committed.
  path:         [B, D] int32, the accepted nodes at depths 1..n; -1 after n.
  path_tokens:  [B, D] int32, their tokens; 0 after n.
  next_token:   [B] int32, the one token emitted after the path (a correction
                from the residual, or the bonus from p at a leaf).
  last_node:    [B] int32, the path's end (0 when n = 0): next_token follows
                p at this node (or its residual).
  """

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


def _finish(tokens: Array, path: Array, n: Array, next_token: Array,
            last: Array) -> TreeOutput:
  rows = jnp.arange(tokens.shape[0])[:, None]
  path_tokens = jnp.where(path >= 0, tokens[rows, jnp.maximum(path, 0)], 0)
  return TreeOutput(n.astype(jnp.int32), path.astype(jnp.int32), path_tokens.astype(jnp.int32),
                    next_token.astype(jnp.int32), last.astype(jnp.int32))


def residual(r: Array, q: Array) -> Array:
  """norm(max(0, r - q)) over the last axis: what the target's distribution r
  becomes once a child drawn from q is rejected (paper §2.3's p'(x), applied
  after every rejected sibling). Where no mass is left (r == q up to
  rounding, where a rejection has probability 0) r is kept."""
  res = jnp.maximum(r - q, 0.0)
  mass = jnp.sum(res, axis=-1, keepdims=True)
  return jnp.where(mass > 0, res / jnp.where(mass > 0, mass, 1.0), r)


def tree_speculative_sampling(key: Array, shape: TreeShape | RoundTree, tokens: Array, q: Array, p: Array,
                              valid: Array | None = None) -> TreeOutput:
  """Multi-candidate speculative sampling over a token tree, batched.

  Args:
    key: PRNG key (one uniform per node is drawn: node c's acceptance coin,
      and node 0's slot for the emitted token).
    shape: the static tree, or this round's tree as data (``RoundTree``,
      one per row).
    tokens: [B, N] int32, the token proposed at each node (node 0 unused).
    q: [B, N, V], q[:, c] = the distribution node c's token was drawn from
      (row 0 unused). Siblings drawn i.i.d.: the draft's (standardized)
      distribution at c's parent, the same for all siblings. Siblings drawn
      in index order without replacement: ``without_replacement`` of that.
    p: [B, N, V], p[:, i] = the target's standardized distribution after the
      committed prefix and node i's path (the tree scored in one pass).
    valid: [B, N] bool or None (all valid): a row's invalid nodes are never
      tested (nor anything under them). Whether node c is proposed must be
      decided before x_c is drawn, from the prefix and earlier nodes only.

  Returns ``TreeOutput``. With the contract above the emitted tokens (path
  tokens, then next_token) follow the target exactly: each, given those
  before it, is distributed as p at that prefix (docs/exactness.md, section 10).
  """
  return tree_sampling_with(jax.random.uniform(key, tokens.shape), shape, tokens, q, p, valid)


def tree_sampling_with(u: Array, shape: TreeShape | RoundTree, tokens: Array, q: Array, p: Array,
                       valid: Array | None = None) -> TreeOutput:
  """``tree_speculative_sampling`` with its uniforms given: u [B, N] in [0, 1).

  Child c is accepted when (1 - u[:, c]) * q_c(x_c) <= r(x_c) and r(x_c) > 0,
  i.e. with probability min(1, r(x_c) / q_c(x_c)), a token the (residual)
  target gives 0 never; the emitted token is ``inverse_cdf(r, u[:, 0])``.
  Other arguments and the result as there.
  """
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
  """Tree verification at temperature 0 from the target's argmax tokens alone.

  tokens [B, N] int32 (node 0 unused); target_tokens [B, N] int32:
  ``sampling.argmax`` of the target's logits at each node; valid [B, N] bool
  or None as in ``tree_speculative_sampling``. A node agrees when it and all
  its proper ancestors carry the target's argmax at their parent; the result
  is the deepest agreeing node (the first in index order among equally deep
  ones), its path, and next_token = the target's argmax there: token for token
  what the greedy baseline emits. Equal to ``tree_speculative_sampling`` on
  one-hot p except where two siblings carry the same token (the walk takes
  the first, this the deeper).
  """
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
  """Per-node proposal distributions for siblings drawn without replacement.

  q [B, N, V]: q[:, c] = the draft's distribution at c's parent (as for i.i.d.
  siblings); tokens [B, N]. Returns [B, N, V] float32: q[:, c] with the tokens
  of c's earlier siblings removed and renormalized, the distribution x_c is
  drawn from when a parent's children are drawn in index order without
  replacement (e.g. Gumbel top-k of q). Passed to
  ``tree_speculative_sampling`` this is recursive rejection sampling (Jeon et
  al. 2024); Sequoia (Chen et al. 2024) verifies its trees the same way. A
  node whose q has no mass left (all of q's support drawn before it) cannot
  be proposed: mark it invalid. Its row here is all zeros.
  """
  _check_inputs(shape, tokens, q)
  b, n_nodes, v = q.shape
  rows = jnp.arange(b)[:, None, None]
  earlier = round_tree(shape, b).earlier_siblings                      # [B, N, K-1]
  drop = jnp.where(earlier >= 0, tokens[rows, jnp.maximum(earlier, 0)], v)  # [B, N, K-1]
  nodes = jnp.arange(n_nodes)[None, :, None]
  q = q.astype(jnp.float32).at[rows, nodes, drop].set(0.0, mode="drop")
  mass = jnp.sum(q, axis=-1, keepdims=True)
  return jnp.where(mass > 0, q / jnp.where(mass > 0, mass, 1.0), 0.0)


# ------------------------------------------------------------ trees as data

@struct.dataclass
class RoundTree:
  """One round's token tree given by its parent indices as data: a tree whose
  shape may change every round (EAGLE-2's per-round trees; ``DynamicTree``),
  with the node count N, a bound D on the depth and a bound K on any node's
  children static (fixed shapes: everything compiles once). A static
  ``TreeShape`` is the special case whose parents are the same every round
  and row (``RoundTree.of``).

  parents:            [B, N] int32, parents[:, 0] = -1, 0 <= parents[:, i] < i.
  depths:             [B, N] int32, each node's depth (root 0), <= D.
  ancestor_mask:      [B, N, N] bool, [b, i, j] iff j is i or an ancestor of i.
  ancestors_by_depth: [B, N, D+1] int32, [b, i, d] = i's ancestor at depth d, -1 past depth(i).
  children_table:     [B, N, K] int32, [b, i, k] = i's k-th child (index order), -1 past the last.
  sibling_rank:       [B, N] int32, a node's place among its siblings (root 0).
  earlier_siblings:   [B, N, max(K-1, 1)] int32, the siblings tried before a node, -1 padded.
  """

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

  @property
  def position_offsets(self) -> Array:
    """[B, N] int32: node i sits at position (prefix length + depth(i))."""
    return self.depths

  @classmethod
  def of(cls, shape: TreeShape, batch: int) -> RoundTree:
    """A static ``TreeShape``'s tables, the same for every row."""
    tile = lambda x: jnp.broadcast_to(jnp.asarray(x), (batch,) + np.shape(x))
    return cls(tile(np.asarray(shape.parents, np.int32)), tile(shape.depths),
               tile(shape.ancestor_mask), tile(shape.ancestors_by_depth),
               tile(shape.children_table), tile(shape.sibling_rank),
               tile(shape.earlier_siblings))

  @classmethod
  def from_parents(cls, parents: Array, max_depth: int, max_branching: int) -> RoundTree:
    """The tables of parents [B, N] int32 (each parent precedes its child; the
    caller guarantees depth <= ``max_depth`` and at most ``max_branching``
    children per node; children beyond K would never be tried)."""
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

  widths: (W_1, ..., W_D): the tree holds W_d nodes at depth d every round,
    N = 1 + ΣW_d nodes in all (static shapes). Which parents they hang from
    is chosen each round by the draft: at depth d every one of the W_{d-1}
    nodes is expanded by the draft, its children are ranked by the draft's
    probability, and the W_d children of highest cumulative draft
    probability (the product of the draft's probabilities along the path)
    are kept; the parents become data (``RoundTree``). The nodes of depth d
    sit at indices 1 + ΣW_{<d} .. ΣW_{≤d}, ordered by parent, then rank, so
    the layout (and each node's position) is the spine's
    (``TreeShape.spine(widths)``, the ``skeleton``), which is also the tree a
    draft that cannot choose per round fills. Exactness: docs/exactness_trees.md.
  """

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
