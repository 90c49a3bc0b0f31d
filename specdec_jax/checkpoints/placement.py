"""The one place where checkpoint arrays become (sharded) device arrays.

A loader describes each stored array by its '/'-joined T5X name, its shape and
how to read any rectangular slice of it (``ArraySource``); ``place_arrays``
then creates every ``jax.Array`` with ``jax.make_array_from_callback`` in the
sharding ``Partitioner.param_sharding(name, shape)`` (one local device without
a partitioner) and the dtype ``stored_dtype(name, param_dtype)``. The callback
asks the source for exactly the slice one device holds, so no loader ever
materialises a whole sharded array on the host.

Host memory. Arrays are placed one at a time. Devices that hold the same slice
(dimensions replicated over a mesh axis) share one read: slices are memoized
per array by index and the memo is dropped once the array is on its devices.
The distinct slices of an array add up to the array itself, so the host holds
at most one array (in its stored dtype) plus the raw slice being read and
cast. Each array is waited on before the next is read, because an in-flight
host-to-device copy keeps its host buffer alive.

Multi-host. ``make_array_from_callback`` calls back only for this process's
addressable devices, so in a multi-host job each host reads just the slices
its own devices hold (and all of an array that is replicated).

Orbax checkpoints (ours and T5X's) are restored by orbax itself, given the
same shardings and dtypes as ``jax.ShapeDtypeStruct`` targets
(``restore_orbax``); orbax/TensorStore then read each device's shard.

``count_reads`` is a test hook: it sums the bytes of every slice the readers
return while it is active, and changes nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator, Mapping, Optional

import jax
import numpy as np

from specdec_jax.checkpoints.common import CheckpointError, flatten, root_cause, unflatten
from specdec_jax.models.t5 import stored_dtype
from specdec_jax.partitioning import Partitioner

# A device's slice of a global array, as make_array_from_callback passes it.
Index = tuple[slice, ...]
# Reads one slice (in the source's own dtype) given an index into the array.
SliceReader = Callable[[Index], np.ndarray]


@dataclasses.dataclass(frozen=True)
class ArraySource:
  """A stored array: its shape, and ``open()`` giving a ``SliceReader``.

  ``open`` is called once per array, just before its slices are read, so a
  handle (a TensorStore array, a memmap) lives only while that array is placed.
  """

  shape: tuple[int, ...]
  open: Callable[[], SliceReader]


# ------------------------------------------------------------ read accounting


@dataclasses.dataclass
class ReadStats:
  """Bytes returned by slice readers while ``count_reads`` was active."""

  bytes_by_array: dict[str, int] = dataclasses.field(default_factory=dict)
  reads: int = 0

  @property
  def total_bytes(self) -> int:
    return sum(self.bytes_by_array.values())


_active_stats: list[ReadStats] = []
_stats_lock = threading.Lock()


@contextlib.contextmanager
def count_reads() -> Iterator[ReadStats]:
  """Counts the bytes every slice reader returns inside the ``with`` block.

  Observation only (for tests and diagnostics): loading behaves the same with
  or without it. Orbax restores are not counted (orbax reads internally).
  """
  stats = ReadStats()
  with _stats_lock:
    _active_stats.append(stats)
  try:
    yield stats
  finally:
    with _stats_lock:
      _active_stats.remove(stats)


def _record(name: str, nbytes: int) -> None:
  with _stats_lock:
    for stats in _active_stats:
      stats.bytes_by_array[name] = stats.bytes_by_array.get(name, 0) + nbytes
      stats.reads += 1


# ------------------------------------------------------------ placement


def target_sharding(name: str, shape: tuple[int, ...],
                    partitioner: Optional[Partitioner]) -> jax.sharding.Sharding:
  """Where parameter ``name`` goes: its partitioner sharding, else one local device."""
  if partitioner is None:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return partitioner.param_sharding(name, shape)


def place_array(name: str, shape: tuple[int, ...], read_slice: SliceReader,
                dtype: np.dtype, sharding: jax.sharding.Sharding) -> jax.Array:
  """One array on its devices, each reading only its own slice (once per index)."""
  memo: dict[tuple, np.ndarray] = {}

  def callback(index: Index) -> np.ndarray:
    key = tuple((s.start, s.stop, s.step) for s in index)  # slices are unhashable
    if key not in memo:
      raw = read_slice(index)
      _record(name, int(raw.nbytes))
      # Cast on the host: the slice is already there, and a bfloat16 copy is
      # half the bytes to transfer. C order: transposed HF slices are not.
      memo[key] = np.ascontiguousarray(raw, dtype=dtype)
    return memo[key]

  out = jax.make_array_from_callback(tuple(shape), sharding, callback, dtype=dtype)
  out.block_until_ready()  # frees the host slices before the next array is read
  return out


def place_arrays(sources: Mapping[str, ArraySource], param_dtype: Any,
                 partitioner: Optional[Partitioner]) -> dict:
  """Every array of ``sources`` placed in turn; returns the nested T5X tree."""
  # All shardings first: a dimension the mesh does not divide fails before any read.
  shardings = {n: target_sharding(n, s.shape, partitioner) for n, s in sources.items()}
  out = {}
  for name in sorted(sources):
    src = sources[name]
    dtype = np.dtype(stored_dtype(name, param_dtype))
    out[name] = place_array(name, src.shape, src.open(), dtype, shardings[name])
  return unflatten(out)


def restore_orbax(directory: str, meta_tree: Mapping, subtree: tuple[str, ...],
                  param_dtype: Any, partitioner: Optional[Partitioner]) -> dict:
  """Restores ``tree[subtree...]`` of an orbax PyTree checkpoint into its shards.

  ``meta_tree`` is the checkpoint's metadata tree (``orbax_metadata_tree``).
  Every leaf's target is a ``jax.ShapeDtypeStruct`` with the same sharding and
  dtype ``place_arrays`` would give it, so orbax reads only each device's
  shard and casts on read. Other subtrees (optimizer state) are not read
  (``partial_restore``).
  """
  import orbax.checkpoint as ocp
  sub = meta_tree
  for key in subtree:
    sub = sub[key]
  items, args = {}, {}
  for name, meta in flatten(sub).items():
    shape = tuple(meta.shape)
    dtype = stored_dtype(name, param_dtype)
    sharding = target_sharding(name, shape, partitioner)
    items[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    args[name] = ocp.ArrayRestoreArgs(dtype=dtype, sharding=sharding)
  item, restore_args = unflatten(items), unflatten(args)
  for key in reversed(subtree):
    item, restore_args = {key: item}, {key: restore_args}
  try:
    restored = ocp.PyTreeCheckpointer().restore(
        directory, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                               partial_restore=bool(subtree)))
  except Exception as e:  # orbax/TensorStore wrap the cause in several layers
    raise CheckpointError(f"{directory}: corrupt or unreadable checkpoint data: "
                          f"{root_cause(e)}") from e
  for key in subtree:
    restored = restored[key]
  return restored
