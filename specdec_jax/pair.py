"""A target and its draft as one spec (paths, mesh layout, dtypes), validated before any
weight is read: ``PairSettings`` (inherited by ``Experiment`` and ``DistillJob``) and
``ModelPair`` (checks, peeked architectures, partitioners, loading). Relative paths
are looked up in the cwd, then ``config_dirs`` (last first), then the repository root."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from specdec_jax import checkpoints, data, partitioning, quantization, storage
from specdec_jax.models.t5 import (DECODE_KERNELS, T5Config, T5Model, fuse_projections,
                                     get_config, param_shapes)
from specdec_jax.partitioning import Partitioner

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16", "float16")   # activation and weight dtypes
ROLES = ("target", "draft")


def is_remote(path: str) -> bool:
  """Whether ``path`` is ``gs://`` or a ``seqio:`` task (passed on unchanged)."""
  return storage.is_gcs(path) or path.startswith("seqio:")


def candidates(path: str, config_dirs: Sequence[str] = ()) -> list[str]:
  """Where a relative path is looked for: cwd, each of ``config_dirs``, the repo root."""
  if is_remote(path):
    return [path]
  if os.path.isabs(path):
    return [str(Path(path))]
  return [str(p) for p in [Path(path)] + [Path(d) / path for d in config_dirs] + [REPO_ROOT / path]]


def resolve_path(path: str, config_dirs: Sequence[str] = ()) -> str:
  """The first existing candidate, else the repo-root one."""
  cands = candidates(path, config_dirs)
  return next((c for c in cands if Path(c).exists()), cands[-1]) if len(cands) > 1 else cands[0]


def check_path(setting: str, value: str, config_dirs: Sequence[str] = (),
               must_exist: bool = True) -> None:
  """Raise naming ``setting`` for a malformed ``gs://`` URL or (``must_exist``) a missing path."""
  if storage.is_gcs(value):
    try:
      storage.check_path(value)
    except ValueError as e:
      raise ValueError(f"{setting}: {e}") from None
  elif must_exist and not is_remote(value) and not Path(resolve_path(value, config_dirs)).exists():
    raise FileNotFoundError(f"{setting}: {value!r} does not exist (looked in: "
                            f"{', '.join(candidates(value, config_dirs))})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PairSettings:
  """The settings of a target and its draft, declared once (``--help`` prints each
  entry's first sentence; scale: docs/sharding.md).

  target_checkpoint: the target's checkpoint, a local path or gs://.
  draft_checkpoint: the draft's checkpoint ('' for an approximation model that reads none).
  target_format: the target checkpoint's format (``checkpoints.FORMATS``; 'auto' detects it).
  draft_format: the draft checkpoint's format (``checkpoints.FORMATS``; 'auto' detects it).
  target_preset: the target's architecture by name, e.g. 't5_1_1_xxl' (required
    for T5X formats; None: the checkpoint's config.json).
  draft_preset: the draft's architecture by name, e.g. 't5_1_1_small' (as ``target_preset``).
  vocab_path: the SentencePiece vocabulary both models speak.
  vocab_extra_ids: sentinel ids appended to the vocabulary (T5's extra ids).
  mesh_shape: the device mesh (data, model), its product the device count (None: one device).
  logical_axis_rules: the target's T5X logical axis rules (None:
    ``partitioning.STANDARD_RULES``).
  draft_logical_axis_rules: the draft's logical axis rules (None:
    ``partitioning.DATA_PARALLEL_RULES``, replicated over the model axis).
  partition_fallback: what a dimension the mesh does not divide gets: 'error'
    or 'replicate' (logged).
  param_dtype: the dtype weights are kept in (norms stay float32).
  draft_param_dtype: the draft's weight dtype (None: ``param_dtype``).
  dtype: the dtype activations run at.
  min_rows: the fewest rows every weight product runs over (``T5Config.min_rows``;
    2 keeps a batch-1 step a matrix product on GPUs).
  decode_kernel: both models' chain decode: 'xla', the reference, or 'pallas'
    (``specdec_jax.kernels``; one device, float kernels, unfused projections).
  fixed_positions: positions every target decode call scores, 0 off
    (``T5Config.fixed_positions``; at least γ + 1 or a tree's node count). Every
    call then reduces each position in one order, so T = 0 matches the baseline
    in bfloat16 too.
  fused_projections: run self-attention's query/key/value and the gated MLP's
    wi_0/wi_1 as one product each (kernels fused after loading,
    ``t5.fuse_projections``; one device only).
  draft_quantization: the draft's kernels quantized weight-only when it loads:
    None, 'int8' or 'int4' (``specdec_jax.quantization``). None keeps what the
    draft's checkpoint records, else float. Exact for any value: only α and the
    draft's cost change.

  ``config_dirs`` is not a setting: where relative paths are looked for after the cwd."""

  target_checkpoint: str = ""
  draft_checkpoint: str = ""
  target_format: str = "auto"
  draft_format: str = "auto"
  target_preset: Optional[str] = None
  draft_preset: Optional[str] = None
  vocab_path: str = "checkpoints/demo/spm.model"
  vocab_extra_ids: int = 0
  mesh_shape: Optional[tuple] = None
  logical_axis_rules: Optional[tuple] = None
  draft_logical_axis_rules: Optional[tuple] = None
  partition_fallback: str = "error"
  param_dtype: str = "float32"
  draft_param_dtype: Optional[str] = None
  dtype: str = "float32"
  min_rows: int = 1
  decode_kernel: str = "xla"
  fixed_positions: int = 0
  fused_projections: bool = False
  draft_quantization: Optional[str] = None
  config_dirs: tuple = ()

  def model_pair(self, owner: str = "") -> ModelPair:
    """These settings as a ``ModelPair`` whose messages spell them as ``owner`` does."""
    return ModelPair(**{f.name: getattr(self, f.name)
                        for f in dataclasses.fields(PairSettings)}, owner=owner)

  def resolve(self, path: str) -> str:
    return resolve_path(path, self.config_dirs)

  def weight_dtype(self, role: str) -> str:
    """The dtype 'target' or 'draft' keeps its weights in (norms aside)."""
    return self.draft_param_dtype if role == "draft" and self.draft_param_dtype \
        else self.param_dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelPair(PairSettings):
  """The target and the draft, validated and loaded. ``owner`` spells the settings in
  messages: 'Experiment' (gin bindings) or '' (``DistillJob``'s flags, the bare name)."""

  owner: str = ""

  def spell(self, setting: str) -> str:
    """``setting`` as the user writes it (``Experiment.draft_checkpoint``)."""
    return f"{self.owner}.{setting}" if self.owner else setting

  def _named(self, setting: str, message: str) -> str:
    """``message`` led by the setting's name (once)."""
    name = self.spell(setting)
    return message if message.startswith(name) else f"{name}: {message}"

  def model(self, role: str) -> tuple[str, str, Optional[str]]:
    if role not in ROLES:
      raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return (getattr(self, f"{role}_checkpoint"), getattr(self, f"{role}_format"),
            getattr(self, f"{role}_preset"))

  def check_values(self, param_dtypes: Sequence[str] = DTYPES) -> None:
    """Every setting's value (no file is looked at); ``param_dtypes``: the owner's."""
    for name, allowed in (("target_format", checkpoints.FORMATS),
                          ("draft_format", checkpoints.FORMATS),
                          ("param_dtype", tuple(param_dtypes)), ("dtype", DTYPES),
                          ("decode_kernel", DECODE_KERNELS),
                          ("partition_fallback", partitioning.FALLBACKS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"{self.spell(name)} must be one of {allowed}, "
                         f"got {getattr(self, name)!r}")
    if self.draft_param_dtype not in (None,) + DTYPES:
      raise ValueError(f"{self.spell('draft_param_dtype')} must be None or one of {DTYPES}, "
                       f"got {self.draft_param_dtype!r}")
    quantization.check(self.draft_quantization, self.spell("draft_quantization"))
    if isinstance(self.min_rows, bool) or not isinstance(self.min_rows, int) or self.min_rows < 1:
      raise ValueError(f"{self.spell('min_rows')} must be an int >= 1, got {self.min_rows!r}")
    if self.decode_kernel == "pallas" and self.mesh_shape is not None:
      raise ValueError(f"{self.spell('decode_kernel')}='pallas' runs on one device; "
                       f"{self.spell('mesh_shape')} is {self.mesh_shape!r} (use 'xla' on a mesh)")
    if self.decode_kernel == "pallas" and self.draft_quantization is not None:
      raise ValueError(f"{self.spell('decode_kernel')}='pallas' does not cover quantized "
                       f"kernels; {self.spell('draft_quantization')} is "
                       f"{self.draft_quantization!r} (use 'xla')")
    if (isinstance(self.fixed_positions, bool) or not isinstance(self.fixed_positions, int)
        or self.fixed_positions < 0):
      raise ValueError(f"{self.spell('fixed_positions')} must be an int >= 0 (0: off), got "
                       f"{self.fixed_positions!r}")
    if not isinstance(self.fused_projections, bool):
      raise ValueError(f"{self.spell('fused_projections')} must be True or False, got "
                       f"{self.fused_projections!r}")
    if self.fused_projections and self.mesh_shape is not None:
      raise ValueError(f"{self.spell('fused_projections')} runs on one device only: a fused "
                       f"kernel's columns would not split by head over {self.spell('mesh_shape')}"
                       f"={self.mesh_shape!r}")
    if self.decode_kernel == "pallas" and self.fused_projections:
      raise ValueError(f"{self.spell('decode_kernel')}='pallas' reads the unfused T5X kernels; "
                       f"{self.spell('fused_projections')} is True (the kernels fuse their own "
                       "products)")
    if self.vocab_extra_ids < 0:
      raise ValueError(f"{self.spell('vocab_extra_ids')} must be >= 0, got {self.vocab_extra_ids}")
    shape = self.mesh_shape
    if shape is not None and (
        not isinstance(shape, (tuple, list)) or len(shape) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)):
      raise ValueError(f"{self.spell('mesh_shape')} must be None or two positive ints "
                       f"(data, model), got {shape!r}")
    for name in ("logical_axis_rules", "draft_logical_axis_rules"):
      if getattr(self, name) is not None:
        try:
          partitioning.validate_rules(getattr(self, name))
        except (partitioning.PartitioningError, TypeError) as e:
          raise ValueError(f"{self.spell(name)}: {e}") from None

  def unset(self, draft_needed: bool) -> list[str]:
    """The required paths that are not set (the draft's with ``draft_needed``)."""
    names = ["target_checkpoint", "vocab_path"] + (["draft_checkpoint"] if draft_needed else [])
    return [n for n in names if not getattr(self, n)]

  def check_paths(self, must_exist: bool = True) -> None:
    for name in ("target_checkpoint", "draft_checkpoint", "vocab_path"):
      if getattr(self, name):
        check_path(self.spell(name), getattr(self, name), self.config_dirs, must_exist)

  def peek_config(self, role: str) -> Optional[T5Config]:
    """The model's architecture without reading weights; None when unknown."""
    path, fmt, preset = self.model(role)
    if not path:
      return None
    return checkpoints.peek_config(self.resolve(path), fmt, preset, self.dtype)

  def partitioners(self) -> tuple[Optional[Partitioner], Optional[Partitioner]]:
    """(target's, draft's) partitioners over one mesh, or (None, None) for one device."""
    try:
      target = partitioning.from_settings(self.mesh_shape, self.logical_axis_rules,
                                          self.partition_fallback)
      if target is None:
        return None, None
      rules = (partitioning.DATA_PARALLEL_RULES if self.draft_logical_axis_rules is None
               else self.draft_logical_axis_rules)
      return target, partitioning.from_settings(self.mesh_shape, rules,
                                                self.partition_fallback, mesh=target.mesh)
    except partitioning.PartitioningError as e:
      raise ValueError(self._named("mesh_shape", str(e))) from None

  def check_vocabularies(self, target: T5Config, draft: T5Config) -> None:
    """The draft must speak the target's token ids (same vocab_size, pad and EOS)."""
    try:
      data.check_vocab_compatible(target.vocab_size, draft.vocab_size,
                                  target_pad_id=target.pad_id, draft_pad_id=draft.pad_id,
                                  target_eos_id=target.eos_id, draft_eos_id=draft.eos_id)
    except ValueError as e:
      raise ValueError(f"{e} ({self.spell('target_checkpoint')}={self.target_checkpoint}, "
                       f"{self.spell('draft_checkpoint')}={self.draft_checkpoint}); distill "
                       "a draft with the target's vocabulary") from None

  def check_vocab_size(self, vocab_size: int, target: T5Config) -> None:
    if vocab_size > target.vocab_size:
      raise ValueError(f"vocabulary {self.vocab_path} has {vocab_size} ids but the target's "
                       f"vocab_size is {target.vocab_size}")

  def check_shardings(self, target_part: Optional[Partitioner], draft_part: Optional[Partitioner],
                      decode: Optional[tuple[int, int, int]] = None) -> None:
    """Every parameter dimension the mesh must divide, from the architectures alone; with
    ``decode`` = (rows, input length, cache length) also the inputs and KV caches."""
    if target_part is None:
      return
    if decode is not None:
      target_part.batch_sharding(decode[:2], f"{self.spell('batch_size')} (inputs)")
    for role, part in (("target", target_part), ("draft", draft_part)):
      cfg = self.peek_config(role)
      if cfg is None:
        continue
      try:
        part.param_shardings(param_shapes(cfg))
        if decode is not None:
          b, input_len, cache_len = decode
          for length, what in ((cache_len, "self-attention cache"), (input_len, "cross K/V")):
            part.spec(partitioning.CACHE_AXES, (b, length, cfg.num_heads, cfg.head_dim),
                      f"{role} {what}")
      except partitioning.PartitioningError as e:
        raise ValueError(f"{self.spell('mesh_shape')}={tuple(self.mesh_shape)} cannot shard "
                         f"the {role} ({self.model(role)[0]}): {e}") from None

  def check_before_loading(self, decode: Optional[tuple[int, int, int]] = None
                           ) -> tuple[Optional[Partitioner], Optional[Partitioner]]:
    """Every check of the pair that reads no weight -> ``partitioners()``."""
    target_part, draft_part = self.partitioners()
    target, draft = self.peek_config("target"), self.peek_config("draft")
    if target is not None and draft is not None:
      self.check_vocabularies(target, draft)
    self.check_shardings(target_part, draft_part, decode)
    return target_part, draft_part

  def load(self, role: str, partitioner: Optional[Partitioner] = None,
           quantize: bool = True) -> tuple[T5Model, Any]:
    """(model, params) of 'target' or 'draft', read into the partitioner's shards at the
    role's weight dtype; the draft quantized per ``quantization_of_draft`` if ``quantize``."""
    path, fmt, preset = self.model(role)
    config = get_config(preset, dtype=self.dtype) if preset else None
    params, config = checkpoints.load_checkpoint(self.resolve(path), fmt=fmt, config=config,
                                                 param_dtype=self.weight_dtype(role),
                                                 partitioner=partitioner)
    if self.fused_projections:  # before quantizing: the same per-column scales
      if partitioner is not None:
        raise ValueError(f"{self.spell('fused_projections')} runs on one device only, not on "
                         "a partitioner's mesh")
      params = fuse_projections(params)
    if role == "draft" and quantize:
      mode = self.quantization_of_draft()
      if mode is not None:
        params = quantization.quantize_params(params, mode)
    return T5Model(self.runtime(config, role)), params

  def runtime(self, config: T5Config, role: str) -> T5Config:
    """``config`` with the runtime choices that change no weight value."""
    fixed = self.fixed_positions if role == "target" else 0
    return config.replace(dtype=self.dtype, min_rows=self.min_rows, fixed_positions=fixed,
                          fused_projections=self.fused_projections,
                          decode_kernel=self.decode_kernel)

  def quantization_of_draft(self) -> Optional[str]:
    """``draft_quantization``, else what the draft's checkpoint records, else None."""
    path = self.draft_checkpoint
    where = self.resolve(path) if path and not is_remote(path) else ""
    recorded = recorded_quantization(where) if where else None
    if self.draft_quantization is not None and recorded not in (None, self.draft_quantization):
      raise ValueError(f"{self.spell('draft_quantization')}={self.draft_quantization!r} but "
                       f"the draft {path} was exported for {recorded!r} "
                       f"({quantization.RECORD_FILE}); bind None to use the recorded one")
    return self.draft_quantization or recorded


def recorded_quantization(directory: str) -> Optional[str]:
  import json
  path = Path(directory) / quantization.RECORD_FILE
  if not path.is_file():
    return None
  with open(path) as f:
    value = json.load(f).get("draft_quantization")
  quantization.check(value, f"{path}: draft_quantization")
  return value
