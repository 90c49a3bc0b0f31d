"""specdec_jax.pair: one validation of the target/draft settings, spelled as
each owner spells them (the runner's gin bindings, distillation's flags)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from specdec_jax import distill, pair
from specdec_jax.run.settings import Experiment

REPO = Path(__file__).resolve().parent.parent
TARGET, DRAFT, VOCAB = "checkpoints/demo/target", "checkpoints/demo/draft_small", \
    "checkpoints/demo/spm.model"


def _owners(**kw):
  """The same pair settings as the runner's and as distillation's."""
  exp = dataclasses.replace(Experiment(target_checkpoint=TARGET, draft_checkpoint=DRAFT,
                                       vocab_path=VOCAB), **kw)
  job = dataclasses.replace(distill.DistillJob(TARGET, DRAFT, "out", "wd", vocab_path=VOCAB),
                            **kw)
  return exp.pair, job.pair


@pytest.mark.parametrize("kw, message", [
    (dict(mesh_shape=(1, 1, 1)), r"mesh_shape must be None or two positive ints"),
    (dict(mesh_shape=(1, True)), r"mesh_shape must be None or two positive ints"),
    (dict(partition_fallback="pad"), r"partition_fallback must be one of"),
    (dict(logical_axis_rules=(("batch", "rows"),)), r"logical_axis_rules: .*'rows'"),
    (dict(target_format="t6x"), r"target_format must be one of .*got 't6x'"),
    (dict(draft_format="gguf"), r"draft_format must be one of .*got 'gguf'"),
    (dict(vocab_extra_ids=-1), r"vocab_extra_ids must be >= 0, got -1"),
    (dict(param_dtype="float8"), r"param_dtype must be one of .*got 'float8'"),
])
def test_one_validation_spelled_as_each_owner_spells_it(kw, message):
  runner, distillation = _owners(**kw)
  for p, name in ((runner, "Experiment."), (distillation, "")):
    with pytest.raises(ValueError, match="^" + name + message):
      p.check_values()


@pytest.mark.parametrize("value", [0, True, 1.5])
def test_min_rows_is_a_positive_int(value):
  with pytest.raises(ValueError, match=rf"^Experiment.min_rows must be an int >= 1, got {value!r}"):
    Experiment(target_checkpoint=TARGET, draft_checkpoint=DRAFT, vocab_path=VOCAB,
               min_rows=value).pair.check_values()


def test_min_rows_reaches_the_loaded_models():
  exp = Experiment(target_checkpoint=TARGET, draft_checkpoint=DRAFT, vocab_path=VOCAB,
                   min_rows=2)
  assert exp.pair.load("draft")[0].config.min_rows == 2


def test_paths_name_the_setting_the_value_and_where_they_were_looked_for(tmp_path, monkeypatch):
  p = pair.ModelPair(target_checkpoint="nope", vocab_path=VOCAB, config_dirs=(str(tmp_path),),
                     prefix="Experiment.")
  with pytest.raises(FileNotFoundError) as e:
    p.check_paths()
  assert str(e.value).startswith("Experiment.target_checkpoint: 'nope' does not exist "
                                 f"(looked in: nope, {tmp_path / 'nope'}, {REPO / 'nope'})")
  p.check_paths(must_exist=False)  # the dry runs read nothing
  with pytest.raises(ValueError, match="^target_checkpoint: .*gs://"):
    pair.ModelPair(target_checkpoint="gs://").check_paths(must_exist=False)
  # Relative paths: the working directory, then the config directories, then the repo root.
  (tmp_path / "spm.model").write_text("x")
  monkeypatch.chdir(tmp_path / "..")
  assert pair.resolve_path("spm.model", (str(tmp_path),)) == str(tmp_path / "spm.model")
  assert pair.resolve_path(VOCAB) == str(REPO / VOCAB)
  assert pair.resolve_path("seqio:task") == "seqio:task"


def test_unset_and_roles():
  p = pair.ModelPair(vocab_path=VOCAB)
  assert p.unset(draft_needed=True) == ["target_checkpoint", "draft_checkpoint"]
  assert p.unset(draft_needed=False) == ["target_checkpoint"]
  assert p.model("draft") == ("", "auto", None) and p.peek_config("draft") is None
  with pytest.raises(ValueError, match="role"):
    p.model("teacher")


def test_before_loading_the_mesh_and_vocabularies_are_named(monkeypatch):
  from specdec_jax import checkpoints
  monkeypatch.setattr(checkpoints, "load_checkpoint", lambda *a, **k: pytest.fail("read"))
  runner, distillation = _owners(mesh_shape=(1, 2))
  with pytest.raises(ValueError, match=r"^Experiment.mesh_shape: mesh_shape \(1, 2\) has 2"):
    runner.check_before_loading()
  with pytest.raises(ValueError, match=r"^mesh_shape \(1, 2\) has 2"):
    distillation.check_before_loading()
  runner, _ = _owners()
  assert runner.check_before_loading() == (None, None)
  target = runner.peek_config("target")
  with pytest.raises(ValueError, match=r"Experiment.draft_checkpoint=.*distill a draft"):
    runner.check_vocabularies(target, target.replace(vocab_size=64))
  with pytest.raises(ValueError, match="has 9000 ids but the target's vocab_size is 8000"):
    runner.check_vocab_size(9000, target)


def test_weights_at_each_roles_dtype():
  """Distillation keeps the target at param_dtype and the draft in float32."""
  p = _owners(param_dtype="bfloat16")[1]
  target, tp = p.load("target")
  draft, dp = p.load("draft")
  assert tp["token_embedder"]["embedding"].dtype == "bfloat16"
  assert dp["token_embedder"]["embedding"].dtype == "float32"
  assert target.config.dtype == draft.config.dtype == "float32"
