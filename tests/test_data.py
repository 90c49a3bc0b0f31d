"""Tests for specdec_jax.data (TF/seqio imported only in the last tests)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from specdec_jax import data

_WORDS = ("the quick brown fox jumps over lazy dog and cat thou art blessed "
     "unto them said lord king house river light day night").split()


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory):
  """A tiny SentencePiece model with T5's special ids (pad 0, eos 1, unk 2)."""
  import sentencepiece as spm

  d = tmp_path_factory.mktemp("spm")
  rng = np.random.default_rng(0)
  corpus = d / "corpus.txt"
  syllables = ["ka", "lo", "mi", "zu", "re", "th", "an", "ou", "st", "ing", "ed", "er"]
  made_up = ["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(200)]
  vocab_words = np.array(_WORDS + made_up)
  corpus.write_text("\n".join(" ".join(rng.choice(vocab_words, size=8)) + " ?!."
                for _ in range(400)))
  prefix = str(d / "tiny")
  spm.SentencePieceTrainer.Train(
    input=str(corpus), model_prefix=prefix, vocab_size=100, model_type="unigram",
    pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0,
    minloglevel=2)
  return prefix + ".model"


# ------------------------------- import hygiene ---------------------------- #

def test_import_does_not_pull_tensorflow_or_seqio():
  code = ("import specdec_jax.data, sys; "
      "assert 'tensorflow' not in sys.modules and 'seqio' not in sys.modules")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": repo}
  subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=repo)


# -------------------------------- local files ------------------------------ #

def test_load_tsv(tmp_path):
  p = tmp_path / "x.tsv"
  p.write_text("id\tinput\treference\na1\tIn the beginning\tAt first\n\n"
         "a2\tAnd God said\t\n")
  exs = data.load_local(str(p))
  assert exs == [data.Example("a1", "In the beginning", "At first"),
          data.Example("a2", "And God said", None)]
  assert len(data.load_local(str(p), max_examples=1)) == 1


def test_load_tsv_default_ids_and_custom_columns(tmp_path):
  p = tmp_path / "x.tsv"
  p.write_text("src\ntext one\ntext two\n")
  exs = data.load_local(str(p), input_key="src")
  assert [(e.id, e.input, e.reference) for e in exs] == [("2", "text one", None),
                             ("3", "text two", None)]


def test_load_jsonl(tmp_path):
  p = tmp_path / "x.jsonl"
  p.write_text(json.dumps({"id": 7, "input": "a", "reference": "b"}) + "\n"
         + json.dumps({"input": "c"}) + "\n")
  assert data.load_local(str(p)) == [data.Example("7", "a", "b"),
                    data.Example("2", "c", None)]


def test_load_local_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.tsv"):
    data.load_local(str(tmp_path / "nope.tsv"))
  with pytest.raises(ValueError, match=r"unknown extension '\.csv'"):
    data.load_local(str(tmp_path / "x.csv"))
  p = tmp_path / "cols.tsv"
  p.write_text("id\ttext\n1\thello\n")
  with pytest.raises(KeyError, match=r"'input'.*\['id', 'text'\]"):
    data.load_local(str(p))
  p = tmp_path / "empty.tsv"
  p.write_text("id\tinput\n1\thello\n2\t  \n")
  with pytest.raises(ValueError, match=r"empty\.tsv:3: empty"):
    data.load_local(str(p))
  p = tmp_path / "k.jsonl"
  p.write_text('{"input": "ok"}\n{"text": "x"}\n')
  with pytest.raises(KeyError, match=r"k\.jsonl:2.*'input'.*\['text'\]"):
    data.load_local(str(p))


def test_load_examples_dispatches_local(tmp_path):
  p = tmp_path / "x.jsonl"
  p.write_text('{"input": "a"}\n')
  assert data.load_examples(str(p)) == [data.Example("1", "a", None)]
  assert data.PREFIXES["bible_modernize"] == "modernize: "


# -------------------------------- vocabulary ------------------------------- #

def test_sentencepiece_vocab_conventions(spm_path):
  base = data.SentencePieceVocab(spm_path)
  v = data.get_vocabulary(spm_path, extra_ids=10)
  assert isinstance(v, data.Vocabulary)
  assert v.vocab_size == base.vocab_size + 10
  assert (v.pad_id, v.eos_id, v.unk_id) == (0, 1, 2)
  ids = v.encode("the quick fox")
  assert ids and 1 not in ids
  assert v.decode(ids) == "the quick fox"
  # Stops at EOS, ignores pad.
  assert v.decode([0] + ids + [1] + v.encode("dog") + [0, 0]) == "the quick fox"
  # <extra_id_0> is the top id, as in seqio/T5.
  assert v.encode("<extra_id_0>")[-1] == v.vocab_size - 1


def test_vocab_file_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="missing.model"):
    data.SentencePieceVocab(str(tmp_path / "missing.model"))
  bad = tmp_path / "bad.model"
  bad.write_bytes(b"\xff\x00 definitely not a protobuf \x12\x99")
  with pytest.raises(ValueError, match="bad.model"):
    data.SentencePieceVocab(str(bad))


def test_check_vocab_compatible():
  data.check_vocab_compatible(32128, 32128, target_pad_id=0, draft_pad_id=0)
  with pytest.raises(ValueError, match=r"t5-xxl=32128 != t5-small=32100"):
    data.check_vocab_compatible(32128, 32100, target_name="t5-xxl", draft_name="t5-small")
  with pytest.raises(ValueError, match=r"eos_id target=1 != draft=2"):
    data.check_vocab_compatible(10, 10, target_eos_id=1, draft_eos_id=2)


# ------------------------------ encode_batch ------------------------------- #

def test_encode_batch_shapes_and_truncation(spm_path):
  v = data.SentencePieceVocab(spm_path)
  short = "the dog"
  long = " ".join(["the quick brown fox"] * 10)
  arr, truncated = data.encode_batch(v, [short, long], max_len=12, prefix="king: ")
  assert arr.dtype == np.int32 and arr.shape == (2, 12)
  assert truncated == [1]
  n = len(v.encode("king: " + short)) + 1
  assert arr[0, n - 1] == 1 and (arr[0, n:] == 0).all()
  assert arr[1, -1] == 1 and 0 not in arr[1]
  no_eos, _ = data.encode_batch(v, [short], max_len=12, append_eos=False)
  assert 1 not in no_eos[0]
  with pytest.raises(ValueError, match=r"text #1 has \d+ tokens.*max_len=12"):
    data.encode_batch(v, [short, long], max_len=12, on_too_long="error")
  with pytest.raises(ValueError, match=r"text #0 is empty"):
    data.encode_batch(v, [""], max_len=12)
  with pytest.raises(ValueError, match="on_too_long"):
    data.encode_batch(v, [short], max_len=12, on_too_long="drop")


# ------------------------- seqio (imports TensorFlow) ---------------------- #

@pytest.mark.slow  # imports TensorFlow (the seqio extra)
def test_matches_seqio_vocabulary(spm_path):
  pytest.importorskip("seqio", reason="the seqio extra is not installed")
  import seqio

  texts = ["the quick brown fox", "thou art blessed unto them", "zebra?!",
       "river  light\tday", "<extra_id_0> dog <extra_id_3>"]
  for extra_ids in (0, 10):
    ours = data.get_vocabulary(spm_path, extra_ids=extra_ids)
    ref = seqio.SentencePieceVocabulary(spm_path, extra_ids=extra_ids)
    assert ours.vocab_size == ref.vocab_size
    assert (ours.pad_id, ours.eos_id, ours.unk_id) == (ref.pad_id, ref.eos_id, ref.unk_id)
    for t in texts:
      ids = ours.encode(t)
      assert ids == list(ref.encode(t)), t
      with_eos = ids + [1] + ids
      assert ours.decode(with_eos) == ref.decode(with_eos)
    top = list(range(ours.vocab_size - 3, ours.vocab_size))
    assert ours.decode(top) == ref.decode(top)


@pytest.mark.slow  # imports TensorFlow (the seqio extra)
def test_seqio_tasks(spm_path, tmp_path):
  pytest.importorskip("seqio", reason="the seqio extra is not installed")
  import seqio

  bible = tmp_path / "bible"
  bible.mkdir()
  for split in data.SPLITS:
    (bible / f"{split}.tsv").write_text(
      f"id\tinput\treference\n{split}1\tthou art\tyou are\n{split}2\tunto them\tto them\n")
  names = data.register_tasks(vocab_path=spm_path, extra_ids=0, bible_dir=str(bible))
  assert data.register_tasks(vocab_path=spm_path, extra_ids=0, bible_dir=str(bible)) == names
  assert set(names) <= set(seqio.TaskRegistry.names())

  exs = data.load_examples("seqio:specdec_bible_modernize", split="validation")
  assert exs == [data.Example("validation1", "thou art", "you are"),
          data.Example("validation2", "unto them", "to them")]
  assert len(data.load_seqio_examples("specdec_bible_modernize", "test", 1)) == 1

  # The full task adds the prefix and tokenizes with the given vocab.
  ds = seqio.get_mixture_or_task("specdec_bible_modernize").get_dataset(
    sequence_length=None, split="test", shuffle=False)
  first = next(ds.as_numpy_iterator())
  v = data.SentencePieceVocab(spm_path)
  assert list(first["inputs"]) == v.encode("modernize: thou art") + [1]

  empty = tmp_path / "tfds"
  empty.mkdir()
  with pytest.raises(FileNotFoundError) as e:
    data.load_seqio_examples("specdec_wmt_ende", "test", 5, data_dir=str(empty))
  msg = str(e.value)
  for part in ("wmt_t2t_translate/de-en", "1.0.0", str(empty), "data_dir argument",
         "tfds build"):
    assert part in msg

  # With "prepared" data (TFDS mock) the TFDS tasks map their fields to raw text.
  import tensorflow_datasets as tfds
  for task, name in (("specdec_wmt_ende", "wmt_t2t_translate/de-en/1.0.0"),
            ("specdec_cnn_dailymail", "cnn_dailymail/3.4.0")):
    (empty / name).mkdir(parents=True)
    (empty / name / "dataset_info.json").write_text("{}")
    with tfds.testing.mock_data(num_examples=3):
      exs = data.load_examples(f"seqio:{task}", "test", 2, data_dir=str(empty))
    assert [e.id for e in exs] == ["test-0", "test-1"]
    assert all(e.input and e.reference for e in exs)
    assert not exs[0].input.startswith(("translate", "summarize"))

  with pytest.raises(KeyError, match="unknown seqio task"):
    data.load_seqio_examples("specdec_nope", "test")


@pytest.mark.slow  # imports TensorFlow (the seqio extra)
def test_the_seqio_path_hides_accelerators_from_tensorflow(monkeypatch):
  """TensorFlow, which seqio runs on, must not claim the GPUs JAX decodes on:
  every seqio/TensorFlow import through the data module hides them first."""
  pytest.importorskip("seqio", reason="the seqio extra is not installed")
  import tensorflow as tf
  from specdec_jax import data
  calls = []
  monkeypatch.setattr(tf.config, "set_visible_devices",
                      lambda devices, kind: calls.append((list(devices), kind)))
  data.import_optional("seqio", "this test")
  assert ([], "GPU") in calls and ([], "TPU") in calls
