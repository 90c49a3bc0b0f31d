"""Token-tree speculative decoding end to end (``decoding.tree_speculative_decode``):
token for token the baseline at temperature 0, and the target's exact
distribution over whole sequences at temperature > 0 (enumerated, as in
test_engine), for two tree shapes and two drafts; a wrong acceptance rule fails
the same test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import decoding, drafts
from specdec_jax import tree as tree_lib
from specdec_jax.decoding import tree_speculative_decode
from specdec_jax.drafts.base import DraftInterfaceError, check_tree
from specdec_jax.sampling import SamplingConfig
from specdec_jax.tree import TreeShape
from specdec_jax.drafts import shortlist as shortlist_lib
from test_engine import (INPUTS, KEY, MAX_LEN, SEQ_EOS, SEQ_INPUT, SEQ_LEN, SEQ_N, _featured,
                         exact_sequence_distribution, greedy_case, seq_models,
                         sequence_pvalue)

__all__ = ["greedy_case", "seq_models"]  # fixtures, imported for pytest

FULL = TreeShape.parse("full:2,2,1")     # 1 + 2 + 4 + 4 = 11 nodes, depth 3
SPINE = TreeShape.parse("spine:3,2,2")   # 1 + 7 nodes, depth 3
FAN = TreeShape.parse("parents:-1,0,0,0,1,2,3,4,5,6")  # three chains of 3 from the root


def _near_target(params, scale: float, seed: int):
  """A draft: the target's weights with noise on the output layer, so its
  argmax often agrees with the target's and its runner-up sometimes wins."""
  out = jax.tree_util.tree_map(lambda x: x, params)
  k = out["decoder"]["logits_dense"]["kernel"]
  out["decoder"]["logits_dense"]["kernel"] = k + scale * jnp.std(k) * jax.random.normal(
      jax.random.PRNGKey(seed), k.shape)
  return out


def _tree_drafts(model, params, tiny_draft):
  near = _near_target(params, 0.7, 3)
  t5 = drafts.T5Draft(params=near, model=model)
  # Half the vocabulary, plus each input's own tokens.
  short = shortlist_lib.Shortlist.for_draft(model, near, np.arange(0, 64, 2))
  return {"t5": t5, "lookup_t5": drafts.LookupT5Draft(t5=t5, max_ngram=2, min_ngram=1),
          "prompt_lookup": drafts.build("prompt_lookup", vocab_size=64),
          "t5_small": drafts.build("t5", model=tiny_draft[0], params=tiny_draft[1]),
          "t5_feature": _featured(model, near, model, params, scale=0.05),
          "t5_shortlist": drafts.T5Draft(params=near, model=model, shortlist=short)}


@pytest.mark.parametrize("draft_name,shape", [("t5", FULL), ("t5", SPINE),
                                              ("lookup_t5", SPINE), ("prompt_lookup", SPINE),
                                              ("prompt_lookup", FAN), ("t5_small", FULL),
                                              ("t5_feature", FULL), ("t5_shortlist", SPINE)])
def test_greedy_tree_identical_to_baseline(tiny_target, tiny_draft, greedy_case, draft_name,
                                           shape):
  model, params = tiny_target
  eos, base = greedy_case
  draft = _tree_drafts(model, params, tiny_draft)[draft_name]
  check_tree(draft_name, draft, shape)
  out = tree_speculative_decode(model, params, draft, INPUTS, KEY, tree=shape,
                                max_decode_len=MAX_LEN, eos_id=eos)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(base.tokens))
  np.testing.assert_array_equal(np.asarray(out.length), np.asarray(base.length))
  st = out.stats
  assert int(st.depth_hist.sum()) == int(st.target_calls.sum())
  assert int(st.accepted.sum()) == int(st.rank_hist.sum())
  assert int((out.length - st.accepted).sum()) <= int(st.target_calls.sum())
  if shape is FAN:
    # Matches other than the best one were verified and won rounds.
    assert int(st.rank_hist[:, 1:].sum()) > 0, np.asarray(st.rank_hist)
  if draft_name in ("t5", "lookup_t5", "t5_feature", "t5_shortlist"):
    # The test means something only if paths went deep (and, for the T5
    # draft, through its runner-up tokens; a chain-only draft's one-hot q at
    # T = 0 has no alternatives, so its tree is its chain).
    assert int(st.depth_hist[:, 2:].sum()) > 0, np.asarray(st.depth_hist)
    assert (int(st.rank_hist[:, 1:].sum()) > 0) == (draft_name != "lookup_t5"), \
        np.asarray(st.rank_hist)


def test_a_chain_tree_is_the_chain_engine(tiny_target, tiny_draft, greedy_case):
  """``TreeShape.chain(γ)`` through the tree loop makes the chain loop's rounds."""
  model, params = tiny_target
  eos, _ = greedy_case
  draft = _tree_drafts(model, params, tiny_draft)["t5"]
  tree = tree_speculative_decode(model, params, draft, INPUTS, KEY, tree=TreeShape.chain(3),
                                 max_decode_len=MAX_LEN, eos_id=eos)
  chain = decoding.speculative_decode(model, params, draft, INPUTS, KEY, gamma=3,
                                      max_decode_len=MAX_LEN, eos_id=eos)
  np.testing.assert_array_equal(np.asarray(tree.stats.target_calls),
                                np.asarray(chain.stats.target_calls))
  np.testing.assert_array_equal(np.asarray(tree.stats.accepted),
                                np.asarray(chain.stats.accepted))


SETTINGS = {
    "temp1": SamplingConfig(temperature=1.0),
    "temp0.7_topk3": SamplingConfig(temperature=0.7, topk=3),
    "temp1_topp0.8": SamplingConfig(temperature=1.0, topp=0.8),
}
SEQ_FULL = TreeShape.parse("full:2,2")    # 7 nodes, depth 2
SEQ_SPINE = TreeShape.parse("spine:3,2")  # 6 nodes, depth 2


def _seq_tree_draft(name, model, draft_params, target_params=None):
  if name == "t5_feature":
    return _featured(model, draft_params, model, target_params, seed=1, scale=1.0)
  t5 = drafts.T5Draft(params=draft_params, model=model)
  return t5 if name == "t5" else drafts.LookupT5Draft(t5=t5, max_ngram=2, min_ngram=1)


def _sample(model, target, draft, shape, sampling, seed=5):
  inputs = jnp.repeat(SEQ_INPUT, SEQ_N, 0)
  return tree_speculative_decode(model, target, draft, inputs, jax.random.PRNGKey(seed),
                                 tree=shape, max_decode_len=SEQ_LEN, sampling=sampling,
                                 eos_id=SEQ_EOS)


# 20k sequences per case, chi-square at significance 1e-3 against the
# enumerated target (test_engine's test): a correct engine fails with
# probability 0.001 per case.
@pytest.mark.parametrize("setting,draft_name,shape", [
    ("temp1", "t5", SEQ_FULL), ("temp1", "t5", SEQ_SPINE), ("temp1", "lookup_t5", SEQ_SPINE),
    ("temp0.7_topk3", "t5", SEQ_FULL), ("temp0.7_topk3", "lookup_t5", SEQ_SPINE),
    ("temp1_topp0.8", "t5", SEQ_FULL), ("temp1_topp0.8", "lookup_t5", SEQ_SPINE),
    ("temp1", "t5_feature", SEQ_FULL)])
def test_tree_sequence_distribution_is_exact(seq_models, setting, draft_name, shape):
  model, target, draft_params = seq_models
  sampling = SETTINGS[setting]
  dist = exact_sequence_distribution(model, target, sampling)
  out = _sample(model, target, _seq_tree_draft(draft_name, model, draft_params, target), shape,
                sampling)
  st = out.stats
  # Siblings were tried and sometimes won, and rounds were sometimes cut short.
  assert int(st.rank_hist[:, 1:].sum()) > 0, np.asarray(st.rank_hist.sum(0))
  assert int(st.depth_hist[:, 0].sum()) > 0
  assert sequence_pvalue(np.asarray(out.tokens), dist) > 1e-3


def test_a_wrong_tree_rule_fails_the_distribution_test(seq_models, monkeypatch):
  """Power: the same test rejects the tree rule that forgets the residual
  update after a rejected sibling (the next sibling tested against p itself)."""
  model, target, draft_params = seq_models
  sampling = SETTINGS["temp1"]
  dist = exact_sequence_distribution(model, target, sampling)
  monkeypatch.setattr(tree_lib, "residual", lambda r, q: r)
  # JAX caches traces by function: drop them so that the loop is traced with
  # the wrong rule here, and again after, so that no later test reuses it.
  jax.clear_caches()
  try:
    bad = _sample(model, target, _seq_tree_draft("t5", model, draft_params), SEQ_FULL,
                  sampling)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  assert sequence_pvalue(np.asarray(bad.tokens), dist) < 1e-3


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
