"""Orbax PyTree checkpoints (ours, T5X's orbax layout) read from ``gs://`` with
TensorStore alone (orbax's own ``gs://`` path needs TensorFlow or gcsfs): its
``_METADATA`` and one zarr array per leaf, placed as ``ChunkedReader``s."""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
from typing import Any, Mapping, Optional

import numpy as np

from specdec_jax import storage
from specdec_jax.checkpoints import placement
from specdec_jax.checkpoints.common import ORBAX_METADATA, CheckpointError, flatten, unflatten
from specdec_jax.partitioning import Partitioner

METADATA_FILE = ORBAX_METADATA
# Bytes of OCDBT b-tree nodes and manifests kept for one load: every array's
# open walks the same nodes, which would otherwise be fetched once per array.
OCDBT_CACHE_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True)
class StoredArray:
  """One leaf of an orbax checkpoint, opened in ``context`` (one per ``metadata_tree``)."""

  shape: tuple[int, ...]
  dtype: np.dtype
  spec: dict
  context: Any = dataclasses.field(default=None, compare=False, repr=False)


def _load_context() -> Any:
  """A child of ``storage.context()`` with a cache for OCDBT's nodes, for one load."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  spec = {"cache_pool#ocdbt": {"total_bytes_limit": OCDBT_CACHE_BYTES}}
  return ts.Context(ts.Context.Spec(spec), storage.context())


def _keys(entry_key: str, entry: Mapping) -> tuple[str, ...]:
  meta = entry.get("key_metadata")
  if isinstance(meta, list) and all(isinstance(m, Mapping) and "key" in m for m in meta):
    return tuple(str(m["key"]) for m in meta)
  parsed = ast.literal_eval(entry_key)  # "('decoder', 'layers_0', ...)"
  return tuple(str(k) for k in (parsed if isinstance(parsed, tuple) else (parsed,)))


def _array_spec(directory: str, name: str, meta: Mapping) -> dict:
  driver = "zarr3" if meta.get("use_zarr3") else "zarr"
  base = storage.kvstore_spec(directory)
  if meta.get("use_ocdbt", True):
    base["path"] = base["path"].rstrip("/") + "/"
    return {"driver": driver, "path": name,
            "kvstore": {"driver": "ocdbt", "base": base, "cache_pool": "cache_pool#ocdbt"}}
  base["path"] = storage.join(base["path"], name) if base["path"] else name
  return {"driver": driver, "kvstore": base}


def metadata_tree(directory: str) -> dict:
  """The checkpoint's tree with a ``StoredArray`` per array leaf (other leaves dropped)."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  meta_path = storage.join(directory, METADATA_FILE)
  if not storage.is_file(meta_path):
    raise CheckpointError(f"{directory}: not a readable orbax checkpoint (no {METADATA_FILE}; "
                          "checkpoints written by orbax before it recorded one must be read "
                          "from a local copy)")
  try:
    meta = json.loads(storage.read_bytes(meta_path))
    entries = meta["tree_metadata"]
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"{meta_path}: not an orbax tree metadata file: {e}") from e
  names = {}
  for entry_key, entry in entries.items():
    value = entry.get("value_metadata", {}) if isinstance(entry, Mapping) else {}
    if value.get("value_type") not in ("jax.Array", "np.ndarray") or value.get("skip_deserialize"):
      continue
    names["/".join(_keys(entry_key, entry))] = _array_spec(
        directory, ".".join(_keys(entry_key, entry)), meta)
  context = _load_context()
  futures = {n: ts.open(spec, open=True, read=True, context=context) for n, spec in names.items()}
  leaves = {}
  for name, future in futures.items():
    store = placement.open_tensorstore(names[name], directory, name, future=future)
    leaves[name] = StoredArray(tuple(int(d) for d in store.shape),
                               np.dtype(store.dtype.numpy_dtype), names[name], context)
  if not leaves:
    raise CheckpointError(f"{directory}: the orbax checkpoint holds no arrays")
  return unflatten(leaves)


def restore(directory: str, meta_tree: Mapping, subtree: tuple[str, ...], param_dtype: Any,
            partitioner: Optional[Partitioner]) -> dict:
  """``meta_tree[subtree...]`` placed by ``placement.place_arrays``."""
  sub: Any = meta_tree
  for key in subtree:
    sub = sub[key]
  sources = {name: placement.ArraySource(leaf.shape, functools.partial(
                 placement.tensorstore_reader, leaf.spec, directory, name, leaf.context))
             for name, leaf in flatten(sub).items()}
  return placement.place_arrays(sources, param_dtype, partitioner,
                                placement.in_flight_for(directory))
