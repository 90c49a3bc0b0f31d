"""Sharded distillation (``DistillJob.mesh_shape``): the same job on one device
and on meshes (1, 8) and (2, 4) of 8 CPU devices (one subprocess,
tests/sharded_distill_worker.py), a sharded run stopped and resumed, the
target's weights as a jit argument of the train step, and bad settings refused
in one line before any weight is read (in this process, one device).

Tolerance. The meshes run the same arithmetic in another order: the target's
matmuls and softmax sums are split over 'model' and summed across devices, and
on (2, 4) each device takes the gradient of its half of the rows and GSPMD
adds the halves. Float32 addition is not associative, so per-step losses may
differ in the last bits (rtol 1e-5, about a hundred float32 ulps) and the
trained float32 params by at most 1e-5 (they are O(0.1); four Adafactor
steps). The exported draft is bfloat16: two float32 values that close may
round to neighbouring bfloat16 values, one bfloat16 ulp apart (rtol 2**-7).
A resumed run reruns the same compiled step on the same batches, so it equals
the uninterrupted one exactly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from specdec_jax import checkpoints, distill, partitioning, training
from specdec_jax.models.t5 import T5Config, T5Model, param_shapes

REPO = Path(__file__).resolve().parent.parent
MESHES = ("1x8", "2x4")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
  """tests/sharded_distill_worker.py's results (8 CPU devices, one subprocess)."""
  out = tmp_path_factory.mktemp("sharded_distill")
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, str(REPO / "tests" / "sharded_distill_worker.py"),
                        str(out)], env=env, capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  return json.loads((out / "report.json").read_text()), np.load(out / "params.npz")


def _losses(run: dict) -> np.ndarray:
  return np.array([[r["train_loss"], r["ce"], r["fkl"]] for r in run["log"]])


def _params(arrays, run: str, kind: str) -> dict:
  prefix = f"{run}/{kind}/"
  return {k[len(prefix):]: arrays[k] for k in arrays.files if k.startswith(prefix)}


def test_meshes_train_what_one_device_trains(sharded):
  """Same seed, data and steps: the target's outputs token for token, every
  step's losses, the trained and the exported draft within the tolerance above."""
  report, arrays = sharded
  runs = report["runs"]
  assert report["devices"] == 8
  single = runs["single"]
  assert single["steps"] == 4 and [r["step"] for r in single["log"]] == [1, 2, 3, 4]
  assert len(single["target_outputs"]) == 16
  for mesh in MESHES:
    assert runs[mesh]["target_outputs"] == single["target_outputs"], mesh
    np.testing.assert_allclose(_losses(runs[mesh]), _losses(single), rtol=1e-5, err_msg=mesh)
    for kind, tol in (("trained", dict(rtol=0, atol=1e-5)),
                      ("exported", dict(rtol=2**-7, atol=1e-6))):
      ref, got = _params(arrays, "single", kind), _params(arrays, mesh, kind)
      assert set(got) == set(ref) and len(ref) > 20
      for name in ref:
        np.testing.assert_allclose(got[name], ref[name], err_msg=f"{mesh} {kind} {name}",
                                   **tol)
  # The first step's loss is the untrained draft's: the same target outputs and
  # the same batch, so any mismatch would be in the sharded forward passes.
  assert single["log"][0]["train_loss"] > single["log"][-1]["train_loss"]


def test_weights_and_batches_are_placed_on_the_mesh(sharded):
  """The target is read into its shards (vocabulary over 'model'), the draft
  replicated, and each training batch split over 'data' (4 rows a device on
  (2, 4), all 8 on (1, 8), where 'data' has size 1)."""
  runs = sharded[0]["runs"]
  assert runs["single"]["placed"]["target"]["devices"] == 1
  for mesh, batch_spec, rows in (("1x8", "P(None, None)", [8]),
                                 ("2x4", "P('data', None)", [4])):
    placed = runs[mesh]["placed"]
    assert placed["target"] == {"spec": "P('model', None)", "dtype": "float32", "devices": 8}
    assert placed["draft"] == {"spec": "P(None, None)", "dtype": "float32", "devices": 8}
    assert placed["batch"] == {"spec": batch_spec, "shard_rows": rows}


def test_a_target_the_mesh_cannot_shard_is_one_line(sharded):
  """6 heads on (1, 8): refused from the config, naming the setting and the array."""
  message = sharded[0]["bad_dims"]
  assert message.startswith("mesh_shape=(1, 8) cannot shard the target (")
  assert "dimension 'heads' of size 6" in message and "\n" not in message


def test_resumed_sharded_run_equals_an_uninterrupted_one(sharded):
  """(2, 4) stopped after its first step (max_minutes=0) and resumed: the same
  losses and bitwise the same trained and exported draft."""
  report, arrays = sharded
  runs = report["runs"]
  assert runs["2x4_stopped"]["steps"] == 1
  resumed, whole = runs["2x4_resumed"], runs["2x4"]
  assert resumed["steps"] == 4
  strip = lambda log: [{k: v for k, v in r.items() if k != "wall_s"} for r in log]
  assert strip(resumed["log"]) == strip(whole["log"])
  assert resumed["target_outputs"] == whole["target_outputs"]
  for kind in ("trained", "exported"):
    a, b = _params(arrays, "2x4", kind), _params(arrays, "2x4_resumed", kind)
    for name in a:
      np.testing.assert_array_equal(b[name], a[name], err_msg=f"{kind} {name}")


# ---------------------------------------------------------------- in this process


def _random(cfg: T5Config, seed: int) -> dict:
  """Random weights of ``cfg``'s shapes (numpy: no initializer to compile)."""
  rng = np.random.default_rng(seed)
  return partitioning.unflatten_names({
      n: (rng.standard_normal(s.shape) / np.sqrt(s.shape[0])).astype(np.float32)
      for n, s in partitioning.flatten_names(param_shapes(cfg)).items()})


def test_train_step_takes_the_target_as_an_argument():
  """distill_loss + fit's step: the target's weights are arguments of the
  lowered program (their shapes in its signature), never constants baked into
  it; a loss that closes over them, as before, would embed them (the check
  sees that)."""
  target_cfg = T5Config(vocab_size=64, d_model=24, num_heads=2, head_dim=8, num_encoder_layers=1,
                        num_decoder_layers=1, d_ff=40)
  draft_cfg = target_cfg.replace(d_model=16, d_ff=32)
  target, draft = T5Model(target_cfg), T5Model(draft_cfg)
  tparams, dparams = (jax.tree.map(jax.numpy.asarray, _random(c, i))
                      for i, c in enumerate((target_cfg, draft_cfg)))
  opt = training.make_optimizer(training.OptimizerConfig("adafactor", 1e-3, 4))
  batch = {"inputs": np.ones((2, 8), np.int32), "targets": np.ones((2, 8), np.int32),
           "step_key": jax.random.PRNGKey(0)}
  loss = distill.distill_loss(draft, target, distill.DistillConfig("fkl"))
  step = training.make_train_step(loss, opt)
  text = step.lower(dparams, opt.init(dparams), batch, tparams).as_text()
  signature = text[text.index("func.func public @main"):].split("{\n", 1)[0]
  # The target's embedding, logits and MLP kernels (no draft array has these shapes).
  for shape in ("64x24", "24x64", "24x40", "40x24"):
    assert re.search(rf"%arg\d+: tensor<{shape}xf32>", signature), shape

  def baked(hlo: str) -> list[str]:
    """Constants that hold an array's values (not one value broadcast)."""
    return [m for m in re.findall(r"stablehlo\.constant dense<([^>]*)> : tensor<([\dx]+)x", hlo)
            if m[0].startswith(("[", '"0x'))
            and np.prod([int(d) for d in m[1].split("x")]) >= 64]

  assert baked(text) == []
  closed = lambda p, b: loss(p, b, tparams)
  old = training.make_train_step(closed, opt).lower(dparams, opt.init(dparams), batch,
                                                    None).as_text()
  assert any(shape == "24x64" for _, shape in baked(old))


REAL = dict(vocab_path=str(REPO / "checkpoints/demo/spm.model"),
            source=str(REPO / "data/bible/validation.tsv"))


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:
  """Micro checkpoints: a target and drafts of its vocabulary and of another."""
  root = tmp_path_factory.mktemp("micro")
  cfg = T5Config(vocab_size=8000, d_model=16, num_heads=2, head_dim=8, num_encoder_layers=1,
                 num_decoder_layers=1, d_ff=32)
  for name, c in (("target", cfg), ("draft", cfg.replace(d_model=8)),
                  ("draft_v64", cfg.replace(d_model=8, vocab_size=64))):
    checkpoints.save_checkpoint(str(root / name), _random(c, 0), c)
  return root


def _job(micro: Path, tmp_path: Path, **kw) -> distill.DistillJob:
  paths = dict(target_checkpoint=str(micro / "target"), draft_checkpoint=str(micro / "draft"),
               output_dir=str(tmp_path / "out"), workdir=str(tmp_path / "wd"), **REAL)
  return distill.DistillJob(**{**paths, **kw})


@pytest.fixture
def no_weights(monkeypatch):
  """Reading any weight fails the test."""
  def refuse(*args, **kwargs):
    raise AssertionError(f"a weight was read: load_checkpoint{args}")
  monkeypatch.setattr(checkpoints, "load_checkpoint", refuse)


@pytest.mark.parametrize("kw, message", [
    (dict(mesh_shape=(1, 2)), r"^mesh_shape \(1, 2\) has 2 devices but there are 1 \(cpu\)"),
    (dict(mesh_shape=(2, 1), generate_batch_size=3),
     r"^generate_batch_size=3 is not divisible by the 'data' axis of mesh_shape=\(2, 1\) \(2\)"),
    (dict(draft_checkpoint="draft_v64"),
     r"^target and draft vocabularies are incompatible .*vocab_size target=8000 != draft=64"),
    (dict(mesh_shape=(1, 0)), r"^mesh_shape must be None or two positive ints"),
    (dict(param_dtype="float8"), r"^param_dtype must be one of \('float32', 'bfloat16'\)"),
    (dict(logical_axis_rules=(("batch", "rows"),)), r"^logical_axis_rules: .*'rows'"),
])
def test_bad_settings_fail_in_one_line_before_any_weight(micro, tmp_path, no_weights, kw,
                                                         message):
  if "draft_checkpoint" in kw:
    kw["draft_checkpoint"] = str(micro / kw["draft_checkpoint"])
  with pytest.raises(ValueError) as e:
    distill.run_job(_job(micro, tmp_path, **kw), log_fn=lambda m: None)
  assert re.search(message, str(e.value)), str(e.value)
  assert "\n" not in str(e.value)
  assert not (tmp_path / "wd").exists()


def test_target_loads_at_param_dtype_into_its_shards_draft_in_float32(micro, tmp_path,
                                                                      monkeypatch):
  """mesh (1, 1), param_dtype='bfloat16': the target is read at bfloat16 (norms
  float32) with the target's rules, the draft at float32 replicated."""
  load, seen = checkpoints.load_checkpoint, []

  def spy(path, *args, **kwargs):
    params, config = load(path, *args, **kwargs)
    seen.append((os.path.basename(path), kwargs["partitioner"].rules, params))
    if len(seen) == 2:
      raise KeyboardInterrupt  # both loaded: nothing more to see
    return params, config

  monkeypatch.setattr(checkpoints, "load_checkpoint", spy)
  with pytest.raises(KeyboardInterrupt):
    distill.run_job(_job(micro, tmp_path, mesh_shape=(1, 1), param_dtype="bfloat16"),
                    log_fn=lambda m: None)
  (t_name, t_rules, tp), (d_name, d_rules, dp) = seen
  assert (t_name, d_name) == ("target", "draft")
  assert t_rules == distill.partitioning.STANDARD_RULES
  assert d_rules == distill.partitioning.DATA_PARALLEL_RULES
  assert tp["token_embedder"]["embedding"].dtype == np.dtype("bfloat16")
  assert tp["encoder"]["encoder_norm"]["scale"].dtype == np.float32
  assert {x.dtype for x in jax.tree.leaves(dp)} == {np.dtype("float32")}


def test_batch_rows_are_a_multiple_of_the_data_axis():
  """Training batches split evenly over 'data': rows per bucket rounded down to
  a multiple (batch_tokens stays a cap), one row per shard at least; the
  single-device rule is unchanged."""
  assert training.batch_rows(48, 4096) == 85
  assert training.batch_rows(48, 4096, 2) == 84
  assert training.batch_rows(48, 4096, 8) == 80
  assert training.batch_rows(512, 256, 4) == 4 and training.batch_rows(512, 256) == 1
  pairs = [([5] * n, [6] * n) for n in range(3, 40)]
  for batch in training.fixed_batches(pairs, 200, (16, 48), rows_multiple=4):
    assert batch["inputs"].shape[0] % 4 == 0


def test_script_passes_mesh_and_dtype(monkeypatch):
  import importlib.util
  spec = importlib.util.spec_from_file_location("distill_draft",
                                                REPO / "scripts" / "distill_draft.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  jobs = []
  monkeypatch.setattr(distill, "run_job", lambda job: jobs.append(job) or {})
  mod.main(["--target_checkpoint=checkpoints/demo/target",
            "--draft_checkpoint=checkpoints/demo/draft_small", "--output_dir=o", "--workdir=w",
            "--mesh_shape=1,8", "--param_dtype=bfloat16"])
  assert jobs[0].mesh_shape == (1, 8) and jobs[0].param_dtype == "bfloat16"
  with pytest.raises(SystemExit):
    mod.parser().parse_args(["--mesh_shape=1,x"])


def test_block_objective_trains_on_a_mesh_as_on_one_device(tmp_path):
  """The block objective (``DistillJob.block_size``: cut points, mask
  positions, the target's distributions at each) on one device and on a
  (2, 4) mesh of 8 CPU devices: the same losses (rtol 1e-5, as above), the
  same mask embedding, and agreement reported by block position."""
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, str(REPO / "tests" / "sharded_distill_worker.py"),
                        str(tmp_path), "block"], env=env, capture_output=True, text=True,
                       timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  runs = json.loads((tmp_path / "report.json").read_text())["runs"]
  one, mesh = runs["block_single"], runs["block_2x4"]
  losses = lambda run: np.array([r["train_loss"] for r in run["log"] if "train_loss" in r])
  assert len(losses(one)) >= 2
  np.testing.assert_allclose(losses(mesh), losses(one), rtol=1e-5)
  # bfloat16-rounded export of a trained (non-zero) mask: equal up to one ulp.
  assert np.abs(np.asarray(one["mask"])).max() > 0
  np.testing.assert_allclose(mesh["mask"], one["mask"], rtol=2 ** -7, atol=1e-6)
  assert len(one["after"]["greedy_by_position"]) == 3

