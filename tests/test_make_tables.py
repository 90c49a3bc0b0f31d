"""Tests for scripts/make_tables.py on synthetic summary.json files."""

import importlib.util
import json
import pathlib

import pytest

_SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "make_tables.py"


@pytest.fixture(scope="module")
def make_tables():
  spec = importlib.util.spec_from_file_location("make_tables", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _run_summary(task, draft, temperature, gamma, alpha, speedup, **extra):
  summary = dict(
    task=task, target="t5_1_1_xl", draft=draft, temperature=temperature, gamma=gamma,
    alpha=alpha, alpha_min_pq=alpha + 0.01, tokens_per_target_call=2.9, c=0.031, v=1.1,
    baseline_ms_per_token=20.0, speculative_ms_per_token=20.0 / speedup, speedup=speedup,
    expected_speedup=2.5, expected_speedup_v=2.3, interplay=1.15,
    expected_speedup_in_context=2.0, expected_speedup_whole_run=1.8, num_examples=64,
    mismatches_vs_baseline=0,
  )
  summary.update(extra)
  return summary


def _alpha_summary(task, draft, temperature, alpha):
  return dict(task=task, target="t5_1_1_xl", draft=draft, temperature=temperature,
        alpha_min_pq=alpha, num_tokens=10000, mode="alpha_only")


def _write(root, name, summary):
  run_dir = root / name
  run_dir.mkdir(parents=True)
  (run_dir / "summary.json").write_text(json.dumps(summary))


def _rows(markdown, title):
  """Table body rows (as cell lists) of the section whose heading contains title."""
  section = markdown.split(title, 1)[1].split("###", 1)[0]
  lines = [l for l in section.splitlines() if l.startswith("|")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  return [dict(zip(header, (c.strip() for c in l.strip("|").split("|")))) for l in lines[2:]]


@pytest.fixture
def runs(tmp_path):
  _write(tmp_path, "runs/ende_small_t0", _run_summary("wmt_ende", "t5_1_1_small", 0.0, 7, 0.712, 2.91))
  _write(tmp_path, "runs/cnn_base_t1", _run_summary("cnn_dailymail", "t5-v1_1-base", 1.0, 3, 0.5, 1.6))
  _write(tmp_path, "runs/bible_t07", _run_summary("bible", "demo_small", 0.7, 4, 0.6, 1.2,
                          mismatches_vs_baseline=None))
  _write(tmp_path, "alpha/ende_bigram", _alpha_summary("wmt_ende", "bigram", 1.0, 0.18))
  _write(tmp_path, "alpha/xl_t0", _alpha_summary("cnn_dailymail", "t5_1_1_xl", 0.0, 0.9))
  return tmp_path


def test_tables_match_paper_rows(make_tables, runs, capsys):
  assert make_tables.main([str(runs / "runs"), str(runs / "alpha" / "*")]) == 0
  md = capsys.readouterr().out

  t2 = {r["TASK"]: r for r in _rows(md, "Table 2")}
  assert set(t2) == {"wmt_ende", "cnn_dailymail", "bible"}
  ende = t2["wmt_ende"]
  assert (ende["alpha"], ende["SPEED"], ende["gamma"]) == ("0.71", "2.91", "7")
  assert (ende["alpha (paper)"], ende["speed (paper)"], ende["gamma (paper)"]) == ("0.75", "3.4", "7")
  cnn = t2["cnn_dailymail"]
  assert (cnn["alpha (paper)"], cnn["speed (paper)"], cnn["gamma (paper)"]) == ("0.55", "2.2", "3")
  bible = t2["bible"]  # no paper counterpart (task, and temperature 0.7)
  assert bible["alpha (paper)"] == bible["speed (paper)"] == bible["gamma (paper)"] == "-"
  assert bible["mismatches vs baseline"] == "-" and bible["TEMP"] == "0.7"

  t4 = {r["TASK"]: r for r in _rows(md, "Table 4")}
  assert (t4["wmt_ende"]["c"], t4["wmt_ende"]["EXP"], t4["wmt_ende"]["EXP (v)"]) == ("0.031", "2.50", "2.30")
  assert (t4["wmt_ende"]["interplay"], t4["wmt_ende"]["EXP (in context)"]) == ("1.15", "2.00")
  assert t4["wmt_ende"]["EXP (whole run)"] == "1.80"
  assert (t4["wmt_ende"]["c (paper)"], t4["wmt_ende"]["EXP (paper)"], t4["wmt_ende"]["EMP (paper)"]) == ("0.02", "3.2", "3.4")
  assert (t4["cnn_dailymail"]["EXP (paper)"], t4["cnn_dailymail"]["EMP (paper)"]) == ("1.8", "2.2")
  assert t4["bible"]["EXP (paper)"] == t4["bible"]["c (paper)"] == "-"

  t3 = {r["M_q"]: r for r in _rows(md, "Table 3")}
  assert set(t3) == {"bigram", "t5_1_1_xl"}  # alpha-only runs only
  assert (t3["bigram"]["alpha"], t3["bigram"]["alpha (paper)"], t3["bigram"]["tokens"]) == ("0.18", "0.19", "10000")
  assert t3["t5_1_1_xl"]["alpha (paper)"] == "-"  # the paper has no T5-XL draft


def test_out_file_and_ordering(make_tables, runs, tmp_path, capsys):
  out = tmp_path / "report" / "tables.md"
  assert make_tables.main([str(runs / "runs" / "*" / "summary.json"), "--out", str(out)]) == 0
  md = out.read_text()
  assert md == capsys.readouterr().out
  assert "Table 3" not in md  # no alpha-only summaries given
  assert [r["TASK"] for r in _rows(md, "Table 2")] == ["bible", "cnn_dailymail", "wmt_ende"]


def test_glob_skips_other_files(make_tables, runs, capsys):
  (runs / "runs" / "tables.md").write_text("| not json |")
  assert make_tables.main([str(runs / "runs" / "*")]) == 0
  assert len(_rows(capsys.readouterr().out, "Table 2")) == 3


def test_no_summaries(make_tables, tmp_path):
  assert make_tables.main([str(tmp_path / "nothing*")]) == 1


def test_paper_tables_consistent(make_tables):
  """Table 4's EMP is Table 2's SPEED, and Table 2's alpha matches Table 3."""
  t2, t3, t4 = (make_tables.PAPER_TABLES[k] for k in ("table2", "table3", "table4"))
  assert len(t2) == len(t4) == 12 and len(t3) == 32
  alpha3 = {(r["task"], r["draft"], r["temp"]): r["alpha"] for r in t3}
  for r2, r4 in zip(t2, t4):
    key = (r2["task"], r2["draft"], r2["temp"])
    assert key == (r4["task"], r4["draft"], r4["temp"])
    assert (r2["gamma"], r2["alpha"], r2["speed"]) == (r4["gamma"], r4["alpha"], r4["emp"])
    assert alpha3[key] == r2["alpha"]


@pytest.mark.parametrize("name,expected", [
  ("wmt_ende", "ende"), ("wmt_t2t_ende_v003", "ende"), ("cnn_dailymail_v002", "cnndm"), ("bible", None),
])
def test_canonical_task(make_tables, name, expected):
  assert make_tables.canonical_task(name) == expected


@pytest.mark.parametrize("name,expected", [
  ("t5_1_1_small", "t5-small"), ("google/t5-v1_1-base", "t5-base"), ("t5-large", "t5-large"),
  ("bigram", "bigram"), ("t5_1_1_xl", None),
])
def test_canonical_draft(make_tables, name, expected):
  assert make_tables.canonical_draft(name) == expected


def test_t5_1_0_rows_are_labelled(make_tables, tmp_path, capsys):
  """configs/table2_t5_1_0's rows (public T5 1.0 checkpoints) say they are T5 1.0,
  the T5 1.1 rows say T5 1.1, and the tables explain the difference."""
  _write(tmp_path, "t5_1_0", _run_summary("wmt_ende", "T5 1.0 small", 0.0, 7, 0.6, 2.0,
                                          target="T5 1.0 11B"))
  _write(tmp_path, "t5_1_1", _run_summary("cnn_dailymail", "T5-small", 0.0, 5, 0.6, 2.0,
                                          target="T5-XXL"))
  _write(tmp_path, "demo", _run_summary("bible", "draft", 0.0, 4, 0.6, 1.2, target="target"))
  _write(tmp_path, "alpha", dict(_alpha_summary("wmt_ende", "T5 1.0 base", 0.0, 0.7),
                                 target="T5 1.0 11B"))
  assert make_tables.main([str(tmp_path)]) == 0
  md = capsys.readouterr().out
  for title in ("Table 2", "Table 4"):
    family = {r["TASK"]: r["family"] for r in _rows(md, title)}
    assert family == {"wmt_ende": "T5 1.0", "cnn_dailymail": "T5 1.1", "bible": "-"}
  t2 = {r["TASK"]: r for r in _rows(md, "Table 2")}
  assert (t2["wmt_ende"]["M_p"], t2["wmt_ende"]["M_q"]) == ("T5 1.0 11B", "T5 1.0 small")
  assert [r["family"] for r in _rows(md, "Table 3")] == ["T5 1.0"]
  note = md.split("Table 2", 1)[1].split("|", 1)[0]
  assert "'T5 1.0' row ran the public T5 1.0 checkpoints" in note and "not the same" in note


@pytest.mark.parametrize("target,draft,family", [
  ("T5 1.0 11B", "T5 1.0 small", "T5 1.0"), ("t5-11b", "t5-small", "T5 1.0"),
  ("T5-XXL", "T5 1.0 base", "T5 1.0"), ("t5_1_1_xxl", "t5_1_1_small", "T5 1.1"),
  ("T5-XXL", "T5-small", "T5 1.1"), ("google/t5-v1_1-xl", "x", "T5 1.1"),
  ("target", "draft", "-"), ("t5_10b", "t5-1.05", "-"),
])
def test_model_family(make_tables, target, draft, family):
  assert make_tables.model_family(dict(target=target, draft=draft)) == family


def _with_positions(root, name, accepted_evaluated):
  """A run dir whose examples.jsonl lines carry per-position counts."""
  lines = [json.dumps({"index": i, "accepted_at": a, "evaluated_at": e})
           for i, (a, e) in enumerate(accepted_evaluated)]
  (root / name / "examples.jsonl").write_text("\n".join(lines) + "\n")


def test_acceptance_by_position_sums_the_lines(runs):
  from specdec_jax.scripting import tables
  run = runs / "runs" / "ende_small_t0"
  assert tables.acceptance_by_position(str(run)) is None  # no examples.jsonl
  _with_positions(runs / "runs", "ende_small_t0", [([3, 1, 0], [4, 3, 1]), ([1, 1, 1], [2, 1, 1])])
  assert tables.acceptance_by_position(str(run)) == pytest.approx([4 / 6, 2 / 4, 1 / 2])


def test_figures_are_written_next_to_the_markdown(make_tables, runs, tmp_path, capsys):
  pytest.importorskip("matplotlib", reason='the figures need matplotlib: pip install -e ".[figures]"')
  _with_positions(runs / "runs", "ende_small_t0", [([3, 1, 0, 0, 0, 0, 0], [4, 3, 1, 1, 1, 1, 1])])
  _with_positions(runs / "runs", "cnn_base_t1", [([2, 1, 0], [3, 2, 1])])
  out = tmp_path / "report" / "table2.md"
  assert make_tables.main([str(runs), "--out", str(out), "--figures"]) == 0
  assert "Table 2" in out.read_text()
  for name in ("speedup.png", "tokens_per_call.png", "acceptance.png"):
    png = out.parent / name
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, name
  assert "speedup.png" in capsys.readouterr().err


def test_figures_need_out_and_matplotlib(make_tables, runs, tmp_path, monkeypatch, capsys):
  with pytest.raises(SystemExit):
    make_tables.main([str(runs), "--figures"])
  assert "give --out too" in capsys.readouterr().err
  monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
  with pytest.raises(ImportError, match=r'pip install -e "\.\[figures\]"'):
    make_tables.main([str(runs), "--out", str(tmp_path / "t.md"), "--figures"])
  assert not (tmp_path / "t.md").exists()  # refused before anything is written


def test_figures_refuse_alpha_only_runs(runs, tmp_path):
  from specdec_jax.scripting import figures, tables
  summaries = tables.load_summaries(tables.find_summary_files([str(runs / "alpha")]))
  with pytest.raises(ValueError, match="no speculative-decoding run"):
    figures.write_figures(summaries, tmp_path)


def _demo_pair(root):
  """The demo pair's two rows (no paper row), with two draft positions each."""
  for name, t, speed in (("demo", 0.0, 1.33), ("demo_t1", 1.0, 1.11)):
    _write(root, name, _run_summary("bible_modernize", "draft_tiny+shortlist", t, 2, 0.7, speed,
                                    tokens_per_target_call_eq1=2.19))
    _with_positions(root, name, [([3, 2], [4, 3])])
  from specdec_jax.scripting import tables
  return tables.load_summaries(tables.find_summary_files([str(root)]))


def _drawn(fig):
  """Draws ``fig``; -> its axes, their legend (or None) and the two's boxes on the canvas."""
  fig.canvas.draw()
  ax = fig.axes[0]
  legend = ax.get_legend()
  return ax, legend, ax.get_window_extent(), legend and legend.get_window_extent()


def test_figures_draw_only_what_they_have_and_cover_no_bar(tmp_path):
  """Runs without a paper row: no legend entry for the paper's bars; rows
  named by draft and temperature; the legend beside the axes, not over a bar."""
  pytest.importorskip("matplotlib")
  from specdec_jax.scripting import figures
  runs = figures._runs(_demo_pair(tmp_path))
  plt = figures.pyplot()
  for draw, entries in ((figures.speedup_figure, ["measured"]),
                        (figures.tokens_figure, ["measured", "Eq. (1) at the run's α and γ"])):
    fig = draw(plt, runs)
    ax, legend, ax_box, legend_box = _drawn(fig)
    assert [t.get_text() for t in legend.get_texts()] == entries
    assert len(ax.containers) == len(entries)  # one bar series per entry
    assert legend_box.x0 >= ax_box.x1  # beside the axes: over no bar
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "draft_tiny+shortlist, T = 0", "draft_tiny+shortlist, T = 1"]
    plt.close(fig)


def test_acceptance_has_whole_positions_and_rows_named_by_draft_and_t(tmp_path):
  pytest.importorskip("matplotlib")
  from specdec_jax.scripting import figures
  runs = figures._runs(_demo_pair(tmp_path))
  plt = figures.pyplot()
  fig = figures.acceptance_figure(plt, runs)
  ax, legend, ax_box, legend_box = _drawn(fig)
  lo, hi = ax.get_xlim()
  ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
  assert ticks == [1.0, 2.0], ticks
  assert [t.get_text() for t in legend.get_texts()] == [
      "draft_tiny+shortlist, T = 0", "draft_tiny+shortlist, T = 1"]
  assert legend_box.x0 >= ax_box.x1
  plt.close(fig)


def test_row_labels_add_the_task_and_gamma_only_where_needed():
  from specdec_jax.scripting import figures
  one = dict(task="wmt_ende", draft="small", temperature=0.0, gamma=7)
  assert figures.row_labels([one, {**one, "temperature": 1.0}]) == [
      "small, T = 0", "small, T = 1"]
  assert figures.row_labels([one, {**one, "task": "cnn_dailymail"}]) == [
      "wmt_ende: small, T = 0", "cnn_dailymail: small, T = 0"]
  assert figures.row_labels([one, {**one, "gamma": 3}]) == [
      "small, T = 0, γ 7", "small, T = 0, γ 3"]
