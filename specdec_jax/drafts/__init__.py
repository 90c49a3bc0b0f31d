"""Approximation models M_q behind one interface (``base``), by name: ``REGISTRY``
maps a name to a builder, selected by the runner's ``draft_name``. Register a
new one with ``@register("name")`` on a builder or a draft class."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from specdec_jax.drafts.base import (ApproximationModel, DraftInterfaceError, check_interface,
                                     check_tree, gather_positions)
from specdec_jax.drafts.lookup_t5 import LookupT5Draft
from specdec_jax.drafts.ngram import BigramDraft, UnigramDraft
from specdec_jax.drafts.prompt_lookup import PromptLookupDraft
from specdec_jax.drafts import t5_block
from specdec_jax.drafts.t5_block import T5BlockDraft
from specdec_jax.drafts.t5_draft import T5Draft

REGISTRY: dict[str, Callable[..., ApproximationModel]] = {}

# What the runner offers every builder; a builder declares the ones it uses.
BUILD_ARGS = ("vocab_size", "vocab", "max_ngram", "model", "params", "corpus", "partitioner",
              "bridge", "feature", "target_model", "target_params", "shortlist", "block")


def register(name: str):
  """Decorator: a builder or draft class (called with the ``build`` arguments it
  names) selectable by ``name``; re-registering the same object is allowed."""
  def deco(obj):
    old = REGISTRY.get(name)
    if old is not None and _qualname(old) != _qualname(obj):
      raise ValueError(f"approximation model {name!r} is already registered "
                       f"({_qualname(old)})")
    REGISTRY[name] = obj
    return obj
  return deco


def _qualname(obj: Any) -> str:
  return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _signature(name: str) -> Optional[inspect.Signature]:
  try:
    return inspect.signature(REGISTRY[name])
  except (TypeError, ValueError):  # builtins without a signature: pass everything
    return None


def takes(name: str, arg: str) -> bool:
  """Whether the builder registered as ``name`` accepts keyword ``arg``."""
  sig = _signature(name)
  if sig is None:
    return True
  return arg in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def requires(name: str) -> list[str]:
  """The build arguments the builder ``name`` cannot do without (no default)."""
  sig = _signature(name)
  if sig is None:
    return []
  return [p.name for p in sig.parameters.values()
          if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def build(name: str, **kwargs: Any) -> ApproximationModel:
  """Build the approximation model registered as ``name``, passing only the keywords
  (of ``BUILD_ARGS``, where configured) its signature names (all with ``**kwargs``)."""
  if name not in REGISTRY:
    raise ValueError(f"unknown approximation model {name!r}; known: {sorted(REGISTRY)}")
  missing = [a for a in requires(name) if a not in kwargs]
  if missing:
    raise ValueError(f"approximation model {name!r} ({_qualname(REGISTRY[name])}) needs "
                     f"{missing}, which the runner did not provide; it offers {list(BUILD_ARGS)}"
                     " (model/params come from Experiment.draft_checkpoint, corpus from "
                     "Experiment.ngram_corpus)")
  kw = {k: v for k, v in kwargs.items() if takes(name, k)}
  return REGISTRY[name](**kw)


@register("t5")
def _t5(model, params, partitioner=None, bridge=None, target_model=None,
        target_params=None, feature=None, shortlist=None) -> T5Draft:
  return T5Draft(params=params, model=model, partitioner=partitioner, bridge=bridge,
                 target_params=target_params, target_model=target_model, feature=feature,
                 shortlist=shortlist)


@register("t5_block")
def _t5_block(model, params, block=None, partitioner=None, bridge=None, target_model=None,
              target_params=None, feature=None) -> T5BlockDraft:
  if block is None:
    raise ValueError("approximation model 't5_block' needs a block draft checkpoint: the draft "
                     f"checkpoint has no {t5_block.FILENAME} (its mask embedding; train one with "
                     "scripts/distill_draft.py --block_size=GAMMA)")
  return t5_block.build(model, params, block, partitioner, bridge, target_model, target_params,
                        feature)


@register("unigram")
def _unigram(corpus, vocab_size) -> UnigramDraft:
  return UnigramDraft.fit(corpus, vocab_size)


@register("bigram")
def _bigram(corpus, vocab_size) -> BigramDraft:
  return BigramDraft.fit(corpus, vocab_size)


@register("prompt_lookup")
def _prompt_lookup(vocab_size, max_ngram=3) -> PromptLookupDraft:
  return PromptLookupDraft(vocab_size=vocab_size, max_ngram=max_ngram)


@register("lookup_t5")
def _lookup_t5(model, params, max_ngram=3, partitioner=None, bridge=None, target_model=None,
               target_params=None, feature=None, shortlist=None) -> LookupT5Draft:
  # Copy only on a full max_ngram match: copies after shorter matches can be
  # accepted less often than the T5 draft's own proposals.
  return LookupT5Draft(t5=_t5(model, params, partitioner, bridge, target_model, target_params,
                              feature, shortlist), max_ngram=max_ngram, min_ngram=max_ngram)


BUILTIN = frozenset(REGISTRY)

__all__ = ["ApproximationModel", "BUILD_ARGS", "DraftInterfaceError", "BUILTIN", "BigramDraft",
           "LookupT5Draft", "PromptLookupDraft", "REGISTRY", "T5BlockDraft", "T5Draft",
           "UnigramDraft", "build", "check_interface", "check_tree", "gather_positions",
           "register", "requires", "takes"]
