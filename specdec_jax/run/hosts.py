"""What every process of a multi-host run must agree on (the loops are
collective: a process running another batch hangs the others): decisions on
process 0's files are broadcast, outputs all-gathered. With one process every
function here is the identity.
"""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils

T = TypeVar("T")


def is_writer() -> bool:
  """Process 0 writes results and prints; the others only compute."""
  return jax.process_index() == 0


def to_host(tree: Any) -> Any:
  """A pytree of device arrays as numpy arrays of every row, on every process."""
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def broadcast_json(value: Any) -> Any:
  """Process 0's JSON-serializable ``value``, on every process."""
  if jax.process_count() == 1:
    return value
  data = np.frombuffer(json.dumps(value).encode() if is_writer() else b"", np.uint8)
  n = int(multihost_utils.broadcast_one_to_all(np.array([data.size], np.int64))[0])
  buf = np.zeros(n, np.uint8)
  if is_writer():
    buf[:] = data
  return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).decode())


def agreed(build: Callable[[], T], what: str) -> T:
  """``build()`` on every process, failing on all if it fails on any (the
  others raise a short error naming ``what``)."""
  if jax.process_count() == 1:
    return build()
  result, error = None, None
  try:
    result = build()
  except (ValueError, OSError, LookupError) as e:
    error = e
  failed = np.asarray(multihost_utils.process_allgather(np.array([error is not None])))
  if error is not None:
    raise error
  if failed.any():
    bad = [int(i) for i in np.nonzero(failed.reshape(-1))[0]]
    raise ValueError(f"{what} failed on process {bad} (see its error); process "
                     f"{jax.process_index()} stops too")
  return result
