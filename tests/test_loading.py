"""Loading at scale: each chunk fetched once per host, arrays placed several at
a time, a gs:// checkpoint directory listed once, and T5X's msgpack found in
``state/``.

The Cloud Storage part runs in one subprocess with 8 CPU devices
(tests/loading_worker.py) against an emulator started here that logs every
download and listing (tests/gcs_emulator.py); the assertions are made here.
The rest runs in this process on fakes and local files.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_fixtures import write_t5x_legacy, write_t5x_orbax

from specdec_jax.checkpoints import (CheckpointError, detect_format, expected_shapes,
                                     load_checkpoint, placement)
from specdec_jax.checkpoints.common import flatten, unflatten
from specdec_jax.models.t5 import T5Config

REPO = Path(__file__).resolve().parent.parent
MESHES = ("one_device", "1x8", "2x4")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  """tests/loading_worker.py's report (8 CPU devices, one subprocess)."""
  pytest.importorskip("gcp_storage_emulator")
  import gcs_emulator
  out = tmp_path_factory.mktemp("loading")
  requests = out / "requests.jsonl"
  with gcs_emulator.running(out / "emulator.log", requests) as host:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", STORAGE_EMULATOR_HOST=host)
    res = subprocess.run([sys.executable, str(REPO / "tests" / "loading_worker.py"), str(out),
                          str(requests)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
  assert res.returncode == 0, res.stderr[-4000:]
  return json.loads((out / "report.json").read_text())


def loads(report, fmt: str) -> dict:
  got = {r["mesh"]: r for r in report["loads"] if r["fmt"] == fmt}
  assert set(got) == set(MESHES), fmt
  return got


@pytest.mark.parametrize("fmt", ["t5x", "t5x_state"])
def test_t5x_objects_are_served_once_on_every_mesh(report, fmt):
  """Every object of the checkpoint (msgpack, zarr metadata, one chunk per
  array) is downloaded exactly once, whole, whether 1, 4 or 8 devices hold
  slices of the arrays: the bytes served equal the bytes stored."""
  assert report["devices"] == 8
  for mesh, r in loads(report, fmt).items():
    assert r["error"] is None and r["mismatches"] == [], (fmt, mesh, r["error"])
    assert r["served"] == r["stored"], (fmt, mesh)


def test_orbax_array_data_is_served_once_on_every_mesh(report):
  """Orbax packs the arrays into a few OCDBT data files (parameters and
  optimizer state together): the byte ranges of the parameters are served
  at most once (never more than the file holds), the same bytes on 8 devices
  as on one. Small metadata (the manifest, the b-tree root) is not counted
  here: the emulator answers TensorStore's revalidations in full."""
  got = loads(report, "t5x_orbax")
  data = sorted(o for o in got["one_device"]["stored"] if "/ocdbt.process_" in o and "/d/" in o)
  assert data
  for mesh, r in got.items():
    assert r["error"] is None and r["mismatches"] == [], (mesh, r["error"])
    for obj in data:
      assert r["served"].get(obj, 0) <= r["stored"][obj], (mesh, obj)
      assert r["served"].get(obj, 0) == got["one_device"]["served"].get(obj, 0), (mesh, obj)
  assert sum(got["one_device"]["served"].get(o, 0) for o in data) > 0


@pytest.mark.parametrize("fmt", ["t5x", "t5x_state", "t5x_orbax"])
def test_checkpoint_directory_is_listed_once(report, fmt):
  for mesh, r in loads(report, fmt).items():
    assert len(r["lists"]) == 1, (fmt, mesh, r["lists"])
    prefix, start, _ = r["lists"][0]
    assert f"loading/{fmt}/" in (prefix, start), (fmt, mesh, r["lists"])


# ------------------------------------------------------------ chunked reads, in memory


def chunk_cells(shape, chunks):
  """Every chunk of the grid, as (start, stop) per dimension."""
  axes = [[(i, min(i + c, n)) for i in range(0, n, c)] for n, c in zip(shape, chunks)]
  return list(itertools.product(*axes))


def inside(inner, outer) -> bool:
  return all(o0 <= i0 and i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer))


def overlaps(a, b) -> bool:
  return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


@pytest.mark.parametrize("box,chunks,block_bytes", [
    (((0, 10), (0, 12)), (4, 5), 4 * 4 * 5),           # one chunk per block
    (((0, 10), (0, 12)), (4, 5), 4 * 4 * 12),          # a row of chunks per block
    (((3, 9), (2, 11)), (4, 5), 4 * 8),                # box not on the grid; chunk > budget
    (((0, 64), (0, 64)), (64, 64), 4 * 16),            # one chunk bigger than the budget
    (((0, 7), (0, 6), (0, 5)), (2, 3, 0), 4 * 30),     # 0: the dimension is not chunked
])
def test_chunk_blocks_hold_each_chunk_once(box, chunks, block_bytes):
  blocks = placement.chunk_blocks(box, chunks, 4, block_bytes)
  shape = [hi for _, hi in box]
  grid = [c or n for c, n in zip(chunks, shape)]
  cells = [c for c in chunk_cells(shape, grid) if overlaps(c, box)]
  # The blocks tile the box ...
  assert sum(np.prod([hi - lo for lo, hi in b]) for b in blocks) == np.prod(
      [hi - lo for lo, hi in box])
  assert all(inside(b, box) for b in blocks)
  # ... and every chunk meeting the box lies in exactly one of them.
  for cell in cells:
    clipped = tuple((max(lo, b0), min(hi, b1)) for (lo, hi), (b0, b1) in zip(cell, box))
    assert sum(inside(clipped, b) for b in blocks) == 1, cell
    assert sum(overlaps(clipped, b) for b in blocks) == 1, cell
  one_chunk = 4 * np.prod([min(g, hi - lo) for g, (lo, hi) in zip(grid, box)])
  assert max(4 * np.prod([hi - lo for lo, hi in b]) for b in blocks) <= max(block_bytes,
                                                                           one_chunk)


def test_slices_are_cut_from_chunks_read_once():
  """Four column slices of an array stored in 4 x 5 chunks: each slice
  straddles chunks, yet every chunk is read once, and each slice is exact
  (and cast, as placement casts)."""
  source = np.arange(10 * 12, dtype=np.float32).reshape(10, 12) / 7
  reads = []

  def read(index):
    reads.append(placement.index_box(index, source.shape))
    return source[index]

  reader = placement.ChunkedReader(read, (4, 5), source.dtype)
  boxes = [((0, 10), (3 * i, 3 * i + 3)) for i in range(4)]
  with placement.count_reads() as stats:
    slices = placement._assemble("w", boxes, reader, np.dtype(jnp.bfloat16))
  for (rows, cols), got in slices.items():
    np.testing.assert_array_equal(got, source[slice(*rows), slice(*cols)].astype(jnp.bfloat16))
  for cell in chunk_cells(source.shape, (4, 5)):
    assert sum(overlaps(cell, r) for r in reads) == 1, (cell, reads)
  # count_reads still sees one read per distinct slice, in the stored dtype.
  assert stats.reads == 4 and stats.total_bytes == source.nbytes


# ------------------------------------------------------------ arrays in flight


def test_arrays_are_placed_concurrently_with_a_bound():
  """With in_flight=4 the first four arrays are read at the same time (a
  barrier that four readers must reach together; one at a time would time
  out), never more than four at once, and the tree equals a one-at-a-time load."""
  cfg = T5Config(vocab_size=32, d_model=8, num_heads=2, head_dim=4, num_encoder_layers=1,
                 num_decoder_layers=1, d_ff=16)
  rng = np.random.default_rng(1)
  arrays = {n: rng.standard_normal(s, dtype=np.float32) for n, s in expected_shapes(cfg).items()}
  assert len(arrays) > 8
  barrier = threading.Barrier(4, timeout=20)
  lock, active, peak, first = threading.Lock(), [0], [0], set()

  def open_reader(name):
    def read(index):
      with lock:
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        wait = len(first) < 4 and name not in first
        first.add(name)
      if wait:
        barrier.wait()
      time.sleep(0.01)
      with lock:
        active[0] -= 1
      return arrays[name][index]
    return read

  sources = {n: placement.ArraySource(a.shape, functools.partial(open_reader, n))
             for n, a in arrays.items()}
  got = placement.place_arrays(sources, "float32", None, in_flight=4)
  assert not barrier.broken and peak[0] == 4
  one_at_a_time = placement.place_arrays(sources, "float32", None, in_flight=1)
  for name, x in flatten(got).items():
    np.testing.assert_array_equal(np.asarray(x), arrays[name])
    np.testing.assert_array_equal(np.asarray(x), np.asarray(flatten(one_at_a_time)[name]))


def test_a_failing_array_fails_the_load():
  """An error in one of the arrays in flight is the load's error."""
  def broken(index):
    raise ValueError("corrupt chunk in decoder/logits_dense/kernel")

  sources = {f"encoder/layers_{i}/mlp/wo/kernel": placement.ArraySource(
      (4, 4), lambda: (lambda index: np.zeros((4, 4), np.float32))) for i in range(6)}
  sources["decoder/logits_dense/kernel"] = placement.ArraySource((4, 4), lambda: broken)
  with pytest.raises(ValueError, match="corrupt chunk in decoder/logits_dense/kernel"):
    placement.place_arrays(sources, "float32", None, in_flight=3)


# ------------------------------------------------------------ T5X's msgpack in state/


def test_t5x_msgpack_in_state_is_t5x_legacy(tmp_path):
  """T5X's restore reads ``checkpoint_<step>/state/checkpoint`` when ``state/``
  exists and takes it for its own format unless orbax's ``_METADATA`` is
  beside it; its TensorStore paths are relative to ``state/``."""
  cfg = T5Config(vocab_size=32, d_model=8, num_heads=2, head_dim=4, num_encoder_layers=1,
                 num_decoder_layers=1, d_ff=16)
  rng = np.random.default_rng(2)
  params = unflatten({n: rng.standard_normal(s, dtype=np.float32)
                      for n, s in expected_shapes(cfg).items()})
  model_dir = tmp_path / "t5x"
  step_dir = model_dir / "checkpoint_5"
  expected = flatten(write_t5x_legacy(str(step_dir / "state"), params))
  (step_dir / "train_ds-000-of-001").write_bytes(b"")  # T5X's dataset checkpoint beside it
  assert detect_format(str(model_dir)) == "t5x"
  assert detect_format(str(step_dir)) == "t5x"
  for path in (model_dir, step_dir, step_dir / "state" / "checkpoint"):
    loaded, _ = load_checkpoint(str(path), config=cfg)
    for name, x in flatten(loaded).items():
      np.testing.assert_array_equal(np.asarray(x), expected[name], err_msg=f"{path} {name}")
  # An orbax ``state/`` (with _METADATA) is still orbax's.
  write_t5x_orbax(str(tmp_path / "orbax"), params)
  assert detect_format(str(tmp_path / "orbax")) == "t5x_orbax"


def test_a_string_leaf_in_the_msgpack_is_named(tmp_path):
  """Orbax once wrote its own msgpack ``checkpoint`` with placeholder strings
  for arrays stored apart; read as T5X's format, that is one clear line."""
  from flax import serialization
  state_dir = tmp_path / "checkpoint_3" / "state"
  state_dir.mkdir(parents=True)
  tree = {"target": {"decoder": {"logits_dense": {
      "kernel": "PLACEHOLDER://target.decoder.logits_dense.kernel"}}}}
  (state_dir / "checkpoint").write_bytes(serialization.msgpack_serialize(tree))
  with pytest.raises(CheckpointError, match=r"state/checkpoint: parameter "
                     r"decoder/logits_dense/kernel is the string 'PLACEHOLDER://"):
    load_checkpoint(str(tmp_path), config=T5Config())
