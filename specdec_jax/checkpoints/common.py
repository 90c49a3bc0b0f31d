"""What every checkpoint format shares: errors, path helpers, '/'-joined name trees,
shape and config checks, orbax metadata."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import Any, Iterable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import storage
from specdec_jax.models.t5 import T5Config, param_shapes
from specdec_jax.partitioning import flatten_names, unflatten_names

FORMATS = ("auto", "specdec", "t5x", "t5x_orbax", "hf")

# Names inside a directory that identify each format.
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                   "pytorch_model.bin", "pytorch_model.bin.index.json")
SPECDEC_PARAMS_DIR = "params"
T5X_MSGPACK = "checkpoint"
T5X_ORBAX_ITEM = "state"
# Orbax's tree metadata file, beside the arrays of every PyTree checkpoint it writes.
ORBAX_METADATA = "_METADATA"
STEP_DIR_RE = re.compile(r"^checkpoint_(\d+)$")


class CheckpointError(ValueError):
  """A checkpoint is malformed or disagrees with the model configuration."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
  """A checkpoint path or one of its files does not exist."""


class CheckpointExistsError(CheckpointError, FileExistsError):
  """Refusing to overwrite a non-empty directory."""


# Path helpers: storage's.
is_gcs, join, is_dir, exists = storage.is_gcs, storage.join, storage.is_dir, storage.exists


def kvstore_spec(path: str) -> dict:
  try:
    return storage.kvstore_spec(path)
  except ValueError as e:  # a malformed gs:// URL
    raise CheckpointError(str(e)) from None


def listdir(path: str) -> list[str]:
  if not is_gcs(path):
    return sorted(os.listdir(path))
  try:
    return storage.listdir(path)
  except storage.StorageNotFoundError as e:
    raise CheckpointNotFoundError(str(e)) from None


def read_bytes(path: str) -> bytes:
  """The file's bytes; a missing one is a CheckpointNotFoundError naming it."""
  try:
    return storage.read_bytes(path, "checkpoint file")
  except storage.StorageNotFoundError as e:
    raise CheckpointNotFoundError(f"{path}: file not found" if not is_gcs(path)
                                  else str(e)) from None


def read_json(path: str) -> Any:
  """A JSON file's content; invalid JSON is a CheckpointError naming the file."""
  try:
    return json.loads(read_bytes(path))
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path}: invalid JSON: {e}") from e


def require_dir(path: str) -> None:
  if is_dir(path):
    return
  if not is_gcs(path):
    what = "is not a directory" if exists(path) else "does not exist"
    raise CheckpointNotFoundError(f"checkpoint directory {path} {what}")
  if storage.is_file(path):
    raise CheckpointNotFoundError(f"checkpoint directory {path} is an object, not a prefix "
                                  "with objects under it")
  # Says whether the bucket is missing, or only the objects under the prefix.
  raise CheckpointNotFoundError(str(storage.not_found(path, "checkpoint directory", prefix=True)))


def latest_step_dir(path: str) -> Optional[str]:
  """The ``checkpoint_<step>`` child with the largest step, if any."""
  steps = [(int(m.group(1)), name) for name in listdir(path) if (m := STEP_DIR_RE.match(name))]
  return join(path, max(steps)[1]) if steps else None


def check_writable(directory: str, params: Any, config: T5Config, overwrite: bool,
                   doing: str, to: str) -> tuple[str, dict]:
  """(absolute local ``directory``, flat ``params``) once both may be written."""
  if is_gcs(directory):
    raise CheckpointError(f"{directory}: {doing} to GCS is not supported")
  directory = os.path.abspath(directory)
  if os.path.isdir(directory) and os.listdir(directory) and not overwrite:
    raise CheckpointExistsError(
        f"{directory} exists and is not empty; pass overwrite=True to replace it")
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise CheckpointExistsError(f"{directory} exists and is not a directory")
  flat = flatten(params)
  check_shapes({k: tuple(np.shape(v)) for k, v in flat.items()}, config,
               f"params to {to} to {directory}")
  return directory, flat


# One implementation of the '/'-joined naming, shared with the axis rules.
flatten = flatten_names
unflatten = unflatten_names


def subtree_keys(tree: Mapping, candidates: Sequence[tuple[str, ...]]) -> Optional[tuple]:
  """The first key path in ``candidates`` that leads to a dict in ``tree``."""
  for keys in candidates:
    node: Any = tree
    for k in keys:
      node = node.get(k) if isinstance(node, Mapping) else None
    if isinstance(node, Mapping):
      return keys
  return None


def params_dtype_tree(params: Any, dtype: Optional[str]) -> Any:
  if dtype is None:
    return params
  dt = jnp.dtype(dtype)
  return jax.tree_util.tree_map(lambda x: jnp.asarray(x).astype(dt), params)


@functools.lru_cache(maxsize=16)
def expected_shapes(config: T5Config) -> dict[str, tuple[int, ...]]:
  """{'encoder/layers_0/attention/query/kernel': shape, ...} for a config."""
  return {k: tuple(v.shape) for k, v in flatten(param_shapes(config)).items()}


def few(names: Iterable[str], n: int = 5) -> str:
  """The first ``n`` sorted names, comma-joined, and how many more there are."""
  names = sorted(names)
  more = f" ... and {len(names) - n} more" if len(names) > n else ""
  return ", ".join(names[:n]) + more


def check_shapes(shapes: Mapping[str, tuple[int, ...]], config: T5Config, source: str) -> None:
  """CheckpointError (led by ``source``) unless ``shapes`` is exactly the config's tree."""
  want = expected_shapes(config)
  missing = set(want) - set(shapes)
  extra = set(shapes) - set(want)
  if missing or extra:
    parts = []
    if missing:
      parts.append(f"missing {len(missing)} parameter(s): {few(missing)}")
    if extra:
      parts.append(f"unknown {len(extra)} parameter(s): {few(extra)}")
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


def config_from_dict(fields: Mapping[str, Any], source: str = "config") -> T5Config:
  known = {f.name for f in dataclasses.fields(T5Config)}
  unknown = set(fields) - known
  if unknown:
    raise CheckpointError(f"{source}: unknown T5Config field(s): {few(unknown)}")
  try:
    return T5Config(**fields)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{source}: invalid T5Config: {e}") from e


def reconcile_config(stored: T5Config, given: Optional[T5Config], source: str) -> T5Config:
  """The caller's config may only differ from the stored one in activation dtype."""
  if given is None:
    return stored
  diff = [f.name for f in dataclasses.fields(T5Config)
          if f.name != "dtype" and getattr(stored, f.name) != getattr(given, f.name)]
  if diff:
    details = ", ".join(f"{n}: checkpoint {getattr(stored, n)!r} vs given {getattr(given, n)!r}"
                        for n in diff)
    raise CheckpointError(f"{source}: the given config disagrees with the checkpoint's: {details}")
  return given


def root_cause(e: BaseException) -> str:
  """The first line of the innermost exception (which names the file, for TensorStore)."""
  seen = set()
  while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
    seen.add(id(e))
    e = e.__cause__ or e.__context__
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}"


def orbax_metadata_tree(directory: str) -> dict:
  """The saved tree of a local orbax PyTree checkpoint, with metadata leaves."""
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


def metadata_shapes(tree: Mapping) -> dict[str, tuple[int, ...]]:
  return {k: tuple(v.shape) for k, v in flatten(tree).items()}
