"""The Hugging Face comparison (``lab.bench.vs_hf``, used by
scripts/bench_vs_hf.py and the accelerator benchmark): its Hugging Face path
agrees with ours on a tiny model.

The tiny random target/draft (vocab 64, d_model 32, from conftest) are exported
with ``export_hf`` and loaded into transformers; at temperature 0 HF greedy
``generate`` and HF assisted generation (constant γ) must produce exactly our
``temperature_sample`` tokens.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdec_jax.drafts import T5Draft  # noqa: E402
from lab.bench import hf as bench_hf  # noqa: E402
from lab.bench import vs_hf as bvh  # noqa: E402

MAX_DECODE_LEN = 16
GAMMA = 3


@pytest.fixture(scope="module")
def setup(tiny_target, tiny_draft, tmp_path_factory):
  (tmodel, tparams), (dmodel, dparams) = tiny_target, tiny_draft
  root = tmp_path_factory.mktemp("hf")
  hf_target = bvh.load_hf(bvh.export_for_hf(tparams, tmodel.config, str(root / "target")), 1)
  hf_draft = bvh.load_hf(bvh.export_for_hf(dparams, dmodel.config, str(root / "draft")), 1)
  ours = bvh.Ours(tmodel, tparams, T5Draft(params=dparams, model=dmodel))
  hf_self = bvh.load_hf(str(root / "target"), 1)  # a second copy: the target as its own draft
  rng = np.random.RandomState(0)
  inputs = np.zeros((3, 12), np.int32)  # padded with 0, EOS-terminated, varied lengths
  for i, n in enumerate((11, 7, 4)):
    inputs[i, :n - 1] = rng.randint(2, tmodel.config.vocab_size, n - 1)
    inputs[i, n - 1] = tmodel.config.eos_id
  return ours, hf_target, hf_draft, inputs, hf_self


def test_helpers():
  assert bvh.upto_eos([5, 6, 1, 0, 0], 1) == [5, 6, 1]
  assert bvh.upto_eos([5, 6, 7], 1) == [5, 6, 7]
  assert bvh.first_difference([1, 2, 3], [1, 2, 3]) is None
  assert bvh.first_difference([1, 2, 3], [1, 4, 3]) == 1
  assert bvh.first_difference([1, 2], [1, 2, 3]) == 2
  np.testing.assert_array_equal(bvh.unpad(np.array([4, 5, 1, 0, 0])), [4, 5, 1])


def test_hf_greedy_and_assisted_match_ours(setup):
  ours, hf_target, hf_draft, inputs, _ = setup
  cfg = ours.config
  kw = dict(max_new_tokens=MAX_DECODE_LEN, temperature=0.0, decoder_start_id=cfg.decoder_start_id,
            eos_id=cfg.eos_id, pad_id=cfg.pad_id)
  counter = bvh.CallCounter(hf_target)
  try:
    for i in range(inputs.shape[0]):
      out = bvh.ours_baseline(ours, inputs[i:i + 1], jax.random.PRNGKey(0),
                              max_decode_len=MAX_DECODE_LEN, temperature=0.0)
      expected = bvh.output_tokens("ours_base", out, cfg.eos_id)
      row = bvh.unpad(inputs[i])
      counter.reset()
      greedy = bvh.upto_eos(bvh.hf_generate(hf_target, row, **kw), cfg.eos_id)
      assert counter.n == len(greedy)  # one target call per token
      assert greedy == expected, f"example {i}: HF greedy {greedy} != ours {expected}"
      bvh.configure_assistant(hf_draft, GAMMA)
      counter.reset()
      assisted = bvh.upto_eos(bvh.hf_generate(hf_target, row, assistant=hf_draft, **kw),
                              cfg.eos_id)
      assert assisted == expected, f"example {i}: HF assisted {assisted} != ours {expected}"
      assert counter.n <= len(assisted)
  finally:
    counter.remove()


def test_constant_gamma_with_self_draft(setup):
  """The target drafting for itself accepts every draft token, so with a
  constant γ (no confidence early stop) each target call yields γ+1 tokens."""
  ours, hf_target, _, inputs, hf_self = setup
  cfg = ours.config
  bvh.configure_assistant(hf_self, GAMMA)
  counter = bvh.CallCounter(hf_target)
  try:
    for i in range(inputs.shape[0]):
      row = bvh.unpad(inputs[i])
      greedy = bvh.upto_eos(bvh.hf_generate(
          hf_target, row, max_new_tokens=MAX_DECODE_LEN, temperature=0.0,
          decoder_start_id=cfg.decoder_start_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id),
          cfg.eos_id)
      counter.reset()
      out = bvh.upto_eos(bvh.hf_generate(
          hf_target, row, max_new_tokens=MAX_DECODE_LEN, temperature=0.0,
          decoder_start_id=cfg.decoder_start_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id,
          assistant=hf_self, assistant_cache_fix=True), cfg.eos_id)
      assert out == greedy
      assert counter.n == -(-len(out) // (GAMMA + 1)), (counter.n, len(out))
  finally:
    counter.remove()


def test_configure_assistant(setup):
  _, _, hf_draft, _, _ = setup
  bvh.configure_assistant(hf_draft, 4)
  gc = hf_draft.generation_config
  assert (gc.num_assistant_tokens, gc.num_assistant_tokens_schedule,
          gc.assistant_confidence_threshold) == (4, "constant", 0.0)
  bvh.configure_assistant(hf_draft, None)
  assert gc.num_assistant_tokens is None and gc.assistant_confidence_threshold is None


def test_bench_setting_temp0_all_identical(setup):
  ours, hf_target, hf_draft, inputs, _ = setup
  logs = []
  s = bvh.bench_setting(ours, hf_target, hf_draft, inputs, ["a", "b", "c"], temperature=0.0,
                        gamma=GAMMA, max_decode_len=MAX_DECODE_LEN, num_warmup=1, seed=0,
                        methods=bvh.METHODS, log=logs.append)
  assert s.mismatches == [], logs
  assert s.compared == 2 * (len(bvh.METHODS) - 1)
  assert all(len(a.tokens) == 2 for a in s.accs.values())
  rows = bvh.setting_table(s)
  assert len(rows) == len(bvh.METHODS)
  n = s.compared
  assert any(f"identical outputs: {n}/{n}" in line for line in bvh.summary_lines([s]))


def test_refuses_a_bridged_draft(tiny_target, tiny_draft, tmp_path):
  """A draft with a bridge to the target (encoder or feature) has no Hugging
  Face equivalent: comparing it without the bridge would not be the same
  weights, so it is refused, naming the file."""
  from specdec_jax.drafts import bridge, feature_bridge
  from specdec_jax.checkpoints import save_checkpoint
  (tmodel, tparams), (dmodel, dparams) = tiny_target, tiny_draft
  save_checkpoint(str(tmp_path / "target"), tparams, tmodel.config)
  save_checkpoint(str(tmp_path / "draft"), dparams, dmodel.config)
  bvh.load_ours(str(tmp_path / "target"), str(tmp_path / "draft"))  # plain: fine
  from specdec_jax.drafts import shortlist
  shortlist.save(str(tmp_path / "s.json"), np.array([1, 5, 9]), 64)
  ours = bvh.load_ours(str(tmp_path / "target"), str(tmp_path / "draft"),
                       str(tmp_path / "s.json"))[0]
  np.testing.assert_array_equal(ours.draft.shortlist.ids, [1, 5, 9])  # ours only; HF keeps all
  feature_bridge.save(str(tmp_path / "draft"), feature_bridge.zeros(tmodel, dmodel, 2))
  with pytest.raises(ValueError, match="feature_bridge.npz"):
    bvh.load_ours(str(tmp_path / "target"), str(tmp_path / "draft"))
  os.remove(tmp_path / "draft" / feature_bridge.FILENAME)
  bridge.save(str(tmp_path / "draft"), np.zeros((32, 32), np.float32))
  with pytest.raises(ValueError, match="encoder_bridge.npz"):
    bvh.load_ours(str(tmp_path / "target"), str(tmp_path / "draft"))


def test_hf_model_built_from_params_equals_the_exported_one(setup, tiny_target):
  """The accelerator benchmark builds the Hugging Face model in memory from our
  params through export_hf's name map: the same weights as export_hf +
  from_pretrained, so the same logits and the same greedy tokens as ours."""
  import torch
  ours, hf_target, _, inputs, _ = setup
  _, tparams = tiny_target
  cfg = ours.config
  built = bench_hf.hf_from_params(tparams, cfg, "float32")
  exported = dict(hf_target.state_dict())
  for key, value in built.state_dict().items():
    assert torch.equal(value, exported[key]), key
  row = bvh.unpad(inputs[0])
  kw = dict(max_new_tokens=MAX_DECODE_LEN, temperature=0.0, decoder_start_id=cfg.decoder_start_id,
            eos_id=cfg.eos_id, pad_id=cfg.pad_id)
  out = bvh.ours_baseline(ours, inputs[:1], jax.random.PRNGKey(0), max_decode_len=MAX_DECODE_LEN,
                          temperature=0.0)
  expected = bvh.output_tokens("ours_base", out, cfg.eos_id)
  assert bvh.upto_eos(bvh.hf_generate(built, row, **kw), cfg.eos_id) == expected
