"""Experiment settings: one frozen dataclass bound by gin, validated before
any data or weight is read, and how its relative paths are found.

Relative paths in configs (checkpoints, vocabulary, data) are looked up in the
working directory, then next to each ``--config`` file (last first), then in
the repository root.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Optional, Sequence, Union

import gin

from specdec_jax import data, drafts, pair as pair_lib
from specdec_jax.decoding import AdaptiveConfig
# Path lookup is the pair's; the runner and scripts import it from here too.
from specdec_jax.pair import (ModelPair, PairSettings, candidates, check_path,  # noqa: F401
                              is_remote, resolve_path)
from specdec_jax.sampling import SamplingConfig
from specdec_jax.tree import TreeShape

REPO_ROOT = pair_lib.REPO_ROOT
DTYPES = pair_lib.DTYPES   # activation and weight dtypes
MODES = ("speculative", "alpha_only")
# Experiment fields outside the pair that hold paths that must exist.
_PATH_FIELDS = ("source", "ngram_corpus", "draft_shortlist")


@gin.configurable("SamplingConfig")
def sampling_config(temperature: float = 0.0, topk: int = 0, topp: float = 0.0
                    ) -> SamplingConfig:
  """``SamplingConfig`` as gin builds it: ``SamplingConfig.temperature = 1.0``
  sets the experiment's sampling (``Experiment.sampling`` defaults to it)."""
  return SamplingConfig(float(temperature), int(topk), float(topp))


@gin.configurable("AdaptiveConfig")
def adaptive_config(rule: str = gin.REQUIRED, threshold: Optional[float] = None,
                    initial_gamma: Optional[int] = None, widths: Sequence[int] = (),
                    skip_below: Optional[float] = None, confidence: str = "top"
                    ) -> AdaptiveConfig:
  """``AdaptiveConfig`` as gin builds it: ``Experiment.adaptive = @AdaptiveConfig()``
  with ``AdaptiveConfig.rule = 'threshold'``, ``AdaptiveConfig.threshold = 0.6``, ...
  (fields as ``specdec_jax.decoding.AdaptiveConfig``)."""
  return AdaptiveConfig(rule, threshold=None if threshold is None else float(threshold),
                        initial_gamma=initial_gamma, widths=tuple(int(w) for w in widths),
                        skip_below=None if skip_below is None else float(skip_below),
                        confidence=confidence)


@gin.configurable(denylist=["config_dirs"])
@dataclasses.dataclass(frozen=True)
class Experiment(PairSettings):
  """One experiment. Every field is a gin binding (``Experiment.<field>``)
  except ``config_dirs``, which ``parse_config`` sets to the ``--config``
  files' directories (where relative paths are looked for, ``resolve``).

  The target's and the draft's settings (checkpoints, formats, presets,
  vocabulary, mesh, dtypes, ``min_rows``, ``draft_quantization``) are the
  pair's, declared in ``specdec_jax.pair.PairSettings`` and inherited here:
  ``pair`` is them as a ``ModelPair``, validated as distillation's. The draft
  is an approximation model by name ('t5', 'unigram', 'bigram',
  'prompt_lookup', 'lookup_t5'); unigram/bigram are estimated from
  ``ngram_corpus`` (a source like ``source``; its references are the corpus).
  """

  task: str = "bible_modernize"
  source: str = "data/bible/test.tsv"         # local .tsv/.jsonl or 'seqio:<task>'
  split: str = "test"                        # for seqio sources
  tfds_data_dir: Optional[str] = None
  prefix: Optional[str] = None               # default: data.PREFIXES[task]
  target_label: Optional[str] = None         # name in tables; default: path basename
  draft_name: str = "t5"
  draft_label: Optional[str] = None
  # A T5 draft's vocabulary shortlist (specdec_jax.drafts.shortlist; scripts/make_shortlist.py):
  # q only over these tokens, plus each input's own with draft_shortlist_inputs.
  # Exact for any shortlist; it trades a little α for a much cheaper draft step.
  draft_shortlist: str = ""
  draft_shortlist_inputs: bool = True
  ngram_corpus: Optional[str] = None
  ngram_corpus_split: str = "train"
  ngram_corpus_max_examples: Optional[int] = None
  prompt_lookup_max_ngram: int = 3
  # Sampling (§2.2): bind ``SamplingConfig.temperature`` / ``.topk`` / ``.topp``.
  sampling: SamplingConfig = dataclasses.field(default_factory=lambda: sampling_config())
  # Draft tokens per round, or 'auto' (§3.5: chosen ≤ auto_gamma_max); with
  # ``adaptive``, the most per round. ``gamma_max`` is that bound, whichever.
  gamma: Union[int, str] = 5
  auto_gamma_max: int = 8                    # the largest γ that gamma='auto' considers
  # Where 'auto' estimates α: '' = the warm-up examples; else a held-out source
  # (a validation split: tuning γ on it keeps the timed examples untouched),
  # its first auto_alpha_examples examples.
  auto_alpha_source: str = ""
  auto_alpha_examples: int = 32
  # Adaptive draft length per round and row: None (a fixed γ every round) or
  # ``@AdaptiveConfig()`` with ``AdaptiveConfig.rule`` etc. bound; gamma is then γ_max.
  adaptive: Optional[AdaptiveConfig] = None
  lenience: float = 1.0
  # A token tree verified in one target pass per round (specdec_jax.tree.TreeShape.parse):
  # '' (the chain of gamma), 'spine:4,2,2,1', 'full:3,2,1', 'parents:-1,0,0,1'.
  # Replaces gamma; exact for every draft that can fill it (README, "Token trees").
  tree: str = ""
  batch_size: int = 1
  max_input_len: int = 128
  # Input lengths to pad each batch to: the smallest that holds its longest
  # input (data.fit_to_bucket), one compiled program each, all compiled in the
  # warm-up. () pads to max_input_len always (T5X's fixed feature length).
  input_buckets: tuple = ()
  max_decode_len: int = 128
  on_too_long: str = "truncate"              # or 'error'
  # >= 1: the decoding loops run from XLA command buffers (CUDA graphs) on a GPU,
  # any run of at least this many kernels one graph; 0 off (decoding.with_command_buffers).
  command_buffers: int = 0
  multihost: bool = False                    # jax.distributed.initialize() before anything
  coordinator_address: Optional[str] = None  # multihost off Cloud TPU VMs: 'host:port'
  num_processes: Optional[int] = None
  process_id: Optional[int] = None
  num_warmup: int = 2
  num_examples: int = 100
  seed: int = 0
  alpha_only_tokens: int = 10_000
  # Interleaved repeats that time c, v (Definition 3.7) and each example's
  # prefill before the timed examples; fewer is quicker and noisier.
  cost_repeats: int = 15

  @property
  def pair(self) -> ModelPair:
    """The target and draft settings as one ``ModelPair`` (messages name them
    as bindings, ``Experiment.<field>``)."""
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
    for name in ("batch_size", "max_input_len", "max_decode_len", "num_examples",
                 "alpha_only_tokens", "cost_repeats"):
      if getattr(self, name) < 1:
        raise ValueError(f"Experiment.{name} must be >= 1, got {getattr(self, name)}")
    data.check_input_buckets(self.input_buckets, self.max_input_len, "Experiment.input_buckets")
    if self.num_warmup < 0:
      raise ValueError(f"Experiment.num_warmup must be >= 0, got {self.num_warmup}")
    if (isinstance(self.command_buffers, bool) or not isinstance(self.command_buffers, int)
        or self.command_buffers < 0):
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
    uses_checkpoint = drafts.takes(self.draft_name, "model") or drafts.takes(self.draft_name,
                                                                             "params")
    if self.draft_checkpoint and not uses_checkpoint:
      raise ValueError(f"Experiment.draft_checkpoint={self.draft_checkpoint!r} is set but "
                       f"approximation model {self.draft_name!r} takes no checkpoint (its "
                       "builder has no model/params argument); bind "
                       "Experiment.draft_checkpoint = '' for it")
    if self.draft_quantization is not None and not uses_checkpoint:
      raise ValueError(f"Experiment.draft_quantization={self.draft_quantization!r} is set but "
                       f"approximation model {self.draft_name!r} has no weights to quantize "
                       "(only T5 drafts do, e.g. 't5' and 'lookup_t5'); bind "
                       "Experiment.draft_quantization = None for it")
    if self.draft_shortlist and not drafts.takes(self.draft_name, "shortlist"):
      raise ValueError(f"Experiment.draft_shortlist={self.draft_shortlist!r} is set but "
                       f"approximation model {self.draft_name!r} takes no 'shortlist' "
                       "argument (the T5 drafts 't5' and 'lookup_t5' do); bind "
                       "Experiment.draft_shortlist = '' for it")

  def _check_unset(self, pair: ModelPair) -> None:
    """Every setting the run needs and that is unset, in one message naming
    each (and the gin macro it is bound through, if any)."""
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
  def tree_shape(self) -> Optional[TreeShape]:
    """``tree`` parsed (None for the chain); a bad one raises ``ValueError``
    naming Experiment.tree."""
    if not self.tree:
      return None
    try:
      return TreeShape.parse(self.tree)
    except ValueError as e:
      raise ValueError(f"Experiment.tree: {e}") from None

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

  @property
  def gamma_max(self) -> int:
    """γ_max: the most proposals the target may score in one round, what
    caches, memory and the dry run are sized for. A fixed
    γ (adaptive rounds choose up to it), 'auto''s ``auto_gamma_max`` (it
    chooses at most that), or a tree's N - 1 (the target scores its N nodes
    per round). The run's own γ, once chosen, is ``run.programs.Programs.gamma``."""
    if self.tree:
      return self.tree_shape.num_nodes - 1
    return self.auto_gamma_max if self.gamma == "auto" else self.gamma

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
  """The directories of the parsed ``--config`` files (last first), where
  relative paths are looked for after the working directory
  (``Experiment.config_dirs``)."""
  return tuple(str(Path(f).resolve().parent) for f in reversed(files))
