"""Run in a subprocess with 8 CPU devices by tests/test_loading.py, against the
Cloud Storage emulator that test started (STORAGE_EMULATOR_HOST).

Writes a T5X legacy (msgpack + zarr, one chunk per array, as T5X writes any
array under 64 MiB), the same with its files in ``checkpoint_<step>/state/``,
and a T5X orbax checkpoint of one tiny random T5, uploads each to the
emulator, and loads each from gs:// onto one device and onto meshes (1, 8)
XX
Usage: python tests/loading_worker.py OUT_DIR REQUESTS_LOG
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # test helpers

import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from checkpoint_fixtures import write_t5x_legacy, write_t5x_orbax  # noqa: E402
from gcs_emulator import BUCKET, read_requests  # noqa: E402

from specdec_jax import partitioning, storage  # noqa: E402
from specdec_jax.checkpoints import expected_shapes, load_checkpoint  # noqa: E402
from specdec_jax.checkpoints.common import flatten, unflatten  # noqa: E402
from specdec_jax.models.t5 import T5Config  # noqa: E402

# 8 heads x 4 = d_model 32, vocab 64, d_ff 64: every dimension the standard
# rules shard divides 8.
CFG = T5Config(vocab_size=64, d_model=32, num_heads=8, head_dim=4, num_encoder_layers=1,
               num_decoder_layers=1, d_ff=64)
MESHES = {"1x8": (1, 8), "2x4": (2, 4)}


def upload(local: Path, url: str) -> dict[str, int]:
  """Every file under ``local`` to ``url``; {object name: bytes}."""
  _, prefix = storage.split(url)
  stored = {}
  for f in sorted(p for p in local.rglob("*") if p.is_file()):
    rel = f.relative_to(local).as_posix()
    storage.write_bytes(storage.join(url, rel), f.read_bytes())
    stored[f"{prefix}/{rel}"] = f.stat().st_size
  return stored


def same(loaded: dict, reference: dict, part) -> list[str]:
  """Names missing, differing from ``reference`` or not in their sharding."""
  flat = flatten(loaded)
  bad = sorted(set(reference) ^ set(flat))
  for name, x in flat.items():
    want = (jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if part is None
            else part.param_sharding(name, x.shape))
    if (name not in reference or not x.sharding.is_equivalent_to(want, x.ndim)
        or not np.array_equal(np.asarray(x), np.asarray(reference[name]))):
      bad.append(name)
  return bad


def main(out_dir: str, requests_log: str) -> None:
  assert jax.device_count() == 8, jax.devices()  # XLA_FLAGS must precede jax's import
  rng = np.random.default_rng(0)
  params = unflatten({n: rng.standard_normal(s, dtype=np.float32)
                      for n, s in expected_shapes(CFG).items()})
  root = Path(out_dir)
  # The values each checkpoint holds (T5X's fixture stores one array in bfloat16).
  expected = {
      "t5x": write_t5x_legacy(str(root / "t5x" / "checkpoint_100"), params),
      "t5x_state": write_t5x_legacy(str(root / "t5x_state" / "checkpoint_100" / "state"),
                                    params),
      "t5x_orbax": params}
  write_t5x_orbax(str(root / "t5x_orbax"), params)
  report = {"devices": jax.device_count(), "loads": []}
  for fmt, values in expected.items():
    url = f"gs://{BUCKET}/loading/{fmt}"
    stored = upload(root / fmt, url)
    reference = flatten(values)
    for mesh, shape in [("one_device", None), *MESHES.items()]:
      part = None if shape is None else partitioning.Partitioner(partitioning.make_mesh(shape))
      start, t0 = len(read_requests(requests_log)), time.perf_counter()
      try:
        loaded, error = load_checkpoint(url, config=CFG, partitioner=part)[0], None
      except Exception as e:  # pylint: disable=broad-except  (reported, asserted on)
        loaded, error = {}, f"{type(e).__name__}: {e}"
      seconds = time.perf_counter() - t0
      served: dict[str, int] = {}
      lists = []
      for r in read_requests(requests_log, start):
        if r["op"] == "download":
          served[r["object"]] = served.get(r["object"], 0) + r["bytes"]
        else:
          lists.append([r["prefix"], r["start"], r["end"]])
      report["loads"].append(dict(fmt=fmt, mesh=mesh, stored=stored, served=served,
                                  lists=lists, error=error, seconds=seconds,
                                  mismatches=same(loaded, reference, part)))
  with open(os.path.join(out_dir, "report.json"), "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
