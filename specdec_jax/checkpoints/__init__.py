"""Loading and saving T5 parameters, local or ``gs://``, straight into (sharded) device
memory, in four formats: ``specdec`` (ours: ``config.json`` + orbax ``params/``),
``t5x`` (T5X's msgpack ``checkpoint``), ``t5x_orbax`` (T5X's orbax ``state/``) and
``hf`` (Hugging Face). Names and shapes are checked against the config before any read;
each array is then read once into its sharding and dtype (``placement.py``), so a host
holds about one array per array in flight."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from specdec_jax import storage
from specdec_jax.checkpoints.common import (FORMATS, HF_WEIGHT_FILES, ORBAX_METADATA,
                                            SPECDEC_PARAMS_DIR, T5X_MSGPACK, T5X_ORBAX_ITEM,
                                            CheckpointError, CheckpointExistsError,
                                            CheckpointNotFoundError, check_shapes, config_from_dict,
                                            expected_shapes, few, is_dir, is_gcs, join,
                                            latest_step_dir, listdir, require_dir)
from specdec_jax.checkpoints.hf import hf_config_to_t5, hf_name_map, load_hf
from specdec_jax.checkpoints.placement import ReadStats, count_reads
from specdec_jax.checkpoints.specdec import load_specdec, save_checkpoint
from specdec_jax.checkpoints.t5x_legacy import load_t5x
from specdec_jax.checkpoints.t5x_orbax import load_t5x_orbax
from specdec_jax.models.t5 import T5Config, get_config
from specdec_jax.partitioning import Partitioner

__all__ = [
    "FORMATS", "CheckpointError", "CheckpointExistsError", "CheckpointNotFoundError",
    "ReadStats", "check_shapes", "config_from_dict", "count_reads",
    "detect_format", "expected_shapes", "hf_config_to_t5", "hf_name_map",
    "load_checkpoint", "peek_config", "save_checkpoint",
]


def _orbax_step_dir(path: str) -> str:
  """``path`` if it holds an orbax ``state/``, else its latest checkpoint_<step>."""
  if is_dir(join(path, T5X_ORBAX_ITEM)):
    return path
  latest = latest_step_dir(path)
  if latest is None:
    raise CheckpointNotFoundError(
        f"{path}: no '{T5X_ORBAX_ITEM}' directory and no checkpoint_<step> subdirectories")
  return latest


def _is_t5x_state(state_dir: str) -> bool:
  """Whether ``state/`` holds T5X's msgpack (a ``checkpoint`` and no ``_METADATA``)."""
  if not is_dir(state_dir):
    return False
  names = set(listdir(state_dir))
  return T5X_MSGPACK in names and ORBAX_METADATA not in names


def _t5x_kind(directory: str, names: set[str]) -> Optional[str]:
  if T5X_MSGPACK in names:
    return "t5x"
  if T5X_ORBAX_ITEM in names:
    return "t5x" if _is_t5x_state(join(directory, T5X_ORBAX_ITEM)) else "t5x_orbax"
  return None


def _t5x_msgpack_dir(path: str) -> str:
  """The directory of the T5X msgpack: ``path``, its ``state/``, or its latest step's."""
  if storage.is_file(join(path, T5X_MSGPACK)):
    return path
  if _is_t5x_state(join(path, T5X_ORBAX_ITEM)):
    return join(path, T5X_ORBAX_ITEM)
  latest = latest_step_dir(path)
  if latest is None:
    raise CheckpointNotFoundError(
        f"{path}: no '{T5X_MSGPACK}' file and no checkpoint_<step> subdirectories")
  state = join(latest, T5X_ORBAX_ITEM)
  return state if _is_t5x_state(state) else latest


def detect_format(path: str) -> str:
  """Which of 'specdec', 't5x', 't5x_orbax', 'hf' the directory holds."""
  with storage.cached_listings():
    require_dir(path)
    names = set(listdir(path))
    if names & set(HF_WEIGHT_FILES):
      return "hf"
    if SPECDEC_PARAMS_DIR in names and "config.json" in names:
      return "specdec"
    kind = _t5x_kind(path, names)
    if kind:
      return kind
    latest = latest_step_dir(path)
    if latest is not None:
      inner = set(listdir(latest))
      kind = _t5x_kind(latest, inner)
      if kind:
        return kind
      raise CheckpointError(f"{latest}: neither a T5X msgpack '{T5X_MSGPACK}' file nor an "
                            f"orbax '{T5X_ORBAX_ITEM}' directory; contents: {few(inner, 10)}")
    raise CheckpointError(f"{path}: cannot detect the checkpoint format; contents: "
                          f"{few(names, 10)}")


def peek_config(path: str, fmt: str = "auto", preset: Optional[str] = None,
                dtype: str = "float32") -> Optional[T5Config]:
  """A checkpoint's architecture from its preset or ``config.json`` (no weights read); None
  when it does not say. An unreachable ``gs://`` raises; other problems are the load's."""
  if preset:
    return get_config(preset, dtype=dtype)
  if "://" in path and not storage.is_gcs(path):
    return None
  try:
    config_path = storage.join(path, "config.json")
    if fmt not in ("auto", "specdec", "hf") or not storage.is_file(config_path):
      return None
    fields = json.loads(storage.read_bytes(config_path))
    if fmt == "auto":  # HF's config.json names d_kv and model_type; ours has neither
      fmt = "hf" if "d_kv" in fields or "model_type" in fields else "specdec"
    if fmt == "specdec":
      return config_from_dict(fields, path).replace(dtype=dtype)
    return hf_config_to_t5(fields, dtype=dtype)
  except (storage.StorageUnreachableError, storage.StorageAccessError):
    raise
  except Exception:  # pylint: disable=broad-except  (the real load reports a bad checkpoint)
    return None


def load_checkpoint(path: str, fmt: str = "auto", config: Optional[T5Config] = None,
                    param_dtype: Any = "float32",
                    partitioner: Optional[Partitioner] = None) -> tuple[dict, T5Config]:
  """T5 parameters (a T5X-named tree of ``jax.Array``) and their config.

  path: local or ``gs://`` (T5X: a ``checkpoint_<step>`` or the model directory, whose
  largest step wins); config: required for T5X formats, else it must match the stored
  one but for ``dtype``; param_dtype: of kernels and the embedding (norms stay float32);
  partitioner: each device reads its own slice (None: one device). A missing path,
  unreachable storage, corrupt files, mismatched names/shapes or an indivisible mesh
  dimension is one error naming it."""
  if fmt not in FORMATS:
    raise ValueError(f"unknown checkpoint format {fmt!r}; expected one of {FORMATS}")
  path = path.rstrip("/") if is_gcs(path) else os.path.abspath(path)
  # One listing of a gs:// directory answers every question asked about it below.
  with storage.cached_listings():
    return _load(path, fmt, config, param_dtype, partitioner)


def _load(path: str, fmt: str, config: Optional[T5Config], param_dtype: Any,
          partitioner: Optional[Partitioner]) -> tuple[dict, T5Config]:
  if storage.basename(path) == T5X_MSGPACK and storage.is_file(path):
    path, fmt = storage.dirname(path), "t5x" if fmt == "auto" else fmt
  require_dir(path)
  if fmt == "auto":
    fmt = detect_format(path)
  if fmt == "specdec":
    return load_specdec(path, config, param_dtype, partitioner)
  if fmt == "hf":
    return load_hf(path, config, param_dtype, partitioner)
  if config is None:
    raise CheckpointError(f"{path}: a {fmt} checkpoint does not record the model "
                          "architecture; pass config= (e.g. a preset from PRESETS)")
  if fmt == "t5x":
    return load_t5x(_t5x_msgpack_dir(path), config, param_dtype, partitioner), config
  step_dir = _orbax_step_dir(path)
  return load_t5x_orbax(step_dir, config, param_dtype, partitioner), config
