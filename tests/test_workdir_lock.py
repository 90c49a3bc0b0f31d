"""One writer per workdir (``specdec_jax.run.workdir.WriterHold``), locally
and on ``gs://`` (the Cloud Storage emulator, which honours
``ifGenerationMatch`` as the real API does).

Fast tests: the hold between processes (refused in one line naming the
holder; taken at once after its holder is killed; on gs:// a hold of another
host taken over only once it is stale), a writer whose results another writer
changed stops, released on errors and on Ctrl-C, and ``run_table2.py`` on a
root in use refused before any row. Slow tests: two real runs on one workdir
(the second refused, the first complete) and a run killed midway then
resumed, equal to the uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

import gcs_emulator
import toy_env
from specdec_jax import run, storage
from specdec_jax.run import cli as run_cli
from specdec_jax.run import workdir as wd
from specdec_jax.run.workdir import Workdir, WorkdirInUseError, WriterHold
from specdec_jax.scripting import table2

REPO = Path(__file__).resolve().parent.parent
# What a resumed run must reproduce exactly (timings differ from run to run).
KEYS = ("index", "id", "output", "baseline_output", "tokens", "baseline_tokens",
        "target_calls", "draft_calls", "accepted", "rejected", "matches_baseline")
DERIVED = ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")
# A process that takes a hold, says so, and keeps it until killed.
HOLDER = """
import sys, time
from specdec_jax.run.workdir import WriterHold
hold = WriterHold(sys.argv[1], sys.argv[2])
print("held", flush=True)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def gcs_server(tmp_path_factory):
  pytest.importorskip("gcp_storage_emulator")
  with gcs_emulator.running(tmp_path_factory.mktemp("gcs") / "emulator.log") as host:
    yield host


@pytest.fixture
def gcs(gcs_server, monkeypatch):
  for name in DERIVED:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
  return f"gs://{gcs_emulator.BUCKET}"


def _env() -> dict:
  return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
              JAX_PLATFORMS="cpu")


def _holder(path: str, command: str = "holder") -> subprocess.Popen:
  """A process holding ``path`` (returned once it holds it)."""
  proc = subprocess.Popen([sys.executable, "-c", HOLDER, path, command], env=_env(),
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "held"
  return proc


def _kill(proc: subprocess.Popen) -> None:
  proc.send_signal(signal.SIGKILL)
  proc.wait()


def _refusal(path: str, pid: int, command: str, flag: str = "--workdir") -> str:
  """The start of the one line refusing ``path`` held by ``pid``."""
  return f"{flag} {path} is in use by process {pid} on host {socket.gethostname()} ({command})"


# ---------------------------------------------------------------- the hold (fast)


def test_local_hold_refuses_while_held_and_not_after_a_kill(tmp_path):
  w = tmp_path / "w"
  proc = _holder(str(w))
  try:
    with pytest.raises(WorkdirInUseError) as e:
      WriterHold(str(w), "second")
    line = str(e.value)
    assert line.startswith(_refusal(str(w), proc.pid, "holder") + ", started 20"), line
    assert "\n" not in line and "UTC" in line
    # A fresh run is refused by the hold, not by "already has results".
    with pytest.raises(WorkdirInUseError, match="is in use by process"):
      Workdir(str(w), "", resume=False)
  finally:
    _kill(proc)
  # Killed: the kernel ended its lock; its file (naming the dead holder) remains.
  assert json.loads((w / wd.HOLD_NAME).read_text())["pid"] == proc.pid
  hold = WriterHold(str(w), "third")
  assert json.loads((w / wd.HOLD_NAME).read_text())["pid"] == os.getpid()
  hold.release()
  assert not (w / wd.HOLD_NAME).exists() and w.is_dir()  # not created by the last hold
  hold = WriterHold(str(tmp_path / "new"), "fourth")
  hold.release()
  assert not (tmp_path / "new").exists()  # created by the hold, left empty: removed


def test_gcs_hold_is_created_only_where_none_exists(gcs):
  url = f"{gcs}/lock/created"
  proc = _holder(url)
  try:
    with pytest.raises(WorkdirInUseError) as e:
      WriterHold(url, "second")
    line = str(e.value)
    assert line.startswith(_refusal(url, proc.pid, "holder") + ", started 20"), line
    assert "refreshed 0 s ago" in line or "refreshed 1 s ago" in line, line
  finally:
    _kill(proc)
  # Killed, on this host: its process is gone, so the hold is taken over at once.
  lock = f"{url}/{wd.HOLD_NAME}"
  assert json.loads(storage.read_bytes(lock))["pid"] == proc.pid
  hold = WriterHold(url, "third")
  assert json.loads(storage.read_bytes(lock))["pid"] == os.getpid()
  hold.release()
  assert not storage.is_file(lock)
  # The precondition itself: a create where an object exists is refused by the server.
  storage.write_bytes(lock, b"{}")
  assert storage.write_if(lock, b"x", storage.NO_OBJECT) is None
  assert storage.read_bytes(lock) == b"{}"
  _, generation = storage.read_versioned(lock)
  assert storage.write_if(lock, None, generation) == storage.NO_OBJECT
  assert storage.read_versioned(lock) == (None, storage.NO_OBJECT)


def test_gcs_hold_of_another_host_is_taken_over_only_when_stale(gcs):
  url = f"{gcs}/lock/stale"
  lock = f"{url}/{wd.HOLD_NAME}"
  now = time.time()
  other = {"host": "another-vm", "pid": 4242, "boot_id": "x", "command": "python -m "
           "specdec_jax.run", "started_s": now - 3600}
  # Refreshed a minute ago (a run on a VM elsewhere): refused.
  storage.write_bytes(lock, json.dumps({**other, "refreshed_s": now - 60}).encode())
  with pytest.raises(WorkdirInUseError, match=r"process 4242 on host another-vm .*refreshed "
                     r"60 s ago \(taken over after 300 s without a refresh\)"):
    WriterHold(url, "second")
  # Not refreshed for longer than STALE_S (the VM was lost): taken over.
  storage.write_bytes(lock, json.dumps({**other, "refreshed_s": now - wd.STALE_S - 5}).encode())
  hold = WriterHold(url, "third")
  assert json.loads(storage.read_bytes(lock))["pid"] == os.getpid()
  hold.release()
  # The same host after a restart (another boot): abandoned too.
  assert wd.abandoned({**other, "host": socket.gethostname(), "refreshed_s": now}) == \
      "its host has restarted since"
  assert wd.abandoned({**other, "refreshed_s": now}) is None
  # A process that ended, on this host: abandoned; unless it ran in another pid
  # namespace (another container of this host), where its pid says nothing here.
  ended = subprocess.Popen(["true"])
  ended.wait()
  here = {**other, "host": socket.gethostname(), "boot_id": wd._boot_id(), "pid": ended.pid,
          "pid_ns": wd._pid_namespace(), "refreshed_s": now}
  assert wd.abandoned(here) == "its process is gone"
  assert wd.abandoned({**here, "pid_ns": "pid:[1]"}) is None
  assert wd.abandoned({**here, "pid": os.getpid()}) is None


def test_gcs_hold_is_refreshed_and_a_writer_that_lost_it_stops(gcs, monkeypatch):
  monkeypatch.setattr(wd, "HEARTBEAT_S", 0.2)
  url = f"{gcs}/lock/heartbeat"
  lock = f"{url}/{wd.HOLD_NAME}"
  w = Workdir(url, "Experiment.gamma = 3\n", resume=False)
  try:
    first = json.loads(storage.read_bytes(lock))["refreshed_s"]
    deadline = time.time() + 30
    while json.loads(storage.read_bytes(lock))["refreshed_s"] == first:
      assert time.time() < deadline, "the hold was never refreshed"
      time.sleep(0.05)
    w.append({"index": 1, "mode": "speculative", "accepted": 1})
    # Another run took the hold over (as if this one had stopped refreshing it).
    _, generation = storage.read_versioned(lock)
    thief = {"host": "another-vm", "pid": 7, "started_s": time.time(),
             "refreshed_s": time.time()}
    assert storage.write_if(lock, json.dumps(thief).encode(), generation) is not None
    deadline = time.time() + 30
    while w.hold.lost is None:
      assert time.time() < deadline, "the lost hold was not noticed"
      time.sleep(0.05)
    with pytest.raises(WorkdirInUseError, match="no longer holds the workdir"):
      w.append({"index": 2, "mode": "speculative", "accepted": 1})
    w.close()
    assert json.loads(storage.read_bytes(lock))["pid"] == 7  # the new holder's, left alone
    assert [json.loads(l)["index"] for l in
            storage.read_text(f"{url}/examples.jsonl").splitlines()] == [1]
  finally:
    w.close()


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_results_changed_by_another_writer_stop_the_run(where, tmp_path, request):
  base = request.getfixturevalue("gcs") + "/lock/changed" if where == "gcs" else str(tmp_path)
  url = storage.join(base, "w")
  examples = storage.join(url, "examples.jsonl")
  w = Workdir(url, "Experiment.gamma = 3\n", resume=False)
  try:
    w.append({"index": 1, "mode": "speculative", "accepted": 1})
    # Written behind the holder's back (a writer that ignores holds):
    other = storage.read_bytes(examples) + b'{"index": 9, "mode": "speculative"}\n'
    storage.write_bytes(examples, other)
    with pytest.raises(WorkdirInUseError, match="changed by another writer"):
      w.append({"index": 2, "mode": "speculative", "accepted": 1})
    assert storage.read_bytes(examples) == other  # not replaced
  finally:
    w.close()


def test_hold_is_released_when_the_workdir_is_refused(tmp_path):
  w = tmp_path / "w"
  first = Workdir(str(w), "Experiment.gamma = 3\n", resume=False)
  first.append({"index": 1, "mode": "speculative", "accepted": 1})
  first.close()
  assert not (w / wd.HOLD_NAME).exists()
  with pytest.raises(ValueError, match="gin config differs"):
    Workdir(str(w), "Experiment.gamma = 4\n", resume=True)
  assert not (w / wd.HOLD_NAME).exists() and not wd._HOLDS
  # In one process a second Workdir on the same path replaces the first's hold.
  a = Workdir(str(w), "Experiment.gamma = 3\n", resume=True)
  b = Workdir(str(w), "Experiment.gamma = 3\n", resume=True)
  with pytest.raises(WorkdirInUseError, match="no longer holds"):
    a.append({"index": 2, "mode": "speculative", "accepted": 1})
  b.append({"index": 2, "mode": "speculative", "accepted": 1})
  wd.release_holds()
  assert not (w / wd.HOLD_NAME).exists()


def _table2_rows(tmp_path: Path) -> Path:
  rows = tmp_path / "rows"
  rows.mkdir()
  (rows / "r1.gin").write_text(f"include '{REPO / 'configs' / 'demo.gin'}'\n")
  return rows


def test_table2_rows_on_a_root_in_use_are_refused_before_any_row(tmp_path):
  root = tmp_path / "runs"
  rows = table2.find_rows(_table2_rows(tmp_path), root)
  proc = _holder(str(root), "scripts/run_table2.py")
  calls = []
  try:
    with pytest.raises(WorkdirInUseError) as e:
      table2.run_rows(rows, [], [], say=calls.append, run=calls.append)
  finally:
    _kill(proc)
  assert str(e.value).startswith(_refusal(str(root), proc.pid, "scripts/run_table2.py",
                                          "--root"))
  assert calls == []
  out = table2.run_rows(rows, [], [], say=calls.append, run=lambda cmd: 0)  # free again
  assert out.ran == ["r1"] and not (root / wd.HOLD_NAME).exists()


@pytest.mark.slow
def test_run_table2_on_a_root_in_use_is_refused_in_one_line(tmp_path):
  rows = _table2_rows(tmp_path)
  root = tmp_path / "runs"
  proc = _holder(str(root), "scripts/run_table2.py")
  try:
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "run_table2.py"),
                          f"--config_dir={rows}", f"--root={root}"], env=_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
  finally:
    _kill(proc)
  assert res.returncode == 2, res.stderr[-3000:]
  lines = res.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      "run_table2.py: error: " + _refusal(str(root), proc.pid, "scripts/run_table2.py",
                                          "--root")), res.stderr
  assert not (root / "r1").exists() and res.stdout == ""


def test_ctrl_c_releases_the_hold(tmp_path, monkeypatch):
  w = tmp_path / "w"

  def interrupt(*a, **k):  # Ctrl-C while the data is read, the workdir held
    assert json.loads((w / wd.HOLD_NAME).read_text())["pid"] == os.getpid()
    raise KeyboardInterrupt
  monkeypatch.setattr(run_cli, "load_data", interrupt)
  assert run.run_args([f"--config={REPO / 'configs' / 'demo.gin'}", f"--workdir={w}"]) == 130
  assert not w.exists() and not wd._HOLDS  # released, and the empty directory removed


# ---------------------------------------------------------------- real runs (slow)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  return toy_env.build(tmp_path_factory.mktemp("lock_env"))


def _runner(env: Path, workdir: str, *args: str, extra_env: dict = None,
            **popen) -> subprocess.Popen:
  cmd = [sys.executable, "-m", "specdec_jax.run", f"--config={env / 'exp.gin'}",
         f"--workdir={workdir}", "--gin_bindings=Experiment.num_examples = 8", *args]
  return subprocess.Popen(cmd, cwd=REPO, env={**_env(), **(extra_env or {})}, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def _wait(check: Callable[[], bool], proc: subprocess.Popen, what: str) -> None:
  deadline = time.time() + 600
  while not check():
    assert proc.poll() is None, f"the run ended before {what}: {proc.stderr.read()[-3000:]}"
    assert time.time() < deadline, f"no {what} in 600 s"
    time.sleep(0.02)


def _records(workdir: str) -> list[dict]:
  return [json.loads(l) for l in storage.read_text(storage.join(workdir, "examples.jsonl"))
          .splitlines()]


def _lines_now(workdir: str) -> int:
  path = storage.join(workdir, "examples.jsonl")
  return storage.read_bytes(path).count(b"\n") if storage.is_file(path) else 0


def _same(a: list[dict], b: list[dict]) -> bool:
  key = lambda rs: [[r[k] for k in KEYS] for r in sorted(rs, key=lambda r: r["index"])]
  return key(a) == key(b)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "gcs"])
def test_two_runs_on_one_workdir_and_a_killed_run_resumed(where, env, tmp_path, request):
  """Two runs on one workdir: the second (fresh locally, --resume on gs://)
  refused in one line naming the first, which completes. A run killed (SIGKILL) after its
  first results, resumed: its results equal the uninterrupted run's."""
  if where == "gcs":
    base = request.getfixturevalue("gcs") + f"/runs/{tmp_path.name}"
    extra = {"STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"]}
  else:
    base, extra = str(tmp_path), {}
  first, killed = storage.join(base, "first"), storage.join(base, "killed")
  lock = storage.join(first, wd.HOLD_NAME)

  a = _runner(env, first, extra_env=extra)
  _wait(lambda: storage.is_file(lock) and bool(storage.read_bytes(lock)), a, "hold")
  a.send_signal(signal.SIGSTOP)  # the first run holds the workdir and stays mid-run
  try:
    # A fresh run locally, a --resume on gs:// (both meet the hold first).
    b = _runner(env, first, *(["--resume"] if where == "gcs" else []), extra_env=extra)
    out, err = b.communicate(timeout=600)
    assert b.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: " + _refusal(first, a.pid, "python -m specdec_jax.run")), err
    assert "Loading the target" not in err and out == ""
  finally:
    a.send_signal(signal.SIGCONT)
  out, err = a.communicate(timeout=600)
  assert a.returncode == 0, err[-3000:]
  reference = _records(first)
  assert sorted(r["index"] for r in reference) == list(range(1, 9))
  summary = json.loads(storage.read_text(storage.join(first, "summary.json")))
  assert summary["num_examples"] == 8
  assert not storage.is_file(lock)  # released at its normal end

  c = _runner(env, killed, extra_env=extra)
  _wait(lambda: _lines_now(killed) >= 1, c, "first result")
  _kill(c)
  done = _lines_now(killed)
  assert 1 <= done < 8, "the run was not killed midway"
  assert storage.is_file(storage.join(killed, wd.HOLD_NAME))  # left by the killed run
  d = _runner(env, killed, "--resume", extra_env=extra)
  out, err = d.communicate(timeout=600)
  assert d.returncode == 0, err[-3000:]
  if where == "gcs":
    assert f"taking over the hold of process {c.pid}" in err and "its process is gone" in err
  resumed = _records(killed)
  assert len(resumed) == 8 and _same(resumed, reference)
  assert not storage.is_file(storage.join(killed, wd.HOLD_NAME))
