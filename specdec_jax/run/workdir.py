"""A run's working directory, local or ``gs://``: examples.jsonl (one line per
example; on ``gs://`` rewritten whole per example), summary.json, config.gin.
One writer per workdir (``WriterHold``, ``writer.lock``): locally an ``flock``;
on ``gs://`` an object created only where none exists, refreshed every
``HEARTBEAT_S``, taken over once its holder is dead or ``STALE_S`` old. Each
write is conditioned on the size or generation this run left, so results are
never replaced by another writer."""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Optional

import jax
from absl import logging

from specdec_jax import storage

MODES = ("speculative", "alpha_only", "beam")
HOLD_NAME = "writer.lock"  # the hold's file or object in the workdir
HEARTBEAT_S = 30.0  # a gs:// hold is refreshed this often
STALE_S = 300.0  # a gs:// hold not refreshed for this long is abandoned


class WorkdirInUseError(OSError):
  """Another run holds the workdir, or changed its results (one-line message)."""


def _boot_id() -> str:
  """This machine's boot (Linux), telling a restarted host from the same one."""
  try:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
  except OSError:
    return ""


def _pid_namespace() -> str:
  """This process's pid namespace (Linux): another's pids are not ours to see."""
  try:
    return os.readlink("/proc/self/ns/pid")
  except OSError:
    return ""


def _running(pid: int) -> bool:
  """Whether process ``pid`` of this host is running (a zombie is not)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  try:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2:][:1] != "Z"
  except (OSError, ValueError):
    return True


def _utc(t: float) -> str:
  return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def describe_holder(holder: dict) -> str:
  """Who holds a workdir, in words: process id, host, command, start time."""
  what = f" ({holder['command']})" if holder.get("command") else ""
  started = holder.get("started_s")
  when = f", started {_utc(started)}" if isinstance(started, (int, float)) else ""
  return f"process {holder.get('pid', '?')} on host {holder.get('host', '?')}{what}{when}"


def abandoned(holder: dict, now: Optional[float] = None) -> Optional[str]:
  """Why a ``gs://`` hold is abandoned (process gone from this host, host
  restarted, no refresh for ``STALE_S``), or None while it may be alive."""
  now = time.time() if now is None else now
  same_host = holder.get("host") == socket.gethostname()
  if same_host and holder.get("boot_id") and holder.get("boot_id") != _boot_id():
    return "its host has restarted since"
  if (same_host and holder.get("boot_id") == _boot_id()
      and holder.get("pid_ns") == _pid_namespace() and isinstance(holder.get("pid"), int)
      and not _running(holder["pid"])):
    return "its process is gone"
  refreshed = holder.get("refreshed_s")
  if not isinstance(refreshed, (int, float)):
    return None
  if now - refreshed > STALE_S:
    return f"not refreshed for {now - refreshed:.0f} s (more than {STALE_S:.0f} s)"
  return None


class WriterHold:
  """The one right to write a workdir, taken at construction or refused with
  ``WorkdirInUseError`` naming the holder. ``lost``: why it was lost (None
  while held; ``check`` raises then)."""

  def __init__(self, path: str, command: str, flag: str = "--workdir"):
    self.flag = flag
    self.remote = storage.is_gcs(path)
    self.path = path.rstrip("/") if self.remote else str(Path(path).absolute())
    self.shown = path.rstrip("/") if self.remote else str(Path(path))  # in messages
    self.lock_path = storage.join(self.path, HOLD_NAME)
    self.lost: Optional[str] = None
    now = time.time()
    self.record = {"host": socket.gethostname(), "pid": os.getpid(), "boot_id": _boot_id(),
                   "pid_ns": _pid_namespace(), "command": command, "started_s": now,
                   "refreshed_s": now}
    previous = _HOLDS.pop(self.path, None)
    if previous is not None:  # an earlier hold of this process: superseded
      previous.release()
      previous.lost = "another hold of this process on the same workdir replaced it"
    self._fd: Optional[int] = None
    self._created_dir = False
    self._generation = b""
    self._stop = threading.Event()
    self._mutex = threading.Lock()
    self._thread: Optional[threading.Thread] = None
    if self.remote:
      self._take_remote()
    else:
      self._take_local()
    _HOLDS[self.path] = self

  # -- local: flock on writer.lock

  def _take_local(self) -> None:
    for _ in range(20):  # retried only when a holder releases between two steps
      created = not os.path.isdir(self.path)
      os.makedirs(self.path, exist_ok=True)
      try:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
      except FileNotFoundError:  # the directory was removed by a holder releasing it
        continue
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = self._read_local(fd)
        os.close(fd)
        raise self._in_use(holder) from None
      try:
        same = os.path.samestat(os.fstat(fd), os.stat(self.lock_path))
      except FileNotFoundError:
        same = False
      if not same:  # locked a file its holder had just removed: take the new one
        os.close(fd)
        continue
      data = json.dumps(self.record).encode()
      os.ftruncate(fd, 0)
      os.pwrite(fd, data, 0)
      self._fd, self._created_dir = fd, created
      return
    raise WorkdirInUseError(f"{self.flag} {self.shown}: could not take {HOLD_NAME} (other "
                            "runs keep taking and releasing it); try again")

  @staticmethod
  def _read_local(fd: int) -> dict:
    for _ in range(20):  # a holder writes its record right after locking
      try:
        return json.loads(os.pread(fd, 4096, 0).decode())
      except (UnicodeDecodeError, json.JSONDecodeError):
        time.sleep(0.05)
    return {}

  # -- gs://: a generation-conditioned object, refreshed while held

  def _take_remote(self) -> None:
    for _ in range(5):  # retried only when another run changed the hold meanwhile
      data, generation = storage.read_versioned(self.lock_path)
      if data is not None:
        try:
          holder = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError):
          raise WorkdirInUseError(f"{self.flag} {self.shown}: {self.lock_path} is not a hold "
                                  "this runner wrote; remove it if no run uses the workdir")
        why = abandoned(holder)
        if why is None:
          raise self._in_use(holder)
        logging.warning("%s: taking over the hold of %s: %s", self.shown,
                        describe_holder(holder), why)
      new = storage.write_if(self.lock_path, json.dumps(self.record).encode(), generation)
      if new is not None:
        self._generation = new
        self._thread = threading.Thread(target=self._heartbeat, daemon=True,
                                        name=f"hold {self.path}")
        self._thread.start()
        return
    raise WorkdirInUseError(f"{self.flag} {self.shown}: could not take {HOLD_NAME} (other "
                            "runs keep changing it); try again")

  def _heartbeat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      with self._mutex:
        if self._stop.is_set() or self.lost:
          return
        self.record["refreshed_s"] = time.time()
        try:
          new = storage.write_if(self.lock_path, json.dumps(self.record).encode(), self._generation)
        except storage.StorageError as e:  # tried again at the next beat
          logging.warning("%s: could not refresh the hold (%s)", self.shown, e)
          continue
        if new is None:
          self.lost = "another run took it over (this run had not refreshed it in time)"
          return
        self._generation = new

  def _in_use(self, holder: dict) -> WorkdirInUseError:
    who = describe_holder(holder) if holder else "another process (not yet named)"
    if self.remote and isinstance(holder.get("refreshed_s"), (int, float)):
      who += (f", refreshed {max(time.time() - holder['refreshed_s'], 0):.0f} s ago (taken "
              f"over after {STALE_S:.0f} s without a refresh)")
    return WorkdirInUseError(f"{self.flag} {self.shown} is in use by {who}; wait for it to "
                             f"end or stop it, or choose another {self.flag} (nothing was "
                             "changed)")

  def check(self) -> None:
    """Raises ``WorkdirInUseError`` if the hold was lost."""
    if self.lost:
      raise WorkdirInUseError(f"{self.shown}: this run no longer holds the workdir "
                              f"({self.lost}); it stops, writing nothing more")

  def release(self) -> None:
    """Gives the hold up (nothing if it was already given up or lost)."""
    self._stop.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout=storage.TIMEOUT_S)
    with self._mutex:
      if _HOLDS.get(self.path) is self:
        del _HOLDS[self.path]
      if self.remote:
        if self._generation and not self.lost:
          try:  # only our own hold: a replaced one is left to its new holder
            storage.write_if(self.lock_path, None, self._generation)
          except storage.StorageError as e:
            logging.warning("%s: could not remove the hold (%s); the next run takes it over "
                            "as abandoned", self.shown, e)
        self._generation = b""
        return
      if self._fd is None:
        return
      try:
        if os.path.samestat(os.fstat(self._fd), os.stat(self.lock_path)):
          os.remove(self.lock_path)
      except FileNotFoundError:
        pass
      os.close(self._fd)
      self._fd = None
      if self._created_dir:
        try:
          os.rmdir(self.path)  # only if empty: a run that wrote no result leaves nothing
        except OSError:
          pass


_HOLDS: dict[str, WriterHold] = {}


def release_holds() -> None:
  """Releases every hold this process took (at the end of a command)."""
  for hold in list(_HOLDS.values()):
    hold.release()


def _record_mode(record: dict) -> str:
  """A line's mode (older lines told by their keys)."""
  return record.get("mode") or ("speculative" if "accepted" in record else "alpha_only")


def _comparable(config_str: str) -> list[str]:
  """Config lines that must match on --resume (all but num_examples and the multi-host identity)."""
  free = r"\s*Experiment\.(num_examples|process_id|coordinator_address)\s*="
  return [l for l in config_str.splitlines() if l.strip() and not re.match(free, l)]


def check_writable(path: Path) -> None:
  """Refuses a local workdir that cannot be created or written, before any model is read."""
  if path.exists() and not path.is_dir():
    raise FileExistsError(f"--workdir {path} is a file, not a directory; choose another "
                          "--workdir")
  existing = path
  while not existing.exists():
    existing = existing.parent
  if not existing.is_dir():
    raise NotADirectoryError(f"--workdir {path}: {existing} is a file, so the directory "
                             "cannot be created; choose another --workdir")
  if not os.access(existing, os.W_OK | os.X_OK):
    where = "" if existing == path else f" ({existing}, where it would be created)"
    raise PermissionError(f"--workdir {path} is not writable{where}; choose another --workdir")


def check_workdir(path: str) -> None:
  """A workdir that can be written (checked, not created)."""
  if not storage.is_gcs(path):
    return check_writable(Path(path))
  try:
    storage.check_path(path)
  except ValueError as e:
    raise ValueError(f"--workdir: {e}") from None


class Workdir:
  """examples.jsonl, summary.json and config.gin. The constructor takes the
  writer hold (process 0 only) and reads finished lines; the directory and
  config.gin are written with the first result."""

  def __init__(self, path: str, config_str: str, resume: bool, mode: str = "speculative",
               num_indices: Optional[int] = None, command: str = "python -m specdec_jax.run"):
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    self.remote = storage.is_gcs(str(path))
    check_workdir(str(path))
    if self.remote and not storage.bucket_exists(str(path)):  # before any model is read
      raise storage.StorageNotFoundError(f"--workdir {path}: the bucket "
                                         f"gs://{storage.split(str(path))[0]} does not exist")
    self.path = str(path).rstrip("/") if self.remote else str(Path(path))
    self.examples_path = storage.join(self.path, "examples.jsonl")
    self.config_path = storage.join(self.path, "config.gin")
    self.summary_path = storage.join(self.path, "summary.json")
    self.mode, self.resume, self.config_str = mode, resume, config_str
    # Multi-host: every process runs the same sharded loops, process 0 writes.
    self.writer = jax.process_index() == 0
    # Taken before anything is read, so that what is read is this run's to extend.
    self.hold = WriterHold(self.path, command) if self.writer else None
    try:
      self._content = b""  # the complete lines of examples.jsonl (rewritten whole on gs://)
      self._size = 0  # examples.jsonl's size when read (a torn last line included)
      self._generation = storage.NO_OBJECT  # gs://: examples.jsonl's generation, read or written
      self.records, self._good_end = self._read_records()
      self._opened = False
      self._check(resume, num_indices)
    except BaseException:
      self.close()
      raise

  def close(self) -> None:
    if self.hold is not None:
      self.hold.release()

  def _check(self, resume: bool, num_indices: Optional[int]) -> None:
    """Existing results are refused unless ``--resume`` continues the same mode and config."""
    if not self.records:
      return  # a workdir without results (or a stale config.gin) is simply reused
    if not resume:
      raise FileExistsError(f"{self.examples_path} already has results; pass --resume to "
                            "continue that run or choose another --workdir (nothing was "
                            "changed)")
    mode = self.mode
    old_mode = _record_mode(self.records[0])
    if old_mode != mode:
      flag = lambda m: "with --alpha_only" if m == "alpha_only" else "without --alpha_only"
      raise ValueError(f"{self.path} holds a {old_mode} run ({len(self.records)} examples, "
                       f"written {flag(old_mode)}); this run is {mode} ({flag(mode)}). "
                       "Use another --workdir (nothing was changed)")
    if storage.is_file(self.config_path):
      old = _comparable(storage.read_text(self.config_path))
      new = _comparable(self.config_str)
      if old != new:
        diff = ([f"- {l}" for l in old if l not in new] + [f"+ {l}" for l in new if l not in old])
        raise ValueError(f"--resume: the gin config differs from {self.config_path} (only "
                         "Experiment.num_examples may change); resume with the same "
                         f"--config/--gin_bindings (nothing was changed). Differences: "
                         f"{'; '.join(diff[:6]) or 'order of lines'}")
    if num_indices is not None:
      beyond = sorted(r["index"] for r in self.records if r["index"] >= num_indices)
      if beyond:
        raise ValueError(f"--resume: {self.examples_path} already has example indices up to "
                         f"{beyond[-1]}, beyond num_warmup + num_examples = {num_indices}; "
                         "Experiment.num_examples can only be raised on resume (nothing was "
                         "changed)")

  def _read_records(self) -> tuple[list[dict], int]:
    """Complete lines, and the byte offset where they end."""
    if self.remote:
      raw, self._generation = storage.read_versioned(self.examples_path)
      if raw is None:
        return [], 0
    else:
      if not storage.is_file(self.examples_path):
        return [], 0
      raw = storage.read_bytes(self.examples_path)
    end = raw.rfind(b"\n") + 1
    self._content = raw[:end]
    self._size = len(raw)
    records = []
    for line_no, line in enumerate(raw[:end].split(b"\n")[:-1], start=1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line.decode("utf-8"))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{self.examples_path}:{line_no}: corrupt line ({e}); only a torn "
                         "last line is repaired automatically; remove or fix that line "
                         "(nothing was changed)") from None
      if not isinstance(rec, dict) or not isinstance(rec.get("index"), int):
        raise ValueError(f"{self.examples_path}:{line_no}: not a result record (no integer "
                         "'index'); nothing was changed")
      records.append(rec)
    return records, end

  def _changed(self) -> WorkdirInUseError:
    return WorkdirInUseError(f"{self.examples_path} was changed by another writer since this "
                             "run read it; this run stops, writing nothing more")

  def _write_examples(self, content: bytes) -> None:
    """gs://: examples.jsonl replaced whole, only if no one else wrote it since."""
    new = storage.write_if(self.examples_path, content, self._generation)
    if new is None:
      raise self._changed()
    self._generation = new

  def _check_hold(self) -> None:
    if self.hold is not None:
      self.hold.check()

  def _open(self) -> None:
    """Before the first write: the directory, the torn-line repair, config.gin."""
    self._check_hold()
    if not self.remote:
      os.makedirs(self.path, exist_ok=True)
      size = os.path.getsize(self.examples_path) if os.path.exists(self.examples_path) else 0
      if size != self._size:
        raise self._changed()
    if self._size > self._good_end:
      logging.warning("Dropping a partial last line of %s (%d bytes)", self.examples_path,
                      self._size - self._good_end)
      if self.remote:
        self._write_examples(self._content)
      else:
        with open(self.examples_path, "r+b") as f:
          f.truncate(self._good_end)
    self._size = self._good_end
    if (not storage.is_file(self.config_path)
        or storage.read_text(self.config_path) != self.config_str):
      storage.write_bytes(self.config_path, self.config_str.encode("utf-8"))
    self._opened = True

  def append(self, record: dict) -> None:
    if not self.writer:
      self.records.append(record)
      return
    if not self._opened:
      self._open()
    self._check_hold()
    line = json.dumps(record) + "\n"
    if self.remote:
      # No appends in Cloud Storage: the whole object, one atomic write per example.
      self._write_examples(self._content + line.encode("utf-8"))
      self._content += line.encode("utf-8")
    else:
      with open(self.examples_path, "ab") as f:
        if os.fstat(f.fileno()).st_size != self._size:
          raise self._changed()
        f.write(line.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
        self._size = f.tell()
    self.records.append(record)

  def write_summary(self, summary: dict) -> None:
    if not self.writer:
      return
    if not self._opened:
      self._open()
    self._check_hold()
    storage.write_bytes(self.summary_path, (json.dumps(summary, indent=2) + "\n").encode())
