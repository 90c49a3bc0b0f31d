"""Weight-only quantization of the draft (``specdec_jax.quantization``,
``Experiment.draft_quantization``): the stored layout, the rounding error, the
model computing with it, validation, memory accounting and the distillation
export's record. Exactness with a quantized draft is in the exactness matrix
(tests/test_exactness.py, tests/test_exactness_sampling.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("qwix", reason="the 'quant' extra (qwix) is not installed")

from specdec_jax import checkpoints, memory, quantization  # noqa: E402
from specdec_jax.distill import DistillJob, _export  # noqa: E402
from specdec_jax.drafts import shortlist  # noqa: E402
from specdec_jax.pair import ModelPair  # noqa: E402
from specdec_jax.partitioning import flatten_names  # noqa: E402
from specdec_jax.run.settings import Experiment  # noqa: E402

MODES = ("int8", "int4")


def _max_error(kernel, mode):
  """The largest rounding error per output column: half a step, where qwix's
  step is absmax / (the type's largest value + 1/2) (int8: 127.5, int4: 7.5)."""
  top = (127 if mode == "int8" else 7) + 0.5
  return np.max(np.abs(np.asarray(kernel, np.float32)), axis=0) / (2 * top)


def _dequantize_params(params, dtype=jnp.float32):
  """Every QArray of a tree as a float array at ``dtype`` (other leaves kept)."""
  return jax.tree.map(lambda x: quantization.dequantize(x, dtype) if quantization.is_qarray(x)
                      else x, params, is_leaf=quantization.is_qarray)


def _flat(params):
  return flatten_names(params, is_leaf=quantization.is_qarray)


@pytest.mark.parametrize("mode", MODES)
def test_kernels_are_stored_as_integers_with_per_channel_scales(tiny_draft, mode):
  """Every Dense kernel becomes integers of the mode's dtype plus one float32
  scale per output column; the embedding, norms and relative-position tables
  keep their dtype and values."""
  _, params = tiny_draft
  flat, qflat = _flat(params), _flat(quantization.quantize_params(params, mode))
  assert set(flat) == set(qflat)
  kernels = [n for n in flat if n.endswith("/kernel")]
  assert "decoder/logits_dense/kernel" in kernels and len(kernels) > 10
  for name, x in flat.items():
    q = qflat[name]
    if name in kernels:
      assert quantization.is_qarray(q)
      assert q.qvalue.dtype == jnp.dtype(mode) and q.qvalue.shape == x.shape
      assert q.scale.dtype == jnp.float32 and q.scale.shape == (1, x.shape[1])
    else:
      assert not quantization.is_qarray(q) and q.dtype == x.dtype
      np.testing.assert_array_equal(np.asarray(q), np.asarray(x))


@pytest.mark.parametrize("mode", MODES)
def test_dequantized_within_half_a_step_per_channel(tiny_draft, mode):
  """|dequantized - float| <= half the column's step (absmax / (2 (qmax + 1/2)))."""
  _, params = tiny_draft
  qflat = _flat(quantization.quantize_params(params, mode))
  for name, x in _flat(params).items():
    if name.endswith("/kernel"):
      err = np.abs(np.asarray(quantization.dequantize(qflat[name])) - np.asarray(x)).max(0)
      bound = _max_error(np.asarray(x), mode)
      assert np.all(err <= bound * (1 + 1e-5) + 1e-7), name
      assert err.max() > bound.max() / 10  # really rounded (not a float copy)


@pytest.mark.slow  # a compile of its own; the int8 exactness cells run the quantized draft
@pytest.mark.parametrize("mode", MODES)
def test_model_computes_with_the_quantized_kernels(tiny_draft, mode):
  """The model with quantized params equals the model with their dequantized
  float values (the product dequantizes inside), and differs from the float
  model by the rounding only."""
  model, params = tiny_draft
  qparams = quantization.quantize_params(params, mode)
  x = jnp.arange(2, 14, dtype=jnp.int32).reshape(2, 6)
  y = jnp.arange(3, 11, dtype=jnp.int32).reshape(2, 4)
  got = model(qparams, x, y)
  np.testing.assert_allclose(got, model(_dequantize_params(qparams), x, y),
                             rtol=1e-5, atol=1e-5)
  ref = model(params, x, y)
  assert 0 < float(jnp.abs(got - ref).max()) < (0.5 if mode == "int8" else 5.0)


def test_shortlist_columns_of_a_quantized_output_layer(tiny_draft):
  """A shortlisted draft reads only its columns of a quantized output layer."""
  model, params = tiny_draft
  qparams = quantization.quantize_params(params, "int8")
  ids = jnp.array([1, 5, 9])
  want = jnp.take(quantization.dequantize(qparams["decoder"]["logits_dense"]["kernel"]), ids,
                  axis=1)
  np.testing.assert_array_equal(shortlist.output_columns(model, qparams, ids), want)


def test_bad_values_and_drafts_without_weights_are_refused():
  with pytest.raises(ValueError, match=r"Experiment\.draft_quantization.*'int3'"):
    Experiment(draft_quantization="int3").validate()
  for name in ("bigram", "prompt_lookup"):
    with pytest.raises(ValueError, match=rf"Experiment\.draft_quantization='int8'.*{name}"):
      Experiment(draft_name=name, draft_checkpoint="",
                 draft_quantization="int8").validate()
  with pytest.raises(ValueError, match="export_quantization.*'fp8'"):
    DistillJob(target_checkpoint="t", draft_checkpoint="d", output_dir="o", workdir="w",
               export_quantization="fp8").validate(check_paths=False)


def test_memory_counts_integers_and_scales(tiny_draft):
  """memory.plan / step_weight_bytes: kernels at 1 (int8) or 1/2 (int4) byte
  per weight plus 4 bytes per output column; the rest as stored."""
  cfg = tiny_draft[0].config
  part = memory.planning_partitioner(None)
  flat = flatten_names(memory._param_shapes(cfg.replace(dtype="float32")))
  kern = [x.shape for n, x in flat.items() if n.endswith("/kernel")]
  rest = sum(4 * int(np.prod(x.shape)) for n, x in flat.items() if not n.endswith("/kernel"))
  n_weights, n_scales = sum(int(np.prod(s)) for s in kern), sum(s[1] for s in kern)
  f32 = memory.param_bytes(cfg, part, "float32")
  assert f32 == rest + 4 * n_weights
  assert memory.param_bytes(cfg, part, "float32", "int8") == rest + n_weights + 4 * n_scales
  assert memory.param_bytes(cfg, part, "float32", "int4") == rest + n_weights // 2 + 4 * n_scales
  plan = memory.plan(cfg, cfg, None, draft_quantization="int8", max_input_len=8,
                     max_decode_len=8)
  assert plan["draft_params"] == rest + n_weights + 4 * n_scales
  assert plan["target_params"] == f32
  assert (memory.step_weight_bytes(cfg, None, "bfloat16", "int8")
          < memory.step_weight_bytes(cfg, None, "bfloat16"))


def test_dry_run_layout_matches_the_plan(tiny_draft):
  """The dry run's abstract quantized params (``driver.abstract_params``) are
  the tree ``quantize_params`` makes, and weigh what memory.plan counts."""
  from specdec_jax.dryrun import driver
  model, params = tiny_draft
  cfg = model.config
  for mode in MODES:
    abstract = driver.abstract_params(cfg, None, "float32", jax.devices()[0], mode)
    real = quantization.quantize_params(params, mode)
    assert (jax.tree.structure(abstract) == jax.tree.structure(real))
    for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(real)):
      assert a.shape == r.shape and a.dtype == r.dtype
    assert driver.weight_bytes(abstract) == memory.param_bytes(
        cfg, memory.planning_partitioner(None), "float32", mode)


def test_export_records_quantization_and_the_runner_loads_it(tiny_draft, tmp_path):
  """A distillation export with ``export_quantization`` records it beside the
  weights; the runner's ModelPair then loads the draft quantized (and
  distillation, continuing it, in float); a contradicting binding is refused."""
  model, params = tiny_draft
  out = str(tmp_path / "distilled")
  job = DistillJob(target_checkpoint="t", draft_checkpoint="d", output_dir=out,
                   workdir=str(tmp_path / "w"), export_quantization="int8")
  _export(job, model.config, jax.tree.map(np.asarray, params), False, {"steps": 0})
  assert quantization.RECORD_FILE in {p.name for p in (tmp_path / "distilled").iterdir()}
  pair = ModelPair(draft_checkpoint=out)
  assert pair.quantization_of_draft() == "int8"
  _, loaded = pair.load("draft")
  kernel = loaded["decoder"]["logits_dense"]["kernel"]
  assert quantization.is_qarray(kernel) and kernel.qvalue.dtype == jnp.int8
  _, floats = pair.load("draft", quantize=False)
  assert not quantization.is_qarray(floats["decoder"]["logits_dense"]["kernel"])
  with pytest.raises(ValueError, match=r"draft_quantization='int4'.*'int8'"):
    ModelPair(draft_checkpoint=out, draft_quantization="int4",
              owner="Experiment").quantization_of_draft()
  # An export without the option leaves no record (and removes an old one).
  _export(DistillJob(target_checkpoint="t", draft_checkpoint="d", output_dir=out,
                     workdir=str(tmp_path / "w")), model.config,
          jax.tree.map(np.asarray, params), False, {"steps": 0})
  assert ModelPair(draft_checkpoint=out).quantization_of_draft() is None
  assert checkpoints.load_checkpoint(out)[1].d_model == model.config.d_model
