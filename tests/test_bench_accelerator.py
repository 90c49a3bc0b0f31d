"""scripts/bench_accelerator.sh --smoke: the accelerator benchmark's commands,
at toy sizes on the CPU, each printing its table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_accelerator_smoke_prints_every_table(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", OUT=str(tmp_path), PYTHONPATH=str(REPO),
             PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
  res = subprocess.run(["bash", str(REPO / "scripts" / "bench_accelerator.sh"), "--smoke"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  out = res.stdout
  assert "# accelerator: cpu" in out
  assert "| model | what | k | ms per call | ratio to k=1 |" in out          # v(k)
  assert out.count("| TASK | M_q | TEMP | γ | α | SPEED |") == 2           # T = 0 and T = 1
  assert "outputs identical to the baseline's on all 1" in out
  assert "| temp | γ | baseline tok/s | speculative tok/s | speedup |" in out  # the sweep
  for config in ("demo", "demo_t1"):
    assert (tmp_path / "bench_accelerator" / config / "summary.json").is_file()
