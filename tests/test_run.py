"""End to end: ``python -m specdec_jax.run`` on tiny random models and a local file."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import gin
import jax
import numpy as np
import pytest

from specdec_jax import run
from lab import accounting as research_accounting
from specdec_jax.run import account as accounting

import toy_env

REPO = Path(__file__).resolve().parent.parent
SUMMARY_KEYS = {"task", "target", "draft", "temperature", "gamma", "alpha", "alpha_min_pq",
                "tokens_per_target_call", "c", "v", "baseline_ms_per_token",
                "speculative_ms_per_token", "speedup", "expected_speedup",
                "expected_speedup_v", "expected_speedup_in_context", "interplay",
                "num_examples", "mismatches_vs_baseline"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """A tiny vocabulary, target/draft checkpoints, a TSV and a gin file."""
  return toy_env.build(tmp_path_factory.mktemp("run"))


def _run(env, *args, check=True, **popen):
  cmd = [sys.executable, "-m", "specdec_jax.run", f"--config={env / 'exp.gin'}", *args]
  e = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  if popen:
    return subprocess.Popen(cmd, cwd=REPO, env=e, **popen)
  res = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=600)
  if check:
    assert res.returncode == 0, res.stderr[-3000:]
  return res


def _lines(path: Path) -> list[dict]:
  return [json.loads(l) for l in path.read_text().splitlines()]


def test_run_writes_results_and_resumes_after_a_kill(env):
  # 1) A complete run: files, keys, the Table-2 row, and recomputable numbers.
  w = env / "w_full"
  res = _run(env, f"--workdir={w}")
  assert "| TASK | M_q | TEMP |" in res.stdout and "| toy | draft | 0 | 3 |" in res.stdout
  # By default: the row and the closing sentence on stdout; on stderr each
  # step announced before it runs, as plain lines (no logging prefix).
  out = res.stdout.strip().splitlines()
  assert len(out) == 5 and out[3].startswith("Speculative decoding was "), res.stdout
  assert "EXP in context" not in res.stdout and "Whole run" not in res.stdout
  err = res.stderr.splitlines()
  steps = ["Speculative decoding vs the baseline: target target, draft draft, γ 3, T 0, 4 "
           "examples of toy", "Loading the target and the draft (",
           "Compiling the baseline and speculative programs for 1 input width (24)",
           "  width 24: baseline ", "Measuring c, v and the prefill (6 small programs",
           "Timing the baseline and speculative decoding on 4 examples", "[4/4] "]
  at = [next((i for i, l in enumerate(err) if l.startswith(p)), None) for p in steps]
  assert None not in at and at == sorted(at), res.stderr
  assert not [l for l in err if re.match(r"[IWEF]\d{4} ", l)], res.stderr
  s = json.loads((w / "summary.json").read_text())
  assert SUMMARY_KEYS <= set(s)
  recs = _lines(w / "examples.jsonl")
  assert len(recs) == 4 == s["num_examples"]
  assert s["mismatches_vs_baseline"] == 0 and all(r["matches_baseline"] for r in recs)
  acc = sum(r["accepted"] for r in recs)
  ev = acc + sum(r["rejected"] for r in recs)
  assert s["alpha"] == pytest.approx(acc / ev)
  assert s["alpha_min_pq"] == pytest.approx(sum(r["min_pq_sum"] for r in recs) / ev)
  assert s["speedup"] == pytest.approx(sum(r["baseline_s"] for r in recs)
                                       / sum(r["speculative_s"] for r in recs))
  assert s["c"] == pytest.approx(np.median([r["c"] for r in recs]))
  assert s["v"] == pytest.approx(np.median([r["v"] for r in recs]))
  assert s["interplay"] == pytest.approx(np.median([r["interplay"] for r in recs]))
  assert s["expected_speedup_in_context"] == pytest.approx(
      s["expected_speedup_v"] / s["interplay"], rel=1e-9)
  assert s["tokens_per_target_call_eq1"] == pytest.approx(
      (1 - s["alpha"] ** 4) / (1 - s["alpha"]))  # γ 3
  assert all(r["prefill_baseline_ms"] > 0 and r["prefill_speculative_ms"] > 0 for r in recs)
  whole = accounting.attribute(recs, accounting.prefill_of(recs),
                               [r["input_width"] for r in recs])
  assert s["expected_speedup_whole_run"] == pytest.approx(whole.expected_whole_run)
  # The cost account, under --verbose, from summary.json alone.
  account = run.report.table2_row(s, verbose=True)
  assert "| EXP (Thm 3.8) | EXP (with v) | mismatches |" in account
  assert f"EXP in context: {s['expected_speedup_in_context']:.2f}X" in account
  assert f"= {whole.expected_whole_run:.2f}X; SPEED / whole run" in account
  assert f"| {s['expected_speedup_v']:.2f}X |" in res.stdout
  assert "Experiment.gamma = 3" in (w / "config.gin").read_text()

  # 2) Kill midway, leave a torn last line, resume: nothing lost or duplicated.
  w = env / "w_kill"
  n = 60
  proc = _run(env, f"--workdir={w}", f"--gin_bindings=Experiment.num_examples = {n}",
              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  path = w / "examples.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and not (path.exists() and path.read_text().count("\n") >= 2):
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  before = path.read_text()
  assert 2 <= before.count("\n") < n, "the run was not interrupted midway"
  with open(path, "a") as f:
    f.write('{"index": 999, "id": "torn')  # an interrupted write
  _run(env, f"--workdir={w}", f"--gin_bindings=Experiment.num_examples = {n}", "--resume")
  after = path.read_text()
  assert after.startswith(before)
  recs = _lines(path)
  assert sorted(r["index"] for r in recs) == list(range(1, n + 1))
  assert json.loads((w / "summary.json").read_text())["num_examples"] == n

  # 3) Without --resume an existing workdir is refused and left untouched.
  res = _run(env, f"--workdir={w}", f"--gin_bindings=Experiment.num_examples = {n}",
             check=False)
  assert res.returncode != 0 and "--resume" in res.stderr
  assert path.read_text() == after


def test_alpha_only(env):
  w = env / "w_alpha"
  res = _run(env, f"--workdir={w}", "--alpha_only", "--gin_bindings=Experiment.draft_name = "
             "'bigram'", f"--gin_bindings=Experiment.ngram_corpus = '{env / 'data.tsv'}'",
             "--gin_bindings=Experiment.draft_checkpoint = ''",
             "--gin_bindings=Experiment.alpha_only_tokens = 40")
  s = json.loads((w / "summary.json").read_text())
  assert s["mode"] == "alpha_only" and s["num_tokens"] >= 40 and 0 <= s["alpha_min_pq"] <= 1
  recs = _lines(w / "examples.jsonl")
  assert s["alpha_min_pq"] == pytest.approx(sum(r["min_pq_sum"] for r in recs)
                                            / sum(r["tokens"] for r in recs))
  assert "alpha" in res.stdout


BAD = {
    "missing checkpoint": ("Experiment.target_checkpoint = '/nonexistent/ckpt'",
                           "target_checkpoint"),
    "vocab mismatch": ("Experiment.draft_checkpoint = '{env}/draft_v65'", "vocab_size"),
    "gamma < 1": ("Experiment.gamma = 0", "gamma must be >= 1 .*, got 0; .*'auto' chooses "
                  r"plain decoding \(γ = 0\)"),
    "temperature < 0": ("SamplingConfig.temperature = -0.5", "temperature must be >= 0"),
    "topp outside (0, 1]": ("SamplingConfig.topp = 1.5", "topp must be in"),
    "topk with topp": ("SamplingConfig.topk = 5\nSamplingConfig.topp = 0.9", "cannot both be set"),
    "too-long input": ("Experiment.max_input_len = 3\nExperiment.on_too_long = 'error'",
                       "max_len=3"),
    "empty input": ("Experiment.source = '{env}/empty.tsv'", "empty"),
    "unknown draft": ("Experiment.draft_name = 'quadgram'", "unknown approximation model"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_fails_clearly_before_work(env, case):
  (env / "empty.tsv").write_text("id\tinput\treference\na\t\tb\n")
  binding, message = BAD[case]
  with pytest.raises(Exception, match=message):
    exp = run.parse_config([str(env / "exp.gin")], [binding.format(env=env)])
    run.prepare(exp)


def test_unknown_binding_fails_with_gins_error(env):
  with pytest.raises(ValueError, match="gama"):
    run.parse_config([str(env / "exp.gin")], ["Experiment.gama = 3"])
  gin.clear_config()


def test_paper_configs_parse_with_the_papers_gamma():
  """Every Table 2/3 config parses; Table 2's γ and temperature are the paper's."""
  sys.path.insert(0, str(REPO / "scripts"))
  from make_tables import PAPER_TABLES
  paper = {(r["task"], r["draft"].replace("t5-", ""), r["temp"]): r["gamma"]
           for r in PAPER_TABLES["table2"]}
  files = sorted((REPO / "configs" / "table2").glob("*.gin"))
  assert len(files) == 12
  for f in files:
    task, draft, temp = f.stem.split("_")
    exp = run.parse_config([str(f)], [])
    assert exp.gamma == paper[(task, draft, int(temp[1:]))], f
    assert exp.sampling.temperature == float(temp[1:]) and exp.draft_preset == f"t5_1_1_{draft}"
    assert exp.target_preset == "t5_1_1_xxl" and exp.vocab_extra_ids == 100
    with pytest.raises(ValueError, match="target_checkpoint is not set"):
      exp.validate()
  for f in sorted((REPO / "configs" / "table3").glob("*.gin")):
    exp = run.parse_config([str(f)], [])
    assert exp.alpha_only_tokens == 10_000
  gin.clear_config()


# ------------------------------------------------------- issue 9: integrity


def _snapshot(w: Path) -> dict[str, bytes]:
  """Every file under a workdir, for 'nothing was changed' assertions."""
  return {str(p.relative_to(w)): p.read_bytes() for p in sorted(w.rglob("*")) if p.is_file()}


def _cli(capsys, *args) -> tuple[int, str, str]:
  """Runs the runner in-process (jit caches are shared across calls)."""
  capsys.readouterr()
  rc = run.run_args(list(args))
  out = capsys.readouterr()
  return rc, out.out, out.err


@pytest.fixture(scope="module")
def spec_run(env):
  """One finished speculative run (2 examples; example ex1's input is truncated)."""
  rows = (env / "data.tsv").read_text().splitlines()
  long = " ".join(toy_env.WORDS * 3)
  rows[2] = f"ex1\t{long}\t{long}"  # index 1: the first measured example
  (env / "data_long.tsv").write_text("\n".join(rows) + "\n")
  cfg = env / "spec.gin"
  cfg.write_text((env / "exp.gin").read_text().replace(str(env / "data.tsv"),
                                                       str(env / "data_long.tsv"))
                 + "Experiment.num_examples = 2\n")
  w = env / "w_spec"
  assert run.run_args([f"--config={cfg}", f"--workdir={w}"]) == 0
  return cfg, w


def test_truncated_inputs_are_logged_and_marked(spec_run, env):
  cfg, w = spec_run
  recs = _lines(w / "examples.jsonl")
  assert [r["input_truncated"] for r in recs] == [True, False]
  assert all(r["mode"] == "speculative" for r in recs)
  exp = run.parse_config([str(cfg)], ["Experiment.on_too_long = 'error'"])
  with pytest.raises(ValueError, match=r"example id='ex1' has \d+ tokens .*max_len=24"):
    run.prepare(exp)


def test_whole_run_account_reads_a_finished_workdir(spec_run, tmp_path):
  cfg, w = spec_run
  s = json.loads((w / "summary.json").read_text())
  assert research_accounting.attribute_run(str(w)).expected_whole_run == pytest.approx(
      s["expected_speedup_whole_run"])
  # Lines from before the runner timed the prefill: attribute_run times it.
  old = tmp_path / "old"
  old.mkdir()
  shutil.copy(w / "config.gin", old / "config.gin")
  keys = ("input_width", "prefill_baseline_ms", "prefill_speculative_ms")
  (old / "examples.jsonl").write_text("".join(
      json.dumps({k: v for k, v in r.items() if k not in keys}) + "\n"
      for r in _lines(w / "examples.jsonl")))
  a = research_accounting.attribute_run(str(old), repeats=2)
  assert a.speed == pytest.approx(s["speedup"])
  assert a.alpha == pytest.approx(s["alpha"])
  assert a.tokens_per_call == pytest.approx(s["tokens_per_target_call"])
  assert a.expected_v == pytest.approx(s["expected_speedup_v"])
  assert a.expected_in_context == pytest.approx(s["expected_speedup_in_context"])
  assert a.prefill_baseline_ms > 0 and a.prefill_speculative_ms > 0
  with pytest.raises(FileNotFoundError, match="config.gin not found"):
    research_accounting.attribute_run(str(tmp_path / "none"))


def test_workdir_mode_is_recorded_and_the_other_mode_refused(spec_run, env, capsys, tmp_path):
  cfg, w = spec_run
  before = _snapshot(w)
  rc, _, err = _cli(capsys, f"--config={cfg}", f"--workdir={w}", "--resume", "--alpha_only")
  assert rc == 2 and "holds a speculative run" in err and "this run is alpha_only" in err
  assert _snapshot(w) == before
  # The reverse: an alpha-only workdir (a line written before modes were recorded).
  wa = tmp_path / "alpha"
  wa.mkdir()
  (wa / "examples.jsonl").write_text('{"index": 1, "id": "ex1", "tokens": 5, '
                                     '"min_pq_sum": 2.0, "alpha_min_pq": 0.4}\n')
  before = _snapshot(wa)
  rc, _, err = _cli(capsys, f"--config={cfg}", f"--workdir={wa}", "--resume")
  assert rc == 2 and "holds a alpha_only run" in err and "this run is speculative" in err
  assert _snapshot(wa) == before


def test_failed_run_leaves_no_files_and_a_stale_config_is_replaced(spec_run, env, capsys,
                                                                   tmp_path, monkeypatch):
  cfg, _ = spec_run
  # Dies after loading, during warm-up (Ctrl-C): no directory, no config.gin.
  w = tmp_path / "died"

  def interrupt(*a, **k):
    raise KeyboardInterrupt
  with monkeypatch.context() as m:
    m.setattr(run.calibrate, "block", interrupt)
    rc, _, err = _cli(capsys, f"--config={cfg}", f"--workdir={w}")
  assert rc == 130 and "interrupted" in err and not w.exists()
  # A workdir holding only a stale config.gin (old runner) is reused, and its
  # config.gin replaced by the one describing the results.
  w.mkdir()
  (w / "config.gin").write_text("Experiment.gamma = 2\n")
  rc, out, err = _cli(capsys, f"--config={cfg}", f"--workdir={w}", "--resume")
  assert rc == 0, err
  assert "Experiment.gamma = 3" in (w / "config.gin").read_text()
  assert len(_lines(w / "examples.jsonl")) == 2


@pytest.mark.parametrize("binding,message", [
    ("Experiment.gamma = 2.5", r"Experiment.gamma must be int or str, got 2.5 \(float\)"),
    ("Experiment.gamma = '3'", r"Experiment.gamma must be an int >= 1 or 'auto', got '3'"),
    ("Experiment.auto_gamma_max = 0", r"Experiment.auto_gamma_max must be >= 1, got 0"),
    ("Experiment.auto_alpha_source = 'x.tsv'\nExperiment.auto_alpha_examples = 0",
     r"Experiment.auto_alpha_examples must be >= 1 with auto_alpha_source='x.tsv', got 0"),
    ("Experiment.mesh_shape = (1, 1, 1)", r"mesh_shape must be None or two positive ints"),
    ("Experiment.partition_fallback = 'pad'", r"partition_fallback must be one of"),
    ("Experiment.dtype = 'float8'", r"Experiment.dtype must be one of .*got 'float8'"),
    ("Experiment.input_buckets = (32, 16)",
     r"Experiment.input_buckets must be strictly increasing ints in \[1, max_input_len="),
    ("Experiment.max_decode_len = 1000000000",
     r"Experiment.max_decode_len=1000000000 .* needs about \d+\.\d GiB .*target KV cache"),
])
def test_types_and_sizes_fail_before_loading(env, monkeypatch, binding, message):
  def no_load(*a, **k):
    raise AssertionError("weights were read")
  monkeypatch.setattr(run.setup, "_load_model", no_load)
  exp = run.parse_config([str(env / "exp.gin")], [binding])
  # no_load proves no weight was read; a huge cache would fail with another error.
  with pytest.raises(ValueError, match=message):
    run.prepare(exp)


def test_data_errors_name_file_and_line(spec_run, env, capsys, tmp_path):
  bad = tmp_path / "latin1.tsv"
  bad.write_bytes("id\tinput\treference\na\tthou\tyou\nb\tcaf\xe9\tx\n".encode("latin-1"))
  with pytest.raises(ValueError, match=r"latin1.tsv:3: not valid UTF-8 \(byte 0xe9"):
    run.load_data(run.parse_config([str(env / "exp.gin")],
                                   [f"Experiment.source = '{bad}'"]))
  # A corrupt middle line of examples.jsonl: refused on resume, nothing changed.
  cfg, w0 = spec_run
  w = tmp_path / "w"
  shutil.copytree(w0, w)
  lines = (w / "examples.jsonl").read_text().splitlines()
  (w / "examples.jsonl").write_text(lines[0][:40] + "\n" + lines[1] + "\n")
  before = _snapshot(w)
  rc, _, err = _cli(capsys, f"--config={cfg}", f"--workdir={w}", "--resume")
  assert rc == 2 and "examples.jsonl:1: corrupt line" in err
  assert _snapshot(w) == before


# ------------------------------------------------ issue 9: drafts from outside


@pytest.fixture
def registry():
  """Removes whatever a test registers."""
  from specdec_jax import drafts
  before = dict(drafts.REGISTRY)
  yield drafts
  drafts.REGISTRY.clear()
  drafts.REGISTRY.update(before)
  sys.modules.pop("my_draft", None)


def test_example_draft_runs_from_outside_the_repo(env, capsys, tmp_path, monkeypatch,
                                                  registry):
  """examples/my_draft.py, copied to a directory outside the repo, via --import."""
  shutil.copy(REPO / "examples" / "my_draft.py", tmp_path / "my_draft.py")
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  rc, out, err = _cli(capsys, f"--config={env / 'exp.gin'}", "--import=my_draft",
                      "--workdir=w", "--gin_bindings=Experiment.draft_name = 'repeat_last'",
                      "--gin_bindings=Experiment.draft_checkpoint = ''",
                      "--gin_bindings=Experiment.num_examples = 2")
  assert rc == 0, err
  assert "| toy | repeat_last | 0 | 3 |" in out
  s = json.loads((tmp_path / "w" / "summary.json").read_text())
  assert s["mismatches_vs_baseline"] == 0 and s["num_examples"] == 2
  # The other documented way: gin's own `import` line in the user's config.
  registry.REGISTRY.pop("repeat_last")
  sys.modules.pop("my_draft")
  (tmp_path / "mine.gin").write_text("import my_draft\nExperiment.draft_name = 'repeat_last'\n")
  assert run.parse_config([str(tmp_path / "mine.gin")], []).draft_name == "repeat_last"
  assert "repeat_last" in registry.REGISTRY


def test_bad_drafts_fail_clearly_before_compilation(env, registry):
  import jax.numpy as jnp
  from flax import struct

  @registry.register("short_q")
  @struct.dataclass
  class ShortQ:  # registered as a class; q misses the last token of the vocabulary
    vocab_size: int = struct.field(pytree_node=False)

    def init(self, inputs, cache_len):
      return ()

    def propose(self, state, seq, length, gamma, sampling, key):
      b = seq.shape[0]
      return (jnp.zeros((b, gamma), jnp.int32),
              jnp.full((b, gamma, self.vocab_size - 1), 1.0 / (self.vocab_size - 1)), state)

    def commit(self, state, seq, length):
      return state

  @registry.register("not_a_distribution")
  def build_doubled(vocab_size):  # registered as a builder function
    return _Doubled(vocab_size)

  base = ["Experiment.draft_checkpoint = ''"]
  exp = run.parse_config([str(env / "exp.gin")], base + ["Experiment.draft_name = 'short_q'"])
  with pytest.raises(ValueError, match=r"approximation model 'short_q' \(.*ShortQ\)\.propose "
                     r"returned tokens \(1, 3\) int32 and q \(1, 3, 63\).*expected.*\(1, 3, 64\)"):
    run.prepare(exp)
  exp = run.parse_config([str(env / "exp.gin")],
                         base + ["Experiment.draft_name = 'not_a_distribution'"])
  with pytest.raises(ValueError, match=r"'not_a_distribution' .*\.propose returned a q "
                     r"\(1, 3, 64\) that is not a distribution.*sums in \[2"):
    run.prepare(exp)
  # A draft that takes no checkpoint, given one: refused before any loading.
  exp = run.parse_config([str(env / "exp.gin")], ["Experiment.draft_name = 'prompt_lookup'"])
  with pytest.raises(ValueError, match=r"draft_checkpoint=.* is set but approximation model "
                     r"'prompt_lookup' takes no checkpoint"):
    exp.validate()


class _Doubled:
  """A plain-class draft whose q sums to 2."""

  def __init__(self, vocab_size):
    self.vocab_size = vocab_size

  def init(self, inputs, cache_len):
    return ()

  def propose(self, state, seq, length, gamma, sampling, key):
    import jax.numpy as jnp
    b = seq.shape[0]
    return (jnp.zeros((b, gamma), jnp.int32),
            jnp.full((b, gamma, self.vocab_size), 2.0 / self.vocab_size), state)

  def commit(self, state, seq, length):
    return state


# ------------------------------------- issue 9: errors, packaging, workflow


def test_corrupt_checkpoint_ends_in_one_clear_line_from_outside_the_repo(env, tmp_path):
  """A subprocess run from a directory outside the repo (python -m works anywhere)."""
  ckpt = tmp_path / "target"
  shutil.copytree(env / "target", ckpt)
  data_file = max((p for p in ckpt.rglob("*") if p.is_file() and "ocdbt.process" in str(p)),
                  key=lambda p: p.stat().st_size)
  raw = bytearray(data_file.read_bytes())
  raw[: len(raw) // 2] = bytes(len(raw) // 2)
  data_file.write_bytes(bytes(raw))
  cmd = [sys.executable, "-m", "specdec_jax.run", f"--config={env / 'exp.gin'}",
         f"--gin_bindings=Experiment.target_checkpoint = '{ckpt}'", "--workdir=w"]
  e = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  res = subprocess.run(cmd, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=300)
  last = res.stderr.strip().splitlines()[-1]
  assert res.returncode == 2, res.stderr[-3000:]
  assert last.startswith("error: ") and str(ckpt / "params") in last, res.stderr[-3000:]
  assert "corrupt or unreadable checkpoint data" in last
  assert "Traceback" not in res.stderr
  assert not (tmp_path / "w").exists()


def test_quiet_unraisable_drops_only_the_closed_loop_report(capsys, monkeypatch):
  """TensorStore's late 'Event loop is closed' reports are dropped; others still print."""

  class Boom:
    def __init__(self, message):
      self.message = message

    def __del__(self):
      raise RuntimeError(self.message)

  monkeypatch.setattr(run.logs, "_previous_unraisablehook", sys.__unraisablehook__)
  monkeypatch.setattr(sys, "unraisablehook", run.logs.quiet_unraisable)
  Boom("Event loop is closed")  # dropped at once: __del__ raises, Python reports it unraisable
  assert capsys.readouterr().err == ""
  Boom("something else")
  assert "something else" in capsys.readouterr().err


def test_pyproject_lists_the_package_and_runtime_deps():
  import tomllib
  meta = tomllib.loads((REPO / "pyproject.toml").read_text())
  req = [l.strip() for l in (REPO / "requirements.txt").read_text().splitlines()
         if l.strip() and not l.startswith("#") and not l.startswith("pytest")]
  assert meta["project"]["name"] == "specdec_jax"
  assert sorted(meta["project"]["dependencies"]) == sorted(req)
  assert meta["build-system"]["build-backend"] == "setuptools.build_meta"


def test_relative_paths_resolve_next_to_the_config(env, tmp_path, monkeypatch):
  d = tmp_path / "cfgdir"
  d.mkdir()
  shutil.copy(env / "data.tsv", d / "mydata.tsv")
  (d / "rel.gin").write_text(f"include '{env / 'exp.gin'}'\n"
                             "Experiment.source = 'mydata.tsv'\n")
  monkeypatch.chdir(tmp_path)  # neither the config's directory nor the repo
  exp = run.parse_config([str(d / "rel.gin")], [])
  exp.validate()
  assert Path(exp.resolve(exp.source)) == d / "mydata.tsv"


def test_resume_prints_a_finished_run_and_extends_a_raised_num_examples(
    spec_run, capsys, tmp_path, monkeypatch):
  cfg, w0 = spec_run
  w = tmp_path / "w"
  shutil.copytree(w0, w)
  before = _snapshot(w)

  def no_models(*a, **k):
    raise AssertionError("models were loaded")
  with monkeypatch.context() as m:
    m.setattr(run.cli, "load_models", no_models)
    rc, out, err = _cli(capsys, f"--config={cfg}", f"--workdir={w}", "--resume")
  assert rc == 0, err
  assert "| TASK | M_q |" in out and "| toy | draft | 0 | 3 |" in out
  assert _snapshot(w) == before
  # Lowering num_examples is refused; raising it extends the run.
  rc, _, err = _cli(capsys, f"--config={cfg}", f"--workdir={w}", "--resume",
                    "--gin_bindings=Experiment.num_examples = 1")
  assert rc == 2 and "can only be raised on resume" in err and _snapshot(w) == before
  rc, _, err = _cli(capsys, f"--config={cfg}", f"--workdir={w}", "--resume",
                    "--gin_bindings=Experiment.gamma = 2")
  assert rc == 2 and "+ Experiment.gamma = 2" in err and _snapshot(w) == before
  rc, out, err = _cli(capsys, f"--config={cfg}", f"--workdir={w}", "--resume",
                      "--gin_bindings=Experiment.num_examples = 3")
  assert rc == 0, err
  assert (w / "examples.jsonl").read_bytes().startswith(before["examples.jsonl"])
  assert [r["index"] for r in _lines(w / "examples.jsonl")] == [1, 2, 3]
  assert "Experiment.num_examples = 3" in (w / "config.gin").read_text()


def test_alpha_only_skips_warmup_and_says_when_examples_ran_out(env, capsys, tmp_path):
  w = tmp_path / "a"
  rc, out, err = _cli(capsys, f"--config={env / 'exp.gin'}", f"--workdir={w}", "--alpha_only",
                      "--gin_bindings=Experiment.num_examples = 2",
                      "--gin_bindings=Experiment.alpha_only_tokens = 1000000")
  assert rc == 0, err
  assert [r["index"] for r in _lines(w / "examples.jsonl")] == [1, 2]  # index 0 is warm-up
  assert "examples ran out after 2 examples" in out and "alpha_only_tokens=1000000" in out
  s = json.loads((w / "summary.json").read_text())
  assert s["budget_reached"] is False and s["num_examples"] == 2


def test_table2_config_lists_every_missing_macro():
  exp = run.parse_config([str(REPO / "configs/table2/ende_small_t0.gin")],
                         ["VOCAB_PATH = ''"])
  with pytest.raises(ValueError) as e:
    exp.validate()
  msg = str(e.value)
  for macro, field in (("TARGET_CHECKPOINT", "target_checkpoint"),
                       ("DRAFT_SMALL_CHECKPOINT", "draft_checkpoint"),
                       ("VOCAB_PATH", "vocab_path")):
    assert f"{macro} (Experiment.{field} is not set" in msg
  gin.clear_config()


def test_help_lists_settings_and_library_info_is_quiet():
  import logging as std_logging
  doc = run.cli.__doc__
  assert "Experiment settings" in doc and "  gamma = 5: draft tokens per round" in doc
  assert "  dtype = 'float32': the dtype activations run at." in doc
  f = run.logs.LibraryFilter()
  rec = lambda path, level: std_logging.LogRecord("absl", level, path, 1, "m", (), None)
  assert not f.filter(rec("/site-packages/orbax/checkpoint/x.py", std_logging.INFO))
  assert f.filter(rec("/site-packages/orbax/checkpoint/x.py", std_logging.WARNING))
  assert f.filter(rec(str(REPO / "specdec_jax" / "run" / "cli.py"), std_logging.INFO))


def _forced_costs(**costs):
  """A stand-in for ``calibrate.costs_many`` that returns the round cost
  ``costs`` (``theory.RoundCost``'s fields but γ) for every γ."""
  from specdec_jax.theory import RoundCost
  return lambda setup, gammas: {g: RoundCost(g, **costs) for g in gammas}


def test_gamma_auto_chooses_the_theorys_argmax_and_keeps_it_on_resume(env, capsys, caplog,
                                                                      tmp_path, monkeypatch):
  """gamma='auto': α on the warm-up examples, c and v per γ, the argmax of the
  v-generalized Theorem 3.8 and the smallest γ within one standard error of
  it (recomputed here from the recorded numbers); a
  resumed run keeps the γ it chose; too few warm-up tokens are warned about.
  The draft is the target's near copy and the costs the choice sees are
  forced cheap (c 0.05, v 1), so that some γ pays (on these toy models none
  does: plain decoding, tested below)."""
  import logging as std_logging
  from specdec_jax.run import autogamma
  monkeypatch.setattr(run.calibrate, "costs_many", _forced_costs(
      c=0.05, v=1.0, step_ms=1.0, c_se=0.01, v_se=0.05, round_se=0.02))
  caplog.set_level(std_logging.WARNING)
  w = tmp_path / "auto"
  args = [f"--config={env / 'exp.gin'}", f"--workdir={w}",
          f"--gin_bindings=Experiment.draft_checkpoint = '{env / 'draft_near'}'",
          "--gin_bindings=Experiment.gamma = 'auto'",
          "--gin_bindings=Experiment.auto_gamma_max = 3",
          "--gin_bindings=Experiment.num_examples = 2"]
  rc, _, err = _cli(capsys, *args)
  assert rc == 0, err
  s = json.loads((w / "summary.json").read_text())
  auto = s["gamma_auto"]
  assert set(auto["predicted"]) == {"1", "2", "3"} and auto["alpha_tokens"] > 0
  from specdec_jax import theory
  for g in ("1", "2", "3"):
    assert auto["predicted"][g] == pytest.approx(theory.walltime_improvement(
        min(auto["alpha_warmup"], 1 - 1e-12), int(g), auto["c"][g], auto["v"][g]))
    assert auto["predicted_se"][g] == pytest.approx(theory.improvement_se(
        auto["alpha_warmup"], int(g), auto["c"][g], auto["v"][g], auto["alpha_se"], 0.0,
        auto["round_se"][g]))
  best = max(auto["predicted"].values())
  assert auto["argmax"] == min(int(g) for g, x in auto["predicted"].items() if x == best)
  # The choice: the smallest γ within one standard error of the argmax's prediction
  # whose gain exceeds its own standard error (all do here: the costs are cheap).
  assert auto["alpha_se"] >= 0 and auto["gap_se"][str(auto["argmax"])] == 0
  assert all(x - 1 > auto["predicted_se"][g] for g, x in auto["predicted"].items())
  assert best >= 1 and auto["gamma"] == min(int(g) for g, x in auto["predicted"].items()
                                           if best - x <= auto["gap_se"][g])
  assert s["gamma"] == auto["gamma"]
  # The run records the costs the choice was made with (one measurement).
  assert s["c"] == pytest.approx(0.05) and s["v"] == pytest.approx(1.0)
  assert auto["alpha_tokens"] < autogamma.MIN_ALPHA_TOKENS
  assert any(f"only {auto['alpha_tokens']} target tokens" in r.getMessage()
             for r in caplog.records)
  recs = _lines(w / "examples.jsonl")
  assert [r["gamma"] for r in recs] == [auto["gamma"]] * 2
  rc, _, err = _cli(capsys, *args[:-1], "--gin_bindings=Experiment.num_examples = 3", "--resume")
  assert rc == 0, err
  recs = _lines(w / "examples.jsonl")
  assert len(recs) == 3 and {r["gamma"] for r in recs} == {auto["gamma"]}
  assert all(r["gamma_auto"] == auto for r in recs)
  # A held-out source for α: its first auto_alpha_examples examples, not the warm-up.
  w2 = tmp_path / "auto_held_out"
  rc, _, err = _cli(capsys, args[0], f"--workdir={w2}", *args[2:],
                    f"--gin_bindings=Experiment.auto_alpha_source = '{env / 'data.tsv'}'",
                    "--gin_bindings=Experiment.auto_alpha_examples = 6")
  assert rc == 0, err
  held = json.loads((w2 / "summary.json").read_text())["gamma_auto"]
  assert held["alpha_tokens"] > auto["alpha_tokens"]


def test_gamma_auto_chooses_plain_decoding_where_no_gamma_pays(env, capsys, tmp_path,
                                                              monkeypatch):
  """gamma='auto' where the costs it measures (forced here: verification 5
  one-token steps, the draft 0.9 of one) make Theorem 3.8 predict < 1x for
  every γ: it chooses plain decoding (γ = 0), records and prints the choice,
  and runs the baseline only, so its outputs are the baseline's token for
  token and speculative decoding never runs."""
  from specdec_jax.run import autogamma
  monkeypatch.setattr(run.calibrate, "costs_many", _forced_costs(c=0.9, v=5.0, step_ms=1.0))
  monkeypatch.setattr(run.programs, "speculative_decode",
                      lambda *a, **k: pytest.fail("speculative decoding ran"))
  w = tmp_path / "plain"
  rc, out, err = _cli(capsys, f"--config={env / 'exp.gin'}", f"--workdir={w}",
                      "--gin_bindings=Experiment.gamma = 'auto'",
                      "--gin_bindings=Experiment.auto_gamma_max = 3",
                      "--gin_bindings=Experiment.num_examples = 2")
  assert rc == 0, err
  s = json.loads((w / "summary.json").read_text())
  auto = s["gamma_auto"]
  assert s["gamma"] == 0 and auto["gamma"] == 0 and auto["plain"]
  assert max(auto["predicted"].values()) < 1 and set(auto["predicted"]) == {"1", "2", "3"}
  assert s["mismatches_vs_baseline"] == 0 and s["expected_speedup"] is None
  recs = _lines(w / "examples.jsonl")
  for r in recs:
    assert r["matches_baseline"] and r["output"] == r["baseline_output"]
    assert r["gamma"] == 0 and r["draft_calls"] == 0 and r["target_calls"] == r["tokens"]
    assert r["gamma_auto"] == auto
  assert "0 (plain decoding)" in out and "gamma='auto' chose plain decoding (γ = 0)" in out
  assert "decoded with the target alone" in out


def test_gamma_auto_speculates_only_on_a_gain_beyond_its_standard_error(env, capsys, tmp_path,
                                                                       monkeypatch):
  """gamma='auto' with α forced to 0.6 ± 0.01 and costs forced to c 0.2, v 1
  (Theorem 3.8 then predicts 1.33×, 1.40×, 1.36× for γ = 1, 2, 3): where the
  round's timing error (s.e. 0.6 one-token steps) makes every gain smaller
  than its own standard error, it chooses plain decoding; with s.e. 0.01 it
  chooses the best γ, 2. Both runs' outputs equal the baseline's and each
  other's, token for token (T = 0)."""
  from specdec_jax.run import autogamma
  monkeypatch.setattr(autogamma, "estimate_alpha", lambda *a, **k: (0.6, 1000, 0.01))
  outputs = {}
  for name, round_se, want in (("noisy", 0.6, 0), ("clear", 0.01, 2)):
    monkeypatch.setattr(run.calibrate, "costs_many", _forced_costs(
        c=0.2, v=1.0, step_ms=1.0, round_se=round_se))
    w = tmp_path / name
    rc, _, err = _cli(capsys, f"--config={env / 'exp.gin'}", f"--workdir={w}",
                      f"--gin_bindings=Experiment.draft_checkpoint = '{env / 'draft_near'}'",
                      "--gin_bindings=Experiment.gamma = 'auto'",
                      "--gin_bindings=Experiment.auto_gamma_max = 3",
                      "--gin_bindings=Experiment.num_examples = 3")
    assert rc == 0, err
    s = json.loads((w / "summary.json").read_text())
    auto = s["gamma_auto"]
    assert [round(auto["predicted"][g], 2) for g in "123"] == [1.33, 1.40, 1.36]
    assert auto["argmax"] == 2 and auto["gamma"] == s["gamma"] == want
    gain, se = auto["predicted"]["2"] - 1, auto["predicted_se"]["2"]
    assert (gain < se) if want == 0 else (gain > 10 * se)
    recs = _lines(w / "examples.jsonl")
    assert all(r["matches_baseline"] and r["gamma"] == want for r in recs)
    assert (sum(r["draft_calls"] for r in recs) > 0) == (want > 0)
    outputs[name] = [r["output"] for r in recs]
  assert outputs["noisy"] == outputs["clear"]


def _summary(**kw):
  s = {"num_examples": 100, "speedup": 1.39, "alpha": 0.72, "gamma": 3, "temperature": 0.0,
       "v": 2.63, "c": 0.038, "expected_speedup_v": 0.9, "mismatches_vs_baseline": 0}
  return {**s, **kw}


def test_conclusion_says_why_a_slower_run_was_slower():
  """The closing sentence: a faster run says so; a slower one says why, in
  words, from the v (for γ + 1 positions), c and α it measured and Theorem
  3.8's prediction with them; one whose prediction was above 1 names the
  interplay of the two models in a round, or else says the loss lies outside
  the theorem."""
  from specdec_jax.run import report
  fast = report.conclusion(_summary(), "runs/x")
  assert fast.startswith("Speculative decoding was 1.39× faster than the baseline on 100 ")
  assert "costs" not in fast and "Outputs identical to the baseline's on all 100." in fast
  slow = report.conclusion(_summary(speedup=1 / 1.05), "runs/x")
  assert ("Speculative decoding was 1.05× slower than the baseline on 100 held-out examples "
          "(α 0.72, γ 3, T = 0): on this machine scoring 4 positions costs 2.6 one-token steps "
          "(on an accelerator: about 1) and the draft costs c = 0.04 of a step, so with α 0.72 "
          "γ = 3 cannot pay (Theorem 3.8 predicts 0.90×); see docs/benchmarks.md.") in slow
  apart = report.conclusion(_summary(speedup=0.9, expected_speedup_v=1.22, interplay=1.24,
                                     expected_speedup_in_context=0.98), "runs/x")
  assert ("Theorem 3.8 predicts 1.22× with α 0.72 and γ = 3, but run alternately, as a round "
          "runs them, the two models cost 1.24× their cost timed apart, which leaves 0.98×; "
          "see docs/benchmarks.md.") in apart
  other = report.conclusion(_summary(speedup=0.95, v=1.1, expected_speedup_v=1.3,
                                     expected_speedup_in_context=1.1,
                                     expected_speedup_whole_run=1.02), "runs/x")
  assert "scoring 4 positions costs 1.1 one-token steps and the draft" in other
  assert "accelerator" not in other
  assert "Theorem 3.8 predicts 1.30× with α 0.72 and γ = 3, so the loss lies in" in other
  assert "(the whole-run account predicts 1.02×)" in other


def test_gamma_auto_is_refused_with_alpha_only(env, monkeypatch):
  monkeypatch.setattr(run.setup, "_load_model", lambda *a, **k: pytest.fail("weights were read"))
  exp = run.parse_config([str(env / "exp.gin")], ["Experiment.gamma = 'auto'"])
  with pytest.raises(ValueError, match="gamma='auto' .* --alpha_only"):
    run.prepare(exp, alpha_only=True)


def test_bfloat16_weights_keep_float32_norms_and_decode(env):
  """Experiment.param_dtype='bfloat16': kernels and embedding in bfloat16 on the
  device, norms and relative-position tables float32, and the loops run."""
  exp = run.parse_config([str(env / "exp.gin")], ["Experiment.param_dtype = 'bfloat16'"])
  setup = run.prepare(exp)
  p = setup.target_params
  assert p["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"].dtype == jax.numpy.bfloat16
  assert p["token_embedder"]["embedding"].dtype == jax.numpy.bfloat16
  assert p["decoder"]["decoder_norm"]["scale"].dtype == jax.numpy.float32
  assert p["encoder"]["relpos_bias"]["rel_embedding"].dtype == jax.numpy.float32
  assert setup.draft.params["encoder"]["layers_0"]["attention"]["query"]["kernel"].dtype == \
      jax.numpy.bfloat16
  from specdec_jax.decoding import temperature_sample
  out = temperature_sample(setup.target, p, jax.numpy.asarray(setup.inputs[:1]),
                           jax.random.PRNGKey(0), max_decode_len=8)
  assert int(out.length[0]) >= 1


@pytest.mark.parametrize("rule,extra", [("threshold", "AdaptiveConfig.threshold = 0.3"),
                                        ("cumulative", "AdaptiveConfig.threshold = 0.2\n"
                                         "AdaptiveConfig.widths = (1, 2, 3)\n"
                                         "AdaptiveConfig.confidence = 'drawn'"),
                                        ("schedule", "AdaptiveConfig.initial_gamma = 2")])
def test_adaptive_runs_record_the_gammas_they_used(env, capsys, tmp_path, rule, extra):
  """An adaptive run (gamma = γ_max) at T=0: 0 mismatches, per-example γ
  histograms whose rounds add up to the target calls and whose proposals add up
  to the draft calls, a mean γ in the summary, and make_tables shows the row."""
  w = tmp_path / rule
  rc, _, err = _cli(capsys, f"--config={env / 'exp.gin'}", f"--workdir={w}",
                    "--gin_bindings=Experiment.adaptive = @AdaptiveConfig()",
                    f"--gin_bindings=AdaptiveConfig.rule = '{rule}'", f"--gin_bindings={extra}",
                    "--gin_bindings=Experiment.num_examples = 2")
  assert rc == 0, err
  recs = _lines(w / "examples.jsonl")
  s = json.loads((w / "summary.json").read_text())
  for r in recs:
    hist = np.asarray(r["gamma_hist"])
    assert len(hist) == 3 + 1 and hist.sum() == r["target_calls"]
    assert (np.arange(4) * hist).sum() == r["draft_calls"]
    assert r["matches_baseline"]
  assert s["adaptive"] == rule and s["mismatches_vs_baseline"] == 0
  assert s["expected_speedup"] is None  # Theorem 3.8 is for a fixed γ
  total = np.sum([r["gamma_hist"] for r in recs], 0)
  assert s["gamma_hist"] == total.tolist()
  assert s["mean_gamma"] == pytest.approx((np.arange(4) * total).sum() / total.sum())
  assert 1 <= s["mean_gamma"] <= 3
  sys.path.insert(0, str(REPO / "scripts"))
  import make_tables
  md = make_tables.build_markdown([s])
  assert s["gamma_label"] in md and s["gamma_label"].startswith(f"≤3 {rule}")
  drawn = "confidence = 'drawn'" in extra
  assert s["adaptive_confidence"] == ("drawn" if drawn else "top")
  assert s["gamma_label"].endswith(" drawn") == drawn


ADAPTIVE = "Experiment.adaptive = @AdaptiveConfig()\nAdaptiveConfig.rule = "


# AdaptiveConfig's own checks are tested where it is built
# (tests/test_adaptive.py::test_bad_config); here, one of them shows that a bad
# adaptive setting stops the runner before any weight is read, beside the two
# checks that only the runner makes (γ 'auto', widths against Experiment.gamma).
@pytest.mark.parametrize("binding,message", [
    (ADAPTIVE + "'sometimes'", "adaptive rule must be one of"),
    (ADAPTIVE + "'schedule'\nExperiment.gamma = 'auto'", "not 'auto'"),
    (ADAPTIVE + "'cumulative'\nAdaptiveConfig.threshold = 0.5\nAdaptiveConfig.widths = (1, 9)",
     r"widths \[9\] exceed gamma"),
])
def test_adaptive_bad_input_fails_before_work(env, monkeypatch, binding, message):
  """Each bad adaptive setting is refused while the config is parsed or
  validated, before any weight is read."""
  monkeypatch.setattr(run.setup, "_load_model", lambda *a, **k: pytest.fail("weights were read"))
  with pytest.raises(ValueError, match=message):
    run.prepare(run.parse_config([str(env / "exp.gin")], binding.splitlines()))


@pytest.mark.parametrize("tree,nodes", [("full:2,2", 7), ("dynamic:2,4", 7)])
def test_tree_run_records_depths_and_branches(env, capsys, tmp_path, tree, nodes):
  """A token-tree run (Experiment.tree, static or chosen per round) at T=0:
  0 mismatches, per-example depth histograms whose rounds add up to the
  target calls, branch (sibling rank) counts that add up to the accepted
  tokens, and make_tables shows the row beside chain rows."""
  w = tmp_path / "tree"
  rc, out, err = _cli(capsys, f"--config={env / 'exp.gin'}", f"--workdir={w}",
                      f"--gin_bindings=Experiment.tree = '{tree}'",
                      "--gin_bindings=Experiment.num_examples = 2")
  assert rc == 0, err
  recs = _lines(w / "examples.jsonl")
  s = json.loads((w / "summary.json").read_text())
  for r in recs:
    assert r["matches_baseline"] and r["tree_nodes"] == nodes
    assert sum(r["depth_hist"]) == r["target_calls"] and len(r["depth_hist"]) == 3
    assert sum(r["rank_hist"]) == r["accepted"] == sum(j * n for j, n in
                                                       enumerate(r["depth_hist"]))
  assert s["tree"] == tree and s["gamma"] is None and s["mismatches_vs_baseline"] == 0
  assert s["expected_speedup"] is None  # Theorem 3.8 is for a chain
  assert f"tree {tree}" in out
  sys.path.insert(0, str(REPO / "scripts"))
  import make_tables
  assert f"tree {tree}" in make_tables.build_markdown([s])


@pytest.mark.parametrize("binding,message", [
    ("Experiment.tree = 'bushy:3'", "Experiment.tree: tree 'bushy:3': expected"),
    ("Experiment.tree = 'parents:-1,0,2'", "node 2's parent 2 does not precede it"),
    ("Experiment.tree = 'dynamic:2,x'", "expected 'dynamic:W1,W2,...'"),
    ("Experiment.tree = 'full:2,2,2'\nExperiment.max_decode_len = 2",
     "does not fit max_decode_len 2"),
    ("Experiment.tree = 'full:2'\nExperiment.lenience = 0.5", "trees are verified exactly"),
    ("Experiment.tree = 'full:2'\nExperiment.gamma = 'auto'", "depth replaces"),
    ("Experiment.tree = 'full:2'\n" + ADAPTIVE + "'schedule'", "shape is fixed per run"),
    ("Experiment.tree = 'full:2,2'\nExperiment.draft_name = 'prompt_lookup'\n"
     "Experiment.draft_checkpoint = ''", "fans of chains from the root"),
])
def test_tree_bad_input_fails_before_work(env, binding, message):
  """Each bad tree setting is refused while the config is validated; a draft
  that cannot fill the tree, once it is built, before anything compiles."""
  with pytest.raises(ValueError, match=message):
    run.prepare(run.parse_config([str(env / "exp.gin")], binding.split("\n")))


def _copied_draft_experiment(env, tmp_path):
  """The toy experiment with its draft checkpoint copied to tmp_path/draft
  (for tests that add files beside it), and its data."""
  shutil.copytree(env / "draft", tmp_path / "draft")
  exp = run.Experiment(task="toy", source=str(env / "data.tsv"), prefix="",
                       vocab_path=str(env / "spm.model"),
                       target_checkpoint=str(env / "target"),
                       draft_checkpoint=str(tmp_path / "draft"), gamma=3, max_input_len=24,
                       max_decode_len=16, num_warmup=1, num_examples=4)
  return exp, run.load_data(exp)


def test_runner_loads_a_draft_with_an_encoder_bridge(env, tmp_path):
  """A draft checkpoint with ``encoder_bridge.npz`` is built reading the
  target's encoder output; a kernel of the wrong shape or an unreadable file
  is refused with the path and the shapes."""
  from specdec_jax.drafts import bridge
  exp, d = _copied_draft_experiment(env, tmp_path)
  assert run.load_models(exp, d).draft.bridge is None
  bridge.save(str(tmp_path / "draft"), np.full((32, 32), 0.1, np.float32))
  setup = run.load_models(exp, d)
  assert setup.draft.bridge.shape == (32, 32) and setup.draft.target_params is not None
  bridge.save(str(tmp_path / "draft"), np.zeros((16, 32), np.float32))
  with pytest.raises(ValueError, match=r"shape \(16, 32\).*need \(32, 32\)"):
    run.load_models(exp, d)
  (tmp_path / "draft" / bridge.FILENAME).write_bytes(b"not an npz")
  with pytest.raises(ValueError, match="encoder_bridge.npz: not a readable encoder bridge"):
    run.load_models(exp, d)


def test_runner_loads_a_draft_with_a_feature_bridge(env, tmp_path):
  """A draft checkpoint with ``feature_bridge.npz`` is built reading the
  target's decoder states (its decoding is tested in test_engine); a bridge
  of the wrong width or an unreadable file is refused with the path and the
  shapes."""
  from specdec_jax.drafts import feature_bridge
  exp, d = _copied_draft_experiment(env, tmp_path)
  rng = np.random.default_rng(0)
  feature_bridge.save(str(tmp_path / "draft"),
                      {"kernel": rng.normal(size=(32, 32)).astype(np.float32),
                       "staleness": rng.normal(size=(3, 32)).astype(np.float32)})
  setup = run.load_models(exp, d)
  assert setup.draft.wants_target_states and setup.draft.feature["kernel"].shape == (32, 32)
  feature_bridge.save(str(tmp_path / "draft"),
                      {"kernel": np.zeros((16, 32), np.float32),
                       "staleness": np.zeros((3, 32), np.float32)})
  with pytest.raises(ValueError, match=r"kernel \(16, 32\).*need \(32, 32\)"):
    run.load_models(exp, d)
  (tmp_path / "draft" / feature_bridge.FILENAME).write_bytes(b"not an npz")
  with pytest.raises(ValueError, match="feature_bridge.npz: not a readable feature bridge"):
    run.load_models(exp, d)


def test_runner_decodes_exactly_with_a_draft_shortlist(env, tmp_path):
  """``Experiment.draft_shortlist``: scripts/make_shortlist.py writes it from
  the training references; the runner builds the draft with it and decodes
  with 0 mismatches at T=0; bad shortlists and drafts that take none are
  refused with the path or the setting named."""
  import dataclasses
  import importlib.util
  from specdec_jax.drafts import shortlist
  spec = importlib.util.spec_from_file_location("make_shortlist",
                                                REPO / "scripts" / "make_shortlist.py")
  mk = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mk)
  path = tmp_path / "shortlist.json"
  args = [f"--source={env / 'data.tsv'}", f"--vocab={env / 'spm.model'}", "--size=12",
          f"--output={path}"]
  mk.main(args)
  ids = shortlist.load(str(path), 64)
  assert len(ids) == 12 and 1 in ids  # EOS always kept
  with pytest.raises(SystemExit):  # an existing output is not overwritten without --overwrite
    mk.main(args)
  exp, d = _copied_draft_experiment(env, tmp_path)
  exp = dataclasses.replace(exp, draft_shortlist=str(path))
  draft = run.load_models(exp, d).draft
  np.testing.assert_array_equal(draft.shortlist.ids, ids)
  assert draft.shortlist.with_inputs and exp.labels[1] == "draft+shortlist"
  with pytest.raises(ValueError, match="approximation model 'prompt_lookup' takes no 'shortlist'"):
    run.check_before_loading(dataclasses.replace(exp, draft_name="prompt_lookup",
                                                 draft_checkpoint=""))
  with pytest.raises(FileNotFoundError, match="Experiment.draft_shortlist: .*nope.json"):
    run.check_before_loading(dataclasses.replace(exp, draft_shortlist=str(tmp_path / "nope.json")))
  shortlist.save(str(tmp_path / "big.json"), np.array([1, 70]), 80)
  with pytest.raises(ValueError, match=r"big.json: token ids outside \[0, 64\): \[70\]"):
    run.load_models(dataclasses.replace(exp, draft_shortlist=str(tmp_path / "big.json")), d)
  w = tmp_path / "w"
  _run(env, f"--workdir={w}", f"--gin_bindings=Experiment.draft_shortlist = '{path}'")
  s = json.loads((w / "summary.json").read_text())
  assert s["mismatches_vs_baseline"] == 0 and s["num_examples"] == 4
  assert s["draft_shortlist"] == str(path) and s["draft"] == "draft+shortlist"


def test_eta_is_the_first_batchs_pace_then_the_pace_since(monkeypatch):
  """The first ETA comes after the first timed batch, at its pace; later ones
  leave the first batch out (it may still pay a one-time cost)."""
  from specdec_jax.run import loop
  clock = iter([0.0, 10.0, 12.0, 14.0])
  monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
  eta = loop.ETA(10)
  assert eta.update(1) == pytest.approx(10.0 * 9)   # 10 s for the first of 10
  assert eta.update(2) == pytest.approx(2.0 * 8)    # 2 s each since
  assert eta.update(3) == pytest.approx(2.0 * 7)


@pytest.mark.slow
def test_one_chip_of_a_multi_device_machine_runs_a_row(tmp_path):
  """One chip of a multi-chip VM (the paper's setting on a v4-8): on 4
  forced CPU devices, the demo with the one-chip overlay (configs/tpu_v4_1.gin:
  mesh (1, 1), bfloat16) at tiny sizes runs end to end on the first device,
  saying so in one line; a mesh larger than the machine is still refused, and
  so is a smaller one over several processes."""
  e = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
           XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                      + " --xla_force_host_platform_device_count=4"))
  w = tmp_path / "one_chip"
  small = ["Experiment.num_warmup = 1", "Experiment.num_examples = 2",
           "Experiment.max_decode_len = 16", "Experiment.cost_repeats = 3",
           "Experiment.max_input_len = 48", "Experiment.input_buckets = (48,)"]
  script = f"""
import json, sys
from specdec_jax.run import cli
args = ["--config=configs/demo.gin", "--config=configs/tpu_v4_1.gin", "--workdir={w}"]
args += ["--gin_bindings=" + b for b in {small!r}]
assert cli.run_args(args) == 0
s = json.load(open("{w}/summary.json"))
print("SUMMARY", json.dumps(s))
code = cli.run_args(args[:2] + ["--workdir={w}_big", "--gin_bindings=Experiment.mesh_shape = (1, 8)"])
print("BIG", code)
import jax
from specdec_jax import partitioning
jax.process_count = lambda: 2   # as on a multi-host slice: every device, or an error
try:
  partitioning.make_mesh((1, 1))
except partitioning.PartitioningError as e:
  print("MULTIHOST", e)
"""
  res = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=e, capture_output=True,
                       text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  s = json.loads(next(l for l in res.stdout.splitlines() if l.startswith("SUMMARY "))[8:])
  assert s["mesh_shape"] == [1, 1] and s["param_dtype"] == "bfloat16"
  assert s["num_examples"] == 2 and s["speedup"] > 0 and 0 <= s["alpha"] <= 1
  assert "mesh_shape (1, 1) uses 1 of the 4 cpu devices (the first 1)" in res.stderr
  assert "BIG 2" in res.stdout
  assert "error: Experiment.mesh_shape: mesh_shape (1, 8) has 8 devices but there are 4 " \
         "(cpu); choose (data, model) with data * model <= 4" in res.stderr
  assert "MULTIHOST mesh_shape (1, 1) has 1 devices but there are 4 (cpu) over 2 processes; " \
         "a multi-host run uses every device" in res.stdout
