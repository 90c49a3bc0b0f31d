"""Hugging Face T5 directories: loading, config conversion and the name map.
HF's Linear weights [out, in] and relative biases [buckets, H] are the transposes of
our kernels and ``rel_embedding``; a slice of ours is read transposed from HF's."""

from __future__ import annotations

import collections
import functools
import io
import json
import pickle
import struct
import zipfile
from typing import Any, Mapping, Optional

import ml_dtypes
import numpy as np

from specdec_jax import storage
from specdec_jax.checkpoints import placement
from specdec_jax.checkpoints.common import (HF_WEIGHT_FILES, CheckpointError,
                                            CheckpointNotFoundError, check_shapes, few, is_gcs,
                                            join, read_bytes, read_json, reconcile_config)
from specdec_jax.models.t5 import T5Config
from specdec_jax.partitioning import Partitioner


def hf_config_to_t5(hf: Mapping[str, Any], dtype: str = "float32",
                    source: str = "config.json") -> T5Config:
  """Our T5Config from a Hugging Face T5 ``config.json`` dict. T5 1.0: ReLU, logits via
  the embedding scaled by 1/sqrt(d_model); 1.1: gated-GELU, unscaled. Transformers 5.x
  writes ``scale_decoder_outputs`` (which wins), 4.x ``tie_word_embeddings``."""
  model_type = hf.get("model_type", "t5")
  if model_type not in ("t5", "mt5"):
    raise CheckpointError(f"{source}: model_type {model_type!r} is not supported "
                          "(only 't5' and 'mt5')")
  ff = hf.get("feed_forward_proj", "relu")
  scaled = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
  if ff == "relu" and scaled:
    version = "1.0"
  elif ff == "gated-gelu" and not scaled:
    version = "1.1"
  else:
    raise CheckpointError(
        f"{source}: unsupported combination feed_forward_proj={ff!r} with "
        f"{'scaled' if scaled else 'unscaled'} decoder outputs; supported: 'relu' with "
        "tied/scaled logits (T5 1.0) or 'gated-gelu' untied/unscaled (T5 1.1)")
  try:
    num_layers = int(hf["num_layers"])
    fields = dict(
        vocab_size=int(hf["vocab_size"]), d_model=int(hf["d_model"]),
        num_heads=int(hf["num_heads"]), head_dim=int(hf["d_kv"]), num_encoder_layers=num_layers,
        num_decoder_layers=int(hf.get("num_decoder_layers") or num_layers),
        d_ff=int(hf["d_ff"]), version=version,
        relative_attention_num_buckets=int(hf.get("relative_attention_num_buckets", 32)),
        relative_attention_max_distance=int(hf.get("relative_attention_max_distance", 128)),
        layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-6)), dtype=dtype)
  except KeyError as e:
    raise CheckpointError(f"{source}: missing required key {e.args[0]!r}") from e
  eos = hf.get("eos_token_id", 1)
  if isinstance(eos, list):  # generation configs sometimes list several
    eos = eos[0]
  pad = hf.get("pad_token_id")
  pad = 0 if pad is None else int(pad)
  start = hf.get("decoder_start_token_id")
  return T5Config(**fields, pad_id=pad, eos_id=int(1 if eos is None else eos),
                  decoder_start_id=pad if start is None else int(start))


# HF keys that alias other weights (tied embeddings) or that HF itself ignores.
HF_IGNORED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
              "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight")


def hf_name_map(config: T5Config) -> dict[str, tuple[str, bool]]:
  """{our param name: (HF state-dict key, transpose?)} for a config."""
  names: dict[str, tuple[str, bool]] = {
      "token_embedder/embedding": ("shared.weight", False),
      "encoder/relpos_bias/rel_embedding":
          ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", True),
      "decoder/relpos_bias/rel_embedding":
          ("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", True),
      "encoder/encoder_norm/scale": ("encoder.final_layer_norm.weight", False),
      "decoder/decoder_norm/scale": ("decoder.final_layer_norm.weight", False),
  }
  if not config.logits_via_embedding:
    names["decoder/logits_dense/kernel"] = ("lm_head.weight", True)
  mlp = ("wi_0", "wi_1", "wo") if config.gated else ("wi", "wo")
  qkvo = (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))

  def attention(ours: str, hf: str) -> None:
    for o, h in qkvo:
      names[f"{ours}/{o}/kernel"] = (f"{hf}.{h}.weight", True)

  def block(ours: str, hf: str) -> None:
    names[f"{ours}/mlp/wo/kernel"] = (f"{hf}.DenseReluDense.wo.weight", True)
    for w in mlp[:-1]:
      names[f"{ours}/mlp/{w}/kernel"] = (f"{hf}.DenseReluDense.{w}.weight", True)
    names[f"{ours}/pre_mlp_layer_norm/scale"] = (f"{hf}.layer_norm.weight", False)

  for i in range(config.num_encoder_layers):
    o, h = f"encoder/layers_{i}", f"encoder.block.{i}.layer"
    attention(f"{o}/attention", f"{h}.0.SelfAttention")
    names[f"{o}/pre_attention_layer_norm/scale"] = (f"{h}.0.layer_norm.weight", False)
    block(o, f"{h}.1")
  for i in range(config.num_decoder_layers):
    o, h = f"decoder/layers_{i}", f"decoder.block.{i}.layer"
    attention(f"{o}/self_attention", f"{h}.0.SelfAttention")
    names[f"{o}/pre_self_attention_layer_norm/scale"] = (f"{h}.0.layer_norm.weight", False)
    attention(f"{o}/encoder_decoder_attention", f"{h}.1.EncDecAttention")
    names[f"{o}/pre_cross_attention_layer_norm/scale"] = (f"{h}.1.layer_norm.weight", False)
    block(o, f"{h}.2")
  return names


class SafetensorsFile:
  """One .safetensors file: local tensors memory-mapped, remote ones fetched once each."""

  DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
            "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
            "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}

  def __init__(self, path: str):
    self.path = path
    try:
      n = int.from_bytes(storage.read_range(path, 0, 8), "little")
      self._start = 8 + n
      header = json.loads(storage.read_range(path, 8, self._start))
    except (ValueError, TypeError) as e:  # a torn or foreign file
      raise CheckpointError(f"{path}: cannot read safetensors header: {e}") from e
    header.pop("__metadata__", None)
    self._header = header
    self.shapes = {k: tuple(v["shape"]) for k, v in header.items()}
    unknown = sorted({v["dtype"] for v in header.values()} - set(self.DTYPES))
    if unknown:
      raise CheckpointError(f"{path}: unsupported safetensors dtype(s) {unknown}")

  def slice_reader(self, key: str) -> placement.SliceReader:
    entry = self._header[key]
    begin, end = entry["data_offsets"]
    dtype = np.dtype(self.DTYPES[entry["dtype"]]).newbyteorder("<")
    if not is_gcs(self.path):
      try:
        mapped = np.memmap(self.path, dtype=dtype, mode="r", offset=self._start + begin,
                           shape=self.shapes[key])
      except ValueError as e:  # the file ends before the tensor does
        raise CheckpointError(f"{self.path}: cannot read tensor {key}: {e}") from e
      return lambda index: np.array(mapped[index])  # a copy: never alias the mapped file
    held: list[np.ndarray] = []

    def read(index: placement.Index) -> np.ndarray:
      if not held:
        raw = storage.read_range(self.path, self._start + begin, self._start + end)
        held.append(np.frombuffer(raw, dtype=dtype).reshape(self.shapes[key]))
      return np.array(held[0][index])
    return read


# PyTorch's storage classes in a pytorch_model.bin, by the numpy dtype they hold.
TORCH_STORAGES = {"FloatStorage": np.float32, "HalfStorage": np.float16,
                  "BFloat16Storage": ml_dtypes.bfloat16, "DoubleStorage": np.float64,
                  "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16,
                  "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_}


class _TorchUnpickler(pickle.Unpickler):
  """A pytorch_model.bin's pickle without torch; any global but tensors is refused."""

  def find_class(self, module: str, name: str) -> Any:
    if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
      return lambda storage, offset, shape, strides, *_: (*storage, offset, tuple(shape),
                                                          tuple(strides))
    if module == "torch" and name in TORCH_STORAGES:
      return TORCH_STORAGES[name]
    if (module, name) == ("collections", "OrderedDict"):
      return collections.OrderedDict
    raise pickle.UnpicklingError(f"{module}.{name} is not a tensor, a storage or a dict")

  def persistent_load(self, pid: Any) -> tuple[str, Any]:
    kind, storage_type, key = pid[:3]
    if kind != "storage":
      raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
    return str(key), np.dtype(storage_type)


class TorchBinFile:
  """A zip-format pytorch_model.bin read without torch, its storages memory-mapped."""

  def __init__(self, path: str):
    self.path = path
    try:
      with zipfile.ZipFile(path) as z:
        names = z.namelist()
        pkl = next(n for n in names if n.endswith("/data.pkl") or n == "data.pkl")
        root = pkl[:-len("data.pkl")]
        order = root + "byteorder"
        if order in names and z.read(order).decode().strip() != "little":
          raise CheckpointError(f"{path}: big-endian PyTorch checkpoints are not supported")
        state = _TorchUnpickler(io.BytesIO(z.read(pkl))).load()
        self._members = {n[len(root) + len("data/"):]: z.getinfo(n) for n in names
                         if n.startswith(root + "data/")}
    except (zipfile.BadZipFile, StopIteration) as e:
      raise CheckpointError(f"{path}: not a zip-format PyTorch checkpoint (saved by torch < "
                            "1.6?); convert it to safetensors") from e
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
      raise CheckpointError(f"{path}: cannot read PyTorch checkpoint: {e}") from e
    self._tensors = dict(state)
    self.shapes = {k: v[3] for k, v in self._tensors.items()}

  def _storage(self, key: str, dtype: np.dtype) -> np.ndarray:
    info = self._members[key]
    if info.file_size == 0:
      return np.zeros((0,), dtype)
    if info.compress_type != zipfile.ZIP_STORED:
      raise CheckpointError(f"{self.path}: storage {key} is compressed; re-save the file")
    with open(self.path, "rb") as f:   # the local header's lengths give the data's offset
      f.seek(info.header_offset + 26)
      name_len, extra_len = struct.unpack("<HH", f.read(4))
    start = info.header_offset + 30 + name_len + extra_len
    return np.memmap(self.path, dtype=dtype, mode="r", offset=start,
                     shape=(info.file_size // dtype.itemsize,))

  def slice_reader(self, key: str) -> placement.SliceReader:
    storage_key, dtype, offset, shape, strides = self._tensors[key]
    flat = self._storage(storage_key, dtype)
    tensor = np.lib.stride_tricks.as_strided(
        flat[offset:], shape=shape, strides=tuple(s * dtype.itemsize for s in strides),
        writeable=False)
    # Copy: a device buffer must not alias the mapped file.
    return lambda index: np.array(tensor[index])


def _hf_weight_files(path: str) -> list[str]:
  for single, index in (("model.safetensors", "model.safetensors.index.json"),
                        ("pytorch_model.bin", "pytorch_model.bin.index.json")):
    if storage.is_file(join(path, single)):
      return [join(path, single)]
    index_path = join(path, index)
    if storage.is_file(index_path):
      try:
        weight_map = json.loads(read_bytes(index_path))["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{index_path}: invalid shard index: {e}") from e
      return [join(path, f) for f in sorted(set(weight_map.values()))]
  raise CheckpointNotFoundError(f"{path}: no Hugging Face weights ({', '.join(HF_WEIGHT_FILES)})")


def _open_weight_file(file_path: str) -> Any:
  if not storage.is_file(file_path):
    raise CheckpointNotFoundError(f"{file_path}: weight shard listed in the index is missing")
  if file_path.endswith(".safetensors"):
    return SafetensorsFile(file_path)
  if is_gcs(file_path):
    raise CheckpointError(f"{file_path}: PyTorch .bin weights cannot be read from Cloud "
                          "Storage (they are memory-mapped from a local file); convert them to "
                          "safetensors or copy the directory to a local disk")
  return TorchBinFile(file_path)


def _transposed_reader(f: Any, key: str) -> placement.SliceReader:
  read = f.slice_reader(key)
  return lambda index: read(tuple(reversed(index))).T


def load_hf(path: str, config: Optional[T5Config], param_dtype: Any,
            partitioner: Optional[Partitioner] = None) -> tuple[dict, T5Config]:
  config_path = join(path, "config.json")
  hf_cfg = read_json(config_path)
  stored = hf_config_to_t5(hf_cfg, source=config_path)
  config = reconcile_config(stored, config, path)
  tensors = {}  # HF key -> (its file, shape)
  for f in map(_open_weight_file, _hf_weight_files(path)):
    tensors.update({key: (f, shape) for key, shape in f.shapes.items()})
  mapping = hf_name_map(config)
  # Tied checkpoints may omit aliases: fall back to the shared embedding.
  if "shared.weight" not in tensors and "encoder.embed_tokens.weight" in tensors:
    mapping["token_embedder/embedding"] = ("encoder.embed_tokens.weight", False)
  ignored = set(HF_IGNORED)
  if config.logits_via_embedding:
    ignored.add("lm_head.weight")  # 1.0: an alias of shared.weight
  elif "lm_head.weight" not in tensors and hf_cfg.get("tie_word_embeddings", True):
    mapping["decoder/logits_dense/kernel"] = ("shared.weight", True)
  used = {hf for hf, _ in mapping.values()}
  missing = sorted(used - set(tensors))
  extra = sorted(set(tensors) - used - ignored)
  if missing or extra:
    parts = ([f"missing {len(missing)} tensor(s): {few(missing)}"] if missing else []) + (
        [f"unknown {len(extra)} tensor(s): {few(extra)}"] if extra else [])
    raise CheckpointError(f"{path}: weights disagree with {config_path}: " + "; ".join(parts))

  sources = {}
  for ours, (hf, transpose) in mapping.items():
    f, shape = tensors[hf]
    if transpose:
      sources[ours] = placement.ArraySource(
          tuple(shape[::-1]), functools.partial(_transposed_reader, f, hf))
    else:
      sources[ours] = placement.ArraySource(tuple(shape), functools.partial(f.slice_reader, hf))
  check_shapes({n: s.shape for n, s in sources.items()}, config, path)
  return placement.place_arrays(sources, param_dtype, partitioner,
                                placement.in_flight_for(path)), config
