"""The distillation's TPU dry run (``specdec_jax.dryrun.distill_programs``,
``scripts/distill_draft.py --dry_run``) on libtpu's compile-only v5e:2x4
devices, on this CPU-only machine: a tiny target/draft pair (config.json
only, no weights) on mesh (2, 4). The job's two programs, the target's
greedy generation and the draft's training step, are compiled once, through
the script's own ``main``, with every loader and Cloud Storage read made to
fail; bad input is refused in one line with compiling made to fail.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("libtpu", reason="the dry run compiles with libtpu (requirements-test.txt)")

from specdec_jax import checkpoints, data, distill, storage  # noqa: E402
from specdec_jax.models.t5 import T5Config  # noqa: E402
from specdec_jax.dryrun import chips, distill_programs, driver  # noqa: E402
from specdec_jax.dryrun.driver import Program  # noqa: E402
from test_dry_run import _checkpoint  # noqa: E402  (a config.json, no weights)

REPO = Path(__file__).resolve().parent.parent
TOPOLOGY = "v5e:2x4"
MESH = (2, 4)
TARGET = T5Config(vocab_size=2048, d_model=256, num_heads=4, head_dim=32, num_encoder_layers=1,
                  num_decoder_layers=1, d_ff=512)
DRAFT = TARGET.replace(d_model=128, num_heads=2, d_ff=256)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
  root = tmp_path_factory.mktemp("distill_dry_run")
  return {"target": _checkpoint(root, "target", TARGET),
          "draft": _checkpoint(root, "draft", DRAFT),
          "other_vocab": _checkpoint(root, "other_vocab", DRAFT.replace(vocab_size=1024)),
          # float32: a 1M x 2048 embedding and output layer are 16 GiB, the
          # draft's 1 GiB.
          "huge": _checkpoint(root, "huge", TARGET.replace(vocab_size=1 << 20, d_model=2048,
                                                           num_heads=8, head_dim=256)),
          "huge_draft": _checkpoint(root, "huge_draft", DRAFT.replace(vocab_size=1 << 20)),
          "out": str(root / "out")}


def flags(paths, **kw) -> list[str]:
  """scripts/distill_draft.py's flags for the tiny job; gs:// data that must not be read."""
  fields = dict(target_checkpoint=paths["target"], draft_checkpoint=paths["draft"],
                output_dir=paths["out"], workdir=paths["out"],
                source="gs://not-read/train.tsv", eval_source="gs://not-read/valid.tsv",
                vocab_path="gs://not-read/spm.model", mesh_shape="2,4",
                param_dtype="bfloat16", max_input_len=32, max_decode_len=16,
                generate_batch_size=8, batch_tokens=512, modes="greedy", dry_run=TOPOLOGY)
  fields.update(kw)
  return [f"--{k}={v}" for k, v in fields.items()]


def _script():
  spec = importlib.util.spec_from_file_location("distill_draft",
                                                REPO / "scripts" / "distill_draft.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _refuse(what: str):
  def refuse(*a, **k):
    raise AssertionError(f"the dry run {what}")
  return refuse


@pytest.fixture(scope="module")
def report(paths):
  """The script's --dry_run, in this process: (exit status, printed report,
  the DryRun, the memory analyses of every executable compiled)."""
  analyses, results = [], []
  original = jax.stages.Lowered.compile

  def spy(self, *a, **k):
    compiled = original(self, *a, **k)
    analyses.append(compiled.memory_analysis())
    return compiled

  main = driver.main
  with pytest.MonkeyPatch.context() as mp:
    for module, name in ((checkpoints, "load_checkpoint"), (checkpoints, "_load"),
                         (storage, "_read_object"), (storage, "_list_prefix"),
                         (data, "load_examples"), (data, "get_vocabulary")):
      mp.setattr(module, name, _refuse(f"called {module.__name__}.{name}"))
    mp.setattr(jax.stages.Lowered, "compile", spy)
    mp.setattr(driver, "main", lambda *a, **k: results.append(main(*a, **k)) or
               results[-1])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      code = _script().main(flags(paths))
  assert not os.path.exists(paths["out"])  # nothing written
  return code, out.getvalue(), results[0], analyses


def test_programs_compile_and_fit(report):
  code, text, r, _ = report
  assert code == 0 and r.fits
  assert r.chip is chips.CHIPS["v5e"] and len(r.ctx.devices) == 8
  assert [p.name for p in r.programs] == ["generate (greedy)", "train step"]
  for p in r.programs:
    assert not p.error, p.error
    assert p.weight_moves == [], p.weight_moves
    assert f"{p.name:20s}" in text and "NO" not in text.split(p.name)[1].splitlines()[0]
  assert text.count("no collective moves a weight") == 2
  assert "the job fits v5e:2x4 as given" in text
  # The job's shapes: generation at the longest input bucket, the step at the
  # longest bucket with batch_tokens / length rows (a multiple of 'data').
  assert distill_programs.input_len(r.ctx) == 32 and distill_programs.train_len(r.ctx) == 32
  assert distill_programs.train_rows(r.ctx) == 16


def test_memory_is_the_executables(report):
  """Each program's figures are its compiled executable's memory analysis,
  and the printed total is arguments + temporaries + outputs - aliased."""
  _, text, r, analyses = report
  got = sorted((a.argument_size_in_bytes, a.temp_size_in_bytes, a.output_size_in_bytes,
                a.alias_size_in_bytes) for a in analyses)
  reported = sorted((p.arguments, p.temporaries, p.outputs, p.aliased) for p in r.programs)
  assert got == reported and len(got) == 2
  for p in r.programs:
    assert p.total == p.arguments + p.temporaries + p.outputs - p.aliased > 0
    row = next(line for line in text.splitlines() if line.strip().startswith(p.name))
    assert driver.gib(p.total) in row


def test_weight_arguments_are_the_sharded_weights(report):
  """The executables take the target's weights in their (2, 4) shards at
  bfloat16 (generation), plus the draft's float32 replicated copy (the
  step), byte for byte; the step donates the draft and its optimizer state."""
  _, _, r, _ = report
  gen, step = r.programs
  w = r.ctx.resident
  assert gen.weights == w["target"] and step.weights == w["target"] + w["draft"]
  assert w["draft"] > w["target"]  # replicated float32 vs 1/4 of a bfloat16 target
  assert step.aliased >= w["draft"]


def test_a_program_that_does_not_fit_gets_a_smaller_batch(paths, monkeypatch):
  """The search for settings that fit halves the batch until a compile fits
  (the compile faked here: bytes proportional to the batch)."""
  ctx = driver.check(distill_programs.DistillPrograms(distill.DistillJob(
      target_checkpoint=paths["target"], draft_checkpoint=paths["draft"],
      output_dir=paths["out"], workdir=paths["out"], source="x",
      vocab_path="x", mesh_shape=MESH, generate_batch_size=64, batch_tokens=4096,
      max_input_len=32, max_decode_len=16)), TOPOLOGY)
  hbm = ctx.chip.hbm_bytes
  monkeypatch.setattr(distill_programs, "lower_train", lambda c, v: ("train", v))
  monkeypatch.setattr(distill_programs, "lower_generate", lambda c, m, v: ("gen", v))
  monkeypatch.setattr(distill_programs, "compile_program",
                      lambda name, low, *a, **k: Program(name, 0, arguments=low[1] * hbm // 1000))
  fix = distill_programs.find_fix(ctx, "train step")
  assert (fix.flag, fix.value, fix.tried) == ("batch_tokens", 512, (2048, 1024, 512))
  fix = distill_programs.find_fix(ctx, "generate (greedy)")
  assert (fix.flag, fix.value) == ("generate_batch_size", 32)
  r = distill_programs.DistillDryRun(ctx, [Program("generate (greedy)", 0, arguments=2 * hbm)],
                                     fixes=[fix])
  text = driver.format_report(r)
  assert "does NOT fit v5e:2x4 as given: generate (greedy) (32.00 GiB per device)" in text
  assert "--generate_batch_size=32 fits (0.51 GiB per device, 3%, compiled; tried 32)" in text


def test_a_moved_weight_is_found_and_a_gradient_is_not():
  """What ``weight_moves`` reports in a program with a backward pass: a
  weight all-gathered at run time, not the gradients (which GSPMD reduces
  across 'data', and which pass through a broadcast norm-like scale)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from specdec_jax import partitioning  # pylint: disable=import-outside-toplevel
  from specdec_jax.dryrun import hlo  # pylint: disable=import-outside-toplevel
  mesh = partitioning.make_mesh(MESH, chips.topology_devices(TOPOLOGY)[1])
  shard = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  sds = jax.ShapeDtypeStruct
  params = {"scale": sds((128,), "float32", sharding=shard()),
            "v": sds((256, 128), "float32", sharding=shard())}
  frozen = {"w": sds((128, 256), "bfloat16", sharding=shard(None, "model"))}
  x = sds((8, 128), "float32", sharding=shard("data"))

  def step(params, x, frozen):
    def loss(p):
      h = (x * p["scale"]) @ frozen["w"].astype(jnp.float32)
      return jnp.sum((h @ p["v"]) ** 2)
    w = jax.lax.with_sharding_constraint(frozen["w"], shard())  # all-gather of a weight
    return jax.grad(loss)(params), x @ w.astype(jnp.float32)

  module = hlo.parse(jax.jit(step).lower(params, x, frozen).compile().as_text())
  assert hlo.all_collectives(module)  # gradients are reduced...
  # ... but only the gather moves a weight
  moves = hlo.weight_collectives(module, driver.is_weight, moves_only=True)
  assert [m.kind for m in moves] == ["all-gather"] and moves[0].shape == "bf16[128,256]"


# ---------------------------------------------------------------- bad input


@pytest.fixture
def no_compile(monkeypatch):
  """Bad input must be refused before any compile."""
  monkeypatch.setattr(jax.stages.Lowered, "compile", _refuse("compiled before refusing"))


def _job(paths, **kw) -> distill.DistillJob:
  fields = dict(source="gs://not-read/train.tsv", vocab_path="gs://not-read/spm.model",
                mesh_shape=MESH, param_dtype="bfloat16", max_input_len=32, max_decode_len=16,
                generate_batch_size=8, batch_tokens=512)
  fields.update(kw)
  return distill.DistillJob(target_checkpoint=fields.pop("target", paths["target"]),
                            draft_checkpoint=fields.pop("draft", paths["draft"]),
                            output_dir=paths["out"], workdir=paths["out"], **fields)


def _one_line(excinfo) -> str:
  text = str(excinfo.value)
  assert "\n" not in text
  return text


def test_mesh_larger_than_the_topology(paths, no_compile):
  with pytest.raises(ValueError) as e:
    distill_programs.dry_run(_job(paths, mesh_shape=(2, 8)), TOPOLOGY)
  text = _one_line(e)
  assert "mesh_shape (2, 8) has 16 devices but there are 8" in text and TOPOLOGY in text
  # The target has 4 heads: of the meshes of 8, (2, 4) splits it the most.
  assert text.endswith("--mesh_shape=2,4 holds the fewest weight bytes per device")


def test_draft_vocabulary_differs(paths, no_compile):
  with pytest.raises(ValueError) as e:
    distill_programs.dry_run(_job(paths, draft=paths["other_vocab"]), TOPOLOGY)
  assert "vocab_size target=2048 != draft=1024" in _one_line(e)


def test_architecture_needs_a_preset(paths, no_compile):
  with pytest.raises(ValueError) as e:
    distill_programs.dry_run(_job(paths, target="gs://not-read/t5x_xxl"), TOPOLOGY)
  assert "pass --target_preset" in _one_line(e)


def test_weights_that_cannot_fit_name_a_mesh_that_holds_them(paths, no_compile):
  with pytest.raises(ValueError) as e:
    distill_programs.dry_run(_job(paths, target=paths["huge"], draft=paths["huge_draft"],
                                mesh_shape=None, param_dtype="float32"), TOPOLOGY)
  text = _one_line(e)
  assert "the weights alone do not fit on one device" in text and "16 GiB of HBM" in text
  assert "--mesh_shape=1,8 holds the target" in text


def test_command_line_refuses_in_one_line(paths):
  """The script's exit status and its one stderr line (one subprocess)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, str(REPO / "scripts" / "distill_draft.py"),
                        *flags(paths, mesh_shape="1,16")], env=env, capture_output=True,
                       text=True, timeout=300)
  assert res.returncode == 2, res.stderr[-3000:]
  err = res.stderr.strip().splitlines()
  assert err[-1].startswith("distill_draft.py: error: --dry_run=v5e:2x4 (8 devices")
  assert "mesh_shape (1, 16) has 16 devices but there are 8" in err[-1]
  assert "Compiled programs" not in res.stdout
