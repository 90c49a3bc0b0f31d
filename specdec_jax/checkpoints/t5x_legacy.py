"""T5X's legacy layout: a msgpack file ``checkpoint`` whose parameter leaves
are inline arrays or TensorStore zarr specs relative to the directory holding
it. That directory is ``checkpoint_<step>/``, or ``checkpoint_<step>/state/``
when that holds the msgpack and no orbax ``_METADATA``: T5X's restore reads
``state/checkpoint`` whenever ``state/`` exists, takes it for its own format
unless orbax's ``_METADATA`` is beside it, and resolves the specs against the
msgpack file's directory. Local paths and ``gs://`` paths.

Each TensorStore array is opened once, when it is placed, and read as a
``placement.ChunkedReader``: the chunks this host's devices need are fetched
and decoded once, whatever the number of devices.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Mapping, Optional

import numpy as np

from specdec_jax.checkpoints import placement
from specdec_jax.checkpoints.common import (T5X_MSGPACK, CheckpointError, check_shapes,
                                            flatten, is_gcs, join, kvstore_spec, read_bytes,
                                            subtree_keys)
from specdec_jax.models.t5 import T5Config
from specdec_jax.partitioning import Partitioner


def is_ts_spec(x: Any) -> bool:
  """Whether a msgpack leaf is a TensorStore spec (a dict with a driver)."""
  return isinstance(x, Mapping) and "driver" in x


def resolve_ts_spec(spec: Mapping, step_dir: str) -> dict:
  """Points a saved zarr spec at its array inside ``step_dir``.

  T5X stores paths relative to the step directory, either at the top level
  (old: ``path``) or in ``kvstore.path``; the saved driver/bucket may name
  where the checkpoint was written, not where it is now, so it is replaced by
  one for ``step_dir`` (local file or gs://). Absolute paths are kept.
  """
  spec = dict(spec)
  kvstore = spec.pop("kvstore", None)
  rel = spec.pop("path", None)
  if isinstance(kvstore, Mapping):
    rel = kvstore.get("path", rel)
  elif isinstance(kvstore, str):  # a URL-style kvstore
    rel = kvstore
  if not rel:
    raise CheckpointError(f"{step_dir}: TensorStore spec without a path: {dict(spec)}")
  if os.path.isabs(rel) or is_gcs(rel):
    target = rel
  else:
    target = join(step_dir, rel)
  spec["kvstore"] = kvstore_spec(target)
  return spec


def _where(resolved: dict, name: str) -> str:
  return f"{name} at {resolved['kvstore']}"


def _ts_shape(spec: Mapping, resolved: dict, name: str, step_dir: str) -> tuple[int, ...]:
  meta = spec.get("metadata")
  if isinstance(meta, Mapping) and "shape" in meta:
    return tuple(int(s) for s in meta["shape"])
  return tuple(placement.open_tensorstore(resolved, step_dir, _where(resolved, name)).shape)


def _ts_reader(resolved: dict, name: str, step_dir: str) -> placement.ChunkedReader:
  """Opens the array once; the reader fetches one region (whole chunks) per call."""
  return placement.tensorstore_reader(resolved, step_dir, _where(resolved, name))


def _inline_reader(arr: np.ndarray) -> placement.SliceReader:
  return lambda index: arr[index]


def _t5x_target(state: Any, msgpack_path: str) -> Mapping:
  """The parameter tree inside a decoded T5X msgpack checkpoint."""
  if not isinstance(state, Mapping):
    raise CheckpointError(f"{msgpack_path}: expected a dict at the top level, "
                          f"got {type(state).__name__}")
  keys = subtree_keys(state, (("optimizer", "target"), ("target",), ("params",)))
  if keys is None:
    raise CheckpointError(f"{msgpack_path}: no optimizer/target parameters; "
                          f"top-level keys: {sorted(map(str, state))}")
  for k in keys:
    state = state[k]
  return state


def load_t5x(step_dir: str, config: T5Config, param_dtype: Any,
             partitioner: Optional[Partitioner] = None) -> dict:
  """The parameters of one T5X msgpack checkpoint, placed in their shards.

  ``step_dir`` is the directory holding the msgpack file ``checkpoint`` (a
  ``checkpoint_<step>`` directory or its ``state/``); TensorStore specs are
  resolved against it. From ``gs://``, ``placement.IN_FLIGHT`` arrays are
  read at once.
  """
  from flax import serialization
  msgpack_path = join(step_dir, T5X_MSGPACK)
  raw = read_bytes(msgpack_path)
  try:
    state = serialization.msgpack_restore(raw)
  except Exception as e:  # msgpack raises several unrelated exception types
    raise CheckpointError(f"{msgpack_path}: corrupt msgpack checkpoint: {e}") from e
  del raw
  target = _t5x_target(state, msgpack_path)
  del state  # keep only the target subtree (optimizer state is dropped unread)
  sources = {}
  for name, leaf in flatten(target, is_leaf=is_ts_spec).items():
    if isinstance(leaf, str):  # e.g. orbax's "PLACEHOLDER://<name>" for an array stored apart
      raise CheckpointError(f"{msgpack_path}: parameter {name} is the string {leaf[:60]!r}, "
                            "not an array or a TensorStore spec (an orbax placeholder? then "
                            "this is an orbax checkpoint written without _METADATA, which "
                            "this loader does not read)")
    if is_ts_spec(leaf):
      resolved = resolve_ts_spec(leaf, step_dir)
      sources[name] = placement.ArraySource(
          _ts_shape(leaf, resolved, name, step_dir),
          functools.partial(_ts_reader, resolved, name, step_dir))
    else:
      arr = np.asarray(leaf)
      sources[name] = placement.ArraySource(arr.shape, functools.partial(_inline_reader, arr))
  check_shapes({n: s.shape for n, s in sources.items()}, config, step_dir)
  return placement.place_arrays(sources, param_dtype, partitioner,
                                placement.in_flight_for(step_dir))
