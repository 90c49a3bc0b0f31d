"""Approximation models: what they propose and that q is what they sampled from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import drafts
from specdec_jax.sampling import SamplingConfig

V = 16
KEY = jax.random.PRNGKey(0)


def _seq(tokens, length_buf=12):
  """Decoder-input buffer [1, T]: start token 0, then the committed tokens."""
  seq = np.zeros((1, length_buf), np.int32)
  seq[0, 1:1 + len(tokens)] = tokens
  return jnp.asarray(seq), jnp.array([len(tokens)], jnp.int32)


def test_bigram_is_a_proper_distribution_following_the_counts():
  corpus = [[3, 4, 5], [3, 4, 6], [3, 4, 5], [7]]
  bg = drafts.BigramDraft.fit(corpus, V, top_m=4, backoff=0.1)
  q = np.asarray(bg.distribution(jnp.array([4, 3, 9])))
  np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
  assert np.all(q > 0)  # full support through the unigram backoff
  # After 4: 5 twice, 6 once -> 5 is the mode and beats 6 by about 2:1.
  assert q[0].argmax() == 5 and q[0, 5] / q[0, 6] == pytest.approx(2.0, rel=0.05)
  assert q[1].argmax() == 4  # 3 -> 4 always
  # Start token 0 precedes every sequence.
  assert np.asarray(bg.distribution(jnp.array([0]))).argmax() == 3


@pytest.mark.parametrize("name", ["unigram", "bigram"])
def test_ngram_q_is_the_standardized_distribution_sampled_from(name):
  corpus = [list(np.random.default_rng(i).integers(2, V, 12)) for i in range(30)]
  draft = drafts.build(name, corpus=corpus, vocab_size=V)
  seq, length = _seq([5, 6])
  for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, topk=3)):
    tokens, q, _ = draft.propose(draft.init(seq, 8), seq, length, 3, sampling, KEY)
    assert tokens.shape == (1, 3) and q.shape == (1, 3, V)
    np.testing.assert_allclose(np.asarray(q).sum(-1), 1.0, rtol=1e-5)
    qx = np.take_along_axis(np.asarray(q), np.asarray(tokens)[..., None], -1)
    assert np.all(qx > 0)  # every proposed token had mass under its q
    if sampling.topk:
      assert np.all((np.asarray(q) > 0).sum(-1) == 3)
    else:
      np.testing.assert_array_equal(np.asarray(q).max(-1), 1.0)  # argmax one-hot


def test_prompt_lookup_copies_the_continuation_of_the_longest_match():
  pl = drafts.build("prompt_lookup", vocab_size=V, max_ngram=3)
  inputs = jnp.array([[9, 4, 5, 6, 7, 8, 1, 0, 0]], jnp.int32)  # 0 = pad
  seq, length = _seq([2, 4, 5])       # suffix "4 5" occurs in the input
  tokens, q, _ = pl.propose(pl.init(inputs, 8), seq, length, 3, SamplingConfig(), KEY)
  np.testing.assert_array_equal(tokens, [[6, 7, 8]])
  np.testing.assert_array_equal(q, jax.nn.one_hot(tokens, V))
  # A longer match in the generated text wins over a shorter one in the input.
  seq, length = _seq([3, 5, 11, 12, 3, 5])   # "3 5" seen before, followed by 11 12
  tokens, _, _ = pl.propose(pl.init(inputs, 8), seq, length, 2, SamplingConfig(), KEY)
  np.testing.assert_array_equal(tokens, [[11, 12]])
  # No match: repeats the last token (any proposal is exact; this one is cheap).
  seq, length = _seq([13, 14])
  tokens, _, _ = pl.propose(pl.init(inputs, 8), seq, length, 2, SamplingConfig(), KEY)
  np.testing.assert_array_equal(tokens, [[14, 14]])


def test_prompt_lookup_adaptive_proposes_its_copied_run():
  """propose_adaptive: the leading copied tokens (filler excluded); at least
  x_1 unless skip_below is set and x_1 is filler; threshold 1: one token."""
  pl = drafts.build("prompt_lookup", vocab_size=V, max_ngram=3)
  inputs = jnp.array([[9, 4, 5, 6, 0, 0]], jnp.int32)  # "4 5" is followed by 6, then pad
  cases = [([2, 4], 2, [5, 6]), ([2, 4, 5], 1, [6]), ([13, 14], 0, [])]
  for committed, run, copied in cases:
    seq, length = _seq(committed)
    state = pl.init(inputs, 8)
    tokens, q, _ = pl.propose(state, seq, length, 4, SamplingConfig(), KEY)

    def count(limit, threshold, skip_below=None):
      out = pl.propose_adaptive(state, seq, length, 4, SamplingConfig(), KEY,
                                jnp.array([limit]), threshold, skip_below)
      np.testing.assert_array_equal(out[0], tokens)  # same proposal as propose
      np.testing.assert_array_equal(out[1], q)
      return int(out[2][0])

    np.testing.assert_array_equal(np.asarray(tokens)[0, :run], copied)
    assert count(4, 0.4) == max(run, 1)
    assert count(1, 0.4) == 1 and count(0, 0.4) == 0
    assert count(4, 1.0) == 1
    assert count(4, 0.4, skip_below=0.5) == run
    assert count(4, 0.4, skip_below=1.0) == 0  # a confidence of 1 is not > 1


@pytest.mark.slow  # 20 s; lookup-T5's exactness is in the fast matrix (test_exactness*)
def test_lookup_t5_copies_on_a_match_and_falls_back_to_the_t5_draft(tiny_draft):
  model, params = tiny_draft
  vocab = model.config.vocab_size
  t5 = drafts.T5Draft(params=params, model=model)
  combo = drafts.LookupT5Draft(t5=t5, max_ngram=2, min_ngram=2)
  inputs = jnp.array([[9, 4, 5, 6, 1, 0]], jnp.int32)  # 0 = pad
  sampling = SamplingConfig(temperature=1.0)
  propose = lambda d, committed: d.propose(d.init(inputs, 12), *_seq(committed), 3, sampling, KEY)
  # "4 5" occurs in the input, followed by 6, 1 and then padding: positions 1-2
  # copy (one-hot q), position 3 has no valid continuation and comes from T5.
  tokens, q, _ = propose(combo, [2, 4, 5])
  np.testing.assert_array_equal(tokens[0, :2], [6, 1])
  np.testing.assert_array_equal(q[0, :2], jax.nn.one_hot(jnp.array([6, 1]), vocab))
  assert float(q[0, 2].max()) < 1.0  # the T5 draft's T=1 distribution, not a copy
  np.testing.assert_allclose(np.asarray(q).sum(-1), 1.0, rtol=1e-5)
  assert float(np.take_along_axis(np.asarray(q), np.asarray(tokens)[..., None], -1).min()) > 0
  # Only a 1-gram match ("5") or none at all: below min_ngram, so the
  # proposal is exactly the T5 draft's (same keys, same q).
  for committed in ([7, 5], [2, 3]):
    tokens, q, _ = propose(combo, committed)
    ref_tokens, ref_q, _ = propose(t5, committed)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_allclose(q, ref_q, rtol=1e-6)


def test_registry():
  assert {"t5", "unigram", "bigram", "prompt_lookup", "lookup_t5"} <= set(drafts.REGISTRY)
  with pytest.raises(ValueError, match="unknown approximation model 'nope'"):
    drafts.build("nope")
  with pytest.raises(ValueError, match="already registered"):
    drafts.register("t5")(lambda **_: None)


CAPABILITY_NAMES = ("init_with_target", "wants_target_states", "commit_with_target",
                    "propose_adaptive", "propose_tree", "commit_tree", "tree_unsupported")


def test_capabilities_are_asked_in_one_place():
  """What the engine reads of each built-in draft, the defaults of a draft
  with only init/propose/commit, and no module but drafts/base.py asking a
  model for an optional method by name (getattr/hasattr)."""
  from pathlib import Path  # pylint: disable=g-import-not-at-top
  from specdec_jax.drafts.base import Capabilities, capabilities  # pylint: disable=g-import-not-at-top
  pl = drafts.build("prompt_lookup", vocab_size=V)
  assert capabilities(pl) == Capabilities(propose_adaptive=True, propose_tree=True,
                                          tree_unsupported=True)
  assert capabilities(drafts.build("unigram", corpus=[[2, 3]], vocab_size=V)) == Capabilities()
  t5 = drafts.T5Draft
  assert all(callable(getattr(t5, n)) for n in ("init_with_target", "propose_adaptive",
                                                "propose_tree", "commit_tree"))
  pkg = Path(drafts.__file__).resolve().parent.parent
  asking = [f"{path.relative_to(pkg)}:{i}" for path in pkg.rglob("*.py")
            if path.name != "base.py" or path.parent.name != "drafts"
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if ("getattr(" in line or "hasattr(" in line)
            and any(f'"{n}"' in line or f"'{n}'" in line for n in CAPABILITY_NAMES)]
  assert not asking, f"capabilities probed outside drafts/base.py: {asking}"
