"""The runner's command line for a newcomer: --help, a bad --workdir, and gin
mistakes, each answered in one line before any data or weight is read."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import gin
import pytest

from specdec_jax.run import cli, logs

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "configs" / "demo.gin")


def test_help_exits_0_and_lists_every_runner_flag():
  res = subprocess.run([sys.executable, "-m", "specdec_jax.run", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr
  for flag in ("--config", "--gin_bindings", "--workdir", "--resume", "--alpha_only",
               "--import", "--verbose", "--dry_run"):
    assert re.search(rf"^  --(\[no\])?{flag[2:]}:", res.stdout, re.M), flag
  assert "Experiment settings" in res.stdout and "  gamma = 5: draft tokens per round" in res.stdout


def test_help_describes_every_setting_in_one_line_from_its_docstring():
  """Every Experiment (its pair's too), SamplingConfig and AdaptiveConfig
  setting: exactly one line of --help, its name, its default and the first
  sentence of its docstring entry (in the class that declares it)."""
  import dataclasses
  from specdec_jax.decoding import AdaptiveConfig
  from specdec_jax.pair import PairSettings
  from specdec_jax.run import settings
  from specdec_jax.sampling import SamplingConfig
  text = cli.help_text()
  for cls in (settings.Experiment, PairSettings, SamplingConfig, AdaptiveConfig):
    docs = settings.setting_docs(cls)
    for f in dataclasses.fields(cls):
      if f.name == "config_dirs":
        continue
      doc = docs.get(f.name)
      assert doc and doc.endswith(".") and len(doc) < 200, (cls.__name__, f.name, doc)
      lines = [l for l in text.splitlines() if re.match(rf"  {f.name} (=|@|\(required)", l)]
      assert len(lines) == 1 and lines[0].endswith(f": {doc}"), (f.name, lines)
  assert "  rule (required): how a row's draft length is chosen" in text
  assert "  temperature = 0.0: the temperature the logits are divided by" in text
  assert "  fixed_positions = 0: positions every target decode call scores" in text


def test_sampling_and_adaptive_settings_are_their_dataclasses_bound_by_gin():
  """The gin names are the dataclasses' own: their fields are the bindings
  (a misspelt one gets 'did you mean'), an int or a list is held as the
  field's type, a wrong type and an unset rule are one line each."""
  from specdec_jax.decoding import AdaptiveConfig
  from specdec_jax.sampling import SamplingConfig
  try:
    exp = cli.parse_config([DEMO], ["SamplingConfig.temperature = 1", "SamplingConfig.topk = 4",
                                    "Experiment.adaptive = @AdaptiveConfig()",
                                    "AdaptiveConfig.rule = 'cumulative'",
                                    "AdaptiveConfig.threshold = 1", "AdaptiveConfig.widths = [1, 2]"])
    assert type(exp.sampling) is SamplingConfig and exp.sampling == SamplingConfig(1.0, 4)
    assert isinstance(exp.sampling.temperature, float)
    assert exp.adaptive == AdaptiveConfig("cumulative", threshold=1.0, widths=(1, 2))
    assert hash(exp.adaptive) == hash(AdaptiveConfig("cumulative", threshold=1.0, widths=(1, 2)))
    with pytest.raises(ValueError, match=r"^AdaptiveConfig.rule is not set; bind it"):
      cli.parse_config([DEMO], ["Experiment.adaptive = @AdaptiveConfig()"])
    with pytest.raises(ValueError, match=r"SamplingConfig.topk must be int, got 2.5 \(float\)"):
      cli.parse_config([DEMO], ["SamplingConfig.topk = 2.5"])
  finally:
    gin.clear_config()


def test_a_table2_row_parses_from_another_directory_with_the_repository_on_sys_path(
    tmp_path, monkeypatch):
  """A row's ``include 'configs/...'`` is found in the repository, not looked
  up as a package's file under the namespace package ``configs``."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(REPO))
  try:
    exp = cli.parse_config(["configs/table2_t5_1_0/t5_1_0_ende_base_t0.gin"], [])
    assert exp.gamma == 7 and exp.target_checkpoint.startswith("gs://")
  finally:
    gin.clear_config()


@pytest.fixture
def no_loading(monkeypatch):
  """Fails the test if the runner reads any data or weight."""
  def refuse(*a, **k):
    raise AssertionError("data or weights were read")
  monkeypatch.setattr(cli, "load_data", refuse)
  monkeypatch.setattr(cli, "load_models", refuse)


def _run(capsys, *args) -> tuple[int, str]:
  try:
    rc = cli.run_args(list(args))
  finally:
    logs.quiet_libraries(False)
    gin.clear_config()
  return rc, capsys.readouterr().err


@pytest.mark.parametrize("layout", ["file", "under_a_file"])
def test_a_workdir_that_cannot_be_a_directory_fails_before_loading(tmp_path, capsys, no_loading,
                                                                    layout):
  f = tmp_path / "results"
  f.write_text("not a directory")
  workdir = f if layout == "file" else f / "run"
  rc, err = _run(capsys, f"--config={DEMO}", f"--workdir={workdir}")
  assert rc == 2
  line = err.strip().splitlines()[-1]
  assert line.startswith(f"error: --workdir {workdir}") and str(f) in line, err
  assert f.read_text() == "not a directory"


@pytest.mark.parametrize("binding,message", [
    ("Experiment.draft_name = repeat_last",
     "--gin_bindings: cannot parse the value 'repeat_last' in 'Experiment.draft_name = "
     "repeat_last' (a string needs quotes: 'repeat_last')"),
    ("Experiment.gama = 3",
     "--gin_bindings: 'Experiment.gama = 3': Experiment has no setting 'gama'; did you mean "
     "'gamma'?"),
    ("SamplingConfig.temprature = 1.0",
     "SamplingConfig has no setting 'temprature'; did you mean 'temperature'?"),
    ("Experimnt.gamma = 3", "no configurable named 'Experimnt'; did you mean 'Experiment'?"),
    ("Experiment.zzz = 3", "Experiment has no setting 'zzz' (--help"),
])
def test_gin_mistakes_are_one_line_naming_the_binding(tmp_path, capsys, no_loading, binding,
                                                       message):
  rc, err = _run(capsys, f"--config={DEMO}", f"--gin_bindings={binding}",
                 f"--workdir={tmp_path / 'w'}")
  assert rc == 2
  errors = [l for l in err.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and message in errors[0], err
  assert err.strip() == errors[0]  # one line, nothing before or after it


def test_a_gin_mistake_in_a_config_file_names_the_file_and_line(tmp_path, capsys, no_loading):
  bad = tmp_path / "bad.gin"
  bad.write_text("Experiment.gamma = 3\nExperiment.gamm = 4\n")
  rc, err = _run(capsys, f"--config={DEMO}", f"--config={bad}", f"--workdir={tmp_path / 'w'}")
  assert rc == 2
  assert f"error: {bad}, line 2: 'Experiment.gamm = 4': Experiment has no setting 'gamm'; " \
         "did you mean 'gamma'?" in err, err


def test_library_info_is_told_by_origin_not_by_a_path_substring(tmp_path):
  """A library inside a clone named specdec_jax (its venv there) is still a library."""
  import logging as std_logging
  f = logs.LibraryFilter()
  rec = lambda path, level=std_logging.INFO: std_logging.LogRecord("absl", level, path, 1, "m",
                                                                   (), None)
  venv_lib = tmp_path / "specdec_jax" / ".venv" / "lib" / "site-packages" / "orbax" / "x.py"
  assert not f.filter(rec(str(venv_lib)))
  assert f.filter(rec(str(venv_lib), std_logging.WARNING))
  assert f.filter(rec(str(REPO / "specdec_jax" / "run" / "loop.py")))
  assert f.filter(rec(str(REPO / "scripts" / "bench_tree.py")))


LIBTPU_ENV = ("ALLOW_MULTIPLE_LIBTPU_LOAD", "TPU_SKIP_MDS_QUERY", "TPU_WORKER_HOSTNAMES",
              "TPU_ACCELERATOR_TYPE")


def test_libtpu_is_told_what_it_would_probe_for_only_off_a_tpu(tmp_path, monkeypatch):
  """Off a TPU VM (no TPU device node) the runner sets what libtpu would
  probe the metadata server for; on a TPU VM (a device node, faked here
  where the check looks) it sets nothing; a value already set is kept."""
  from specdec_jax.dryrun import chips
  for k in LIBTPU_ENV:
    monkeypatch.delenv(k, raising=False)
  (tmp_path / "accel0").write_text("")
  monkeypatch.setattr(chips, "TPU_DEVICE_GLOBS", (str(tmp_path / "accel*"),))
  assert chips.on_tpu_vm() and not chips.quiet_libtpu("v5e:2x4")
  assert not [k for k in LIBTPU_ENV if k in os.environ]
  monkeypatch.setattr(chips, "TPU_DEVICE_GLOBS", (str(tmp_path / "vfio" / "[0-9]*"),))
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "mine")
  assert not chips.on_tpu_vm() and chips.quiet_libtpu("v5e:2x4")
  assert os.environ["TPU_ACCELERATOR_TYPE"] == "v5litepod-8"
  assert os.environ["TPU_SKIP_MDS_QUERY"] == "1" and os.environ["TPU_WORKER_HOSTNAMES"] == "mine"


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu installed")
def test_a_run_starts_quietly_with_libtpu_installed_and_no_tpu(tmp_path):
  """With libtpu installed, no TPU and JAX free to try every backend (no
  JAX_PLATFORMS), a run prints its first line and, here, its one-line
  error, and nothing from libtpu (which would otherwise warn about the
  accelerator type and the worker hostnames it cannot find)."""
  from specdec_jax.dryrun import chips
  if chips.on_tpu_vm():
    pytest.skip("this machine has a TPU")
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS",) + LIBTPU_ENV}
  env["PYTHONPATH"] = str(REPO)
  res = subprocess.run([sys.executable, "-m", "specdec_jax.run", f"--config={DEMO}",
                        "--gin_bindings=Experiment.mesh_shape = (2, 1)",
                        f"--workdir={tmp_path / 'w'}"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 2
  lines = res.stderr.strip().splitlines()
  assert len(lines) == 2, res.stderr
  assert lines[0].startswith("Speculative decoding vs the baseline: target demo-target")
  assert lines[1].startswith("error: Experiment.mesh_shape: mesh_shape (2, 1) has 2 devices")


@pytest.mark.parametrize("given,meant", [
    ("configs/dmo.gin", "configs/demo.gin"),
    ("config/demo_t1.gin", "configs/demo_t1.gin"),
    ("configs/table2_t5_1_0/t5_1_0_ende_smal_t0.gin",
     "configs/table2_t5_1_0/t5_1_0_ende_small_t0.gin"),
])
def test_a_wrong_config_path_names_the_nearest_existing_one(capsys, no_loading, given, meant):
  rc, err = _run(capsys, f"--config={given}")
  assert rc == 2
  assert err.strip() == f"error: --config={given}: no such file; did you mean --config={meant}?"
  assert (REPO / meant).is_file()


def test_a_repeated_command_gets_a_fresh_default_workdir(tmp_path):
  """Without --workdir: runs/<name>, then runs/<name>-2, ... (a command can be
  repeated); --resume takes the last that holds results."""
  runs = tmp_path / "runs"
  assert cli.default_workdir("demo", False, str(runs)) == str(runs / "demo")
  assert cli.default_workdir("demo", True, str(runs)) == str(runs / "demo")
  (runs / "demo").mkdir(parents=True)  # an empty directory holds nothing: reused
  assert cli.default_workdir("demo", False, str(runs)) == str(runs / "demo")
  (runs / "demo" / "examples.jsonl").write_text("{}\n")
  assert cli.default_workdir("demo", False, str(runs)) == str(runs / "demo-2")
  (runs / "demo-2").mkdir()
  (runs / "demo-2" / "examples.jsonl").write_text("{}\n")
  assert cli.default_workdir("demo", False, str(runs)) == str(runs / "demo-3")
  assert cli.default_workdir("demo", True, str(runs)) == str(runs / "demo-2")
  assert cli.default_workdir("demo_t1", False, str(runs)) == str(runs / "demo_t1")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
  import toy_env
  return toy_env.build(tmp_path_factory.mktemp("cli"))


@pytest.mark.slow
def test_ctrl_c_says_what_is_on_disk_and_the_command_that_continues(toy, tmp_path, capsys,
                                                                     monkeypatch):
  """Before the first result: nothing written, and it says so. After one of
  two examples: the workdir holds it, and the printed command (run as
  printed, from the same directory) finishes the run."""
  from specdec_jax.run import calibrate, workdir as workdir_lib
  monkeypatch.chdir(tmp_path)
  args = [f"--config={toy / 'exp.gin'}", "--gin_bindings=Experiment.num_examples = 2"]

  def interrupt(*a, **k):
    raise KeyboardInterrupt
  with monkeypatch.context() as m:
    m.setattr(calibrate, "block", interrupt)
    rc, err = _run(capsys, *args)
  assert rc == 130 and not (tmp_path / "runs" / "exp").exists()
  assert err.strip().splitlines()[-1] == (
      "interrupted before the first result: nothing was written in runs/exp; the same "
      "command starts the run again")
  append = workdir_lib.Workdir.append

  def append_then_interrupt(self, record):
    append(self, record)
    raise KeyboardInterrupt
  with monkeypatch.context() as m:
    m.setattr(workdir_lib.Workdir, "append", append_then_interrupt)
    rc, err = _run(capsys, *args)
  assert rc == 130
  lines = err.strip().splitlines()
  assert lines[-2] == ("interrupted: runs/exp/examples.jsonl holds 1 of 2 examples, each "
                       "complete (summary.json is recomputed from them); to continue:")
  command = lines[-1].strip()
  assert command.startswith("python -m specdec_jax.run ") and command.endswith(
      " --workdir=runs/exp --resume")
  assert len((tmp_path / "runs" / "exp" / "examples.jsonl").read_text().splitlines()) == 1
  import shlex
  rc, err = _run(capsys, *shlex.split(command)[3:])
  assert rc == 0, err
  assert len((tmp_path / "runs" / "exp" / "examples.jsonl").read_text().splitlines()) == 2


def _summary(**kw):
  s = {"num_examples": 100, "speedup": 1.39, "alpha": 0.72, "gamma": 3, "temperature": 0.0,
       "v": 2.63, "c": 0.038, "expected_speedup_v": 0.9, "mismatches_vs_baseline": 0,
       "task": "bible_modernize", "draft": "draft_tiny", "interplay": 1.0}
  return {**s, **kw}


@pytest.mark.parametrize("speedup", [0.997, 1.0, 1.004, 0.9951])
def test_a_speedup_that_rounds_to_one_is_the_same_speed(speedup):
  from specdec_jax.run import report
  text = report.conclusion(_summary(speedup=speedup), "runs/x")
  assert text.startswith("Speculative decoding ran at the same speed as the baseline on 100 "
                         "held-out examples (α 0.72, γ 3, T = 0). Outputs identical"), text
  assert "slower" not in text and "faster" not in text


def test_a_speedup_just_off_one_keeps_its_direction():
  from specdec_jax.run import report
  assert report.conclusion(_summary(speedup=1 / 1.006), "r").startswith(
      "Speculative decoding was 1.01× slower than the baseline")
  assert report.conclusion(_summary(speedup=1.006), "r").startswith(
      "Speculative decoding was 1.01× faster than the baseline")


def test_the_default_row_shows_v_and_c_beside_exp():
  from specdec_jax.run import report
  head, _, row = report.table2_row(_summary()).splitlines()
  cells = lambda line: [c.strip() for c in line.strip("|").split("|")]
  assert dict(zip(cells(head), cells(row))) == {
      "TASK": "bible_modernize", "M_q": "draft_tiny", "TEMP": "0", "γ": "3", "α": "0.72",
      "SPEED": "1.39X", "v": "2.63", "c": "0.038", "EXP (Thm 3.8 at this v and c)": "0.90X"}


def test_native_noise_filter_drops_only_the_credentials_line(capfd):
  """Inside quiet_native_noise, fd 2 loses TensorStore's 'no credentials
  file' line and nothing else: other native lines (a real auth error from the
  same file included) and a last partial line pass, in order (Python's
  lines, on fd 2 in a process, are the subprocess test's)."""
  noise = (b"E1128 14:12:23.060103   27746 google_auth_provider.cc:188] Could not find the "
           b"credentials file in the standard gcloud location [/root/.config/gcloud/x.json].\n")
  real = (b"E1128 14:12:23.070000   27746 google_auth_provider.cc:201] PERMISSION_DENIED: "
          b"bad token\n")
  with logs.quiet_native_noise():
    os.write(2, b"first\n" + noise + b"second\n")
    os.write(2, real + b"E1128 partial")
  err = capfd.readouterr().err
  assert err == "first\nsecond\n" + real.decode() + "E1128 partial"
  with logs.quiet_native_noise(False):  # --verbose: everything
    os.write(2, noise)
  assert capfd.readouterr().err == noise.decode()


@pytest.mark.slow
def test_an_offline_gs_run_prints_no_native_line_before_its_error(tmp_path):
  """A gs:// checkpoint with no credentials and no reachable Cloud Storage
  (a closed local port stands in for it): the run's first line, then its
  one-line error, and no line from TensorStore's C++ logging; --verbose shows it."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST",
                      "GOOGLE_AUTH_TOKEN_FOR_TESTING")}
  env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", HOME=str(tmp_path),
             TENSORSTORE_GCS_HTTP_URL="http://127.0.0.1:9", GCE_METADATA_HOST="127.0.0.1:9",
             GCE_METADATA_ROOT="127.0.0.1:9")
  cmd = [sys.executable, "-m", "specdec_jax.run", f"--config={DEMO}",
         "--gin_bindings=Experiment.target_checkpoint = 'gs://offline-bucket/target'",
         f"--workdir={tmp_path / 'w'}"]
  res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  lines = res.stderr.strip().splitlines()
  assert res.returncode == 2 and len(lines) == 2, res.stderr
  assert lines[0].startswith("Speculative decoding vs the baseline")
  assert lines[1].startswith("error: ") and "gs://offline-bucket" in lines[1]
  verbose = subprocess.run(cmd + ["--verbose"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
  assert "google_auth_provider.cc" in verbose.stderr  # quiet by default, not lost
