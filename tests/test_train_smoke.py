"""End-to-end smoke run of scripts/train_demo_models.py (micro models, < 1 min)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "train_demo_models.py")
NAMES = ("smoke_target", "smoke_draft")


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory) -> str:
  workdir = str(tmp_path_factory.mktemp("train_smoke"))
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, SCRIPT, "--smoke", f"--workdir={workdir}"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return workdir


def _log(workdir: str, name: str) -> dict:
  with open(os.path.join(workdir, "export", name, "train_log.json")) as f:
    return json.load(f)


@pytest.mark.parametrize("name", NAMES)
def test_finished_and_loss_went_down(smoke_dir, name):
  log = _log(smoke_dir, name)
  assert log["steps"] == 40
  curve = log["log"]
  assert curve[-1]["step"] == 40
  assert curve[-1]["train_loss"] < curve[0]["train_loss"]
  assert curve[-1]["val_loss"] < curve[0]["val_loss"]
  # The per-step log in the workdir matches the exported curve.
  with open(os.path.join(smoke_dir, name, "log.jsonl")) as f:
    assert [json.loads(line) for line in f] == curve


def test_vocabulary_has_t5_ids(smoke_dir):
  import sentencepiece as spm
  sp = spm.SentencePieceProcessor(model_file=os.path.join(smoke_dir, "export", "spm.model"))
  assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)


@pytest.mark.parametrize("name", NAMES)
def test_export_reloads(smoke_dir, name):
  checkpoints = pytest.importorskip("specdec_jax.checkpoints")
  import jax
  import numpy as np
  from lab.common import count_params
  from specdec_jax.models.t5 import T5Model
  params, config = checkpoints.load_checkpoint(os.path.join(smoke_dir, "export", name))
  log = _log(smoke_dir, name)
  assert config.vocab_size == log["config"]["vocab_size"]
  assert count_params(params) == log["params"]
  inputs = np.array([[5, 6, 7, 1]], np.int32)
  logits = T5Model(config)(params, inputs, np.zeros((1, 3), np.int32))
  assert logits.shape == (1, 3, config.vocab_size)
  assert bool(jax.numpy.isfinite(logits).all())


def _script():
  from lab import train_demo_models
  return train_demo_models


def test_continuing_without_the_vocabulary_is_an_error(tmp_path):
  # A resumed run whose export dir lacks spm.model must not train a new
  # vocabulary (it would re-map every token id of the saved model).
  workdir, export = tmp_path / "work", tmp_path / "export"
  (workdir / "target" / "ckpt" / "824").mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match="--spm"):
    _script().main(["--models=target", f"--workdir={workdir}", f"--export_dir={export}"])
  assert not (export / "spm.model").exists()
  with pytest.raises(FileNotFoundError, match="no such SentencePiece model"):
    _script().main(["--models=target", f"--workdir={workdir}", f"--export_dir={export}",
                    f"--spm={tmp_path / 'missing.model'}"])
  with pytest.raises(FileNotFoundError, match="--report needs"):
    _script().main(["--models=target", "--report", f"--export_dir={export}"])


def test_oversample_long_repeats_only_long_pairs():
  from specdec_jax import training
  short, long_in, long_out = ([1] * 5, [2] * 5), ([3] * 9, [4]), ([5], [6] * 12)
  out = training.oversample_long([short, long_in, long_out], min_tokens=9, times=3)
  assert out.count(short) == 1
  assert out.count(long_in) == 3 and out.count(long_out) == 3
  assert out[:3] == [short, long_in, long_out]  # the original order first
  with pytest.raises(ValueError, match="times=0"):
    training.oversample_long([short], min_tokens=9, times=0)
