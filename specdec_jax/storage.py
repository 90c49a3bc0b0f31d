"""Paths and bytes, local or in Cloud Storage, for every reader and writer.

``gs://`` goes through TensorStore's ``gcs`` kvstore (no TensorFlow, no Cloud SDK): a
"directory" is the prefix ``key/``, each call returns within ``TIMEOUT_S`` (bounded
``RETRIES``), a failure is a one-line ``StorageError`` naming the path, and
``STORAGE_EMULATOR_HOST`` points it at an emulator."""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import os
import re
from typing import Iterator, Optional

GCS_PREFIX = "gs://"
DEFAULT_ENDPOINT = "https://storage.googleapis.com"
# TensorStore's Context.gcs_request_retries: a bounded number of quick retries.
RETRIES = {"max_retries": 4, "initial_delay": "100ms", "max_delay": "2s"}
# The most seconds one call of this module waits (retries included).
TIMEOUT_S = 120.0
# A value for GOOGLE_AUTH_TOKEN_FOR_TESTING when an emulator is used (any token does).
EMULATOR_TOKEN = "emulator"

# The values configure_emulator set (a value set by the user is never replaced).
_derived: dict[str, str] = {}

# cached_listings' snapshot: prefix path (no trailing '/') -> its sorted relative keys.
_listings: contextvars.ContextVar[Optional[dict[str, list[str]]]] = contextvars.ContextVar(
    "specdec_storage_listings", default=None)


class StorageError(OSError):
  """A local or ``gs://`` path could not be read or written (one-line message)."""


class StorageNotFoundError(StorageError, FileNotFoundError):
  """The object (or file), or the bucket holding it, does not exist."""


class StorageUnreachableError(StorageError, ConnectionError):
  """The Cloud Storage endpoint did not answer (network, emulator not running)."""


class StorageAccessError(StorageError, PermissionError):
  """Cloud Storage refused the request (credentials or permissions)."""


def is_gcs(path: str) -> bool:
  return str(path).startswith(GCS_PREFIX)


def split(path: str) -> tuple[str, str]:
  """``gs://bucket/a/b`` -> ('bucket', 'a/b'); a malformed URL is a ValueError."""
  bucket, _, key = path[len(GCS_PREFIX):].partition("/")
  if not bucket or not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]", bucket):
    raise ValueError(f"malformed Cloud Storage path {path!r}: expected gs://BUCKET/OBJECT "
                     "with a valid bucket name")
  return bucket, key.strip("/")


def check_path(path: str) -> None:
  """ValueError for a malformed ``gs://`` path (no network)."""
  if is_gcs(path):
    split(path)


def join(base: str, *parts: str) -> str:
  if is_gcs(base):
    return "/".join([base.rstrip("/")] + [p.strip("/") for p in parts if p])
  return os.path.join(base, *parts)


def basename(path: str) -> str:
  return path.rstrip("/").rsplit("/", 1)[-1] if is_gcs(path) else os.path.basename(
      path.rstrip(os.sep))


def dirname(path: str) -> str:
  return path.rstrip("/").rsplit("/", 1)[0] if is_gcs(path) else os.path.dirname(path)


def emulator_url() -> Optional[str]:
  """The URL ``STORAGE_EMULATOR_HOST`` names (``host:port`` gets ``http://``), if set."""
  host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
  if not host:
    return None
  return host.rstrip("/") if "://" in host else f"http://{host.rstrip('/')}"


def configure_emulator() -> None:
  """Point TensorStore at ``STORAGE_EMULATOR_HOST`` where the user has not set its
  variables (and undo that when it is unset); called before every ``gs://`` access."""
  url = emulator_url()
  wanted = {"TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": EMULATOR_TOKEN}
  for name, value in wanted.items():
    current = os.environ.get(name)
    ours = name in _derived and current == _derived[name]
    if url is None:
      if ours:
        del os.environ[name]
        del _derived[name]
      continue
    if current is None or ours:
      os.environ[name] = value
      _derived[name] = value


def endpoint() -> str:
  configure_emulator()
  return os.environ.get("TENSORSTORE_GCS_HTTP_URL") or DEFAULT_ENDPOINT


def kvstore_spec(path: str) -> dict:
  """A TensorStore kvstore spec for a local or ``gs://`` path (open with ``context()``)."""
  if is_gcs(path):
    configure_emulator()
    bucket, key = split(path)
    return {"driver": "gcs", "bucket": bucket, "path": key}
  return {"driver": "file", "path": os.path.abspath(path)}


_context = None


def context() -> "tensorstore.Context":  # noqa: F821 (imported lazily)
  """The shared TensorStore Context for ``gs://`` opens, with ``RETRIES``."""
  global _context
  if _context is None:
    _context = _ts().Context({"gcs_request_retries": dict(RETRIES)})
  return _context


def _ts():
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  return ts


def _kvstore(bucket: str, prefix: str = ""):
  configure_emulator()
  spec = {"driver": "gcs", "bucket": bucket, "path": prefix}
  return _ts().KvStore.open(spec, context=context()).result(timeout=TIMEOUT_S)


def credentials_note() -> str:
  """Where credentials would come from (for error messages)."""
  if os.environ.get("GOOGLE_AUTH_TOKEN_FOR_TESTING"):
    return "GOOGLE_AUTH_TOKEN_FOR_TESTING is set (no real credentials are used)"
  if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
    return f"credentials from GOOGLE_APPLICATION_CREDENTIALS=" \
           f"{os.environ['GOOGLE_APPLICATION_CREDENTIALS']}"
  config = os.environ.get("CLOUDSDK_CONFIG") or os.path.expanduser("~/.config/gcloud")
  if os.path.isfile(os.path.join(config, "application_default_credentials.json")):
    return "gcloud application-default credentials found"
  return ("no credentials found: GOOGLE_APPLICATION_CREDENTIALS is unset and there are no "
          "gcloud application-default credentials, which only public buckets and Cloud TPU or "
          "Compute Engine VMs do without")


def _reason(e: BaseException) -> str:
  """TensorStore's error in a few words (first line, no status prefix or payloads)."""
  text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  text = re.sub(r"\s*\[[a-z_]+=[^\]]*\]", "", text)
  attempts = re.search(r"All (\d+) retry attempts failed: (?:CURL error )?(.*)", text)
  if attempts:
    # curl repeats itself: "Could not connect to server: Failed to connect ...: Could not ..."
    detail = re.sub(r"^Could not (connect to server|resolve hostname): ", "", attempts.group(2))
    detail = re.sub(r": Could not connect to server$", "", detail.rstrip(": "))
    text = f"{detail}; {attempts.group(1)} attempts"
  return text[:300]


def _unreachable(path: str, reason: str) -> StorageUnreachableError:
  url = endpoint()
  if emulator_url() and url == emulator_url():
    return StorageUnreachableError(
        f"{path}: cannot reach the Cloud Storage emulator at {url} (STORAGE_EMULATOR_HOST="
        f"{os.environ['STORAGE_EMULATOR_HOST']}): is it running? ({reason})")
  return StorageUnreachableError(f"{path}: cannot reach Cloud Storage at {url}: no network "
                                 f"connection? ({reason}; {credentials_note()})")


def _classify(path: str, e: BaseException) -> StorageError:
  """A one-line StorageError for a TensorStore failure on ``path``."""
  if isinstance(e, TimeoutError):
    return _unreachable(path, f"no answer within {TIMEOUT_S:.0f} s")
  reason, raw = _reason(e), str(e)
  if re.search(r"CURL error|Could not (connect|resolve)|Failed to connect|UNAVAILABLE|"
               r"DEADLINE_EXCEEDED|Connection refused|timed out", raw):
    return _unreachable(path, reason)
  if re.search(r"PERMISSION_DENIED|UNAUTHENTICATED|\b40[13]\b", raw):
    return StorageAccessError(f"{path}: Cloud Storage refused access ({reason}; "
                              f"{credentials_note()})")
  if "NOT_FOUND" in raw:
    return StorageNotFoundError(f"{path}: not found in Cloud Storage ({reason})")
  return StorageError(f"{path}: Cloud Storage request failed ({reason})")


def _bucket_missing(bucket: str, key: str) -> bool:
  """Whether listing at ``key`` fails for want of the bucket."""
  ts = _ts()
  try:
    _kvstore(bucket).list(ts.KvStore.KeyRange(key, key + "\x00")).result(timeout=TIMEOUT_S)
  except Exception as e:  # pylint: disable=broad-except
    err = _classify(f"gs://{bucket}", e)
    if isinstance(err, (StorageUnreachableError, StorageAccessError)):
      raise err from None
    # GCS answers 404 for a missing bucket; the emulator's empty 404 body fails to parse.
    return True
  return False


def bucket_exists(path: str) -> bool:
  """Whether the bucket of a ``gs://`` path exists (unreachable or refused raises)."""
  return not _bucket_missing(*split(path))


def not_found(path: str, what: str = "", prefix: bool = False) -> StorageNotFoundError:
  """The error for a missing file or object, saying whether a ``gs://`` bucket is missing."""
  label = f"{what} {path}" if what else path
  if not is_gcs(path):
    return StorageNotFoundError(f"{label} does not exist")
  bucket, key = split(path)
  if _bucket_missing(bucket, key):
    return StorageNotFoundError(f"{label}: the bucket gs://{bucket} does not exist (or "
                                "cannot be listed)")
  if prefix:
    return StorageNotFoundError(f"{label} does not exist (bucket gs://{bucket} has no objects "
                                f"under {key + '/'!r})")
  return StorageNotFoundError(f"{label} does not exist (bucket gs://{bucket} has no object "
                              f"{key!r})")


def _read_object(path: str, byte_range: Optional[slice] = None) -> Optional[bytes]:
  """The object's bytes (in ``byte_range``), or None if there is none."""
  bucket, key = split(path)
  if not key:
    return None
  try:
    result = _kvstore(bucket).read(key, byte_range=byte_range).result(timeout=TIMEOUT_S)
  except Exception as e:  # TensorStore raises ValueError subclasses and TimeoutError
    raise _classify(path, e) from None
  return bytes(result.value) if result.state == "value" else None


def _list_prefix(path: str) -> list[str]:
  """Keys under ``path/``, relative to it (from a cached listing if one covers it)."""
  cache = _listings.get()
  cached = None if cache is None else _cached_keys(cache, path)
  if cached is not None:
    return cached
  bucket, key = split(path)
  prefix = f"{key}/" if key else ""
  try:
    keys = _kvstore(bucket, prefix).list().result(timeout=TIMEOUT_S)
  except Exception as e:  # pylint: disable=broad-except
    err = _classify(path, e)
    if isinstance(err, (StorageUnreachableError, StorageAccessError)):
      raise err from None
    raise not_found(path, prefix=True) from None
  keys = sorted(k.decode() for k in keys)
  if cache is not None:
    cache[path.rstrip("/")] = keys
  return keys


def _cached_keys(cache: dict[str, list[str]], path: str) -> Optional[list[str]]:
  """The keys under ``path/`` from a cached listing; None if none covers it."""
  path = path.rstrip("/")
  if path in cache:
    return cache[path]
  for prefix, keys in cache.items():
    if path.startswith(prefix + "/"):
      rel = path[len(prefix) + 1:] + "/"
      lo = bisect.bisect_left(keys, rel)
      hi = bisect.bisect_left(keys, rel[:-1] + chr(ord("/") + 1))
      return [k[len(rel):] for k in keys[lo:hi]]
  return None


def _cached_object(path: str) -> Optional[bool]:
  """Whether object ``path`` exists per a cached listing; None if none covers it."""
  cache = _listings.get()
  if not cache:
    return None
  parent, _, name = path.rstrip("/").rpartition("/")
  keys = _cached_keys(cache, parent) if parent != "gs:/" else None
  if keys is None:
    return None
  i = bisect.bisect_left(keys, name)
  return i < len(keys) and keys[i] == name


@contextlib.contextmanager
def cached_listings() -> Iterator[None]:
  """Inside the block each ``gs://`` prefix is listed at most once and questions below it
  answered from that snapshot (for a directory that does not change, per thread)."""
  if _listings.get() is not None:
    yield
    return
  token = _listings.set({})
  try:
    yield
  finally:
    _listings.reset(token)


def read_bytes(path: str, what: str = "") -> bytes:
  if is_gcs(path):
    data = _read_object(path)
    if data is None:
      raise not_found(path, what)
    return data
  if not os.path.isfile(path):
    raise not_found(path, what)
  with open(path, "rb") as f:
    return f.read()


def read_range(path: str, start: int, stop: int) -> bytes:
  """Bytes [start, stop) of a local file or ``gs://`` object (no more is fetched)."""
  if not is_gcs(path):
    with open(path, "rb") as f:
      f.seek(start)
      return f.read(stop - start)
  data = _read_object(path, slice(start, stop))
  if data is None:
    raise not_found(path)
  return data


def exists(path: str) -> bool:
  """A file or directory (local), an object or non-empty prefix (``gs://``)."""
  if not is_gcs(path):
    return os.path.exists(path)
  cached = _cached_object(path)
  if cached or (cached is None and _read_object(path, slice(0, 0)) is not None):
    return True
  return is_dir(path)


def is_file(path: str) -> bool:
  if is_gcs(path):
    cached = _cached_object(path)
    return cached if cached is not None else _read_object(path, slice(0, 0)) is not None
  return os.path.isfile(path)


def is_dir(path: str) -> bool:
  if not is_gcs(path):
    return os.path.isdir(path)
  try:
    return bool(_list_prefix(path))
  except StorageNotFoundError:
    return False


def listdir(path: str) -> list[str]:
  """The sorted names directly inside a directory (for ``gs://`` all keys below are listed)."""
  if is_gcs(path):
    return sorted({k.split("/", 1)[0] for k in _list_prefix(path)})
  return sorted(os.listdir(path))


def write_bytes(path: str, data: bytes) -> None:
  """Replace the file or object at ``path`` with ``data``, whole or not at all."""
  if is_gcs(path):
    bucket, key = split(path)
    try:
      _kvstore(bucket).write(key, data).result(timeout=TIMEOUT_S)
    except Exception as e:  # pylint: disable=broad-except
      err = _classify(path, e)
      if isinstance(err, (StorageUnreachableError, StorageAccessError)):
        raise err from None
      if _bucket_missing(bucket, key):
        raise StorageNotFoundError(f"cannot write {path}: the bucket gs://{bucket} does not "
                                   "exist (or cannot be listed)") from None
      raise err from None
    return
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  tmp = f"{path}.tmp"
  with open(tmp, "wb") as f:
    f.write(data)
  os.replace(tmp, path)


# TensorStore's generation of an absent object: a write conditioned on it creates the
# object only if there is none (``ifGenerationMatch=0``).
NO_OBJECT = b"\x02"


def read_versioned(path: str) -> tuple[Optional[bytes], bytes]:
  """A ``gs://`` object's bytes and generation (None, ``NO_OBJECT`` if absent), for ``write_if``."""
  bucket, key = split(path)
  try:
    result = _kvstore(bucket).read(key).result(timeout=TIMEOUT_S)
  except Exception as e:  # pylint: disable=broad-except
    raise _classify(path, e) from None
  if result.state != "value":
    return None, NO_OBJECT
  return bytes(result.value), bytes(result.stamp.generation)


def write_if(path: str, data: Optional[bytes], generation: bytes) -> Optional[bytes]:
  """Write ``data`` (None: delete) only if the object's generation is still ``generation``
  -> the new generation, or None if another writer changed it."""
  bucket, key = split(path)
  try:
    stamp = _kvstore(bucket).write(key, data, if_equal=generation).result(timeout=TIMEOUT_S)
  except Exception as e:  # pylint: disable=broad-except
    raise _classify(path, e) from None
  new = bytes(stamp.generation)
  return new if new else None  # TensorStore's unknown generation: the condition failed


def read_text(path: str, what: str = "") -> str:
  """``read_bytes`` decoded as UTF-8 (a bad byte is a ValueError naming its line and column)."""
  raw = read_bytes(path, what)
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw.count(b"\n", 0, e.start) + 1
    col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
    raise ValueError(f"{path}:{line}: not valid UTF-8 (byte {raw[e.start]:#04x} at column "
                     f"{col}: {e.reason}); save the file as UTF-8") from None
