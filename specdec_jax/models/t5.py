"""T5 1.0 / 1.1 encoder-decoder in Flax linen, shaped for speculative decoding.

T5X parameter names (docs/sharding.md). ``decode`` writes k >= 1 tokens per row
at positions [B, k] into a fixed [B, cache_len, H, dh] cache; a query at t reads
slots 0..t, so rollback is moving the row's index; negative positions are not
written. Token trees (SpecInfer, Miao et al. 2023): node j of a row at length n
sits at slot n + j, position n + depth(j), seeing the prefix and its ancestors;
``commit_path`` moves the accepted nodes to slots n + d."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from typing import Any, NamedTuple, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec_jax import quantization
from specdec_jax.models import base
from specdec_jax.partitioning import Partitioner, constrain_cache
from specdec_jax.tree import RoundTree, TreeShape

Array = jax.Array
# Large negative (not -inf) so that a fully-masked row gives a finite softmax.
_MASK_VALUE = -1e10
# T5Config.decode_kernel's values.
DECODE_KERNELS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Architecture of a T5 1.0 or 1.1 model (hashable, so usable as a jit static)."""

  vocab_size: int = 32128
  d_model: int = 512
  num_heads: int = 6
  head_dim: int = 64
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  d_ff: int = 1024
  # "1.1": gated-GELU MLP + untied logits_dense. "1.0": ReLU MLP + logits
  # through the shared embedding scaled by 1/sqrt(d_model).
  version: str = "1.1"
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6
  # Training only: applied when a 'dropout' rng is passed (T5Model.__call__).
  dropout_rate: float = 0.0
  dtype: str = "float32"  # activation dtype; params/norms/softmax/logits stay f32
  # Weight products run over at least this many rows (``RowPaddedDense``).
  min_rows: int = 1
  # 'xla' (the reference) or 'pallas': the chain decode's layers as fused
  # Pallas kernels (``specdec_jax.kernels``; uncovered calls stay on XLA).
  decode_kernel: str = "xla"
  # R > 0: every cached decode call scores exactly R positions (padding writes
  # nothing), one compiled shape, so the baseline's step and the speculative
  # pass agree bit for bit at any dtype; costs v(R) per call. 0: off.
  fixed_positions: int = 0
  # Self-attention's q/k/v as one 'qkv' product and wi_0/wi_1 as 'wi_fused',
  # fused in memory after loading (``fuse_projections``).
  fused_projections: bool = False
  pad_id: int = 0
  eos_id: int = 1
  decoder_start_id: int = 0

  def __post_init__(self):
    if self.version not in ("1.0", "1.1"):
      raise ValueError(f"T5Config.version must be '1.0' or '1.1', got {self.version!r}")
    if self.decode_kernel not in DECODE_KERNELS:
      raise ValueError(f"T5Config.decode_kernel must be one of {DECODE_KERNELS}, "
                       f"got {self.decode_kernel!r}")
    if (isinstance(self.fixed_positions, bool) or not isinstance(self.fixed_positions, int)
        or self.fixed_positions < 0):
      raise ValueError(f"T5Config.fixed_positions must be an int >= 0 (0: off), got "
                       f"{self.fixed_positions!r}")

  @property
  def gated(self) -> bool:
    return self.version == "1.1"

  @property
  def logits_via_embedding(self) -> bool:
    return self.version == "1.0"

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  def replace(self, **kw) -> "T5Config":
    return dataclasses.replace(self, **kw)


def _preset(version, d, h, l, ff, dh=64):
  return T5Config(d_model=d, num_heads=h, head_dim=dh, num_encoder_layers=l,
                  num_decoder_layers=l, d_ff=ff, version=version, vocab_size=32128)


_v11, _v10 = functools.partial(_preset, "1.1"), functools.partial(_preset, "1.0")


# Released sizes (T5 1.1 and T5 1.0).
PRESETS = {
    "t5_1_1_small": _v11(512, 6, 8, 1024),
    "t5_1_1_base": _v11(768, 12, 12, 2048),
    "t5_1_1_large": _v11(1024, 16, 24, 2816),
    "t5_1_1_xl": _v11(2048, 32, 24, 5120),
    "t5_1_1_xxl": _v11(4096, 64, 24, 10240),
    "t5_small": _v10(512, 8, 6, 2048),
    "t5_base": _v10(768, 12, 12, 3072),
    "t5_large": _v10(1024, 16, 24, 4096),
    "t5_3b": _v10(1024, 32, 24, 16384, dh=128),
    "t5_11b": _v10(1024, 128, 24, 65536, dh=128),
}


def get_config(name: str, **overrides: Any) -> T5Config:
  """A preset by name (see ``PRESETS``), with optional field overrides."""
  if name not in PRESETS:
    raise KeyError(f"unknown T5 preset {name!r}; known: {sorted(PRESETS)}")
  return PRESETS[name].replace(**overrides)


class RMSNorm(nn.Module):
  """T5 layer norm: no mean subtraction, no bias, computed in float32."""

  epsilon: float = 1e-6
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
    return (y * scale).astype(self.dtype)


def relative_position_bucket(relative_position: Array, bidirectional: bool,
                             num_buckets: int = 32, max_distance: int = 128) -> Array:
  """T5's bucketing of (key - query position): exact near, logarithmic up to
  ``max_distance``; half the buckets for later keys if bidirectional."""
  n = -relative_position
  ret = jnp.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    ret += (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  # Guard log(0): those entries take the is_small branch anyway.
  scaled = (jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact)
            / math.log(max_distance / max_exact) * (num_buckets - max_exact))
  large = jnp.minimum(max_exact + scaled.astype(jnp.int32), num_buckets - 1)
  return ret + jnp.where(is_small, n, large)


class RelativePositionBias(nn.Module):
  """One table per stack, shared by all its layers; self-attention only."""

  num_heads: int
  bidirectional: bool
  num_buckets: int = 32
  max_distance: int = 128

  @nn.compact
  def __call__(self, q_pos: Array, k_pos: Array) -> Array:
    """q_pos [B, Q], k_pos [B, K] -> bias [B, H, Q, K] (float32)."""
    table = self.param("rel_embedding", nn.initializers.normal(0.1),
                       (self.num_heads, self.num_buckets), jnp.float32)
    rel = k_pos[:, None, :] - q_pos[:, :, None]
    buckets = relative_position_bucket(rel, self.bidirectional, self.num_buckets, self.max_distance)
    # Gather via one-hot matmul-free indexing: table[:, buckets] -> [H, B, Q, K].
    return jnp.moveaxis(table[:, buckets], 0, 1)


class RowPaddedDense(nn.Dense):
  """``nn.Dense`` whose product runs over at least ``min_rows`` rows: XLA's GPU
  compiler turns a one-row product into a slow multiply-reduce; zero rows
  behind an optimization barrier keep it a GEMM, and are dropped. A quantized
  kernel (``qwix.QArray``, ``specdec_jax.quantization``) is dequantized inside
  the product at the activation dtype."""

  min_rows: int = 1

  def _product(self, x: Array) -> Array:
    if self.has_variable("params", "kernel"):
      kernel = self.get_variable("params", "kernel")
      if quantization.is_qarray(kernel):
        return quantization.dot(x, kernel, self.dtype or x.dtype, self.precision)
    return super().__call__(x)

  def __call__(self, x: Array) -> Array:
    rows = math.prod(x.shape[:-1])
    if rows >= self.min_rows:
      return self._product(x)
    flat = x.reshape(rows, x.shape[-1])
    pad = jnp.zeros((self.min_rows - rows, x.shape[-1]), x.dtype)
    y = self._product(jax.lax.optimization_barrier(jnp.concatenate([flat, pad])))
    return y[:rows].reshape(x.shape[:-1] + (self.features,))


def _dense(features: int, dtype, name: str, fan_in: int, min_rows: int = 1) -> nn.Dense:
  return RowPaddedDense(features, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                        kernel_init=nn.initializers.normal(fan_in ** -0.5), name=name,
                        min_rows=min_rows)


class Attention(nn.Module):
  """Multi-head attention with 2-D kernels and no 1/sqrt(head_dim) scaling."""

  num_heads: int
  head_dim: int
  d_model: int
  dtype: Any
  min_rows: int = 1  # T5Config.min_rows
  fused: bool = False  # self-attention with T5Config.fused_projections: one 'qkv' kernel

  def setup(self):
    inner, r = self.num_heads * self.head_dim, self.min_rows
    if self.fused:
      self.qkv = _dense(3 * inner, self.dtype, "qkv", self.d_model, r)
    else:
      self.query = _dense(inner, self.dtype, "query", self.d_model * self.head_dim, r)
      self.key = _dense(inner, self.dtype, "key", self.d_model, r)
      self.value = _dense(inner, self.dtype, "value", self.d_model, r)
    self.out = _dense(self.d_model, self.dtype, "out", inner, r)

  def _split(self, x: Array) -> Array:
    return x.reshape(x.shape[:-1] + (self.num_heads, self.head_dim))

  def project_q(self, x: Array) -> Array:
    return self._split(self.query(x))

  def project_kv(self, x: Array) -> tuple[Array, Array]:
    return self._split(self.key(x)), self._split(self.value(x))

  def project_qkv(self, x: Array) -> tuple[Array, Array, Array]:
    """Self-attention's (q, k, v) from one input: one product when fused."""
    if not self.fused:
      return (self.project_q(x),) + self.project_kv(x)
    return tuple(map(self._split, jnp.split(self.qkv(x), 3, axis=-1)))

  def attend(self, q: Array, k: Array, v: Array, mask: Array, bias: Optional[Array]) -> Array:
    """q [B,Q,H,dh], k/v [B,K,H,dh], mask [B,1|H,Q,K] bool, bias [B,H,Q,K]."""
    return self.attend_blocks(q, [(k, v, mask, bias)])

  def attend_blocks(self, q: Array, blocks: Sequence[tuple]) -> Array:
    """Attention over key blocks [(k, v, mask, bias), ...] with one softmax."""
    # Heads to the front ([B,H,*,dh]) so the dots are batched matmuls; left to
    # XLA it may transpose every K/V cache per layer and step.
    q = jnp.swapaxes(q, 1, 2)
    logits, values = [], []
    for k, v, mask, bias in blocks:
      l = jnp.einsum("bhqd,bhkd->bhqk", q, jnp.swapaxes(k, 1, 2),
                     preferred_element_type=jnp.float32)
      if bias is not None:
        l = l + bias
      logits.append(jnp.where(mask, l, _MASK_VALUE))
      values.append(jnp.swapaxes(v, 1, 2))
    # Only the small [B,H,Q,K] logits are concatenated, never the K/V blocks.
    weights = jax.nn.softmax(jnp.concatenate(logits, -1), axis=-1).astype(self.dtype)
    splits = list(itertools.accumulate(l.shape[-1] for l in logits))[:-1]
    # reduce without a start value: one block is exactly its einsum (no "+ 0").
    y = functools.reduce(operator.add, (jnp.einsum("bhqk,bhkd->bhqd", w, v) for w, v in
                                        zip(jnp.split(weights, splits, axis=-1), values)))
    y = jnp.swapaxes(y, 1, 2)
    return self.out(y.reshape(y.shape[:2] + (self.num_heads * self.head_dim,)))

  def __call__(self, x: Array, mask: Array, bias: Optional[Array]) -> Array:
    return self.attend(*self.project_qkv(x), mask, bias)


class MLP(nn.Module):
  d_model: int
  d_ff: int
  gated: bool
  dtype: Any
  min_rows: int = 1  # T5Config.min_rows
  fused: bool = False  # T5Config.fused_projections: wi_0 and wi_1 as one 'wi_fused' kernel

  @nn.compact
  def __call__(self, x: Array) -> Array:
    dense = functools.partial(_dense, dtype=self.dtype, min_rows=self.min_rows)
    if self.gated and self.fused:
      h0, h1 = jnp.split(dense(2 * self.d_ff, name="wi_fused", fan_in=self.d_model)(x), 2, -1)
      h = nn.gelu(h0, approximate=True) * h1
    elif self.gated:  # T5 1.1: gelu(x wi_0) * (x wi_1), tanh-approximated gelu
      h = (nn.gelu(dense(self.d_ff, name="wi_0", fan_in=self.d_model)(x), approximate=True)
           * dense(self.d_ff, name="wi_1", fan_in=self.d_model)(x))
    else:  # T5 1.0: relu(x wi)
      h = nn.relu(dense(self.d_ff, name="wi", fan_in=self.d_model)(x))
    return dense(self.d_model, name="wo", fan_in=self.d_ff)(h)


class Dropout(nn.Module):
  """Dropout active only when the caller passed a 'dropout' rng."""

  rate: float

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return nn.Dropout(self.rate)(x, deterministic=not self.has_rng("dropout"))


def _normed_attention(c: "T5Config", fused: bool = True) -> tuple[RMSNorm, Attention]:
  """A layer's pre-attention RMSNorm and its attention (created in a setup)."""
  return (RMSNorm(c.layer_norm_epsilon, c.jnp_dtype),
          Attention(c.num_heads, c.head_dim, c.d_model, c.jnp_dtype, c.min_rows,
                    c.fused_projections and fused))


def _normed_mlp(c: "T5Config") -> tuple[RMSNorm, MLP]:
  """A layer's pre-MLP RMSNorm and its MLP (created in a setup)."""
  return (RMSNorm(c.layer_norm_epsilon, c.jnp_dtype),
          MLP(c.d_model, c.d_ff, c.gated, c.jnp_dtype, c.min_rows, c.fused_projections))


def _stack(c: "T5Config", encoder: bool) -> tuple:
  """A stack's relative-position bias, ``layers_{i}`` and final RMSNorm."""
  layer, n = (EncoderLayer, c.num_encoder_layers) if encoder else (DecoderLayer,
                                                                    c.num_decoder_layers)
  return (RelativePositionBias(c.num_heads, encoder, c.relative_attention_num_buckets,
                               c.relative_attention_max_distance),
          [layer(c, name=f"layers_{i}") for i in range(n)],
          RMSNorm(c.layer_norm_epsilon, c.jnp_dtype if encoder else jnp.float32))


class EncoderLayer(nn.Module):
  config: T5Config

  def setup(self):
    c = self.config
    self.pre_attention_layer_norm, self.attention = _normed_attention(c)
    self.pre_mlp_layer_norm, self.mlp = _normed_mlp(c)
    self.dropout = Dropout(c.dropout_rate)

  def __call__(self, x: Array, mask: Array, bias: Array) -> Array:
    x = x + self.dropout(self.attention(self.pre_attention_layer_norm(x), mask, bias))
    return x + self.dropout(self.mlp(self.pre_mlp_layer_norm(x)))


class Encoder(nn.Module):
  config: T5Config

  def setup(self):
    self.relpos_bias, self.layers, self.encoder_norm = _stack(self.config, encoder=True)

  def __call__(self, x: Array, input_mask: Array) -> Array:
    b, s = input_mask.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    bias = self.relpos_bias(pos, pos)
    mask = (input_mask[:, None, None, :] & input_mask[:, None, :, None])
    for layer in self.layers:
      x = layer(x, mask, bias)
    return self.encoder_norm(x)


@struct.dataclass
class DecoderCache:
  """Fixed-shape decoding state for one model (a pytree).

  self_k, self_v:   per decoder layer, [B, cache_len, H, dh] (activation dtype).
  cross_k, cross_v: per decoder layer, [B, S, H, dh], computed once per example.
  encoder_mask:     [B, S] bool, True at real (non-pad) encoder positions."""

  self_k: tuple
  self_v: tuple
  cross_k: tuple
  cross_v: tuple
  encoder_mask: Array

  @property
  def cache_len(self) -> int:
    return self.self_k[0].shape[1]


class DecoderLayer(nn.Module):
  config: T5Config

  def setup(self):
    c = self.config
    self.pre_self_attention_layer_norm, self.self_attention = _normed_attention(c)
    # Cross-attention's keys/values come from the encoder once: never fused.
    self.pre_cross_attention_layer_norm, self.encoder_decoder_attention = _normed_attention(
        c, fused=False)
    self.pre_mlp_layer_norm, self.mlp = _normed_mlp(c)
    self.dropout = Dropout(c.dropout_rate)

  def cross_kv(self, encoded: Array) -> tuple[Array, Array]:
    return self.encoder_decoder_attention.project_kv(encoded)

  def __call__(self, x, positions, self_mask, bias, k_cache, v_cache, cross_k, cross_v,
               cross_mask, new_mask=None, new_bias=None, rows_only=False):
    """One decoder layer over k new tokens.

    k_cache None: teacher forcing. Otherwise the new keys/values are written at
    ``positions`` and the queries attend over the cache. With ``new_mask``
    ([B,1,k,k]) the cache is only read (a second key block) and the new rows
    [B,k,H,dh] are returned; ``rows_only`` returns them but attends as a write does,
    so a position reduces in the same order however it is scored."""
    h = self.pre_self_attention_layer_norm(x)
    q, k, v = self.self_attention.project_qkv(h)
    if new_mask is not None:
      attn = self.self_attention.attend_blocks(
          q, [(k_cache, v_cache, self_mask, bias), (k, v, new_mask, new_bias)])
      k_cache, v_cache = k, v
    else:
      rows = k, v
      if k_cache is not None:
        k_cache = _write(k_cache, k, positions)
        v_cache = _write(v_cache, v, positions)
        k, v = k_cache, v_cache
      attn = self.self_attention.attend(q, k, v, self_mask, bias)
      if rows_only:
        k_cache, v_cache = rows
    x = x + self.dropout(attn)
    h = self.pre_cross_attention_layer_norm(x)
    q = self.encoder_decoder_attention.project_q(h)
    x = x + self.dropout(self.encoder_decoder_attention.attend(q, cross_k, cross_v, cross_mask,
                                                               None))
    x = x + self.dropout(self.mlp(self.pre_mlp_layer_norm(x)))
    return x, k_cache, v_cache


class NodeAttention(NamedTuple):
  """Where a decode call's k nodes are written and what each sees (token trees and
  beam search's nodes).

  slots:         [B, k] int32, where the call's nodes are written (-1: nowhere).
  key_positions: [B, L] int32, the position of the key in every cache slot.
  mask:          [B, k, L] bool, whether each node sees each slot."""

  slots: Array
  key_positions: Array
  mask: Array


def tree_attention(start: Array, nodes: np.ndarray, key_offsets: Array, visible: Array,
                   cache_len: int) -> NodeAttention:
  """A token tree's ``NodeAttention``: slot start + j holds node j, its key at
  start + key_offsets[j] ([N] or [B, N]); the prefix (slots < start) is seen by
  all, and the call's ``nodes`` [k] see the scratch slots ``visible`` marks."""
  slot = jnp.arange(cache_len, dtype=jnp.int32)[None]
  rel = slot - start[:, None]                                        # [B, L]
  n = key_offsets.shape[-1]
  in_tree = (rel >= 0) & (rel < n)
  j = jnp.clip(rel, 0, n - 1)
  if visible.ndim == 3:  # a tree given as data, per row
    offsets = jnp.take_along_axis(jnp.broadcast_to(key_offsets, (rel.shape[0], n)), j, 1)
    seen = jnp.take_along_axis(visible, jnp.broadcast_to(
        j[:, None], (j.shape[0], visible.shape[1], j.shape[1])), axis=2)
  else:
    offsets, seen = key_offsets[j], jnp.moveaxis(visible[:, j], 0, 1)
  k_pos = jnp.where(in_tree, start[:, None] + offsets, slot)          # seen: [B, k, L]
  return NodeAttention(slots=start[:, None] + jnp.asarray(nodes)[None], key_positions=k_pos,
                       mask=(rel < 0)[:, None, :] | (in_tree[:, None, :] & seen))


def _write(cache: Array, new: Array, positions: Array) -> Array:
  """cache [B, L, H, dh] <- new [B, k, H, dh] at positions [B, k] (negatives dropped)."""
  length = cache.shape[1]
  pos = jnp.where(positions < 0, length, positions)
  # Per row (vmap): a batch-sharded cache is updated in place, no all-gather.
  write_row = lambda c, n, p: c.at[p].set(n, mode="drop")
  return jax.vmap(write_row)(cache, new.astype(cache.dtype), pos)


def _pad_call(tokens: Array, positions: Array, extra: Optional[Array],
              tree: Optional[NodeAttention], r: int) -> tuple:
  """A call's k positions padded to r (``T5Config.fixed_positions``) at position -1."""
  k = tokens.shape[1]
  if k > r:
    raise ValueError(f"a decode call scores {k} positions but T5Config.fixed_positions is "
                     f"{r}: set it to at least {k} (gamma + 1, or a tree's node count)")
  pad = lambda a, value=0: jnp.pad(a, ((0, 0), (0, r - k)) + ((0, 0),) * (a.ndim - 2),
                                   constant_values=value)
  if extra is not None:
    extra = pad(extra)
  if tree is not None:
    tree = tree._replace(slots=pad(tree.slots, -1), mask=pad(tree.mask, False))
  return pad(tokens), pad(positions, -1), extra, tree


class Decoder(nn.Module):
  config: T5Config

  def setup(self):
    c = self.config
    self.relpos_bias, self.layers, self.decoder_norm = _stack(c, encoder=False)
    if not c.logits_via_embedding:
      self.logits_dense = RowPaddedDense(c.vocab_size, use_bias=False, dtype=c.jnp_dtype,
                                         param_dtype=jnp.float32,
                                         kernel_init=nn.initializers.normal(c.d_model ** -0.5),
                                         min_rows=c.min_rows)

  def cross_kv(self, encoded: Array) -> tuple[tuple, tuple]:
    kv = [layer.cross_kv(encoded) for layer in self.layers]
    return tuple(k for k, _ in kv), tuple(v for _, v in kv)

  def output_logits(self, y: Array, embed_attend: Any) -> Array:
    """Final normed hidden states [B, k, d] -> logits [B, k, V] float32."""
    c = self.config
    if c.logits_via_embedding:
      logits = embed_attend(y) / jnp.sqrt(jnp.float32(c.d_model))
    else:
      logits = self.logits_dense(y.astype(c.jnp_dtype))
    return logits.astype(jnp.float32)

  def __call__(self, x: Array, positions: Array, cache: Optional[DecoderCache],
               cross: Optional[tuple], embed_attend, write: bool = True,
               return_hidden: bool = False, tree: Optional[NodeAttention] = None) -> tuple:
    """-> (logits, cache); with ``write=False``, (logits, per-layer (keys, values)).

    ``return_hidden`` appends the final normed hidden states [B, k, d]; ``tree``
    (a ``NodeAttention``) writes at its slots under its mask. With
    ``decode_kernel='pallas'`` a call ``kernels.covers`` runs as fused kernels."""
    c = self.config
    if c.decode_kernel == "pallas":
      # Imported here: only this setting needs Pallas (most of a second to import).
      from specdec_jax import kernels
      if kernels.covers(c, positions.shape[0], positions.shape[1], cache, write, tree,
                        return_hidden):
        embedding = embed_attend.__self__.embedding if c.logits_via_embedding else None
        return kernels.decode(c, self.variables["params"], x, positions, cache,
                              self.relpos_bias, embedding)
    if cache is not None:
      k_pos = jnp.broadcast_to(jnp.arange(cache.cache_len, dtype=jnp.int32),
                               (positions.shape[0], cache.cache_len))
      cross_k, cross_v, enc_mask = cache.cross_k, cache.cross_v, cache.encoder_mask
    else:
      k_pos = positions
      cross_k, cross_v, enc_mask = cross
    # Causal over actual positions: a query at t sees keys at positions 0..t.
    causal = lambda kp: ((kp[:, None, :] <= positions[:, :, None]) & (kp[:, None, :] >= 0))
    if tree is None:
      self_mask, write_at = causal(k_pos), positions
    else:
      k_pos, self_mask, write_at = tree.key_positions, tree.mask, tree.slots
    new_mask = new_bias = None
    rows_only = cache is not None and not write and c.fixed_positions > 0
    if cache is not None and not write and not rows_only:
      # Cache block: positions before the first new token; new tokens: block two.
      self_mask = self_mask & (k_pos[:, None, :] < positions[:, :1, None])
      new_mask, new_bias = causal(positions)[:, None], self.relpos_bias(positions, positions)
    self_mask = self_mask[:, None]
    bias = self.relpos_bias(positions, k_pos)
    cross_mask = enc_mask[:, None, None, :]
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      kc = cache.self_k[i] if cache is not None else None
      vc = cache.self_v[i] if cache is not None else None
      x, kc, vc = layer(x, write_at, self_mask, bias, kc, vc, cross_k[i], cross_v[i],
                        cross_mask, new_mask, new_bias, rows_only)
      new_k.append(kc)
      new_v.append(vc)
    y = self.decoder_norm(x)
    logits = self.output_logits(y, embed_attend)
    if cache is not None and not write:
      out = logits, (tuple(new_k), tuple(new_v))
    else:
      if cache is not None:
        cache = cache.replace(self_k=tuple(new_k), self_v=tuple(new_v))
      out = logits, cache
    return out + (y,) if return_hidden else out


class T5(nn.Module):
  """The whole encoder-decoder. Use the methods through ``T5Model`` below."""

  config: T5Config

  def setup(self):
    c = self.config
    self.token_embedder = nn.Embed(c.vocab_size, c.d_model, dtype=c.jnp_dtype,
                                   param_dtype=jnp.float32,
                                   embedding_init=nn.initializers.normal(1.0))
    self.encoder = Encoder(c)
    self.decoder = Decoder(c)

  def encode(self, inputs: Array, extra: Optional[Array] = None) -> Array:
    mask = inputs != self.config.pad_id
    return self.encoder(self._embed(inputs, extra), mask)

  def init_cache(self, encoded: Array, inputs: Array, cache_len: int) -> DecoderCache:
    c = self.config
    b = encoded.shape[0]
    cross_k, cross_v = self.decoder.cross_kv(encoded)
    shape = (b, cache_len, c.num_heads, c.head_dim)
    zeros = tuple(jnp.zeros(shape, c.jnp_dtype) for _ in range(c.num_decoder_layers))
    return DecoderCache(self_k=zeros, self_v=zeros, cross_k=cross_k, cross_v=cross_v,
                        encoder_mask=inputs != c.pad_id)

  def _embed(self, tokens: Array, extra: Optional[Array]) -> Array:
    """Token embeddings plus ``extra`` (from a bridge) if given."""
    x = self.token_embedder(tokens)
    return x if extra is None else x + extra.astype(x.dtype)

  def decode(self, tokens: Array, positions: Array, cache: DecoderCache, write: bool = True,
             extra: Optional[Array] = None, return_hidden: bool = False,
             tree: Optional[NodeAttention] = None):
    k, r = tokens.shape[1], self.config.fixed_positions
    if r:
      tokens, positions, extra, tree = _pad_call(tokens, positions, extra, tree, r)
    out = self.decoder(self._embed(tokens, extra), positions, cache, None,
                       self.token_embedder.attend, write, return_hidden, tree)
    if not r:
      return out
    # Drop the padding positions' logits, rows and hidden states.
    cut = lambda a: a[:, :k]
    rows = out[1] if write else jax.tree.map(cut, out[1])
    return (cut(out[0]), rows) + tuple(cut(a) for a in out[2:])

  def output_logits(self, hidden: Array) -> Array:
    return self.decoder.output_logits(hidden, self.token_embedder.attend)

  def __call__(self, inputs: Array, decoder_inputs: Array, encoder_extra: Optional[Array] = None,
               decoder_extra: Optional[Array] = None, return_hidden: bool = False):
    """Teacher-forced logits [B, T, V] (with ``return_hidden``, and states [B, T, d])."""
    encoded = self.encode(inputs, encoder_extra)
    cross = self.decoder.cross_kv(encoded) + (inputs != self.config.pad_id,)
    b, t = decoder_inputs.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = self.decoder(self._embed(decoder_inputs, decoder_extra), pos, None, cross,
                       self.token_embedder.attend, return_hidden=return_hidden)
    return (out[0], out[2]) if return_hidden else out[0]


@dataclasses.dataclass(frozen=True)
class T5Model:
  """Pure-function view of ``T5``, hashable (a static jit argument); a ``TargetModel``."""

  config: T5Config

  @property
  def module(self) -> T5:
    return T5(self.config)

  def init(self, rng: Array, input_len: int = 8, target_len: int = 8) -> dict:
    """Random parameters (T5X tree) for tests and benchmarks."""
    dummy_in = jnp.ones((1, input_len), jnp.int32)
    dummy_out = jnp.ones((1, target_len), jnp.int32)
    return self.module.init(rng, dummy_in, dummy_out)["params"]

  def encode(self, params: dict, inputs: Array, extra: Optional[Array] = None) -> Array:
    """inputs [B, S] (0 = pad) -> encoded [B, S, d]; ``extra`` added to the embeddings."""
    return self.module.apply({"params": params}, inputs, extra, method=T5.encode)

  def output_logits(self, params: dict, hidden: Array) -> Array:
    """The output layer alone: hidden [B, k, d] -> logits [B, k, V] float32."""
    return self.module.apply({"params": params}, hidden, method=T5.output_logits)

  def init_cache(self, params: dict, encoded: Array, inputs: Array, cache_len: int) -> DecoderCache:
    """Cross-attention K/V (once per example) + an empty self-attention cache."""
    return self.module.apply({"params": params}, encoded, inputs, cache_len, method=T5.init_cache)

  def decode(self, params: dict, tokens: Array, positions: Array, cache: DecoderCache,
             extra: Optional[Array] = None, return_hidden: bool = False, *, write: bool = True,
             tree: Optional[TreeShape] = None) -> tuple:
    """``models.base.TargetModel.decode``; ``extra`` [B, k, d] is added to the
    embeddings. ``write=False`` attends over cache and new tokens with one softmax
    (bit-equal to a write with ``T5Config.fixed_positions``)."""
    if tree is not None:
      if not write:
        raise ValueError("a tree pass writes its nodes at scratch slots; write=False is for "
                         "chains only")
      return self.decode_tree(params, tokens, positions[:, 0], tree, cache,
                              return_hidden=return_hidden, extra=extra)
    return self.module.apply({"params": params}, tokens, positions, cache, write, extra,
                             return_hidden, method=T5.decode)

  @staticmethod
  def read_rows(cache: DecoderCache, slots: Array) -> tuple[tuple, tuple]:
    """The self-attention (keys, values) at slots [B, k] (clipped), per layer."""
    take = jax.vmap(lambda c, s: jnp.take(c, s, axis=0, mode="clip"))
    return tuple(take(c, slots) for c in cache.self_k), tuple(take(c, slots) for c in cache.self_v)

  @staticmethod
  def write_rows(cache: DecoderCache, rows: tuple[tuple, tuple], positions: Array) -> DecoderCache:
    """``decode(write=False)``'s rows written at positions [B, k] (negatives dropped)."""
    ks, vs = rows
    return cache.replace(self_k=tuple(_write(c, n, positions) for c, n in zip(cache.self_k, ks)),
                         self_v=tuple(_write(c, n, positions) for c, n in zip(cache.self_v, vs)))

  def decode_tree(self, params: dict, tokens: Array, lengths: Array,
                  tree: Union[TreeShape, RoundTree], cache: DecoderCache,
                  nodes: Optional[Sequence[int]] = None, return_hidden: bool = False,
                  partitioner: Optional[Partitioner] = None,
                  extra: Optional[Array] = None) -> tuple:
    """``models.base.decode_tree`` for tokens [B, k] of ``nodes`` (default all N;
    a subset builds a tree a depth at a time, EAGLE-2, ancestors already written).
    Node i's logits equal a chain ``decode`` of its path to rounding. Needs
    lengths + N <= cache_len; ``partitioner`` pins the cache."""
    n_nodes = tree.num_nodes
    nodes = tuple(range(n_nodes)) if nodes is None else tuple(int(j) for j in nodes)
    if not nodes or len(set(nodes)) != len(nodes) or not all(0 <= j < n_nodes for j in nodes):
      raise ValueError(f"nodes must be distinct node indices in [0, {n_nodes}), got {nodes}")
    if tokens.ndim != 2 or tokens.shape[1] != len(nodes):
      raise ValueError(f"tokens must be [B, {len(nodes)}] (one per node decoded), got "
                       f"{tokens.shape}")
    if cache.cache_len < n_nodes:
      raise ValueError(f"a cache of {cache.cache_len} slots cannot hold a tree of {n_nodes} "
                       f"nodes; size it with TreeShape.cache_len(max_decode_len)")
    idx = np.asarray(nodes, np.int32)
    start = lengths.astype(jnp.int32)
    offsets = jnp.asarray(tree.depths, jnp.int32)                # [N] or [B, N]
    positions = start[:, None] + offsets[..., idx]
    att = tree_attention(start, idx, offsets, jnp.asarray(tree.ancestor_mask)[..., idx, :],
                         cache.cache_len)
    out = self.module.apply({"params": params}, tokens, positions, cache, True, extra,
                            return_hidden, att, method=T5.decode)
    return (out[0], constrain_cache(out[1], partitioner, "tree cache")) + out[2:]

  def decode_nodes(self, params: dict, tokens: Array, positions: Array, slots: Array,
                   key_positions: Array, mask: Array, cache: DecoderCache) -> tuple:
    """One pass over k nodes with data-given layout: tokens [B, k] at positions
    [B, k] written at slots [B, k] (negative: not), node i seeing the slots of
    mask [B, k, L] with keys at key_positions [B, L] -> (logits, cache). Beam
    search keeps its own layout (``specdec_jax.beam``); each node must see its
    own slot."""
    if self.config.fixed_positions:
      raise ValueError("decode_nodes does not pad to T5Config.fixed_positions: set it to 0 for "
                       "beam search")
    if mask.shape != (*tokens.shape, cache.cache_len) or key_positions.shape != (
        tokens.shape[0], cache.cache_len):
      raise ValueError(f"mask must be [B, k, cache_len] and key_positions [B, cache_len] for "
                       f"tokens {tokens.shape} and cache_len {cache.cache_len}, got "
                       f"{mask.shape} and {key_positions.shape}")
    att = NodeAttention(slots=slots.astype(jnp.int32),
                        key_positions=key_positions.astype(jnp.int32), mask=mask)
    return self.module.apply({"params": params}, tokens, positions.astype(jnp.int32), cache,
                             True, None, False, att, method=T5.decode)

  @staticmethod
  def commit_path(cache: DecoderCache, lengths: Array, path: Array, num_accepted: Array,
                  partitioner: Optional[Partitioner] = None) -> DecoderCache:
    """``models.base.commit_path`` on a T5 cache; unwritten slots (a draft's unfed
    leaves) move as garbage, so ``T5Draft`` refeeds."""
    return base.commit_path(T5Model, cache, lengths, path, num_accepted, partitioner)

  def __call__(self, params: dict, inputs: Array, decoder_inputs: Array,
               dropout_rng: Optional[Array] = None, encoder_extra: Optional[Array] = None,
               decoder_extra: Optional[Array] = None, return_hidden: bool = False):
    """Teacher-forced logits [B, T, V]; ``dropout_rng`` enables dropout (training)."""
    rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
    return self.module.apply({"params": params}, inputs, decoder_inputs, encoder_extra,
                             decoder_extra, return_hidden, rngs=rngs)


def shift_right(targets: Array, start_id: int = 0) -> Array:
  """Decoder inputs for teacher forcing: [start, y_0, ..., y_{T-2}]."""
  return jnp.concatenate(
      [jnp.full(targets.shape[:-1] + (1,), start_id, targets.dtype), targets[..., :-1]], -1)


def param_shapes(config: T5Config) -> dict:
  """The parameter tree's shapes (jax.ShapeDtypeStruct leaves), no allocation."""
  model = T5Model(config)
  return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0)))


def stored_dtype(name: str, param_dtype: Any) -> jnp.dtype:
  """The dtype T5X parameter ``name`` is kept in: ``param_dtype``, but float32 for
  norm scales and relative-position tables (as in T5X)."""
  if name.endswith("/scale") or name.endswith("/rel_embedding"):
    return jnp.dtype(jnp.float32)
  return jnp.dtype(param_dtype)


# Self-attention modules whose query/key/value fuse, and the fused names.
_FUSED = (("attention", ("query", "key", "value"), "qkv"),
          ("self_attention", ("query", "key", "value"), "qkv"),
          ("mlp", ("wi_0", "wi_1"), "wi_fused"))


def fuse_projections(params: Any) -> Any:
  """A T5X tree as the fused model reads it: self-attention q/k/v become one
  ``qkv`` kernel and a gated MLP's wi_0/wi_1 one ``wi_fused`` (columns side by
  side, values copied). Float kernels only: quantize after fusing."""
  def fuse_layer(layer: dict) -> dict:
    layer = dict(layer)
    for module, parts, fused in _FUSED:
      sub = layer.get(module)
      if sub is None or not all(p in sub for p in parts):
        continue
      kernels = [sub[p]["kernel"] for p in parts]
      if any(quantization.is_qarray(k) for k in kernels):
        raise ValueError(f"fuse_projections takes float kernels; {module}/{parts[0]}/kernel is "
                         "quantized: fuse before quantizing")
      sub = {k: v for k, v in sub.items() if k not in parts}
      sub[fused] = {"kernel": jnp.concatenate(kernels, axis=1)}
      layer[module] = sub
    return layer

  out = dict(params)
  for stack in ("encoder", "decoder"):
    if stack not in out:
      raise ValueError(f"fuse_projections: no '{stack}' in the parameter tree (keys: "
                       f"{sorted(out)})")
    out[stack] = {name: fuse_layer(v) if name.startswith("layers_") else v
                  for name, v in out[stack].items()}
  return out
