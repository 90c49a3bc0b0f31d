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
  job = dataclasses.replace(distill.DistillJob(target_checkpoint=TARGET, draft_checkpoint=DRAFT,
                                               output_dir="out", workdir="wd",
                                               vocab_path=VOCAB), **kw)
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
                     owner="Experiment")
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


# ------------------------------------------------------------------- declared once


PAIR = [f.name for f in dataclasses.fields(pair.PairSettings)]


@pytest.mark.parametrize("owner", [pair.ModelPair, Experiment, distill.DistillJob])
def test_each_pair_setting_is_declared_once(owner):
  """The runner's Experiment, distillation's DistillJob and ModelPair hold
  the pair's settings by inheriting them from PairSettings: the very field
  objects, none declared again in the owner's own class body (a setting
  declared a second time fails here)."""
  fields = owner.__dataclass_fields__
  assert [n for n in fields if n in PAIR] == PAIR
  for name in PAIR:
    assert fields[name] is pair.PairSettings.__dataclass_fields__[name], name
  own = set(vars(owner).get("__annotations__", {}))
  assert not own & set(PAIR), f"{owner.__name__} declares {sorted(own & set(PAIR))} again"
  if owner is pair.ModelPair:
    assert list(fields) == PAIR + ["owner"]


def _distinct_values() -> dict:
  """A value for every pair setting that no default has (validity aside)."""
  out = {}
  for f in dataclasses.fields(pair.PairSettings):
    out[f.name] = (7 if isinstance(f.default, int) else (f.name, 1)
                   if f.name in ("mesh_shape", "config_dirs") or "rules" in f.name
                   else f"v_{f.name}")
  return out


def test_one_conversion_carries_every_setting():
  """``Experiment.pair`` and ``DistillJob.pair`` carry every pair setting
  (one added later included); distillation keeps its draft in float32."""
  values = _distinct_values()
  exp = dataclasses.replace(Experiment(), **values)
  job = dataclasses.replace(distill.DistillJob(output_dir="o", workdir="w"), **values)
  assert {n: getattr(exp.pair, n) for n in PAIR} == values and exp.pair.owner == "Experiment"
  assert {n: getattr(job.pair, n) for n in PAIR} == dict(values, draft_param_dtype="float32")
  assert job.pair.owner == ""


def test_no_second_list_of_the_pairs_settings_in_the_code():
  """No module spells out the pair's settings as a list (the mirror that once
  kept three declarations in step): no literal tuple, list or set of string
  constants naming six or more of them."""
  import ast
  found = []
  for path in sorted([*(REPO / "specdec_jax").rglob("*.py"), *(REPO / "scripts").glob("*.py")]):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        names = {e.value for e in node.elts if isinstance(e, ast.Constant)} & set(PAIR)
        if len(names) >= 6:
          found.append(f"{path.relative_to(REPO)}:{node.lineno}")
  assert not found, f"a list of the pair's settings: {found}"


def test_the_names_users_write_are_unchanged():
  """Bindings ``Experiment.<setting>`` and DistillJob keywords keep working;
  a message names the setting as each owner spells it; the old positional
  DistillJob(target, draft, output_dir, workdir) fails rather than
  misassigning."""
  import gin
  from specdec_jax import run
  exp = run.parse_config([], ["Experiment.target_checkpoint = 't'", "Experiment.min_rows = 2",
                              "Experiment.draft_param_dtype = 'bfloat16'"])
  gin.clear_config()
  assert (exp.target_checkpoint, exp.pair.min_rows, exp.pair.weight_dtype("draft"),
          exp.pair.weight_dtype("target")) == ("t", 2, "bfloat16", "float32")
  with pytest.raises(ValueError, match=r"^Experiment.draft_param_dtype must be None or one of"):
    dataclasses.replace(exp, draft_param_dtype="int8").pair.check_values()
  with pytest.raises(TypeError):
    distill.DistillJob("t", "d", "o", "w")  # pylint: disable=too-many-function-args


@pytest.mark.parametrize("kw, message", [
    (dict(dtype="bfloat16"), r"^dtype='bfloat16': distillation computes in float32"),
    (dict(draft_param_dtype="bfloat16"), r"^draft_param_dtype='bfloat16': the draft is kept"),
    (dict(draft_quantization="int8"), r"^draft_quantization='int8': .*export_quantization"),
    (dict(draft_logical_axis_rules=()), r"^draft_logical_axis_rules=\(\): the draft is"),
])
def test_distillation_refuses_the_pair_settings_it_holds_fixed(kw, message):
  job = distill.DistillJob(target_checkpoint=TARGET, draft_checkpoint=DRAFT, output_dir="o",
                           workdir="w", vocab_path=VOCAB, source="data/bible/train.tsv", **kw)
  with pytest.raises(ValueError, match=message):
    job.validate(check_paths=False)
