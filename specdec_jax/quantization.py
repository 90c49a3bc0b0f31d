"""Weight-only int8/int4 quantization of the draft, one float32 scale per output
channel. Exact for any M_q (§2.3): only α and c change. Every ``Dense`` kernel
becomes a ``qwix.QArray``, run by ``models.t5.RowPaddedDense``; embeddings,
norms and position tables keep their dtype."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

try:  # the 'quant' extra: pip install -e ".[quant]"
  import qwix
except ImportError:  # the package works without it; quantizing asks for it
  qwix = None

QUANTIZATIONS = ("int8", "int4")
SCALE_DTYPE = jnp.float32
# Where a quantized export records its scheme (next to its config.json).
RECORD_FILE = "quantization.json"
SCHEME = "weight-only, Dense kernels, symmetric absmax per output channel (qwix)"


def check(value: Optional[str], setting: str = "draft_quantization") -> None:
  """None or one of ``QUANTIZATIONS`` (qwix installed); else a ValueError."""
  if value is None:
    return
  if value not in QUANTIZATIONS:
    raise ValueError(f"{setting} must be None or one of {QUANTIZATIONS}, got {value!r}")
  if qwix is None:
    raise ValueError(f"{setting}={value!r} needs the qwix library: "
                     "pip install -e \".[quant]\"")


def qtype(mode: str) -> jnp.dtype:
  """The integer dtype of ``mode`` ('int8' -> int8, 'int4' -> int4)."""
  if mode not in QUANTIZATIONS:
    raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")
  return jnp.dtype(jnp.int8 if mode == "int8" else jnp.int4)


def bits(dtype: Any) -> int:
  """Bits per element of ``dtype`` (int4: 4; packed two per byte on TPUs)."""
  dtype = jnp.dtype(dtype)
  return jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else 8 * dtype.itemsize


def array_bytes(shape: Sequence[int], dtype: Any) -> int:
  """Bytes of an array of ``shape`` at ``dtype``, sub-byte dtypes packed."""
  return math.ceil(math.prod(shape) * bits(dtype) / 8)


def quantized(name: str) -> bool:
  """Whether T5X parameter ``name`` is quantized (the ``Dense`` kernels)."""
  return name.endswith("/kernel")


def is_qarray(x: Any) -> bool:
  """Whether ``x`` is a quantized kernel (a ``qwix.QArray``)."""
  return qwix is not None and isinstance(x, qwix.QArray)


def quantize_kernel(kernel: jax.Array, mode: str) -> qwix.QArray:
  """[in, out] -> QArray: qvalue at ``qtype(mode)``, scale [1, out] float32 (absmax)."""
  return qwix.quantize(jnp.asarray(kernel, jnp.float32), qtype(mode), channelwise_axes=(1,),
                       scale_dtype=SCALE_DTYPE)


def _name(path: tuple) -> str:
  return "/".join(str(getattr(k, "key", k)) for k in path)


def quantize_params(params: Any, mode: str) -> Any:
  """Every ``quantized`` kernel a ``QArray``, jitted (keeps the leaves' layout)."""
  check(mode)

  def one(path, x):
    return quantize_kernel(x, mode) if quantized(_name(path)) else x
  return jax.jit(lambda p: jax.tree_util.tree_map_with_path(one, p))(params)


def dequantize(x: Any, dtype: Any = jnp.float32) -> jax.Array:
  """A QArray's float values at ``dtype`` (an array is only cast)."""
  return (qwix.dequantize(x) if is_qarray(x) else jnp.asarray(x)).astype(dtype)


def take_columns(kernel: Any, ids: jax.Array) -> jax.Array:
  """Columns ``ids`` of a [d, V] kernel as float32 [d, ...], dequantizing only those."""
  if not is_qarray(kernel):
    return jnp.take(kernel, ids, axis=1)
  part = qwix.QArray(jnp.take(kernel.qvalue, ids, axis=1), jnp.take(kernel.scale, ids, axis=1),
                     qtype=kernel.qtype)
  return dequantize(part)


def dot(x: jax.Array, kernel: qwix.QArray, dtype: Any, precision: Any = None) -> jax.Array:
  """x [..., in] @ a quantized kernel [in, out] at the activation ``dtype``."""
  x = x.astype(dtype)
  return qwix.dot_general(x, kernel.astype(dtype), (((x.ndim - 1,), (0,)), ((), ())),
                          precision=precision)


def scale_axes(axes: Sequence[Optional[str]]) -> tuple:
  """The logical axes of a kernel's [1, out] scale: its output axis only."""
  return (None,) + tuple(axes[1:])


def abstract_kernel(shape: Sequence[int], mode: str,
                    sharding: Callable[[Sequence[Optional[int]], tuple], Any]) -> qwix.QArray:
  """A kernel's QArray as ShapeDtypeStructs, ``sharding(shape, 'qvalue'|'scale')``."""
  shape = tuple(shape)
  scale = (1,) + shape[1:]
  return qwix.QArray(jax.ShapeDtypeStruct(shape, qtype(mode), sharding=sharding(shape, "qvalue")),
                     jax.ShapeDtypeStruct(scale, SCALE_DTYPE, sharding=sharding(scale, "scale")),
                     qtype=qtype(mode))


def stored_bytes(name: str, shard: Sequence[int], mode: Optional[str], dtype: Any) -> int:
  """Bytes one device holds of ``name``'s ``shard`` (quantized: ints + scales)."""
  if mode is None or not quantized(name):
    return array_bytes(shard, dtype)
  return array_bytes(shard, qtype(mode)) + array_bytes((1,) + tuple(shard[1:]), SCALE_DTYPE)
