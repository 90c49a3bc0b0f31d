"""The one place where checkpoint arrays become (sharded) device arrays.

A loader gives each array's name, shape and a reader of rectangular slices
(``ArraySource``); ``place_arrays`` builds each ``jax.Array`` in its
``param_sharding`` and ``stored_dtype``, reading only what this host's devices hold,
every TensorStore chunk once (``chunk_blocks``). Local orbax checkpoints are
restored by orbax into the same shardings (``restore_orbax``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import math
import threading
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from specdec_jax import storage
from specdec_jax.checkpoints.common import CheckpointError, flatten, root_cause, unflatten
from specdec_jax.models.t5 import stored_dtype
from specdec_jax.partitioning import Partitioner

# A device's slice of a global array, as make_array_from_callback passes it.
Index = tuple[slice, ...]
# Reads one slice (in the source's own dtype) given an index into the array.
SliceReader = Callable[[Index], np.ndarray]
# A rectangular region: (start, stop) per dimension.
Box = tuple[tuple[int, int], ...]

# Arrays placed at once from an object store (``place_arrays``' in_flight).
IN_FLIGHT = 8
# A chunked array is read in blocks of whole chunks of about this many bytes
# (T5X's largest chunk), one block at a time per array.
BLOCK_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class ChunkedReader:
  """A stored array read in whole chunks of shape ``chunks`` (a grid from 0)."""

  read: SliceReader
  chunks: tuple[int, ...]
  dtype: np.dtype


def open_tensorstore(spec: Any, directory: str, name: str, context: Any = None,
                     future: Any = None) -> Any:
  """Open a checkpoint's TensorStore array (or wait for ``future``); errors name the array."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  try:
    if future is None:
      future = ts.open(spec, open=True, read=True, context=context or storage.context())
    return future.result(timeout=storage.TIMEOUT_S)
  except Exception as e:  # tensorstore raises ValueError and friends
    raise CheckpointError(f"{directory}: cannot open the array {name}: {root_cause(e)}") from e


def tensorstore_reader(spec: Any, directory: str, name: str, context: Any = None) -> ChunkedReader:
  """A ``ChunkedReader`` of the array; a missing or corrupt chunk is a CheckpointError."""
  store = open_tensorstore(spec, directory, name, context)

  def read(index: Index) -> np.ndarray:
    try:
      return store[index].read().result()
    except Exception as e:  # a missing or corrupt chunk
      raise CheckpointError(f"{directory}: corrupt or unreadable checkpoint data for {name}: "
                            f"{root_cause(e)}") from e
  chunks = tuple(int(c or 0) for c in store.chunk_layout.read_chunk.shape)
  return ChunkedReader(read, chunks, np.dtype(store.dtype.numpy_dtype))


@dataclasses.dataclass(frozen=True)
class ArraySource:
  """A stored array: its shape, and ``open()`` (called just before it is placed)."""

  shape: tuple[int, ...]
  open: Callable[[], Union[SliceReader, ChunkedReader]]


@dataclasses.dataclass
class ReadStats:
  """Bytes of the distinct device slices read while ``count_reads`` was active."""

  bytes_by_array: dict[str, int] = dataclasses.field(default_factory=dict)
  reads: int = 0

  @property
  def total_bytes(self) -> int:
    return sum(self.bytes_by_array.values())


_active_stats: list[ReadStats] = []
_stats_lock = threading.Lock()


@contextlib.contextmanager
def count_reads() -> Iterator[ReadStats]:
  """Count the bytes of every distinct device slice read in the block (orbax's not)."""
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


def in_flight_for(path: str) -> int:
  """Arrays placed at once: ``IN_FLIGHT`` from ``gs://``, 1 from local files."""
  return IN_FLIGHT if storage.is_gcs(path) else 1


def target_sharding(name: str, shape: tuple[int, ...],
                    partitioner: Optional[Partitioner]) -> jax.sharding.Sharding:
  if partitioner is None:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return partitioner.param_sharding(name, shape)


def index_box(index: Index, shape: Sequence[int]) -> Box:
  box = []
  for s, n in zip(index, shape):
    start, stop, step = s.indices(n)
    if step != 1:
      raise ValueError(f"strided index {index} into shape {tuple(shape)}")
    box.append((start, stop))
  return tuple(box)


def _cells(start: int, stop: int, chunk: int) -> list[tuple[int, int]]:
  """[start, stop) cut at the multiples of ``chunk``."""
  cuts = range((start // chunk + 1) * chunk, stop, chunk)
  edges = [start, *cuts, stop]
  return [(a, b) for a, b in zip(edges, edges[1:]) if a < b]


def chunk_blocks(box: Box, chunks: Sequence[int], itemsize: int,
                 block_bytes: int = BLOCK_BYTES) -> list[Box]:
  """Boxes of whole chunks tiling ``box`` (each chunk in one), of at most ``block_bytes``
  or one chunk, grouped along the last dimensions first (chunk size 0: whole dimension)."""
  chunks = [c if c > 0 else max(hi, 1) for c, (lo, hi) in zip(chunks, box)]
  cells = [_cells(lo, hi, c) for (lo, hi), c in zip(box, chunks)]
  budget = max(1, block_bytes // max(1, itemsize))
  size = math.prod(min(c, hi - lo) for c, (lo, hi) in zip(chunks, box))  # one chunk, clipped
  group = [1] * len(box)
  for i in reversed(range(len(box))):
    group[i] = max(1, min(len(cells[i]), budget // max(1, size)))
    size *= group[i]
  spans = [[(dim[j][0], dim[min(j + g, len(dim)) - 1][1]) for j in range(0, len(dim), g)]
           for dim, g in zip(cells, group)]
  return [tuple(b) for b in itertools.product(*spans)]


def _overlap(a: Box, b: Box) -> Optional[Box]:
  out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
  return out if all(lo < hi for lo, hi in out) else None


def _index(box: Box) -> Index:
  return tuple(slice(lo, hi) for lo, hi in box)


def _within(inner: Box, outer: Box) -> Index:
  return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(inner, outer))


def _assemble(name: str, boxes: Sequence[Box], reader: ChunkedReader,
              dtype: np.dtype) -> dict[Box, np.ndarray]:
  """The slices ``boxes`` of a chunked array, every chunk they need read once."""
  out = {b: np.empty([hi - lo for lo, hi in b], dtype) for b in boxes}
  if not boxes:
    return out
  cover = tuple((min(d[0] for d in dims), max(d[1] for d in dims)) for dims in zip(*boxes))
  for block in chunk_blocks(cover, reader.chunks, reader.dtype.itemsize):
    parts = [(b, o) for b in boxes if (o := _overlap(b, block)) is not None]
    if not parts:
      continue  # chunks no local device holds (a host's devices are not contiguous)
    data = reader.read(_index(block))
    for b, o in parts:
      out[b][_within(o, b)] = data[_within(o, block)]  # casts to dtype
    del data
  for b in boxes:
    _record(name, math.prod(hi - lo for lo, hi in b) * reader.dtype.itemsize)
  return out


def place_array(name: str, shape: tuple[int, ...], read_slice: Union[SliceReader, ChunkedReader],
                dtype: np.dtype, sharding: jax.sharding.Sharding) -> jax.Array:
  """One array on its devices; devices holding the same slice share one read."""
  shape = tuple(shape)
  if isinstance(read_slice, ChunkedReader):
    local = {index_box(i, shape) for i in sharding.addressable_devices_indices_map(shape).values()}
    slices = _assemble(name, sorted(local), read_slice, dtype)
    out = jax.make_array_from_callback(shape, sharding,
                                       lambda index: slices[index_box(index, shape)], dtype=dtype)
    out.block_until_ready()  # frees the host slices once on the devices
    return out

  memo: dict[Box, np.ndarray] = {}

  def callback(index: Index) -> np.ndarray:
    key = index_box(index, shape)
    if key not in memo:
      raw = read_slice(index)
      _record(name, int(raw.nbytes))
      # Cast on the host: the slice is already there, and a bfloat16 copy is
      # half the bytes to transfer. C order: transposed HF slices are not.
      memo[key] = np.ascontiguousarray(raw, dtype=dtype)
    return memo[key]

  out = jax.make_array_from_callback(shape, sharding, callback, dtype=dtype)
  out.block_until_ready()  # frees the host slices before the next array is read
  return out


def place_arrays(sources: Mapping[str, ArraySource], param_dtype: Any,
                 partitioner: Optional[Partitioner], in_flight: int = 1) -> dict:
  """Every array of ``sources`` placed, ``in_flight`` at a time -> the nested T5X tree."""
  if in_flight < 1:
    raise ValueError(f"in_flight must be at least 1, got {in_flight}")
  # All shardings first: a dimension the mesh does not divide fails before any read.
  shardings = {n: target_sharding(n, s.shape, partitioner) for n, s in sources.items()}

  def place(name: str) -> jax.Array:
    src = sources[name]
    dtype = np.dtype(stored_dtype(name, param_dtype))
    return place_array(name, src.shape, src.open(), dtype, shardings[name])

  names = sorted(sources)
  if in_flight == 1:
    return unflatten({name: place(name) for name in names})
  pool = concurrent.futures.ThreadPoolExecutor(in_flight, thread_name_prefix="place_array")
  try:
    futures = {name: pool.submit(place, name) for name in names}
    return unflatten({name: futures[name].result() for name in names})
  finally:
    pool.shutdown(wait=True, cancel_futures=True)


def restore_orbax(directory: str, meta_tree: Mapping, subtree: tuple[str, ...],
                  param_dtype: Any, partitioner: Optional[Partitioner]) -> dict:
  """``tree[subtree...]`` of a local orbax checkpoint, restored as ``place_arrays`` would."""
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
