"""``T5Config.fused_projections``: self-attention's query/key/value and the
gated MLP's wi_0/wi_1 as one product each, from a T5X tree fused in memory
(``fuse_projections``). The same logits as the separate products (bit for
bit on the CPU: each output column is the same dot over the same weights),
also for a quantized kernel fused before quantizing; the settings that reach
it (``Experiment.fused_projections``) and the combinations it refuses."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.common import cast_params
from specdec_jax import quantization
from specdec_jax.models.t5 import T5Config, T5Model, fuse_projections, param_shapes
from specdec_jax.run.settings import Experiment

CFG = T5Config(vocab_size=64, d_model=32, num_heads=4, head_dim=8, num_encoder_layers=1,
               num_decoder_layers=2, d_ff=48)


@functools.partial(jax.jit, static_argnums=0)
def _logits(model, params, inputs, dec):
  """(teacher-forced logits [B, T, V], a one-token step's and a 3-position
  pass's logits from an empty cache)."""
  forced = model(params, inputs, dec)
  cache = model.init_cache(params, model.encode(params, inputs), inputs, 8)
  step, cache = model.decode(params, dec[:, :1], jnp.zeros((2, 1), jnp.int32), cache)
  pos = jnp.broadcast_to(jnp.arange(1, 4, dtype=jnp.int32), (2, 3))
  return forced, step, model.decode(params, dec[:, 1:4], pos, cache)[0]


@pytest.mark.parametrize("version,dtype,quant", [
    pytest.param("1.1", "float32", None, marks=pytest.mark.slow),
    pytest.param("1.0", "bfloat16", None, marks=pytest.mark.slow),
    pytest.param("1.1", "bfloat16", "int8", marks=pytest.mark.slow)])
def test_fused_logits_are_bit_equal(version, dtype, quant):
  cfg = CFG.replace(version=version, dtype=dtype)
  params = cast_params(T5Model(cfg).init(jax.random.PRNGKey(0)), dtype)
  fused = fuse_projections(params)
  if quant:  # fused before quantizing: per-output-column scales, so the same
    params, fused = (quantization.quantize_params(p, quant) for p in (params, fused))
  model, fused_model = T5Model(cfg), T5Model(cfg.replace(fused_projections=True))
  layer = fused["decoder"]["layers_0"]
  assert set(layer["self_attention"]) == {"qkv", "out"}
  assert set(layer["encoder_decoder_attention"]) == {"query", "key", "value", "out"}
  assert ("wi_fused" in layer["mlp"]) == (version == "1.1")
  inputs = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 2, 64)
  dec = jax.random.randint(jax.random.PRNGKey(2), (2, 6), 2, 64)
  for a, b in zip(_logits(model, params, inputs, dec), _logits(fused_model, fused, inputs, dec)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert float(jnp.abs(_logits(model, params, inputs, dec)[0]).max()) > 0


def test_fused_tree_has_the_fused_models_shapes():
  params = T5Model(CFG).init(jax.random.PRNGKey(0))
  shapes = param_shapes(CFG.replace(fused_projections=True))
  got = jax.tree.map(lambda x: x.shape, fuse_projections(params))
  assert got == jax.tree.map(lambda x: x.shape, shapes)
  with pytest.raises(ValueError, match="fuse before quantizing"):
    fuse_projections(quantization.quantize_params(params, "int8"))


def _exp(**kw):
  return Experiment(target_checkpoint="checkpoints/demo/target",
                    draft_checkpoint="checkpoints/demo/draft_small",
                    vocab_path="checkpoints/demo/spm.model", **kw)


def test_the_setting_fuses_both_loaded_models():
  pair = _exp(fused_projections=True).pair
  for role in ("target", "draft"):
    model, params = pair.load(role)
    assert model.config.fused_projections
    assert "qkv" in params["decoder"]["layers_0"]["self_attention"]


def test_the_setting_refuses_a_mesh_and_non_bools():
  with pytest.raises(ValueError, match=r"^Experiment.fused_projections runs on one device only"):
    _exp(fused_projections=True, mesh_shape=(1, 1)).pair.check_values()
  with pytest.raises(ValueError, match=r"^Experiment.fused_projections must be True or False"):
    dataclasses.replace(_exp(), fused_projections=1).pair.check_values()
