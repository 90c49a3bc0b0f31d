"""Prompt lookup (paper §3.6): copy the continuation of a matching n-gram.

Parameter-free, c ≈ 0. The proposal is deterministic given the context, so
the q it reports is the one-hot of each proposed token — exactly what it
"sampled" from, which keeps Algorithm 1 exact (docs/exactness.md, section 3).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.drafts.base import skip_unsure

Array = jax.Array


def lookup_continuation(inputs: Array, seq: Array, length: Array, gamma: int,
                        max_ngram: int) -> tuple[Array, Array, Array]:
  """The γ tokens after the most recent occurrence of the longest matching suffix.

  Context = the input tokens (non-pad) followed by the committed output tokens
  seq[:, 1:length + 1]. For n = 1..max_ngram the last n committed tokens are
  searched for in the context (excluding their own occurrence); the longest n
  found wins, and among its occurrences the most recent.

  Returns (tokens [B, γ] int32, matched [B] int32: the winning n, 0 if none,
  valid [B, γ] bool: token i is a real context token, not padding or past the
  end). Depends only on the context, never on the target.
  """
  b, s = inputs.shape
  t = seq.shape[1] - 1
  gen = seq[:, 1:]
  ctx = jnp.concatenate([inputs, gen], axis=1)                        # [B, S+T]
  valid = jnp.concatenate([inputs != 0, jnp.arange(t)[None] < length[:, None]], axis=1)
  pos = jnp.arange(s + t)
  end = s + length                                                  # [B] one past last token
  best_start = jnp.full((b,), -1, jnp.int32)                        # continuation start
  matched = jnp.zeros((b,), jnp.int32)
  for n in range(1, max_ngram + 1):                                 # longer n overrides
    # suffix[j] = last n committed tokens; match ends at i with i + 1 < end.
    suffix_idx = end[:, None] - n + jnp.arange(n)[None]            # [B, n]
    suffix = jnp.take_along_axis(ctx, jnp.clip(suffix_idx, 0), axis=1)
    ok = length >= n
    match = jnp.ones((b, s + t), bool)
    for j in range(n):
      shifted = jnp.roll(ctx, n - 1 - j, axis=1)                     # ctx[i - (n-1-j)]
      vshift = jnp.roll(valid, n - 1 - j, axis=1)
      match &= (shifted == suffix[:, j:j + 1]) & vshift & (pos[None] >= n - 1 - j)
    # Exclude the suffix's own occurrence and any match ending at the end.
    match &= pos[None] < (end[:, None] - 1)
    last = jnp.max(jnp.where(match, pos[None], -1), axis=1)
    found = ok & (last >= 0)
    best_start = jnp.where(found, last + 1, best_start)
    matched = jnp.where(found, n, matched)
  idx = best_start[:, None] + jnp.arange(gamma)[None]
  cont = jnp.take_along_axis(ctx, jnp.clip(idx, 0, s + t - 1), axis=1)
  cont_ok = (best_start[:, None] >= 0) & jnp.take_along_axis(
      valid, jnp.clip(idx, 0, s + t - 1), axis=1) & (idx < s + t)
  return cont.astype(jnp.int32), matched, cont_ok


@struct.dataclass
class PromptLookupDraft:
  """Find the longest suffix n-gram (n = max_ngram..1) of the generated text in
  the input or earlier in the generated text; propose the γ tokens after its
  most recent occurrence (``lookup_continuation``). Without a match, repeat the
  last token (any proposal is correct; this one is merely unlikely to be
  accepted).
  """

  vocab_size: int = struct.field(pytree_node=False)
  max_ngram: int = struct.field(pytree_node=False, default=3)

  def init(self, inputs: Array, cache_len: int) -> Any:
    return inputs

  def _proposal(self, state, seq, length, gamma):
    cont, _, cont_ok = lookup_continuation(state, seq, length, gamma, self.max_ngram)
    last_tok = jnp.take_along_axis(seq, length[:, None], axis=1)[:, 0]
    tokens = jnp.where(cont_ok, cont, last_tok[:, None]).astype(jnp.int32)
    return tokens, jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32), cont_ok

  def propose(self, state, seq, length, gamma, sampling, key):
    del key, sampling  # deterministic; q is one-hot whatever the sampling
    tokens, q, _ = self._proposal(state, seq, length, gamma)
    return tokens, q, state

  def propose_adaptive(self, state, seq, length, gamma, sampling, key, limit, threshold,
                       skip_below=None, cumulative=False, drawn=False):
    """Adaptive rounds (``drafts.base``): a row proposes its copied run, the
    leading tokens that come from a match, not the last-token filler. Its
    confidence is 1 for a copied token and 0 for a filler (every q is
    one-hot, so ``top_probability`` would say 1 for both): x_1 is proposed
    unless ``skip_below`` is set and x_1 is a filler (then the round is a
    plain target step), and at most one token when ``threshold`` is 1. The
    run's confidences are all 1, so ``cumulative`` (their product) and
    ``drawn`` (a copy's q is one-hot at it) change nothing. Depends only on
    the context, so the engine stays exact."""
    del key, sampling, cumulative, drawn
    tokens, q, copied = self._proposal(state, seq, length, gamma)
    run = jnp.sum(jnp.cumprod(copied.astype(jnp.int32), axis=-1), axis=-1)
    count = jnp.maximum(run, 1) if threshold < 1.0 else jnp.ones_like(run)
    count = skip_unsure(jnp.minimum(count, limit), copied[:, 0].astype(jnp.float32), skip_below)
    return tokens, q, count, jnp.asarray(gamma, jnp.int32), state

  def commit(self, state, seq, length):
    return state
