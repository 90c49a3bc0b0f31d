"""``--calibrate`` (``specdec_jax.run.check_model``): the dry run's cost model
beside one real run's costs, on this CPU-only machine. The end-to-end run
uses the tiny toy pair on two host devices with a (1, 2) mesh and the
v5e:1x2 topology, so that it measures and models the loop's collectives
too; the rest needs no model."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gin  # noqa: E402
import pytest  # noqa: E402

from specdec_jax import paper  # noqa: E402
from specdec_jax.dryrun import chips  # noqa: E402
from specdec_jax.dryrun.costs import Piece, Roofline  # noqa: E402
from specdec_jax.run import check_model, cli, logs  # noqa: E402

import toy_env  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "configs" / "demo.gin")
QUANTITIES = ("target step (ms)", "v(1)", "v(2)", "v(3)", "draft step (ms)", "c",
              "collectives per loop iteration (µs)", "Theorem 3.8 speedup, α 0.75, γ 2 (v = 1)",
              "with v(3)")


# ------------------------------------------------------------ end to end


@pytest.mark.slow
def test_calibrate_prints_every_quantity_writes_json_and_its_fit_reproduces_c(tmp_path):
  """About 30 s on 2 cores: libtpu compiles the pieces, the CPU times them."""
  pytest.importorskip("libtpu", reason="the model's pieces compile with libtpu")
  env = toy_env.build(tmp_path)
  workdir = tmp_path / "cal"
  cmd = [sys.executable, "-m", "specdec_jax.run", f"--config={env / 'exp.gin'}",
         f"--workdir={workdir}", "--calibrate=v5e:1x2",
         "--gin_bindings=Experiment.mesh_shape = (1, 2)",
         "--gin_bindings=Experiment.task = 'wmt_ende'",          # the paper's α (EnDe, small, T=0)
         "--gin_bindings=Experiment.draft_label = 'T5-small'",
         "--gin_bindings=Experiment.gamma = 2", "--gin_bindings=Experiment.cost_repeats = 3"]
  e = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
           XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
  res = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  out = res.stdout
  assert "NOTE: measured on cpu (2 devices), model for v5e:1x2 (2 TPU v5e chips): compare " \
      "only on that TPU." in out
  for q in QUANTITIES:
    assert f"  {q} " in out or f"  {q}\n" in out, q
  assert "x all-reduce of" in out and "µs measured" in out
  assert "nothing was decoded" in out
  assert not (workdir / "examples.jsonl").exists() and not (workdir / "summary.json").exists()

  r = json.loads((workdir / check_model.FILENAME).read_text())
  assert r["topology"] == "v5e:1x2" and r["comparable"] is False and r["gamma"] == 2
  for side in ("measured", "model"):
    s = r[side]
    assert s["step_ms"] > 0 and s["c"] > 0 and s["draft_step_ms"] > 0
    assert sorted(s["v"]) == ["1", "2", "3"]
    assert s["collectives_us"] > 0  # a (1, 2) mesh: the target's all-reduces
  assert r["collectives"] and all(c["measured_us"] > 0 and c["model_us"] > 0
                                  for c in r["collectives"])
  assert r["paper"]["alpha"] == 0.75 and len(r["rows"]) == len(QUANTITIES)

  # The fixed cost: re-priced from the stored pieces alone, the model's c at
  # the fitted cost is the measured c; where no cost reaches it, the measured
  # c lies outside what any cost can give.
  piece = lambda d: Piece(d["flops"], d["bytes"], d["ops"],
                          tuple((tuple(k), n) for k, n in d["collectives"]))
  target, draft = piece(r["pieces"]["target k=1"]), piece(r["pieces"]["draft"])
  fit, c = r["op_seconds"], r["measured"]["c"]
  chip = chips.CHIPS["v5e"]
  if "fitted" in fit:
    at = dataclasses.replace(chip, op_seconds=fit["fitted"])
    assert draft.seconds(at) / target.seconds(at) == pytest.approx(c, rel=1e-6)
    assert fit["chips_line"].startswith('CHIPS["v5e"]: op_seconds=')
  else:
    free = dataclasses.replace(chip, op_seconds=0.0)
    low, high = sorted((draft.seconds(free) / target.seconds(free), draft.ops / target.ops))
    assert not low <= c <= high, fit["error"]


# ------------------------------------------------------------- the parts


def _roofline(op_seconds: float = 0.0) -> Roofline:
  """A made-up model: a target step of 1.2 GB and 1000 ops, a draft of
  24 MB and 400 ops, one v4 chip (no collectives)."""
  chip = dataclasses.replace(chips.CHIPS["v4"], op_seconds=op_seconds)
  return Roofline(chip, {1: Piece(2e9, 1.2e9, 1000), 2: Piece(4e9, 1.21e9, 1010)},
                  Piece(2e7, 2.4e7, 400), 0)


@pytest.mark.parametrize("c", [0.05, 0.1, 0.3])
def test_the_fitted_fixed_cost_gives_back_the_measured_c(c):
  rl = _roofline()
  t = check_model.solve_op_seconds(rl, c)
  assert t > 0
  assert check_model.with_op_seconds(rl, t).c() == pytest.approx(c, rel=1e-9)
  # ... and not at a cost 10% off
  assert check_model.with_op_seconds(rl, 1.1 * t).c() != pytest.approx(c, rel=1e-3)


def test_compare_holds_both_sides_and_says_when_no_cost_fits():
  rl = _roofline(op_seconds=3e-7)
  meas = check_model.Side(2.0, {1: 1.0, 2: 1.1}, 0.04, 0.02, None)
  row = paper.table2_row("ende", "small", 0)
  r = check_model.compare(rl, 1, meas, row, "v4:1x1x1", "cpu, 1 device",
                          "measured on cpu (1 device), model for v4:1x1x1", paper_models=False)
  text = check_model.table(r)
  assert "no collectives (one device)" in text and "Theorem 3.8 speedup" in text
  assert "NOT for chips.py" in text and "V4_OP_SECONDS = " in r["op_seconds"]["chips_line"]
  assert r["model"]["c"] == pytest.approx(rl.c())
  # The model's c without a fixed cost is above 0.01, and it only grows with one.
  r = check_model.compare(rl, 1, dataclasses.replace(meas, c=0.001), None, "v4:1x1x1",
                          "TPU v4, 1 device", None)
  assert "error" in r["op_seconds"] and "no fixed cost per operation gives c = 0.001" in \
      check_model.table(r)


def _tpu(kind: str, coords: tuple) -> types.SimpleNamespace:
  return types.SimpleNamespace(platform="tpu", device_kind=kind, coords=coords)


def test_auto_reads_the_topology_from_the_devices():
  v4 = [_tpu("TPU v4", (x, y, 0)) for x in range(2) for y in range(2)]
  v5e = [_tpu("TPU v5 lite", (x, y, 0)) for x in range(2) for y in range(4)]
  assert check_model.topology_of(v4) == "v4:2x2x1"
  assert check_model.topology_of(v4[:1]) == "v4:1x1x1"
  assert check_model.topology_of(v5e) == "v5e:2x4"
  assert check_model.machine_note(v4[:1], "v4:1x1x1") is None
  assert "compare only on that TPU" in check_model.machine_note(v4, "v4:1x1x1")
  cpu = [types.SimpleNamespace(platform="cpu", device_kind="cpu", coords=())]
  assert check_model.machine_note(cpu, "v4:1x1x1") == (
      "measured on cpu (1 device), model for v4:1x1x1 (1 TPU v4 chip): compare only on "
      "that TPU")
  with pytest.raises(ValueError, match="devices here are cpu, not TPUs"):
    check_model.topology_of(cpu)


def test_collectives_are_timed_on_a_mesh():
  """Each kind the loop may run, over groups along the mesh's axes, on 4 host devices."""
  code = textwrap.dedent("""
      from specdec_jax import partitioning
      from specdec_jax.run import check_model
      mesh = partitioning.make_mesh((2, 2))
      keys = [("all-reduce", 4096, 2), ("all-gather", 4096, 2), ("reduce-scatter", 4096, 4),
              ("all-to-all", 4096, 4), ("collective-permute", 4096, 2), ("all-reduce", 4096, 3)]
      got = check_model.time_collectives(mesh, keys, "bfloat16", repeats=2, inner=2)
      assert got[("all-reduce", 4096, 3)] is None, got  # no group of 3 in 4 devices
      assert all(got[k] > 0 for k in keys[:-1]), got
      print("ok")
  """)
  e = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
           XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4")
  res = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                       timeout=120)
  assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


# ---------------------------------------------------------- bad input


@pytest.fixture
def no_loading(monkeypatch):
  """Fails the test if any data or weight is read."""
  def refuse(*a, **k):
    raise AssertionError("data or weights were read")
  for module in (cli, check_model):
    monkeypatch.setattr(module, "load_data", refuse)
    monkeypatch.setattr(module, "load_models", refuse)


def _error(capsys, *args) -> str:
  try:
    rc = cli.run_args([f"--config={DEMO}", *args])
  finally:
    logs.quiet_libraries(False)
    gin.clear_config()
  assert rc == 2
  return capsys.readouterr().err.strip().splitlines()[-1]


def test_bad_input_is_one_line_before_loading(tmp_path, capsys, no_loading):
  line = _error(capsys, f"--workdir={tmp_path / 'a'}", "--calibrate=v9:2x2")
  assert line.startswith("error: --calibrate='v9:2x2': unknown TPU topology; expected CHIP:GRID")
  line = _error(capsys, f"--workdir={tmp_path / 'a'}", "--calibrate=v4:1x1x1",
                "--dry_run=v4:1x1x1")
  assert line.startswith("error: --calibrate=v4:1x1x1 and --dry_run=v4:1x1x1: choose one")
  f = tmp_path / "results"
  f.write_text("not a directory")
  line = _error(capsys, f"--workdir={f / 'cal'}", "--calibrate=v4:1x1x1")
  assert line.startswith(f"error: --workdir {f / 'cal'}: {f} is a file"), line
  line = _error(capsys, f"--workdir={tmp_path / 'a'}", "--calibrate=auto")
  assert "--calibrate=auto: the devices here are cpu, not TPUs" in line
  assert not (tmp_path / "a").exists()


def test_an_unwritable_workdir_is_refused(tmp_path, capsys, no_loading):
  locked = tmp_path / "locked"
  locked.mkdir()
  locked.chmod(0o500)
  try:
    if os.access(locked, os.W_OK):
      pytest.skip("running as a user who may write anywhere (root)")
    line = _error(capsys, f"--workdir={locked / 'cal'}", "--calibrate=v4:1x1x1")
    assert line.startswith(f"error: --workdir {locked / 'cal'} is not writable"), line
  finally:
    locked.chmod(0o700)
