"""Draft vocabulary shortlists (``specdec_jax.drafts.shortlist``): choosing,
saving and loading them, and the shortlisted draft's q (its support, and a
full shortlist equal to no shortlist). Exactness with a shortlisted draft (at
T = 0 token for token with a shortlist that leaves out tokens the target
emits; at T > 0 the whole-sequence distribution while the shortlist leaves
out most of the vocabulary, so the target's tokens outside it come only from
the rejection's residual) is in the exactness matrix (test_exactness.py).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exactness_cases import KEY
from specdec_jax import drafts
from specdec_jax.drafts import shortlist
from specdec_jax.models.t5 import T5Config, T5Model
from specdec_jax.sampling import SamplingConfig


def test_frequent_keeps_the_most_common_and_always_eos():
  seqs = [[5, 5, 5, 7, 1], [7, 9, 5], [9, 4]]
  # counts: 5:4, 7:2, 9:2, 1:1, 4:1; ties broken by the lower id
  np.testing.assert_array_equal(shortlist.frequent(seqs, 3, 16), [5, 7, 9])
  np.testing.assert_array_equal(shortlist.frequent(seqs, 3, 16, always=(1,)), [1, 5, 7])
  np.testing.assert_array_equal(shortlist.frequent(seqs, 50, 16), [1, 4, 5, 7, 9])
  with pytest.raises(ValueError, match="size must be >= 1"):
    shortlist.frequent(seqs, 0, 16)
  with pytest.raises(ValueError, match=r"outside \[0, 8\): \[9\]"):
    shortlist.frequent(seqs, 3, 8)


def test_save_load_round_trip_and_bad_files(tmp_path):
  path = str(tmp_path / "s.json")
  shortlist.save(path, np.array([9, 1, 4]), 16, source="x.tsv")
  np.testing.assert_array_equal(shortlist.load(path, 16), [1, 4, 9])
  assert json.loads(open(path).read())["source"] == "x.tsv"
  with pytest.raises(ValueError, match=r"s.json: token ids outside \[0, 8\): \[9\]"):
    shortlist.load(path, 8)
  with pytest.raises(FileNotFoundError, match="draft shortlist not found: .*nope.json"):
    shortlist.load(str(tmp_path / "nope.json"), 16)
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(ValueError, match="bad.json is not readable JSON"):
    shortlist.load(str(tmp_path / "bad.json"), 16)
  (tmp_path / "other.json").write_text('{"token_ids": [1]}')
  with pytest.raises(ValueError, match="other.json: expected a JSON object with format"):
    shortlist.load(str(tmp_path / "other.json"), 16)
  with pytest.raises(ValueError, match="repeated token ids"):
    shortlist.save(path, np.array([1, 1]), 16)
  with pytest.raises(ValueError, match="non-empty"):
    shortlist.save(path, np.array([], np.int32), 16)


def test_sequences_from_target_outputs_and_references(tmp_path):
  """A distillation's target outputs are counted as they are; examples by
  their references, encoded, with EOS; ``max_examples`` caps both."""
  outs = tmp_path / "target_outputs.jsonl"
  outs.write_text("".join(json.dumps({"i": i, "mode": "greedy", "tokens": [i, 7, 1]}) + "\n"
                          for i in range(5)))
  assert list(shortlist.sequences_from(str(outs), None)) == [[i, 7, 1] for i in range(5)]
  assert len(list(shortlist.sequences_from(str(outs), None, max_examples=2))) == 2

  class Vocab:
    eos_id = 1

    def encode(self, text):
      return [len(w) + 2 for w in text.split()]

  tsv = tmp_path / "pairs.tsv"
  tsv.write_text("id\tinput\treference\na\tx\tno yes\nb\ty\tmaybe\n")
  assert list(shortlist.sequences_from(str(tsv), Vocab())) == [[4, 5, 1], [7, 1]]
  (tmp_path / "noref.tsv").write_text("id\tinput\na\tx\n")
  with pytest.raises(ValueError, match="noref.tsv: no references to count"):
    list(shortlist.sequences_from(str(tmp_path / "noref.tsv"), Vocab()))


@pytest.mark.slow  # 20 s; the shortlist's exactness cells are in the fast matrix
@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_a_full_shortlist_is_the_draft_itself(version):
  """Every token shortlisted: the same tokens and q as without one, for the
  untied output layer (1.1) and the tied, 1/sqrt(d)-scaled embedding (1.0)."""
  cfg = T5Config(vocab_size=64, d_model=16, num_heads=2, head_dim=8, num_encoder_layers=1,
                 num_decoder_layers=1, d_ff=16, version=version)
  model = T5Model(cfg)
  params = model.init(jax.random.PRNGKey(0))
  full = drafts.T5Draft(params=params, model=model)
  every = drafts.T5Draft(params=params, model=model, shortlist=shortlist.Shortlist.for_draft(
      model, params, np.arange(64), with_inputs=False))
  inputs = jnp.array([[5, 9, 7, 0, 0]], jnp.int32)
  seq, length = jnp.zeros((1, 20), jnp.int32), jnp.array([0], jnp.int32)
  sampling = SamplingConfig(temperature=1.0)
  a = full.propose(full.init(inputs, 16), seq, length, 3, sampling, KEY)
  b = every.propose(every.init(inputs, 16), seq, length, 3, sampling, KEY)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_allclose(a[1], b[1], atol=1e-6)


@pytest.mark.slow
def test_q_lives_on_the_shortlist_and_the_inputs_tokens(tiny_draft):
  model, params = tiny_draft
  fixed = np.array([1, 2, 3])
  inputs = jnp.array([[40, 41, 41, 0], [50, 0, 0, 0]], jnp.int32)  # 0: padding
  seq, length = jnp.zeros((2, 20), jnp.int32), jnp.array([0, 0], jnp.int32)
  for with_inputs, allowed in ((False, [{1, 2, 3}] * 2), (True, [{1, 2, 3, 40, 41},
                                                                  {1, 2, 3, 50}])):
    d = drafts.T5Draft(params=params, model=model,
                       shortlist=shortlist.Shortlist.for_draft(model, params, fixed, with_inputs))
    for temp in (0.0, 1.0):
      tokens, q, _ = d.propose(d.init(inputs, 16), seq, length, 4,
                               SamplingConfig(temperature=temp), KEY)
      np.testing.assert_allclose(np.asarray(q).sum(-1), 1.0, atol=1e-5)
      for row in range(2):
        support = set(np.nonzero(np.asarray(q[row]).sum(0))[0].tolist())
        assert support <= allowed[row], (with_inputs, temp, support)
        assert set(np.asarray(tokens[row]).tolist()) <= allowed[row]
        if temp == 1.0 and with_inputs:  # the input's tokens really join S
          assert support - {1, 2, 3}, (row, support)


def test_the_demo_shortlist_defaults_only_for_the_demo_t5_draft():
  """Scripts' --draft_shortlist default: the demo shortlist for the demo T5
  draft; nothing for another checkpoint or a draft that is not a T5 (prompt
  lookup takes no shortlist); an explicit value always wins."""
  import argparse
  from specdec_jax.scripting import script_args as demo
  ns = argparse.Namespace
  assert demo.shortlist_for(ns(draft_shortlist=None, draft=demo.DRAFT)) == demo.SHORTLIST
  assert demo.shortlist_for(ns(draft_shortlist=None, draft=demo.DRAFT,
                               draft_name="t5")) == demo.SHORTLIST
  assert demo.shortlist_for(ns(draft_shortlist=None, draft=demo.DRAFT,
                               draft_name="prompt_lookup")) == ""
  assert demo.shortlist_for(ns(draft_shortlist=None, draft="other")) == ""
  assert demo.shortlist_for(ns(draft_shortlist="x.json", draft="other")) == "x.json"
