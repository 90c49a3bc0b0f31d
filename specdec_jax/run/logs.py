"""One logging setup for every entry point: by default this package's own INFO
records as plain lines plus every warning and error; ``--verbose`` shows
every record with absl's prefix. Also hides libtpu's probing off a TPU and
TensorStore's native "no credentials file" line."""

from __future__ import annotations

import contextlib
import functools
import logging as std_logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

from absl import logging

from specdec_jax.dryrun import chips

_LIBRARY_LOGGERS = ("orbax", "jax", "absl")


# ``logging.info(..., extra=DETAIL)``: a record only ``--verbose`` shows.
DETAIL = {"detail": True}


class LibraryFilter:
  """Passes warnings, errors and INFO records (not ``DETAIL``) from files in
  ``OWN_DIRS`` (by location, not a path substring: a clone's virtualenv
  lies under ``specdec_jax/`` too)."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno >= std_logging.WARNING:
      return True
    return is_own(record.pathname) and not getattr(record, "detail", False)


class PlainFormatter(std_logging.Formatter):
  """An INFO record's message alone; warnings and errors prefixed."""

  def format(self, record: std_logging.LogRecord) -> str:
    text = super().format(record)
    if record.levelno >= std_logging.ERROR:
      return f"error: {text}"
    return f"warning: {text}" if record.levelno >= std_logging.WARNING else text


# The package's own directory, and the scripts that ship beside it in a clone.
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
OWN_DIRS = tuple(d for d in (_PACKAGE_DIR, _PACKAGE_DIR.parent / "scripts") if d.is_dir())


@functools.lru_cache(maxsize=4096)
def is_own(pathname: str) -> bool:
  """Whether the source file ``pathname`` lies inside one of ``OWN_DIRS``."""
  try:
    path = Path(pathname).resolve()
  except (OSError, RuntimeError):
    return False
  return any(path.is_relative_to(d) for d in OWN_DIRS)


def quiet_libraries(quiet: bool) -> None:
  """Installs (``quiet``) or removes ``LibraryFilter``, ``PlainFormatter``
  and ``quiet_unraisable``."""
  handler = logging.get_absl_handler()
  handler.setFormatter(PlainFormatter() if quiet else logging.PythonFormatter())
  targets = [handler] + [std_logging.getLogger(n) for n in _LIBRARY_LOGGERS]
  for t in targets:
    for f in [f for f in t.filters if isinstance(f, LibraryFilter)]:
      t.removeFilter(f)
    if quiet:
      t.addFilter(LibraryFilter())
  # Restored later, so an in-process caller keeps its own hook.
  global _previous_unraisablehook
  if quiet and sys.unraisablehook is not quiet_unraisable:
    _previous_unraisablehook, sys.unraisablehook = sys.unraisablehook, quiet_unraisable
  elif not quiet and sys.unraisablehook is quiet_unraisable:
    sys.unraisablehook = _previous_unraisablehook


_previous_unraisablehook = sys.__unraisablehook__


def quiet_libtpu(topology: Optional[str] = None) -> None:
  """Before JAX starts a backend: keeps an installed libtpu from probing off a
  TPU (``topology``: a dry run's, if valid)."""
  try:
    chips.parse_topology(topology or "")
  except ValueError:
    topology = chips.DEFAULT_TOPOLOGY
  chips.quiet_libtpu(topology)


def script_logging(verbose: bool) -> None:
  """The logging of an entry point outside ``absl.app`` (``verbose``: every
  library's INFO records on stderr)."""
  quiet_libtpu()
  root = std_logging.getLogger()
  if verbose:
    if not root.handlers:
      handler = std_logging.StreamHandler()
      handler.setFormatter(std_logging.Formatter(
          "%(levelname).1s %(asctime)s %(filename)s:%(lineno)d] %(message)s"))
      root.addHandler(handler)
    root.setLevel(std_logging.INFO)
  quiet_libraries(not verbose)


def quiet_unraisable(u: Any) -> None:
  """Drops TensorStore's 'Event loop is closed' reports (reads in flight after
  Orbax closed its loop on a corrupt checkpoint), passes everything else on."""
  if isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value):
    return
  _previous_unraisablehook(u)


# TensorStore's line when it finds no gcloud credentials (then reads anonymously).
NATIVE_NOISE = re.compile(rb"[IWEF]\d{4} [\d:.]+ +\d+ google_auth_provider\.cc:\d+\] "
                          rb"Could not find the credentials file in the standard gcloud location")
_ABSL_START = re.compile(rb"[IWEF]\d{0,4}( [\d:.]*)?")   # a line that may become NATIVE_NOISE


def _write_all(fd: int, data: bytes) -> None:
  while data:
    data = data[os.write(fd, data):]


def _pump(source: int, sink: int) -> None:
  """Copies ``source`` to ``sink`` line by line, without ``NATIVE_NOISE`` lines."""
  pending = b""
  with os.fdopen(source, "rb", buffering=0) as src:
    while chunk := src.read(1 << 16):
      *lines, pending = (pending + chunk).split(b"\n")
      kept = b"".join(l + b"\n" for l in lines if not NATIVE_NOISE.match(l))
      if pending and not _ABSL_START.fullmatch(pending[:20]):
        kept, pending = kept + pending, b""
      _write_all(sink, kept)
  if pending and not NATIVE_NOISE.match(pending):
    _write_all(sink, pending)


@contextlib.contextmanager
def quiet_native_noise(quiet: bool = True) -> Iterator[None]:
  """While inside, file descriptor 2 goes through a pipe dropping
  ``NATIVE_NOISE`` lines (stderr is then no terminal)."""
  if not quiet:
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  read_end, write_end = os.pipe()
  os.dup2(write_end, 2)
  os.close(write_end)
  pump = threading.Thread(target=_pump, args=(read_end, saved), daemon=True,
                          name="quiet_native_noise")
  pump.start()
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)    # the pipe's last write end closes: the pump drains and stops
    pump.join(timeout=10)
    os.close(saved)
