"""Checkpoints load straight into shards: every format onto meshes (1, 8) and
(2, 4) of 8 CPU devices, each device's slice read once, host memory bounded.

The loads run in a subprocess (tests/sharded_checkpoints_worker.py) with 8
host devices, so that the rest of the suite keeps its single device; the
worker reports facts as JSON and the assertions are made here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "sharded_checkpoints_worker.py"
MODEL_SIZES = {"1x8": 8, "2x4": 4}
SLICED_FORMATS = ("t5x", "hf", "hf_bf16", "hf_bin")  # read by our slice readers (orbax reads itself)

# Which dimension the standard rules split over 'model' (None: replicated),
# written out here rather than taken from specdec_jax.partitioning.
MODEL_DIM = (
    (r"^token_embedder/embedding$", 0),           # (vocab, embed)
    (r"/(query|key|value)/kernel$", 1),           # (embed, joined_kv)
    (r"/out/kernel$", 0),                         # (joined_kv, embed)
    (r"/mlp/wi(_\d)?/kernel$", 1),                # (embed, mlp)
    (r"/mlp/wo/kernel$", 0),                      # (mlp, embed)
    (r"^decoder/logits_dense/kernel$", 1),        # (embed, vocab)
    (r"/relpos_bias/rel_embedding$", 0),          # (heads, relpos_buckets)
    (r"/scale$", None),                           # (embed,)
)


def model_dim(name: str):
  for pattern, dim in MODEL_DIM:
    if re.search(pattern, name):
      return dim
  raise AssertionError(f"no expected sharding for {name}")


def keeps_float32(name: str) -> bool:
  return name.endswith("/scale") or name.endswith("/rel_embedding")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  out = tmp_path_factory.mktemp("sharded_checkpoints")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                        + " --xla_force_host_platform_device_count=8"))
  res = subprocess.run([sys.executable, str(WORKER), str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-4000:]
  return json.loads((out / "report.json").read_text())


def sharded(report, mesh="any"):
  """The worker's load records; ``mesh`` '1x8', '2x4' or None (no partitioner)."""
  recs = [r for r in report["sharded"] if mesh == "any" or r["mesh"] == mesh]
  assert recs
  return recs


def test_worker_saw_eight_devices_and_every_format(report):
  assert report["devices"] == 8
  seen = {(r["mesh"], r["fmt"], r["param_dtype"]) for r in report["sharded"]}
  for mesh in MODEL_SIZES:
    for fmt in ("t5x", "t5x_orbax", "specdec") + SLICED_FORMATS[1:]:
      for dtype in ("float32", "bfloat16"):
        assert (mesh, fmt, dtype) in seen


def test_values_and_dtypes(report):
  """Exactly the source values; bfloat16 kernels/embedding are the values rounded
  once, while norm scales and rel_embedding stay float32 and exact."""
  for r in sharded(report):
    where = (r["mesh"], r["fmt"], r["param_dtype"])
    assert r["mismatches"] == [], where
    for name, dtype in r["dtypes"].items():
      want = "float32" if keeps_float32(name) else r["param_dtype"]
      assert dtype == want, (where, name)


def test_shardings_follow_the_rules(report):
  for mesh, n in MODEL_SIZES.items():
    for r in sharded(report, mesh):
      where = (mesh, r["fmt"], r["param_dtype"])
      for name, spec in r["specs"].items():
        shape, dim = r["shapes"][name], model_dim(name)
        want = [None] * len(shape)
        if dim is not None:
          want[dim] = "model"
        assert spec + [None] * (len(shape) - len(spec)) == want, (where, name, spec)
        shard = list(shape)
        if dim is not None:
          shard[dim] //= n
        assert r["shard_shapes"][name] == [shard] * 8, (where, name)
        assert r["devices"][name] == 8, (where, name)
  for r in sharded(report, None):  # no partitioner: everything on one device
    for name, shapes in r["shard_shapes"].items():
      assert shapes == [r["shapes"][name]] and r["devices"][name] == 1, (r["fmt"], name)


def test_each_slice_is_read_once(report):
  """The readers return the checkpoint's bytes once in total, not once per
  device: replicated slices are shared, sharded ones partition the array."""
  for r in sharded(report):
    if r["fmt"] not in SLICED_FORMATS:
      continue
    where = (r["mesh"], r["fmt"], r["param_dtype"])
    assert r["bytes_by_array"] == r["source_bytes"], where
    assert r["bytes_read"] == sum(r["source_bytes"].values()), where
    n = MODEL_SIZES.get(r["mesh"], 1)
    distinct = sum(1 if model_dim(name) is None else n for name in r["source_bytes"])
    assert r["reads"] == distinct, where


def test_peak_host_memory_is_about_one_array(report):
  """tracemalloc peak while loading a model ~40x larger than its largest array.

  Placing one array holds its distinct device slices (together at most the
  array, A) plus the raw slice being read and its cast copy (at most A
  between them), so the transient peak is below 2A; SLACK covers Python
  objects (the 144 jax.Array handles, source descriptors, the msgpack tree of
  specs). Reading the whole model, or one copy of a slice per device, would
  exceed the bound many times over. On CPU devices XLA may keep the host
  slices it was given as the device buffers themselves; that memory is the
  loaded model (``retained_bytes``), so the overall peak is bounded above it.
  """
  slack = 256 * 1024
  for r in report["peak"]:
    where = (r["mesh"], r["fmt"])
    bound = 2 * r["largest_array_bytes"] + slack
    assert r["model_bytes"] > 10 * bound, where  # the bound means something
    assert r["arrays_placed"] == r["leaves"] == 144, where
    assert r["max_array_peak_bytes"] < bound, (where, r)
    assert r["peak_bytes"] - r["retained_bytes"] < bound, (where, r)
    assert r["retained_bytes"] <= r["model_bytes"], (where, r)
    assert r["bytes_read"] == r["source_bytes"], where
