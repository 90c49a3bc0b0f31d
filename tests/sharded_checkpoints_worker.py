"""Run in a subprocess with 8 CPU devices by tests/test_sharded_checkpoints.py.

Writes one tiny random T5 in every checkpoint format (T5X TensorStore, T5X
orbax, ours, HF safetensors in float32 and bfloat16, pytorch_model.bin),
loads each onto meshes (1, 8) and (2, 4) in float32 and bfloat16 (and once
without a partitioner), and records what the test asserts
on: whether values match the source, dtypes, sharding specs, per-device shard
shapes, and the bytes the slice readers returned. Then loads a deeper model
(total bytes >> its largest array) from the TensorStore and safetensors
checkpoints under tracemalloc and records the peak host allocation.
Usage: python tests/sharded_checkpoints_worker.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # checkpoint_fixtures

import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from checkpoint_fixtures import (BF16_LEAF, bf16_round, write_t5x_legacy,  # noqa: E402
                                 write_t5x_orbax)

from specdec_jax import partitioning  # noqa: E402
from specdec_jax.checkpoints import (count_reads, expected_shapes,  # noqa: E402
                                     load_checkpoint, placement, save_checkpoint)
from specdec_jax.checkpoints.common import flatten, unflatten  # noqa: E402
from specdec_jax.models.t5 import T5Config  # noqa: E402

from lab.hf_export import export_hf  # noqa: E402

# 8 heads, vocab 64, d_ff 64, d_model 32 = 8 heads x 4: every dimension the
# standard rules shard divides 8.
SMALL = T5Config(vocab_size=64, d_model=32, num_heads=8, head_dim=4, num_encoder_layers=2,
                 num_decoder_layers=2, d_ff=64)
# For the peak-memory check: the MLP kernels (64 x 1024 float32, 256 KiB) are
# the largest arrays; 6 + 6 layers make the model about 40 times larger.
DEEP = T5Config(vocab_size=256, d_model=64, num_heads=8, head_dim=8, num_encoder_layers=6,
                num_decoder_layers=6, d_ff=1024)
MESHES = {"1x8": (1, 8), "2x4": (2, 4)}


def init(config: T5Config, seed: int) -> dict:
  """Random float32 parameters of the config's shapes (numpy: no init to compile)."""
  rng = np.random.default_rng(seed)
  return unflatten({n: rng.standard_normal(s, dtype=np.float32)
                    for n, s in expected_shapes(config).items()})


def write_all(root: str, params: dict, config: T5Config, formats: tuple) -> dict:
  """{fmt: (path, fmt, config to pass, expected float32 tree, source bytes per name)}."""
  flat = flatten(params)
  f32_bytes = {n: int(a.size) * 4 for n, a in flat.items()}
  out = {}
  if "t5x" in formats:
    path = os.path.join(root, "t5x")
    expected = write_t5x_legacy(os.path.join(path, "checkpoint_100"), params)
    out["t5x"] = (path, "t5x", config, flatten(expected),
                  {n: b // 2 if n == BF16_LEAF else b for n, b in f32_bytes.items()})
  if "t5x_orbax" in formats:
    path = os.path.join(root, "t5x_orbax")
    write_t5x_orbax(path, params)
    out["t5x_orbax"] = (path, "t5x_orbax", config, flat, f32_bytes)
  if "specdec" in formats:
    path = os.path.join(root, "specdec")
    save_checkpoint(path, params, config)
    out["specdec"] = (path, "specdec", None, flat, f32_bytes)
  if "hf" in formats:
    path = os.path.join(root, "hf")
    export_hf(params, config, path)
    out["hf"] = (path, "hf", None, flat, f32_bytes)
  if "hf_bf16" in formats:  # bfloat16 safetensors: sliced from a memmap
    path = os.path.join(root, "hf_bf16")
    export_hf(params, config, path, dtype="bfloat16")
    out["hf_bf16"] = (path, "hf", None, {n: bf16_round(a) for n, a in flat.items()},
                      {n: b // 2 for n, b in f32_bytes.items()})
  if "hf_bin" in formats:
    try:
      import torch
      from safetensors.torch import load_file
    except ImportError:
      return out
    path = os.path.join(root, "hf_bin")
    os.makedirs(path)
    torch.save(load_file(os.path.join(root, "hf", "model.safetensors")),
               os.path.join(path, "pytorch_model.bin"))
    with open(os.path.join(root, "hf", "config.json")) as src, \
        open(os.path.join(path, "config.json"), "w") as dst:
      dst.write(src.read())
    out["hf_bin"] = (path, "hf", None, flat, f32_bytes)
  return out


def describe(loaded: dict, expected: dict, param_dtype: str) -> dict:
  """Per-parameter facts the test checks."""
  rec = {"mismatches": [], "dtypes": {}, "specs": {}, "shard_shapes": {}, "shapes": {},
         "devices": {}}
  for name, x in flatten(loaded).items():
    want = expected[name]
    if x.dtype == np.float32:
      ok = np.array_equal(np.asarray(x), want)
    else:  # bfloat16: the source value rounded once
      ok = np.array_equal(np.asarray(x, np.float32), bf16_round(want))
    if not ok:
      rec["mismatches"].append(name)
    rec["dtypes"][name] = str(x.dtype)
    rec["shapes"][name] = list(x.shape)
    spec = getattr(x.sharding, "spec", None)
    rec["specs"][name] = None if spec is None else [
        p if p is None or isinstance(p, str) else list(p) for p in spec]
    rec["shard_shapes"][name] = [list(s.data.shape) for s in x.addressable_shards]
    rec["devices"][name] = len({s.device.id for s in x.addressable_shards})
  return rec


def sharded_loads(root: str) -> list[dict]:
  formats = ("t5x", "t5x_orbax", "specdec", "hf", "hf_bf16", "hf_bin")
  ckpts = write_all(root, init(SMALL, 0), SMALL, formats)
  records = []
  for mesh_name, mesh_shape in [(None, None)] + list(MESHES.items()):
    part = None if mesh_shape is None else partitioning.Partitioner(
        partitioning.make_mesh(mesh_shape))
    for fmt, (path, load_fmt, config, expected, source_bytes) in ckpts.items():
      for param_dtype in ("float32", "bfloat16"):
        if mesh_shape is None and param_dtype == "bfloat16":
          continue
        with count_reads() as stats:
          loaded, _ = load_checkpoint(path, fmt=load_fmt, config=config,
                                      param_dtype=param_dtype, partitioner=part)
        rec = describe(loaded, expected, param_dtype)
        rec.update(mesh=mesh_name, fmt=fmt, param_dtype=param_dtype,
                   bytes_read=stats.total_bytes, bytes_by_array=stats.bytes_by_array,
                   reads=stats.reads, source_bytes=source_bytes,
                   single_device=str(jax.local_devices()[0]) if part is None else None)
        records.append(rec)
        del loaded
  return records


class PeakTracker:
  """tracemalloc peaks over a load: overall, and per ``placement.place_array`` call.

  On CPU "devices" XLA may alias the host buffer it is given instead of
  copying it, so the numpy slices of arrays already placed can stay
  allocated as the loaded model itself. The per-array peak (relative to the
  allocation when that array starts) separates the transient host memory of
  placing one array from that, and ``retained`` (still allocated when the
  load returns) bounds what the loaded arrays hold.
  """

  def __init__(self):
    self.per_array: dict[str, int] = {}
    self.overall = 0

  def _mark(self) -> int:
    current, peak = tracemalloc.get_traced_memory()
    self.overall = max(self.overall, peak)
    tracemalloc.reset_peak()
    return current

  def wrap(self, place_array):
    def traced(name, *args, **kwargs):
      start = self._mark()
      out = place_array(name, *args, **kwargs)
      self.per_array[name] = tracemalloc.get_traced_memory()[1] - start
      self._mark()
      return out
    return traced


def peak_loads(root: str) -> list[dict]:
  params = init(DEEP, 1)
  ckpts = write_all(root, params, DEEP, ("t5x", "hf"))
  largest = max(a.nbytes for a in flatten(params).values())
  total = sum(a.nbytes for a in flatten(params).values())
  del params
  records = []
  place_array = placement.place_array
  for mesh_name, mesh_shape in MESHES.items():
    part = partitioning.Partitioner(partitioning.make_mesh(mesh_shape))
    for fmt, (path, load_fmt, config, _, source_bytes) in ckpts.items():
      load_checkpoint(path, fmt=load_fmt, config=config, partitioner=part)  # warm jax's caches
      gc.collect()
      tracker = PeakTracker()
      placement.place_array = tracker.wrap(place_array)
      tracemalloc.start()
      try:
        base = tracemalloc.get_traced_memory()[0]
        with count_reads() as stats:
          loaded, _ = load_checkpoint(path, fmt=load_fmt, config=config, partitioner=part)
        retained = tracker._mark() - base
      finally:
        tracemalloc.stop()
        placement.place_array = place_array
      records.append(dict(mesh=mesh_name, fmt=fmt, peak_bytes=tracker.overall - base,
                          retained_bytes=retained,
                          max_array_peak_bytes=max(tracker.per_array.values()),
                          arrays_placed=len(tracker.per_array),
                          largest_array_bytes=largest, model_bytes=total,
                          bytes_read=stats.total_bytes,
                          source_bytes=sum(source_bytes.values()),
                          leaves=len(jax.tree_util.tree_leaves(loaded))))
      del loaded
  return records


def main(out_dir: str) -> None:
  assert jax.device_count() == 8, jax.devices()  # XLA_FLAGS must precede jax's import
  start = time.perf_counter()
  report = {"devices": jax.device_count(),
            "sharded": sharded_loads(os.path.join(out_dir, "small")),
            "peak": peak_loads(os.path.join(out_dir, "deep"))}
  report["seconds"] = time.perf_counter() - start
  with open(os.path.join(out_dir, "report.json"), "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
