"""``python -m specdec_jax.prepare_data``: the command parses, builds the TFDS
builder the seqio tasks read into the given directory, says how to install a
missing TFDS, and is the command the unprepared-data error names. Nothing is
downloaded: ``download_and_prepare`` is replaced by a recorder."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from specdec_jax import data, prepare_data

REPO = Path(__file__).resolve().parent.parent


def _fake_tfds(calls: list) -> types.ModuleType:
  """A stand-in ``tensorflow_datasets`` that records builders and preparations."""
  class Builder:
    def __init__(self, name, data_dir):
      self.name, self.data_dir_arg = name, data_dir
      self.data_dir = f"{data_dir}/{name.replace(':', '/')}"

    def download_and_prepare(self, download_dir=None):
      calls.append((self.name, self.data_dir_arg, download_dir))

  module = types.ModuleType("tensorflow_datasets")
  module.builder = Builder
  return module


@pytest.mark.parametrize("dataset,name", [("wmt_ende", "wmt_t2t_translate/de-en:1.0.0"),
                                          ("cnn_dailymail", "cnn_dailymail:3.4.0")])
def test_command_names_builder_and_data_dir(dataset, name, monkeypatch, capsys):
  calls = []
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", _fake_tfds(calls))
  assert prepare_data.main([f"--dataset={dataset}", "--data_dir=gs://bucket/tfds"]) == 0
  assert calls == [(name, "gs://bucket/tfds", None)]
  out = capsys.readouterr().out
  assert "Experiment.tfds_data_dir = 'gs://bucket/tfds'" in out
  assert data.TFDS_DATASETS[dataset] == name


def test_local_dirs_are_absolute(monkeypatch, tmp_path):
  calls = []
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", _fake_tfds(calls))
  monkeypatch.chdir(tmp_path)
  prepare_data.prepare("wmt_ende", "tfds", download_dir="dl")
  assert calls == [(data.WMT_TFDS_NAME, str(tmp_path / "tfds"), str(tmp_path / "dl"))]


def test_missing_tfds_is_one_clear_line(monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails
  assert prepare_data.main(["--dataset=cnn_dailymail", "--data_dir=/tmp/x"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and err.startswith("error: TensorFlow Datasets is not installed")
  assert 'pip install -e ".[seqio]"' in err


def test_bad_arguments(capsys):
  with pytest.raises(SystemExit) as e:
    prepare_data.main(["--dataset=wmt14", "--data_dir=/tmp/x"])
  assert e.value.code == 2 and "invalid choice: 'wmt14'" in capsys.readouterr().err
  with pytest.raises(ValueError, match="data_dir is empty"):
    prepare_data.prepare("wmt_ende", "")


def test_module_help_runs():
  res = subprocess.run([sys.executable, "-m", "specdec_jax.prepare_data", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 0 and "--dataset {cnn_dailymail,wmt_ende}" in res.stdout


def test_real_builders_and_the_prepared_data(monkeypatch, tmp_path):
  """With TFDS installed: the builders exist under these names and versions and
  aim at data_dir; the error for unprepared data names this command; prepared
  data is read by the runner through the seqio task, with the task prefix."""
  tfds = pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("seqio")
  prepared = []
  monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare",
                      lambda self, **kw: prepared.append(str(self.data_dir)))
  for dataset, sub in (("wmt_ende", "wmt_t2t_translate/de-en/1.0.0"),
                       ("cnn_dailymail", "cnn_dailymail/3.4.0")):
    assert prepare_data.prepare(dataset, str(tmp_path)) == str(tmp_path / sub)
  assert prepared == [str(tmp_path / "wmt_t2t_translate/de-en/1.0.0"),
                      str(tmp_path / "cnn_dailymail/3.4.0")]

  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError) as e:
    data.load_seqio_examples("specdec_cnn_dailymail", "test", 1, data_dir=str(empty))
  assert (f"`python -m specdec_jax.prepare_data --dataset=cnn_dailymail --data_dir={empty}`"
          in str(e.value))

  # Once prepared (TFDS's mock data in place of the download), the T5 1.0 CNN/DM
  # row reads it through the seqio task and prefixes every input.
  (empty / "cnn_dailymail" / "3.4.0").mkdir(parents=True)
  (empty / "cnn_dailymail" / "3.4.0" / "dataset_info.json").write_text("{}")
  from specdec_jax import run
  exp = run.parse_config([str(REPO / "configs/table2_t5_1_0/t5_1_0_cnndm_small_t0.gin")], [
      f"Experiment.tfds_data_dir = '{empty}'",
      f"VOCAB_PATH = '{REPO / 'checkpoints/demo/spm.model'}'",
      "Experiment.num_warmup = 1", "Experiment.num_examples = 2"])
  assert exp.source == "seqio:specdec_cnn_dailymail" and exp.prefix == "summarize: "
  with tfds.testing.mock_data(num_examples=3):
    loaded = run.load_data(exp)
  for ex, row in zip(loaded.examples, loaded.inputs):
    assert not ex.input.startswith("summarize")
    want = loaded.vocab.encode("summarize: " + ex.input)
    n = min(len(want), exp.max_input_len - 1)  # a truncated row ends in EOS
    assert list(row[:n]) == want[:n]
