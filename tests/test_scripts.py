"""Every script in scripts/ works after the README's install (``pip install -e .``),
from any directory: ``--help`` exits 0 without a traceback from a directory
outside the repository, no script edits sys.path (but to find lab/ beside
scripts/, after the installed package), the demo defaults resolve
against the repository root, and the library pieces the scripts share
(``specdec_jax.scripting.script_args``, ``specdec_jax.run.logs``) keep their contracts."""

from __future__ import annotations

import argparse
import concurrent.futures
import logging as std_logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "scripts").glob("*.py")) + sorted((REPO / "scripts").glob("*.sh"))


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
  """``<script> --help`` of every script, run from an empty directory outside the
  repository without PYTHONPATH (the package is found as installed), a few at a time."""
  cwd = tmp_path_factory.mktemp("elsewhere")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["JAX_PLATFORMS"] = "cpu"

  def run(script: Path) -> subprocess.CompletedProcess:
    if script.suffix == ".sh" and "--help" not in script.read_text():
      cmd = ["bash", "-n", str(script)]  # no --help of its own: only parsed, never run
    else:
      cmd = (["bash"] if script.suffix == ".sh" else [sys.executable]) + [str(script), "--help"]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)

  with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
    return dict(zip((s.name for s in SCRIPTS), pool.map(run, SCRIPTS)))


def test_every_script_is_listed():
  names = {s.name for s in SCRIPTS}
  assert {"bench_decode.py", "bench_speculative.py", "bench_vs_hf.py", "distill_draft.py",
          "make_shortlist.py", "make_tables.py", "plan_memory.py", "prepare_bible.py",
          "profile_round.py", "train_demo_models.py", "demo_alpha_table.sh",
          # one study per script (lab/)
          "compare_revision.py", "cache_contention.py", "adaptive_pieces.py",
          "adaptive_replay.py", "confidence_auc.py", "acceptance_head.py",
          "account_run.py", "bench_vk.py"} <= names


@pytest.mark.parametrize("name", [s.name for s in SCRIPTS])
def test_help_from_outside_the_repository(helps, name):
  res = helps[name]
  assert res.returncode == 0, res.stderr[-3000:]
  assert "Traceback" not in res.stderr, res.stderr[-3000:]
  if name.endswith(".py"):
    assert res.stdout.startswith("usage:"), res.stdout[:500]


# The one edit of the import path a script may make: lab/ (not installed) is
# found beside scripts/, after the installed package.
LAB_PATH = "sys.path.append(str(Path(__file__).resolve().parents[1]))"


def test_no_script_or_doc_edits_the_import_path():
  """Scripts import specdec_jax as installed (a script that uses lab/ appends
  the repository root, once, after it); no doc tells anyone to set PYTHONPATH."""
  files = SCRIPTS + [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
  bad = [f.relative_to(REPO) for f in files
         if "sys.path.insert" in f.read_text() or "PYTHONPATH" in f.read_text()]
  assert not bad, bad
  for f in SCRIPTS:
    text = f.read_text()
    uses_lab = "\nfrom lab" in text or "\n  from lab" in text or "\nimport lab" in text
    assert text.count("sys.path") == (1 if uses_lab else 0), f.name
    assert (LAB_PATH in text) == uses_lab, f.name


def _parser_with_pair():
  from specdec_jax.scripting import script_args
  p = script_args.new_parser("doc")
  script_args.add_pair_arguments(p)
  script_args.add_shortlist_argument(p)
  return p


def test_demo_defaults_resolve_against_the_repository_root(tmp_path, monkeypatch):
  from specdec_jax.run import logs
  from specdec_jax.scripting import script_args
  monkeypatch.chdir(tmp_path)
  try:
    args = script_args.parse(_parser_with_pair(), [])
    assert args.target == str(REPO / script_args.TARGET) and Path(args.target).is_dir()
    assert args.draft_shortlist == str(REPO / script_args.SHORTLIST)
    assert Path(args.source).is_file() and Path(args.vocab).is_file()
    # A file in the working directory wins; '' (no shortlist) stays ''.
    (tmp_path / "my.tsv").write_text("id\tinput\treference\n")
    args = script_args.parse(_parser_with_pair(), ["--source=my.tsv", "--draft=other",
                                                    "--draft_shortlist="])
    assert args.source == "my.tsv" and args.draft_shortlist == ""
    # The shortlist defaults to the demo's only for the demo draft.
    assert script_args.parse(_parser_with_pair(), ["--draft=other"]).draft_shortlist == ""
  finally:
    logs.quiet_libraries(False)


def test_parse_hides_library_info_unless_verbose():
  from absl import logging
  from specdec_jax.run import logs
  from specdec_jax.scripting import script_args
  handler = logging.get_absl_handler()
  rec = lambda path: std_logging.LogRecord("absl", std_logging.INFO, path, 1, "m", (), None)
  try:
    script_args.parse(script_args.new_parser("doc"), [])
    assert not all(f.filter(rec("/site-packages/orbax/x.py")) for f in handler.filters)
    assert all(f.filter(rec(str(REPO / "specdec_jax" / "x.py"))) for f in handler.filters)
    script_args.parse(script_args.new_parser("doc"), ["--verbose"])
    assert not any(isinstance(f, logs.LibraryFilter) for f in handler.filters)
  finally:
    logs.quiet_libraries(False)


def test_markdown_table():
  from specdec_jax.scripting.script_args import markdown_table
  assert markdown_table(["a", "b"], [[1, "x"], ["-", 2.5]]) == (
      "| a | b |\n|---|---|\n| 1 | x |\n| - | 2.5 |")


def test_the_seqio_path_names_its_extra(monkeypatch):
  """Without the seqio extra, the first seqio function says how to install it
  and what needed it."""
  from specdec_jax import data
  monkeypatch.setitem(sys.modules, "seqio", None)  # as if not installed
  with pytest.raises(ImportError, match=r'seqio is not installed: pip install -e "\.\[seqio\]" '
                                        r"\(the source 'seqio:specdec_wmt_ende' needs it\)"):
    data.load_examples("seqio:specdec_wmt_ende", split="validation")


def test_plan_memory_prints_rows_for_a_draft_without_a_table2_row(capsys):
  """T5 1.0 11B with T5 1.0 small (no Table 2 row of its own): rows, planned
  with the γ of the small draft's rows, not an empty table."""
  from lab import plan_memory as mod
  assert "t5_11b" in mod.TARGETS
  try:
    mod.main(["--targets=t5_11b", "--drafts=t5_small", "--batch_sizes=1",
              "--hardware=H:80:1x1"])
  finally:
    from specdec_jax.run import logs
    logs.quiet_libraries(False)
  out = capsys.readouterr().out
  rows = [l for l in out.splitlines() if l.startswith("1.0-11B   1.0-small bf16")]
  assert len(rows) == 2 and all(l.endswith(" ok") for l in rows), out
  assert "t5_small has no row in the configs: planned with gamma 7" in out
  with pytest.raises(SystemExit):
    mod.main(["--targets=t5_xxl"])
  assert "valid: t5_1_1_small" in capsys.readouterr().err


def test_new_parser_keeps_the_docstring_layout():
  from specdec_jax.scripting import script_args
  p = script_args.new_parser("one\n\n  python x.py --a\n")
  assert isinstance(p, argparse.ArgumentParser)
  assert "\n  python x.py --a\n" in p.format_help()


def test_run_main_reports_a_user_error_in_one_line(capsys, monkeypatch):
  from specdec_jax.scripting import script_args
  monkeypatch.setattr(sys, "argv", ["some_script.py"])

  def main():
    raise FileNotFoundError("no such file: x.tsv")

  with pytest.raises(SystemExit) as e:
    script_args.run_main(main)
  assert e.value.code == 2
  assert capsys.readouterr().err == "some_script.py: error: no such file: x.tsv\n"
  with pytest.raises(SystemExit) as e:
    script_args.run_main(lambda: 3)
  assert e.value.code == 3
