"""The target's pass over a token tree (``T5Model.decode_tree``, SpecInfer's tree
attention) and moving the accepted path into place (``T5Model.commit_path``):

* a chain-shaped tree is the chain ``decode``, bit for bit (logits and cache);
* every node of a branching tree scores what a chain decode of its
  root-to-node path scores, from the same committed prefix (T5 1.1 and 1.0);
* a node ignores every non-ancestor: perturbing one changes nothing, bit for bit;
* after ``commit_path`` the cache decodes the next token as a cache built by
  decoding the prefix + the accepted path as a chain;
* batched rows at different lengths (0 included, with stale slots past the
  length) accepting different paths;
* a tree built a depth at a time (``nodes``) equals the one-pass tree;
* under a partitioner the returned cache keeps the cache layout.

Where the tree's nodes sit in other cache slots than the chain's (another
order of the softmax sums) results agree to float rounding (``_close``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, sharpen
from specdec_jax.models.t5 import DecoderCache, T5Model, param_shapes
from specdec_jax.partitioning import Partitioner, make_mesh
from specdec_jax.tree import TreeShape

# Rows at committed lengths 0, 3, 5; slots 0..7 are written for every row, so
# every row has stale slots past its length.
LENGTHS = np.array([0, 3, 5], np.int32)
B, S = 3, 6
TREE = TreeShape.from_branching((3, 2, 2))  # 22 nodes, depth 3
CHAIN = TreeShape.chain(3)
L = TREE.cache_len(8)  # 30 >= max length + N
# Paths through other cache slots sum in another order: agreement to TOL of
# the larger of 1 and the reference's largest magnitude (a few float32 ulps).
TOL = 1e-6


def _close(got, want) -> None:
  want = np.asarray(want)
  np.testing.assert_allclose(np.asarray(got), want, rtol=0,
                             atol=TOL * max(1.0, float(np.max(np.abs(want)))))


def _random_params(config, seed: int) -> dict:
  """Random weights with init's scales, drawn with numpy (no compilation)."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    if name.endswith("/scale"):
      return np.ones(leaf.shape, np.float32)
    std = 1.0 if name == "token_embedder/embedding" else leaf.shape[0] ** -0.5
    return (std * rng.standard_normal(leaf.shape)).astype(np.float32)
  return jax.tree_util.tree_map_with_path(draw, param_shapes(config))


@functools.lru_cache(maxsize=None)
def _setup(version: str):
  """(model, params, cache with 8 decoder inputs written) for a tiny T5 of ``version``."""
  model = T5Model(TINY.replace(version=version))
  params = _random_params(model.config, 0)
  if version == "1.1":
    params = sharpen(params)
  inputs = jnp.array([[5, 9, 17, 33, 2, 40], [7, 11, 3, 60, 0, 0], [8, 4, 0, 0, 0, 0]],
                     jnp.int32)
  cache = jax.jit(lambda p, x: model.init_cache(p, model.encode(p, x), x, L))(params, inputs)
  dec = jnp.asarray(np.random.RandomState(3).randint(2, 64, (B, 8)), jnp.int32)
  for start in (0, 4):  # the width the tests decode chains at: one compilation
    pos = jnp.broadcast_to(jnp.arange(start, start + 4, dtype=jnp.int32), (B, 4))
    _, cache = _decode(model, params, dec[:, start:start + 4], pos, cache)
  return model, params, cache


@functools.partial(jax.jit, static_argnums=0)
def _decode(model, params, tokens, positions, cache):
  return model.decode(params, tokens, positions, cache)


@functools.partial(jax.jit, static_argnums=(0, 3, 6))
def _decode_tree(model, params, tokens, tree, lengths, cache, nodes=None):
  return model.decode_tree(params, tokens, lengths, tree, cache, nodes=nodes)


_commit = jax.jit(T5Model.commit_path)


def _tokens(tree: TreeShape, seed: int = 0) -> jax.Array:
  return jnp.asarray(np.random.RandomState(seed).randint(2, 64, (B, tree.num_nodes)), jnp.int32)


def _chain_positions(k: int) -> jax.Array:
  return jnp.asarray(LENGTHS[:, None] + np.arange(k, dtype=np.int32)[None])


def _path_tokens(tokens: jax.Array, path: tuple[int, ...]) -> jax.Array:
  return tokens[:, np.asarray(path)]


def _rows(cache: DecoderCache) -> list[np.ndarray]:
  """Every layer's self-attention keys, then values, [B, L, H, dh] on the host."""
  return [np.asarray(x) for x in cache.self_k + cache.self_v]


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_chain_shaped_tree_is_the_chain_decode_bit_for_bit(version):
  model, params, cache = _setup(version)
  tokens = _tokens(CHAIN)
  lengths = jnp.asarray(LENGTHS)
  want, want_cache = _decode(model, params, tokens, _chain_positions(4), cache)
  got, got_cache = _decode_tree(model, params, tokens, CHAIN, lengths, cache)
  np.testing.assert_array_equal(got, want)
  jax.tree.map(np.testing.assert_array_equal, got_cache, want_cache)
  # On a chain every accepted node is already in place: commit moves nothing.
  path = jnp.broadcast_to(jnp.arange(1, 4, dtype=jnp.int32), (B, 3))
  moved = _commit(got_cache, lengths, path, jnp.array([3, 1, 0], jnp.int32))
  jax.tree.map(np.testing.assert_array_equal, moved, want_cache)


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_every_node_scores_its_root_to_node_chain(version):
  model, params, cache = _setup(version)
  tokens = _tokens(TREE)
  got, _ = _decode_tree(model, params, tokens, TREE, jnp.asarray(LENGTHS), cache)
  got = np.asarray(got)
  seen = set()
  for path in TREE.paths:  # every node lies on a root-to-leaf path (a full tree)
    want, _ = _decode(model, params, _path_tokens(tokens, path), _chain_positions(len(path)),
                      cache)
    _close(got[:, np.asarray(path)], want)
    seen.update(path)
  assert seen == set(range(TREE.num_nodes))
  # Not vacuous: siblings score differently.
  assert np.max(np.abs(got[:, 1] - got[:, 2])) > 1e-2


@pytest.mark.parametrize("perturbed", [(7,), (2, 6, 7, 14, 15, 16, 17)])
def test_a_node_ignores_every_non_ancestor(perturbed):
  """(7,): one leaf-level sibling; (2, ...): node 2's whole subtree. Every node
  whose ancestors (itself included) avoid the perturbed set is bit-identical."""
  model, params, cache = _setup("1.1")
  tokens = _tokens(TREE)
  changed = tokens.at[:, np.asarray(perturbed)].set((tokens[:, np.asarray(perturbed)] + 7) % 60
                                                    + 2)
  lengths = jnp.asarray(LENGTHS)
  base, _ = _decode_tree(model, params, tokens, TREE, lengths, cache)
  other, _ = _decode_tree(model, params, changed, TREE, lengths, cache)
  touched = TREE.ancestor_mask[:, np.asarray(perturbed)].any(axis=1)
  np.testing.assert_array_equal(other[:, ~touched], base[:, ~touched])
  assert bool(jnp.all(jnp.any(other[:, touched] != base[:, touched], axis=-1)))


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_commit_path_then_decode_equals_the_chain_built_cache(version):
  """Rows at lengths 0, 3, 5 accept different paths: all D, one, none."""
  model, params, cache = _setup(version)
  tokens = _tokens(TREE, seed=1)
  lengths = jnp.asarray(LENGTHS)
  accepted = np.array([3, 1, 0], np.int32)
  leaf_paths = [TREE.paths[5], TREE.paths[9], TREE.paths[0]]   # root-to-leaf, depth 3 each
  path = np.array([[j if d <= a else -1 for d, j in enumerate(p[1:], 1)]
                   for p, a in zip(leaf_paths, accepted)], np.int32)
  _, tree_cache = _decode_tree(model, params, tokens, TREE, lengths, cache)
  moved = _commit(tree_cache, lengths, jnp.asarray(path), jnp.asarray(accepted))
  nxt = jnp.array([[11], [12], [13]], jnp.int32)
  end = LENGTHS + accepted + 1  # committed decoder inputs per row: slots 0..end-1
  got, _ = _decode(model, params, nxt, jnp.asarray(end[:, None]), moved)

  # The reference: the root and the accepted path decoded as a chain (padded
  # to D + 1 tokens; what it writes past a row's path is never read below).
  rows = np.arange(B)[:, None]
  chain_tokens = tokens[rows, np.where(path >= 0, path, 0)]
  chain_tokens = jnp.concatenate([tokens[:, :1], chain_tokens], 1)
  _, chain_cache = _decode(model, params, chain_tokens, _chain_positions(4), cache)
  want, _ = _decode(model, params, nxt, jnp.asarray(end[:, None]), chain_cache)
  _close(got, want)

  for m, c, t in zip(_rows(moved), _rows(chain_cache), _rows(tree_cache)):
    for b in range(B):
      _close(m[b, :end[b]], c[b, :end[b]])
      # Only slots n+1..n+a change.
      np.testing.assert_array_equal(m[b, :LENGTHS[b] + 1], t[b, :LENGTHS[b] + 1])
      np.testing.assert_array_equal(m[b, end[b]:], t[b, end[b]:])


def test_a_tree_built_a_depth_at_a_time_equals_the_one_pass_tree():
  model, params, cache = _setup("1.1")
  tokens = _tokens(TREE, seed=2)
  lengths = jnp.asarray(LENGTHS)
  want, want_cache = _decode_tree(model, params, tokens, TREE, lengths, cache)
  # Depths 0-1, then 2-3: ancestors written by the earlier call and by this one.
  for depths in ((0, 1), (2, 3)):
    nodes = tuple(int(j) for j in np.flatnonzero(np.isin(TREE.depths, depths)))
    got, cache = _decode_tree(model, params, tokens[:, np.asarray(nodes)], TREE, lengths, cache,
                              nodes)
    _close(got, want[:, np.asarray(nodes)])
  for got, ref in zip(_rows(cache), _rows(want_cache)):
    for b in range(B):
      scratch = slice(LENGTHS[b], LENGTHS[b] + TREE.num_nodes)
      _close(got[b, scratch], ref[b, scratch])


def test_under_a_partitioner_the_cache_keeps_its_layout():
  """One device: the calls and their constraints are in place (the sharded
  layout itself is ``constrain_cache``'s, tested with the decoding loops)."""
  model, params, cache = _setup("1.1")
  part = Partitioner(make_mesh((1, 1)))
  tokens = _tokens(CHAIN)
  lengths = jnp.asarray(LENGTHS)

  @jax.jit
  def run(params, tokens, cache):
    logits, cache = model.decode_tree(params, tokens, lengths, CHAIN, cache, partitioner=part)
    path = jnp.broadcast_to(jnp.arange(1, 4, dtype=jnp.int32), (B, 3))
    return logits, T5Model.commit_path(cache, lengths, path, jnp.full((B,), 2), part)

  logits, moved = run(params, tokens, cache)
  want, want_cache = _decode_tree(model, params, tokens, CHAIN, lengths, cache)
  np.testing.assert_array_equal(logits, want)
  jax.tree.map(np.testing.assert_array_equal, moved, want_cache)
  for x in moved.self_k + moved.self_v:
    assert x.sharding.is_equivalent_to(
        part.sharding(("batch", "length", "heads", "kv"), x.shape, "k"), x.ndim)


def test_bad_calls_fail_before_any_work():
  model = T5Model(TINY)
  small = jnp.zeros((B, 8, TINY.num_heads, TINY.head_dim))
  cache = DecoderCache(self_k=(small,), self_v=(small,), cross_k=(), cross_v=(),
                       encoder_mask=jnp.ones((B, S), bool))
  lengths = jnp.zeros((B,), jnp.int32)
  with pytest.raises(ValueError, match="cannot hold a tree of 22 nodes"):
    model.decode_tree({}, _tokens(TREE), lengths, TREE, cache)
  with pytest.raises(ValueError, match=r"tokens must be \[B, 4\]"):
    model.decode_tree({}, _tokens(TREE), lengths, CHAIN, cache)
  with pytest.raises(ValueError, match="distinct node indices"):
    model.decode_tree({}, _tokens(CHAIN)[:, :2], lengths, CHAIN, cache, nodes=(1, 1))
  with pytest.raises(ValueError, match="distinct node indices"):
    model.decode_tree({}, _tokens(CHAIN)[:, :1], lengths, CHAIN, cache, nodes=(4,))
