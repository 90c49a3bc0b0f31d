"""Draft distillation (specdec_jax.distill): divergences, target outputs on disk
and resume, and that distilling measurably raises α over the undistilled draft."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np

import pytest

from specdec_jax import distill, training
from specdec_jax.decoding import temperature_sample
from specdec_jax.models.t5 import T5Model

from conftest import TINY
from lab.evaluate import ce_loss


def test_divergences_match_definitions():
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(3, 11)), rng.normal(size=(3, 11))
  p, q = jax.nn.softmax(a), jax.nn.softmax(b)
  np.testing.assert_allclose(distill.token_divergence(a, b, "tv"),
                             0.5 * np.abs(p - q).sum(-1), rtol=1e-5)
  np.testing.assert_allclose(distill.token_divergence(a, b, "fkl"),
                             (p * (np.log(p) - np.log(q))).sum(-1), rtol=1e-5)
  np.testing.assert_allclose(distill.token_divergence(a, b, "rkl"),
                             (q * (np.log(q) - np.log(p))).sum(-1), rtol=1e-5)
  # TV = 1 - Σ min(p, q): the per-token rejection probability (paper Lemma 3.3).
  np.testing.assert_allclose(distill.token_divergence(a, b, "tv"),
                             1 - np.minimum(p, q).sum(-1), rtol=1e-5)
  assert float(jnp.max(distill.token_divergence(a, a, "fkl"))) < 1e-6


def test_bad_config_is_refused():
  with pytest.raises(ValueError, match="divergence must be one of"):
    distill.DistillConfig(divergence="js")
  with pytest.raises(ValueError, match="on_policy_fraction"):
    distill.DistillConfig(on_policy_fraction=1.5)


def _random_inputs(n: int, seed: int, vocab: int = TINY.vocab_size) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, size=int(rng.integers(3, 10))).tolist() + [1]
          for _ in range(n)]


def test_target_outputs_equal_baseline_and_resume(tiny_target, tmp_path):
  model, params = tiny_target
  inputs = _random_inputs(10, 1)
  path = str(tmp_path / "out.jsonl")
  got = distill.generate_target_outputs(model, params, inputs, path, max_decode_len=12,
                                        batch_size=4, buckets=(12,), log_fn=lambda m: None)
  # Each row equals the baseline's greedy decoding of that input alone.
  for i in (0, 7):
    x = np.zeros((1, 12), np.int32)
    x[0, :len(inputs[i])] = inputs[i]
    out = temperature_sample(model, params, jnp.asarray(x), jax.random.PRNGKey(0),
                             max_decode_len=12)
    assert got[(i, "greedy")] == np.asarray(out.tokens)[0, :int(out.length[0])].tolist()
  # Resume: a torn final line is redone, nothing else is regenerated.
  with open(path) as f:
    lines = f.readlines()
  with open(path, "w") as f:
    f.writelines(lines[:-1] + [lines[-1][:5]])
  msgs = []
  again = distill.generate_target_outputs(model, params, inputs, path, max_decode_len=12,
                                          batch_size=4, buckets=(12,), log_fn=msgs.append)
  assert again == got
  assert "1 chunks to generate" in msgs[0]
  # Outputs made under other settings are never reused.
  with pytest.raises(ValueError, match=r"other settings \(\['max_decode_len'\]"):
    distill.generate_target_outputs(model, params, inputs, path, max_decode_len=11,
                                    batch_size=4, buckets=(12,), log_fn=lambda m: None)
  # A corrupt middle line names the file and line.
  with open(path) as f:
    lines = f.readlines()
  lines[2] = "{not json\n"
  with open(path, "w") as f:
    f.writelines(lines)
  with pytest.raises(ValueError, match=r"out\.jsonl:3: corrupt"):
    distill.read_outputs(path)


def test_distillation_raises_alpha(tiny_target, tmp_path):
  """A random draft distilled (sequence-level CE + forward KL) toward a random
  target agrees with it far more on held-out inputs. Before: ~chance (greedy
  agreement 0.02 of two random models, vocab 64). The margins, +0.12 in greedy
  agreement and +0.1 in Σmin(p,q) over ~280 held-out positions, are over four
  binomial standard errors (≤ 0.025), so they cannot pass by chance (measured:
  +0.19 and +0.17); seeds are fixed."""
  target, target_params = tiny_target
  draft = T5Model(TINY.replace(num_encoder_layers=1, num_decoder_layers=1, d_model=16,
                               num_heads=2, d_ff=32))
  draft_params = draft.init(jax.random.PRNGKey(3))
  buckets = (12,)
  train_in, held_in = _random_inputs(128, 2), _random_inputs(48, 3)
  outs = distill.generate_target_outputs(target, target_params, train_in + held_in,
                                         str(tmp_path / "t.jsonl"), max_decode_len=12,
                                         batch_size=64, buckets=buckets, log_fn=lambda m: None)
  pairs = [(x, outs[(i, "greedy")]) for i, x in enumerate(train_in)]
  held = training.fixed_batches(
      [(x, outs[(128 + i, "greedy")]) for i, x in enumerate(held_in)], 12 * 48, buckets)
  before = distill.agreement(target, target_params, draft, draft_params, held)
  cfg = distill.DistillConfig("fkl", ce_weight=1.0)
  result = training.fit(
      distill.distill_loss(draft, target, cfg), draft_params,
      lambda s: training.batch_stream(pairs, 12 * 32, 0, s, buckets),
      training.OptimizerConfig("adamw", 1e-2, 150, warmup_steps=10), str(tmp_path / "fit"),
      eval_every=50, log_fn=lambda m: None, frozen=target_params)
  after = distill.agreement(target, target_params, draft, result.params, held)
  assert after["greedy_agreement"] > before["greedy_agreement"] + 0.12, (before, after)
  assert after["t1_acceptance"] > before["t1_acceptance"] + 0.1, (before, after)
  assert result.log[-1]["fkl"] < result.log[0]["fkl"]


def test_fit_resumes_where_it_stopped(tiny_draft, tmp_path):
  """A run stopped after 1 step and resumed to 6 ends with the same params as one run of 6."""
  model, params = tiny_draft
  pairs = [(x, x[::-1]) for x in _random_inputs(32, 4)]
  stream = lambda s: training.batch_stream(pairs, 64, 0, s, (12,))
  opt = training.OptimizerConfig("adafactor", 1e-2, 6)
  loss = ce_loss(model)
  one = training.fit(loss, params, stream, opt, str(tmp_path / "a"), eval_every=3,
                     log_fn=lambda m: None)
  training.fit(loss, params, stream, opt, str(tmp_path / "b"), eval_every=3,
               max_minutes=0.0, log_fn=lambda m: None)  # stops after its first step
  two = training.fit(loss, params, stream, opt, str(tmp_path / "b"), eval_every=3,
                     log_fn=lambda m: None)
  assert two.steps == one.steps == 6
  for a, b in zip(jax.tree_util.tree_leaves(one.params), jax.tree_util.tree_leaves(two.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_job_refuses_bad_input_before_work(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  base = dict(target_checkpoint=os.path.join(repo, "checkpoints/demo/target"),
              draft_checkpoint=os.path.join(repo, "checkpoints/demo/draft_small"),
              vocab_path=os.path.join(repo, "checkpoints/demo/spm.model"),
              source=os.path.join(repo, "data/bible/train.tsv"),
              output_dir=str(tmp_path / "out"), workdir=str(tmp_path / "wd"))
  with pytest.raises(FileNotFoundError, match="target_checkpoint: 'nope' does not exist"):
    distill.DistillJob(**dict(base, target_checkpoint="nope")).validate()
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "keep.txt").write_text("x")
  with pytest.raises(FileExistsError, match="--resume"):
    distill.DistillJob(**base).validate()
  assert (tmp_path / "out" / "keep.txt").read_text() == "x"


def test_smoke_job_runs_every_stage(tmp_path):
  """scripts/distill_draft.py --smoke: target outputs, training, export, agreement
  before/after, on random micro models and the demo vocabulary."""
  summary = distill.smoke_job(str(tmp_path), log_fn=lambda m: None)
  assert summary["steps"] == 4 and summary["training_inputs"] == 48
  assert set(summary["before"]) == {"greedy_agreement", "t1_acceptance"}
  from specdec_jax.checkpoints import load_checkpoint
  params, config = load_checkpoint(str(tmp_path / "distilled"))
  assert config.d_model == 16
  with open(tmp_path / "run" / "target_outputs.jsonl") as f:
    assert sum(1 for _ in f) == 48


def test_smoke_job_with_bridges(tmp_path):
  """--encoder_bridge and --feature_bridge: zero bridges leave the draft as it
  was (agreement before training equals the plain draft's, to float
  rounding), training moves them off zero, and they are written beside the
  draft checkpoint (and only there)."""
  from specdec_jax.drafts import bridge, feature_bridge
  plain = distill.smoke_job(str(tmp_path / "plain"), log_fn=lambda m: None)
  bridged = distill.smoke_job(str(tmp_path / "bridged"), log_fn=lambda m: None,
                              encoder_bridge=True, feature_bridge=True)
  for k in ("greedy_agreement", "t1_acceptance"):
    assert bridged["before"][k] == pytest.approx(plain["before"][k], abs=1e-6)
  kernel = bridge.load(str(tmp_path / "bridged" / "distilled"))
  assert kernel.shape == (32, 16) and np.abs(kernel).max() > 0
  features = feature_bridge.load(str(tmp_path / "bridged" / "distilled"))
  assert features["kernel"].shape == (32, 16) and np.abs(features["kernel"]).max() > 0
  assert features["staleness"].shape == (4, 16) and np.abs(features["staleness"]).max() > 0
  assert bridge.load(str(tmp_path / "plain" / "distilled")) is None
  assert feature_bridge.load(str(tmp_path / "plain" / "distilled")) is None


def test_interrupted_export_leaves_nothing_that_loads(tmp_path, monkeypatch):
  """An export that dies while writing the params must leave neither the old
  log nor a loadable mix of old params and new bridge: the directory then
  does not load at all."""
  from specdec_jax import checkpoints
  from specdec_jax.drafts import bridge
  distill.smoke_job(str(tmp_path), log_fn=lambda m: None, encoder_bridge=True)
  out = tmp_path / "distilled"
  assert (out / bridge.FILENAME).exists() and (out / "distill_log.json").exists()

  save = checkpoints.save_checkpoint

  def dies(directory, *args, **kwargs):  # only the export; smoke_job saves its models too
    if os.path.basename(directory) == "distilled":
      raise KeyboardInterrupt
    return save(directory, *args, **kwargs)

  monkeypatch.setattr(checkpoints, "save_checkpoint", dies)
  with pytest.raises(KeyboardInterrupt):  # the same job again (resumed: straight to export)
    distill.smoke_job(str(tmp_path), log_fn=lambda m: None, encoder_bridge=True)
  assert not (out / "distill_log.json").exists()
  with pytest.raises(checkpoints.CheckpointError, match="cannot detect"):
    checkpoints.load_checkpoint(str(out))


def test_evaluate_report_scores_and_agreement(tiny_target, tiny_draft):
  """evaluate_models: with the target's own greedy outputs as references, the
  target scores BLEU = chrF = 100 and its draft less; agreement and step-cost
  fields are present and in range."""
  from lab import evaluate
  target, tparams = tiny_target
  draft, dparams = tiny_draft
  inputs = _random_inputs(12, 5)
  outs = evaluate.greedy_outputs(target, tparams, inputs, max_decode_len=12, batch_size=16)
  text = lambda ids: " ".join(f"w{t}" for t in ids)
  refs = [text([t for t in o if t != 1]) for o in outs]
  pairs = [(x, o if o and o[-1] == 1 else o + [1]) for x, o in zip(inputs, outs)]
  rep = evaluate.evaluate_models({"t": (target, tparams), "d": (draft, dparams)}, "t", pairs,
                                 text, refs, max_decode_len=12, batch_tokens=256,
                                 timing_repeats=1, log_fn=lambda m: None)
  assert rep["t"]["bleu"] == pytest.approx(100.0) and rep["t"]["chrf"] == pytest.approx(100.0)
  assert rep["d"]["bleu"] < 100.0 and rep["d"]["chrf"] < 100.0
  assert 0.0 <= rep["d"]["greedy_agreement"] < 1.0 and 0.0 < rep["d"]["t1_acceptance"] < 1.0
  assert 0.0 <= rep["t"]["hit_max_decode_len"] <= 1.0
  assert rep["t"]["target_step_over_this"] == pytest.approx(1.0)


def test_grow_layers_preserves_the_function_and_trains(tiny_draft):
  """grow_layers appends encoder/decoder layers whose residual outputs are zero:
  the grown draft's logits equal the original's exactly (teacher-forced and one
  cached decode step), its tree is the deeper config's, and the new layers get
  a nonzero gradient on their output projections (they can learn)."""
  model, params = tiny_draft
  grown, cfg = distill.grow_layers(params, model.config, encoder_layers=1, decoder_layers=2)
  big = T5Model(cfg)
  assert (cfg.num_encoder_layers, cfg.num_decoder_layers) == (
      model.config.num_encoder_layers + 1, model.config.num_decoder_layers + 2)
  assert (jax.tree_util.tree_structure(grown)
          == jax.tree_util.tree_structure(big.init(jax.random.PRNGKey(0))))
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.integers(3, TINY.vocab_size, size=(3, 7)), jnp.int32)
  y = jnp.asarray(rng.integers(3, TINY.vocab_size, size=(3, 5)), jnp.int32)
  np.testing.assert_array_equal(model(params, x, y), big(grown, x, y))
  enc_a, enc_b = model.encode(params, x), big.encode(grown, x)
  np.testing.assert_array_equal(enc_a, enc_b)
  tok = y[:, :1]
  pos = jnp.zeros((3, 1), jnp.int32)
  la, _ = model.decode(params, tok, pos, model.init_cache(params, enc_a, x, 8))
  lb, _ = big.decode(grown, tok, pos, big.init_cache(grown, enc_b, x, 8))
  np.testing.assert_array_equal(la, lb)
  grad = jax.grad(lambda p: jnp.sum(jax.nn.log_softmax(big(p, x, y))[..., 3]))(grown)
  new = grad["decoder"][f"layers_{cfg.num_decoder_layers - 1}"]
  assert float(jnp.abs(new["mlp"]["wo"]["kernel"]).max()) > 0
  with pytest.raises(ValueError, match="decoder=-1"):
    distill.grow_layers(params, model.config, decoder_layers=-1)


def test_script_has_a_flag_for_each_pair_setting_it_takes():
  """scripts/distill_draft.py: every pair setting (``PairSettings``) is a flag
  of its name, typed from its annotation, but those distillation holds fixed
  and NO_FLAG's; each flag reaches the DistillJob field of its name, and each
  has one sentence of help from the docstring of the class declaring it."""
  import dataclasses
  import importlib.util
  from pathlib import Path
  from specdec_jax.pair import PairSettings
  from specdec_jax.scripting import script_args
  path = Path(__file__).resolve().parent.parent / "scripts" / "distill_draft.py"
  spec = importlib.util.spec_from_file_location("distill_draft", path)
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  flags = {a.dest for a in script.parser()._actions}
  pair = {f.name for f in dataclasses.fields(PairSettings)}
  assert pair - flags == set(distill.FIXED_PAIR_SETTINGS) | set(script.NO_FLAG)
  for a in script.parser()._actions:
    if a.dest in flags & {f.name for f in dataclasses.fields(distill.DistillJob)}:
      assert re.fullmatch(rf"DistillJob\.{a.dest}: [^ ].*\.", a.help), (a.dest, a.help)
  args = script_args.parse(script.parser(), [
      "--target_checkpoint=t", "--draft_checkpoint=d", "--output_dir=o", "--workdir=w",
      "--min_rows=2", "--mesh_shape=1,2", "--vocab_extra_ids=3", "--draft_preset=t5_1_1_small"])
  job = script_args.dataclass_from_flags(distill.DistillJob, args)
  assert (job.target_checkpoint, job.draft_checkpoint, job.min_rows, job.mesh_shape,
          job.vocab_extra_ids, job.draft_preset, job.dtype) == (
              "t", "d", 2, (1, 2), 3, "t5_1_1_small", "float32")
