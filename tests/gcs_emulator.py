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
import threading
import time
import urllib.parse
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
# and listing (the key range listed). An empty media upload (TensorFlow writes
# one per folder) is stored as an empty object (the emulator crashes on it), a
# chunked body is read as chunks even beside a Content-Length (TensorFlow sends
# both; the emulator would store the chunk framing), and a bucket's
# storageLayout is answered (flat; TensorFlow asks before it renames a folder).
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


_media_upload = objects._media_upload


def media_upload(request, response, storage, *args, **kwargs):
  if request.data is None:  # an empty object (TensorFlow's folder markers)
    request._data = b""
  return _media_upload(request, response, storage, *args, **kwargs)


objects._media_upload = media_upload

from gcp_storage_emulator import server as _server
_read_raw_data = _server._read_raw_data


def read_raw_data(handler):
  # A chunked body's length is the chunks' (RFC 9112 6.3): TensorFlow sends a
  # Content-Length beside Transfer-Encoding: chunked, which the emulator obeys.
  if (handler.headers.get("Transfer-Encoding") or "").lower() == "chunked":
    del handler.headers["Content-Length"]
  return _read_raw_data(handler)


_server._read_raw_data = read_raw_data


def storage_layout(request, response, storage, *args, **kwargs):
  # A flat bucket's layout (TensorFlow asks before renaming a folder).
  name = request.params["bucket_name"]
  response.json({"kind": "storage#storageLayout", "bucket": name, "location": "US",
                 "locationType": "multi-region", "hierarchicalNamespace": {"enabled": False}})


_server.HANDLERS = ((r"^/storage/v1/b/(?P<bucket_name>[-.\\w]+)/storageLayout$",
                     {"GET": storage_layout}),) + _server.HANDLERS
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


# --------------------------------------------------------------------------- more buckets


def create_bucket(host: str, name: str) -> None:
  """Creates bucket ``name`` on the emulator at ``host`` (``host:port``)."""
  request = urllib.request.Request(
      f"http://{host}/storage/v1/b?project=test", method="POST",
      data=json.dumps({"name": name}).encode(), headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(request, timeout=10) as r:
    if r.status != 200:
      raise RuntimeError(f"could not create bucket {name}: HTTP {r.status}")


def upload(host: str, url: str, data: bytes) -> None:
  """Writes ``data`` to the object ``gs://bucket/name`` on the emulator at ``host``."""
  bucket, _, name = url[len("gs://"):].partition("/")
  request = urllib.request.Request(
      f"http://{host}/upload/storage/v1/b/{bucket}/o?uploadType=media&name="
      f"{urllib.parse.quote(name, safe='')}", data=data, method="POST",
      headers={"Content-Type": "application/octet-stream"})
  with urllib.request.urlopen(request, timeout=30) as r:
    if r.status != 200:
      raise RuntimeError(f"could not upload {url}: HTTP {r.status}")


def upload_tree(host: str, local: Path, url: str) -> int:
  """Every file under ``local`` to the same relative path under ``url``; returns the count."""
  files = [p for p in sorted(Path(local).rglob("*")) if p.is_file()]
  for path in files:
    upload(host, f"{url.rstrip('/')}/{path.relative_to(local).as_posix()}", path.read_bytes())
  return len(files)


# --------------------------------------------------------------------------- TensorFlow's client

# The names TensorFlow's own Cloud Storage client calls: metadata, listings and
# uploads on the first, object reads on the second.
GOOGLE_HOSTS = ("www.googleapis.com", "storage.googleapis.com")


def _certificates(folder: Path, hosts: tuple[str, ...]) -> tuple[Path, Path, Path]:
  """A throw-away certificate authority and a server certificate for ``hosts``
  signed by it (``openssl``): (CA file, certificate file, key file)."""
  ca, ca_key = folder / "ca.pem", folder / "ca.key"
  cert, key, request = folder / "server.pem", folder / "server.key", folder / "server.csr"
  ext = folder / "server.ext"
  ext.write_text("basicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth\n"
                 "subjectAltName=" + ",".join(f"DNS:{h}" for h in hosts) + "\n"
                 "authorityKeyIdentifier=keyid\n")
  ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
  for cmd in (
      ["openssl", "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2",
       "-subj", "/CN=specdec test CA", "-addext", "basicConstraints=critical,CA:TRUE",
       "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
      ["openssl", "req", "-new", *ec, "-keyout", key, "-out", request, "-subj", f"/CN={hosts[0]}"],
      ["openssl", "x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key,
       "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", ext]):
    subprocess.run([str(c) for c in cmd], check=True, capture_output=True)
  return ca, cert, key


def _pipe(src, dst) -> None:
  """Copies ``src`` to ``dst`` until ``src`` ends, then ends ``dst``'s writing side."""
  try:
    while chunk := src.recv(65536):
      dst.sendall(chunk)
  except OSError:
    pass
  finally:
    try:
      dst.shutdown(socket.SHUT_WR)
    except OSError:
      pass


def _relay(client, upstream) -> None:
  back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
  back.start()
  _pipe(client, upstream)
  back.join(timeout=60)
  for s in (client, upstream):
    try:
      s.close()
    except OSError:
      pass


def _read_head(conn) -> tuple[bytes, bytes]:
  """(the request's head up to its blank line, what came after it)."""
  data = b""
  while b"\r\n\r\n" not in data:
    chunk = conn.recv(65536)
    if not chunk:
      break
    data += chunk
  head, _, rest = data.partition(b"\r\n\r\n")
  return head, rest


@contextlib.contextmanager
def google_endpoints(emulator: str, folder: Path) -> Iterator[dict[str, str]]:
  """The environment under which TensorFlow's own Cloud Storage client (what
  ``tf.io.gfile`` and ``tf.data`` use for gs://: TensorFlow Datasets writing
  and reading a data dir, seqio) reaches the emulator at ``emulator``.

  That client has no emulator setting: it always calls https://GOOGLE_HOSTS.
  It does honour the standard proxy variables and ``CURL_CA_BUNDLE``, so this
  runs, for the ``with`` block, a proxy on localhost that answers a CONNECT to
  either name with TLS under a certificate from a throw-away authority (the
  bundle it names) and passes each request on to the emulator; a plain-HTTP
  request (the emulator's resumable-upload Location) goes the same way. The
  environment also holds STORAGE_EMULATOR_HOST, so every other client
  (TensorStore, through ``specdec_jax.storage``) talks to the emulator directly."""
  import socketserver  # pylint: disable=g-import-not-at-top
  import ssl  # pylint: disable=g-import-not-at-top
  ca, cert, key = _certificates(folder, GOOGLE_HOSTS)
  context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  context.load_cert_chain(cert, key)
  target = emulator.rsplit(":", 1)
  address = (target[0], int(target[1]))

  class Proxy(socketserver.BaseRequestHandler):
    def handle(self):
      head, rest = _read_head(self.request)
      method, _, line_rest = head.partition(b" ")
      where, _, version_and_headers = line_rest.partition(b" ")
      if method == b"CONNECT":
        if where.split(b":")[0].decode() not in GOOGLE_HOSTS:
          self.request.sendall(b"HTTP/1.1 403 Forbidden\r\n\r\n")
          return
        self.request.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        client = context.wrap_socket(self.request, server_side=True)
        _relay(client, socket.create_connection(address))
        return
      parts = urllib.parse.urlsplit(where.decode())
      if parts.hostname not in GOOGLE_HOSTS:
        self.request.sendall(b"HTTP/1.1 403 Forbidden\r\n\r\n")
        return
      path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
      upstream = socket.create_connection(address)
      upstream.sendall(method + b" " + path.encode() + b" " + version_and_headers
                       + b"\r\n\r\n" + rest)
      _relay(self.request, upstream)

  class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

  server = Server(("127.0.0.1", 0), Proxy)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  proxy = f"http://127.0.0.1:{server.server_address[1]}"
  try:
    yield {"STORAGE_EMULATOR_HOST": emulator, "https_proxy": proxy, "http_proxy": proxy,
           "HTTPS_PROXY": proxy, "HTTP_PROXY": proxy, "no_proxy": "127.0.0.1,localhost",
           "NO_PROXY": "127.0.0.1,localhost", "CURL_CA_BUNDLE": str(ca),
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator"}
  finally:
    server.shutdown()
    server.server_close()
