"""One of two processes of a multi-host run on localhost, started by
tests/test_multihost.py: 2 CPU devices per process, the runner called in
process for several meshes and a resumed run (one distributed start).

Usage: python tests/multihost_worker.py PROCESS_ID PORT ENV_DIR OUT_DIR
"""

from __future__ import annotations

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
  for name, bindings in RUNS:
    args = [f"--config={env}/exp.gin", f"--workdir={out}/{name}"]
    args += [f"--gin_bindings={b}" for b in common + bindings]
    if name in seen:
      args.append("--resume")
    seen.add(name)
    code = run.run_args(args)
    if code:
      sys.exit(code)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
