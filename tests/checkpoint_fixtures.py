"""Checkpoint writers shared by tests/test_checkpoints.py and the sharded
loading worker (tests/sharded_checkpoints_worker.py): T5X legacy (msgpack +
zarr) and T5X orbax checkpoints built from a parameter tree."""

from __future__ import annotations

import os

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import serialization

from specdec_jax.checkpoints.common import flatten, unflatten

# Stored as bfloat16 zarr in the T5X fixture (T5X may write bf16 arrays).
BF16_LEAF = "decoder/layers_1/mlp/wo/kernel"
# Stored inline in the msgpack file (T5X does so for small arrays).
INLINE_LEAVES = ("encoder/encoder_norm/scale", "decoder/relpos_bias/rel_embedding")


def bf16_round(x):
  return np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)


def write_zarr(step_dir: str, rel: str, arr: np.ndarray, dtype: str) -> dict:
  """Writes arr under step_dir/rel; returns the zarr metadata T5X would record."""
  metadata = {"shape": list(arr.shape), "chunks": list(arr.shape),
              "dtype": dtype, "compressor": {"id": "gzip", "level": 1}}
  store = ts.open({"driver": "zarr", "metadata": metadata,
                   "kvstore": {"driver": "file", "path": os.path.join(step_dir, rel)}},
                  create=True).result()
  store.write(arr.astype(store.dtype.numpy_dtype)).result()
  return metadata


def write_t5x_legacy(step_dir: str, params: dict, extra: dict | None = None,
                     drop: tuple = ()) -> dict:
  """A T5X msgpack checkpoint; returns the expected (bf16-rounded) float32 tree.

  Leaves alternate between the old spec (path at the top level) and the newer
  one (a kvstore naming GCS, which the loader must remap to the local step
  directory); ``INLINE_LEAVES`` are inline arrays and ``BF16_LEAF`` bfloat16.
  """
  os.makedirs(step_dir)
  flat = flatten(params)
  flat.update(extra or {})
  target, expected = {}, {}
  for i, (name, arr) in enumerate(sorted(flat.items())):
    if name in drop:
      continue
    rel = "target." + name.replace("/", ".")
    expected[name] = np.asarray(arr, np.float32)
    if name in INLINE_LEAVES:
      target[name] = arr
    elif name == BF16_LEAF:
      meta = write_zarr(step_dir, rel, arr, "bfloat16")
      target[name] = {"driver": "zarr", "dtype": "bfloat16", "metadata": meta,
                      "kvstore": {"driver": "file", "path": rel}}
      expected[name] = bf16_round(arr)
    elif i % 2:  # old spec: path at the top level
      meta = write_zarr(step_dir, rel, arr, "<f4")
      target[name] = {"driver": "zarr", "path": rel, "metadata": meta}
    else:  # newer spec: kvstore (written on GCS; must be remapped to the local dir)
      meta = write_zarr(step_dir, rel, arr, "<f4")
      target[name] = {"driver": "zarr", "metadata": meta,
                      "kvstore": {"driver": "gcs", "bucket": "some-bucket", "path": rel}}
  # Optimizer state: its specs point to arrays that do not exist, so reading
  # any of them would fail the test.
  param_states = {n.replace("/", "."): {"driver": "zarr", "kvstore": {
      "driver": "file", "path": "state.param_states." + n.replace("/", ".")}}
                  for n in list(flat)[:3]}
  state = {"version": 3, "optimizer": {
      "target": unflatten(target),
      "state": {"step": np.int32(100), "param_states": param_states,
                "inline_moment": np.ones((3,), np.float32)}}}
  with open(os.path.join(step_dir, "checkpoint"), "wb") as f:
    f.write(serialization.msgpack_serialize(state))
  return unflatten(expected)


def write_t5x_orbax(model_dir: str, params: dict, step: int = 7) -> None:
  """A T5X orbax checkpoint ``model_dir/checkpoint_<step>/state`` with optimizer state."""
  state = {"target": params,
           "state": {"step": np.int32(step),
                     "param_states": jax.tree_util.tree_map(np.zeros_like, params)}}
  ocp.PyTreeCheckpointer().save(os.path.join(model_dir, f"checkpoint_{step}", "state"), state)


def random_params(config, seed: int) -> dict:
  """Random weights of ``config``'s T5 tree, drawn with numpy (no compilation):
  norm scales 1, the embedding N(0, 1), every kernel N(0, 1/fan_in)."""
  from specdec_jax.models.t5 import param_shapes  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  out = {}
  for name, leaf in flatten(param_shapes(config)).items():
    if name.endswith("/scale"):
      out[name] = np.ones(leaf.shape, np.float32)
    else:
      std = 1.0 if name == "token_embedder/embedding" else leaf.shape[0] ** -0.5
      out[name] = (std * rng.standard_normal(leaf.shape)).astype(np.float32)
  return unflatten(out)
