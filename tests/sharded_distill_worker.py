"""Run in a subprocess with 8 CPU devices by tests/test_sharded_distill.py.

The same distillation job (micro models, the demo vocabulary, same seed, data
and steps) on one device and on meshes (1, 8) and (2, 4), and on (2, 4) once
more stopped after its first step and resumed. Records what the test asserts
on: per-step losses, the target's outputs, the final float32 draft params
(from the training checkpoint) and the exported draft, where the loaded
weights and the training batches were placed, and the line that refuses a
target the mesh cannot shard.
With ``block`` after OUT_DIR it runs only the block objective
(``DistillJob.block_size``) on one device and on (2, 4) instead.
Usage: python tests/sharded_distill_worker.py OUT_DIR [block]
"""

from __future__ import annotations

import os
import sys

# LLVM's backend optimization level only changes how fast the CPU code is
# generated and runs (it compiles several times faster at 0); every run
# compared here is compiled with it, and XLA's own passes are unchanged.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8"
                           + " --xla_backend_optimization_level=0")
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from specdec_jax import checkpoints, distill, partitioning, training  # noqa: E402
from distill_micro import STEPS, TARGET, job, save_models  # noqa: E402

def trained_params(workdir: str) -> dict:
  """The float32 draft params of the last training checkpoint, flattened."""
  ckpt = os.path.join(workdir, "train", "ckpt", str(STEPS), "default")
  state = ocp.StandardCheckpointer().restore(ckpt)
  return partitioning.flatten_names(jax.tree.map(np.asarray, state["params"]))


def main_block(out_dir: str) -> None:
  """The block objective (block_size 3, a new mask embedding) on one device
  and on (2, 4): losses, the exported mask embedding and per-position
  agreement."""
  root = os.path.join(out_dir, "work")
  save_models(root)
  report: dict = {"devices": jax.device_count(), "runs": {}}
  for name, mesh in (("block_single", None), ("block_2x4", (2, 4))):
    summary = distill.run_job(job(root, name, mesh, block_size=3, block_cuts=2,
                                  eval_source=job(root, name, mesh).source,
                                  eval_max_examples=8), log_fn=lambda m: None)
    mask = np.load(os.path.join(root, name, "distilled", "block_draft.npz"))
    report["runs"][name] = {"log": summary["log"], "after": summary["after"],
                            "mask": np.asarray(mask["decoder/mask_embedding"]).tolist()}
  with open(os.path.join(out_dir, "report.json"), "w") as f:
    json.dump(report, f, indent=1)


def main(out_dir: str) -> None:
  t0 = time.time()
  # The (2, 4) job runs three times: its programs compile once (a persistent
  # cache keyed by each program's HLO: the test session's, else this run's own).
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.join(out_dir, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  root = os.path.join(out_dir, "work")
  save_models(root)
  placed: dict = {}
  load, place = checkpoints.load_checkpoint, training.place_batch

  def spy_load(path, *args, **kwargs):
    params, config = load(path, *args, **kwargs)
    emb = params["token_embedder"]["embedding"]
    spec = getattr(emb.sharding, "spec", None)
    placed[os.path.basename(path)] = {"spec": str(spec), "dtype": str(emb.dtype),
                                      "devices": len(emb.sharding.device_set)}
    return params, config

  def spy_place(batch, partitioner):
    out = place(batch, partitioner)
    placed["batch"] = {"spec": str(getattr(getattr(out["inputs"], "sharding", None), "spec",
                                           None)),
                       "shard_rows": sorted({s.data.shape[0] for s in
                                             getattr(out["inputs"], "addressable_shards", [])})}
    return out

  checkpoints.load_checkpoint, training.place_batch = spy_load, spy_place
  report: dict = {"devices": jax.device_count(), "runs": {}}
  arrays: dict = {}
  quiet = lambda m: None
  runs = [("single", None, {}), ("1x8", (1, 8), {}), ("2x4", (2, 4), {}),
          ("2x4_stopped", (2, 4), {"max_minutes": 0.0}),
          ("2x4_resumed", (2, 4), {"resume": True})]
  for name, mesh, kw in runs:
    workdir_name = "2x4_resumed" if name.startswith("2x4_") else name
    t = time.time()
    summary = distill.run_job(job(root, workdir_name, mesh, **kw), log_fn=quiet)
    rec = {"steps": summary["steps"], "log": summary["log"], "placed": dict(placed),
           "seconds": round(time.time() - t, 1)}
    placed.clear()
    if name != "2x4_stopped":
      run = os.path.join(root, workdir_name)
      with open(os.path.join(run, "run", "target_outputs.jsonl")) as f:
        rec["target_outputs"] = sorted(f.read().splitlines())
      for k, v in trained_params(os.path.join(run, "run")).items():
        arrays[f"{name}/trained/{k}"] = v
      exported, _ = load(os.path.join(run, "distilled"))
      for k, v in partitioning.flatten_names(exported).items():
        arrays[f"{name}/exported/{k}"] = np.asarray(v)
    report["runs"][name] = rec
  # A target with 6 heads on (1, 8): refused from its config alone (the
  # checkpoint below has no weights to read).
  odd = os.path.join(root, "target_6_heads")
  os.makedirs(os.path.join(odd, "params"))
  with open(os.path.join(odd, "config.json"), "w") as f:
    json.dump(dataclasses.asdict(TARGET.replace(num_heads=6)), f)
  try:
    distill.check_before_loading(job(root, "odd", (1, 8), target_checkpoint=odd))
  except ValueError as e:
    report["bad_dims"] = str(e)
  report["seconds"] = round(time.time() - t0, 1)
  np.savez(os.path.join(out_dir, "params.npz"), **arrays)
  with open(os.path.join(out_dir, "report.json"), "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  if sys.argv[2:] == ["block"]:
    main_block(sys.argv[1])
  else:
    main(sys.argv[1])
