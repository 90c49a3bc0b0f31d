"""scripts/run_table2.py and specdec_jax.scripting.table2: every row of a
family in sequence, skipping finished rows and resuming the others with the
runner's --resume, then the Table 2 markdown. The fast tests replace the
runner by a recorder; the slow one runs a tiny row (the demo pair, two
examples) end to end and again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_jax.scripting import table2

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "run_table2.py"


def _row(folder: Path, name: str, *lines: str) -> Path:
  """A row config built from configs/demo.gin (included by absolute path, so
  any working directory parses it)."""
  folder.mkdir(parents=True, exist_ok=True)
  path = folder / f"{name}.gin"
  path.write_text("\n".join([f"include '{REPO / 'configs' / 'demo.gin'}'", *lines]) + "\n")
  return path


def _summary(workdir: Path, n: int, mode: str = "speculative") -> None:
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "summary.json").write_text(json.dumps({"mode": mode, "num_examples": n}))


def test_families_have_the_papers_twelve_rows(tmp_path):
  for family, prefix in (("t5_1_0", "t5_1_0_"), ("t5_1_1", "")):
    rows = table2.find_rows(table2.family_dir(family), tmp_path)
    assert len(rows) == 12, family
    assert {r.name for r in rows} == {f"{prefix}{task}_{size}_t{t}" for task in ("ende", "cnndm")
                                      for size in ("small", "base", "large") for t in (0, 1)}
    assert all(r.workdir == tmp_path / r.name for r in rows)
  with pytest.raises(ValueError, match="one of t5_1_0, t5_1_1"):
    table2.family_dir("t5_2")
  with pytest.raises(ValueError, match="ende_tiny_t0 not in"):
    table2.find_rows(table2.family_dir("t5_1_0"), tmp_path, ["ende_tiny_t0"])


def test_requested_examples_follow_overlays_and_bindings():
  row = str(REPO / "configs" / "table2_t5_1_0" / "t5_1_0_ende_small_t0.gin")
  overlay = str(REPO / "configs" / "tpu_v4_1.gin")
  assert table2.requested_examples([row, overlay], []) == 200  # configs/base.gin's
  assert table2.requested_examples([row, overlay], ["Experiment.num_examples = 7"]) == 7
  with pytest.raises(ValueError, match="gama"):
    table2.requested_examples([row], ["Experiment.gama = 3"])


def test_rows_done_are_skipped_and_the_others_resume(tmp_path):
  """Done (summary counts num_examples): no process; partial and new: the
  runner with --resume into ROOT/<row>; a failure does not stop the next row;
  an interruption does."""
  folder, root = tmp_path / "rows", tmp_path / "runs"
  for name in ("a_done", "b_partial", "c_fails", "d_new", "e_after"):
    _row(folder, name)
  rows = table2.find_rows(folder, root)
  _summary(root / "a_done", 3)
  _summary(root / "b_partial", 1)
  calls, said = [], []

  def runner(cmd):
    calls.append(cmd)
    return {"c_fails": 2, "e_after": table2.INTERRUPTED}.get(Path(cmd[3][9:]).stem, 0)

  out = table2.run_rows(rows, [], ["Experiment.num_examples = 3"], say=said.append, run=runner)
  assert out.skipped == ["a_done"] and out.ran == ["b_partial", "d_new"]
  assert out.failed == {"c_fails": 2} and out.interrupted == "e_after"
  assert [Path(c[3][9:]).stem for c in calls] == ["b_partial", "c_fails", "d_new", "e_after"]
  b = calls[0]
  assert b[:3] == [sys.executable, "-m", "specdec_jax.run"]
  assert b[3:] == [f"--config={folder / 'b_partial.gin'}",
                   "--gin_bindings=Experiment.num_examples = 3",
                   f"--workdir={root / 'b_partial'}", "--resume"]
  assert said[0] == f"[row 1/5] a_done: done (3 examples in {root / 'a_done'}), skipped"
  assert said[1].startswith("[row 2/5] b_partial: resuming after 1 of 3 examples")
  assert "failed (exit status 2)" in said[3]

  overlay = _row(tmp_path, "overlay")
  table2.run_rows(rows[3:4], [str(overlay)], [], say=said.append, run=calls.append)
  assert calls[-1][4] == f"--config={overlay}"  # overlays come after the row


def test_a_finished_row_of_other_settings_is_refused(tmp_path):
  """A row finished under another overlay (mesh, dtypes) is not skipped as if
  it were this command's: the command stops before running anything."""
  _row(tmp_path / "rows", "a")
  _row(tmp_path / "rows", "b")
  overlay = tmp_path / "mesh.gin"
  overlay.write_text("Experiment.mesh_shape = (1, 1)\nExperiment.param_dtype = 'bfloat16'\n")
  workdir = tmp_path / "runs" / "b"
  _summary(workdir, 100)
  summary = json.loads((workdir / "summary.json").read_text())
  summary.update(mesh_shape=[1, 4], param_dtype="bfloat16", dtype="float32", batch_size=1,
                 temperature=0.0)
  (workdir / "summary.json").write_text(json.dumps(summary))
  rows = table2.find_rows(tmp_path / "rows", tmp_path / "runs")
  calls = []
  with pytest.raises(ValueError, match=r"mesh_shape \[1, 4\] there, \[1, 1\] here"):
    table2.run_rows(rows, [str(overlay)], [], run=calls.append)
  assert calls == []
  summary["mesh_shape"] = [1, 1]  # the same settings: done, skipped
  (workdir / "summary.json").write_text(json.dumps(summary))
  out = table2.run_rows(rows, [str(overlay)], [], say=lambda _: None, run=lambda cmd: 0)
  assert out.skipped == ["b"] and out.ran == ["a"]


def test_an_alpha_only_workdir_is_refused(tmp_path):
  _row(tmp_path / "rows", "a")
  _summary(tmp_path / "runs" / "a", 5, mode="alpha_only")
  rows = table2.find_rows(tmp_path / "rows", tmp_path / "runs")
  with pytest.raises(ValueError, match="--alpha_only run"):
    table2.run_rows(rows, [], [], run=lambda cmd: 0)


def _script(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
def test_a_tiny_row_end_to_end_then_skipped(tmp_path):
  """A row of the demo pair (two examples) runs and the table is printed and
  written; run again, the finished row is skipped without starting the
  runner and the same table is printed; --figures writes the PNGs. (Twelve
  rows, T = 1 and a resumed row: tests/test_tpu_page.py, step 8.)"""
  tiny = ["Experiment.num_warmup = 1", "Experiment.num_examples = 2",
          "Experiment.input_buckets = (128,)", "Experiment.cost_repeats = 1"]
  folder, root = tmp_path / "rows", tmp_path / "runs"
  _row(folder, "demo_small_t0", *tiny)
  args = [f"--config_dir={folder}", f"--root={root}", "--figures"]

  first = _script(*args)
  assert first.returncode == 0, first.stderr[-3000:]
  summary = json.loads((root / "demo_small_t0" / "summary.json").read_text())
  assert summary["num_examples"] == 2 and summary["mismatches_vs_baseline"] == 0
  table = first.stdout[first.stdout.index("### Table 2"):]
  rows = [l for l in table.split("### Table 4")[0].splitlines() if l.startswith("| bible")]
  assert len(rows) == 1 and rows[0].split("|")[5].strip() == "0"  # TEMP
  assert (root / "table2.md").read_text() == table
  for png in ("speedup.png", "tokens_per_call.png", "acceptance.png"):
    assert (root / png).stat().st_size > 5000, png

  lines = (root / "demo_small_t0" / "examples.jsonl").read_bytes()
  again = _script(*args)
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.count("skipped") == 1 and "[1/2]" not in again.stdout + again.stderr
  assert again.stdout[again.stdout.index("### Table 2"):] == table
  assert (root / "demo_small_t0" / "examples.jsonl").read_bytes() == lines
