"""The fused Pallas decoder kernels (``specdec_jax.kernels``) against the XLA
path of ``models.t5``, in Pallas interpret mode on the CPU.

* per kernel and per layer: the products (norm, q/k/v, gated-GELU, ReLU,
  residual, the embedding's transposed product), self-attention with its
  cache write (negative positions dropped) and cross-attention, and one
  whole decoder layer, against the XLA modules;
* per decode call (T5 1.1 and 1.0): logits and caches at batch 3 with
  per-row positions, a padded row (-1) included, float32 to 1e-5 and
  bfloat16 to ``BF16_ATOL``;
* one position and k positions: a (γ+1)-position pass and γ+1 one-position
  steps give bit-for-bit equal logits and caches (float32 and bfloat16);
* what falls back (teacher forcing, ``decode(write=False)``, trees) equals the XLA
  path bit for bit, and quantized kernels are refused;
* speculative decoding at T = 0 with the kernels on for target and draft
  equals the baseline token for token (bfloat16);
* the kernels lower to Triton for CUDA without a GPU (``jax.export``), 6 per
  layer + 1 for the logits at a T5-small-sized shape.

Interpret mode compiles slowly, so the shapes are tiny and most tests are in
the slow tier.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from exactness_cases import noisy
from lab.common import cast_params
from specdec_jax import drafts, kernels, quantization
from specdec_jax.decoding import speculative_decode, temperature_sample
from specdec_jax.models import t5
from specdec_jax.models.t5 import T5Config, T5Model
from specdec_jax.tree import TreeShape

# The smallest model the kernels cover: head_dim >= 16, sizes multiples of 16.
CFG = T5Config(vocab_size=64, d_model=32, num_heads=2, head_dim=16, num_encoder_layers=1,
               num_decoder_layers=2, d_ff=48)
CACHE_LEN = 24
# Batch 3 (the kernels pad it to 4 rows of 16 queries).
INPUTS = (jax.random.randint(jax.random.PRNGKey(1), (3, 16), 2, 64).astype(jnp.int32)
          .at[1, 11:].set(0))                   # row 1: 11 real encoder positions
TOKENS = jax.random.randint(jax.random.PRNGKey(2), (3, 8), 2, 64).astype(jnp.int32)
# Call 1 fills slots 0..3 (row 1 only 0..2: its last position is padding);
# call 2 continues rows 0 and 2 at 4 and rolls row 1 back to 2 (overwriting a
# slot); call 3 is a one-position step.
POS1 = jnp.array([[0, 1, 2, 3], [0, 1, 2, -1], [0, 1, 2, 3]], jnp.int32)
POS2 = jnp.array([[4, 5, 6, 7], [2, 3, 4, 5], [4, 5, 6, 7]], jnp.int32)
POS3 = jnp.array([[8], [6], [8]], jnp.int32)
# bfloat16 activations: differences from the XLA path come from sums in
# another order rounded to bf16's 8 bits (measured max ~0.03 on these logits).
BF16_ATOL = 0.1


def _models(version: str = "1.1", dtype: str = "float32"):
  cfg = CFG.replace(version=version, dtype=dtype)
  return T5Model(cfg), T5Model(cfg.replace(decode_kernel="pallas"))


@functools.lru_cache(maxsize=None)
def _setup(version: str = "1.1", dtype: str = "float32"):
  """(xla model, pallas model, params, empty cache) shared by the tests."""
  xla, pallas = _models(version, dtype)
  params = xla.init(jax.random.PRNGKey(0), input_len=16)
  cache = xla.init_cache(params, xla.encode(params, INPUTS), INPUTS, CACHE_LEN)
  return xla, pallas, params, cache


@functools.lru_cache(maxsize=None)
def _decode(model: T5Model):
  return jax.jit(model.decode)


def _valid(logits, positions):
  return np.asarray(logits, np.float32)[np.asarray(positions) >= 0]


# ------------------------------------------------------------------ kernels


@pytest.mark.slow
def test_products_match_the_xla_modules():
  """Norm + q/k/v (three outputs), gated-GELU and ReLU MLP inputs, output
  product + residual, and T5 1.0's logits through the embedding, each one
  kernel, against the flax modules of models.t5 (float32)."""
  _, _, params, _ = _setup()
  p = params["decoder"]["layers_0"]
  sa, mlp, emb = p["self_attention"], p["mlp"], params["token_embedder"]["embedding"]
  rows = 32
  x = jax.random.normal(jax.random.PRNGKey(3), (rows, CFG.d_model), jnp.float32)
  res = jax.random.normal(jax.random.PRNGKey(4), (rows, CFG.d_model), jnp.float32)
  dt = jnp.float32

  @jax.jit
  def products(x, res):
    run = functools.partial(kernels.rows_product, dtype=dt)
    return (run(x, [sa[n]["kernel"] for n in ("query", "key", "value")],
                norm_scale=p["pre_self_attention_layer_norm"]["scale"])
            + run(x, [sa["out"]["kernel"]], residual=res)
            + run(x, [mlp["wi_0"]["kernel"], mlp["wi_1"]["kernel"]], act="gated",
                  norm_scale=p["pre_mlp_layer_norm"]["scale"])
            + run(x, [mlp["wi_0"]["kernel"]], act="relu")
            + run(x, [emb], transpose=True, divisor=8.0))

  norm = lambda s: t5.RMSNorm(CFG.layer_norm_epsilon, dt).apply({"params": s}, x)
  att = t5.Attention(CFG.num_heads, CFG.head_dim, CFG.d_model, dt)
  h = norm(p["pre_self_attention_layer_norm"])
  want_q = att.apply({"params": sa}, h, method=t5.Attention.project_q).reshape(rows, -1)
  want_k, want_v = (w.reshape(rows, -1)
                    for w in att.apply({"params": sa}, h, method=t5.Attention.project_kv))
  g = norm(p["pre_mlp_layer_norm"])
  # The MLP's first half as models.t5.MLP computes it (tanh-approximated gelu).
  gated = jax.nn.gelu(g @ mlp["wi_0"]["kernel"], approximate=True) * (g @ mlp["wi_1"]["kernel"])
  want = [want_q, want_k, want_v, res + x @ sa["out"]["kernel"], gated,
          jax.nn.relu(x @ mlp["wi_0"]["kernel"]), x @ emb.T / 8.0]
  got = products(x, res)
  assert len(got) == len(want)
  for g_, w_ in zip(got, want):
    np.testing.assert_allclose(g_, w_, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_attention_writes_the_cache_and_matches_xla():
  """RMSNorm + q/k/v products + self-attention over the cache with the
  call's rows written at their positions (a negative one dropped), and RMSNorm
  + query product + cross-attention under an encoder mask, each one kernel,
  against the XLA modules over the cache written by models.t5._write."""
  _, _, params, _ = _setup()
  p = params["decoder"]["layers_0"]
  sa, scale = p["self_attention"], p["pre_self_attention_layer_norm"]
  b, h, dh, nq, d = 2, CFG.num_heads, CFG.head_dim, kernels.QUERY_BLOCK, CFG.d_model
  key = jax.random.split(jax.random.PRNGKey(5), 4)
  kc = jax.random.normal(key[0], (b, CACHE_LEN, h, dh))
  vc = jax.random.normal(key[1], (b, CACHE_LEN, h, dh))
  x = jax.random.normal(key[2], (b * nq, d))
  pos = jnp.full((b, nq), -1, jnp.int32).at[:, :3].set(jnp.array([[5, 6, 7], [0, -1, 23]]))
  bias = jax.random.normal(key[3], (b, h, nq, CACHE_LEN))
  att = jax.jit(functools.partial(kernels.attention, dtype=jnp.float32))
  out, k2, v2 = att(x, scale["scale"], sa["query"]["kernel"], kc, vc,
                    w_k=sa["key"]["kernel"], w_v=sa["value"]["kernel"], positions=pos,
                    bias=bias)
  xla = t5.Attention(h, dh, d, jnp.float32)
  hx = t5.RMSNorm(CFG.layer_norm_epsilon, jnp.float32).apply({"params": scale}, x)
  hx = hx.reshape(b, nq, d)
  q = xla.apply({"params": sa}, hx, method=t5.Attention.project_q)
  kn, vn = xla.apply({"params": sa}, hx, method=t5.Attention.project_kv)
  want_k, want_v = t5._write(kc, kn, pos), t5._write(vc, vn, pos)
  np.testing.assert_allclose(k2, want_k, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(v2, want_v, rtol=1e-5, atol=1e-6)
  untouched = np.ones((b, CACHE_LEN), bool)
  untouched[0, 5:8] = untouched[1, 0] = untouched[1, 23] = False
  np.testing.assert_array_equal(np.asarray(k2)[untouched], np.asarray(kc)[untouched])
  mask = (jnp.arange(CACHE_LEN)[None, None, :] <= pos[:, :, None])[:, None]
  # attend's dots only (its output product is the out kernel's business).
  ident = {"params": {"out": {"kernel": jnp.eye(h * dh)}}}
  want = xla.apply(ident, q, want_k, want_v, mask, bias, method=t5.Attention.attend)
  real = np.asarray(pos) >= 0
  np.testing.assert_allclose(np.asarray(out).reshape(b, nq, -1)[real],
                             np.asarray(want)[real], rtol=1e-5, atol=1e-5)
  ca, cscale = p["encoder_decoder_attention"], p["pre_cross_attention_layer_norm"]
  visible = jnp.ones((b, CACHE_LEN), bool).at[1, 9:].set(False)   # row 1: 9 encoder positions
  out = att(x, cscale["scale"], ca["query"]["kernel"], kc, vc,
            key_mask=visible.astype(jnp.int32))
  hx = t5.RMSNorm(CFG.layer_norm_epsilon, jnp.float32).apply({"params": cscale}, x)
  q = xla.apply({"params": ca}, hx.reshape(b, nq, d), method=t5.Attention.project_q)
  want = xla.apply(ident, q, kc, vc, visible[:, None, None, :], None,
                   method=t5.Attention.attend)
  np.testing.assert_allclose(np.asarray(out).reshape(b, nq, -1), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ layers and calls


@pytest.mark.slow
def test_layer_matches_the_xla_layer():
  """One decoder layer in its 6 kernels (kernels.layer) against
  models.t5.DecoderLayer with the same cache, positions and bias (float32)."""
  xla, _, params, cache = _setup()
  b, nq, d = 3, kernels.QUERY_BLOCK, CFG.d_model
  x = jax.random.normal(jax.random.PRNGKey(6), (b, 4, d))
  pos = POS1
  dec = params["decoder"]
  rel = t5.RelativePositionBias(CFG.num_heads, False)
  slot = jnp.broadcast_to(jnp.arange(CACHE_LEN), (b, CACHE_LEN))
  bias = rel.apply({"params": dec["relpos_bias"]}, pos, slot)
  mask = (slot[:, None, :] <= pos[:, :, None])[:, None]
  enc = cache.encoder_mask
  want_x, want_k, want_v = t5.DecoderLayer(CFG).apply(
      {"params": dec["layers_0"]}, x, pos, mask, bias, cache.self_k[0], cache.self_v[0],
      cache.cross_k[0], cache.cross_v[0], enc[:, None, None, :])
  pad = lambda a, v: jnp.pad(a, ((0, 0), (0, nq - a.shape[1])) + ((0, 0),) * (a.ndim - 2),
                             constant_values=v)
  pos16 = pad(pos, -1)
  bias16 = rel.apply({"params": dec["relpos_bias"]}, pos16, slot)
  got_x, got_k, got_v = jax.jit(functools.partial(kernels.layer, CFG))(
      # Rows for 4 batch rows (a power of two); the fourth is padding.
      dec["layers_0"], jnp.pad(pad(x, 0).reshape(b * nq, d), ((0, nq), (0, 0))), pos16, bias16,
      cache.self_k[0],
      cache.self_v[0], cache.cross_k[0], cache.cross_v[0], enc.astype(jnp.int32))
  real = np.asarray(pos) >= 0
  np.testing.assert_allclose(np.asarray(got_x)[:b * nq].reshape(b, nq, d)[:, :4][real],
                             np.asarray(want_x)[real], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_k, want_k, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_v, want_v, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("version,dtype", [("1.1", "float32"), ("1.0", "float32"),
                                           ("1.1", "bfloat16")])
def test_decode_matches_xla(version, dtype):
  """Three chained decode calls (k = 4, 4 and 1; batch 3, per-row positions,
  a padded -1, a rollback that overwrites a slot): logits at the real positions and
  every cache slot as the XLA path's; float32 to 1e-5, bfloat16 to BF16_ATOL
  (logits) and one bf16 ulp of the cache entries' scale."""
  xla, pallas, params, cache = _setup(version, dtype)
  atol = 1e-5 if dtype == "float32" else BF16_ATOL
  caches = {}
  for name, model in (("xla", xla), ("pallas", pallas)):
    c = cache
    logits = []
    for pos, toks in ((POS1, TOKENS[:, :4]), (POS2, TOKENS[:, 4:]), (POS3, TOKENS[:, :1])):
      l, c = _decode(model)(params, toks, pos, c)
      logits.append(_valid(l, pos))
    caches[name] = (logits, c)
  (lx, cx), (lp, cp) = caches["xla"], caches["pallas"]
  for a, b in zip(lx, lp):
    np.testing.assert_allclose(b, a, rtol=1e-5 if dtype == "float32" else 0.05, atol=atol)
  for a, b in zip(cx.self_k + cx.self_v, cp.self_k + cp.self_v):
    np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32),
                               rtol=1e-5 if dtype == "float32" else 1e-2, atol=atol)
  # Row 1 ends at position 6: nothing was written after it.
  assert not np.asarray(cp.self_k[0][1, 7:], np.float32).any()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_position_equals_k_positions_bitwise(dtype):
  """The kernels' tiling does not depend on k: a (γ+1)-position pass (k = 4)
  gives each position the very logits (and cache rows) of one-position steps
  after the same prefix, bit for bit, per row (batch 3, rows at different
  positions, one rolled back). The XLA path does not have this property
  (float32 on the CPU: these logits differ in the last bits)."""
  _, pallas, params, cache = _setup("1.1", dtype)
  dec = _decode(pallas)
  _, c0 = dec(params, TOKENS[:, :4], POS1, cache)
  toks = TOKENS[:, 4:]
  pass_logits, pass_cache = dec(params, toks, POS2, c0)
  c = c0
  for j in range(4):
    step_logits, c = dec(params, toks[:, j:j + 1], POS2[:, j:j + 1], c)
    np.testing.assert_array_equal(np.asarray(step_logits[:, 0]), np.asarray(pass_logits[:, j]))
  for a, b in zip(c.self_k + c.self_v, pass_cache.self_k + pass_cache.self_v):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ what falls back


@pytest.mark.slow
def test_uncovered_calls_fall_back_to_xla_and_quantized_is_refused():
  """Teacher forcing, ``decode(write=False)`` and a tree pass with
  decode_kernel='pallas' are the XLA path's results bit for bit; k > 16 too;
  quantized kernels are refused with a clear error."""
  xla, pallas, params, cache = _setup()
  dec_in = TOKENS[:, :4]
  for run in (lambda m: m(params, INPUTS, dec_in),
              lambda m: m.decode(params, dec_in, POS1.at[1, 3].set(3), cache, write=False)[0],
              lambda m: m.decode_tree(params, dec_in[:, :3], jnp.array([2, 3, 1], jnp.int32),
                                      TreeShape.parse("full:2"), cache)[0]):
    np.testing.assert_array_equal(np.asarray(run(pallas)), np.asarray(run(xla)))
  assert not kernels.covers(CFG, 2, 17, cache, True, None, False)
  assert not kernels.covers(CFG, 9, 1, cache, True, None, False)
  assert kernels.covers(CFG, 8, 16, cache, True, None, False)
  qparams = quantization.quantize_params(params, "int8")
  with pytest.raises(ValueError, match="does not cover quantized kernels"):
    pallas.decode(qparams, dec_in, POS1, cache)


def test_the_setting_reaches_both_models_and_is_checked():
  """Experiment.decode_kernel: validated, refused on a mesh and with a
  quantized draft, and set on both loaded models (as min_rows)."""
  from specdec_jax.run.settings import Experiment
  with pytest.raises(ValueError, match=r"^Experiment.decode_kernel must be one of"):
    Experiment(decode_kernel="triton").pair.check_values()
  with pytest.raises(ValueError, match=r"runs on one device"):
    Experiment(decode_kernel="pallas", mesh_shape=(1, 1)).pair.check_values()
  with pytest.raises(ValueError, match=r"does not cover quantized"):
    Experiment(decode_kernel="pallas", draft_quantization="int8").pair.check_values()
  with pytest.raises(ValueError, match=r"T5Config.decode_kernel must be one of"):
    CFG.replace(decode_kernel="cuda")
  demo = Experiment(target_checkpoint="checkpoints/demo/target",
                    draft_checkpoint="checkpoints/demo/draft_small",
                    vocab_path="checkpoints/demo/spm.model", decode_kernel="pallas")
  for role in ("target", "draft"):
    assert demo.pair.load(role)[0].config.decode_kernel == "pallas"


# ------------------------------------------------------------------ the engine


@pytest.mark.slow
def test_greedy_speculative_equals_baseline_with_kernels(monkeypatch):
  """T = 0, bfloat16, the kernels on for target and draft (a noisy copy of
  the target, α < 1 so that rounds end by rejection): speculative decoding
  (γ = 3) emits the baseline's tokens, token for token, at batch 4."""
  calls = []
  real = kernels.decode
  monkeypatch.setattr(kernels, "decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
  cfg = CFG.replace(dtype="bfloat16", decode_kernel="pallas")
  target = T5Model(cfg)
  params = target.init(jax.random.PRNGKey(0), input_len=16)
  draft = drafts.T5Draft(params=noisy(params, 0.2), model=target)
  inputs = jnp.pad(jax.random.randint(jax.random.PRNGKey(1), (4, 12), 2, 64), ((0, 0), (0, 4)))
  key, max_len = jax.random.PRNGKey(0), 20
  base = temperature_sample(target, params, inputs, key, max_decode_len=max_len, eos_id=-1)
  out = speculative_decode(target, params, draft, inputs, key, gamma=3, max_decode_len=max_len,
                           eos_id=-1)
  assert len(calls) >= 3  # baseline step, draft step, target pass: all on the kernels
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(base.tokens))
  st = jax.tree_util.tree_map(np.asarray, out.stats)
  assert 0 < st.accepted.sum() < 3 * st.target_calls.sum()  # rejections happened


# ------------------------------------------------------------------ GPU lowering


@pytest.mark.parametrize("version", ["1.1", pytest.param("1.0", marks=pytest.mark.slow)])
def test_kernels_lower_to_triton_for_cuda(monkeypatch, version):
  """Without a GPU: a T5-small-sized decoder (2 of its layers, bfloat16,
  batch 3, a 133-slot cache, 100 encoder positions) exports for CUDA with
  every kernel lowered to Triton, 6 per layer + 1 for the logits, for the
  one-position step and the 8-position pass."""
  monkeypatch.setattr(kernels.decode_layer, "interpret_mode", lambda interpret=None: False)
  preset = "t5_1_1_small" if version == "1.1" else "t5_small"
  cfg = t5.get_config(preset, num_decoder_layers=2, num_encoder_layers=1, dtype="bfloat16",
                      decode_kernel="pallas")
  model = T5Model(cfg)
  params = jax.eval_shape(lambda: cast_params(model.init(jax.random.PRNGKey(0)),
                                                  jnp.bfloat16))
  inputs = jax.ShapeDtypeStruct((3, 100), jnp.int32)
  cache = jax.eval_shape(lambda p, i: model.init_cache(p, model.encode(p, i), i, 133),
                         params, inputs)
  allow = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  for k in (1, 8):
    toks = jax.ShapeDtypeStruct((3, k), jnp.int32)
    exp = jax.export.export(jax.jit(model.decode), platforms=["cuda"],
                            disabled_checks=allow)(params, toks, toks, cache)
    names = re.findall(r'name = "(t5_\w+)"', exp.mlir_module())
    assert len(names) == 6 * 2 + 1, names
    assert names.count("t5_self_attention") == names.count("t5_cross_attention") == 2
