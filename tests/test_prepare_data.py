"""``python -m specdec_jax.prepare_data``: the command builds the TFDS
datasets the seqio tasks read (the exact names and versions) through TFDS's
real builders, from tiny local copies of their downloads
(tests/tfds_downloads.py: only the HTTP fetch and the checksum registry are
redirected), into local and gs:// data directories; says how to install a
missing TFDS; is the command the unprepared-data error names; and the data it
builds reaches the runner through the seqio task, with the task prefix."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tfds_downloads

from specdec_jax import data, prepare_data

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """TFDS's downloads of both datasets served from tiny local files (this process)."""
  pytest.importorskip("tensorflow_datasets")
  files = tfds_downloads.write_sources(tmp_path_factory.mktemp("sources"))
  undo = tfds_downloads.serve(files)
  yield files
  undo()


@pytest.fixture(scope="module")
def prepared(served, tmp_path_factory):
  """Both datasets built by the command into a fresh data dir, and its output."""
  root = tmp_path_factory.mktemp("tfds")
  out = {}
  for dataset in ("wmt_ende", "cnn_dailymail"):
    out[dataset] = prepare_data.main([f"--dataset={dataset}", f"--data_dir={root}"])
  return root, out


def test_the_seqio_extra_declares_what_building_imports():
  """TensorFlow Datasets imports importlib_resources inside
  ``download_and_prepare`` and requires it only on Python < 3.9: the extra
  the docs install for the data path declares it, and it is installed."""
  extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
      "optional-dependencies"]
  names = {re.split(r"[<>=\[; ]", r, maxsplit=1)[0].lower().replace("-", "_")
           for r in extras["seqio"]}
  assert {"seqio", "importlib_resources"} <= names
  importlib.metadata.version("importlib_resources")


@pytest.mark.slow
@pytest.mark.parametrize("dataset,sub", [("wmt_ende", "wmt_t2t_translate/de-en/1.0.0"),
                                         ("cnn_dailymail", "cnn_dailymail/3.4.0")])
def test_the_real_builders_build_both_datasets(prepared, dataset, sub):
  """TFDS's own builders (no recorder) downloaded, checked, extracted and
  generated every split from the served files, under the exact names and
  versions the seqio tasks read."""
  import tensorflow_datasets as tfds
  root, codes = prepared
  assert codes[dataset] == 0
  assert (root / sub / "dataset_info.json").is_file()
  name = data.TFDS_DATASETS[dataset]
  builder = tfds.builder(name, data_dir=str(root))
  splits = {k: v.num_examples for k, v in builder.info.splits.items()}
  train = tfds_downloads.SIZES["train"] * (3 if dataset == "wmt_ende" else 1)
  assert splits == {"train": train, "validation": tfds_downloads.SIZES["validation"],
                    "test": tfds_downloads.SIZES["test"]}
  test = list(tfds.load(name, split="test", data_dir=str(root)).as_numpy_iterator())
  if dataset == "wmt_ende":
    got = {(r["en"].decode(), r["de"].decode()) for r in test}
    assert got == set(tfds_downloads.wmt_pairs("test"))
  else:
    got = {(r["article"].decode(), r["highlights"].decode()) for r in test}
    assert got == set(tfds_downloads.cnn_examples("test"))
    assert {r["publisher"].decode() for r in test} == {"cnn", "dm"}


@pytest.mark.slow
def test_a_prepared_version_is_kept(prepared, capsys):
  """Run again, the command changes nothing (TFDS reuses the prepared version)."""
  root, _ = prepared
  info = root / "cnn_dailymail" / "3.4.0" / "dataset_info.json"
  before = info.stat().st_mtime_ns
  assert prepare_data.main(["--dataset=cnn_dailymail", f"--data_dir={root}"]) == 0
  assert info.stat().st_mtime_ns == before
  assert f"prepared in {root / 'cnn_dailymail' / '3.4.0'}" in capsys.readouterr().out


def test_local_dirs_are_absolute(monkeypatch, tmp_path):
  """A relative --data_dir / --download_dir is made absolute before TFDS sees it."""
  assert prepare_data._local_or_remote("gs://b/tfds") == "gs://b/tfds"
  monkeypatch.chdir(tmp_path)
  assert prepare_data._local_or_remote("tfds") == str(tmp_path / "tfds")


def test_raw_downloads_stay_on_this_machine(monkeypatch, tmp_path):
  """Without --download_dir: <data_dir>/downloads for a local data dir, the
  home directory's for a gs:// one (TFDS's WMT builder finds its extracted
  files with a glob that only sees local ones)."""
  monkeypatch.setenv("HOME", str(tmp_path))
  assert prepare_data.default_download_dir("gs://b/tfds") == str(
      tmp_path / "tensorflow_datasets" / "downloads")
  assert prepare_data.default_download_dir("/data/tfds") == "/data/tfds/downloads"


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


@pytest.mark.slow
def test_the_prepared_data_reaches_the_runner(prepared, tmp_path):
  """The error for unprepared data names this command; the data the command
  built is read by the runner through the seqio task, with the task prefix."""
  pytest.importorskip("seqio")
  root, _ = prepared
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError) as e:
    data.load_seqio_examples("specdec_cnn_dailymail", "test", 1, data_dir=str(empty))
  assert (f"`python -m specdec_jax.prepare_data --dataset=cnn_dailymail --data_dir={empty}`"
          in str(e.value))

  from specdec_jax import run
  for row, prefix in (("t5_1_0_cnndm_small_t0", "summarize: "),
                      ("t5_1_0_ende_small_t0", "translate English to German: ")):
    exp = run.parse_config([str(REPO / f"configs/table2_t5_1_0/{row}.gin")], [
        f"Experiment.tfds_data_dir = '{root}'",
        f"VOCAB_PATH = '{REPO / 'checkpoints/demo/spm.model'}'",
        "Experiment.num_warmup = 1", "Experiment.num_examples = 2"])
    assert exp.prefix == prefix
    loaded = run.load_data(exp)
    written = ({a for a, _ in tfds_downloads.cnn_examples("test")} if "cnndm" in row
               else {en for en, _ in tfds_downloads.wmt_pairs("test")})
    assert len(loaded.examples) >= 2
    for ex, ids in zip(loaded.examples, loaded.inputs):
      assert ex.input in written  # the raw text, no prefix
      want = loaded.vocab.encode(prefix + ex.input)
      n = min(len(want), exp.max_input_len - 1)  # a truncated row ends in EOS
      assert list(ids[:n]) == want[:n]
