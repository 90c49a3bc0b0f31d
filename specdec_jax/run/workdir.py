"""A run's working directory: examples.jsonl (append-only, one line per
example), summary.json (rewritten atomically) and config.gin. A local
directory or a ``gs://`` prefix: Cloud Storage objects cannot be appended to,
so there examples.jsonl is rewritten whole (one atomic object write) after
each example; resuming reads it back the same way.

Workdir integrity: nothing is written before the first result; ``config.gin``
(the run's gin config) is written atomically with it, so a workdir's files
always describe its results. A workdir holds one mode (speculative or
``--alpha_only``); the other mode, a different config, or a corrupt line is
refused before any work, with nothing changed. ``--resume`` may raise
``Experiment.num_examples`` (the run is extended).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

import jax
from absl import logging

from specdec_jax import storage

MODES = ("speculative", "alpha_only", "beam")


def _record_mode(record: dict) -> str:
  """A line's mode; lines written before modes were recorded are told by their keys."""
  return record.get("mode") or ("speculative" if "accepted" in record else "alpha_only")


def _comparable(config_str: str) -> list[str]:
  """Config lines that must match on --resume: num_examples may be raised,
  and the multi-host identity (this process's id, the coordinator's address)
  differs between hosts and launches without changing the experiment."""
  free = r"\s*Experiment\.(num_examples|process_id|coordinator_address)\s*="
  return [l for l in config_str.splitlines() if l.strip() and not re.match(free, l)]


def check_writable(path: Path) -> None:
  """Refuses a local workdir that is a file, sits under a file, or cannot be
  created or written, before any model is read (the first write comes only
  after loading and compiling)."""
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


class Workdir:
  """examples.jsonl (append-only), summary.json (atomic rewrite), config.gin.

  The constructor only checks (and reads finished lines); the directory and
  config.gin are written with the first result, so a run that fails earlier
  leaves nothing behind. ``path`` is a local directory or a ``gs://`` prefix
  (a str, as are the file paths below).
  """

  def __init__(self, path: str, config_str: str, resume: bool, mode: str = "speculative",
               num_indices: Optional[int] = None):
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    self.remote = storage.is_gcs(str(path))
    if self.remote:
      try:
        storage.check_path(str(path))
      except ValueError as e:
        raise ValueError(f"--workdir: {e}") from None
      if not storage.bucket_exists(str(path)):  # before any model is read
        raise storage.StorageNotFoundError(f"--workdir {path}: the bucket "
                                           f"gs://{storage.split(str(path))[0]} does not exist")
    else:
      check_writable(Path(path))
    self.path = str(path).rstrip("/") if self.remote else str(Path(path))
    self.examples_path = storage.join(self.path, "examples.jsonl")
    self.config_path = storage.join(self.path, "config.gin")
    self.summary_path = storage.join(self.path, "summary.json")
    self.mode, self.resume, self.config_str = mode, resume, config_str
    self._content = b""  # the complete lines of examples.jsonl (rewritten whole on gs://)
    self._size = 0  # examples.jsonl's size when read (a torn last line included)
    self.records, self._good_end = self._read_records()
    self._opened = False
    # Multi-host: every process runs the same sharded loops, process 0 writes.
    self.writer = jax.process_index() == 0
    if not self.records:
      return  # a workdir without results (or a stale config.gin) is simply reused
    if not resume:
      raise FileExistsError(f"{self.examples_path} already has results; pass --resume to "
                            "continue that run or choose another --workdir (nothing was "
                            "changed)")
    old_mode = _record_mode(self.records[0])
    if old_mode != mode:
      flag = lambda m: "with --alpha_only" if m == "alpha_only" else "without --alpha_only"
      raise ValueError(f"{self.path} holds a {old_mode} run ({len(self.records)} examples, "
                       f"written {flag(old_mode)}); this run is {mode} ({flag(mode)}). "
                       "Use another --workdir (nothing was changed)")
    if storage.is_file(self.config_path):
      old = _comparable(storage.read_text(self.config_path))
      new = _comparable(config_str)
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
    """Complete lines, and the byte offset where they end (a torn last line follows)."""
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

  def _open(self) -> None:
    """Before the first write: the directory, the torn-line repair, config.gin."""
    if self.remote:
      if self._size > self._good_end:
        logging.warning("Dropping a partial last line of %s (%d bytes)", self.examples_path,
                        self._size - self._good_end)
        storage.write_bytes(self.examples_path, self._content)
    else:
      os.makedirs(self.path, exist_ok=True)
      if (os.path.exists(self.examples_path)
          and os.path.getsize(self.examples_path) > self._good_end):
        logging.warning("Dropping a partial last line of %s (%d bytes)", self.examples_path,
                        os.path.getsize(self.examples_path) - self._good_end)
        with open(self.examples_path, "r+b") as f:
          f.truncate(self._good_end)
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
    line = json.dumps(record) + "\n"
    if self.remote:
      # No appends in Cloud Storage: the whole object, one atomic write per example.
      self._content += line.encode("utf-8")
      storage.write_bytes(self.examples_path, self._content)
    else:
      with open(self.examples_path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    self.records.append(record)

  def write_summary(self, summary: dict) -> None:
    if not self.writer:
      return
    if not self._opened:
      self._open()
    storage.write_bytes(self.summary_path, (json.dumps(summary, indent=2) + "\n").encode())
