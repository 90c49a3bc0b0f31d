"""Token trees (``specdec_jax.tree``): the shape, and exactness of the
multi-candidate acceptance rule (docs/exactness.md, section 10).

The target and the draft are random conditional tables over a tiny
vocabulary: p at a node is a function of the node's token path (as a real
target's is), q at a node's parent a function of the parent's path. The
enumeration tests compute, analytically, the exact distribution of a round's
output (accepted path + one more token, extended to D + 1 tokens by the
target itself, as the next round would by induction) over every proposal
outcome and every coin outcome, and compare it with the target's chain to
1e-6. The statistical test runs the jitted kernel on 20,000 rows (fixed
seeds) with a chi-square goodness-of-fit test at significance 1e-3; its
power against the wrong rule (no residual update after a rejected sibling) is
computed from the exact distributions and asserted to exceed 0.99.
"""

from __future__ import annotations

import collections
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specdec_jax.sampling import SamplingConfig, standardize
from specdec_jax.speculative import speculative_sampling
from specdec_jax.tree import (MAX_NODES, TreeShape, tree_greedy_kernel, tree_sampling_with,
                              tree_speculative_sampling, without_replacement)
from stat_tests import pooled_chisquare_pvalue

SIGNIFICANCE = 1e-3
SHAPES = {"2x2": (2, 2), "3x1": (3, 1)}

# Everything runs jitted (eager JAX compiles every op on its own).
_kernel = jax.jit(tree_speculative_sampling, static_argnames="shape")
_standardize = jax.jit(standardize, static_argnames="config")
_walk = jax.jit(tree_sampling_with, static_argnames="shape")
_greedy = jax.jit(tree_greedy_kernel, static_argnames="shape")
_without_replacement = jax.jit(without_replacement, static_argnames="shape")


# ---------------------------------------------------------------- the shape

def test_from_branching_numbers_breadth_first():
  s = TreeShape.from_branching((2, 2))
  assert s.parents == (-1, 0, 0, 1, 1, 2, 2)
  assert s.num_nodes == 7 and s.max_depth == 2 and s.max_branching == 2
  np.testing.assert_array_equal(s.depths, [0, 1, 1, 2, 2, 2, 2])
  assert s.paths == ((0, 1, 3), (0, 1, 4), (0, 2, 5), (0, 2, 6))
  assert s.sibling_groups == ((1, 2), (3, 4), (5, 6))
  assert s.leaves == (3, 4, 5, 6)
  np.testing.assert_array_equal(s.sibling_rank, [0, 0, 1, 0, 1, 0, 1])
  np.testing.assert_array_equal(s.children_table[:3], [[1, 2], [3, 4], [5, 6]])
  assert np.all(s.children_table[3:] == -1)
  big = TreeShape.from_branching((3, 2, 2, 1))
  assert big.num_nodes == 34 and big.max_depth == 4 and len(big.paths) == 12
  assert TreeShape.chain(3).parents == (-1, 0, 1, 2)


def test_ancestor_mask_is_the_tree_attention_mask():
  s = TreeShape((-1, 0, 0, 1, 3, 2))  # a general tree: chain 0-1-3-4 with 2, 5 off the root
  expect = np.zeros((6, 6), bool)
  for i, chain in enumerate([(0,), (0, 1), (0, 2), (0, 1, 3), (0, 1, 3, 4), (0, 2, 5)]):
    expect[i, list(chain)] = True
  np.testing.assert_array_equal(s.ancestor_mask, expect)
  np.testing.assert_array_equal(s.ancestors_by_depth[4], [0, 1, 3, 4])
  np.testing.assert_array_equal(s.ancestors_by_depth[5], [0, 2, 5, -1])
  assert s.paths == ((0, 1, 3, 4), (0, 2, 5))
  # A node sees exactly the nodes on its path: the mask's rows are the paths.
  for path in s.paths:
    assert set(np.flatnonzero(s.ancestor_mask[path[-1]])) == set(path)
  with pytest.raises(ValueError):
    s.depths[0] = 5  # derived tables are read-only


def test_shape_is_hashable_and_a_static_jit_argument():
  a, b = TreeShape.from_branching((2, 1)), TreeShape((-1, 0, 0, 1, 2))
  assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
  assert TreeShape([-1, 0]) == TreeShape((-1, 0))  # lists are made tuples

  @functools.partial(jax.jit, static_argnames="shape")
  def width(x, shape):
    return x + shape.num_nodes

  assert int(width(0, shape=a)) == 5


@pytest.mark.parametrize("make, match", [
    (lambda: TreeShape((-1, 0, 3, 1)), "node 2's parent 3 does not precede it"),
    (lambda: TreeShape((-1, 0, 2)), "node 2's parent 2 does not precede it"),
    (lambda: TreeShape((-1, -1)), "node 1's parent -1 does not precede it"),
    (lambda: TreeShape((0, 0)), "node 0 is the root"),
    (lambda: TreeShape((-1,)), "at least one proposed node"),
    (lambda: TreeShape((-1,) + (0,) * MAX_NODES), "at most 64 nodes"),
    (lambda: TreeShape.from_branching((4, 4, 4)), "gives 85 nodes"),
    (lambda: TreeShape.from_branching(()), "empty branching"),
    (lambda: TreeShape.from_branching((2, 0)), "integer >= 1"),
])
def test_bad_shapes_raise_one_clear_error(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_check_room():
  s = TreeShape.from_branching((3, 2, 2, 1))
  s.check_room(4)
  assert s.cache_len(16) == 16 + 34
  with pytest.raises(ValueError, match="depth 4.*does not fit max_decode_len 3"):
    s.check_room(3)
  with pytest.raises(ValueError, match="max_decode_len must be >= 1"):
    s.cache_len(0)


# ------------------------------------------------- the exact rule, enumerated

def _tables(rng, v, depth, logits=False):
  """Conditional tables T[d][prefix] -> [V] for prefixes of length d = 0..depth
  (Dirichlet(1) distributions, or normal logits)."""
  out = []
  for d in range(depth + 1):
    shape = (v,) * (d + 1)
    out.append(rng.normal(size=shape) * 1.5 if logits else rng.dirichlet(np.ones(v), shape[:-1]))
  return out


def _standardized(tables, config):
  """``sampling.standardize`` applied to every row of every table (one call)."""
  v = tables[0].shape[-1]
  flat = np.concatenate([t.reshape(-1, v) for t in tables])
  out = np.asarray(_standardize(jnp.asarray(flat, jnp.float32), config), np.float64)
  out /= out.sum(-1, keepdims=True)  # sums of 1 in float64, below the 1e-6 tolerance
  sizes = np.cumsum([t.size // v for t in tables])[:-1]
  return [o.reshape(t.shape) for o, t in zip(np.split(out, sizes), tables)]


def _residual(r, q):
  m = np.maximum(r - q, 0.0)
  s = m.sum()
  return m / s if s > 0 else r


def _q_nodes(shape, toks, Q, proposal):
  """Per node, the distribution its token is drawn from given the earlier
  nodes (node 0: None). proposal: 'iid' (siblings i.i.d. from q at the
  parent), 'without' (in index order without replacement), 'next_best' (the
  first sibling drawn from q, each later one the most probable token of q
  not yet taken: deterministic, so its q is one-hot)."""
  qs = [None]
  for c in range(1, shape.num_nodes):
    par = shape.parents[c]
    q = Q[shape.depths[par]][_path_tokens(shape, toks, par)].copy()
    earlier = [toks[e] for e in shape.earlier_siblings[c] if e >= 0]
    if proposal != "iid" and earlier:
      q[earlier] = 0.0
      if proposal == "next_best":
        q = np.eye(len(q))[np.argmax(q)]
      elif q.sum() > 0:
        q = q / q.sum()
    qs.append(q)
  return qs


def _path_tokens(shape, toks, node):
  return tuple(toks[j] for j in shape.ancestors_by_depth[node, 1:shape.depths[node] + 1])


def _round_dist(shape, toks, P, qs, rule, out, prob, stats_out):
  """Add to ``out`` (sequence -> probability) the exact distribution of the
  round's emitted tokens for fixed proposals ``toks``, enumerating the coins
  analytically. rule: 'residual' (the exact rule) or 'no_update' (siblings
  all tested against p, one residual after the last rejection)."""
  kids = collections.defaultdict(list)
  for c in range(1, shape.num_nodes):
    kids[shape.parents[c]].append(c)

  def walk(u, prefix, prob):
    p = P[len(prefix)][prefix]
    r = p
    for rank, c in enumerate(kids[u]):
      x, qc = toks[c], qs[c]
      a = min(1.0, r[x] / qc[x]) if r[x] > 0 else 0.0
      if a > 0:
        stats_out[rank > 0] += prob * a
        walk(c, prefix + (x,), prob * a)
      prob *= 1.0 - a
      if prob == 0:
        return
      r = _residual(r, qc) if rule == "residual" else r
    if rule == "no_update" and kids[u]:
      r = _residual(p, qs[kids[u][-1]])
    for y in range(len(r)):
      out[prefix + (y,)] += prob * r[y]

  walk(0, (), prob)


def _extend(P, dist, length):
  """Round outputs (sequence -> prob) -> [V]^length: shorter outputs continue
  with the target's own conditionals (the next rounds, exact by induction)."""
  v = P[0].shape[-1]
  full = np.zeros((v,) * length)
  for s, w in dist.items():
    if w == 0:
      continue
    for tail in itertools.product(range(v), repeat=length - len(s)):
      seq, pr = s, w
      for y in tail:
        pr *= P[len(seq)][seq][y]
        seq = seq + (y,)
      full[seq] += pr
  return full


def _target_chain(P, length):
  v = P[0].shape[-1]
  joint = np.ones((v,) * length)
  for seq in itertools.product(range(v), repeat=length):
    joint[seq] = np.prod([P[t][seq[:t]][seq[t]] for t in range(length)])
  return joint


def exact_round(shape, P, Q, rule="residual", proposal="iid", told=None):
  """The exact distribution of a round's first D + 1 emitted tokens, [V]^(D+1),
  and the expected number of siblings other than the first accepted per round.
  proposal: how the tokens are drawn (``_q_nodes``); told: the proposal whose
  q the acceptance rule is given, when it differs (a broken contract)."""
  v, n = P[0].shape[-1], shape.num_nodes
  dist, stat = collections.defaultdict(float), [0.0, 0.0]
  for toks in itertools.product(range(v), repeat=n - 1):
    toks = (0,) + toks
    qs = _q_nodes(shape, toks, Q, proposal)
    prob = np.prod([qs[c][toks[c]] for c in range(1, n)])
    if prob == 0:
      continue
    told_qs = qs if told is None else _q_nodes(shape, toks, Q, told)
    _round_dist(shape, toks, P, told_qs, rule, dist, prob, stat)
  return _extend(P, dist, shape.max_depth + 1), stat[1]


def _pq(seed, shape, v=3):
  rng = np.random.default_rng(seed)
  return _tables(rng, v, shape.max_depth), _tables(rng, v, shape.max_depth - 1)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_round_is_exact_by_enumeration(name, seed):
  """Siblings i.i.d. from q: the round's output (first token, first two, all
  D + 1) is the target's chain, to 1e-6; later siblings do get accepted."""
  shape = TreeShape.from_branching(SHAPES[name])
  P, Q = _pq(seed, shape)
  got, later_sibling = exact_round(shape, P, Q)
  want = _target_chain(P, shape.max_depth + 1)
  np.testing.assert_allclose(got, want, atol=1e-6)
  np.testing.assert_allclose(got.sum(axis=(1, 2)), P[0], atol=1e-6)  # first token
  assert later_sibling > 0.05


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_forgetting_the_residual_update_is_not_exact(name, seed):
  """Power: testing every sibling against p itself (one residual at the end)
  moves the output distribution far beyond the tolerance above."""
  shape = TreeShape.from_branching(SHAPES[name])
  P, Q = _pq(seed, shape)
  got, _ = exact_round(shape, P, Q, rule="no_update")
  want = _target_chain(P, shape.max_depth + 1)
  assert np.abs(got - want).max() > 0.01
  assert np.abs(got.sum(axis=(1, 2)) - P[0]).max() > 0.01  # already the first token


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_without_replacement_is_exact_with_its_own_q(name):
  """Siblings drawn without replacement: exact when the rule is given each
  sibling's renormalized q (recursive rejection sampling), not exact with
  the i.i.d. rule's shared q (the deviation is smaller than the no-update
  rule's, still over a thousand times the tolerance)."""
  shape = TreeShape.from_branching(SHAPES[name])
  P, Q = _pq(2, shape, v=4)  # 4 > 3 siblings: the drawn set is not always all of V
  want = _target_chain(P, shape.max_depth + 1)
  got, later_sibling = exact_round(shape, P, Q, proposal="without")
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert later_sibling > 0.05
  wrong, _ = exact_round(shape, P, Q, proposal="without", told="iid")
  assert np.abs(wrong - want).max() > 1e-3  # > 1000 times the tolerance


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_next_best_siblings_are_exact_with_one_hot_q(name):
  """The first child drawn from q, its siblings the next most probable tokens
  of the same q (no extra draft call): exact when those deterministic
  siblings are reported with one-hot q; not exact when reported with q."""
  shape = TreeShape.from_branching(SHAPES[name])
  P, Q = _pq(2, shape, v=4)
  want = _target_chain(P, shape.max_depth + 1)
  got, later_sibling = exact_round(shape, P, Q, proposal="next_best")
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert later_sibling > 0.05
  wrong, _ = exact_round(shape, P, Q, proposal="next_best", told="iid")
  assert np.abs(wrong - want).max() > 0.01


@pytest.mark.parametrize("config", [SamplingConfig(temperature=0.8, topk=2),
                                    SamplingConfig(temperature=1.0, topp=0.7)],
                         ids=["temp0.8_topk2", "temp1_topp0.7"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_standardized_round_is_exact(name, config):
  """Top-k / top-p: p and q standardized (``sampling.standardize``), so both
  have zeros; the rule on them stays exact, and the filters really cut."""
  shape = TreeShape.from_branching(SHAPES[name])
  rng = np.random.default_rng(3)
  P = _standardized(_tables(rng, 4, shape.max_depth, logits=True), config)
  Q = _standardized(_tables(rng, 4, shape.max_depth - 1, logits=True), config)
  assert (P[0] == 0).any() and all((t == 0).any() for t in Q)
  got, _ = exact_round(shape, P, Q)
  np.testing.assert_allclose(got, _target_chain(P, shape.max_depth + 1), atol=1e-6)


# --------------------------------------------------------- the jitted kernel



def _draw_round(rng, shape, P, Q, rows, replacement=True):
  """Proposals drawn as the contract says (i.i.d. from q at the parent, or in
  index order without replacement), with per-node p and q: [B, N], [B, N, V] x2."""
  n, v = shape.num_nodes, P[0].shape[-1]
  toks = np.zeros((rows, n), np.int64)
  q = np.zeros((rows, n, v))
  p = np.zeros((rows, n, v))
  p[:, 0] = P[0][()]
  for c in range(1, n):
    par = shape.parents[c]
    q[:, c] = Q[shape.depths[par]][tuple(toks[:, j] for j in _anc(shape, par))]
    draw = q[:, c].copy()
    if not replacement:
      for e in shape.earlier_siblings[c]:
        if e >= 0:
          draw[np.arange(rows), toks[:, e]] = 0.0
      draw /= draw.sum(-1, keepdims=True)
    cdf = np.cumsum(draw, -1)
    toks[:, c] = np.minimum((rng.random(rows)[:, None] * cdf[:, -1:] >= cdf).sum(-1), v - 1)
    p[:, c] = P[shape.depths[c]][tuple(toks[:, j] for j in _anc(shape, c))]
  return toks, q, p


def _anc(shape, node):
  return [int(j) for j in shape.ancestors_by_depth[node, 1:shape.depths[node] + 1]]


def _complete(rng, P, out, length):
  """Accepted path + next token, continued by the target to ``length`` tokens."""
  n = np.asarray(out.num_accepted)
  rows = len(n)
  seq = np.zeros((rows, length), np.int64)
  path_tokens = np.asarray(out.path_tokens)
  seq[:, :path_tokens.shape[1]] = path_tokens
  seq[np.arange(rows), n] = np.asarray(out.next_token)
  for t in range(length):
    fill = t > n
    probs = P[t][tuple(seq[:, j] for j in range(t))]
    cdf = np.cumsum(probs, -1)
    drawn = np.minimum((rng.random(rows)[:, None] >= cdf).sum(-1), probs.shape[-1] - 1)
    seq[:, t] = np.where(fill, drawn, seq[:, t])
  return np.ravel_multi_index(seq.T, (P[0].shape[-1],) * length)


ROWS = 20_000


def _power(want, wrong, rows, significance):
  """Power of the chi-square test at ``rows`` samples against ``wrong``."""
  keep = want > 0
  lam = rows * np.sum((wrong[keep] - want[keep]) ** 2 / want[keep])
  df = keep.sum() - 1
  return stats.ncx2.sf(stats.chi2.isf(significance, df), df, lam)


@pytest.mark.parametrize("replacement", [True, False], ids=["iid", "without_replacement"])
def test_jitted_kernel_matches_the_exact_distribution(replacement):
  """20,000 rows of the jitted kernel, tree (2, 2), V = 3: the 27 sequences of
  D + 1 = 3 tokens pass a chi-square test against the target's chain at
  significance 1e-3; the same test would reject the no-update rule with
  probability > 0.99 (from its exact distribution)."""
  shape = TreeShape.from_branching((2, 2))
  P, Q = _pq(0, shape)
  rng = np.random.default_rng(7)
  toks, q, p = _draw_round(rng, shape, P, Q, ROWS, replacement)
  if not replacement:
    q = _without_replacement(shape, q.astype(np.float32), toks.astype(np.int32))
  out = _kernel(jax.random.PRNGKey(11), shape, toks.astype(np.int32), q.astype(np.float32),
                p.astype(np.float32))
  cells = _complete(rng, P, out, shape.max_depth + 1)
  want = _target_chain(P, shape.max_depth + 1).ravel()
  assert pooled_chisquare_pvalue(np.bincount(cells, minlength=want.size), want) > SIGNIFICANCE
  n = np.asarray(out.num_accepted)
  assert (n == 0).mean() > 0.01 and (n == 1).mean() > 0.05 and (n == 2).mean() > 0.05
  assert (np.asarray(out.path)[:, 0] == 2).mean() > 0.05  # the second sibling wins often
  wrong, _ = exact_round(shape, P, Q, rule="no_update",
                         proposal="iid" if replacement else "without")
  assert _power(want, wrong.ravel(), ROWS, SIGNIFICANCE) > 0.99


@functools.partial(jax.jit, static_argnames="gamma")
def _chain_and_tree(key, x, q, p, gamma):
  chain = speculative_sampling(key, x, q, p)
  u = jax.random.uniform(key, (x.shape[0], gamma + 1))  # the chain kernel's draw
  z = jnp.zeros_like(x[:, :1])
  tree = tree_sampling_with(jnp.concatenate([u[:, gamma:], u[:, :gamma]], axis=1),
                            TreeShape.chain(gamma), jnp.concatenate([z, x], 1),
                            jnp.concatenate([jnp.zeros_like(q[:, :1]), q], 1), p)
  return chain, tree


def test_chain_tree_is_algorithm_1():
  """On the chain (1,) * γ the tree kernel is Algorithm 1: with the chain
  kernel's uniforms it accepts the same prefix and emits the same token."""
  gamma, v, b = 3, 5, 256
  rng = np.random.default_rng(5)
  p = rng.dirichlet(np.full(v, 0.5), (b, gamma + 1)).astype(np.float32)
  q = rng.dirichlet(np.full(v, 0.5), (b, gamma)).astype(np.float32)
  cdf = np.cumsum(q, -1)
  x = np.minimum((rng.random((b, gamma, 1)) * cdf[..., -1:] >= cdf).sum(-1), v - 1)
  chain, tree = _chain_and_tree(jax.random.PRNGKey(5), jnp.asarray(x, jnp.int32), q, p,
                                gamma=gamma)
  np.testing.assert_array_equal(tree.num_accepted, chain.num_accepted)
  np.testing.assert_array_equal(tree.next_token, chain.next_token)
  n = np.asarray(chain.num_accepted)
  assert 0 < (n == gamma).sum() < b and (n == 0).sum() > 0


def test_a_rejected_sibling_updates_the_residual():
  """Constructed: the first child (token 1) is rejected; the residual then
  has no mass on token 1, so the second child (also token 1) is rejected
  whatever its coin, and the emitted token is 0. Invalid nodes are skipped."""
  shape = TreeShape.from_branching((2,))
  p = np.array([[[0.5, 0.5, 0.0]] * 3], np.float32)
  q = np.array([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]], np.float32)
  toks = np.array([[0, 1, 1]], np.int32)
  u = np.array([[0.3, 0.0, 0.999]], np.float32)  # coins 1 (reject: 1 * 1 > 0.5) and 0.001
  out = _walk(u, shape, toks, q, p)
  assert int(out.num_accepted[0]) == 0 and int(out.next_token[0]) == 0
  out = _walk(u, shape, toks, q, p, valid=np.array([[True, False, True]]))
  assert int(out.num_accepted[0]) == 1 and int(out.path[0, 0]) == 2
  assert int(out.last_node[0]) == 2 and int(out.path_tokens[0, 0]) == 1


def test_without_replacement_renormalizes_over_the_tokens_left():
  shape = TreeShape.from_branching((3,))
  q = np.array([[[0, 0, 0, 0], [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4],
                 [0.1, 0.2, 0.3, 0.4]]], np.float32)
  toks = np.array([[0, 3, 1, 2]], np.int32)
  got = np.asarray(_without_replacement(shape, q, toks))[0]
  np.testing.assert_allclose(got[1], [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
  np.testing.assert_allclose(got[2], [1 / 6, 2 / 6, 3 / 6, 0], rtol=1e-6)
  np.testing.assert_allclose(got[3], [1 / 4, 0, 3 / 4, 0], rtol=1e-6)


# ----------------------------------------------------------------- T = 0

def test_greedy_takes_the_longest_argmax_path():
  """Tree (3, 2): nodes 1-3 under the root, 4-5 under 1, 6-7 under 2, 8-9
  under 3. target_tokens[i] = the target's argmax after node i's path."""
  shape = TreeShape.from_branching((3, 2))
  target = np.array([[7, 1, 2, 3, 0, 0, 0, 0, 0, 0]] * 5, np.int32)
  toks = np.array([
      [0, 5, 7, 6, 9, 9, 9, 2, 9, 9],   # first child wrong, second right, its 2nd child right
      [0, 5, 5, 5, 9, 9, 9, 9, 9, 9],   # nothing agrees
      [0, 7, 5, 5, 1, 9, 9, 9, 9, 9],   # first child right, its first child right (a leaf)
      [0, 7, 7, 5, 9, 9, 9, 2, 9, 9],   # two siblings right: the deeper path wins
      [0, 7, 5, 5, 9, 9, 9, 9, 9, 9],   # right at depth 1 only
  ], np.int32)
  out = _greedy(shape, toks, target)
  np.testing.assert_array_equal(out.num_accepted, [2, 0, 2, 2, 1])
  np.testing.assert_array_equal(out.path, [[2, 7], [-1, -1], [1, 4], [2, 7], [1, -1]])
  np.testing.assert_array_equal(out.path_tokens, [[7, 2], [0, 0], [7, 1], [7, 2], [7, 0]])
  np.testing.assert_array_equal(out.last_node, [7, 0, 4, 7, 1])
  np.testing.assert_array_equal(out.next_token, target[0, [7, 0, 4, 7, 1]])
  # An invalid node is never on the path.
  valid = np.ones((5, 10), bool)
  valid[0, 7] = False
  out = _greedy(shape, toks, target, valid)
  assert int(out.num_accepted[0]) == 1 and int(out.next_token[0]) == 2


def test_greedy_kernel_is_the_walk_on_one_hot_p():
  """Random trees of distinct sibling tokens: the T = 0 kernel equals the
  sampling walk on one-hot p field for field, and its tokens are the target's
  argmax chain (what the greedy baseline emits)."""
  shape = TreeShape.from_branching((3, 2, 1))
  b, v = 64, 6
  rng = np.random.default_rng(4)
  target = rng.integers(0, 4, (b, shape.num_nodes))
  toks = np.zeros((b, shape.num_nodes), np.int64)
  for g in shape.sibling_groups:
    toks[:, g] = np.stack([rng.permutation(3)[:len(g)] for _ in range(b)])
  p = np.eye(v, dtype=np.float32)[target]
  q = np.full((b, shape.num_nodes, v), 1.0 / v, np.float32)
  greedy = _greedy(shape, toks.astype(np.int32), target.astype(np.int32))
  walk = _kernel(jax.random.PRNGKey(0), shape, toks.astype(np.int32), q, p)
  for field in greedy._fields:
    np.testing.assert_array_equal(getattr(greedy, field), getattr(walk, field), err_msg=field)
  n = np.asarray(greedy.num_accepted)
  assert len(set(n)) == shape.max_depth + 1  # every depth occurs
  for row in range(b):
    node = 0
    for d in range(n[row]):
      nxt = int(greedy.path[row, d])
      assert shape.parents[nxt] == node and toks[row, nxt] == target[row, node]
      node = nxt
    assert int(greedy.next_token[row]) == target[row, node]
    # Maximal: no child of the last node agrees.
    kids = [c for c in shape.children_table[node] if c >= 0]
    assert all(toks[row, c] != target[row, node] for c in kids)


def _expected_accepted(shape, rates):
  """Σ over nodes of the product of their path's rank rates (Sequoia's model)."""
  total, prob = 0.0, {0: 1.0}
  for i in range(1, shape.num_nodes):
    rank = int(shape.sibling_rank[i])
    prob[i] = prob[shape.parents[i]] * (rates[rank] if rank < len(rates) else 0.0)
    total += prob[i]
  return total


@pytest.mark.parametrize("rates,n", [((0.7, 0.12, 0.05), 6), ((0.5, 0.3), 7),
                                     ((0.9,), 5), ((0.4, 0.3, 0.2, 0.1), 7)])
def test_from_acceptance_is_the_best_tree_of_its_size(rates, n):
  """Against every tree of n nodes (parent tuples enumerated), the tree
  ``from_acceptance`` builds has the largest expected accepted length under
  its model, and it is a valid breadth-first numbering."""
  import itertools
  best = TreeShape.from_acceptance(rates, n)
  assert best.num_nodes == n
  got = _expected_accepted(best, rates)
  top = max(_expected_accepted(TreeShape((-1,) + p), rates)
            for p in itertools.product(*[range(i) for i in range(1, n)]))
  assert got == pytest.approx(top, abs=1e-12)
  cap = 2 if len(rates) > 1 else n - 1  # one rank: only the chain fits
  capped = TreeShape.from_acceptance(rates, n, max_depth=cap)
  assert capped.max_depth <= cap
  assert TreeShape.parse(f"acceptance:{n}:{','.join(map(str, rates))}:{cap}") == capped


def test_from_acceptance_refuses_bad_rates():
  with pytest.raises(ValueError, match="must not increase"):
    TreeShape.from_acceptance([0.1, 0.5], 4)
  with pytest.raises(ValueError, match="sum <= 1"):
    TreeShape.from_acceptance([0.7, 0.6], 4)
  with pytest.raises(ValueError, match="only 3 nodes fit"):
    TreeShape.from_acceptance([0.5, 0.3], 6, max_depth=1)
