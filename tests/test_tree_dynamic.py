"""Trees whose shape is data (``tree.RoundTree``) and trees chosen per round
(``tree.DynamicTree``) beyond the exactness matrix (test_exactness.py and
test_exactness_sampling.py hold their T = 0 identity and whole-sequence
cells): a static shape is the special case, the trees really change, and
choosing nodes by their own drawn probability is caught."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exactness_cases import SEQ_EOS, SEQ_KEY, SEQ_LEN, SETTINGS, SIGNIFICANCE
from exactness_cases import exact_sequence_distribution, seq_inputs, seq_models, sequence_pvalue
from specdec_jax import drafts
from specdec_jax.decoding import tree_speculative_decode
from specdec_jax.drafts import base as draft_base
from specdec_jax.sampling import SamplingConfig
from specdec_jax.tree import (DynamicTree, RoundTree, TreeShape, parse_tree, tree_greedy_kernel,
                              tree_sampling_with, without_replacement)

SHAPES = ["full:2,2,1", "spine:3,2,2", "acceptance:16:0.7,0.1,0.04", "parents:-1,0,0,1,1,2,0"]
TABLES = ["parents", "depths", "ancestor_mask", "ancestors_by_depth", "children_table",
          "sibling_rank", "earlier_siblings"]


@pytest.mark.parametrize("text", SHAPES)
def test_a_static_shape_is_the_special_case(text):
  """The arrays derived from a static shape's parents inside jit equal the
  shape's own tables, and (on the last shape: the kernels read a static
  shape through the same tables, ``tree.round_tree``) the kernels give the
  same verdicts on either."""
  shape = TreeShape.parse(text)
  b, n, v = 3, shape.num_nodes, 5
  parents = jnp.broadcast_to(jnp.asarray(shape.parents), (b, n))
  derived = jax.jit(RoundTree.from_parents, static_argnums=(1, 2))(parents, shape.max_depth,
                                                                   shape.max_branching)
  static = RoundTree.of(shape, b)
  for name in TABLES:
    np.testing.assert_array_equal(np.asarray(getattr(derived, name)),
                                  np.asarray(getattr(static, name)), err_msg=name)
  if text != SHAPES[-1]:
    return
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  tokens = jax.random.randint(ks[0], (b, n), 0, v)
  q = jax.nn.softmax(jax.random.normal(ks[1], (b, n, v)) * 2)
  p = jax.nn.softmax(jax.random.normal(ks[2], (b, n, v)) * 2)
  u = jax.random.uniform(ks[3], (b, n))
  # All three kernels in one program per tree (the static shape a static
  # argument, the derived tables traced).
  kernels = lambda tree, u, tokens, q, p: (  # noqa: E731
      tree_sampling_with(u, tree, tokens, q, p),
      tree_greedy_kernel(tree, tokens, jnp.argmax(p, -1)), without_replacement(tree, q, tokens))
  want = jax.jit(kernels, static_argnums=0)(shape, u, tokens, q, p)
  got = jax.jit(kernels)(derived, u, tokens, q, p)
  for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_per_row_parents_give_per_row_tables():
  """Two rows, two different trees of 5 nodes: each row's tables are its own."""
  parents = jnp.asarray([[-1, 0, 0, 1, 1], [-1, 0, 1, 2, 3]])
  t = jax.jit(RoundTree.from_parents, static_argnums=(1, 2))(parents, 4, 2)
  np.testing.assert_array_equal(np.asarray(t.depths), [[0, 1, 1, 2, 2], [0, 1, 2, 3, 4]])
  np.testing.assert_array_equal(np.asarray(t.children_table[0, :2]), [[1, 2], [3, 4]])
  np.testing.assert_array_equal(np.asarray(t.children_table[1, :2]), [[1, -1], [2, -1]])
  np.testing.assert_array_equal(np.asarray(t.sibling_rank), [[0, 0, 1, 0, 1], [0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(np.asarray(t.earlier_siblings[0, :, 0]), [-1, -1, 1, -1, 3])


def test_dynamic_tree_settings():
  tree = parse_tree("dynamic:3,4,2")
  assert isinstance(tree, DynamicTree) and tree.num_nodes == 10 and tree.max_depth == 3
  assert tree.level(0) == (0, 1) and tree.level(2) == (4, 8)
  assert tree.skeleton == TreeShape.spine((3, 4, 2))
  assert isinstance(parse_tree("full:2,2"), TreeShape)
  with pytest.raises(ValueError, match="expected 'dynamic:W1,W2,...'"):
    parse_tree("dynamic:3,x")
  with pytest.raises(ValueError, match="at most 64"):
    parse_tree("dynamic:40,40")


@pytest.mark.slow
def test_the_trees_change_between_rounds_and_rows(tiny_target):
  """The T5 draft's trees differ between rows of a round and between rounds
  (the parents are data), each a valid layout: W_d nodes at depth d."""
  model, params = tiny_target
  draft = drafts.T5Draft(params=params, model=model)
  tree = DynamicTree((3, 3, 3))
  b = 4
  inputs = jax.random.randint(jax.random.PRNGKey(1), (b, 6), 2, 64)
  state = draft.init(inputs, 32)
  seq = jax.random.randint(jax.random.PRNGKey(2), (b, 32), 2, 64)
  seen = set()
  for n in (1, 3, 5):
    *_, parents, _, state = draft.propose_dynamic_tree(
        state, seq, jnp.full((b,), n, jnp.int32), tree, SamplingConfig(temperature=1.0),
        jax.random.PRNGKey(n))
    rt = RoundTree.from_parents(parents, tree.max_depth, tree.max_branching)
    np.testing.assert_array_equal(np.asarray(rt.depths),
                                  np.broadcast_to(tree.skeleton.depths, (b, tree.num_nodes)))
    seen |= {tuple(int(x) for x in row) for row in np.asarray(parents)}
  assert len(seen) > 2, seen


@pytest.mark.slow
def test_choosing_by_the_drawn_token_is_not_exact(monkeypatch):
  """Power: ranking a sampled first child by its own drawn probability
  (EAGLE-2's reranking after drawing) is rejected by the whole-sequence test
  that passes the exact choice (test_exactness_sampling.py's dynamic cells)."""
  model, target, draft_params = seq_models()
  t5 = drafts.T5Draft(params=draft_params, model=model)
  sampling = SETTINGS["temp1"]
  dist = exact_sequence_distribution(model, target, sampling)
  run = lambda: tree_speculative_decode(model, target, t5, seq_inputs(), SEQ_KEY,  # noqa: E731
                                        tree=DynamicTree((2, 2)), max_decode_len=SEQ_LEN,
                                        sampling=sampling, eos_id=SEQ_EOS)
  monkeypatch.setattr(draft_base, "first_child_score",
                      lambda probs, first: jnp.take_along_axis(probs, first[..., None], -1)[..., 0])
  jax.clear_caches()
  try:
    bad = run()
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  assert sequence_pvalue(np.asarray(bad.tokens), dist) < SIGNIFICANCE
