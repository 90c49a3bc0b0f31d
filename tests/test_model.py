"""T5 model: cached incremental decode vs teacher forcing, per-row positions,
rollback, stale cache entries, negative positions, bf16, presets, relpos buckets.

All decode calls go through the module-level jitted wrappers below with the
same shapes (B=2, S=6, cache_len=16) wherever possible, so each (model, k)
compiles once per session.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.common import count_params
from specdec_jax.models.t5 import (PRESETS, T5Model, param_shapes,
                                   relative_position_bucket)

# Batch, encoder length, self-attention cache length. L > 128 so that the
# long-position test shares the cache shape (and compiled code) with the rest;
# every teacher-forced pass is at length L too (causal, so a prefix of it is
# the teacher-forced pass of that prefix).
B, S, L = 2, 6, 136


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, inputs, dec_inputs):
  return model(params, inputs, dec_inputs)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _empty_cache(model, params, inputs, cache_len):
  return model.init_cache(params, model.encode(params, inputs), inputs, cache_len)


@functools.partial(jax.jit, static_argnums=0)
def _decode(model, params, tokens, positions, cache):
  return model.decode(params, tokens, positions, cache)


def empty_cache(model, params, inputs, cache_len=L):
  return _empty_cache(model, params, inputs, cache_len)


def _inputs():
  # Row 1 has two pad positions at the end: the encoder mask must be honoured.
  return jnp.array([[5, 9, 17, 33, 2, 40], [7, 11, 3, 60, 0, 0]], jnp.int32)


def _dec_inputs(t=L, seed=1):
  rng = np.random.RandomState(seed)
  d = rng.randint(2, 64, size=(B, t)).astype(np.int32)
  d[:, 0] = 0  # decoder start token
  return jnp.asarray(d)


def _pos(start, k):
  """[B, k] positions start..start+k-1 (start scalar or per-row list)."""
  start = np.broadcast_to(np.asarray(start, np.int32), (B,))
  return jnp.asarray(start[:, None] + np.arange(k, dtype=np.int32)[None])


def _prefill(model, params, dec, n, cache=None):
  """Write dec[:, :n] at positions 0..n-1, one token per call (k=1)."""
  if cache is None:
    cache = empty_cache(model, params, _inputs())
  logits = []
  for t in range(n):
    lg, cache = _decode(model, params, dec[:, t:t + 1], _pos(t, 1), cache)
    logits.append(lg)
  return (jnp.concatenate(logits, 1) if logits else None), cache


# ------------------------------------------------------ cached == teacher forced


@pytest.mark.parametrize("k", [1, 3])
def test_cached_decode_matches_teacher_forcing(tiny_target, k):
  model, params = tiny_target
  t = 9  # divisible by 1 and 3
  dec = _dec_inputs()
  full = _forward(model, params, _inputs(), dec)
  assert full.shape == (B, L, 64) and full.dtype == jnp.float32
  full = full[:, :t]
  cache = empty_cache(model, params, _inputs())
  chunks = []
  for s in range(0, t, k):
    lg, cache = _decode(model, params, dec[:, s:s + k], _pos(s, k), cache)
    assert lg.shape == (B, k, 64) and lg.dtype == jnp.float32
    chunks.append(lg)
  cached = jnp.concatenate(chunks, 1)
  np.testing.assert_allclose(cached, full, atol=1e-5, rtol=1e-5)
  # Logits are not trivially equal across positions (the test can fail).
  assert float(jnp.max(jnp.abs(full[:, 1:] - full[:, :-1]))) > 1e-2


def test_k_token_decode_equals_k_single_decodes(tiny_target):
  model, params = tiny_target
  dec = _dec_inputs()
  _, cache = _prefill(model, params, dec, 3)
  lg3, cache3 = _decode(model, params, dec[:, 3:6], _pos(3, 3), cache)
  lg1, cache1 = _prefill(model, params, dec, 6)
  np.testing.assert_allclose(lg3, lg1[:, 3:6], atol=1e-5, rtol=1e-5)
  for a, b in zip(cache3.self_k + cache3.self_v, cache1.self_k + cache1.self_v):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_row_padded_products_change_no_row(tiny_target):
  """T5Config.min_rows pads one-token steps (B = 2 rows here) to 4 rows for
  every weight product, then drops the padding: logits, greedy tokens and
  the cache written are those of the unpadded model; a pass that already has
  enough rows (k = 3) is the unpadded program's."""
  model, params = tiny_target
  padded = T5Model(model.config.replace(min_rows=4))
  dec = _dec_inputs()
  lg, cache = _prefill(model, params, dec, 4)
  lgp, cachep = _prefill(padded, params, dec, 4)
  np.testing.assert_allclose(lgp, lg, atol=1e-6, rtol=1e-6)
  np.testing.assert_array_equal(jnp.argmax(lgp, -1), jnp.argmax(lg, -1))
  for a, b in zip(cachep.self_k + cachep.self_v, cache.self_k + cache.self_v):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)
  lg3, _ = _decode(model, params, dec[:, 4:7], _pos(4, 3), cache)
  lg3p, _ = _decode(padded, params, dec[:, 4:7], _pos(4, 3), cachep)
  np.testing.assert_allclose(lg3p, lg3, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------ per-row positions


def test_rows_at_different_positions(tiny_target):
  """Row 0 at position 5 and row 1 at position 2 decode together == alone."""
  model, params = tiny_target
  inputs = _inputs()
  dec = _dec_inputs()
  full = _forward(model, params, inputs, dec)
  # Prefill row 0 with 5 tokens and row 1 with 2 (padding the writes with -1).
  cache = empty_cache(model, params, inputs)
  for t in range(5):
    pre_pos = jnp.array([[t], [t if t < 2 else -1]], jnp.int32)
    _, cache = _decode(model, params, dec[:, t:t + 1], pre_pos, cache)
  # One step together: row 0 feeds dec[0,5] at 5, row 1 feeds dec[1,2] at 2.
  tok = jnp.array([[dec[0, 5]], [dec[1, 2]]], jnp.int32)
  pos = jnp.array([[5], [2]], jnp.int32)
  together, cache = _decode(model, params, tok, pos, cache)
  # Then a k=3 step, again at different positions.
  tok3 = jnp.stack([dec[0, 6:9], dec[1, 3:6]])
  together3, _ = _decode(model, params, tok3, _pos([6, 3], 3), cache)

  np.testing.assert_allclose(together[0, 0], full[0, 5], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(together[1, 0], full[1, 2], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(together3[0], full[0, 6:9], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(together3[1], full[1, 3:6], atol=1e-5, rtol=1e-5)

  # Each row alone (batch 1), decoded one token at a time.
  for row, n in ((0, 5), (1, 2)):
    inp1 = inputs[row:row + 1]
    c1 = _empty_cache(model, params, inp1, L)
    alone = []
    for t in range(n + 4):
      lg, c1 = _decode(model, params, dec[row:row + 1, t:t + 1],
                       jnp.array([[t]], jnp.int32), c1)
      alone.append(lg[0, 0])
    np.testing.assert_allclose(together[row, 0], alone[n], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(together3[row], jnp.stack(alone[n + 1:n + 4]),
                               atol=1e-5, rtol=1e-5)


# ------------------------------------------------------ rollback / stale / negative


def test_rollback_is_exact(tiny_target):
  """Write x at n..n+3, roll back to n and write y: identical to writing only y."""
  model, params = tiny_target
  dec = _dec_inputs()
  n = 4
  _, base = _prefill(model, params, dec, n)
  x = jnp.full((B, 4), 13, jnp.int32)
  y = dec[:, n:n + 4]
  assert not bool(jnp.all(x == y))
  lx, rolled = _decode(model, params, x, _pos(n, 4), base)
  ly_after, rolled = _decode(model, params, y, _pos(n, 4), rolled)
  ly_clean, clean = _decode(model, params, y, _pos(n, 4), base)
  np.testing.assert_array_equal(np.asarray(ly_after), np.asarray(ly_clean))
  for a, b in zip(rolled.self_k + rolled.self_v, clean.self_k + clean.self_v):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The speculative write really produced different logits (test can fail).
  assert float(jnp.max(jnp.abs(lx[:, 1:] - ly_clean[:, 1:]))) > 1e-2

  # Partial rollback: keep x at n, n+1 (accepted), redo from n+2. Must equal a
  # cache that saw x[:2] and never x[2:].
  _, spec = _decode(model, params, x, _pos(n, 4), base)
  z = dec[:, n + 2:n + 6]
  lz_after, _ = _decode(model, params, z, _pos(n + 2, 4), spec)
  # Bitwise reference with the same k=4 call: x's last two positions are -1.
  pad_pos = jnp.concatenate([_pos(n, 2), jnp.full((B, 2), -1, jnp.int32)], 1)
  _, c4 = _decode(model, params, x, pad_pos, base)
  lz_clean, _ = _decode(model, params, z, _pos(n + 2, 4), c4)
  np.testing.assert_array_equal(np.asarray(lz_after), np.asarray(lz_clean))


def test_stale_cache_entries_never_change_logits(tiny_target):
  model, params = tiny_target
  dec = _dec_inputs()
  n = 5
  _, cache = _prefill(model, params, dec, n)
  rng = np.random.RandomState(3)

  def garbage(c):
    g = rng.normal(0, 1e3, size=c.shape).astype(np.float32)
    keep = (np.arange(c.shape[1]) < n)[None, :, None, None]
    return jnp.asarray(np.where(keep, np.asarray(c), g))

  dirty = cache.replace(self_k=tuple(garbage(c) for c in cache.self_k),
                        self_v=tuple(garbage(c) for c in cache.self_v))
  assert not np.array_equal(np.asarray(dirty.self_k[0]), np.asarray(cache.self_k[0]))
  for k in (1, 3):
    clean_lg, _ = _decode(model, params, dec[:, n:n + k], _pos(n, k), cache)
    dirty_lg, _ = _decode(model, params, dec[:, n:n + k], _pos(n, k), dirty)
    np.testing.assert_allclose(dirty_lg, clean_lg, atol=1e-6, rtol=1e-6)


def test_negative_position_writes_nothing(tiny_target):
  model, params = tiny_target
  dec = _dec_inputs()
  n = 3
  _, cache = _prefill(model, params, dec, n)
  # Row 0 writes at n with two padding slots; row 1 writes nothing at all.
  pos = jnp.array([[n, -1, -1], [-1, -1, -1]], jnp.int32)
  _, after = _decode(model, params, dec[:, n:n + 3], pos, cache)
  for a, b in zip(after.self_k + after.self_v, cache.self_k + cache.self_v):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(a[1], b[1])                 # row 1 untouched
    np.testing.assert_array_equal(a[0, :n], b[0, :n])         # prefix untouched
    np.testing.assert_array_equal(a[0, n + 1:], b[0, n + 1:])  # incl. slot L-1 (no wrap)
    assert np.all(a[0, L - 1] == 0)
    assert not np.array_equal(a[0, n], b[0, n])               # the real write happened
  # And the real write equals a plain k=1 write at n.
  _, ref = _decode(model, params, dec[:, n:n + 1], _pos(n, 1), cache)
  np.testing.assert_allclose(after.self_k[0][0, n], ref.self_k[0][0, n], atol=1e-6)


def test_decode_without_writing_then_write_rows_equals_decode(tiny_target):
  """``decode(write=False)`` (cache only read: attention over the committed prefix and
  the new tokens as two key blocks) + ``write_rows`` == ``decode``, with rows
  at different positions and garbage in the cache past each row's prefix (a
  read-only pass must not see the stale rows that ``decode`` overwrites)."""
  model, params = tiny_target
  dec = _dec_inputs()
  _, cache = _prefill(model, params, dec, 7)
  rng = np.random.RandomState(4)
  starts = np.array([4, 6])        # row 0 re-verifies from 4: rows 4..6 are stale
  dirty = lambda c: jnp.asarray(np.where(
      (np.arange(c.shape[1])[None, :] < starts[:, None])[:, :, None, None], np.asarray(c),
      rng.normal(0, 1e3, size=c.shape).astype(np.float32)))
  cache = cache.replace(self_k=tuple(dirty(c) for c in cache.self_k),
                        self_v=tuple(dirty(c) for c in cache.self_v))
  k = 3
  pos = _pos(starts, k)
  toks = jnp.stack([dec[0, 4:4 + k], dec[1, 6:6 + k]])
  ref_lg, ref_cache = _decode(model, params, toks, pos, cache)
  rows_fn = jax.jit(functools.partial(model.decode, write=False))
  lg, rows = rows_fn(params, toks, pos, cache)
  np.testing.assert_allclose(lg, ref_lg, atol=2e-5, rtol=1e-5)
  # Padding positions (-1) write nothing; the real rows land where decode put them.
  pad = lambda r: jnp.pad(r, ((0, 0), (0, 2), (0, 0), (0, 0)))
  written = T5Model.write_rows(cache, jax.tree.map(pad, rows),
                               jnp.pad(pos, ((0, 0), (0, 2)), constant_values=-1))
  for a, b in zip(written.self_k + written.self_v, ref_cache.self_k + ref_cache.self_v):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)
  # The rows differ from the stale ones they replace (the check can fail).
  assert not np.allclose(np.asarray(rows[0][0])[0], np.asarray(cache.self_k[0])[0, 4:7])


# ------------------------------------------------------ bf16


def test_bf16_activations_close_to_f32(tiny_target):
  model, params = tiny_target
  m16 = T5Model(model.config.replace(dtype="bfloat16"))
  dec = _dec_inputs()
  full32 = _forward(model, params, _inputs(), dec)[:, :9]
  full16 = _forward(m16, params, _inputs(), dec)[:, :9]
  assert full16.dtype == jnp.float32
  scale = float(jnp.max(jnp.abs(full32)))
  err = float(jnp.max(jnp.abs(full16 - full32)))
  assert 0 < err < 0.05 * scale, (err, scale)  # bf16 has ~3 significant digits
  # Cached bf16 decode: cache in bf16, logits f32, close to the bf16 forward.
  cache = empty_cache(m16, params, _inputs())
  assert cache.self_k[0].dtype == jnp.bfloat16
  lg, cache = _decode(m16, params, dec[:, :3], _pos(0, 3), cache)
  assert lg.dtype == jnp.float32
  np.testing.assert_allclose(lg, full16[:, :3], atol=0.05 * scale)
  # Greedy choices mostly agree with f32 (sharpened logits => clear margins).
  agree = float(jnp.mean(jnp.argmax(full16, -1) == jnp.argmax(full32, -1)))
  assert agree >= 0.8, agree


# ------------------------------------------------------ presets / relpos / long


def test_preset_param_counts():
  # Same as the released T5 1.1 checkpoints (HF google/t5-v1_1-{small,base}).
  assert count_params(param_shapes(PRESETS["t5_1_1_small"])) == 76_961_152
  assert count_params(param_shapes(PRESETS["t5_1_1_base"])) == 247_577_856
  shapes = param_shapes(PRESETS["t5_1_1_base"])
  assert shapes["decoder"]["logits_dense"]["kernel"].shape == (768, 32128)
  assert shapes["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"].shape == (768, 2048)


def test_relative_position_buckets():
  # relative_position = key - query. Values computed by hand from
  # max_exact + int(log(n / max_exact) / log(128 / max_exact) * (nb - max_exact)).
  # Causal (32 buckets, max_exact 16): keys after the query -> bucket 0;
  # n=16 -> 16; n=32 -> 16 + int(16/3)=21; n=64 -> 16 + int(32/3)=26;
  # n=127 -> 16 + int(15.94)=31; n>=128 -> 31 (clipped).
  rel = jnp.array([0, -1, -5, -15, -16, -32, -64, -127, -128, -1000, 3], jnp.int32)
  got = jax.jit(relative_position_bucket, static_argnums=1)(rel, False)
  np.testing.assert_array_equal(got, [0, 1, 5, 15, 16, 21, 26, 31, 31, 31, 0])
  # Bidirectional (16 buckets per side, max_exact 8; keys after the query +16):
  # n=16 -> 8 + int(8 * log2 / log16)=10; 32 -> 12; 64 -> 14; 127 -> 15.
  rel = jnp.array([0, -3, 3, -7, -8, -16, -32, -64, -127, -500, 8, 16, 32, 127, 500],
                  jnp.int32)
  got = jax.jit(relative_position_bucket, static_argnums=1)(rel, True)
  np.testing.assert_array_equal(got, [0, 3, 19, 7, 8, 10, 12, 14, 15, 15, 24, 26, 28, 31, 31])


def test_decoder_positions_beyond_128(tiny_target):
  model, params = tiny_target
  t, n = L, L - 4
  dec = _dec_inputs(seed=5)
  full = _forward(model, params, _inputs(), dec)
  cache = empty_cache(model, params, _inputs())
  for s in range(0, n, 4):  # prefill 4 tokens per call
    _, cache = _decode(model, params, dec[:, s:s + 4], _pos(s, 4), cache)
  lg, _ = _decode(model, params, dec[:, n:t], _pos(n, t - n), cache)
  assert bool(jnp.all(jnp.isfinite(lg)))
  np.testing.assert_allclose(lg, full[:, n:t], atol=1e-4, rtol=1e-4)
