"""Data: examples from ``.tsv`` / ``.jsonl`` files (local or ``gs://``) or the specdec
seqio tasks (TensorFlow imported only there), vocabularies, fixed-shape batches.
``Example.input`` is the raw text; ``encode_batch`` adds the task prefix."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np
from absl import logging

from specdec_jax import storage

# Task prefixes of the T5 paper (and of our demo task).
PREFIXES: dict[str, str] = {
  "wmt_ende": "translate English to German: ",
  "cnn_dailymail": "summarize: ",
  "bible_modernize": "modernize: ",
}

# Default T5 vocabulary (needs GCS access; pass an explicit local path offline).
T5_VOCAB_PATH = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"

# seqio/T5 special ids.
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2

TASK_PREFIX = "specdec_"
WMT_TFDS_NAME = "wmt_t2t_translate/de-en:1.0.0"
CNN_TFDS_NAME = "cnn_dailymail:3.4.0"
# The datasets `python -m specdec_jax.prepare_data --dataset=KEY` builds.
TFDS_DATASETS: dict[str, str] = {"wmt_ende": WMT_TFDS_NAME, "cnn_dailymail": CNN_TFDS_NAME}
SPLITS = ("train", "validation", "test")
DEFAULT_BIBLE_DIR = str(Path(__file__).resolve().parent.parent / "data" / "bible")


@dataclasses.dataclass(frozen=True)
class Example:
  """One source text with an optional reference output."""

  id: str
  input: str
  reference: Optional[str]


def _check_max_examples(max_examples: Optional[int]) -> None:
  if max_examples is not None and max_examples < 0:
    raise ValueError(f"max_examples must be >= 0 or None, got {max_examples}")


def _make_example(path: str, line_no: int, raw_id: Any, text: Any, reference: Any) -> Example:
  """One validated record; ``line_no`` (1-based) is the default id."""
  if not isinstance(text, str) or not text.strip():
    raise ValueError(f"{path}:{line_no}: empty or non-string input text: {text!r}")
  if reference is not None and not isinstance(reference, str):
    raise ValueError(f"{path}:{line_no}: reference must be a string, got {reference!r}")
  ex_id = str(line_no) if raw_id is None or raw_id == "" else str(raw_id)
  # An empty reference cell means "no reference", not "the empty string".
  return Example(id=ex_id, input=text, reference=reference or None)


def _read_tsv(path: str, input_key: str, reference_key: str, id_key: str,
              max_examples: Optional[int]) -> list[Example]:
  lines = storage.read_text(path, "examples file").splitlines()
  if not lines or not lines[0].strip():
    raise ValueError(f"{path}: missing TSV header line (expected columns like "
             f"'{id_key}\\t{input_key}\\t{reference_key}')")
  columns = lines[0].split("\t")
  if input_key not in columns:
    raise KeyError(f"{path}: required column {input_key!r} not in header; columns found: {columns}")
  col = {name: i for i, name in enumerate(columns)}
  examples: list[Example] = []
  for line_no, line in enumerate(lines[1:], start=2):
    if max_examples is not None and len(examples) >= max_examples:
      break
    if not line.strip():
      continue  # tolerate blank lines, e.g. a trailing one
    cells = line.split("\t")
    if len(cells) != len(columns):
      raise ValueError(f"{path}:{line_no}: expected {len(columns)} tab-separated "
               f"fields {columns}, found {len(cells)}")
    get = lambda key: cells[col[key]] if key in col else None  # noqa: E731
    examples.append(_make_example(path, line_no, get(id_key), get(input_key), get(reference_key)))
  return examples


def _json_records(path: str) -> Iterable[tuple[int, Any]]:
  """(line_no, record) for JSON Lines, or a top-level JSON array."""
  content = storage.read_text(path, "examples file")
  if content.lstrip().startswith("["):
    try:
      records = json.loads(content)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: invalid JSON array: {e}") from e
    yield from enumerate(records, start=1)
    return
  for line_no, line in enumerate(content.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      yield line_no, json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{line_no}: invalid JSON: {e}") from e


def _read_jsonl(path: str, input_key: str, reference_key: str, id_key: str,
                max_examples: Optional[int]) -> list[Example]:
  examples: list[Example] = []
  for line_no, record in _json_records(path):
    if max_examples is not None and len(examples) >= max_examples:
      break
    if not isinstance(record, dict):
      raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
    if input_key not in record:
      raise KeyError(f"{path}:{line_no}: required key {input_key!r} missing; "
              f"keys found: {sorted(record)}")
    examples.append(_make_example(path, line_no, record.get(id_key),
                   record[input_key], record.get(reference_key)))
  return examples


_LOCAL_READERS = {".tsv": _read_tsv, ".jsonl": _read_jsonl, ".json": _read_jsonl}


def load_local(path: str, input_key: str = "input", reference_key: str = "reference",
               id_key: str = "id", max_examples: Optional[int] = None) -> list[Example]:
  """Examples from a ``.tsv`` (with header) or ``.jsonl`` file, local or ``gs://``; a
  missing id is the 1-based line number; ``.json`` may also be an array."""
  _check_max_examples(max_examples)
  ext = os.path.splitext(path)[1].lower()
  if ext not in _LOCAL_READERS:
    raise ValueError(f"{path}: unknown extension {ext!r}; expected one of {sorted(_LOCAL_READERS)}")
  if not storage.is_gcs(path) and not os.path.isfile(path):
    raise FileNotFoundError(f"examples file not found: {path}")
  return _LOCAL_READERS[ext](path, input_key, reference_key, id_key, max_examples)


@runtime_checkable
class Vocabulary(Protocol):
  """What decoding needs from a tokenizer (seqio conventions)."""

  vocab_size: int
  pad_id: int
  eos_id: int
  unk_id: int

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


SEQIO_INSTALL = 'pip install -e ".[seqio]"'
_SEQIO_MODULES = ("seqio", "tensorflow", "tensorflow_datasets")


def import_optional(module: str, needed_by: str) -> Any:
  """``import module`` (the ``seqio`` extra), or an ImportError naming the install command."""
  try:
    imported = importlib.import_module(module)
  except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in _SEQIO_MODULES:
      raise  # installed, but one of its own imports is missing
    what = {"seqio": "seqio", "tensorflow_datasets": "TensorFlow Datasets"}.get(module,
                                                                               "TensorFlow")
    raise ImportError(f"{what} is not installed: {SEQIO_INSTALL} ({needed_by} needs "
                      "it)") from None
  hide_accelerators_from_tensorflow()
  return imported


def hide_accelerators_from_tensorflow() -> None:
  """Keep TensorFlow off the GPU/TPU (before it first touches one): JAX decodes there."""
  tf = importlib.import_module("tensorflow")
  for kind in ("GPU", "TPU"):
    try:
      tf.config.set_visible_devices([], kind)
    except (RuntimeError, ValueError):
      pass  # devices already initialized, or no such device type in this build


def _read_bytes(path: str) -> bytes:
  if "://" in path and not storage.is_gcs(path):
    # Other remote schemes need TF's file systems; local and gs:// paths do not.
    tf = import_optional("tensorflow", f"the remote path {path!r}")
    if not tf.io.gfile.exists(path):
      raise FileNotFoundError(f"SentencePiece model not found: {path}")
    with tf.io.gfile.GFile(path, "rb") as f:
      return f.read()
  return storage.read_bytes(path, "SentencePiece model")


@functools.lru_cache(maxsize=8)
def _load_sp_processor(path: str, extra_ids: int):
  """A SentencePiece model with ``extra_ids`` sentinels appended as seqio does
  ("▁<extra_id_i>" in reverse, so <extra_id_0> is vocab_size - 1)."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  from google.protobuf.message import DecodeError  # pylint: disable=g-import-not-at-top
  from sentencepiece import sentencepiece_model_pb2 as pb2  # pylint: disable=g-import-not-at-top

  raw = _read_bytes(path)
  try:
    proto = pb2.ModelProto.FromString(raw)
  except DecodeError as e:
    raise ValueError(f"not a valid SentencePiece model (corrupt?): {path}: {e}") from e
  if not proto.pieces:
    raise ValueError(f"not a valid SentencePiece model (no pieces): {path}")
  for i in reversed(range(extra_ids)):
    proto.pieces.add(piece=f"▁<extra_id_{i}>", score=0.0,
             type=pb2.ModelProto.SentencePiece.USER_DEFINED)
  processor = spm.SentencePieceProcessor()
  try:
    processor.LoadFromSerializedProto(proto.SerializeToString())
  except (RuntimeError, OSError) as e:
    raise ValueError(f"SentencePiece could not load model {path}: {e}") from e
  return processor


class SentencePieceVocab:
  """SentencePiece with seqio's conventions, without TF/seqio: vocab_size = pieces +
  extra_ids (T5's cc_all.32000 + 100 = 32128); pad 0, eos 1, unk 2."""

  def __init__(self, path: str, extra_ids: int = 0):
    if extra_ids < 0:
      raise ValueError(f"extra_ids must be >= 0, got {extra_ids}")
    self.path = path
    self.extra_ids = extra_ids
    self._sp = _load_sp_processor(path, extra_ids)
    if self._sp.pad_id() != PAD_ID:
      logging.warning("SentencePiece model %s has pad_id=%d; T5/seqio use %d",
              path, self._sp.pad_id(), PAD_ID)
    # seqio fixes PAD at 0 regardless of the model's own setting.
    self.vocab_size, self.pad_id, self.eos_id, self.unk_id = (
        int(self._sp.GetPieceSize()), PAD_ID, int(self._sp.eos_id()), int(self._sp.unk_id()))

  def encode(self, text: str) -> list[int]:
    """Text -> ids, without EOS (as seqio's ``encode``)."""
    return list(self._sp.EncodeAsIds(text))

  def decode(self, ids: Sequence[int]) -> str:
    """Ids -> text, up to the first EOS; pad is dropped, out-of-range -> unk."""
    clean: list[int] = []
    for i in (int(x) for x in ids):
      if i == self.eos_id:
        break
      if i == self.pad_id:
        continue
      clean.append(i if 0 <= i < self.vocab_size else self.unk_id)
    return self._sp.DecodeIds(clean)

  def __repr__(self) -> str:
    return f"SentencePieceVocab({self.path!r}, extra_ids={self.extra_ids})"


def get_vocabulary(path: str, extra_ids: int = 0) -> Vocabulary:
  """The SentencePiece vocabulary at ``path`` (local or gs://; no TensorFlow)."""
  return SentencePieceVocab(path, extra_ids=extra_ids)


def check_vocab_compatible(target_vocab_size: int, draft_vocab_size: int,
                           target_name: str = "target", draft_name: str = "draft",
                           target_pad_id: Optional[int] = None, draft_pad_id: Optional[int] = None,
                           target_eos_id: Optional[int] = None,
                           draft_eos_id: Optional[int] = None) -> None:
  """ValueError unless target and draft share the token set (vocab_size, pad and eos ids)."""
  problems = []
  if target_vocab_size != draft_vocab_size:
    problems.append(f"vocab_size {target_name}={target_vocab_size} != "
            f"{draft_name}={draft_vocab_size}")
  for what, t, d in (("pad_id", target_pad_id, draft_pad_id),
            ("eos_id", target_eos_id, draft_eos_id)):
    if t is not None and d is not None and t != d:
      problems.append(f"{what} {target_name}={t} != {draft_name}={d}")
  if problems:
    raise ValueError(f"{target_name} and {draft_name} vocabularies are incompatible "
             f"(speculative decoding needs p and q over the same tokens): "
             + "; ".join(problems))


def encode_batch(vocab: Vocabulary, texts: list[str], max_len: int, prefix: str = "",
                 on_too_long: str = "truncate", append_eos: bool = True,
                 ids: Optional[Sequence[str]] = None) -> tuple[np.ndarray, list[int]]:
  """``prefix + text`` per text as int32 [B, max_len], right-padded -> (array, truncated
  rows). Over-long rows are truncated (EOS kept) or rejected (``on_too_long='error'``)."""
  if on_too_long not in ("truncate", "error"):
    raise ValueError(f"on_too_long must be 'truncate' or 'error', got {on_too_long!r}")
  min_len = 2 if append_eos else 1
  if max_len < min_len:
    raise ValueError(f"max_len must be >= {min_len} (append_eos={append_eos}), got {max_len}")
  out = np.full((len(texts), max_len), vocab.pad_id, dtype=np.int32)
  truncated: list[int] = []
  for b, text in enumerate(texts):
    name = f"text #{b}" if ids is None else f"example id={ids[b]!r}"
    if not isinstance(text, str) or not text.strip():
      raise ValueError(f"{name} is empty or not a string: {text!r}")
    tokens = vocab.encode(prefix + text) + ([vocab.eos_id] if append_eos else [])
    if len(tokens) > max_len:
      if on_too_long == "error":
        raise ValueError(f"{name} has {len(tokens)} tokens (incl. prefix"
                 f"{' and EOS' if append_eos else ''}) > max_len={max_len}")
      logging.warning("Truncating %s from %d to %d tokens", name, len(tokens), max_len)
      tokens = (tokens[: max_len - 1] + [vocab.eos_id]) if append_eos else tokens[:max_len]
      truncated.append(b)
    out[b, : len(tokens)] = tokens
  return out, truncated


def check_input_buckets(buckets: Sequence[int], max_len: int, what: str = "input_buckets") -> None:
  """Buckets must be strictly increasing ints in [1, max_len]."""
  if any(not isinstance(n, (int, np.integer)) or isinstance(n, bool) or not 1 <= n <= max_len
         for n in buckets) or list(buckets) != sorted(set(buckets)):
    raise ValueError(f"{what} must be strictly increasing ints in [1, max_input_len={max_len}], "
                     f"got {tuple(buckets)!r}")


def by_width(arrays: Sequence[Any]) -> dict[int, list[int]]:
  """Indices of ``arrays`` ([B, L] each) grouped by width L (one compiled program each)."""
  groups: dict[int, list[int]] = {}
  for i, x in enumerate(arrays):
    groups.setdefault(int(np.shape(x)[-1]), []).append(i)
  return groups


def fit_to_bucket(inputs: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
  """inputs [B, S] cut to [B, L], L the smallest bucket (else S) holding every row's
  tokens (() -> unchanged): only masked padding goes, so the outputs are the same."""
  if not len(buckets):
    return inputs
  nonzero = np.nonzero(np.any(np.asarray(inputs) != 0, axis=0))[0]
  used = int(nonzero[-1]) + 1 if len(nonzero) else 1
  length = next((n for n in buckets if n >= used), inputs.shape[1])
  return inputs[:, :min(length, inputs.shape[1])]


# name -> registration config, to make register_tasks idempotent.
_REGISTERED: dict[str, tuple] = {}


def _select_fields(dataset, input_key: str, target_key: str, id_key: Optional[str] = None):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def fn(ex):
    out = {"inputs": ex[input_key], "targets": ex[target_key]}
    if id_key:
      out["id"] = ex[id_key]
    return out

  return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)


def _add_prefix(dataset, prefix: str):
  """Prepends the T5 task prefix to 'inputs' (the last text preprocessor)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def fn(ex):
    return {**ex, "inputs": tf.strings.join([prefix, ex["inputs"]])}

  return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)


def _bible_dataset_fn(split: str, shuffle_files: bool, seed: Optional[int] = None, *,
           bible_dir: str):
  del shuffle_files, seed  # one file per split: nothing to shuffle
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  examples = load_local(os.path.join(bible_dir, f"{split}.tsv"))
  column = lambda xs: tf.constant(xs, dtype=tf.string, shape=[len(xs)])  # noqa: E731
  return tf.data.Dataset.from_tensor_slices({
    "id": column([e.id for e in examples]),
    "input": column([e.input for e in examples]),
    "reference": column([e.reference or "" for e in examples]),
  })


def register_tasks(vocab_path: Optional[str] = None, extra_ids: int = 100,
                   bible_dir: Optional[str] = None) -> list[str]:
  """Register the specdec seqio tasks (idempotent; other arguments replace them) -> names."""
  seqio = import_optional("seqio", "register_tasks (the specdec seqio tasks)")

  vocab_path = vocab_path or T5_VOCAB_PATH
  bible_dir = bible_dir or DEFAULT_BIBLE_DIR
  vocab = seqio.SentencePieceVocabulary(vocab_path, extra_ids=extra_ids)
  features = {k: seqio.Feature(vocabulary=vocab, add_eos=True) for k in ("inputs", "targets")}
  specs = {
    f"{TASK_PREFIX}wmt_ende": (
      seqio.TfdsDataSource(tfds_name=WMT_TFDS_NAME, splits=SPLITS),
      dict(input_key="en", target_key="de"), PREFIXES["wmt_ende"]),
    f"{TASK_PREFIX}cnn_dailymail": (
      seqio.TfdsDataSource(tfds_name=CNN_TFDS_NAME, splits=SPLITS),
      dict(input_key="article", target_key="highlights"), PREFIXES["cnn_dailymail"]),
    f"{TASK_PREFIX}bible_modernize": (
      seqio.FunctionDataSource(
        functools.partial(_bible_dataset_fn, bible_dir=bible_dir), splits=SPLITS),
      dict(input_key="input", target_key="reference", id_key="id"), PREFIXES["bible_modernize"]),
  }
  config = (vocab_path, extra_ids, bible_dir)
  for name, (source, keys, prefix) in specs.items():
    if _REGISTERED.get(name) == config and name in seqio.TaskRegistry.names():
      continue
    if name in seqio.TaskRegistry.names():
      seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(
        name, source=source, output_features=features, metric_fns=[],
        preprocessors=[functools.partial(_select_fields, **keys),
                       functools.partial(_add_prefix, prefix=prefix),
                       seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim])
    _REGISTERED[name] = config
  return list(specs)


def _resolve_tfds_data_dir(data_dir: Optional[str]) -> tuple[str, str]:
  """Returns (directory, how it was chosen) following TFDS's own precedence."""
  if data_dir:
    return data_dir, "the data_dir argument"
  if os.environ.get("TFDS_DATA_DIR"):
    return os.environ["TFDS_DATA_DIR"], "$TFDS_DATA_DIR"
  return os.path.expanduser("~/tensorflow_datasets"), "the TFDS default (TFDS_DATA_DIR unset)"


def _check_tfds_prepared(tfds_name: str, data_dir: str, how: str) -> None:
  """FileNotFoundError with preparation instructions if the TFDS data is absent."""
  name, _, version = tfds_name.partition(":")
  version_dir = storage.join(data_dir, *name.split("/"), version)
  if storage.is_file(storage.join(version_dir, "dataset_info.json")):
    return
  ours = [k for k, v in TFDS_DATASETS.items() if v == tfds_name]
  command = f"`tfds build {name} --data_dir={data_dir}`"
  if ours:
    command = (f"`python -m specdec_jax.prepare_data --dataset={ours[0]} "
               f"--data_dir={data_dir}` (TFDS's own {command} does the same)")
  raise FileNotFoundError(
    f"TFDS dataset {name} version {version} is not prepared: looked for "
    f"{version_dir}/dataset_info.json (data dir {data_dir!r} from {how}). "
    f"Prepare it once, where the network is reachable: {command}; then bind "
    f"Experiment.tfds_data_dir (data_dir=) to that directory or set TFDS_DATA_DIR.")


def _text_preprocessors(task) -> list:
  """The task's preprocessors before the prefix step (raw text, no tokens)."""
  steps = []
  for fn in task.preprocessors:
    if getattr(fn, "func", None) is _add_prefix:
      return steps
    steps.append(fn)
  raise ValueError(f"seqio task {task.name!r} was not registered by register_tasks "
           f"(no _add_prefix step); cannot extract raw text")


def load_seqio_examples(task_name: str, split: str, max_examples: Optional[int] = None,
                        data_dir: Optional[str] = None) -> list[Example]:
  """Raw text examples of a specdec seqio task (no prefix, no tokens)."""
  seqio = import_optional("seqio", f"the source 'seqio:{task_name}'")

  _check_max_examples(max_examples)
  if task_name not in seqio.TaskRegistry.names():
    if task_name.startswith(TASK_PREFIX):
      register_tasks()
    if task_name not in seqio.TaskRegistry.names():
      raise KeyError(f"unknown seqio task {task_name!r}; registered specdec tasks: "
              f"{sorted(n for n in seqio.TaskRegistry.names() if n.startswith(TASK_PREFIX))}")
  task = seqio.get_mixture_or_task(task_name)
  source = task.source
  if split not in source.splits:
    raise ValueError(f"task {task_name!r} has no split {split!r}; splits: {sorted(source.splits)}")
  if isinstance(source, seqio.TfdsDataSource):
    tfds_name = source.tfds_dataset.name
    resolved, how = _resolve_tfds_data_dir(data_dir)
    _check_tfds_prepared(tfds_name, resolved, how)
    source = seqio.TfdsDataSource(tfds_name=tfds_name, tfds_data_dir=resolved, splits=SPLITS)
  dataset = source.get_dataset(split=split, shuffle=False)
  for fn in _text_preprocessors(task):
    dataset = fn(dataset)
  if max_examples is not None:
    dataset = dataset.take(max_examples)
  text = lambda v: v.decode("utf-8") if isinstance(v, bytes) else str(v)  # noqa: E731
  examples = []
  for i, ex in enumerate(dataset.as_numpy_iterator()):
    ex_id = text(ex["id"]) if "id" in ex else f"{split}-{i}"
    examples.append(Example(id=ex_id, input=text(ex["inputs"]),
                reference=text(ex["targets"]) or None))
  return examples


def load_examples(source: str, split: str = "test", max_examples: Optional[int] = None,
                  data_dir: Optional[str] = None, input_key: str = "input",
                  reference_key: str = "reference", id_key: str = "id") -> list[Example]:
  """Raw examples from ``seqio:<task_name>`` or a .tsv/.jsonl path."""
  if source.startswith("seqio:"):
    task_name = source[len("seqio:"):]
    if not task_name:
      raise ValueError(f"empty task name in source {source!r}; "
               f"use e.g. 'seqio:{TASK_PREFIX}wmt_ende'")
    return load_seqio_examples(task_name, split, max_examples, data_dir=data_dir)
  return load_local(source, input_key=input_key, reference_key=reference_key,
           id_key=id_key, max_examples=max_examples)
