"""Everything a run needs before its first decoding step: the data, the
target and the draft (built by name), each checked before any weight is read
(settings, mesh, memory per device)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import checkpoints, data, drafts, memory, partitioning, storage  # noqa: F401
from specdec_jax.decoding import cache_length
from specdec_jax.drafts import bridge as bridge_lib
from specdec_jax.drafts import feature_bridge as feature_lib
from specdec_jax.drafts import t5_block
from specdec_jax.drafts import shortlist as shortlist_lib
from specdec_jax.models.t5 import T5Model
from specdec_jax.run.settings import Experiment


@dataclasses.dataclass
class Data:
  vocab: Any
  examples: list            # data.Example, warm-up first
  inputs: np.ndarray        # [N, max_input_len] int32
  truncated: set            # indices of examples whose input was truncated
  held_out: Optional[np.ndarray] = None   # [M, max_input_len]: auto_alpha_source's inputs


@dataclasses.dataclass(kw_only=True)
class Setup(Data):
  exp: Experiment
  target: T5Model
  target_params: Any
  draft: Any
  partitioner: Optional[partitioning.Partitioner] = None   # the target's (None: one device)


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
  """Bytes per device of the weights and decoding buffers from the configs
  (``memory.plan``; ``--alpha_only``: also p and q [B, T, V] float32); {}
  where the target's architecture is unknown."""
  pair = exp.pair
  cfgs = {role: pair.peek_config(role) for role in ("target", "draft")}
  if cfgs["target"] is None:
    return {}
  plan = memory.plan(cfgs["target"], cfgs["draft"], exp.mesh_shape, exp.param_dtype, exp.dtype,
                     exp.batch_size, exp.max_input_len, exp.max_decode_len, exp.gamma_max,
                     exp.logical_axis_rules, exp.draft_logical_axis_rules, exp.partition_fallback,
                     pair.quantization_of_draft() if cfgs["draft"] is not None else None)
  out = {"target weights": plan["target_params"], "target KV cache": plan["target_caches"]}
  if cfgs["draft"] is not None:
    out.update({"draft weights": plan["draft_params"], "draft KV cache": plan["draft_caches"]})
  if alpha_only:
    out["p and q along the outputs"] = (3 * exp.batch_size * exp.max_decode_len
                                        * cfgs["target"].vocab_size * 4)
  return out


def check_memory(exp: Experiment, alpha_only: bool = False) -> None:
  """Refuses a config whose weights and buffers cannot fit on a device."""
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


def _load_model(exp: Experiment, role: str, part: Optional[partitioning.Partitioner]
                ) -> tuple[T5Model, Any]:
  """The target or the draft read straight into its shards (tests patch this)."""
  return exp.pair.load(role, part)


def partitioners(exp: Experiment) -> tuple[Optional[partitioning.Partitioner],
                                          Optional[partitioning.Partitioner]]:
  """(target's, draft's) partitioners over one mesh; (None, None) without one."""
  return exp.pair.partitioners()


def decode_shape(exp: Experiment) -> tuple[int, int, int]:
  """(rows, input length, cache length) of a decoding batch."""
  return exp.batch_size, exp.max_input_len, cache_length(exp.max_decode_len, exp.gamma_max)


def check_partitioning(exp: Experiment, target_part, draft_part) -> None:
  """Every dimension the mesh must divide, checked from the configs alone."""
  exp.pair.check_shardings(target_part, draft_part, decode_shape(exp))


def _corpus(exp: Experiment, vocab) -> list[list[int]]:
  exs = data.load_examples(exp.resolve(exp.ngram_corpus), split=exp.ngram_corpus_split,
                           max_examples=exp.ngram_corpus_max_examples, data_dir=exp.tfds_data_dir)
  seqs = [vocab.encode(e.reference) + [vocab.eos_id] for e in exs if e.reference]
  if not seqs:
    raise ValueError(f"Experiment.ngram_corpus={exp.ngram_corpus!r} has no references")
  return seqs


def _tokenized(exp: Experiment, vocab: Any, setting: str, source: str, split: str,
               n: int, num_warmup: int) -> tuple[list, np.ndarray, list]:
  """(examples, inputs [n, max_input_len] int32, truncated indices) of
  ``source``'s first ``n`` examples (``setting``: the binding, for errors)."""
  examples = data.load_examples(exp.resolve(source), split=split, max_examples=n,
                                data_dir=exp.tfds_data_dir)
  if not examples:
    raise ValueError(f"Experiment.{setting}={source!r} has no examples")
  if len(examples) <= num_warmup:
    raise ValueError(f"Experiment.{setting}={source!r} has {len(examples)} examples, not "
                     f"more than num_warmup={num_warmup}")
  prefix = exp.prefix if exp.prefix is not None else data.PREFIXES.get(exp.task, "")
  for e in examples:
    if not e.input or not e.input.strip():
      raise ValueError(f"Experiment.{setting}={source!r}: example id={e.id!r} has an "
                       "empty input")
  try:
    inputs, truncated = data.encode_batch(vocab, [e.input for e in examples], exp.max_input_len,
                                          prefix=prefix, on_too_long=exp.on_too_long,
                                          ids=[e.id for e in examples])
  except ValueError as e:
    raise ValueError(f"Experiment.{setting}={source!r}: {e} (Experiment.max_input_len="
                     f"{exp.max_input_len}, on_too_long={exp.on_too_long!r})") from None
  return examples, inputs, truncated


def _vocabulary(exp: Experiment) -> Any:
  return data.get_vocabulary(exp.resolve(exp.vocab_path), extra_ids=exp.vocab_extra_ids)


def load_data(exp: Experiment) -> Data:
  """The vocabulary, the tokenized examples (warm-up first) and any held-out inputs."""
  vocab = _vocabulary(exp)
  examples, inputs, truncated = _tokenized(exp, vocab, "source", exp.source, exp.split,
                                           exp.num_warmup + exp.num_examples, exp.num_warmup)
  held_out = None
  if exp.gamma == "auto" and exp.auto_alpha_source:
    held_out = _tokenized(exp, vocab, "auto_alpha_source", exp.auto_alpha_source,
                          "validation", exp.auto_alpha_examples, 0)[1]
  return Data(vocab, examples, inputs, set(truncated), held_out)


def held_out_inputs(exp: Experiment, source: str, num_examples: int) -> np.ndarray:
  """Another source's first inputs [num_examples, max_input_len], tokenized
  like the experiment's own."""
  return _tokenized(exp, _vocabulary(exp), "source", source, "validation", num_examples, 0)[1]


def load_models(exp: Experiment, d: Data) -> Setup:
  """Target, draft (built by name) and a one-time check of the draft's interface."""
  target_part, draft_part = partitioners(exp)
  target, target_params = _load_model(exp, "target", target_part)
  exp.pair.check_vocab_size(d.vocab.vocab_size, target.config)
  return Setup(**vars(d), exp=exp, target=target, target_params=target_params,
               draft=load_draft(exp, d, target, draft_part, target_params), partitioner=target_part)


def load_draft(exp: Experiment, d: Data, target: T5Model,
               draft_part: Optional[partitioning.Partitioner] = None,
               target_params: Any = None) -> Any:
  """The draft ``exp`` names, built for ``target`` and its interface checked
  once; an encoder bridge needs ``target_params``. Every builder is offered
  the same keywords and receives those it names."""
  build_kw: dict[str, Any] = dict(vocab_size=target.config.vocab_size, vocab=d.vocab,
                                  max_ngram=exp.prompt_lookup_max_ngram)
  if draft_part is not None:
    build_kw["partitioner"] = draft_part
  if exp.draft_checkpoint:
    dmodel, dparams = _load_model(exp, "draft", draft_part)
    exp.pair.check_vocabularies(target.config, dmodel.config)
    build_kw.update(model=dmodel, params=dparams, bridge=None)
    kernel = _load_bridge(exp.resolve(exp.draft_checkpoint))
    if kernel is not None:
      if target_params is None:
        raise ValueError(f"{exp.draft_checkpoint} has an encoder bridge "
                         f"({bridge_lib.FILENAME}), which needs the target's params")
      bridge_lib.check(kernel, target, dmodel, exp.draft_checkpoint)
      if not drafts.takes(exp.draft_name, "bridge"):
        raise ValueError(f"{exp.draft_checkpoint} has an encoder bridge, but approximation "
                         f"model {exp.draft_name!r} takes no 'bridge' argument")
      build_kw.update(bridge=jnp.asarray(kernel), target_model=target, target_params=target_params)
    features = _load_bridge(exp.resolve(exp.draft_checkpoint), feature_lib)
    if features is not None:
      feature_lib.check(features, target, dmodel, exp.draft_checkpoint)
      if not drafts.takes(exp.draft_name, "feature"):
        raise ValueError(f"{exp.draft_checkpoint} has a feature bridge "
                         f"({feature_lib.FILENAME}), but approximation model "
                         f"{exp.draft_name!r} takes no 'feature' argument")
      build_kw["feature"] = jax.tree.map(jnp.asarray, features)
    block = _load_bridge(exp.resolve(exp.draft_checkpoint), t5_block)
    if block is not None and drafts.takes(exp.draft_name, "block"):
      t5_block.check(block, dmodel, exp.draft_checkpoint)
      build_kw["block"] = jax.tree.map(jnp.asarray, block)
    if exp.draft_shortlist:
      ids = shortlist_lib.load(exp.resolve(exp.draft_shortlist), target.config.vocab_size)
      build_kw["shortlist"] = shortlist_lib.Shortlist.for_draft(
          dmodel, dparams, ids, with_inputs=exp.draft_shortlist_inputs)
  if exp.ngram_corpus:
    build_kw["corpus"] = _corpus(exp, d.vocab)
  draft = drafts.build(exp.draft_name, **build_kw)
  # Built-in drafts are tested elsewhere: trace them (free) but skip the run.
  drafts.check_interface(exp.draft_name, draft, jnp.asarray(d.inputs[:1].repeat(
      exp.batch_size, 0)), target.config.vocab_size, exp.gamma_max,
      cache_length(exp.max_decode_len, exp.gamma_max), exp.sampling,
      concrete=exp.draft_name not in drafts.BUILTIN, target_width=target.config.d_model)
  if exp.tree_shape is not None:
    drafts.check_tree(exp.draft_name, draft, exp.tree_shape)
  return draft


def _load_bridge(where: str, lib: Any = bridge_lib) -> Any:
  """What ``lib`` (a bridge module) stores in a draft checkpoint, or None."""
  if not storage.is_gcs(where) and not os.path.isdir(where):
    return None
  return lib.load(where)


def start_multihost(exp: Experiment) -> None:
  """``jax.distributed.initialize`` once, before JAX touches a device."""
  if exp.multihost and not jax.distributed.is_initialized():
    try:
      partitioning.initialize_multihost(exp.coordinator_address, exp.num_processes, exp.process_id)
    except partitioning.PartitioningError as e:
      raise ValueError(f"Experiment.multihost: {e}") from None


def check_before_loading(exp: Experiment, alpha_only: bool = False) -> None:
  """Every check that needs no data or weights (settings, pair, memory)."""
  exp.validate()
  if alpha_only and exp.gamma == "auto":
    raise ValueError("Experiment.gamma='auto' chooses γ from timed speculative pieces; "
                     "--alpha_only measures α only and uses no γ: bind a number (or drop "
                     "--alpha_only)")
  start_multihost(exp)
  exp.pair.check_before_loading(decode_shape(exp))
  check_memory(exp, alpha_only)


def prepare(exp: Experiment, alpha_only: bool = False) -> Setup:
  """Loads and checks everything; raises a clear error before any decoding."""
  check_before_loading(exp, alpha_only)
  return load_models(exp, load_data(exp))
