"""A multi-host run on one machine: two processes joined by
``jax.distributed`` on localhost, two CPU devices each (CPU collectives over
gloo), the runner's loops sharded over the four. Outputs and per-example
counts equal the single-process run's, on meshes (1, 4) and (2, 2) and for a
run resumed halfway; only process 0 writes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specdec_jax import checkpoints, distill, partitioning, run

import distill_micro
import toy_env

REPO = Path(__file__).resolve().parent.parent
KEYS = ("index", "id", "output", "baseline_output", "tokens", "baseline_tokens",
        "target_calls", "draft_calls", "accepted", "rejected", "matches_baseline")


def _lines(path: Path) -> list[dict]:
  return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _worker_env() -> dict:
  # Two processes compiling the same programs at once: no shared compile cache.
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  return dict(env, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  env = toy_env.build(tmp_path_factory.mktemp("mh_env"))
  out = tmp_path_factory.mktemp("mh_out")
  distill_micro.save_models(str(out / "distill"))  # the workers' distillation job
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, str(REPO / "tests" / "multihost_worker.py"), str(pid), str(port),
       str(env), str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, env=_worker_env())
      for pid in (0, 1)]
  logs = []
  for p in procs:
    try:  # a guard against a hang only: a loaded machine stretches the run several-fold
      logs.append(p.communicate(timeout=3600)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-4000:]
  # The single-process reference: one device, batch 1.
  ref = out / "single"
  assert run.run_args([f"--config={env}/exp.gin", f"--workdir={ref}",
                       f"--gin_bindings=Experiment.draft_checkpoint = '{env}/draft_near'",
                       "--gin_bindings=Experiment.cost_repeats = 1"]) == 0
  return out, logs


@pytest.mark.parametrize("name", ["mesh_1x4", "mesh_2x2", "resumed"])
def test_two_processes_equal_one(runs, name):
  out, _ = runs
  single = _lines(out / "single" / "examples.jsonl")
  multi = _lines(out / name / "examples.jsonl")
  assert [[r[k] for k in KEYS] for r in multi] == [[r[k] for k in KEYS] for r in single]
  acc = sum(r["accepted"] for r in single)
  assert 0 < acc < sum(r["accepted"] + r["rejected"] for r in single)  # both verdicts occur
  s = json.loads((out / name / "summary.json").read_text())
  ref = json.loads((out / "single" / "summary.json").read_text())
  for k in ("num_examples", "alpha", "tokens_per_target_call", "mismatches_vs_baseline"):
    assert s[k] == ref[k], k
  if name == "resumed":
    assert len(s["cost_segments"]) == 2 and [g["examples"] for g in s["cost_segments"]] == [2, 2]


def test_only_process_zero_prints_the_result(runs):
  _, logs = runs
  assert logs[0].count("| TASK | M_q |") == 4 and "| TASK | M_q |" not in logs[1]


def test_two_process_distillation_equals_one_device(runs):
  """The micro distillation job over 2 processes on mesh (2, 2): the same
  target outputs and every step's losses as on one device (tolerance as in
  test_sharded_distill), its checkpoint and export written once."""
  out, _ = runs
  root = out / "distill"
  multi = json.loads((root / "mesh_2x2.json").read_text())
  single = distill.run_job(distill_micro.job(str(root), "single", None), log_fn=lambda m: None)
  assert multi["steps"] == single["steps"] == distill_micro.STEPS
  losses = lambda log: np.array([[r["train_loss"], r["ce"], r["fkl"]] for r in log])
  np.testing.assert_allclose(losses(multi["log"]), losses(single["log"]), rtol=1e-5)
  outputs = lambda name: sorted((root / name / "run" / "target_outputs.jsonl")
                                .read_text().splitlines())
  assert outputs("mesh_2x2") == outputs("single") and len(outputs("single")) == 16
  exported, _ = checkpoints.load_checkpoint(str(root / "mesh_2x2" / "distilled"))
  ref, _ = checkpoints.load_checkpoint(str(root / "single" / "distilled"))
  flat, flat_ref = (partitioning.flatten_names(p) for p in (exported, ref))
  assert set(flat) == set(flat_ref) and len(flat) > 20
  for name in flat:
    np.testing.assert_allclose(np.asarray(flat[name]), np.asarray(flat_ref[name]),
                               rtol=2**-7, atol=1e-6, err_msg=name)
