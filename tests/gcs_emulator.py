"""An in-memory Cloud Storage API server on localhost for tests
(``gcp-storage-emulator``), shared by tests/test_gcs.py and
tests/test_loading.py (and the workers they start, which reach it through
STORAGE_EMULATOR_HOST).

``running(log, requests)`` starts one with the bucket BUCKET; with
``requests`` (a file path) it appends one JSON line per download (the object
and the bytes served) and per listing (the prefix), so that a test can count
what a load fetched: ``read_requests(requests)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

BUCKET = "specdec-test"
# Where the emulator appends its request log (unset: no log).
REQUESTS_ENV = "SPECDEC_TEST_GCS_REQUESTS"

# ``gcp-storage-emulator start ...`` with two features of the real Cloud Storage
# JSON API that TensorStore uses and the emulator lacks: downloads carry the
# x-goog-generation header (OCDBT reads of orbax checkpoints need it), and
# listings honour startOffset/endOffset (TensorStore lists key ranges that way;
# keys outside the range crash it). Its listen backlog is raised from
# socketserver's 5: a loader with several reads in flight opens more
# connections at once than that, and the ones refused wait a second for the
# SYN to be retried. Uploads and deletes honour the ifGenerationMatch
# precondition ('0': only if the object does not exist), answering 412 when it
# fails, as the real API does: a workdir's writer hold is created and released
# with it. With REQUESTS_ENV set, it also logs every download (bytes served)
# and listing (the key range listed).
EMULATOR = """
import http, http.server, json, os, sys, threading
from gcp_storage_emulator.handlers import objects

http.server.HTTPServer.request_queue_size = 128

_download, _ls = objects.download, objects.ls
_log_path, _log_lock = os.environ.get("%s"), threading.Lock()


def log(**fields):
  if _log_path:
    with _log_lock, open(_log_path, "a") as f:
      f.write(json.dumps(fields) + "\\n")


def ls(request, response, storage, *args, **kwargs):
  start = (request.query.get("startOffset") or [None])[0]
  end = (request.query.get("endOffset") or [None])[0]
  write_json = response.json

  def in_range(item):
    return (start is None or item["name"] >= start) and (end is None or item["name"] < end)

  response.json = lambda obj: write_json(
      {**obj, "items": [i for i in obj.get("items") or [] if in_range(i)]})
  log(op="list", prefix=(request.query.get("prefix") or [""])[0], start=start, end=end)
  return _ls(request, response, storage, *args, **kwargs)


def download(request, response, storage, *args, **kwargs):
  try:
    obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    response["x-goog-generation"] = str(obj.get("generation") or 1)
    response["x-goog-metageneration"] = str(obj.get("metageneration") or 1)
  except Exception:
    pass
  write_file = response.write_file

  def counted(content, *a, **k):
    log(op="download", object=request.params["object_id"], bytes=len(content))
    return write_file(content, *a, **k)

  response.write_file = counted
  return _download(request, response, storage, *args, **kwargs)


def _generation(storage, bucket, name):
  try:
    return str(storage.get_file_obj(bucket, name).get("generation") or 1)
  except Exception:
    return "0"  # no such object


def _unmet(request, storage, name):
  # Whether the request's ifGenerationMatch precondition fails (412).
  want = (request.query.get("ifGenerationMatch") or [None])[0]
  if want is None or name is None:
    return False
  return _generation(storage, request.params["bucket_name"], name) != want


def _precondition_failed(response):
  response.status = http.HTTPStatus.PRECONDITION_FAILED
  response.json({"error": {"code": 412, "message": "Precondition Failed", "errors": [
      {"domain": "global", "reason": "conditionNotMet", "message": "Precondition Failed"}]}})


_insert, _delete = objects.insert, objects.delete
_conditional = threading.Lock()  # the check and the write as one step


def insert(request, response, storage, *args, **kwargs):
  name = (request.query.get("name") or [None])[0]
  if name is None and isinstance(request.data, dict):
    name = (request.data.get("meta") or {}).get("name")
  with _conditional:
    if _unmet(request, storage, name):
      return _precondition_failed(response)
    return _insert(request, response, storage, *args, **kwargs)


def delete(request, response, storage, *args, **kwargs):
  with _conditional:
    if _unmet(request, storage, request.params["object_id"]):
      return _precondition_failed(response)
    return _delete(request, response, storage, *args, **kwargs)


objects.download, objects.ls, objects.insert, objects.delete = download, ls, insert, delete
from gcp_storage_emulator.__main__ import main
sys.argv = ["gcp-storage-emulator", *sys.argv[1:]]
sys.exit(main())
""" % REQUESTS_ENV


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def running(log: Path, requests: Optional[Path] = None) -> Iterator[str]:
  """``host:port`` of a fresh emulator holding the empty bucket BUCKET, for the
  ``with`` block; its stderr goes to ``log``, its request log to ``requests``.
  Raises RuntimeError (with the log's end) if it does not answer in 30 s."""
  port = free_port()
  env = dict(os.environ)
  env.pop(REQUESTS_ENV, None)
  if requests is not None:
    env[REQUESTS_ENV] = str(requests)
  # stderr to a file: a pipe would fill and block the server.
  with open(log, "wb") as err:
    proc = subprocess.Popen(
        [sys.executable, "-c", EMULATOR, "start", "--host=127.0.0.1", f"--port={port}",
         "--in-memory", f"--default-bucket={BUCKET}"],
        stdout=subprocess.DEVNULL, stderr=err, env=env)
  try:
    deadline = time.monotonic() + 30
    while True:
      try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/storage/v1/b/{BUCKET}",
                                    timeout=1) as r:
          if r.status == 200:
            break
      except OSError:
        pass
      if proc.poll() is not None or time.monotonic() > deadline:
        raise RuntimeError(f"the Cloud Storage emulator did not start: "
                           f"{log.read_text()[-2000:]}")
      time.sleep(0.1)
    yield f"127.0.0.1:{port}"
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def read_requests(path: Path, start: int = 0) -> list[dict]:
  """The logged requests from line ``start`` on (none if nothing was logged)."""
  if not Path(path).exists():
    return []
  return [json.loads(line) for line in Path(path).read_text().splitlines()[start:]]
