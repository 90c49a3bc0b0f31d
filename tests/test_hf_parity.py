"""Our Flax T5 against Hugging Face's PyTorch T5 on the same weights.

Tiny random models; sequences longer than 128 so that both the exact and the
logarithmic relative-position buckets (and the clamp at max_distance) are used.
"""

import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specdec_jax.checkpoints import CheckpointError, hf_config_to_t5, load_checkpoint
from specdec_jax.models.t5 import T5Config, T5Model

from lab.hf_export import export_hf

VOCAB, D, H, DH, FF, LAYERS = 64, 32, 2, 8, 48, 2
ENC_LEN, DEC_LEN = 150, 140  # > 128 (max_distance) and > 16 (exact buckets)


def _hf_model(version: str):
  cfg = transformers.T5Config(
      vocab_size=VOCAB, d_model=D, d_kv=DH, num_heads=H, num_layers=LAYERS,
      num_decoder_layers=LAYERS, d_ff=FF, dropout_rate=0.0,
      feed_forward_proj="relu" if version == "1.0" else "gated-gelu",
      tie_word_embeddings=(version == "1.0"), decoder_start_token_id=0)
  torch.manual_seed(0 if version == "1.0" else 1)
  return transformers.T5ForConditionalGeneration(cfg).eval()


def _inputs(seed: int = 0):
  rng = np.random.default_rng(seed)
  inputs = rng.integers(2, VOCAB, (2, ENC_LEN)).astype(np.int32)
  inputs[1, -20:] = 0  # padding on one row
  dec = rng.integers(2, VOCAB, (2, DEC_LEN)).astype(np.int32)
  dec[:, 0] = 0  # decoder start token
  return inputs, dec


def _hf_logits(model, inputs, dec) -> np.ndarray:
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(inputs).long(),
                attention_mask=torch.from_numpy(inputs != 0).long(),
                decoder_input_ids=torch.from_numpy(dec).long())
  return out.logits.numpy()


_jitted = {}


def _our_logits(params, config: T5Config, inputs, dec) -> np.ndarray:
  if config not in _jitted:
    _jitted[config] = jax.jit(T5Model(config).__call__)
  return np.asarray(_jitted[config](params, inputs, dec))


def _assert_close(ours, ref):
  scale = np.abs(ref).max()
  np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * scale)


@pytest.fixture(scope="module", params=["1.0", "1.1"])
def hf_dir(request, tmp_path_factory):
  """(version, HF model, directory saved with save_pretrained as safetensors)."""
  model = _hf_model(request.param)
  path = tmp_path_factory.mktemp(f"hf_{request.param}")
  model.save_pretrained(path, safe_serialization=True)
  assert os.path.exists(path / "model.safetensors")
  return request.param, model, str(path)


def test_config_from_hf(hf_dir):
  version, _, path = hf_dir
  params, config = load_checkpoint(path, fmt="hf")
  assert config == T5Config(vocab_size=VOCAB, d_model=D, num_heads=H, head_dim=DH,
                            num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
                            d_ff=FF, version=version)
  assert ("logits_dense" in params["decoder"]) == (version == "1.1")


def test_logits_match_hf(hf_dir):
  _, model, path = hf_dir
  params, config = load_checkpoint(path)  # 'auto' detects hf
  inputs, dec = _inputs()
  _assert_close(_our_logits(params, config, inputs, dec), _hf_logits(model, inputs, dec))


@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_export_round_trip_and_hf_loads_it(version, tmp_path):
  config = T5Config(vocab_size=VOCAB, d_model=D, num_heads=H, head_dim=DH,
                    num_encoder_layers=LAYERS, num_decoder_layers=LAYERS, d_ff=FF,
                    version=version)
  params = T5Model(config).init(jax.random.PRNGKey(3))
  export_hf(params, config, str(tmp_path / "hf"))
  loaded, loaded_config = load_checkpoint(str(tmp_path / "hf"), fmt="hf")
  assert loaded_config == config
  jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, params)
  assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(params)

  # For 1.1 our logits_dense differs from the embedding: HF must keep it untied.
  model = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path / "hf")).eval()
  inputs, dec = _inputs(1)
  _assert_close(_our_logits(params, config, inputs, dec), _hf_logits(model, inputs, dec))


def test_pytorch_bin(tmp_path):
  """pytorch_model.bin with tied aliases and an untied lm_head (T5 1.1 style)."""
  model = _hf_model("1.1")
  # Transformers 5 ties lm_head to shared; untie it as in released 1.1 checkpoints.
  model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, D))
  model.config.save_pretrained(tmp_path)
  torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
  params, config = load_checkpoint(str(tmp_path))
  inputs, dec = _inputs(2)
  _assert_close(_our_logits(params, config, inputs, dec), _hf_logits(model, inputs, dec))


def test_pytorch_bin_is_read_without_torch_in_every_layout(tmp_path):
  """The .bin reader (no torch): bfloat16 and float16 storages, a transposed
  view, a slice at an offset into a shared storage, a scalar, an empty
  tensor; every slice equals torch's own; a legacy (non-zip) file is one
  clear error."""
  from specdec_jax.checkpoints.hf import TorchBinFile
  from specdec_jax.checkpoints.common import CheckpointError
  base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
  state = {"bf16": torch.randn(4, 6).to(torch.bfloat16), "half": torch.randn(3, 5).half(),
           "t": base.t(), "offset": base[2:5, 3:8], "whole": base,
           "scalar": torch.tensor(7, dtype=torch.int64), "empty": torch.zeros(0, 3)}
  torch.save(state, tmp_path / "pytorch_model.bin")
  f = TorchBinFile(str(tmp_path / "pytorch_model.bin"))
  assert f.shapes == {k: tuple(v.shape) for k, v in state.items()}
  for key, tensor in state.items():
    want = (tensor.float().numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy())
    for index in ((), (slice(1, 3),) if tensor.dim() else ()):
      got = f.slice_reader(key)(index)
      np.testing.assert_array_equal(np.asarray(got, np.float32 if tensor.dtype ==
                                               torch.bfloat16 else got.dtype), want[index])
  torch.save(state, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
  with pytest.raises(CheckpointError, match="not a zip-format PyTorch checkpoint"):
    TorchBinFile(str(tmp_path / "legacy.bin"))


def test_bf16_safetensors(tmp_path):
  """bfloat16 tensors (no numpy dtype) load and upcast to float32 exactly."""
  config = T5Config(vocab_size=VOCAB, d_model=D, num_heads=H, head_dim=DH,
                    num_encoder_layers=1, num_decoder_layers=1, d_ff=FF, version="1.1")
  params = T5Model(config).init(jax.random.PRNGKey(4))
  export_hf(params, config, str(tmp_path), dtype="bfloat16")
  loaded, _ = load_checkpoint(str(tmp_path), fmt="hf", param_dtype="float32")
  want = jax.tree_util.tree_map(lambda x: np.asarray(x.astype("bfloat16").astype("float32")),
                                params)
  jax.tree_util.tree_map(lambda a, b: (np.testing.assert_array_equal(a, b),
                                       assert_dtype(a)), loaded, want)


def assert_dtype(x):
  assert x.dtype == np.float32


def test_hf_errors(hf_dir, tmp_path):
  version, _, path = hf_dir
  with open(os.path.join(path, "config.json")) as f:
    hf_cfg = json.load(f)
  # A config with an extra layer: the weights for block 2 are missing.
  bad = tmp_path / "bad"
  bad.mkdir()
  os.symlink(os.path.join(path, "model.safetensors"), bad / "model.safetensors")
  (bad / "config.json").write_text(json.dumps(dict(hf_cfg, num_layers=3)))
  with pytest.raises(CheckpointError, match=r"missing .*encoder\.block\.2"):
    load_checkpoint(str(bad), fmt="hf")
  # A wrong vocabulary.
  (bad / "config.json").write_text(json.dumps(dict(hf_cfg, vocab_size=VOCAB + 8)))
  with pytest.raises(CheckpointError, match=r"vocab.*\(64, 32\).*vocab_size=72"):
    load_checkpoint(str(bad), fmt="hf")
  # An unsupported activation.
  with pytest.raises(CheckpointError, match="feed_forward_proj"):
    hf_config_to_t5(dict(hf_cfg, feed_forward_proj="gated-silu"))
