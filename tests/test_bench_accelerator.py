"""scripts/bench_accelerator.sh: the GPU benchmark (scripts/bench_gpu.py) and
the earlier runner set, each at toy sizes on the CPU (--smoke), each section
printing its table; its sections each run even when an earlier one fails;
the steered approximation model the loops section times (exact at T = 0,
acceptance at the steer's α)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "bench_accelerator.sh"
GPU_SECTIONS = ("loops", "variant_min_rows", "hf", "demo")
MORE_SECTIONS = ("bandwidth", "targets", "exactness", "profile")
RUNNER_SECTIONS = ("runner demo", "runner demo_t1", "v(k)", "γ sweep T=0", "γ sweep T=1")


def _env(tmp_path: Path) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", OUT=str(tmp_path), PYTHONPATH=str(REPO),
             PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
  env.pop("BENCH_WORKDIR", None)
  env.pop("BENCH_BUDGET_S", None)
  return env


@pytest.mark.slow
def test_bench_accelerator_gpu_smoke_prints_every_table(tmp_path):
  """Every section of the GPU benchmark at toy sizes: its table printed, its
  rows in bench_gpu.json and its table in bench_gpu.md."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  res = subprocess.run(["bash", str(SCRIPT), "--smoke"], cwd=tmp_path, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  out = res.stdout
  assert "failed" not in out and "skipped" not in out, out
  assert "# accelerator: cpu" in out
  assert "| device-to-device copy | 8 |" in out                                   # bandwidth
  assert out.count("| model | pass | k | ms | v(k) / c | weight GB read | floor ms |") == 2
  assert out.count("| target | draft | α | γ | c | v(8) | EXP (Thm 3.8) |") == 2    # Thm 3.8
  assert "| HF eager | one-token step (dynamic cache) |" in out                     # hf
  assert "| ours | one-token step (targets section) |" in out
  assert "| HF generate | static cache, not compiled" in out                         # hf_compiled
  assert "| 0 | HF assisted (constant γ) |" in out and "| 0 | ours speculative_decode |" in out
  assert "identical outputs: 5/5 comparisons with HF generate" in out              # demo
  for dtype, precision in (("float32", "highest"), ("bfloat16", "default")):  # smoke: 2 of 3
    assert f"| {dtype} | {precision} | 1 | **" in out                                # exactness
  work = tmp_path / "bench_accelerator"
  doc = json.loads((work / "bench_gpu.json").read_text())
  assert set(doc["sections"]) == set(GPU_SECTIONS)
  assert doc["machine"]["platform"] == "cpu"
  xxl = doc["sections"]["targets"]["targets"]["xxl"]
  assert [p["k"] for p in xxl["passes"] if p["kind"] == "target"] == [1, 8]
  assert all(0 < p["pct_of_floor"] for p in xxl["passes"])
  from specdec_jax import memory                              # the floor's bytes: memory's count
  assert xxl["passes"][0]["weight_bytes"] == memory.step_weight_bytes(
      bench_gpu_smoke_target(), None, "bfloat16")
  assert [r["mismatches"] for r in doc["sections"]["exactness"]["rows"]] == [0, 0]
  # The kernel profiles: the first target's step and γ + 1 pass, then the
  # profile section's steps with and without min_rows 2 (same weights).
  assert [r["label"] for r in xxl["profile"]] == ["one-token step", "8-position pass"]
  labels = [r["label"] for r in doc["sections"]["profile"]["rows"]]
  assert "target xl (min_rows 2) one-token step" in labels and "target xl 2-position pass" in labels
  assert all(r["kernels_per_pass"] > 0 and r["wall_ms"] > 0
             for r in xxl["profile"] + doc["sections"]["profile"]["rows"])
  assert out.count("Per-kernel profile of") == 2
  md = (work / "bench_gpu.md").read_text()
  assert all(f"### {name}" in md for name in GPU_SECTIONS)
  assert "| device-to-device copy |" in (work / "bench_accelerator.log").read_text()


def test_bench_accelerator_runner_smoke_prints_every_table(tmp_path):
  res = subprocess.run(["bash", str(SCRIPT), "--runner", "--smoke"], cwd=tmp_path,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  out = res.stdout
  assert "failed" not in out and "skipped" not in out, out
  assert "# accelerator: cpu" in out
  assert "| model | what | k | ms per call | ratio to k=1 |" in out          # v(k)
  # Smoke mode runs configs/demo.gin alone (demo_t1 is the same path at T = 1).
  assert out.count("| TASK | M_q | TEMP | γ | α | SPEED |") == 1
  assert "Outputs identical to the baseline's on all 1" in out
  assert out.count("# summary: 1 examples, T = 0") == 1                     # tok/s, α, c
  assert "| temp | γ | baseline tok/s | speculative tok/s | speedup |" in out  # the sweep
  assert (tmp_path / "bench_accelerator" / "demo" / "summary.json").is_file()


@pytest.mark.parametrize("flags, names", [([], ("devices",) + GPU_SECTIONS),
                                          (["--runner"], ("devices",) + RUNNER_SECTIONS)])
def test_bench_accelerator_runs_every_section_after_failures(tmp_path, flags, names):
  """A `python` that fails at once: every section is tried and reported,
  the script goes on to the end and exits 1; output goes to BENCH_WORKDIR."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  fake = bin_dir / "python"
  fake.write_text("#!/bin/sh\nexit 3\n")
  fake.chmod(0o755)
  env = dict(os.environ, OUT=str(tmp_path / "out"), BENCH_WORKDIR=str(tmp_path / "work"),
             PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
  env.pop("BENCH_BUDGET_S", None)
  res = subprocess.run(["bash", str(SCRIPT), *flags], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 1, res.stdout + res.stderr
  out = res.stdout
  for name in names:
    assert f"# section {name} failed (exit 3)" in out, out
  assert f"# failed or skipped: {','.join(names)}" in out
  assert (tmp_path / "work" / "bench_accelerator" / "bench_accelerator.log").is_file()
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, n", [([], 1 + len(GPU_SECTIONS)),
                                      (["--runner"], 1 + len(RUNNER_SECTIONS))])
def test_bench_accelerator_time_budget_skips_what_does_not_fit(tmp_path, flags, n):
  """With no budget left, sections are skipped (not started), reported, exit 1."""
  env = dict(os.environ, BENCH_WORKDIR=str(tmp_path), BENCH_BUDGET_S="10")
  res = subprocess.run(["bash", str(SCRIPT), *flags], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 1, res.stdout + res.stderr
  assert res.stdout.count("skipped: the time budget (10 s) is spent") == n, res.stdout


def test_bench_accelerator_rejects_unknown_flags(tmp_path):
  res = subprocess.run(["bash", str(SCRIPT), "--nope"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
  assert res.returncode == 2 and "usage:" in res.stderr


def bench_gpu_smoke_target():
  import bench_gpu
  return bench_gpu.SMOKE.targets["xxl"]


def test_paper_rows_are_table_2_endes_at_t0():
  import bench_gpu
  assert bench_gpu.PAPER_GAMMA == 7
  assert {k: v["alpha"] for k, v in bench_gpu.PAPER_ENDE_T0.items()} == {
      "small": 0.75, "base": 0.80, "large": 0.82}
  assert 1 in bench_gpu.FULL.ks and bench_gpu.PAPER_GAMMA + 1 in bench_gpu.FULL.ks
  assert bench_gpu.FULL.ks == (1, 2, 4, 8, 16)
  assert set(bench_gpu.FULL.targets) == {"xxl", "xl"}
  assert bench_gpu.FULL.targets["xxl"].d_model == 4096
