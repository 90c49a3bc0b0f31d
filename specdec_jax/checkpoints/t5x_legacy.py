"""T5X's legacy layout: a msgpack ``checkpoint`` whose leaves are inline arrays or
TensorStore zarr specs relative to its directory (``checkpoint_<step>/`` or its
``state/``, by T5X's rule). Each TensorStore array is read as a ``ChunkedReader``."""

from __future__ import annotations

import functools
import os
from typing import Any, Mapping, Optional

import numpy as np

from specdec_jax.checkpoints import placement
from specdec_jax.checkpoints.common import (T5X_MSGPACK, CheckpointError, check_shapes, flatten,
                                            is_gcs, join, kvstore_spec, read_bytes, subtree_keys)
from specdec_jax.models.t5 import T5Config
from specdec_jax.partitioning import Partitioner


def is_ts_spec(x: Any) -> bool:
  return isinstance(x, Mapping) and "driver" in x


def resolve_ts_spec(spec: Mapping, step_dir: str) -> dict:
  """A saved zarr spec pointed at its array: a relative path is joined to ``step_dir``."""
  spec = dict(spec)
  kvstore = spec.pop("kvstore", None)
  rel = spec.pop("path", None)
  if isinstance(kvstore, Mapping):
    rel = kvstore.get("path", rel)
  elif isinstance(kvstore, str):  # a URL-style kvstore
    rel = kvstore
  if not rel:
    raise CheckpointError(f"{step_dir}: TensorStore spec without a path: {dict(spec)}")
  spec["kvstore"] = kvstore_spec(rel if os.path.isabs(rel) or is_gcs(rel) else join(step_dir, rel))
  return spec


def _where(resolved: dict, name: str) -> str:
  return f"{name} at {resolved['kvstore']}"


def _ts_shape(spec: Mapping, resolved: dict, name: str, step_dir: str) -> tuple[int, ...]:
  meta = spec.get("metadata")
  if isinstance(meta, Mapping) and "shape" in meta:
    return tuple(int(s) for s in meta["shape"])
  return tuple(placement.open_tensorstore(resolved, step_dir, _where(resolved, name)).shape)


def _inline_reader(arr: np.ndarray) -> placement.SliceReader:
  return lambda index: arr[index]


def _t5x_target(state: Any, msgpack_path: str) -> Mapping:
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
  """The parameters of the T5X msgpack checkpoint in ``step_dir``, placed in their shards."""
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
          functools.partial(placement.tensorstore_reader, resolved, step_dir,
                            _where(resolved, name)))
    else:
      arr = np.asarray(leaf)
      sources[name] = placement.ArraySource(arr.shape, functools.partial(_inline_reader, arr))
  check_shapes({n: s.shape for n, s in sources.items()}, config, step_dir)
  return placement.place_arrays(sources, param_dtype, partitioner,
                                placement.in_flight_for(step_dir))
