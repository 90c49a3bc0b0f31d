"""Loading and saving T5 parameters in four on-disk formats.

* ``specdec``: our own format, a directory holding ``config.json`` (the
  ``T5Config`` fields) and ``params/`` (an orbax-checkpoint PyTree, possibly
  stored in bfloat16).
* ``t5x``: T5X's legacy layout, ``checkpoint_<step>/checkpoint`` (msgpack)
  whose leaves are inline arrays or TensorStore zarr specs relative to the
  step directory. Local paths and ``gs://`` paths.
* ``t5x_orbax``: T5X's newer layout, ``checkpoint_<step>/state/`` written by
  orbax-checkpoint (OCDBT); only the parameter subtree is restored.
* ``hf``: a Hugging Face T5 directory (``config.json`` plus ``model.safetensors``
  or ``pytorch_model.bin``, optionally sharded with an index file).

Every loader first collects the names and shapes of the stored arrays (without
reading them), checks them against ``param_shapes(config)``, and only then
reads the arrays one at a time, casting each to ``param_dtype`` and moving it
to the device before reading the next, so that a 44 GB T5-XXL never needs two
full host copies.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specdec_jax.models.t5 import T5Config, param_shapes

FORMATS = ("auto", "specdec", "t5x", "t5x_orbax", "hf")

# Names inside a directory that identify each format.
_HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                    "pytorch_model.bin", "pytorch_model.bin.index.json")
_SPECDEC_PARAMS_DIR = "params"
_T5X_MSGPACK = "checkpoint"
_T5X_ORBAX_ITEM = "state"
_STEP_DIR_RE = re.compile(r"^checkpoint_(\d+)$")

Reader = Callable[[], np.ndarray]


class CheckpointError(ValueError):
  """A checkpoint is malformed or disagrees with the model configuration."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
  """A checkpoint path or one of its files does not exist."""


class CheckpointExistsError(CheckpointError, FileExistsError):
  """Refusing to overwrite a non-empty directory."""


# ------------------------------------------------------------ path helpers


def _is_gcs(path: str) -> bool:
  return path.startswith("gs://")


def _join(base: str, *parts: str) -> str:
  if _is_gcs(base):
    return "/".join([base.rstrip("/")] + [p.strip("/") for p in parts])
  return os.path.join(base, *parts)


def _split_gcs(path: str) -> tuple[str, str]:
  """'gs://bucket/a/b' -> ('bucket', 'a/b')."""
  bucket, _, rest = path[len("gs://"):].partition("/")
  if not bucket:
    raise CheckpointError(f"malformed GCS path {path!r}: no bucket")
  return bucket, rest.strip("/")


def _kvstore_spec(path: str) -> dict:
  """A TensorStore kvstore spec for a local or ``gs://`` path."""
  if _is_gcs(path):
    bucket, key = _split_gcs(path)
    return {"driver": "gcs", "bucket": bucket, "path": key}
  return {"driver": "file", "path": os.path.abspath(path)}


def _kv_open(path: str):
  import tensorstore as ts  # only needed for TensorStore-backed formats
  spec = _kvstore_spec(path)
  if spec["path"] and not spec["path"].endswith("/"):
    spec["path"] += "/"
  return ts.KvStore.open(spec).result()


def _kv_listdir(path: str) -> list[str]:
  """Immediate children of a directory through a kvstore (used for gs://).

  Object stores have no directories, so this lists keys recursively and keeps
  their first component: a model directory with many zarr checkpoints lists
  every chunk, so pass a checkpoint_<step> directory to keep this short.
  """
  keys = _kv_open(path).list().result()
  return sorted({k.decode().split("/", 1)[0] for k in keys})


def _kv_read(path: str) -> Optional[bytes]:
  """A whole object's bytes, or None if it does not exist."""
  parent, _, name = path.rstrip("/").rpartition("/")
  result = _kv_open(parent).read(name).result()
  return bytes(result.value) if result.state == "value" else None


def _listdir(path: str) -> list[str]:
  if _is_gcs(path):
    return _kv_listdir(path)
  return sorted(os.listdir(path))


def _is_dir(path: str) -> bool:
  if _is_gcs(path):
    return bool(_kv_listdir(path))
  return os.path.isdir(path)


def _exists(path: str) -> bool:
  if _is_gcs(path):
    return _kv_read(path) is not None or _is_dir(path)
  return os.path.exists(path)


def _read_bytes(path: str) -> bytes:
  if _is_gcs(path):
    data = _kv_read(path)
    if data is None:
      raise CheckpointNotFoundError(f"{path}: file not found")
    return data
  if not os.path.isfile(path):
    raise CheckpointNotFoundError(f"{path}: file not found")
  with open(path, "rb") as f:
    return f.read()


def _require_dir(path: str) -> None:
  if not _is_dir(path):
    what = "is not a directory" if _exists(path) else "does not exist"
    raise CheckpointNotFoundError(f"checkpoint directory {path} {what}")


def _latest_step_dir(path: str) -> Optional[str]:
  """The ``checkpoint_<step>`` child with the largest step, if any."""
  steps = [(int(m.group(1)), name) for name in _listdir(path)
           if (m := _STEP_DIR_RE.match(name))]
  return _join(path, max(steps)[1]) if steps else None


# ------------------------------------------------------------ tree helpers


def _flatten(tree: Mapping, is_leaf: Callable[[Any], bool] = lambda x: False,
             prefix: str = "") -> dict[str, Any]:
  """Nested dicts -> {'a/b/c': leaf}."""
  flat = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping) and not is_leaf(value):
      flat.update(_flatten(value, is_leaf, name + "/"))
    else:
      flat[name] = value
  return flat


def _unflatten(flat: Mapping[str, Any]) -> dict:
  """{'a/b/c': leaf} -> nested dicts."""
  tree: dict = {}
  for name, value in flat.items():
    *parents, last = name.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = value
  return tree


@functools.lru_cache(maxsize=16)
def expected_shapes(config: T5Config) -> dict[str, tuple[int, ...]]:
  """{'encoder/layers_0/attention/query/kernel': shape, ...} for a config."""
  return {k: tuple(v.shape) for k, v in _flatten(param_shapes(config)).items()}


def _few(names: Iterable[str], n: int = 5) -> str:
  names = sorted(names)
  more = f" ... and {len(names) - n} more" if len(names) > n else ""
  return ", ".join(names[:n]) + more


def check_shapes(shapes: Mapping[str, tuple[int, ...]], config: T5Config,
                 source: str) -> None:
  """Raises CheckpointError unless ``shapes`` is exactly the config's tree.

  ``shapes`` maps '/'-joined parameter names to shapes; ``source`` (a path)
  prefixes every message.
  """
  want = expected_shapes(config)
  missing = set(want) - set(shapes)
  extra = set(shapes) - set(want)
  if missing or extra:
    parts = []
    if missing:
      parts.append(f"missing {len(missing)} parameter(s): {_few(missing)}")
    if extra:
      parts.append(f"unknown {len(extra)} parameter(s): {_few(extra)}")
    raise CheckpointError(f"{source}: parameter names disagree with the config "
                          f"(version {config.version}, {config.num_encoder_layers}+"
                          f"{config.num_decoder_layers} layers): " + "; ".join(parts))
  # Vocabulary first: the most common mismatch, and worth naming as such.
  vocab_axes = {"token_embedder/embedding": 0, "decoder/logits_dense/kernel": 1}
  for name, axis in vocab_axes.items():
    if name in shapes and len(shapes[name]) == 2 and shapes[name][axis] != config.vocab_size:
      raise CheckpointError(
          f"{source}: vocab size mismatch: {name} has shape {tuple(shapes[name])} "
          f"({shapes[name][axis]} vocab entries) but config.vocab_size={config.vocab_size}")
  for name in sorted(want):
    if tuple(shapes[name]) != want[name]:
      raise CheckpointError(f"{source}: parameter {name} has shape {tuple(shapes[name])} "
                            f"in the checkpoint but the config expects {want[name]}")


def _stream_to_device(readers: Mapping[str, Reader], param_dtype) -> dict:
  """Reads, casts and device_puts one array at a time; returns the nested tree."""
  dtype = np.dtype(jnp.dtype(param_dtype))
  out = {}
  for name in sorted(readers):
    host = np.asarray(readers[name](), dtype=dtype)
    out[name] = jax.device_put(host)
    del host  # drop the host copy before reading the next array
  return _unflatten(out)


def config_from_dict(fields: Mapping[str, Any], source: str = "config") -> T5Config:
  """A T5Config from its fields; unknown keys are an error naming ``source``."""
  known = {f.name for f in dataclasses.fields(T5Config)}
  unknown = set(fields) - known
  if unknown:
    raise CheckpointError(f"{source}: unknown T5Config field(s): {_few(unknown)}")
  try:
    return T5Config(**fields)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{source}: invalid T5Config: {e}") from e


def _reconcile_config(stored: T5Config, given: Optional[T5Config], source: str) -> T5Config:
  """The caller's config may only differ from the stored one in activation dtype."""
  if given is None:
    return stored
  diff = [f.name for f in dataclasses.fields(T5Config)
          if f.name != "dtype" and getattr(stored, f.name) != getattr(given, f.name)]
  if diff:
    details = ", ".join(f"{n}: checkpoint {getattr(stored, n)!r} vs given {getattr(given, n)!r}"
                        for n in diff)
    raise CheckpointError(f"{source}: the given config disagrees with the checkpoint's: "
                          f"{details}")
  return given


def _check_overwrite(directory: str, overwrite: bool) -> None:
  if os.path.isdir(directory) and os.listdir(directory) and not overwrite:
    raise CheckpointExistsError(
        f"{directory} exists and is not empty; pass overwrite=True to replace it")
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise CheckpointExistsError(f"{directory} exists and is not a directory")


def _params_dtype_tree(params: Any, dtype: Optional[str]) -> Any:
  if dtype is None:
    return params
  dt = jnp.dtype(dtype)
  return jax.tree_util.tree_map(lambda x: jnp.asarray(x).astype(dt), params)


# ------------------------------------------------------------ our own format


def _orbax_restore(directory: str, subtree: tuple[str, ...], param_dtype) -> dict:
  """Restores ``tree[subtree...]`` of an orbax PyTree checkpoint, cast on read.

  Other subtrees (optimizer state) are not read (``partial_restore``).
  """
  import orbax.checkpoint as ocp
  ckptr = ocp.PyTreeCheckpointer()
  tree = _orbax_metadata_tree(directory)
  sub = tree
  for key in subtree:
    sub = sub[key]
  dtype = jnp.dtype(param_dtype)
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  item = jax.tree_util.tree_map(
      lambda m: jax.ShapeDtypeStruct(tuple(m.shape), dtype, sharding=sharding), sub)
  restore_args = jax.tree_util.tree_map(
      lambda m: ocp.ArrayRestoreArgs(dtype=dtype, sharding=sharding), sub)
  for key in reversed(subtree):
    item, restore_args = {key: item}, {key: restore_args}
  try:
    restored = ckptr.restore(
        directory, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                               partial_restore=bool(subtree)))
  except Exception as e:  # orbax/TensorStore wrap the cause in several layers
    raise CheckpointError(f"{directory}: corrupt or unreadable checkpoint data: "
                          f"{_root_cause(e)}") from e
  for key in subtree:
    restored = restored[key]
  return restored


def _root_cause(e: BaseException) -> str:
  """The first line of the innermost exception (which names the file, for TensorStore)."""
  seen = set()
  while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
    seen.add(id(e))
    e = e.__cause__ or e.__context__
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _orbax_metadata_tree(directory: str) -> dict:
  """The saved tree of an orbax PyTree checkpoint, with metadata leaves (no data)."""
  import orbax.checkpoint as ocp
  try:
    meta = ocp.PyTreeCheckpointer().metadata(directory)
  except Exception as e:  # orbax raises assorted types for a bad directory
    raise CheckpointError(f"{directory}: not a readable orbax checkpoint: {e}") from e
  tree = getattr(meta, "item_metadata", meta)
  tree = getattr(tree, "tree", tree)
  if not isinstance(tree, Mapping):
    raise CheckpointError(f"{directory}: orbax metadata is not a tree of arrays")
  return tree


def _metadata_shapes(tree: Mapping) -> dict[str, tuple[int, ...]]:
  return {k: tuple(v.shape) for k, v in _flatten(tree).items()}


def save_checkpoint(directory: str, params: Any, config: T5Config,
                    dtype: Optional[str] = None, overwrite: bool = False) -> None:
  """Writes ``params`` (T5X-named tree) and ``config`` in our own format.

  Layout: ``directory/config.json`` (T5Config fields) and ``directory/params``
  (orbax PyTree). ``dtype`` (e.g. 'bfloat16') casts the arrays on disk;
  loading casts back to the requested ``param_dtype``. A non-empty existing
  directory is only replaced with ``overwrite=True``.
  """
  import orbax.checkpoint as ocp
  if _is_gcs(directory):
    raise CheckpointError(f"{directory}: saving to GCS is not supported")
  directory = os.path.abspath(directory)
  _check_overwrite(directory, overwrite)
  shapes = {k: tuple(np.shape(v)) for k, v in _flatten(params).items()}
  check_shapes(shapes, config, f"params to save to {directory}")
  # Only remove what we write ourselves, never unrelated files.
  params_dir = os.path.join(directory, _SPECDEC_PARAMS_DIR)
  if os.path.isdir(params_dir):
    shutil.rmtree(params_dir)
  os.makedirs(directory, exist_ok=True)
  ocp.PyTreeCheckpointer().save(params_dir, _params_dtype_tree(params, dtype))
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(dataclasses.asdict(config), f, indent=2, sort_keys=True)


def _load_specdec(path: str, config: Optional[T5Config], param_dtype) -> tuple[dict, T5Config]:
  config_path = _join(path, "config.json")
  try:
    fields = json.loads(_read_bytes(config_path))
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{config_path}: invalid JSON: {e}") from e
  config = _reconcile_config(config_from_dict(fields, config_path), config, path)
  params_dir = _join(path, _SPECDEC_PARAMS_DIR)
  _require_dir(params_dir)
  check_shapes(_metadata_shapes(_orbax_metadata_tree(params_dir)), config, params_dir)
  return _orbax_restore(params_dir, (), param_dtype), config


# ------------------------------------------------------------ T5X legacy


def _is_ts_spec(x: Any) -> bool:
  return isinstance(x, Mapping) and "driver" in x


def _resolve_ts_spec(spec: Mapping, step_dir: str) -> dict:
  """Points a saved zarr spec at its array inside ``step_dir``.

  T5X stores paths relative to the step directory, either at the top level
  (old: ``path``) or in ``kvstore.path``; the saved driver/bucket may name
  where the checkpoint was written, not where it is now, so it is replaced by
  one for ``step_dir`` (local file or gs://). Absolute paths are kept.
  """
  spec = dict(spec)
  kvstore = spec.pop("kvstore", None)
  rel = spec.pop("path", None)
  if isinstance(kvstore, Mapping):
    rel = kvstore.get("path", rel)
  elif isinstance(kvstore, str):  # a URL-style kvstore
    rel = kvstore
  if not rel:
    raise CheckpointError(f"{step_dir}: TensorStore spec without a path: {dict(spec)}")
  if os.path.isabs(rel):
    target = rel
  elif _is_gcs(rel):
    target = rel
  else:
    target = _join(step_dir, rel)
  spec["kvstore"] = _kvstore_spec(target)
  return spec


def _ts_shape(spec: Mapping, resolved: dict, name: str, step_dir: str) -> tuple[int, ...]:
  meta = spec.get("metadata")
  if isinstance(meta, Mapping) and "shape" in meta:
    return tuple(int(s) for s in meta["shape"])
  return tuple(_ts_open(resolved, name, step_dir).shape)


def _ts_open(resolved: dict, name: str, step_dir: str):
  import tensorstore as ts
  try:
    return ts.open(resolved, open=True, read=True).result()
  except Exception as e:  # tensorstore raises ValueError and friends
    raise CheckpointError(f"{step_dir}: cannot open TensorStore array for {name} "
                          f"at {resolved['kvstore']}: {e}") from e


def _subtree_keys(tree: Mapping, candidates: Sequence[tuple[str, ...]]) -> Optional[tuple]:
  """The first key path in ``candidates`` that leads to a dict in ``tree``."""
  for keys in candidates:
    node: Any = tree
    for k in keys:
      node = node.get(k) if isinstance(node, Mapping) else None
    if isinstance(node, Mapping):
      return keys
  return None


def _t5x_target(state: Any, msgpack_path: str) -> Mapping:
  """The parameter tree inside a decoded T5X msgpack checkpoint."""
  if not isinstance(state, Mapping):
    raise CheckpointError(f"{msgpack_path}: expected a dict at the top level, "
                          f"got {type(state).__name__}")
  keys = _subtree_keys(state, (("optimizer", "target"), ("target",), ("params",)))
  if keys is None:
    raise CheckpointError(f"{msgpack_path}: no optimizer/target parameters; "
                          f"top-level keys: {sorted(map(str, state))}")
  for k in keys:
    state = state[k]
  return state


def _load_t5x(step_dir: str, config: T5Config, param_dtype) -> dict:
  from flax import serialization
  msgpack_path = _join(step_dir, _T5X_MSGPACK)
  raw = _read_bytes(msgpack_path)
  try:
    state = serialization.msgpack_restore(raw)
  except Exception as e:  # msgpack raises several unrelated exception types
    raise CheckpointError(f"{msgpack_path}: corrupt msgpack checkpoint: {e}") from e
  del raw
  target = _t5x_target(state, msgpack_path)
  del state  # keep only the target subtree (optimizer state is dropped unread)
  leaves = _flatten(target, is_leaf=_is_ts_spec)
  shapes, readers = {}, {}
  for name, leaf in leaves.items():
    if _is_ts_spec(leaf):
      resolved = _resolve_ts_spec(leaf, step_dir)
      shapes[name] = _ts_shape(leaf, resolved, name, step_dir)
      readers[name] = functools.partial(
          lambda r, n: _ts_open(r, n, step_dir).read().result(), resolved, name)
    else:
      arr = np.asarray(leaf)
      shapes[name] = arr.shape
      readers[name] = functools.partial(lambda a: a, arr)
  check_shapes(shapes, config, step_dir)
  return _stream_to_device(readers, param_dtype)


# ------------------------------------------------------------ T5X orbax


def _find_params_subtree(tree: Mapping, directory: str) -> tuple[str, ...]:
  keys = _subtree_keys(tree, (("target",), ("params",), ("optimizer", "target"),
                              ("state", "params")))
  if keys is None:
    raise CheckpointError(f"{directory}: no 'target' or 'params' subtree in the orbax "
                          f"checkpoint; top-level keys: {sorted(tree)}")
  return keys


def _load_t5x_orbax(step_dir: str, config: T5Config, param_dtype) -> dict:
  item_dir = _join(step_dir, _T5X_ORBAX_ITEM)
  _require_dir(item_dir)
  tree = _orbax_metadata_tree(item_dir)
  keys = _find_params_subtree(tree, item_dir)
  sub = tree
  for k in keys:
    sub = sub[k]
  check_shapes(_metadata_shapes(sub), config, item_dir)
  return _orbax_restore(item_dir, keys, param_dtype)


# ------------------------------------------------------------ Hugging Face


def hf_config_to_t5(hf: Mapping[str, Any], dtype: str = "float32",
                    source: str = "config.json") -> T5Config:
  """Our T5Config from a Hugging Face T5 ``config.json`` dict.

  T5 1.0 is a ReLU MLP with logits through the embedding scaled by
  1/sqrt(d_model); T5 1.1 is gated-GELU with unscaled logits. Transformers
  4.x marks the scaling with ``tie_word_embeddings``; 5.x always ties and
  writes ``scale_decoder_outputs`` instead, so that key wins when present.
  """
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
        num_heads=int(hf["num_heads"]), head_dim=int(hf["d_kv"]),
        num_encoder_layers=num_layers,
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


def t5_to_hf_config(config: T5Config) -> dict:
  """The Hugging Face ``config.json`` dict for a T5Config (inverse of the above)."""
  return {
      "architectures": ["T5ForConditionalGeneration"],
      "model_type": "t5",
      "vocab_size": config.vocab_size,
      "d_model": config.d_model,
      "d_kv": config.head_dim,
      "d_ff": config.d_ff,
      "num_heads": config.num_heads,
      "num_layers": config.num_encoder_layers,
      "num_decoder_layers": config.num_decoder_layers,
      "relative_attention_num_buckets": config.relative_attention_num_buckets,
      "relative_attention_max_distance": config.relative_attention_max_distance,
      "layer_norm_epsilon": config.layer_norm_epsilon,
      "feed_forward_proj": "gated-gelu" if config.gated else "relu",
      # 4.x reads the logits scaling from this; 5.x turns it into
      # scale_decoder_outputs and keeps lm_head untied when it differs.
      "tie_word_embeddings": config.logits_via_embedding,
      "is_encoder_decoder": True,
      "pad_token_id": config.pad_id,
      "eos_token_id": config.eos_id,
      "decoder_start_token_id": config.decoder_start_id,
      "initializer_factor": 1.0,
  }


# HF keys that alias other weights (tied embeddings) or that HF itself ignores.
_HF_IGNORED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
               "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight")


def hf_name_map(config: T5Config) -> dict[str, tuple[str, bool]]:
  """{our param name: (HF state-dict key, transpose?)} for a config.

  HF Linear weights are [out, in] and relative biases [buckets, H], the
  transposes of T5X's kernels [in, out] and rel_embedding [H, buckets].
  """
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


class _SafetensorsFile:
  """Shapes and lazy tensor reads of one .safetensors file.

  Uses ``safetensors.safe_open(framework='numpy')``; bfloat16 (which numpy
  lacks) is read straight from the file through a memmap and viewed as
  ``ml_dtypes.bfloat16``.
  """

  def __init__(self, path: str):
    from safetensors import safe_open
    self.path = path
    try:
      self._f = safe_open(path, framework="numpy")
      self.shapes = {k: tuple(self._f.get_slice(k).get_shape()) for k in self._f.keys()}
      self._dtypes = {k: self._f.get_slice(k).get_dtype() for k in self._f.keys()}
    except Exception as e:  # safetensors raises its own error types
      raise CheckpointError(f"{path}: cannot read safetensors file: {e}") from e

  @functools.cached_property
  def _header(self) -> tuple[int, dict]:
    """(offset of the data section, parsed JSON header)."""
    with open(self.path, "rb") as f:
      n = int.from_bytes(f.read(8), "little")
      return 8 + n, json.loads(f.read(n))

  def read(self, key: str) -> np.ndarray:
    if self._dtypes[key] != "BF16":
      return self._f.get_tensor(key)
    start, header = self._header
    begin, end = header[key]["data_offsets"]
    raw = np.memmap(self.path, dtype=np.uint16, mode="r", offset=start + begin,
                    shape=((end - begin) // 2,))
    return raw.view(ml_dtypes.bfloat16).reshape(self.shapes[key])


class _TorchBinFile:
  """Shapes and lazy tensor reads of one pytorch_model.bin (torch imported lazily)."""

  def __init__(self, path: str):
    import torch
    self.path = path
    try:
      self._sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:
      # Pre-1.6 (non-zip) files cannot be memory-mapped: load them whole.
      try:
        self._sd = torch.load(path, map_location="cpu", weights_only=True)
      except Exception as e:  # pickle/zip errors
        raise CheckpointError(f"{path}: cannot read PyTorch checkpoint: {e}") from e
    except Exception as e:  # pickle errors
      raise CheckpointError(f"{path}: cannot read PyTorch checkpoint: {e}") from e
    self.shapes = {k: tuple(v.shape) for k, v in self._sd.items()}

  def read(self, key: str) -> np.ndarray:
    import torch
    t = self._sd[key].detach()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
      return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _hf_weight_files(path: str) -> list[str]:
  """The weight files of an HF directory (one file, or the shards of an index)."""
  for single, index in (("model.safetensors", "model.safetensors.index.json"),
                        ("pytorch_model.bin", "pytorch_model.bin.index.json")):
    if os.path.isfile(os.path.join(path, single)):
      return [os.path.join(path, single)]
    index_path = os.path.join(path, index)
    if os.path.isfile(index_path):
      try:
        weight_map = json.loads(_read_bytes(index_path))["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{index_path}: invalid shard index: {e}") from e
      return [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
  raise CheckpointNotFoundError(f"{path}: no Hugging Face weights ({', '.join(_HF_WEIGHT_FILES)})")


def _open_hf_tensors(path: str) -> dict[str, tuple[Any, tuple[int, ...]]]:
  """{HF key: (file object with .read(key), shape)} over all weight files."""
  tensors = {}
  for file_path in _hf_weight_files(path):
    if not os.path.isfile(file_path):
      raise CheckpointNotFoundError(f"{file_path}: weight shard listed in the index is missing")
    f = _SafetensorsFile(file_path) if file_path.endswith(".safetensors") else _TorchBinFile(file_path)
    for key, shape in f.shapes.items():
      tensors[key] = (f, shape)
  return tensors


def _load_hf(path: str, config: Optional[T5Config], param_dtype) -> tuple[dict, T5Config]:
  if _is_gcs(path):
    raise CheckpointError(f"{path}: Hugging Face checkpoints must be local")
  config_path = os.path.join(path, "config.json")
  try:
    hf_cfg = json.loads(_read_bytes(config_path))
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{config_path}: invalid JSON: {e}") from e
  stored = hf_config_to_t5(hf_cfg, source=config_path)
  config = _reconcile_config(stored, config, path)
  tensors = _open_hf_tensors(path)
  mapping = hf_name_map(config)
  # Tied checkpoints may omit aliases: fall back to the shared embedding.
  if "shared.weight" not in tensors and "encoder.embed_tokens.weight" in tensors:
    mapping["token_embedder/embedding"] = ("encoder.embed_tokens.weight", False)
  ignored = set(_HF_IGNORED)
  if config.logits_via_embedding:
    ignored.add("lm_head.weight")  # 1.0: an alias of shared.weight
  elif "lm_head.weight" not in tensors and hf_cfg.get("tie_word_embeddings", True):
    mapping["decoder/logits_dense/kernel"] = ("shared.weight", True)
  used = {hf for hf, _ in mapping.values()}
  missing = sorted(used - set(tensors))
  extra = sorted(set(tensors) - used - ignored)
  if missing or extra:
    parts = ([f"missing {len(missing)} tensor(s): {_few(missing)}"] if missing else []) + (
        [f"unknown {len(extra)} tensor(s): {_few(extra)}"] if extra else [])
    raise CheckpointError(f"{path}: weights disagree with {config_path}: " + "; ".join(parts))

  shapes, readers = {}, {}
  for ours, (hf, transpose) in mapping.items():
    f, shape = tensors[hf]
    shapes[ours] = shape[::-1] if transpose else shape
    readers[ours] = functools.partial(
        lambda f, k, t: f.read(k).T if t else f.read(k), f, hf, transpose)
  check_shapes(shapes, config, path)
  return _stream_to_device(readers, param_dtype), config


_SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                       np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float64): "F64"}


def _write_safetensors(path: str, arrays: Mapping[str, Callable[[], np.ndarray]],
                       shapes: Mapping[str, tuple[int, ...]], dtype: np.dtype) -> None:
  """Writes a .safetensors file one tensor at a time (the header needs only shapes).

  Format: u64 little-endian header length, JSON header (padded with spaces to
  8 bytes) mapping names to dtype/shape/byte offsets, then the raw data.
  """
  if dtype not in _SAFETENSORS_DTYPES:
    raise CheckpointError(f"{path}: cannot write dtype {dtype} to safetensors")
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  for name in arrays:
    nbytes = int(np.prod(shapes[name], dtype=np.int64)) * dtype.itemsize
    header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shapes[name]),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path, "wb") as f:
    f.write(len(blob).to_bytes(8, "little"))
    f.write(blob)
    for name in arrays:
      arr = np.ascontiguousarray(arrays[name](), dtype=dtype)
      if arr.shape != tuple(shapes[name]):
        raise CheckpointError(f"{path}: tensor {name} has shape {arr.shape}, "
                              f"expected {tuple(shapes[name])}")
      f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())


def export_hf(params: Any, config: T5Config, directory: str,
              dtype: Optional[str] = None, overwrite: bool = False) -> None:
  """Writes a Hugging Face T5 directory (config.json + model.safetensors).

  The inverse of ``load_checkpoint(fmt='hf')``. ``dtype`` (default: the
  params' own, float32 for a model from ``init``) is the on-disk dtype.
  Tensors are transferred to the host one at a time.
  """
  if _is_gcs(directory):
    raise CheckpointError(f"{directory}: exporting to GCS is not supported")
  directory = os.path.abspath(directory)
  _check_overwrite(directory, overwrite)
  flat = _flatten(params)
  check_shapes({k: tuple(np.shape(v)) for k, v in flat.items()}, config,
               f"params to export to {directory}")
  out_dtype = np.dtype(jnp.dtype(dtype) if dtype else jnp.asarray(flat["token_embedder/embedding"]).dtype)
  arrays: dict[str, Callable[[], np.ndarray]] = {}
  shapes: dict[str, tuple[int, ...]] = {}
  for ours, (hf, transpose) in sorted(hf_name_map(config).items(), key=lambda kv: kv[1][0]):
    shape = tuple(np.shape(flat[ours]))
    shapes[hf] = shape[::-1] if transpose else shape
    arrays[hf] = functools.partial(
        lambda x, t: np.asarray(x).T if t else np.asarray(x), flat[ours], transpose)
  os.makedirs(directory, exist_ok=True)
  _write_safetensors(os.path.join(directory, "model.safetensors"), arrays, shapes, out_dtype)
  hf_cfg = t5_to_hf_config(config)
  hf_cfg["torch_dtype"] = str(out_dtype) if out_dtype != ml_dtypes.bfloat16 else "bfloat16"
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2, sort_keys=True)


# ------------------------------------------------------------ dispatch


def _step_dir_for(path: str, marker: str, is_marker_dir: bool) -> str:
  """``path`` itself if it holds ``marker``, else its latest checkpoint_<step>."""
  here = _join(path, marker)
  if _is_dir(here) if is_marker_dir else _exists(here):
    return path
  latest = _latest_step_dir(path)
  if latest is None:
    kind = "directory" if is_marker_dir else "file"
    raise CheckpointNotFoundError(
        f"{path}: no '{marker}' {kind} and no checkpoint_<step> subdirectories")
  return latest


def detect_format(path: str) -> str:
  """Which of 'specdec', 't5x', 't5x_orbax', 'hf' the directory holds."""
  _require_dir(path)
  names = set(_listdir(path))
  if names & set(_HF_WEIGHT_FILES):
    return "hf"
  if _SPECDEC_PARAMS_DIR in names and "config.json" in names:
    return "specdec"
  if _T5X_MSGPACK in names:
    return "t5x"
  if _T5X_ORBAX_ITEM in names:
    return "t5x_orbax"
  latest = _latest_step_dir(path)
  if latest is not None:
    inner = set(_listdir(latest))
    if _T5X_MSGPACK in inner:
      return "t5x"
    if _T5X_ORBAX_ITEM in inner:
      return "t5x_orbax"
    raise CheckpointError(f"{latest}: neither a T5X msgpack '{_T5X_MSGPACK}' file nor an "
                          f"orbax '{_T5X_ORBAX_ITEM}' directory; contents: {_few(inner, 10)}")
  raise CheckpointError(f"{path}: cannot detect the checkpoint format; contents: "
                        f"{_few(names, 10)}")


def load_checkpoint(path: str, fmt: str = "auto", config: Optional[T5Config] = None,
                    param_dtype: Any = "float32") -> tuple[dict, T5Config]:
  """Loads T5 parameters (T5X-named tree on the default device) and their config.

  Args:
    path: a checkpoint directory; for T5X formats either a ``checkpoint_<step>``
      directory or a model directory holding several (the largest step wins).
      T5X paths may be ``gs://``.
    fmt: 'auto' (detect from the directory contents), 'specdec', 't5x',
      't5x_orbax' or 'hf'.
    config: required for T5X formats (their checkpoints do not record the
      architecture), e.g. ``PRESETS['t5_1_1_xl']``. For self-describing formats
      it is optional and must agree with the stored one except in ``dtype``.
    param_dtype: dtype every array is cast to as it is read.

  Raises:
    CheckpointNotFoundError: a missing directory or file.
    CheckpointError: corrupt files, unknown/missing parameters, or shapes
      (including the vocabulary size) that disagree with the config.
  """
  if fmt not in FORMATS:
    raise ValueError(f"unknown checkpoint format {fmt!r}; expected one of {FORMATS}")
  path = path.rstrip("/") if _is_gcs(path) else os.path.abspath(path)
  if not _is_gcs(path) and os.path.basename(path) == _T5X_MSGPACK and os.path.isfile(path):
    path, fmt = os.path.dirname(path), "t5x" if fmt == "auto" else fmt
  _require_dir(path)
  if fmt == "auto":
    fmt = detect_format(path)
  if fmt == "specdec":
    return _load_specdec(path, config, param_dtype)
  if fmt == "hf":
    return _load_hf(path, config, param_dtype)
  if config is None:
    raise CheckpointError(f"{path}: a {fmt} checkpoint does not record the model "
                          "architecture; pass config= (e.g. a preset from PRESETS)")
  if fmt == "t5x":
    return _load_t5x(_step_dir_for(path, _T5X_MSGPACK, False), config, param_dtype), config
  return _load_t5x_orbax(_step_dir_for(path, _T5X_ORBAX_ITEM, True), config, param_dtype), config
