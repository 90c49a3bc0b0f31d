"""scripts/bench_accelerator.sh --smoke: the accelerator benchmark's commands,
at toy sizes on the CPU, each printing its table; and its sections each run
even when an earlier one fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "bench_accelerator.sh"


def test_bench_accelerator_smoke_prints_every_table(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", OUT=str(tmp_path), PYTHONPATH=str(REPO),
             PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
  env.pop("BENCH_WORKDIR", None)
  env.pop("BENCH_BUDGET_S", None)
  res = subprocess.run(["bash", str(SCRIPT), "--smoke"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  out = res.stdout
  assert "failed" not in out and "skipped" not in out, out
  assert "# accelerator: cpu" in out
  assert "| model | what | k | ms per call | ratio to k=1 |" in out          # v(k)
  assert out.count("| TASK | M_q | TEMP | γ | α | SPEED |") == 2           # T = 0 and T = 1
  assert "Outputs identical to the baseline's on all 1" in out
  assert out.count("# summary: 1 examples, T = ") == 2                      # tok/s, α, c
  assert "| temp | γ | baseline tok/s | speculative tok/s | speedup |" in out  # the sweep
  for config in ("demo", "demo_t1"):
    assert (tmp_path / "bench_accelerator" / config / "summary.json").is_file()


def test_bench_accelerator_runs_every_section_after_failures(tmp_path):
  """A `python` that fails at once: every section is tried and reported,
  the script goes on to the end and exits 1; workdirs go to BENCH_WORKDIR."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  fake = bin_dir / "python"
  fake.write_text("#!/bin/sh\nexit 3\n")
  fake.chmod(0o755)
  env = dict(os.environ, OUT=str(tmp_path / "out"), BENCH_WORKDIR=str(tmp_path / "work"),
             PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
  env.pop("BENCH_BUDGET_S", None)
  res = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
  assert res.returncode == 1, res.stdout + res.stderr
  out = res.stdout
  for name in ("devices", "runner demo", "runner demo_t1", "v(k)", "γ sweep T=0",
               "γ sweep T=1"):
    assert f"# section {name} failed (exit 3)" in out, out
  assert "# failed or skipped: devices,runner demo,runner demo_t1,v(k),γ sweep T=0,γ sweep T=1" in out
  assert (tmp_path / "work" / "bench_accelerator").is_dir()
  assert not (tmp_path / "out").exists()


def test_bench_accelerator_time_budget_skips_what_does_not_fit(tmp_path):
  """With no budget left, sections are skipped (not started), reported, exit 1."""
  env = dict(os.environ, BENCH_WORKDIR=str(tmp_path), BENCH_BUDGET_S="10")
  res = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
  assert res.returncode == 1, res.stdout + res.stderr
  assert res.stdout.count("skipped: the time budget (10 s) is spent") == 6, res.stdout
