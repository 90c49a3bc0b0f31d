"""Experiment settings: one frozen dataclass bound by gin and validated before
anything is read; ``SamplingConfig`` and ``AdaptiveConfig`` bound as they are
(``gin_dataclass``); ``--help`` read from the declaring classes' docstrings.
Relative paths are looked up in the working directory, next to each
``--config`` (last first), then in the repository root.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import gin

from specdec_jax import data, drafts, pair as pair_lib
from specdec_jax.decoding import AdaptiveConfig
# Path lookup is the pair's; the runner and scripts import it from here too.
from specdec_jax.pair import (ModelPair, PairSettings, candidates, check_path,  # noqa: F401
                              is_remote, resolve_path)
from specdec_jax.sampling import SamplingConfig
from specdec_jax.tree import DynamicTree, TreeShape, parse_tree

REPO_ROOT = pair_lib.REPO_ROOT
# Experiment fields outside the pair that hold paths that must exist.
_PATH_FIELDS = ("source", "ngram_corpus", "draft_shortlist")


def _type_error(owner: str, name: str, value: Any, hint: Any) -> Optional[str]:
  """Why ``value`` is not of type ``hint`` (None: it is); an int passes for a
  float, a list for a tuple."""

  def matches(t) -> bool:
    t = typing.get_origin(t) or t
    if t is float:
      return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t is tuple:
      return isinstance(value, (tuple, list))
    return isinstance(value, t) and not (t is int and isinstance(value, bool))

  options = [a for a in typing.get_args(hint) if a is not type(None)] \
      if typing.get_origin(hint) in (Union, types.UnionType) else [hint]
  optional = type(None) in typing.get_args(hint)
  if (value is None and optional) or any(matches(t) for t in options):
    return None
  names = " or ".join(getattr(typing.get_origin(t) or t, "__name__", str(t)) for t in options)
  return (f"{owner}.{name} must be {names}{' or None' if optional else ''}, got {value!r} "
          f"({type(value).__name__})")


def _coerced(value: Any, hint: Any) -> Any:
  """An int for a float field as a float, a list for a tuple as a tuple (the
  dataclasses are static jit arguments: hashable, equal whatever the spelling)."""
  options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) \
      else (hint,)
  if float in options and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if any((typing.get_origin(t) or t) is tuple for t in options) and isinstance(value, list):
    return tuple(value)
  return value


def gin_dataclass(cls: type) -> Callable[..., Any]:
  """Registers the frozen dataclass ``cls`` with gin under its own name
  (bindings ``<Name>.<field>``, checked against the annotations and coerced)
  and returns the configurable that builds it."""
  hints = typing.get_type_hints(cls)
  fields = [f for f in dataclasses.fields(cls) if f.init]

  def build(**bound: Any) -> Any:
    for f in fields:
      if f.name not in bound and f.default is dataclasses.MISSING \
          and f.default_factory is dataclasses.MISSING:
        raise ValueError(f"{cls.__name__}.{f.name} is not set; bind it, e.g. "
                         f"--gin_bindings=\"{cls.__name__}.{f.name} = ...\" (--help lists "
                         "its values)")
    for name, value in bound.items():
      why = _type_error(cls.__name__, name, _coerced(value, hints[name]), hints[name])
      if why:
        raise ValueError(why)
    return cls(**{k: _coerced(v, hints[k]) for k, v in bound.items()})

  build.__signature__ = inspect.signature(cls)
  build.__name__ = build.__qualname__ = cls.__name__
  build.__doc__ = cls.__doc__
  return gin.external_configurable(build, cls.__name__)


sampling_config = gin_dataclass(SamplingConfig)
gin_dataclass(AdaptiveConfig)


@gin.configurable(denylist=["config_dirs"])
@dataclasses.dataclass(frozen=True)
class Experiment(PairSettings):
  """One experiment; every field is a gin binding ``Experiment.<field>``
  except ``config_dirs`` (set by ``parse_config``). The pair's settings are
  inherited from ``pair.PairSettings``. Each entry's first sentence is its
  ``--help`` line.

  task: the task's name in tables and its input prefix (``data.PREFIXES``:
    'wmt_ende', 'cnn_dailymail', 'bible_modernize').
  source: the examples, a local .tsv/.jsonl (id, input, reference) or
    'seqio:<task>'.
  split: the split a 'seqio:' source reads.
  tfds_data_dir: where TensorFlow Datasets finds a 'seqio:' source's data
    (None: TFDS_DATA_DIR or TFDS's default; ``prepare_data`` writes it).
  prefix: the text put before each input (None: the task's, ``data.PREFIXES``).
  target_label: the target's name in tables (None: its checkpoint's folder name).
  draft_name: the approximation model by name: 't5', 'unigram', 'bigram',
    'prompt_lookup', 'lookup_t5', or one registered by ``--import``.
  draft_label: the draft's name in tables (None: its checkpoint's folder
    name, or ``draft_name``).
  draft_shortlist: a T5 draft's vocabulary shortlist, a JSON file from
    ``scripts/make_shortlist.py`` ('' off; ``specdec_jax.drafts.shortlist``).
  draft_shortlist_inputs: whether the shortlist also holds each input's own tokens.
  ngram_corpus: the corpus a unigram/bigram draft is estimated from, a source
    like ``source`` (its references are the corpus).
  ngram_corpus_split: the split a 'seqio:' ``ngram_corpus`` reads.
  ngram_corpus_max_examples: how many of ``ngram_corpus``'s examples to read (None: all).
  prompt_lookup_max_ngram: the longest n-gram the 'prompt_lookup' draft looks up in the input.
  sampling: the sampling settings (§2.2), bound as ``SamplingConfig.<name>``.
  gamma: draft tokens per round (γ), or 'auto': chosen after the warm-up by
    Theorem 3.8 at the measured α, c and v (§3.5), plain decoding where no γ pays.
    With ``adaptive``, the most per round (``gamma_max``).
  auto_gamma_max: the largest γ that gamma = 'auto' considers.
  auto_alpha_source: where 'auto' estimates α: '' the warm-up examples, else
    a held-out source (a validation split keeps the timed examples untouched),
    its first ``auto_alpha_examples`` examples.
  auto_alpha_examples: how many of ``auto_alpha_source``'s examples 'auto' reads.
  adaptive: the draft length chosen per round and row (None: γ every round),
    ``@AdaptiveConfig()`` with ``AdaptiveConfig.<name>`` bound; ``gamma`` is then γ_max.
  lenience: the lenience of Appendix A.5, in (0, 1] (1 is exact).
  tree: a token tree verified in one target pass per round instead of a chain
    ('' the chain; 'spine:4,2,2,1', 'full:3,2,1', 'parents:-1,0,0,1', or
    'dynamic:4,4,4' chosen each round). It replaces gamma (README, "Token trees").
  decode_method: 'sample' (``SamplingConfig``) or 'beam': T5X's beam search
    against speculative beam search (Appendix A.4, ``specdec_jax.beam``). With
    'beam' ``gamma`` is the draft's steps per round: a plain T5 draft runs
    beam search, any other proposes each beam's greedy chain.
  beam_size: the beam width w of 'beam'.
  beam_alpha: the brevity penalty's exponent of 'beam' ((5 + length) / 6)^alpha.
  draft_beam_size: the draft's beam width u >= w of 'beam' (0: ``beam_size``;
    a draft's greedy chains are u = w).
  batch_size: examples decoded together (rows accept independently).
  max_input_len: the longest input in tokens (longer ones per ``on_too_long``).
  input_buckets: the input lengths each batch is padded to, the smallest
    that holds its longest input (() always ``max_input_len``, T5X's fixed
    feature length).
  max_decode_len: the most tokens generated per example.
  on_too_long: what an input over ``max_input_len`` gets: 'truncate' (logged) or 'error'.
  command_buffers: on a GPU, run the decoding loops from XLA command buffers
    (CUDA graphs) of at least this many kernels (0 off;
    ``run.programs.with_command_buffers``).
  multihost: call ``jax.distributed.initialize()`` before anything (several hosts, one run).
  coordinator_address: the multi-host coordinator off Cloud TPU VMs, 'host:port'.
  num_processes: the multi-host process count (with ``coordinator_address``).
  process_id: this process's multi-host id (with ``coordinator_address``).
  num_warmup: the first examples, decoded untimed to compile and warm both loops.
  num_examples: the timed examples after the warm-up.
  seed: the random key both loops draw from (the same key for both).
  alpha_only_tokens: ``--alpha_only``'s budget of target tokens.
  cost_repeats: interleaved repeats timing c, v (Definition 3.7) and each
    example's prefill before the timed examples (fewer: quicker, noisier).
  """

  task: str = "bible_modernize"
  source: str = "data/bible/test.tsv"
  split: str = "test"
  tfds_data_dir: Optional[str] = None
  prefix: Optional[str] = None
  target_label: Optional[str] = None
  draft_name: str = "t5"
  draft_label: Optional[str] = None
  draft_shortlist: str = ""
  draft_shortlist_inputs: bool = True
  ngram_corpus: Optional[str] = None
  ngram_corpus_split: str = "train"
  ngram_corpus_max_examples: Optional[int] = None
  prompt_lookup_max_ngram: int = 3
  sampling: SamplingConfig = dataclasses.field(default_factory=lambda: sampling_config())
  gamma: Union[int, str] = 5
  auto_gamma_max: int = 8
  auto_alpha_source: str = ""
  auto_alpha_examples: int = 32
  adaptive: Optional[AdaptiveConfig] = None
  lenience: float = 1.0
  tree: str = ""
  decode_method: str = "sample"
  beam_size: int = 4
  beam_alpha: float = 0.6
  draft_beam_size: int = 0
  batch_size: int = 1
  max_input_len: int = 128
  input_buckets: tuple = ()
  max_decode_len: int = 128
  on_too_long: str = "truncate"
  command_buffers: int = 0
  multihost: bool = False
  coordinator_address: Optional[str] = None
  num_processes: Optional[int] = None
  process_id: Optional[int] = None
  num_warmup: int = 2
  num_examples: int = 100
  seed: int = 0
  alpha_only_tokens: int = 10_000
  cost_repeats: int = 15

  @property
  def pair(self) -> ModelPair:
    """The target and draft settings as one ``ModelPair``."""
    return self.model_pair("Experiment")

  def validate(self) -> None:
    """Cheap checks that fail before any long work starts (types, values, paths)."""
    self.check_types()
    pair = self.pair
    pair.check_values()
    if self.multihost and self.coordinator_address is not None and (
        self.num_processes is None or self.process_id is None):
      raise ValueError("Experiment.multihost with Experiment.coordinator_address also needs "
                       "Experiment.num_processes and Experiment.process_id")
    self._check_gamma()
    if self.tree:
      self._check_tree()
    self._check_fixed_positions()
    self._check_draft()
    self._check_beam()
    for name in ("batch_size", "max_input_len", "max_decode_len", "num_examples",
                 "alpha_only_tokens", "cost_repeats"):
      if getattr(self, name) < 1:
        raise ValueError(f"Experiment.{name} must be >= 1, got {getattr(self, name)}")
    data.check_input_buckets(self.input_buckets, self.max_input_len, "Experiment.input_buckets")
    if self.num_warmup < 0:
      raise ValueError(f"Experiment.num_warmup must be >= 0, got {self.num_warmup}")
    if self.command_buffers < 0:  # an int: check_types
      raise ValueError(f"Experiment.command_buffers must be an int >= 0 (0: off, else the "
                       f"fewest kernels per graph), got {self.command_buffers!r}")
    if self.on_too_long not in ("truncate", "error"):
      raise ValueError(f"Experiment.on_too_long must be 'truncate' or 'error', "
                       f"got {self.on_too_long!r}")
    self._check_unset(pair)
    pair.check_paths()
    for name in _PATH_FIELDS + ("tfds_data_dir", "auto_alpha_source"):
      if getattr(self, name):
        check_path(f"Experiment.{name}", getattr(self, name), self.config_dirs,
                   must_exist=name in _PATH_FIELDS)

  def _check_gamma(self) -> None:
    """γ, its automatic choice and the adaptive rule (§3.5), and lenience."""
    if isinstance(self.gamma, str) and self.gamma != "auto":
      raise ValueError(f"Experiment.gamma must be an int >= 1 or 'auto', got {self.gamma!r}")
    if not isinstance(self.gamma, str) and self.gamma < 1:
      raise ValueError(f"Experiment.gamma must be >= 1 (draft tokens per round), got "
                       f"{self.gamma}; every run times plain decoding as its baseline, and "
                       "Experiment.gamma = 'auto' chooses plain decoding (γ = 0) where no γ pays")
    if self.auto_gamma_max < 1:
      raise ValueError(f"Experiment.auto_gamma_max must be >= 1, got {self.auto_gamma_max}")
    if self.auto_alpha_source and self.auto_alpha_examples < 1:
      raise ValueError("Experiment.auto_alpha_examples must be >= 1 with "
                       f"auto_alpha_source={self.auto_alpha_source!r}, got "
                       f"{self.auto_alpha_examples}")
    if self.adaptive is not None:
      if self.gamma == "auto":
        raise ValueError("Experiment.adaptive chooses γ per round up to Experiment.gamma "
                         "(γ_max); bind a number for gamma, not 'auto'")
      try:
        self.adaptive.verify_widths(self.gamma)
      except ValueError as e:
        raise ValueError(f"Experiment.adaptive (rule {self.adaptive.rule!r}): {e}") from None
    if not 0 < self.lenience <= 1:
      raise ValueError(f"Experiment.lenience must be in (0, 1] (1 is exact), got {self.lenience}")

  def _check_fixed_positions(self) -> None:
    """Fixed positions hold every target call: γ_max + 1 (``gamma_max``)."""
    if not self.fixed_positions:
      return
    need = self.gamma_max + 1
    what = (f"the tree's {need} nodes" if self.tree else f"γ + 1 = {need} positions")
    if self.fixed_positions < need:
      raise ValueError(f"Experiment.fixed_positions = {self.fixed_positions} cannot hold {what} "
                       f"a target call scores: bind at least {need} (or 0: off)")

  def _check_tree(self) -> None:
    """A token tree: well formed, alone (no adaptive γ, lenience or 'auto'), and room for it."""
    shape = self.tree_shape  # a malformed tree fails here, naming itself
    clash = [(f, why) for f, on, why in (
        ("adaptive", self.adaptive is not None, "a tree's shape is fixed per run"),
        ("lenience", self.lenience != 1.0, "trees are verified exactly"),
        ("gamma", self.gamma == "auto", "the tree's depth replaces γ")) if on]
    if clash:
      f, why = clash[0]
      raise ValueError(f"Experiment.tree={self.tree!r} cannot run with Experiment.{f}="
                       f"{getattr(self, f)!r}: {why}")
    try:
      shape.check_room(self.max_decode_len)
    except ValueError as e:
      raise ValueError(f"Experiment.tree={self.tree!r}: {e}") from None

  def _check_draft(self) -> None:
    """The approximation model is registered and takes what is bound for it."""
    if self.draft_name not in drafts.REGISTRY:
      raise ValueError(f"unknown approximation model Experiment.draft_name="
                       f"{self.draft_name!r}; known: {sorted(drafts.REGISTRY)} (a draft "
                       "defined outside the package needs --import=<its module>)")
    takes = lambda *args: any(drafts.takes(self.draft_name, a) for a in args)
    for field, ok, lacks, off in (
        ("draft_checkpoint", takes("model", "params"),
         "takes no checkpoint (its builder has no model/params argument)", ""),
        ("draft_quantization", takes("model", "params"),
         "has no weights to quantize (only T5 drafts do, e.g. 't5' and 'lookup_t5')", None),
        ("draft_shortlist", takes("shortlist"),
         "takes no 'shortlist' argument (the T5 drafts 't5' and 'lookup_t5' do)", "")):
      value = getattr(self, field)
      if value not in ("", None) and not ok:
        raise ValueError(f"Experiment.{field}={value!r} is set but approximation model "
                         f"{self.draft_name!r} {lacks}; bind Experiment.{field} = {off!r} for it")

  def _check_beam(self) -> None:
    """Beam search: a known method, widths u >= w >= 1, alpha >= 0, and what it runs with."""
    if self.decode_method not in ("sample", "beam"):
      raise ValueError(f"Experiment.decode_method must be 'sample' or 'beam', got "
                       f"{self.decode_method!r}")
    if self.decode_method != "beam":
      return
    if self.beam_size < 1:
      raise ValueError(f"Experiment.beam_size must be >= 1, got {self.beam_size}")
    if self.draft_beam_size and self.draft_beam_size < self.beam_size:
      raise ValueError(f"Experiment.draft_beam_size ({self.draft_beam_size}) must be >= "
                       f"Experiment.beam_size ({self.beam_size}), or 0 for the same width")
    if not self.beam_alpha >= 0:
      raise ValueError(f"Experiment.beam_alpha must be >= 0, got {self.beam_alpha}")
    clash = [f for f, on in (("tree", bool(self.tree)), ("adaptive", self.adaptive is not None),
                             ("lenience", self.lenience != 1.0),
                             ("fixed_positions", bool(self.fixed_positions)),
                             ("gamma", not isinstance(self.gamma, int)))
             if on]
    if clash:
      raise ValueError(f"Experiment.decode_method='beam' cannot run with Experiment."
                       f"{clash[0]}={getattr(self, clash[0])!r} (beam search takes a fixed "
                       "integer gamma)")

  @property
  def draft_beam_width(self) -> int:
    """The draft's beam width u (draft_beam_size, or beam_size where 0)."""
    return self.draft_beam_size or self.beam_size

  def _check_unset(self, pair: ModelPair) -> None:
    """Every needed setting that is unset, in one message (with its gin macro)."""
    needs = set(drafts.requires(self.draft_name))
    why = {"draft_checkpoint": f"draft_name={self.draft_name!r} needs one"}
    unset = [(f, why.get(f, "")) for f in pair.unset(bool(needs & {"model", "params"}))]
    if not self.source:
      unset.append(("source", ""))
    if "corpus" in needs and not self.ngram_corpus:
      unset.append(("ngram_corpus", f"draft_name={self.draft_name!r} is estimated from a "
                    "corpus"))
    if unset:
      items = []
      for f, reason in unset:
        macro = _macro_for(f)
        item = f"Experiment.{f} is not set" + (f" ({reason})" if reason else "")
        items.append(f"{macro} ({item})" if macro else item)
      example = _macro_for(unset[0][0]) or f"Experiment.{unset[0][0]}"
      raise ValueError(f"missing settings: {'; '.join(items)}. Bind each, e.g. "
                       f"--gin_bindings=\"{example} = '/path/...'\"")

  @property
  def tree_shape(self) -> Optional[TreeShape | DynamicTree]:
    """``tree`` parsed (None for the chain)."""
    if not self.tree:
      return None
    try:
      return parse_tree(self.tree)
    except ValueError as e:
      raise ValueError(f"Experiment.tree: {e}") from None

  def check_types(self) -> None:
    """Each field has its annotated type (gin passes whatever the config says)."""
    hints = typing.get_type_hints(Experiment)
    for f in dataclasses.fields(self):
      why = _type_error("Experiment", f.name, getattr(self, f.name), hints[f.name])
      if why:
        raise ValueError(why)

  @property
  def gamma_max(self) -> int:
    """γ_max: the most proposals scored in one round, what caches and memory
    are sized for: γ, 'auto''s ``auto_gamma_max`` or a tree's N - 1. The
    run's chosen γ is ``run.programs.Programs.gamma``."""
    if self.tree:
      return self.tree_shape.num_nodes - 1
    return self.auto_gamma_max if self.gamma == "auto" else self.gamma

  @property
  def labels(self) -> tuple[str, str]:
    target = self.target_label or Path(self.target_checkpoint.rstrip("/")).name
    draft = self.draft_label or (Path(self.draft_checkpoint.rstrip("/")).name
                                 if self.draft_name == "t5" else self.draft_name)
    if self.draft_shortlist and not self.draft_label:
      draft += "+shortlist"
    return target, draft


def _macro_for(field: str) -> Optional[str]:
  """The gin macro ``Experiment.<field>`` is bound to (e.g. TARGET_CHECKPOINT), if any."""
  try:
    ref = gin.query_parameter(f"Experiment.{field}")
  except (ValueError, KeyError):
    return None
  text = str(ref)
  return text[1:] if isinstance(ref, gin.config.ConfigurableReference) and \
      text.startswith("%") else None


def config_dirs(files: Sequence[str]) -> tuple[str, ...]:
  """The ``--config`` files' directories, last first (``Experiment.config_dirs``)."""
  return tuple(str(Path(f).resolve().parent) for f in reversed(files))


def setting_docs(cls: type) -> dict[str, str]:
  """Each field of ``cls`` -> the first sentence of its entry ``<field>:
  <text>`` in the docstring of the class declaring it, without reST markup."""
  docs: dict[str, str] = {}
  for klass in reversed(cls.__mro__):
    own = set(klass.__dict__.get("__annotations__", {}))
    lines = inspect.cleandoc(klass.__dict__.get("__doc__") or "").splitlines()
    for i, line in enumerate(lines):
      m = re.match(r"(\s*)(\w+): (.*)", line)
      if not m or m.group(2) not in own:
        continue
      text, depth = [m.group(3)], len(m.group(1))
      for more in lines[i + 1:]:
        if not more.strip() or len(more) - len(more.lstrip()) <= depth:
          break
        text.append(more.strip())
      docs[m.group(2)] = _first_sentence(" ".join(text).replace("``", ""))
  return {f.name: docs[f.name] for f in dataclasses.fields(cls) if f.name in docs}


def _first_sentence(text: str) -> str:
  return re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=\.)\s+(?=[A-Z'\"(0-9])", text, maxsplit=1)[0]


def _default(f: dataclasses.Field) -> str:
  """A field's default as a binding would spell it ('(required)' for none)."""
  if f.default is not dataclasses.MISSING:
    value = f.default
  elif f.default_factory is not dataclasses.MISSING:
    value = f.default_factory()
  else:
    return "(required)"
  if dataclasses.is_dataclass(value):
    return f"@{type(value).__name__}()"
  return f"= {value!r}"


def setting_lines(cls: type, skip: Sequence[str] = ()) -> list[str]:
  """One line per setting of ``cls``: its name, its default and its description."""
  docs = setting_docs(cls)
  return [f"  {f.name} {_default(f)}: {docs.get(f.name, '')}".rstrip(": ")
          for f in dataclasses.fields(cls) if f.init and f.name not in skip]


def settings_help() -> str:
  """Every setting the runner takes, one line each (``--help``)."""
  pair = [f.name for f in dataclasses.fields(PairSettings)]
  own = [f.name for f in dataclasses.fields(Experiment) if f.name not in pair]
  lines = ["", "Experiment settings (--gin_bindings=\"Experiment.<name> = <value>\"; each with "
           "its default):"]
  lines += setting_lines(Experiment, skip=pair + ["config_dirs"])
  lines += ["", "The target and the draft (Experiment.<name> too; shared with distillation):"]
  lines += setting_lines(PairSettings, skip=own + ["config_dirs"])
  lines += ["", "Sampling (§2.2), SamplingConfig.<name>:"]
  lines += setting_lines(SamplingConfig)
  lines += ["", "Adaptive draft length, with Experiment.adaptive = @AdaptiveConfig(): "
            "AdaptiveConfig.<name>:"]
  lines += setting_lines(AdaptiveConfig)
  return "\n".join(lines) + "\n"
