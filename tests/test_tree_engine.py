"""Token-tree speculative decoding (``decoding.tree_speculative_decode``)
beyond the exactness matrix (test_exactness.py, which holds the tree loop's
token-for-token and whole-sequence distribution cells and its power cell):
a chain tree is the chain engine, and bad trees fail before any work."""

from __future__ import annotations

import numpy as np
import pytest

from exactness_cases import INPUTS, KEY, MAX_LEN, noisy_output_layer, pick_greedy_case
from specdec_jax import drafts
from specdec_jax.decoding import speculative_decode, tree_speculative_decode
from specdec_jax.drafts.base import DraftInterfaceError, check_tree
from specdec_jax.tree import TreeShape

FULL = TreeShape.parse("full:2,2,1")     # 1 + 2 + 4 + 4 = 11 nodes, depth 3
SPINE = TreeShape.parse("spine:3,2,2")   # 1 + 7 nodes, depth 3


@pytest.fixture(scope="module")
def greedy_case(tiny_target):
  """(eos, baseline) on ``INPUTS``: rows end at different EOS positions."""
  return pick_greedy_case(*tiny_target)


def test_a_chain_tree_is_the_chain_engine(tiny_target, greedy_case):
  """``TreeShape.chain(γ)`` through the tree loop makes the chain loop's rounds."""
  model, params = tiny_target
  eos, _ = greedy_case
  draft = drafts.T5Draft(params=noisy_output_layer(params, 0.7, 3), model=model)
  tree = tree_speculative_decode(model, params, draft, INPUTS, KEY, tree=TreeShape.chain(3),
                                 max_decode_len=MAX_LEN, eos_id=eos)
  chain = speculative_decode(model, params, draft, INPUTS, KEY, gamma=3,
                             max_decode_len=MAX_LEN, eos_id=eos)
  np.testing.assert_array_equal(np.asarray(tree.stats.target_calls),
                                np.asarray(chain.stats.target_calls))
  np.testing.assert_array_equal(np.asarray(tree.stats.accepted),
                                np.asarray(chain.stats.accepted))


def test_bad_trees_fail_before_any_work(tiny_target, tiny_draft):
  model, params = tiny_target
  pl = drafts.build("prompt_lookup", vocab_size=64)
  with pytest.raises(DraftInterfaceError, match="fills spine trees .* and fans of chains"):
    check_tree("prompt_lookup", pl, FULL)
  with pytest.raises(DraftInterfaceError, match="proposes chains only.*spine"):
    check_tree("bigram", drafts.build("bigram", corpus=np.zeros((2, 3), np.int32),
                                      vocab_size=64), FULL)
  observed = drafts.T5Draft(params=tiny_draft[1], model=tiny_draft[0],
                            observe=lambda hidden, logits: None)
  with pytest.raises(DraftInterfaceError, match="observed T5 draft"):
    check_tree("t5", observed, FULL)
  with pytest.raises(ValueError, match="does not fit max_decode_len 2"):
    tree_speculative_decode(model, params, pl, INPUTS, KEY, tree=SPINE, max_decode_len=2)
  with pytest.raises(ValueError, match="node 2's parent 3 does not precede it"):
    TreeShape.parse("parents:-1,0,3,0")
  with pytest.raises(ValueError, match="vocab mismatch"):
    tree_speculative_decode(model, params, drafts.build("prompt_lookup", vocab_size=65), INPUTS,
                            KEY, tree=SPINE, max_decode_len=MAX_LEN)
