"""Sharding over a ('data', 'model') mesh: rules and errors in-process (one
device), decoding on 8 CPU devices in a subprocess (so the rest of the suite
keeps one device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specdec_jax import partitioning, run
from specdec_jax.models.t5 import PRESETS, param_shapes
from specdec_jax.partitioning import (Partitioner, PartitioningError, abstract_mesh,
                                      param_logical_axes)

REPO = Path(__file__).resolve().parent.parent


def test_every_t5_parameter_has_t5x_logical_axes():
  for preset in ("t5_1_1_small", "t5_small"):  # gated 1.1 and ReLU 1.0 trees
    flat = partitioning.flatten_names(param_shapes(PRESETS[preset]))
    for name, shape in flat.items():
      assert len(param_logical_axes(name)) == len(shape.shape), name
  assert param_logical_axes("encoder/layers_3/attention/query/kernel") == ("embed", "joined_kv")
  assert param_logical_axes("decoder/layers_0/encoder_decoder_attention/out/kernel") == (
      "joined_kv", "embed")
  assert param_logical_axes("decoder/layers_1/mlp/wi_1/kernel") == ("embed", "mlp")
  assert param_logical_axes("encoder/layers_1/mlp/wi/kernel") == ("embed", "mlp")
  assert param_logical_axes("decoder/layers_1/mlp/wo/kernel") == ("mlp", "embed")
  assert param_logical_axes("token_embedder/embedding") == ("vocab", "embed")
  assert param_logical_axes("decoder/logits_dense/kernel") == ("embed", "vocab")
  assert param_logical_axes("decoder/relpos_bias/rel_embedding") == ("heads", "relpos_buckets")
  assert param_logical_axes("decoder/decoder_norm/scale") == ("embed",)
  with pytest.raises(PartitioningError, match="no logical axis names"):
    param_logical_axes("decoder/mystery/bias")


def test_standard_rules_shard_xxl_on_model_and_batch_on_data():
  part = Partitioner(abstract_mesh((2, 4)))
  shard = lambda name, shape: part.param_sharding(name, shape).shard_shape(shape)
  # T5 1.1 XXL sizes: d 4096, 64 heads x 64, d_ff 10240, vocab 32128.
  assert shard("decoder/layers_0/self_attention/query/kernel", (4096, 4096)) == (4096, 1024)
  assert shard("decoder/layers_0/mlp/wo/kernel", (10240, 4096)) == (2560, 4096)
  assert shard("token_embedder/embedding", (32128, 4096)) == (8032, 4096)
  assert shard("decoder/decoder_norm/scale", (4096,)) == (4096,)
  cache = part.sharding(partitioning.CACHE_AXES, (32, 136, 64, 64), "cache")
  assert cache.shard_shape((32, 136, 64, 64)) == (16, 136, 16, 64)
  # A mesh axis is used once per array; size-1 axes are never named.
  assert Partitioner(abstract_mesh((1, 8))).spec(("batch", "heads"), (4, 8), "x") == \
      partitioning.PartitionSpec(None, "model")


# T5X's rules for 2-D parameter and activation sharding
# (standard_logical_axis_rules(activation_partitioning_dims=2,
# parameter_partitioning_dims=2)), written out: 'embed' appears twice, an
# ordered fallback from 'model' to 'data'.
T5X_2D_RULES = (("batch", "data"), ("vocab", "model"), ("mlp", "model"), ("heads", "model"),
                ("kv", None), ("joined_kv", "model"), ("embed", "model"), ("embed", "data"),
                ("relpos_buckets", None), ("abspos_buckets", None), ("length", None),
                ("layers", None), ("stack", None), ("mlp_activations", None))


def test_repeated_rules_are_ordered_fallbacks_as_in_t5x():
  part = Partitioner(abstract_mesh((2, 4)), rules=partitioning.validate_rules(T5X_2D_RULES))
  spec = lambda axes, shape: part.spec(axes, shape, "x")
  P = partitioning.PartitionSpec
  # 'mlp' takes 'model' first, so 'embed' falls back to 'data' (2-D weights).
  assert spec(("embed", "mlp"), (4096, 10240)) == P("data", "model")
  assert spec(("mlp", "embed"), (10240, 4096)) == P("model", "data")
  assert spec(("embed", "joined_kv"), (4096, 4096)) == P("data", "model")
  assert spec(("vocab", "embed"), (32128, 4096)) == P("model", "data")
  # Alone, 'embed' takes its first rule's axis; activations keep batch on 'data'.
  assert spec(("embed",), (4096,)) == P("model")
  assert spec(("batch", "length", "embed"), (8, 16, 4096)) == P("data", None, "model")
  # The last of the two rules alone (the old dict lookup) would have put
  # 'embed' on 'data' and clashed with 'batch'.
  assert spec(("batch", "embed"), (8, 4096)) == P("data", "model")
  # A None rule settles a dimension as replicated; later rules do not apply.
  first_none = Partitioner(abstract_mesh((2, 4)), rules=partitioning.validate_rules(
      (("embed", None), ("embed", "data"))))
  assert first_none.spec(("embed",), (4096,), "x") == P(None)


def test_non_divisible_dimension_errors_or_replicates_with_a_warning():
  part = Partitioner(abstract_mesh((1, 8)))
  with pytest.raises(PartitioningError, match=r"parameter encoder/relpos_bias/rel_embedding: "
                     r"dimension 'heads' of size 6 .* mesh axis 'model' of size 8"):
    part.param_sharding("encoder/relpos_bias/rel_embedding", (6, 32))
  lenient = Partitioner(abstract_mesh((1, 8)), fallback="replicate")
  assert lenient.param_sharding("encoder/relpos_bias/rel_embedding", (6, 32)).spec == \
      partitioning.PartitionSpec(None, None)
  with pytest.raises(PartitioningError, match="fallback must be one of"):
    Partitioner(abstract_mesh((1, 8)), fallback="pad")
  with pytest.raises(PartitioningError, match="mesh axis must be one of"):
    partitioning.validate_rules((("batch", "pipeline"),))


def test_mesh_shape_must_match_the_device_count():
  with pytest.raises(PartitioningError, match=r"mesh_shape \(1, 8\) has 8 devices but there "
                     r"are 1"):
    partitioning.make_mesh((1, 8))
  with pytest.raises(PartitioningError, match="two positive sizes"):
    partitioning.make_mesh((0, 1))
  assert partitioning.make_mesh((1, 1)).shape == {"data": 1, "model": 1}


def test_multihost_without_a_coordinator_or_a_cluster_is_refused():
  # No coordinator: JAX's own cluster detection runs, and finds none here.
  with pytest.raises(PartitioningError, match="found no cluster to join.*coordinator_address"):
    partitioning.initialize_multihost(None)
  with pytest.raises(PartitioningError, match="also needs num_processes"):
    partitioning.initialize_multihost("10.0.0.1:1234")


def _exp(**kw) -> run.Experiment:
  base = dict(target_checkpoint="checkpoints/demo/target",
              draft_checkpoint="checkpoints/demo/draft_small", batch_size=1, gamma=3)
  return run.Experiment(**{**base, **kw})


def test_runner_refuses_bad_meshes_before_reading_weights(monkeypatch):
  read = []
  monkeypatch.setattr(run.setup.checkpoints, "load_checkpoint", lambda *a, **k: read.append(a))
  with pytest.raises(ValueError, match=r"Experiment.mesh_shape: mesh_shape \(2, 4\) has 8 "
                     r"devices but there are 1"):
    run.prepare(_exp(mesh_shape=(2, 4)))
  with pytest.raises(ValueError, match="found no cluster to join"):
    run.prepare(_exp(multihost=True))
  with pytest.raises(ValueError, match="mesh_shape must be None or two positive ints"):
    _exp(mesh_shape=(8,)).validate()
  # The demo target has 4 heads: a model axis of 8 does not divide them.
  exp = _exp(mesh_shape=(1, 8))
  target, draft = (Partitioner(abstract_mesh((1, 8))),
                   Partitioner(abstract_mesh((1, 8)), partitioning.DATA_PARALLEL_RULES))
  with pytest.raises(ValueError, match=r"cannot shard the target .*relpos_bias/rel_embedding: "
                     r"dimension 'heads' of size 4"):
    run.setup.check_partitioning(exp, target, draft)
  # Batch 1 cannot be split over a data axis of 2.
  with pytest.raises(PartitioningError, match=r"dimension 'batch' of size 1 .* 'data' of size 2"):
    run.setup.check_partitioning(_exp(mesh_shape=(2, 2)), Partitioner(abstract_mesh((2, 2))), draft)
  run.setup.check_partitioning(_exp(mesh_shape=(1, 4)), Partitioner(abstract_mesh((1, 4))),
                         Partitioner(abstract_mesh((1, 4)), partitioning.DATA_PARALLEL_RULES))
  assert read == []


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
  """tests/sharded_decoding_worker.py's results (8 CPU devices, one subprocess)."""
  out = tmp_path_factory.mktemp("sharded")
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, str(REPO / "tests" / "sharded_decoding_worker.py"),
                        str(out)], env=env, capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  return np.load(out / "tokens.npz"), json.loads((out / "report.json").read_text())


def test_sharded_outputs_are_token_for_token_the_single_device_ones(sharded):
  """At T=0 and at T=1 (with top-p) with the same key: identical.

  Identical even when sampling because jax_threefry_partitionable (the default)
  makes random bits a function of the key and the array's global index, not
  of how it is laid out over devices.
  """
  tokens, report = sharded
  assert report["devices"] == 8
  names = [k for k in tokens.files if not k.startswith("single/")]
  assert {k.split("/")[0] for k in names} == {"1x8", "2x4", "8x1"}
  assert len(names) == 3 * (2 * 2 + 1)  # + a token tree at T = 0
  for name in names:
    _, sampling, loop = name.split("/")
    ref = tokens[f"single/{sampling}/{loop}"]
    assert (ref > 1).sum() > 50, "the reference decoded next to nothing"
    np.testing.assert_array_equal(tokens[name], ref, err_msg=name)
  # And the engine is exact on the mesh too: speculative == baseline at T=0.
  for mesh in ("1x8", "2x4", "8x1"):
    np.testing.assert_array_equal(tokens[f"{mesh}/t0/speculative"], tokens[f"{mesh}/t0/baseline"])
    np.testing.assert_array_equal(tokens[f"{mesh}/t0/tree"], tokens[f"{mesh}/t0/baseline"])
  # Different keys and temperatures do give different samples (not a constant output).
  assert not np.array_equal(tokens["single/t1_topp/baseline"], tokens["single/t0/baseline"])


def test_kernels_are_split_over_model_and_caches_over_heads(sharded):
  _, report = sharded
  for mesh, (data, model) in (("1x8", (1, 8)), ("2x4", (2, 4)), ("8x1", (8, 1))):
    params = report["meshes"][mesh]["params"]
    for name, p in params.items():
      axes = param_logical_axes(name)
      want = [n // model if (a in ("vocab", "mlp", "heads", "joined_kv") and model > 1) else n
              for a, n in zip(axes, p["shape"])]
      assert p["shard_shapes"] == [want], (mesh, name, p)
    wi = params["decoder/layers_0/mlp/wi_0/kernel"]
    assert wi["spec"] == (["None", "model"] if model > 1 else ["None", "None"])
    # Compiled loops: caches live only as per-device shards [B/data, L, H/model, dh];
    # the unsharded [8, L, 8, 4] never exists, and no weight is all-gathered.
    for loop, cache_len in (("baseline", 16), ("speculative", 20)):
      shapes = report["meshes"][mesh][loop]["f32_4d_shapes"]
      assert f"{8 // data},{cache_len},{8 // model},4" in shapes, (mesh, loop, shapes)
      assert f"{8 // data},12,{8 // model},4" in shapes  # cross K/V over 12 inputs
      if (data, model) != (1, 1):
        assert f"8,{cache_len},8,4" not in shapes, (mesh, loop)
      gathered = report["meshes"][mesh][loop]["all_gather_shapes"]
      full = {f"f32[{','.join(map(str, p['shape']))}]" for p in params.values()}
      assert not full & set(gathered), (mesh, loop, gathered)
      assert all(g.startswith("s32") for g in gathered), gathered  # token ids only


def test_runner_on_a_mesh_gives_the_single_device_outputs(tmp_path):
  """``python -m specdec_jax.run --config=configs/demo.gin`` on a (1, 4) mesh of
  4 CPU devices (the demo target's 4 heads divide 4, not 8): 0 mismatches and
  the same outputs, baseline and speculative, as the run on one device."""
  bindings = ["Experiment.num_warmup = 1", "Experiment.num_examples = 3",
              "Experiment.max_decode_len = 48", "Experiment.gamma = 3",
              # One input bucket for these three verses: bucketed, one program.
              "Experiment.input_buckets = (48,)"]
  records = {}
  for name, extra, devices in (("single", [], 1), ("mesh", ["Experiment.mesh_shape = (1, 4)"], 4)):
    cmd = [sys.executable, "-m", "specdec_jax.run", "--config=configs/demo.gin",
           f"--workdir={tmp_path / name}"] + [f"--gin_bindings={b}" for b in bindings + extra]
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                          + f" --xla_force_host_platform_device_count={devices}"))
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    records[name] = [json.loads(l) for l in (tmp_path / name / "examples.jsonl").read_text()
                     .splitlines()]
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["mismatches_vs_baseline"] == 0
    assert summary["mesh_shape"] == ([1, 4] if name == "mesh" else None)
  assert len(records["mesh"]) == 3
  for a, b in zip(records["single"], records["mesh"]):
    assert a["id"] == b["id"] and len(a["output"]) > 20
    assert (a["output"], a["baseline_output"]) == (b["output"], b["baseline_output"])
