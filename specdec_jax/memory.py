"""Per-device memory of a target/draft pair on a planned ('data', 'model') mesh: both
models' weights (at ``stored_dtype`` or quantized) and decoder caches, from
``jax.eval_shape`` and the real ``Partitioner`` over an abstract mesh (nothing is
allocated). XLA temporaries are not counted: leave headroom (``fits``)."""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from specdec_jax.decoding import cache_length
from specdec_jax.models.t5 import (DecoderCache, T5Config, T5Model, get_config,
                                   param_shapes, stored_dtype)
from specdec_jax import partitioning, quantization
from specdec_jax.partitioning import (CACHE_AXES, DATA_PARALLEL_RULES, STANDARD_RULES, Partitioner,
                                      flatten_names, param_logical_axes, validate_rules)

GiB = 2 ** 30
ConfigLike = Union[T5Config, str]
PLAN_KEYS = ("target_params", "draft_params", "target_caches", "draft_caches", "total")


def planning_partitioner(mesh_shape: Optional[Sequence[int]], rules: Optional[Sequence] = None,
                         fallback: str = "error") -> Partitioner:
  """The Partitioner the runner would build, over an abstract mesh (rules None: standard)."""
  return Partitioner(partitioning.abstract_mesh((1, 1) if mesh_shape is None else mesh_shape),
                     validate_rules(STANDARD_RULES if rules is None else rules), fallback)


def _shard_bytes(part: Partitioner, axes: Sequence[Optional[str]], shape: Sequence[int],
                 dtype: Any, what: str) -> int:
  """Bytes one device holds of an array (shards are equal)."""
  shard = part.sharding(axes, shape, what).shard_shape(tuple(shape))
  return math.prod(shard) * jnp.dtype(dtype).itemsize


def _config(cfg: ConfigLike, dtype: Optional[str] = None) -> T5Config:
  cfg = get_config(cfg) if isinstance(cfg, str) else cfg
  return cfg if dtype is None else cfg.replace(dtype=dtype)


@functools.lru_cache(maxsize=None)
def _param_shapes(cfg: T5Config) -> dict:
  # Callers pass dtype='float32' (shapes do not depend on it): one traced entry.
  return param_shapes(cfg)


def param_bytes(cfg: ConfigLike, part: Partitioner, param_dtype: Any = "float32",
                quant: Optional[str] = None) -> int:
  """Per-device bytes of a model's weights under ``part`` (``quant``: 'int8' / 'int4')."""
  return _weight_bytes(_config(cfg, "float32"), part, jnp.dtype(param_dtype).name, quant, False)


# Cached: a table of plans asks for the same (model, layout) many times.
@functools.lru_cache(maxsize=None)
def _weight_bytes(cfg: T5Config, part: Partitioner, param_dtype: str, quant: Optional[str],
                  per_step: bool) -> int:
  """Per-device bytes of the weights (``per_step``: of those ``reads_per_step`` names)."""
  total = 0
  for name, x in flatten_names(_param_shapes(cfg)).items():
    if not per_step or reads_per_step(name, cfg):
      shard = part.sharding(param_logical_axes(name), x.shape,
                            f"parameter {name}").shard_shape(tuple(x.shape))
      total += quantization.stored_bytes(name, shard, quant, stored_dtype(name, param_dtype))
  return total


@functools.lru_cache(maxsize=None)
def cache_shapes(cfg: T5Config, batch: int, max_input_len: int, cache_len: int) -> DecoderCache:
  model = T5Model(cfg)
  inputs = jax.ShapeDtypeStruct((batch, max_input_len), jnp.int32)
  # init_cache only projects the encoder's output: no need to trace the encoder.
  encoded = jax.ShapeDtypeStruct((batch, max_input_len, cfg.d_model), cfg.jnp_dtype)
  return jax.eval_shape(lambda p, e, x: model.init_cache(p, e, x, cache_len),
                        _param_shapes(cfg.replace(dtype="float32")), encoded, inputs)


def cache_bytes(cfg: ConfigLike, part: Partitioner, batch: int, max_input_len: int,
                cache_len: int, dtype: Optional[str] = None, what: str = "cache") -> int:
  """Per-device bytes of one model's decoder cache in the layout ``constrain_cache`` pins."""
  return _cache_bytes(_config(cfg, dtype), part, int(batch), int(max_input_len),
                      int(cache_len), what)


@functools.lru_cache(maxsize=None)
def _cache_bytes(cfg: T5Config, part: Partitioner, batch: int, max_input_len: int,
                 cache_len: int, what: str) -> int:
  cache = cache_shapes(cfg, batch, max_input_len, cache_len)
  total = 0
  for field in ("self_k", "self_v", "cross_k", "cross_v"):
    for i, x in enumerate(getattr(cache, field)):
      total += _shard_bytes(part, CACHE_AXES, x.shape, x.dtype, f"{what} {field}[{i}]")
  m = cache.encoder_mask
  return total + _shard_bytes(part, ("batch", "length"), m.shape, m.dtype, f"{what} encoder_mask")


def reads_per_step(name: str, cfg: T5Config) -> bool:
  """Whether a decoding step reads parameter ``name`` (the decoder's weights, but the cross
  K/V kernels only in ``init_cache``; T5 1.0's tied embedding as the output layer)."""
  cross_kv = "encoder_decoder_attention/key/" in name or \
      "encoder_decoder_attention/value/" in name
  return (name.startswith("decoder/") and not cross_kv) or (
      name == "token_embedder/embedding" and cfg.logits_via_embedding)


def step_weight_bytes(cfg: ConfigLike, part: Optional[Partitioner] = None,
                      param_dtype: Any = "float32", quant: Optional[str] = None) -> int:
  """Bytes of weights each device reads per decoding step at batch 1."""
  part = planning_partitioner(None) if part is None else part
  return _weight_bytes(_config(cfg, "float32"), part, jnp.dtype(param_dtype).name, quant, True)


def plan(target_cfg: ConfigLike, draft_cfg: Optional[ConfigLike],
         mesh_shape: Optional[Sequence[int]], param_dtype: str = "float32", dtype: str = "float32",
         batch: int = 1, max_input_len: int = 512, max_decode_len: int = 128, gamma: int = 5,
         rules: Optional[Sequence] = None, draft_rules: Optional[Sequence] = None,
         fallback: str = "error", draft_quantization: Optional[str] = None) -> dict[str, int]:
  """Per-device bytes {'target_params', 'draft_params', 'target_caches', 'draft_caches',
  'total'}; arguments mirror ``Experiment``'s fields, ``draft_cfg`` None: no weights."""
  if gamma < 1 or max_decode_len < 1 or batch < 1 or max_input_len < 1:
    raise ValueError(f"gamma, max_decode_len, batch and max_input_len must be >= 1, got "
                     f"{gamma}, {max_decode_len}, {batch}, {max_input_len}")
  cache_len = cache_length(max_decode_len, gamma)
  target_part = planning_partitioner(mesh_shape, rules, fallback)
  out = dict(target_params=param_bytes(target_cfg, target_part, param_dtype),
             target_caches=cache_bytes(target_cfg, target_part, batch, max_input_len,
                                       cache_len, dtype, "target cache"),
             draft_params=0, draft_caches=0)
  if draft_cfg is not None:
    draft_part = planning_partitioner(
        mesh_shape, DATA_PARALLEL_RULES if draft_rules is None else draft_rules, fallback)
    out["draft_params"] = param_bytes(draft_cfg, draft_part, param_dtype, draft_quantization)
    out["draft_caches"] = cache_bytes(draft_cfg, draft_part, batch, max_input_len, cache_len,
                                      dtype, "draft cache")
  out["total"] = sum(out.values())
  return {k: int(out[k]) for k in PLAN_KEYS}


def fits(total_bytes: int, device_bytes: int, headroom: float = 0.9) -> bool:
  """Whether a plan's total leaves ``1 - headroom`` of a device for XLA temporaries."""
  return total_bytes <= headroom * device_bytes
