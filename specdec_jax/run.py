r"""Experiment runner: speculative decoding vs the plain baseline (paper §4).

  python -m specdec_jax.run --config=configs/demo.gin [--config=more.gin] \
      [--gin_bindings='Experiment.gamma = 5'] [--workdir=runs/x] [--resume] \
      [--alpha_only] [--import=my_drafts] [--verbose]

Everything an experiment varies is a binding of ``Experiment`` (listed below
with its default). Measurement protocol (README "Measurement protocol"):

* the first ``num_warmup`` examples compile and warm both loops, untimed;
* each timed batch is decoded by the baseline and by speculative decoding with
  the same inputs, max length, sampling settings and key, each call ending in
  ``block_until_ready``;
* c and v are measured once, up front, with the same jitted pieces;
* per example, one line of ``examples.jsonl`` (appended and flushed as it
  completes); ``summary.json`` is recomputed from all lines, so every number
  it holds can be recomputed from ``examples.jsonl``.

``--alpha_only`` (paper §4.2, Table 3) generates with the target alone and
averages sum_x min(p, q) along the generated tokens.

Workdir integrity: nothing is written before the first result; ``config.gin``
(the run's gin config) is written atomically with it, so a workdir's files
always describe its results. A workdir holds one mode (speculative or
``--alpha_only``); the other mode, a different config, or a corrupt line is
refused before any work, with nothing changed. ``--resume`` may raise
``Experiment.num_examples`` (the run is extended); on a finished run it prints
the table without loading any model.

Relative paths in configs (checkpoints, vocabulary, data) are looked up in the
working directory, then next to each ``--config`` file (last first), then in
the repository root.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import os
import re
import sys
import time
import traceback
import typing
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import gin
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from specdec_jax import (accounting, autogamma, checkpoints, data, drafts, memory,
                         partitioning, theory)
from specdec_jax import bridge as bridge_lib
from specdec_jax import feature_bridge as feature_lib
from specdec_jax import shortlist as shortlist_lib
from specdec_jax.decoding import (CONFIDENCE_RULES, AdaptiveConfig, alpha_estimates,
                                  speculative_decode, temperature_sample)
from specdec_jax.models.t5 import T5Config, T5Model, get_config, param_shapes
from specdec_jax.sampling import SamplingConfig
from specdec_jax.timing import block, measure_costs, timed, warm_up_widths

REPO_ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}   # activation dtype -> bytes
MODES = ("speculative", "alpha_only")
# Experiment fields that hold paths, and the macros the paper configs bind them to.
_PATH_FIELDS = ("vocab_path", "target_checkpoint", "draft_checkpoint", "source", "ngram_corpus",
                "draft_shortlist")
_CONFIG_DIRS: list[Path] = []  # directories of the parsed --config files, last first


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Experiment:
  """One experiment. Every field is a gin binding (``Experiment.<field>``).

  Models: a checkpoint path + format ('auto', 'specdec', 't5x', 't5x_orbax',
  'hf') + preset (required for T5X formats, e.g. 't5_1_1_xxl'); the draft is an
  approximation model by name ('t5', 'unigram', 'bigram', 'prompt_lookup', 'lookup_t5').
  unigram/bigram are estimated from ``ngram_corpus`` (a source like
  ``source``; its references are the corpus).
  """

  task: str = "bible_modernize"
  source: str = "data/bible/test.tsv"         # local .tsv/.jsonl or 'seqio:<task>'
  split: str = "test"                        # for seqio sources
  tfds_data_dir: Optional[str] = None
  prefix: Optional[str] = None               # default: data.PREFIXES[task]
  vocab_path: str = "checkpoints/demo/spm.model"
  vocab_extra_ids: int = 0
  target_checkpoint: str = ""
  target_format: str = "auto"
  target_preset: Optional[str] = None
  target_label: Optional[str] = None         # name in tables; default: path basename
  draft_name: str = "t5"
  draft_checkpoint: str = ""
  draft_format: str = "auto"
  draft_preset: Optional[str] = None
  draft_label: Optional[str] = None
  # A T5 draft's vocabulary shortlist (specdec_jax.shortlist; scripts/make_shortlist.py):
  # q only over these tokens, plus each input's own with draft_shortlist_inputs.
  # Exact for any shortlist; it trades a little α for a much cheaper draft step.
  draft_shortlist: str = ""
  draft_shortlist_inputs: bool = True
  ngram_corpus: Optional[str] = None
  ngram_corpus_split: str = "train"
  ngram_corpus_max_examples: Optional[int] = None
  prompt_lookup_max_ngram: int = 3
  temperature: float = 0.0
  topk: int = 0
  topp: float = 0.0
  gamma: Union[int, str] = 5                 # draft tokens per round, or 'auto' (§3.5)
  gamma_max: int = 8                         # the largest γ 'auto' considers
  # Where 'auto' estimates α: '' = the warm-up examples; else a held-out source
  # (a validation split: tuning γ on it keeps the timed examples untouched),
  # its first auto_alpha_examples examples.
  auto_alpha_source: str = ""
  auto_alpha_examples: int = 32
  # Adaptive draft length per round and row (decoding.AdaptiveConfig); gamma is
  # then γ_max. 'threshold': the draft stops when its top probability is at or
  # below adaptive_threshold; 'cumulative': when the product of its top
  # probabilities this round is; 'schedule': +2 after a fully accepted round, -1 else.
  adaptive: Optional[str] = None
  adaptive_threshold: float = 0.4
  # 'threshold'/'cumulative' only: a row whose first draft distribution has top probability
  # <= this proposes nothing that round (a plain target step); None: never.
  adaptive_skip_below: Optional[float] = None
  # 'threshold'/'cumulative' only: what they read after each draft token: 'top'
  # (max_x q(x)) or 'drawn' (q of the token drawn; the same at T = 0).
  adaptive_confidence: str = "top"
  adaptive_initial_gamma: Optional[int] = None
  # The verification widths compiled for adaptive rounds (AdaptiveConfig.widths);
  # () = powers of two below gamma, and gamma. At batch 1 where v(k) grows with
  # k (a CPU), every width 1..gamma avoids verifying positions nobody proposed.
  adaptive_widths: tuple = ()
  lenience: float = 1.0
  batch_size: int = 1
  max_input_len: int = 128
  # Input lengths to pad each batch to: the smallest that holds its longest
  # input (data.fit_to_bucket), one compiled program each, all compiled in the
  # warm-up. () pads to max_input_len always (T5X's fixed feature length).
  input_buckets: tuple = ()
  max_decode_len: int = 128
  on_too_long: str = "truncate"              # or 'error'
  dtype: str = "float32"                     # activation dtype
  param_dtype: str = "float32"               # weights in device memory; norms stay float32
  # Sharding (docs/scaling.md). None: one device, exactly the unsharded path.
  mesh_shape: Optional[tuple] = None         # (data, model), product = device count
  logical_axis_rules: Optional[tuple] = None     # None: partitioning.STANDARD_RULES
  draft_logical_axis_rules: Optional[tuple] = None  # None: DATA_PARALLEL_RULES
  partition_fallback: str = "error"          # or 'replicate' (logged) for non-divisible dims
  multihost: bool = False                    # jax.distributed.initialize() before anything
  coordinator_address: Optional[str] = None  # multihost off Cloud TPU VMs: 'host:port'
  num_processes: Optional[int] = None
  process_id: Optional[int] = None
  num_warmup: int = 2
  num_examples: int = 100
  seed: int = 0
  alpha_only_tokens: int = 10_000

  def sampling(self) -> SamplingConfig:
    return SamplingConfig(self.temperature, self.topk, self.topp)

  def validate(self) -> None:
    """Cheap checks that fail before any long work starts (types, values, paths)."""
    self.check_types()
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"Experiment.{name} must be one of {sorted(DTYPES)}, "
                         f"got {getattr(self, name)!r}")
    if self.mesh_shape is not None and (
        len(self.mesh_shape) != 2 or not all(isinstance(n, int) and not isinstance(n, bool)
                                             and n >= 1 for n in self.mesh_shape)):
      raise ValueError(f"Experiment.mesh_shape must be None or two positive ints (data, model), "
                       f"got {self.mesh_shape!r}")
    for name in ("logical_axis_rules", "draft_logical_axis_rules"):
      if getattr(self, name) is not None:
        try:
          partitioning.validate_rules(getattr(self, name))
        except (partitioning.PartitioningError, TypeError) as e:
          raise ValueError(f"Experiment.{name}: {e}") from None
    if self.partition_fallback not in partitioning.FALLBACKS:
      raise ValueError(f"Experiment.partition_fallback must be one of "
                       f"{partitioning.FALLBACKS}, got {self.partition_fallback!r}")
    if self.multihost and self.coordinator_address is not None and (
        self.num_processes is None or self.process_id is None):
      raise ValueError("Experiment.multihost with Experiment.coordinator_address also needs "
                       "Experiment.num_processes and Experiment.process_id")
    self.sampling()  # temperature / topk / topp errors
    if isinstance(self.gamma, str) and self.gamma != "auto":
      raise ValueError(f"Experiment.gamma must be an int >= 1 or 'auto', got {self.gamma!r}")
    if not isinstance(self.gamma, str) and self.gamma < 1:
      raise ValueError(f"Experiment.gamma must be >= 1, got {self.gamma}")
    if self.gamma_max < 1:
      raise ValueError(f"Experiment.gamma_max must be >= 1, got {self.gamma_max}")
    if self.auto_alpha_source and self.auto_alpha_examples < 1:
      raise ValueError("Experiment.auto_alpha_examples must be >= 1 with "
                       f"auto_alpha_source={self.auto_alpha_source!r}, got "
                       f"{self.auto_alpha_examples}")
    if self.adaptive is not None:
      if self.gamma == "auto":
        raise ValueError("Experiment.adaptive chooses γ per round up to Experiment.gamma "
                         "(γ_max); bind a number for gamma, not 'auto'")
      try:
        self.adaptive_config().verify_widths(self.gamma)
      except ValueError as e:
        raise ValueError(f"Experiment.adaptive={self.adaptive!r}: {e}") from None
    if not 0 < self.lenience <= 1:
      raise ValueError(f"Experiment.lenience must be in (0, 1] (1 is exact), got {self.lenience}")
    if self.draft_name not in drafts.REGISTRY:
      raise ValueError(f"unknown approximation model Experiment.draft_name="
                       f"{self.draft_name!r}; known: {sorted(drafts.REGISTRY)} (a draft "
                       "defined outside the package needs --import=<its module>)")
    for name in ("batch_size", "max_input_len", "max_decode_len", "num_examples",
                 "alpha_only_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"Experiment.{name} must be >= 1, got {getattr(self, name)}")
    data.check_input_buckets(self.input_buckets, self.max_input_len, "Experiment.input_buckets")
    if self.num_warmup < 0:
      raise ValueError(f"Experiment.num_warmup must be >= 0, got {self.num_warmup}")
    if self.on_too_long not in ("truncate", "error"):
      raise ValueError(f"Experiment.on_too_long must be 'truncate' or 'error', "
                       f"got {self.on_too_long!r}")
    uses_checkpoint = drafts.takes(self.draft_name, "model") or drafts.takes(self.draft_name,
                                                                             "params")
    if self.draft_checkpoint and not uses_checkpoint:
      raise ValueError(f"Experiment.draft_checkpoint={self.draft_checkpoint!r} is set but "
                       f"approximation model {self.draft_name!r} takes no checkpoint (its "
                       "builder has no model/params argument); bind "
                       "Experiment.draft_checkpoint = '' for it")
    if self.draft_shortlist and not drafts.takes(self.draft_name, "shortlist"):
      raise ValueError(f"Experiment.draft_shortlist={self.draft_shortlist!r} is set but "
                       f"approximation model {self.draft_name!r} takes no 'shortlist' "
                       "argument (the T5 drafts 't5' and 'lookup_t5' do)")
    needs = set(drafts.requires(self.draft_name))
    unset = [(f, "") for f in ("target_checkpoint", "vocab_path", "source")
             if not getattr(self, f)]
    if needs & {"model", "params"} and not self.draft_checkpoint:
      unset.append(("draft_checkpoint", f"draft_name={self.draft_name!r} needs one"))
    if "corpus" in needs and not self.ngram_corpus:
      unset.append(("ngram_corpus", f"draft_name={self.draft_name!r} is estimated from a "
                    "corpus"))
    if unset:
      items = []
      for f, why in unset:
        macro = _macro_for(f)
        item = f"Experiment.{f} is not set" + (f" ({why})" if why else "")
        items.append(f"{macro} ({item})" if macro else item)
      example = _macro_for(unset[0][0]) or f"Experiment.{unset[0][0]}"
      raise ValueError(f"missing settings: {'; '.join(items)}. Bind each, e.g. "
                       f"--gin_bindings=\"{example} = '/path/...'\"")
    for name in _PATH_FIELDS:
      value = getattr(self, name)
      if value and not _is_remote(value) and not Path(_resolve(value)).exists():
        raise FileNotFoundError(f"Experiment.{name}: {value!r} does not exist (looked in: "
                                f"{', '.join(str(c) for c in _candidates(value))})")

  def check_types(self) -> None:
    """Each field has its annotated type (gin passes whatever the config says)."""
    hints = typing.get_type_hints(Experiment)

    def matches(value, t) -> bool:
      if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
      if t is tuple:  # gin writes (1, 8); [1, 8] is as clear
        return isinstance(value, (tuple, list))
      return isinstance(value, t) and not (t is int and isinstance(value, bool))

    for f in dataclasses.fields(self):
      value, want = getattr(self, f.name), hints[f.name]
      types = [a for a in typing.get_args(want) if a is not type(None)] or [want]
      optional = type(None) in typing.get_args(want)
      if (value is None and optional) or any(matches(value, t) for t in types):
        continue
      names = " or ".join(t.__name__ for t in types)
      raise ValueError(f"Experiment.{f.name} must be {names}{' or None' if optional else ''}, "
                       f"got {value!r} ({type(value).__name__})")

  def adaptive_config(self) -> Optional[AdaptiveConfig]:
    """The engine's adaptive setting (None: a fixed γ every round)."""
    if self.adaptive is None:
      return None
    skip = None if self.adaptive_skip_below is None else float(self.adaptive_skip_below)
    widths = tuple(int(w) for w in self.adaptive_widths)
    if self.adaptive in CONFIDENCE_RULES:
      return AdaptiveConfig(self.adaptive, threshold=float(self.adaptive_threshold),
                            skip_below=skip, widths=widths,
                            confidence=self.adaptive_confidence)
    return AdaptiveConfig(self.adaptive, initial_gamma=self.adaptive_initial_gamma,
                          skip_below=skip, widths=widths, confidence=self.adaptive_confidence)

  @property
  def gamma_bound(self) -> int:
    """The largest γ any round may use: what caches and memory are sized for."""
    return self.gamma_max if self.gamma == "auto" else self.gamma

  @property
  def labels(self) -> tuple[str, str]:
    target = self.target_label or Path(self.target_checkpoint.rstrip("/")).name
    if self.draft_name == "t5":
      draft = self.draft_label or Path(self.draft_checkpoint.rstrip("/")).name
    else:
      draft = self.draft_label or self.draft_name
    if self.draft_shortlist and not self.draft_label:
      draft += "+shortlist"
    return target, draft


def _is_remote(path: str) -> bool:
  return path.startswith("gs://") or path.startswith("seqio:")


def _candidates(path: str) -> list[Path]:
  """Where a relative path is looked for: cwd, each config's directory, the repo root."""
  if _is_remote(path) or os.path.isabs(path):
    return [Path(path)]
  return [Path(path)] + [d / path for d in _CONFIG_DIRS] + [REPO_ROOT / path]


def _resolve(path: str) -> str:
  """The first existing candidate (see ``_candidates``), else the repo-root one."""
  cands = _candidates(path)
  return str(next((c for c in cands if c.exists()), cands[-1]))


def _macro_for(field: str) -> Optional[str]:
  """The gin macro ``Experiment.<field>`` is bound to (e.g. TARGET_CHECKPOINT), if any."""
  try:
    ref = gin.query_parameter(f"Experiment.{field}")
  except (ValueError, KeyError):
    return None
  text = str(ref)
  return text[1:] if isinstance(ref, gin.config.ConfigurableReference) and \
      text.startswith("%") else None


# ------------------------------------------------------------------ loading


@dataclasses.dataclass
class Data:
  vocab: Any
  examples: list            # data.Example, warm-up first
  inputs: np.ndarray        # [N, max_input_len] int32
  truncated: set            # indices of examples whose input was truncated


@dataclasses.dataclass
class Setup:
  exp: Experiment
  vocab: Any
  examples: list            # data.Example, warm-up first
  inputs: np.ndarray        # [N, max_input_len] int32
  target: T5Model
  target_params: Any
  draft: Any
  truncated: set = dataclasses.field(default_factory=set)
  partitioner: Optional[partitioning.Partitioner] = None   # the target's (None: one device)


def _peek_config(path: str, fmt: str, preset: Optional[str], dtype: str) -> Optional[T5Config]:
  """A checkpoint's architecture without reading its weights (None if unknown)."""
  try:
    if preset:
      return get_config(preset, dtype=dtype)
    local = _resolve(path)
    if _is_remote(local):
      return None
    fmt = checkpoints.detect_format(local) if fmt == "auto" else fmt
    fields = json.loads((Path(local) / "config.json").read_text())
    if fmt == "specdec":
      return checkpoints.config_from_dict(fields, local).replace(dtype=dtype)
    if fmt == "hf":
      return checkpoints.hf_config_to_t5(fields, dtype=dtype)
  except Exception:  # the real load reports a bad checkpoint properly
    return None
  return None


def _device_memory() -> tuple[int, str]:
  """(bytes, what) of the memory decoding runs in: the accelerator's, else host RAM."""
  dev = jax.devices()[0]
  try:
    stats = dev.memory_stats() or {}
  except Exception:
    stats = {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{dev.platform} device memory"
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM"


def estimate_bytes(exp: Experiment, alpha_only: bool = False) -> dict[str, int]:
  """Bytes per device of the weights and decoding buffers, from the configs alone.

  ``memory.plan`` under the experiment's mesh and rules: weights at
  ``param_dtype`` (norms float32), KV caches (self-attention over
  max_decode_len + γ + 1 positions, cross-attention over max_input_len) at
  ``dtype``; in ``--alpha_only`` also the teacher-forced p and q ([B, T, V]
  float32, counted unsharded). A model whose checkpoint does not say its
  architecture (no preset, remote) is left out.
  """
  cfgs = {role: _peek_config(path, fmt, preset, exp.dtype) if path else None
          for role, path, fmt, preset in (
              ("target", exp.target_checkpoint, exp.target_format, exp.target_preset),
              ("draft", exp.draft_checkpoint, exp.draft_format, exp.draft_preset))}
  if cfgs["target"] is None:
    return {}
  plan = memory.plan(cfgs["target"], cfgs["draft"], exp.mesh_shape, exp.param_dtype, exp.dtype,
                     exp.batch_size, exp.max_input_len, exp.max_decode_len, exp.gamma_bound,
                     exp.logical_axis_rules, exp.draft_logical_axis_rules,
                     exp.partition_fallback)
  out = {"target weights": plan["target_params"], "target KV cache": plan["target_caches"]}
  if cfgs["draft"] is not None:
    out.update({"draft weights": plan["draft_params"], "draft KV cache": plan["draft_caches"]})
  if alpha_only:
    out["p and q along the outputs"] = (3 * exp.batch_size * exp.max_decode_len
                                        * cfgs["target"].vocab_size * 4)
  return out


def check_memory(exp: Experiment, alpha_only: bool = False) -> None:
  """Refuses a config whose weights and decoding buffers cannot fit on a
  device, before any weight is read."""
  parts = estimate_bytes(exp, alpha_only)
  need = sum(parts.values())
  have, what = _device_memory()
  if need > have:
    detail = ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in parts.items())
    mesh = f"mesh_shape={tuple(exp.mesh_shape)}, " if exp.mesh_shape else ""
    raise ValueError(f"Experiment.max_decode_len={exp.max_decode_len} with batch_size="
                     f"{exp.batch_size} (max_input_len={exp.max_input_len}, {mesh}"
                     f"param_dtype={exp.param_dtype}, dtype={exp.dtype}) needs about "
                     f"{need / 2**30:.1f} GiB per device ({detail}) but the {what} is "
                     f"{have / 2**30:.1f} GiB; lower Experiment.max_decode_len or "
                     "Experiment.batch_size, use bfloat16 weights, or shard over more "
                     "devices (docs/scaling.md)")


def _load_model(path: str, fmt: str, preset: Optional[str], exp: Experiment,
                part: Optional[partitioning.Partitioner]):
  """A checkpoint read straight into its shards (one device without a mesh)."""
  config = get_config(preset, dtype=exp.dtype) if preset else None
  params, config = checkpoints.load_checkpoint(_resolve(path), fmt=fmt, config=config,
                                               param_dtype=exp.param_dtype, partitioner=part)
  return T5Model(config.replace(dtype=exp.dtype)), params


def partitioners(exp: Experiment) -> tuple[Optional[partitioning.Partitioner],
                                          Optional[partitioning.Partitioner]]:
  """(target's, draft's) partitioners over one mesh; (None, None) without a mesh."""
  target = partitioning.from_settings(exp.mesh_shape, exp.logical_axis_rules,
                                      exp.partition_fallback)
  if target is None:
    return None, None
  rules = (partitioning.DATA_PARALLEL_RULES if exp.draft_logical_axis_rules is None
           else exp.draft_logical_axis_rules)
  return target, partitioning.from_settings(exp.mesh_shape, rules, exp.partition_fallback,
                                            mesh=target.mesh)


def check_partitioning(exp: Experiment, target_part, draft_part) -> None:
  """Every parameter, cache and batch dimension the mesh must divide, from the
  configs alone: a bad mesh is refused before any weight is read."""
  if target_part is None:
    return
  b, t = exp.batch_size, exp.max_decode_len + exp.gamma_bound + 1
  target_part.batch_sharding((b, exp.max_input_len), "Experiment.batch_size (inputs)")
  models = [("target", exp.target_checkpoint, exp.target_format, exp.target_preset,
             target_part)]
  if exp.draft_checkpoint:
    models.append(("draft", exp.draft_checkpoint, exp.draft_format, exp.draft_preset,
                   draft_part))
  for role, path, fmt, preset, part in models:
    cfg = _peek_config(path, fmt, preset, exp.dtype)
    if cfg is None:
      continue  # the loader checks each array as it places it
    try:
      part.param_shardings(param_shapes(cfg))
      for length, what in ((t, "self-attention cache"), (exp.max_input_len, "cross K/V")):
        part.spec(partitioning.CACHE_AXES, (b, length, cfg.num_heads, cfg.head_dim),
                  f"{role} {what}")
    except partitioning.PartitioningError as e:
      raise ValueError(f"Experiment.mesh_shape={tuple(exp.mesh_shape)} cannot shard the "
                       f"{role} ({path}): {e}") from None


def _corpus(exp: Experiment, vocab) -> list[list[int]]:
  exs = data.load_examples(_resolve(exp.ngram_corpus), split=exp.ngram_corpus_split,
                           max_examples=exp.ngram_corpus_max_examples,
                           data_dir=exp.tfds_data_dir)
  seqs = [vocab.encode(e.reference) + [vocab.eos_id] for e in exs if e.reference]
  if not seqs:
    raise ValueError(f"Experiment.ngram_corpus={exp.ngram_corpus!r} has no references")
  return seqs


def load_data(exp: Experiment) -> Data:
  """The vocabulary and the tokenized examples (warm-up first); no model is read."""
  vocab = data.get_vocabulary(_resolve(exp.vocab_path), extra_ids=exp.vocab_extra_ids)
  need = exp.num_warmup + exp.num_examples
  examples = data.load_examples(_resolve(exp.source), split=exp.split, max_examples=need,
                                data_dir=exp.tfds_data_dir)
  if not examples:
    raise ValueError(f"Experiment.source={exp.source!r} has no examples")
  if len(examples) <= exp.num_warmup:
    raise ValueError(f"Experiment.source={exp.source!r} has {len(examples)} examples, not "
                     f"more than num_warmup={exp.num_warmup}")
  prefix = exp.prefix if exp.prefix is not None else data.PREFIXES.get(exp.task, "")
  for e in examples:
    if not e.input or not e.input.strip():
      raise ValueError(f"Experiment.source={exp.source!r}: example id={e.id!r} has an "
                       "empty input")
  try:
    inputs, truncated = data.encode_batch(vocab, [e.input for e in examples], exp.max_input_len,
                                          prefix=prefix, on_too_long=exp.on_too_long,
                                          ids=[e.id for e in examples])
  except ValueError as e:
    raise ValueError(f"Experiment.source={exp.source!r}: {e} (Experiment.max_input_len="
                     f"{exp.max_input_len}, on_too_long={exp.on_too_long!r})") from None
  return Data(vocab, examples, inputs, set(truncated))


def held_out_inputs(exp: Experiment, source: str, num_examples: int) -> np.ndarray:
  """The first ``num_examples`` inputs of another source (e.g. a validation
  split to tune γ on), tokenized exactly like the experiment's own."""
  return load_data(dataclasses.replace(exp, source=source, split="validation", num_warmup=0,
                                       num_examples=num_examples)).inputs


def load_models(exp: Experiment, d: Data) -> Setup:
  """Target, draft (built by name) and a one-time check of the draft's interface."""
  target_part, draft_part = partitioners(exp)
  target, target_params = _load_model(exp.target_checkpoint, exp.target_format,
                                      exp.target_preset, exp, target_part)
  if d.vocab.vocab_size > target.config.vocab_size:
    raise ValueError(f"vocabulary {exp.vocab_path} has {d.vocab.vocab_size} ids but the target "
                     f"model's vocab_size is {target.config.vocab_size}")
  return Setup(exp, d.vocab, d.examples, d.inputs, target, target_params,
               load_draft(exp, d, target, draft_part, target_params), d.truncated,
               target_part)


def load_draft(exp: Experiment, d: Data, target: T5Model,
               draft_part: Optional[partitioning.Partitioner] = None,
               target_params: Any = None) -> Any:
  """The draft ``exp`` names, built for ``target`` (on ``draft_part``, the
  draft's partitioner from ``partitioners``) and its interface checked once;
  also used alone to compare several drafts beside one loaded target. A draft
  checkpoint with an encoder bridge (``specdec_jax.bridge``) needs
  ``target_params``."""
  # Every builder is offered the same keywords and receives those it names, so
  # a newly registered approximation model is selectable with no change here.
  build_kw: dict[str, Any] = dict(vocab_size=target.config.vocab_size, vocab=d.vocab,
                                  max_ngram=exp.prompt_lookup_max_ngram)
  if draft_part is not None:
    build_kw["partitioner"] = draft_part
  if exp.draft_checkpoint:
    dmodel, dparams = _load_model(exp.draft_checkpoint, exp.draft_format, exp.draft_preset,
                                  exp, draft_part)
    data.check_vocab_compatible(target.config.vocab_size, dmodel.config.vocab_size,
                                target_eos_id=target.config.eos_id,
                                draft_eos_id=dmodel.config.eos_id,
                                target_pad_id=target.config.pad_id,
                                draft_pad_id=dmodel.config.pad_id)
    build_kw.update(model=dmodel, params=dparams, bridge=None)
    kernel = _load_bridge(exp.draft_checkpoint)
    if kernel is not None:
      if target_params is None:
        raise ValueError(f"{exp.draft_checkpoint} has an encoder bridge "
                         f"({bridge_lib.FILENAME}), which needs the target's params")
      bridge_lib.check(kernel, target, dmodel, exp.draft_checkpoint)
      if not drafts.takes(exp.draft_name, "bridge"):
        raise ValueError(f"{exp.draft_checkpoint} has an encoder bridge, but approximation "
                         f"model {exp.draft_name!r} takes no 'bridge' argument")
      build_kw.update(bridge=jnp.asarray(kernel), target_model=target,
                      target_params=target_params)
    features = _load_bridge(exp.draft_checkpoint, feature_lib)
    if features is not None:
      feature_lib.check(features, target, dmodel, exp.draft_checkpoint)
      if not drafts.takes(exp.draft_name, "feature"):
        raise ValueError(f"{exp.draft_checkpoint} has a feature bridge "
                         f"({feature_lib.FILENAME}), but approximation model "
                         f"{exp.draft_name!r} takes no 'feature' argument")
      build_kw["feature"] = jax.tree.map(jnp.asarray, features)
    if exp.draft_shortlist:
      ids = shortlist_lib.load(_resolve(exp.draft_shortlist), target.config.vocab_size)
      build_kw["shortlist"] = shortlist_lib.Shortlist.for_draft(
          dmodel, dparams, ids, with_inputs=exp.draft_shortlist_inputs)
  if exp.ngram_corpus:
    build_kw["corpus"] = _corpus(exp, d.vocab)
  draft = drafts.build(exp.draft_name, **build_kw)
  # Built-in drafts are tested elsewhere: trace them (free) but skip the run.
  drafts.check_interface(exp.draft_name, draft, jnp.asarray(d.inputs[:1].repeat(
      exp.batch_size, 0)), target.config.vocab_size, exp.gamma_bound,
      exp.max_decode_len + exp.gamma_bound + 1, exp.sampling(),
      concrete=exp.draft_name not in drafts.BUILTIN, target_width=target.config.d_model)
  return draft


def _load_bridge(path: str, lib: Any = bridge_lib) -> Any:
  """A draft checkpoint's encoder bridge kernel, or with ``lib`` =
  ``feature_bridge`` its feature bridge (local directories only; None if it
  has none)."""
  if "://" in path:
    return None
  local = _resolve(path)
  if not os.path.isdir(local):
    return None
  return lib.load(local)


_MULTIHOST_STARTED = False


def start_multihost(exp: Experiment) -> None:
  """``jax.distributed.initialize`` once per process, before JAX touches a device."""
  global _MULTIHOST_STARTED
  if exp.multihost and not _MULTIHOST_STARTED:
    try:
      partitioning.initialize_multihost(exp.coordinator_address, exp.num_processes,
                                        exp.process_id)
    except partitioning.PartitioningError as e:
      raise ValueError(f"Experiment.multihost: {e}") from None
    _MULTIHOST_STARTED = True


def check_before_loading(exp: Experiment, alpha_only: bool = False) -> None:
  """Every check that needs no data or weights: settings, multi-host start,
  mesh against devices and model dimensions, memory per device."""
  exp.validate()
  if alpha_only and exp.gamma == "auto":
    raise ValueError("Experiment.gamma='auto' chooses γ from timed speculative pieces; "
                     "--alpha_only measures α only and uses no γ: bind a number (or drop "
                     "--alpha_only)")
  start_multihost(exp)
  try:
    target_part, draft_part = partitioners(exp)
  except partitioning.PartitioningError as e:
    raise ValueError(f"Experiment.mesh_shape: {e}") from None
  check_partitioning(exp, target_part, draft_part)
  check_memory(exp, alpha_only)


def prepare(exp: Experiment, alpha_only: bool = False) -> Setup:
  """Loads and checks everything; raises a clear error before any decoding."""
  check_before_loading(exp, alpha_only)
  return load_models(exp, load_data(exp))


# ---------------------------------------------------------------- workdir


def _record_mode(record: dict) -> str:
  """A line's mode; lines written before modes were recorded are told by their keys."""
  return record.get("mode") or ("speculative" if "accepted" in record else "alpha_only")


def _comparable(config_str: str) -> list[str]:
  """Config lines that must match on --resume (num_examples may be raised)."""
  return [l for l in config_str.splitlines()
          if l.strip() and not re.match(r"\s*Experiment\.num_examples\s*=", l)]


class Workdir:
  """examples.jsonl (append-only), summary.json (atomic rewrite), config.gin.

  The constructor only checks (and reads finished lines); the directory and
  config.gin are written with the first result, so a run that fails earlier
  leaves nothing behind.
  """

  def __init__(self, path: str, config_str: str, resume: bool, mode: str = "speculative",
               num_indices: Optional[int] = None):
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    self.path = Path(path)
    self.examples_path = self.path / "examples.jsonl"
    self.config_path = self.path / "config.gin"
    self.summary_path = self.path / "summary.json"
    self.mode, self.resume, self.config_str = mode, resume, config_str
    self.records, self._good_end = self._read_records()
    self._opened = False
    # Multi-host: every process runs the same sharded loops, process 0 writes.
    self.writer = jax.process_index() == 0
    if not self.records:
      return  # a workdir without results (or a stale config.gin) is simply reused
    if not resume:
      raise FileExistsError(f"{self.examples_path} already has results; pass --resume to "
                            "continue that run or choose another --workdir (nothing was "
                            "changed)")
    old_mode = _record_mode(self.records[0])
    if old_mode != mode:
      flag = lambda m: "with --alpha_only" if m == "alpha_only" else "without --alpha_only"
      raise ValueError(f"{self.path} holds a {old_mode} run ({len(self.records)} examples, "
                       f"written {flag(old_mode)}); this run is {mode} ({flag(mode)}). "
                       "Use another --workdir (nothing was changed)")
    if self.config_path.exists():
      old, new = _comparable(self.config_path.read_text()), _comparable(config_str)
      if old != new:
        diff = ([f"- {l}" for l in old if l not in new] + [f"+ {l}" for l in new if l not in old])
        raise ValueError(f"--resume: the gin config differs from {self.config_path} (only "
                         "Experiment.num_examples may change); resume with the same "
                         f"--config/--gin_bindings (nothing was changed). Differences: "
                         f"{'; '.join(diff[:6]) or 'order of lines'}")
    if num_indices is not None:
      beyond = sorted(r["index"] for r in self.records if r["index"] >= num_indices)
      if beyond:
        raise ValueError(f"--resume: {self.examples_path} already has example indices up to "
                         f"{beyond[-1]}, beyond num_warmup + num_examples = {num_indices}; "
                         "Experiment.num_examples can only be raised on resume (nothing was "
                         "changed)")

  def _read_records(self) -> tuple[list[dict], int]:
    """Complete lines, and the byte offset where they end (a torn last line follows)."""
    if not self.examples_path.exists():
      return [], 0
    raw = self.examples_path.read_bytes()
    end = raw.rfind(b"\n") + 1
    records = []
    for line_no, line in enumerate(raw[:end].split(b"\n")[:-1], start=1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line.decode("utf-8"))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{self.examples_path}:{line_no}: corrupt line ({e}); only a torn "
                         "last line is repaired automatically; remove or fix that line "
                         "(nothing was changed)") from None
      if not isinstance(rec, dict) or not isinstance(rec.get("index"), int):
        raise ValueError(f"{self.examples_path}:{line_no}: not a result record (no integer "
                         "'index'); nothing was changed")
      records.append(rec)
    return records, end

  def _open(self) -> None:
    """Before the first write: the directory, the torn-line repair, config.gin."""
    self.path.mkdir(parents=True, exist_ok=True)
    if self.examples_path.exists() and self.examples_path.stat().st_size > self._good_end:
      logging.warning("Dropping a partial last line of %s (%d bytes)", self.examples_path,
                      self.examples_path.stat().st_size - self._good_end)
      with open(self.examples_path, "r+b") as f:
        f.truncate(self._good_end)
    if not self.config_path.exists() or self.config_path.read_text() != self.config_str:
      _atomic_write(self.config_path, self.config_str)
    self._opened = True

  def append(self, record: dict) -> None:
    if not self.writer:
      self.records.append(record)
      return
    if not self._opened:
      self._open()
    with open(self.examples_path, "a") as f:
      f.write(json.dumps(record) + "\n")
      f.flush()
      os.fsync(f.fileno())
    self.records.append(record)

  def write_summary(self, summary: dict) -> None:
    if not self.writer:
      return
    if not self._opened:
      self._open()
    _atomic_write(self.summary_path, json.dumps(summary, indent=2) + "\n")


def _atomic_write(path: Path, text: str) -> None:
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


# ---------------------------------------------------------------- measuring


def _batches(n: int, start: int, batch: int):
  for i in range(start, n, batch):
    yield list(range(i, min(i + batch, n)))


def _pad_batch(inputs: np.ndarray, idx: list[int], batch: int,
               buckets: tuple = ()) -> jnp.ndarray:
  rows = idx + [idx[-1]] * (batch - len(idx))  # repeat the last row; ignored
  return jnp.asarray(data.fit_to_bucket(inputs[rows], buckets))




def _text(vocab, tokens: np.ndarray) -> str:
  return vocab.decode([int(t) for t in tokens])


COST_KEYS = ("c", "v", "target_step_ms", "verify_ms", "draft_token_ms", "interplay")


def summarize(exp: Experiment, records: list[dict]) -> dict:
  """Aggregates examples.jsonl lines into summary.json.

  Each line carries the cost measurement of its process (c, v, step times), so
  a resumed run's summary uses the median over all lines: every number here
  can be recomputed from examples.jsonl alone.
  """
  tot = lambda k: float(sum(r[k] for r in records))
  # (Lines written before 'interplay' was measured count as 1: no interplay.)
  costs = {k: float(np.median([r.get(k, 1.0 if k == "interplay" else None) for r in records]))
           if records else float("nan") for k in COST_KEYS}
  evaluated = tot("accepted") + tot("rejected")
  alpha = tot("accepted") / evaluated if evaluated else float("nan")
  alpha_min_pq = tot("min_pq_sum") / evaluated if evaluated else float("nan")
  target_label, draft_label = exp.labels
  if exp.gamma == "auto" and records:  # the γ the run chose (recorded on every line)
    exp = dataclasses.replace(exp, gamma=records[0]["gamma"])
  base_s = tot("baseline_s")
  spec_s = tot("speculative_s")
  summary = {
      "mode": "speculative", "task": exp.task, "target": target_label, "draft": draft_label,
      "temperature": exp.temperature, "topk": exp.topk, "topp": exp.topp,
      "gamma": exp.gamma, "lenience": exp.lenience, "batch_size": exp.batch_size,
      "mesh_shape": list(exp.mesh_shape) if exp.mesh_shape else None,
      "param_dtype": exp.param_dtype, "dtype": exp.dtype,
      "draft_shortlist": exp.draft_shortlist or None,
      "alpha": alpha, "alpha_min_pq": alpha_min_pq,
      "tokens_per_target_call": tot("tokens") / max(tot("target_calls"), 1),
      "c": costs["c"], "v": costs["v"],
      "target_step_ms": costs["target_step_ms"], "verify_ms": costs["verify_ms"],
      "draft_token_ms": costs["draft_token_ms"], "interplay": costs["interplay"],
      "baseline_ms_per_token": 1e3 * base_s / max(tot("baseline_tokens"), 1),
      "speculative_ms_per_token": 1e3 * spec_s / max(tot("tokens"), 1),
      "baseline_s": base_s, "speculative_s": spec_s,
      "speedup": base_s / spec_s if spec_s else float("nan"),
      "num_examples": len(records),
      "mismatches_vs_baseline": (int(sum(not r["matches_baseline"] for r in records))
                                 if exp.temperature == 0 else None),
  }
  if records and "gamma_auto" in records[0]:
    summary["gamma_auto"] = records[0]["gamma_auto"]
  if exp.adaptive is not None:
    hist = np.sum([r["gamma_hist"] for r in records], 0) if records else np.zeros(1)
    summary["adaptive"] = exp.adaptive
    summary["adaptive_threshold"] = (exp.adaptive_threshold if exp.adaptive in CONFIDENCE_RULES
                                     else None)
    summary["adaptive_skip_below"] = exp.adaptive_skip_below
    summary["adaptive_confidence"] = exp.adaptive_confidence
    summary["gamma_hist"] = hist.tolist()       # rounds that proposed j tokens, at j
    summary["mean_gamma"] = float(np.dot(np.arange(len(hist)), hist) / max(hist.sum(), 1))
    summary["gamma_label"] = (f"≤{exp.gamma} {exp.adaptive}"
                              + (f" {exp.adaptive_threshold:g}"
                                 if exp.adaptive in CONFIDENCE_RULES else "")
                              + (f" skip {exp.adaptive_skip_below:g}"
                                 if exp.adaptive_skip_below is not None else "")
                              + (" drawn" if exp.adaptive_confidence == "drawn" else ""))
  # Theorem 3.8 is for a fixed γ: an adaptive run has no such prediction.
  ok = records and not math.isnan(alpha) and exp.adaptive is None
  summary["expected_speedup"] = (float(theory.walltime_improvement(min(alpha, 1.0), exp.gamma,
                                                                   costs["c"]))
                                 if ok else None)
  summary["expected_speedup_v"] = (float(theory.walltime_improvement(
      min(alpha, 1.0), exp.gamma, costs["c"], costs["v"])) if ok else None)
  # The same with the round's two models timed as they alternate in a round
  # (``timing.Costs.interplay``): what is left between this and SPEED is the
  # engine's own per-round work and the finite length of the outputs.
  f = costs["interplay"]
  summary["expected_speedup_in_context"] = (float(theory.walltime_improvement(
      min(alpha, 1.0), exp.gamma, costs["c"] * f, costs["v"] * f)) if ok else None)
  # Eq. (1)'s tokens per target call at the run's α: the measured count falls
  # short where acceptances are not independent or rounds stop at EOS
  # (``specdec_jax.accounting`` has the whole account).
  summary["tokens_per_target_call_eq1"] = (float(theory.expected_tokens(min(alpha, 1.0),
                                                                        exp.gamma))
                                           if ok else None)
  # ... and with each example's prefill: the whole-run prediction
  # (``specdec_jax.accounting``; batch 1, fixed γ, lines that carry prefill times).
  whole = None
  if ok and exp.batch_size == 1 and all("prefill_speculative_ms" in r for r in records):
    a = accounting.attribute(records, accounting.prefill_of(records),
                             [r["input_width"] for r in records])
    whole = a.expected_whole_run
    summary["prefill_baseline_ms"] = a.prefill_baseline_ms
    summary["prefill_speculative_ms"] = a.prefill_speculative_ms
  summary["expected_speedup_whole_run"] = whole
  return summary


def table2_row(s: dict) -> str:
  """The paper's Table 2 layout (TASK, M_q, TEMP, γ, α, SPEED), plus EXP."""
  head = "| TASK | M_q | TEMP | γ | α | SPEED | EXP (Thm 3.8) | EXP (with v) | mismatches |"
  sep = "|---|---|---|---|---|---|---|---|---|"
  fmt = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"
  row = (f"| {s['task']} | {s['draft']} | {s['temperature']:g} | {s['gamma']} | "
         f"{fmt(s['alpha'])} | {fmt(s['speedup'])}X | {fmt(s['expected_speedup'])}X | "
         f"{fmt(s['expected_speedup_v'])}X | "
         f"{'-' if s['mismatches_vs_baseline'] is None else s['mismatches_vs_baseline']} |")
  lines = [head, sep, row]
  if s.get("expected_speedup_in_context") is not None:
    lines.append(f"EXP in context: {fmt(s['expected_speedup_in_context'])}X (draft and target "
                 f"timed alternating as in a round: {fmt(s['interplay'])}x their cost timed "
                 f"apart); SPEED / EXP in context "
                 f"{fmt(s['speedup'] / s['expected_speedup_in_context'])}")
  if s.get("expected_speedup_whole_run") is not None:
    tokens = s["tokens_per_target_call"] / s["tokens_per_target_call_eq1"]
    measured_tau = s["expected_speedup_in_context"] * tokens
    lines.append(
        f"Whole run: EXP (with v) {fmt(s['expected_speedup_v'])}X × interplay "
        f"{fmt(1 / s['interplay'])} × tokens per target call {fmt(tokens)} "
        f"({fmt(s['tokens_per_target_call'])} against Eq. (1)'s "
        f"{fmt(s['tokens_per_target_call_eq1'])}) × prefill "
        f"{fmt(s['expected_speedup_whole_run'] / measured_tau)} "
        f"({fmt(s['prefill_baseline_ms'])} / {fmt(s['prefill_speculative_ms'])} ms per example) "
        f"= {fmt(s['expected_speedup_whole_run'])}X; SPEED / whole run "
        f"{fmt(s['speedup'] / s['expected_speedup_whole_run'])}")
  return "\n".join(lines)


def _auto_gamma(setup: Setup, workdir: Workdir, root) -> tuple[int, Optional[dict]]:
  """γ for this run: the fixed one, the one an earlier part of this run chose
  (resume), or ``autogamma.choose_gamma`` on the warm-up examples."""
  exp = setup.exp
  if exp.gamma != "auto":
    return exp.gamma, None
  if workdir.records:
    choice = workdir.records[0]["gamma_auto"]
    logging.info("gamma='auto': resuming with the gamma chosen before, %d", choice["gamma"])
    return choice["gamma"], choice
  place = setup.partitioner.shard_batch if setup.partitioner else (lambda x: x)
  inputs, n = setup.inputs, exp.num_warmup
  if exp.auto_alpha_source:
    inputs = held_out_inputs(exp, exp.auto_alpha_source, exp.auto_alpha_examples)
    n = len(inputs)
  batches = [(place(x), rows) for x, rows in autogamma.alpha_batches(inputs, n, exp.batch_size)]
  choice = autogamma.choose_gamma(setup.target, setup.target_params, setup.draft, batches, root,
                                  exp.sampling(), exp.max_decode_len, exp.gamma_max,
                                  setup.partitioner)
  return choice.gamma, choice.as_record()


def run_speculative(setup: Setup, workdir: Workdir) -> dict:
  exp = setup.exp
  sampling = exp.sampling()
  target, tparams, draft = setup.target, setup.target_params, setup.draft
  kw = dict(max_decode_len=exp.max_decode_len, sampling=sampling, eos_id=target.config.eos_id,
            partitioner=setup.partitioner)
  place = setup.partitioner.shard_batch if setup.partitioner else (lambda x: x)
  base_fn = lambda x, k: temperature_sample(target, tparams, place(x), k, **kw)
  root = jax.random.PRNGKey(exp.seed)
  gamma, gamma_auto = _auto_gamma(setup, workdir, root)
  spec_fn = lambda x, k: speculative_decode(target, tparams, draft, place(x), k,
                                            gamma=gamma, lenience=exp.lenience,
                                            adaptive=exp.adaptive_config(), **kw)
  n_total = len(setup.examples)
  # Warm-up: compile both loops on the warm-up examples (or the first batch).
  t0 = time.perf_counter()
  for idx in (list(_batches(exp.num_warmup, 0, exp.batch_size)) or [[0]]):
    x = _pad_batch(setup.inputs, idx, exp.batch_size, exp.input_buckets)
    block(base_fn(x, root))
    block(spec_fn(x, root))
  adaptive = exp.adaptive_config()
  if exp.input_buckets or adaptive is not None:
    batches = [_pad_batch(setup.inputs, idx, exp.batch_size, exp.input_buckets)
               for idx in _batches(n_total, 0, exp.batch_size)]
    groups = data.by_width(batches)  # one program per input bucket
  if exp.input_buckets:
    # Every bucket the examples use compiled and run once here, untimed.
    for group in groups.values():
      block(base_fn(batches[group[0]], root))
      block(spec_fn(batches[group[0]], root))
    logging.info("Input buckets used: %s", sorted(groups))
  if adaptive is not None:
    # Every verification branch run once, untimed (its code is generated on
    # its first run, per program: timing.warm_up_widths); over the examples of
    # each input bucket, as far as needed.
    for length, group in sorted(groups.items()):
      seen = warm_up_widths(lambda x: spec_fn(x, root), (batches[i] for i in group),
                            adaptive.verify_widths(gamma))
      logging.info("Adaptive warm-up ran verification widths %s (inputs of length %d)",
                   sorted(seen), length)
  logging.info("Warm-up (compilation included) took %.1f s", time.perf_counter() - t0)
  c = measure_costs(target, tparams, draft,
                    _pad_batch(setup.inputs, [0], exp.batch_size, exp.input_buckets),
                    gamma, sampling, cache_len=exp.max_decode_len + gamma + 1)
  costs = {"c": c.c, "v": c.v, "target_step_ms": 1e3 * c.target_step_s,
           "verify_ms": 1e3 * c.verify_s, "draft_token_ms": 1e3 * c.draft_token_s,
           "interplay": c.interplay}
  logging.info("Costs: %s", costs)
  # Each example's fixed cost before its first step or round (the encoders and
  # caches), timed per input width: the whole-run account (``accounting``).
  done_ids = {r["index"] for r in workdir.records}
  todo = [i for i in range(exp.num_warmup, n_total) if i not in done_ids]
  first = {}
  for idx in _batches(len(todo), 0, exp.batch_size):
    x = _pad_batch(setup.inputs, [todo[i] for i in idx], exp.batch_size, exp.input_buckets)
    first.setdefault(int(x.shape[1]), place(x))
  prefill = accounting.prefill_ms(target, tparams, draft, first, exp.max_decode_len, gamma,
                                  repeats=5)
  logging.info("Prefill ms (baseline, speculative) by input width: %s", prefill)
  extra = {"gamma": gamma} if gamma_auto is None else {"gamma": gamma, "gamma_auto": gamma_auto}

  t_start = time.perf_counter()
  processed = 0
  for idx in _batches(len(todo), 0, exp.batch_size):
    rows = [todo[i] for i in idx]
    x = _pad_batch(setup.inputs, rows, exp.batch_size, exp.input_buckets)
    key = jax.random.fold_in(root, rows[0])
    base, base_s = timed(lambda: base_fn(x, key))
    spec, spec_s = timed(lambda: spec_fn(x, key))
    alphas = alpha_estimates(spec.stats)
    st = jax.tree_util.tree_map(np.asarray, spec.stats)
    base_tok, spec_tok = np.asarray(base.tokens), np.asarray(spec.tokens)
    for j, i in enumerate(rows):
      ex = setup.examples[i]
      workdir.append({
          "index": i, "id": ex.id,
          "baseline_s": base_s / len(rows), "speculative_s": spec_s / len(rows),
          "batch_baseline_s": base_s, "batch_speculative_s": spec_s, "batch_size": len(rows),
          "baseline_tokens": int(base.length[j]), "tokens": int(spec.length[j]),
          "target_calls": int(st.target_calls[j]), "draft_calls": int(st.draft_calls[j]),
          "accepted": int(st.accepted[j]), "rejected": int(st.rejected[j]),
          "min_pq_sum": float(st.min_pq_sum[j]),
          "accepted_at": st.accepted_at[j].tolist(), "evaluated_at": st.evaluated_at[j].tolist(),
          "gamma_hist": st.gamma_hist[j].tolist(),
          "target_positions": int(st.target_positions[j]),
          "alpha": float(alphas["alpha"][j]), "alpha_min_pq": float(alphas["alpha_min_pq"][j]),
          "tokens_per_target_call": int(spec.length[j]) / max(int(st.target_calls[j]), 1),
          "matches_baseline": bool(np.array_equal(base_tok[j], spec_tok[j])),
          "output": _text(setup.vocab, spec_tok[j]),
          "baseline_output": _text(setup.vocab, base_tok[j]),
          "reference": ex.reference, "input_truncated": i in setup.truncated,
          "mode": "speculative",
          "input_width": int(x.shape[1]), "prefill_baseline_ms": prefill[int(x.shape[1])][0],
          "prefill_speculative_ms": prefill[int(x.shape[1])][1],
          **costs, **extra,
      })
    processed += len(rows)
    s = summarize(exp, workdir.records)
    eta = (time.perf_counter() - t_start) / processed * (len(todo) - processed)
    logging.info("[%d/%d] alpha %.3f  speedup %.2fx  ETA %.0f s", len(workdir.records),
                 n_total - exp.num_warmup, s["alpha"], s["speedup"], eta)
    workdir.write_summary(s)
  summary = summarize(exp, workdir.records)
  workdir.write_summary(summary)
  return summary


# ---------------------------------------------------------------- alpha only


def summarize_alpha(exp: Experiment, records: list[dict], available: int) -> dict:
  """summary.json of an --alpha_only run (recomputable from examples.jsonl)."""
  tokens = sum(r["tokens"] for r in records)
  target_label, draft_label = exp.labels
  return {"mode": "alpha_only", "task": exp.task, "target": target_label,
          "draft": draft_label, "temperature": exp.temperature, "topk": exp.topk,
          "topp": exp.topp, "num_tokens": tokens, "num_examples": len(records),
          "alpha_only_tokens": exp.alpha_only_tokens,
          "budget_reached": tokens >= exp.alpha_only_tokens,
          "examples_available": available,
          "alpha_min_pq": sum(r["min_pq_sum"] for r in records) / max(
              sum(r.get("evaluated", r["tokens"]) for r in records), 1)}


def pending(exp: Experiment, n_examples: int, workdir: Workdir, alpha_only: bool) -> list[int]:
  """Indices still to decode (warm-up examples are never measured)."""
  if alpha_only and sum(r["tokens"] for r in workdir.records) >= exp.alpha_only_tokens:
    return []
  done = {r["index"] for r in workdir.records}
  return [i for i in range(exp.num_warmup, n_examples) if i not in done]


def run_alpha_only(setup: Setup, workdir: Workdir) -> dict:
  """Paper §4.2: E[sum_x min(p, q)] along tokens generated by the target.

  Uses the same examples as a speculative run (the warm-up ones are skipped:
  nothing here is timed) until ``alpha_only_tokens`` tokens are generated.
  """
  exp = setup.exp
  sampling = exp.sampling()
  target, tparams = setup.target, setup.target_params
  root = jax.random.PRNGKey(exp.seed)
  todo = pending(exp, len(setup.examples), workdir, alpha_only=True)
  for idx in _batches(len(todo), 0, exp.batch_size):
    if sum(r["tokens"] for r in workdir.records) >= exp.alpha_only_tokens:
      break
    rows = [todo[k] for k in idx]
    x = _pad_batch(setup.inputs, rows, exp.batch_size, exp.input_buckets)
    if setup.partitioner is not None:
      x = setup.partitioner.shard_batch(x)
    key = jax.random.fold_in(root, rows[0])
    if getattr(setup.draft, "wants_target_states", False):
      # Its q depends on where rounds start (the staleness of the target state
      # it reads), so α is measured in the engine's own rounds at γ.
      out, sums, evaluated = autogamma.min_pq_in_rounds(
          target, tparams, setup.draft, x, key, exp.gamma_bound, exp.max_decode_len, sampling,
          setup.partitioner)
    else:
      out = temperature_sample(target, tparams, x, key, max_decode_len=exp.max_decode_len,
                               sampling=sampling, eos_id=target.config.eos_id,
                               partitioner=setup.partitioner)
      sums = np.asarray(autogamma.min_pq_along(target, tparams, setup.draft, x, out.tokens,
                                                out.length, sampling))
      evaluated = np.asarray(out.length)
    for j, i in enumerate(rows):
      n, m = int(out.length[j]), int(evaluated[j])
      workdir.append({"index": i, "id": setup.examples[i].id, "mode": "alpha_only",
                      "tokens": n, "evaluated": m, "min_pq_sum": float(sums[j]),
                      "alpha_min_pq": float(sums[j]) / max(m, 1),
                      "input_truncated": i in setup.truncated})
    tokens = sum(r["tokens"] for r in workdir.records)
    logging.info("[alpha-only] %d / %d tokens, alpha %.3f", tokens, exp.alpha_only_tokens,
                 sum(r["min_pq_sum"] for r in workdir.records) / max(tokens, 1))
  summary = summarize_alpha(exp, workdir.records, len(setup.examples) - exp.num_warmup)
  workdir.write_summary(summary)
  return summary


def alpha_row(s: dict) -> str:
  """One Table-3-style line; says so when the examples ran out before the budget."""
  row = (f"| {s['task']} | {s['target']} | {s['draft']} | T={s['temperature']:g} | "
         f"alpha {s['alpha_min_pq']:.3f} | {s['num_tokens']} tokens |")
  if not s.get("budget_reached", True):
    row += (f"\nnote: the examples ran out after {s['num_examples']} examples and "
            f"{s['num_tokens']} tokens, before Experiment.alpha_only_tokens="
            f"{s['alpha_only_tokens']}; raise Experiment.num_examples or use a larger source")
  return row


# ---------------------------------------------------------------- main


FLAGS = flags.FLAGS
flags.DEFINE_multi_string("config", [], "Gin config file(s); later files override earlier.")
flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings, e.g. 'Experiment.gamma = 5'.")
flags.DEFINE_string("workdir", None, "Output directory (default runs/<config file stem>).")
flags.DEFINE_bool("resume", False, "Continue after the last complete line of examples.jsonl "
                  "(Experiment.num_examples may be raised; a finished run just prints).")
flags.DEFINE_bool("alpha_only", False, "Only measure alpha along target generations (§4.2).")
flags.DEFINE_multi_string("import", [], "A Python module to import before the config is "
                          "parsed, by name (found in the working directory or sys.path) or "
                          "as path/to/file.py, e.g. one that registers an approximation "
                          "model; may repeat.")
flags.DEFINE_bool("verbose", False, "Show library INFO logs (Orbax, JAX) and the traceback "
                  "of user errors.")

# Bad settings, missing or malformed files: one line on stderr, no traceback.
USER_ERRORS = (ValueError, OSError, LookupError, ImportError, checkpoints.CheckpointError)


def import_modules(names: Sequence[str]) -> None:
  """Imports each module (a name, or a path to a .py file) for its registrations."""
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())  # as `python -m` does; in-process callers need it too
  for name in names:
    if name.endswith(".py") or os.sep in name:
      path = Path(name).resolve()
      if not path.is_file():
        raise FileNotFoundError(f"--import={name}: no such file ({path})")
      spec = importlib.util.spec_from_file_location(path.stem, path)
      module = importlib.util.module_from_spec(spec)
      sys.modules[path.stem] = module
      try:
        spec.loader.exec_module(module)
      except BaseException:
        del sys.modules[path.stem]
        raise
    else:
      try:
        importlib.import_module(name)
      except ModuleNotFoundError as e:
        if e.name != name.split(".")[0] and e.name != name:
          raise  # the module exists but one of its own imports is missing
        raise ValueError(f"--import={name}: no module named {name!r} in the working "
                         f"directory ({os.getcwd()}) or on sys.path") from None


def parse_config(configs: Sequence[str], bindings: Sequence[str]) -> Experiment:
  """Parses gin files and bindings into an Experiment (unknown bindings fail here)."""
  gin.clear_config()
  gin.add_config_file_search_path(str(REPO_ROOT))  # so `include 'configs/...'` works anywhere
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())  # so a config's `import my_module` line finds it
  _CONFIG_DIRS.clear()
  files = [_resolve(c) for c in configs]
  _CONFIG_DIRS[:] = [Path(f).resolve().parent for f in reversed(files)]
  for f in files:
    if not Path(f).is_file():
      raise FileNotFoundError(f"--config={f}: no such file")
  gin.parse_config_files_and_bindings(files, bindings)
  return Experiment()


def _print_result(s: dict) -> None:
  print(alpha_row(s) if s.get("mode") == "alpha_only" else table2_row(s))
  sys.stdout.flush()


def main(argv: Sequence[str]) -> None:
  """The runner; raises user errors (see ``cli`` for how they are reported)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import_modules(FLAGS["import"].value)
  exp = parse_config(FLAGS.config, FLAGS.gin_bindings)
  config_str = gin.config_str()
  alpha_only = FLAGS.alpha_only
  check_before_loading(exp, alpha_only)  # before any data or weights are read
  mode = "alpha_only" if alpha_only else "speculative"
  # Every config names the run: a hardware overlay (configs/tpu_v4_8.gin) must
  # not make two Table 2 rows share a workdir.
  stem = "+".join(Path(c).stem for c in FLAGS.config) if FLAGS.config else "default"
  workdir_path = FLAGS.workdir or str(Path("runs") / (stem + ("_alpha" if alpha_only else "")))
  workdir = Workdir(workdir_path, config_str, FLAGS.resume, mode,  # checks only, no writes
                    num_indices=exp.num_warmup + exp.num_examples)
  d = load_data(exp)
  if workdir.records and not pending(exp, len(d.examples), workdir, alpha_only):
    logging.info("%s: the run is finished (%d examples); nothing to do", workdir.path,
                 len(workdir.records))
    _print_result(summarize_alpha(exp, workdir.records, len(d.examples) - exp.num_warmup)
                  if alpha_only else summarize(exp, workdir.records))
    return
  setup = load_models(exp, d)  # all loading and checking before the workdir is touched
  for i in sorted(d.truncated):
    logging.warning("Example id=%r (index %d) was truncated to max_input_len=%d tokens",
                    d.examples[i].id, i, exp.max_input_len)
  logging.info("Workdir %s (%d examples already done)", workdir.path, len(workdir.records))
  s = run_alpha_only(setup, workdir) if alpha_only else run_speculative(setup, workdir)
  _print_result(s)


class _LibraryFilter:
  """Drops INFO records of other libraries (Orbax, JAX, ...) unless --verbose."""

  def filter(self, record) -> bool:
    return record.levelno >= 30 or f"{os.sep}specdec_jax{os.sep}" in record.pathname


def _quiet_libraries(quiet: bool) -> None:
  """Adds (or, for --verbose, removes) the filter on absl's handler and library loggers."""
  import logging as std_logging
  targets = [logging.get_absl_handler()] + [std_logging.getLogger(n)
                                            for n in ("orbax", "jax", "absl")]
  for t in targets:
    for f in [f for f in t.filters if isinstance(f, _LibraryFilter)]:
      t.removeFilter(f)
    if quiet:
      t.addFilter(_LibraryFilter())
  # Installed over (and later restored to) whatever hook the process had, so an
  # in-process caller (``run_args``: tests, notebooks) keeps its own.
  global _previous_unraisablehook
  if quiet and sys.unraisablehook is not _quiet_unraisable:
    _previous_unraisablehook, sys.unraisablehook = sys.unraisablehook, _quiet_unraisable
  elif not quiet and sys.unraisablehook is _quiet_unraisable:
    sys.unraisablehook = _previous_unraisablehook


_previous_unraisablehook = sys.__unraisablehook__


def _quiet_unraisable(u) -> None:
  """Drops TensorStore's 'Event loop is closed' reports, passes everything else on.

  When one read of a corrupt checkpoint fails, Orbax closes its asyncio loop while
  TensorStore's other reads are still in flight; each later completion reports the
  closed loop from a TensorStore thread, interleaving a traceback with the one-line
  error (and racing ``os._exit``, so it is cut mid-line).
  """
  if isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value):
    return
  _previous_unraisablehook(u)


def _message(e: BaseException) -> str:
  text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
  return f"{type(e).__name__}: {text}" if not isinstance(e, (ValueError, OSError)) else text


def cli(argv: Sequence[str]) -> int:
  """Runs ``main``; a user error ends in one line on stderr and exit status 2."""
  _quiet_libraries(not FLAGS.verbose)
  try:
    main(argv)
    return 0
  except KeyboardInterrupt:
    print("interrupted (the workdir holds only complete results)", file=sys.stderr)
    return 130
  except USER_ERRORS as e:
    if FLAGS.verbose:
      traceback.print_exc()
    else:
      print("(run with --verbose for the traceback)", file=sys.stderr)
    print(f"error: {_message(e)}", file=sys.stderr)
    return 2


def run_args(args: Sequence[str]) -> int:
  """In-process entry for tests and notebooks: parses ``args`` as flags, runs ``cli``."""
  FLAGS.unparse_flags()
  rest = FLAGS(["specdec_jax.run", *args])
  return cli(rest)


def _settings_help() -> str:
  hints = typing.get_type_hints(Experiment)
  lines = ["", "Experiment settings (--gin_bindings='Experiment.<name> = <value>'; defaults):"]
  for f in dataclasses.fields(Experiment):
    t = str(hints[f.name]).replace("typing.", "").replace("<class '", "").replace("'>", "")
    lines.append(f"  {f.name}: {t} = {f.default!r}")
  return "\n".join(lines) + "\n"


__doc__ += _settings_help()


def _app_main(argv: Sequence[str]) -> None:
  code = cli(argv)
  sys.stdout.flush()
  sys.stderr.flush()
  if code:
    os._exit(code)  # skip interpreter teardown, where Orbax's threads print noise


if __name__ == "__main__":
  app.run(_app_main)
