"""A T5 decoder layer at decode time in 6 Pallas kernels (XLA: ~34): norm + qkv
+ self-attention (rows written to the cache), output + residual, norm + cross-
attention, output + residual, norm + MLP input, MLP output + residual. Every
call runs ``QUERY_BLOCK`` query rows per batch row with tilings independent of
k, so a position's logits are bit for bit a one-position step's (T = 0
speculative decoding reproduces the baseline at low precision) and equal the
XLA path's to rounding. ``covers`` decides what falls back to XLA; quantized
kernels are refused. Triton on GPUs, interpret mode on CPU."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specdec_jax import quantization

Array = jax.Array
# Query rows per batch row in every call: k <= QUERY_BLOCK new tokens, padded.
QUERY_BLOCK = 16
# Most batch rows a call runs on (all rows sit in one block of the products).
MAX_BATCH = 8
# Output-column and reduction tiles of the products (capped powers of two).
_BLOCK_N = 64
_BLOCK_K = 128
# Key slots per attention step (the largest power of two <= the length, capped).
_BLOCK_L = 128
# As models.t5: large negative, not -inf, so a fully masked row stays finite.
_MASK_VALUE = -1e10


def interpret_mode(interpret: Optional[bool] = None) -> bool:
  """``interpret`` if given, else interpret mode on a CPU, Triton on GPUs."""
  if interpret is not None:
    return interpret
  backend = jax.default_backend()
  if backend == "cpu":
    return True
  if backend in ("gpu", "cuda", "rocm"):
    return False
  raise ValueError(f"decode_kernel='pallas' runs on GPUs (Triton) or in interpret mode on "
                   f"the CPU, not on backend {backend!r}; use decode_kernel='xla'")


def _tile(size: int, cap: int) -> int:
  """The largest power of two that divides ``size``, at most ``cap``."""
  return min(size & -size, cap)


def _pow2_floor(n: int) -> int:
  return 1 << (n.bit_length() - 1)


def _compiler_params():
  return plgpu.CompilerParams(num_warps=4, num_stages=2)


def _normed_products(x_ref, s_ref, w_refs, bk: int, eps: float, dtype,
                     transpose: bool = False) -> list:
  """[RMSNorm(x)] @ w for each w, float32 sums over ``bk``-wide tiles in order:
  x_ref [R, K], s_ref [K] or None, w_refs [K, N] ([N, K] with ``transpose``)."""
  rows, k = x_ref.shape
  nk = k // bk
  f32 = jnp.float32
  if s_ref is not None:  # T5's RMSNorm, float32, over the whole row before any product
    def squares(t, acc):
      xt = x_ref[:, pl.ds(t * bk, bk)].astype(f32)
      return acc + jnp.sum(xt * xt, axis=1)
    ss = jax.lax.fori_loop(0, nk, squares, jnp.zeros((rows,), f32))
    inv = jax.lax.rsqrt(ss / k + eps)

  def body(t, accs):
    xt = x_ref[:, pl.ds(t * bk, bk)]
    if s_ref is not None:
      xt = (xt.astype(f32) * inv[:, None]) * s_ref[pl.ds(t * bk, bk)].astype(f32)[None, :]
    xt = xt.astype(dtype)
    out = []
    for w_ref, acc in zip(w_refs, accs):
      if transpose:  # w [N, K] (the embedding): contract its minor axis
        wt = w_ref[:, pl.ds(t * bk, bk)].astype(dtype)
        p = jax.lax.dot_general(xt, wt, (((1,), (1,)), ((), ())), preferred_element_type=f32)
      else:
        wt = w_ref[pl.ds(t * bk, bk), :].astype(dtype)
        p = jnp.dot(xt, wt, preferred_element_type=f32)
      out.append(acc + p)
    return tuple(out)

  n = w_refs[0].shape[0 if transpose else 1]
  return list(jax.lax.fori_loop(0, nk, body, tuple(jnp.zeros((rows, n), f32) for _ in w_refs)))


def _rows_kernel(*refs, n_w: int, has_norm: bool, has_res: bool, act: Optional[str],
                 transpose: bool, bk: int, eps: float, dtype, divisor: Optional[float]):
  it = iter(refs)
  x_ref = next(it)
  s_ref = next(it) if has_norm else None
  w_refs = [next(it) for _ in range(n_w)]
  r_ref = next(it) if has_res else None
  o_refs = list(it)
  f32 = jnp.float32
  accs = _normed_products(x_ref, s_ref, w_refs, bk, eps, dtype, transpose)
  # Epilogue at the activation dtype, as the XLA path's Dense outputs.
  if act == "gated":  # T5 1.1: gelu(x wi_0) * (x wi_1), tanh-approximated gelu
    a0, a1 = (a.astype(dtype).astype(f32) for a in accs)
    outs = [(jax.nn.gelu(a0, approximate=True) * a1).astype(dtype)]
  elif act == "relu":  # T5 1.0
    outs = [jnp.maximum(accs[0].astype(dtype), 0).astype(dtype)]
  else:
    outs = [a.astype(dtype) for a in accs]
  if has_res:
    outs = [(o + r_ref[...]).astype(dtype) for o in outs]
  if divisor is not None:
    outs = [o.astype(f32) / divisor for o in outs]
  for o_ref, o in zip(o_refs, outs):
    o_ref[...] = o.astype(o_ref.dtype)


def rows_product(x: Array, weights: Sequence[Array], dtype: Any, *,
                 norm_scale: Optional[Array] = None, eps: float = 1e-6, act: Optional[str] = None,
                 residual: Optional[Array] = None, transpose: bool = False, out_dtype: Any = None,
                 divisor: Optional[float] = None, interpret: Optional[bool] = None) -> list[Array]:
  """One kernel: ``[RMSNorm(x)] @ w`` for each of ``weights`` and an epilogue.

  x [R, K] (R a power of two >= 16), weights [K, N] ([N, K] with
  ``transpose``). ``act``: None, 'gated' (gelu(x w0) * (x w1)) or 'relu'.
  ``residual`` [R, N] is added at ``dtype``; ``divisor`` divides the result (T5
  1.0's logits). -> outputs [R, N] (``out_dtype``, default ``dtype``)."""
  rows, k = x.shape
  n = weights[0].shape[0 if transpose else 1]
  bk, bn = _tile(k, _BLOCK_K), _tile(n, _BLOCK_N)
  if bk < 16 or bn < 16:
    raise ValueError(f"rows_product needs K and N multiples of 16, got K={k}, N={n}")
  dtype = jnp.dtype(dtype)
  out_dtype = jnp.dtype(out_dtype or dtype)
  n_out = 1 if act else len(weights)
  kernel = functools.partial(_rows_kernel, n_w=len(weights), has_norm=norm_scale is not None,
                             has_res=residual is not None, act=act, transpose=transpose,
                             bk=bk, eps=eps, dtype=dtype, divisor=divisor)
  w_spec = (pl.BlockSpec((bn, k), lambda j: (j, 0)) if transpose
            else pl.BlockSpec((k, bn), lambda j: (0, j)))
  row_block = pl.BlockSpec((rows, bn), lambda j: (0, j))
  in_specs = [pl.BlockSpec((rows, k), lambda j: (0, 0))]
  args = [x]
  if norm_scale is not None:
    in_specs.append(pl.BlockSpec((k,), lambda j: (0,)))
    args.append(norm_scale)
  in_specs += [w_spec] * len(weights)
  args += list(weights)
  if residual is not None:
    in_specs.append(row_block)
    args.append(residual)
  return pl.pallas_call(
      kernel, grid=(n // bn,), in_specs=in_specs, out_specs=[row_block] * n_out,
      out_shape=[jax.ShapeDtypeStruct((rows, n), out_dtype)] * n_out,
      compiler_params=_compiler_params(), interpret=interpret_mode(interpret),
      name="t5_rows_product")(*args)


def _attn_kernel(*refs, self_attn: bool, bl: int, bk: int, eps: float, length: int, dtype):
  it = iter(refs)
  x_ref, s_ref, wq_ref = next(it), next(it), next(it)
  if self_attn:
    wk_ref, wv_ref = next(it), next(it)
  k_ref, v_ref = next(it), next(it)
  if self_attn:
    pos_ref, bias_ref = next(it), next(it)
  else:
    mask_ref = next(it)
  o_ref = next(it)
  if self_attn:
    kout_ref, vout_ref = next(it), next(it)
  h, b = pl.program_id(0), pl.program_id(1)
  f32 = jnp.float32
  # RMSNorm + this head's query (and new key/value) rows [Qb, dh], activation dtype.
  w_refs = [wq_ref, wk_ref, wv_ref] if self_attn else [wq_ref]
  projected = [a.astype(dtype) for a in _normed_products(x_ref, s_ref, w_refs, bk, eps, dtype)]
  q = projected[0]
  nq, dh = q.shape
  if self_attn:
    kn, vn = projected[1:]
    pos = pos_ref[0, :]                                          # [Qb] int32
  n_chunks = pl.cdiv(length, bl)

  def body(c, carry):
    o, m, l = carry
    # The last chunk is shifted back to end at the last slot; slots an earlier
    # chunk already covered are masked there (exact zeros in the sums).
    start = jnp.minimum(c * bl, length - bl)
    slots = start + jax.lax.broadcasted_iota(jnp.int32, (bl,), 0)
    fresh = slots >= c * bl
    kt = k_ref[b, pl.ds(start, bl), h, :].astype(dtype)          # [bl, dh]
    vt = v_ref[b, pl.ds(start, bl), h, :].astype(dtype)
    if self_attn:
      # The call's new rows in the slots they are written to: what the cache
      # holds after the write (a one-hot product copies them exactly).
      hit = (slots[:, None] == pos[None, :]).astype(f32)         # [bl, Qb]
      written = jnp.sum(hit, axis=1)[:, None] > 0
      exact = jax.lax.Precision.HIGHEST
      onehot = hit.astype(dtype)
      kt = jnp.where(written, jnp.dot(onehot, kn, precision=exact,
                                      preferred_element_type=f32).astype(dtype), kt)
      vt = jnp.where(written, jnp.dot(onehot, vn, precision=exact,
                                      preferred_element_type=f32).astype(dtype), vt)

      # A chunk holding a new row is stored back whole (out-of-range positions
      # match no slot); concurrent readers merge the same rows, so order is moot.
      @pl.when(jnp.max(hit) > 0)
      def _():
        kout_ref[b, pl.ds(start, bl), h, :] = kt.astype(kout_ref.dtype)
        vout_ref[b, pl.ds(start, bl), h, :] = vt.astype(vout_ref.dtype)

    s = jax.lax.dot_general(q, kt, (((1,), (1,)), ((), ())), preferred_element_type=f32)
    if self_attn:
      s = s + bias_ref[b, h, :, pl.ds(start, bl)]
      seen = (slots[None, :] <= pos[:, None]) & fresh[None, :]
    else:
      seen = jnp.broadcast_to(((mask_ref[b, pl.ds(start, bl)] != 0) & fresh)[None, :], s.shape)
    s = jnp.where(seen, s, _MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = corr * l + jnp.sum(p, axis=1)
    o = corr[:, None] * o + jnp.dot(p.astype(dtype), vt, preferred_element_type=f32)
    return o, m_new, l

  # Self-attention visits only chunks up to the row's last query position (the
  # rest add exact zeros), at least one so every row is finite.
  trips = jnp.clip(jnp.max(pos) // bl + 1, 1, n_chunks) if self_attn else n_chunks
  init = (jnp.zeros((nq, dh), f32), jnp.full((nq,), -1e30, f32), jnp.zeros((nq,), f32))
  o, _, l = jax.lax.fori_loop(0, trips, body, init)
  o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)


def attention(x: Array, norm_scale: Array, w_q: Array, keys: Array, values: Array, dtype: Any, *,
              eps: float = 1e-6, w_k: Optional[Array] = None, w_v: Optional[Array] = None,
              positions: Optional[Array] = None, bias: Optional[Array] = None,
              key_mask: Optional[Array] = None, interpret: Optional[bool] = None):
  """One kernel, grid (head, batch): RMSNorm(x), the head's query product and T5
  attention (no 1/sqrt(dh)) of ``QUERY_BLOCK`` rows per batch row over keys/values
  [B, L, H, dh]. x [R, d] (batch row b at rows 16 b ..), w_q [d, H*dh].
  Self-attention (w_k/w_v, positions [B, 16], bias [B, H, 16, L]): new rows
  written at ``positions`` (negatives dropped), query j sees slots
  0..positions[b, j]; -> (out [R, H*dh], keys, values). Cross-attention
  (``key_mask`` [B, L], nonzero = visible): -> out."""
  self_attn = positions is not None
  b, length, heads, dh = keys.shape
  rows, d = x.shape
  nq = QUERY_BLOCK
  bl = min(_BLOCK_L, _pow2_floor(length))
  bk = _tile(d, _BLOCK_K)
  dtype = jnp.dtype(dtype)
  kernel = functools.partial(_attn_kernel, self_attn=self_attn, bl=bl, bk=bk, eps=eps,
                             length=length, dtype=dtype)
  whole = pl.no_block_spec   # the whole array: indexed in the kernel
  head_w = pl.BlockSpec((d, dh), lambda i, j: (0, i))
  in_specs = [pl.BlockSpec((nq, d), lambda i, j: (j, 0)), pl.BlockSpec((d,), lambda i, j: (0,)),
              head_w]
  args = [x, norm_scale, w_q]
  if self_attn:
    in_specs += [head_w, head_w]
    args += [w_k, w_v]
  in_specs += [whole, whole]
  args += [keys, values]
  if self_attn:
    in_specs += [pl.BlockSpec((1, nq), lambda i, j: (j, 0)), whole]
    args += [positions, bias]
  else:
    in_specs.append(whole)
    args.append(key_mask)
  out_shape = [jax.ShapeDtypeStruct((rows, heads * dh), dtype)]
  out_specs = [pl.BlockSpec((nq, dh), lambda i, j: (j, i))]
  aliases = {}
  if self_attn:
    out_shape += [jax.ShapeDtypeStruct(keys.shape, keys.dtype),
                  jax.ShapeDtypeStruct(values.shape, values.dtype)]
    out_specs += [whole, whole]
    aliases = {5: 1, 6: 2}   # keys, values -> the updated caches
  out = pl.pallas_call(
      kernel, grid=(heads, b), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases, compiler_params=_compiler_params(),
      interpret=interpret_mode(interpret),
      name="t5_self_attention" if self_attn else "t5_cross_attention")(*args)
  return tuple(out) if self_attn else out[0]


def covers(config: Any, batch: int, k: int, cache: Any, write: bool, tree: Any,
           return_hidden: bool) -> bool:
  """Whether the kernels run this decode call (else XLA does), at trace time."""
  if cache is None or not write or tree is not None or return_hidden:
    return False
  if not (1 <= k <= QUERY_BLOCK and 1 <= batch <= MAX_BATCH):
    return False
  c = config
  sizes = (c.d_model, c.num_heads * c.head_dim, c.d_ff, c.vocab_size)
  lengths = (cache.cache_len, cache.cross_k[0].shape[1])
  return (all(n % 16 == 0 for n in sizes) and c.head_dim & (c.head_dim - 1) == 0
          and c.head_dim >= 16 and all(n >= 16 for n in lengths))


def _check_float(params: Any) -> None:
  leaves = jax.tree_util.tree_leaves(params, is_leaf=quantization.is_qarray)
  if any(quantization.is_qarray(x) for x in leaves):
    raise ValueError("decode_kernel='pallas' does not cover quantized kernels "
                     "(draft_quantization); use decode_kernel='xla' for a quantized draft")


def layer(config: Any, params: dict, x: Array, positions: Array, bias: Array,
          k_cache: Array, v_cache: Array, cross_k: Array, cross_v: Array, enc_mask: Array,
          interpret: Optional[bool] = None) -> tuple[Array, Array, Array]:
  """One decoder layer (chain decode with a cache) in 6 kernels: x [R, d], R = 16 *
  (batch rounded up to a power of two); positions [B, 16] (-1: padding); bias
  [B, H, 16, L]; caches [B, L, H, dh]; cross [B, S, H, dh]; enc_mask [B, S].
  -> (x [R, d], k_cache, v_cache)."""
  c = config
  dt = jnp.dtype(c.dtype)
  run = functools.partial(rows_product, dtype=dt, eps=c.layer_norm_epsilon, interpret=interpret)
  att = functools.partial(attention, dtype=dt, eps=c.layer_norm_epsilon, interpret=interpret)
  kern = lambda p: p["kernel"]
  scale = lambda p: p["scale"]
  sa, ca, mlp = params["self_attention"], params["encoder_decoder_attention"], params["mlp"]
  a, k_cache, v_cache = att(x, scale(params["pre_self_attention_layer_norm"]),
                            kern(sa["query"]), k_cache, v_cache, w_k=kern(sa["key"]),
                            w_v=kern(sa["value"]), positions=positions, bias=bias)
  x, = run(a, [kern(sa["out"])], residual=x)
  a = att(x, scale(params["pre_cross_attention_layer_norm"]), kern(ca["query"]), cross_k,
          cross_v, key_mask=enc_mask)
  x, = run(a, [kern(ca["out"])], residual=x)
  if c.gated:
    h, = run(x, [kern(mlp["wi_0"]), kern(mlp["wi_1"])], act="gated",
             norm_scale=scale(params["pre_mlp_layer_norm"]))
  else:
    h, = run(x, [kern(mlp["wi"])], act="relu", norm_scale=scale(params["pre_mlp_layer_norm"]))
  x, = run(h, [kern(mlp["wo"])], residual=x)
  return x, k_cache, v_cache


def decode(config: Any, params: dict, x: Array, positions: Array, cache: Any,
           relpos_bias: Callable[[Array, Array], Array], embedding: Optional[Array] = None,
           interpret: Optional[bool] = None) -> tuple[Array, Any]:
  """``models.t5.Decoder``'s chain decode (cache given, ``write=True``) with the
  kernels: x [B, k, d] embeddings at positions [B, k]; relpos_bias: (q_pos,
  k_pos) -> [B, H, Q, L]; embedding [V, d] (T5 1.0's logits). -> (logits
  [B, k, V] float32, cache)."""
  _check_float(params)
  c = config
  dt = jnp.dtype(c.dtype)
  b, k, d = x.shape
  nq = QUERY_BLOCK
  batch_rows = 1 << (b - 1).bit_length()   # a power of two, for Triton's blocks
  rows = batch_rows * nq
  # Row r = b * 16 + j: batch row b's j-th new token; padding at position -1.
  x = jnp.pad(x.astype(dt), ((0, batch_rows - b), (0, nq - k), (0, 0))).reshape(rows, d)
  pos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, nq - k)), constant_values=-1)
  length = cache.cache_len
  k_pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
  bias = relpos_bias(pos, k_pos).astype(jnp.float32)     # [B, H, 16, L], once per call
  enc_mask = cache.encoder_mask.astype(jnp.int32)
  run = functools.partial(rows_product, dtype=dt, eps=c.layer_norm_epsilon, interpret=interpret)
  new_k, new_v = [], []
  for i in range(c.num_decoder_layers):
    x, kc, vc = layer(c, params[f"layers_{i}"], x, pos, bias, cache.self_k[i], cache.self_v[i],
                      cache.cross_k[i], cache.cross_v[i], enc_mask, interpret)
    new_k.append(kc)
    new_v.append(vc)
  final = params["decoder_norm"]["scale"]
  if c.logits_via_embedding:
    logits, = run(x, [embedding], norm_scale=final, transpose=True, out_dtype=jnp.float32,
                  divisor=math.sqrt(c.d_model))
  else:
    logits, = run(x, [params["logits_dense"]["kernel"]], norm_scale=final, out_dtype=jnp.float32)
  logits = logits.reshape(batch_rows, nq, -1)[:b, :k]
  return logits, cache.replace(self_k=tuple(new_k), self_v=tuple(new_v))
