"""One of two processes of a multi-host run on localhost, started by
tests/test_multihost.py: 2 CPU devices per process, the runner called in
process for several meshes and a resumed run, then a distillation job on
mesh (2, 2) (one distributed start).

Usage: python tests/multihost_worker.py PROCESS_ID PORT ENV_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")
os.environ["JAX_PLATFORMS"] = "cpu"

from specdec_jax import run  # noqa: E402

# (workdir name, extra bindings); "resumed" runs in two parts.
RUNS = [("mesh_1x4", ["Experiment.mesh_shape = (1, 4)"]),
        ("mesh_2x2", ["Experiment.mesh_shape = (2, 2)", "Experiment.batch_size = 2"]),
        ("resumed", ["Experiment.mesh_shape = (1, 4)", "Experiment.num_examples = 2"]),
        ("resumed", ["Experiment.mesh_shape = (1, 4)"])]


def main(pid: int, port: int, env: str, out: str) -> None:
  common = [f"Experiment.draft_checkpoint = '{env}/draft_near'", "Experiment.cost_repeats = 1",
            "Experiment.multihost = True", f"Experiment.coordinator_address = '127.0.0.1:{port}'",
            "Experiment.num_processes = 2", f"Experiment.process_id = {pid}"]
  seen = set()
  distill_only = bool(os.environ.get("MH_DISTILL_ONLY"))  # for debugging the job alone
  if distill_only:
    from specdec_jax import partitioning  # pylint: disable=g-import-not-at-top
    partitioning.initialize_multihost(f"127.0.0.1:{port}", 2, pid)
  for name, bindings in RUNS if not distill_only else []:
    args = [f"--config={env}/exp.gin", f"--workdir={out}/{name}"]
    args += [f"--gin_bindings={b}" for b in common + bindings]
    if name in seen:
      args.append("--resume")
    seen.add(name)
    code = run.run_args(args)
    if code:
      sys.exit(code)
  # Distillation over both processes: the micro job (tests/distill_micro.py,
  # its checkpoints saved by the test) on mesh (2, 2); process 0 writes what
  # the test compares with one device.
  from specdec_jax import distill  # pylint: disable=g-import-not-at-top
  from distill_micro import job  # pylint: disable=g-import-not-at-top
  if distill_only:
    import faulthandler  # pylint: disable=g-import-not-at-top
    faulthandler.dump_traceback_later(120)
  summary = distill.run_job(job(f"{out}/distill", "mesh_2x2", (2, 2)),
                            log_fn=print if distill_only else lambda m: None)
  if pid == 0:
    with open(f"{out}/distill/mesh_2x2.json", "w", encoding="utf-8") as f:
      json.dump({"steps": summary["steps"], "log": summary["log"]}, f)
  # Leave together. At exit JAX shuts the distributed system down behind a
  # barrier that aborts every process ("Shutdown barrier has failed") when
  # the last one arrives more than the service's shutdown timeout (300 s)
  # after the first. Process 0's own work above (the export, its files) would
  # run while process 1 already waits there, on a clock that load stretches;
  # met here first, the processes reach it together.
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  multihost_utils.sync_global_devices("multihost_worker: done")
  # Both reach JAX's shutdown barrier right after the sync, not after their
  # other exit handlers: once, on a loaded machine, process 0 came too late.
  import jax  # pylint: disable=g-import-not-at-top
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
