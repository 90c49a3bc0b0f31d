"""Checkpoint formats: T5X legacy (msgpack + zarr), T5X orbax, our own, errors."""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest
from checkpoint_fixtures import bf16_round, write_t5x_legacy, write_t5x_orbax

from specdec_jax.checkpoints import (CheckpointError, CheckpointExistsError,
                                     CheckpointNotFoundError, common, detect_format,
                                     load_checkpoint, save_checkpoint, t5x_legacy)
from specdec_jax.models.t5 import T5Config, T5Model

from lab.hf_export import export_hf

needs_safetensors = pytest.mark.skipif(importlib.util.find_spec("safetensors") is None,
                                       reason="the hf extra (safetensors) is not installed")

CFG = T5Config(vocab_size=64, d_model=32, num_heads=2, head_dim=8, num_encoder_layers=2,
               num_decoder_layers=2, d_ff=48)


@pytest.fixture(scope="module")
def params():
  return jax.tree_util.tree_map(np.asarray, T5Model(CFG).init(jax.random.PRNGKey(0)))


def assert_trees_equal(got, want):
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree_util.tree_leaves(want)):
    assert g.dtype == np.float32, path
    np.testing.assert_array_equal(np.asarray(g), w, err_msg=str(path))


# ------------------------------------------------------------ T5X legacy


@pytest.fixture(scope="module")
def t5x_dir(params, tmp_path_factory):
  """A model dir with an older, corrupt checkpoint_20 and a good checkpoint_100."""
  model_dir = tmp_path_factory.mktemp("t5x")
  os.makedirs(model_dir / "checkpoint_20")
  (model_dir / "checkpoint_20" / "checkpoint").write_bytes(b"\xc1garbage")
  os.makedirs(model_dir / "checkpoint_100.tmp-123")  # an unfinished save
  expected = write_t5x_legacy(str(model_dir / "checkpoint_100"), params)
  return str(model_dir), expected


def test_t5x_legacy_loads_identical(t5x_dir):
  model_dir, expected = t5x_dir
  for path in (model_dir, os.path.join(model_dir, "checkpoint_100"),
               os.path.join(model_dir, "checkpoint_100", "checkpoint")):
    loaded, config = load_checkpoint(path, fmt="t5x", config=CFG)
    assert config == CFG
    assert_trees_equal(loaded, expected)
  assert detect_format(model_dir) == "t5x"
  assert detect_format(os.path.join(model_dir, "checkpoint_100")) == "t5x"


def test_t5x_legacy_bfloat16_params(t5x_dir):
  """Kernels and the embedding take param_dtype; norm scales and rel_embedding stay f32."""
  loaded, _ = load_checkpoint(t5x_dir[0], config=CFG, param_dtype="bfloat16")
  expected = t5x_dir[1]
  for path, x in jax.tree_util.tree_leaves_with_path(loaded):
    name = "/".join(k.key for k in path)
    want = expected
    for k in path:
      want = want[k.key]
    if name.endswith("/scale") or name.endswith("/rel_embedding"):
      assert x.dtype == np.float32, name
      np.testing.assert_array_equal(np.asarray(x), want, err_msg=name)
    else:
      assert x.dtype == jax.numpy.bfloat16, name
      np.testing.assert_array_equal(np.asarray(x, np.float32), bf16_round(want), err_msg=name)


def test_t5x_requires_config(t5x_dir):
  with pytest.raises(CheckpointError, match="pass config="):
    load_checkpoint(t5x_dir[0])


def test_t5x_corrupt_and_missing_msgpack(t5x_dir, tmp_path):
  bad = os.path.join(t5x_dir[0], "checkpoint_20")
  with pytest.raises(CheckpointError, match=f"{bad}/checkpoint: corrupt msgpack"):
    load_checkpoint(bad, fmt="t5x", config=CFG)
  os.makedirs(tmp_path / "checkpoint_5")
  with pytest.raises(CheckpointNotFoundError, match=f"{tmp_path}/checkpoint_5/checkpoint"):
    load_checkpoint(str(tmp_path), fmt="t5x", config=CFG)


def test_t5x_unknown_and_missing_params(params, tmp_path):
  write_t5x_legacy(str(tmp_path / "extra"), params,
                   extra={"encoder/layers_0/attention/bias": np.zeros(3, np.float32)},
                   drop=("decoder/layers_0/mlp/wi_1/kernel",))
  with pytest.raises(CheckpointError) as e:
    load_checkpoint(str(tmp_path / "extra"), fmt="t5x", config=CFG)
  msg = str(e.value)
  assert str(tmp_path / "extra") in msg
  assert "unknown 1 parameter(s): encoder/layers_0/attention/bias" in msg
  assert "missing 1 parameter(s): decoder/layers_0/mlp/wi_1/kernel" in msg


def test_t5x_shape_and_vocab_mismatch(t5x_dir):
  with pytest.raises(CheckpointError,
                     match=r"mlp/wi_0/kernel has shape \(32, 48\).*expects \(32, 40\)"):
    load_checkpoint(t5x_dir[0], config=CFG.replace(d_ff=40))
  with pytest.raises(CheckpointError, match=r"vocab size mismatch: token_embedder/embedding "
                     r"has shape \(64, 32\).*config.vocab_size=128"):
    load_checkpoint(t5x_dir[0], config=CFG.replace(vocab_size=128))
  with pytest.raises(CheckpointError, match="missing .* parameter"):
    load_checkpoint(t5x_dir[0], config=CFG.replace(num_decoder_layers=3))


# ------------------------------------------------------------ T5X orbax fixture


@pytest.fixture(scope="module")
def t5x_orbax_dir(params, tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("t5x_orbax")
  write_t5x_orbax(str(model_dir), params, step=7)
  return str(model_dir)


def test_t5x_orbax_loads_identical(params, t5x_orbax_dir):
  for path in (t5x_orbax_dir, os.path.join(t5x_orbax_dir, "checkpoint_7")):
    loaded, _ = load_checkpoint(path, fmt="t5x_orbax", config=CFG)
    assert_trees_equal(loaded, params)
    assert detect_format(path) == "t5x_orbax"
  loaded, _ = load_checkpoint(t5x_orbax_dir, config=CFG)  # auto
  assert_trees_equal(loaded, params)
  half, _ = load_checkpoint(t5x_orbax_dir, config=CFG, param_dtype="bfloat16")
  leaf = half["decoder"]["layers_0"]["mlp"]["wo"]["kernel"]
  assert leaf.dtype == jax.numpy.bfloat16
  np.testing.assert_array_equal(np.asarray(leaf, np.float32),
                                bf16_round(params["decoder"]["layers_0"]["mlp"]["wo"]["kernel"]))


def test_t5x_orbax_shape_mismatch(t5x_orbax_dir):
  with pytest.raises(CheckpointError, match="vocab size mismatch"):
    load_checkpoint(t5x_orbax_dir, config=CFG.replace(vocab_size=32))


# ------------------------------------------------------------ our own format


def test_own_format_round_trip(params, tmp_path):
  path = str(tmp_path / "ours")
  save_checkpoint(path, params, CFG)
  assert detect_format(path) == "specdec"
  loaded, config = load_checkpoint(path)
  assert config == CFG
  assert_trees_equal(loaded, params)
  with open(os.path.join(path, "config.json")) as f:
    assert json.load(f)["d_ff"] == CFG.d_ff


def test_own_format_bf16_on_disk(params, tmp_path):
  path = str(tmp_path / "bf16")
  save_checkpoint(path, params, CFG, dtype="bfloat16")
  meta = common.orbax_metadata_tree(os.path.join(path, "params"))
  assert meta["token_embedder"]["embedding"].dtype == jax.numpy.bfloat16
  loaded, _ = load_checkpoint(path, fmt="specdec")
  assert_trees_equal(loaded, jax.tree_util.tree_map(bf16_round, params))


def test_own_format_overwrite_and_config_checks(params, tmp_path):
  path = str(tmp_path / "ours")
  save_checkpoint(path, params, CFG)
  with pytest.raises(CheckpointExistsError, match=f"{path} exists and is not empty"):
    save_checkpoint(path, params, CFG)
  doubled = jax.tree_util.tree_map(lambda x: 2 * x, params)
  save_checkpoint(path, doubled, CFG, overwrite=True)
  loaded, config = load_checkpoint(path, config=CFG.replace(dtype="bfloat16"))
  assert config.dtype == "bfloat16"  # activation dtype may be overridden
  assert_trees_equal(loaded, doubled)
  with pytest.raises(CheckpointError, match="d_ff: checkpoint 48 vs given 40"):
    load_checkpoint(path, config=CFG.replace(d_ff=40))
  with pytest.raises(CheckpointError, match="wi_0/kernel has shape"):
    save_checkpoint(str(tmp_path / "other"), params, CFG.replace(d_ff=40))


# ------------------------------------------------------------ detection, paths


@needs_safetensors
def test_detect_hf_and_errors(params, tmp_path):
  export_hf(params, CFG, str(tmp_path / "hf"))
  assert detect_format(str(tmp_path / "hf")) == "hf"
  missing = str(tmp_path / "nope")
  with pytest.raises(CheckpointNotFoundError, match=f"{missing} does not exist"):
    load_checkpoint(missing)
  (tmp_path / "junk").mkdir()
  (tmp_path / "junk" / "readme.txt").write_text("hi")
  with pytest.raises(CheckpointError, match="cannot detect .*readme.txt"):
    load_checkpoint(str(tmp_path / "junk"))
  with pytest.raises(ValueError, match="unknown checkpoint format"):
    load_checkpoint(str(tmp_path / "hf"), fmt="npz")


def test_resolve_ts_spec_paths():
  local = t5x_legacy.resolve_ts_spec({"driver": "zarr", "path": "target.a"}, "/ckpt/checkpoint_1")
  assert local["kvstore"] == {"driver": "file", "path": "/ckpt/checkpoint_1/target.a"}
  gcs = t5x_legacy.resolve_ts_spec(
      {"driver": "zarr", "kvstore": {"driver": "file", "path": "target.a"}},
      "gs://bucket/model/checkpoint_1")
  assert gcs["kvstore"] == {"driver": "gcs", "bucket": "bucket",
                            "path": "model/checkpoint_1/target.a"}


@needs_safetensors
def test_hf_unknown_tensor(params, tmp_path):
  from safetensors.numpy import load_file, save_file
  path = tmp_path / "hf"
  export_hf(params, CFG, str(path))
  tensors = load_file(str(path / "model.safetensors"))
  tensors["encoder.block.0.layer.0.SelfAttention.q.bias"] = np.zeros(16, np.float32)
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(CheckpointError,
                     match=f"{path}: .*unknown 1 tensor.*SelfAttention.q.bias"):
    load_checkpoint(str(path))
