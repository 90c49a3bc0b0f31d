"""Approximation models M_q behind one interface (see ``base``), by name.

``REGISTRY`` maps a name to a builder; a config selects a draft by that name
(the runner's ``draft_name`` binding), so swapping approximation models needs
no code change. Register a new one with ``register("name")``.
"""

from __future__ import annotations

from typing import Callable

from specdec_jax.drafts.base import ApproximationModel, gather_positions
from specdec_jax.drafts.ngram import BigramDraft, UnigramDraft
from specdec_jax.drafts.prompt_lookup import PromptLookupDraft
from specdec_jax.drafts.t5_draft import T5Draft

REGISTRY: dict[str, Callable[..., ApproximationModel]] = {}


def register(name: str):
  """Decorator: make a builder selectable by ``name``."""
  def deco(fn):
    if name in REGISTRY:
      raise ValueError(f"approximation model {name!r} is already registered")
    REGISTRY[name] = fn
    return fn
  return deco


def build(name: str, **kwargs) -> ApproximationModel:
  """Build the approximation model registered as ``name``.

  The runner passes every builder the same keywords — ``vocab_size``,
  ``max_ngram``, and when configured ``model``/``params`` (a draft checkpoint)
  and ``corpus`` (token sequences) — so builders accept ``**_`` for the rest.
  """
  if name not in REGISTRY:
    raise ValueError(f"unknown approximation model {name!r}; known: {sorted(REGISTRY)}")
  return REGISTRY[name](**kwargs)


register("t5")(lambda model, params, **_: T5Draft(params=params, model=model))
register("unigram")(lambda corpus, vocab_size, **_: UnigramDraft.fit(corpus, vocab_size))
register("bigram")(lambda corpus, vocab_size, **_: BigramDraft.fit(corpus, vocab_size))
register("prompt_lookup")(
    lambda vocab_size, max_ngram=3, **_: PromptLookupDraft(vocab_size=vocab_size,
                                                           max_ngram=max_ngram))

__all__ = ["ApproximationModel", "BigramDraft", "PromptLookupDraft", "REGISTRY",
           "T5Draft", "UnigramDraft", "build", "gather_positions", "register"]
