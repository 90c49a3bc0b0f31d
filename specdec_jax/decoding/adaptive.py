"""Adaptive draft length: the chain loop with γ chosen per row and per round, at
most γ_max (``AdaptiveConfig``; the paper fixes γ, §3.5, and names varying it
as future work, §6). The target scores the narrowest compiled width covering
every live row's count (a ``lax.switch``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from specdec_jax.decoding.state import (Loop, Proposal, SpecState, Verdict, judge, pad_states,
                                        target_pass)
from specdec_jax.drafts.base import ApproximationModel, adaptive_proposal
from specdec_jax.models.base import pad_rows

Array = jax.Array


ADAPTIVE_RULES = ("threshold", "cumulative", "schedule")
# The rules that stop on the draft's confidence (``threshold``, ``skip_below``).
CONFIDENCE_RULES = ("threshold", "cumulative")
# What the confidence rules read after x_i: max_x q_i(x), or q_i(x_i).
CONFIDENCES = ("top", "drawn")


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
  """Adaptive draft length: ``speculative_decode``'s ``gamma`` is γ_max and each
  round row b proposes c_b <= γ_max tokens, verified as Algorithm 1 with γ = c_b.

  rule: how a row's draft length is chosen each round: 'threshold',
    'cumulative' or 'schedule'. 'threshold': after x_i, go on while i < γ_max
    and the draft's confidence at i is > ``threshold``; 'cumulative': while the
    product of the confidences 1..i is > ``threshold`` (after SpecDec++, Huang
    et al. 2024); 'schedule' (Hugging Face's 'heuristic'): row b proposes γ_b,
    += 2 after a fully accepted round, else -= 1, within [1, γ_max].
  threshold: the confidence the rules compare with, in [0, 1] (required by
    the confidence rules, refused by 'schedule'). 0 never stops early; 1
    always stops after x_1.
  skip_below: rows whose q_1 has top probability <= skip_below propose
    nothing that round, in [0, 1] (None: off; confidence rules only). The
    round is then a plain target step; q_1's top probability is always read.
  confidence: what the confidence rules read: 'top' or 'drawn'. 'top': max_x
    q_i(x) (at T = 0 the draft's own softmax); 'drawn': q_i(x_i).
  initial_gamma: the schedule's γ_b in the first round, 1 to γ_max (None:
    γ_max; 'schedule' only).
  widths: the verification widths k compiled, the target scoring k + 1
    positions (default: the powers of two below γ_max). Always with γ_max, and
    0 with ``skip_below``; each must be <= γ_max.

  Every rule decides whether to propose x_i before drawing it, from the past
  and the draft alone, so the output distribution is the target's exactly;
  proof: docs/exactness.md, section 5 (which also shows two rules that fail).
  """

  rule: str
  threshold: Optional[float] = None
  initial_gamma: Optional[int] = None
  widths: tuple[int, ...] = ()
  skip_below: Optional[float] = None
  confidence: str = "top"

  def __post_init__(self):
    if self.rule not in ADAPTIVE_RULES:
      raise ValueError(f"adaptive rule must be one of {ADAPTIVE_RULES}, got {self.rule!r}")
    if self.confidence not in CONFIDENCES:
      raise ValueError(f"adaptive confidence must be one of {CONFIDENCES}, got "
                       f"{self.confidence!r}")
    if self.confidence != "top" and self.rule not in CONFIDENCE_RULES:
      raise ValueError(f"confidence {self.confidence!r} applies to rules {CONFIDENCE_RULES} "
                       f"only, not {self.rule!r}")
    if self.rule in CONFIDENCE_RULES:
      if self.threshold is None or not 0.0 <= self.threshold <= 1.0:  # also rejects NaN
        raise ValueError(f"adaptive rule {self.rule!r} needs a threshold in [0, 1] (0: never "
                         f"stop early, 1: one draft token per round), got {self.threshold!r}")
      if self.initial_gamma is not None:
        raise ValueError(f"initial_gamma ({self.initial_gamma}) applies to rule 'schedule' "
                         f"only, not {self.rule!r}")
    else:
      if self.threshold is not None:
        raise ValueError(f"threshold ({self.threshold}) applies to rules {CONFIDENCE_RULES} "
                         "only, not 'schedule'")
      if self.initial_gamma is not None and self.initial_gamma < 1:
        raise ValueError(f"initial_gamma must be >= 1, got {self.initial_gamma}")
    if self.skip_below is not None:
      if self.rule not in CONFIDENCE_RULES:
        raise ValueError(f"skip_below ({self.skip_below}) applies to rules {CONFIDENCE_RULES} "
                         f"only, not {self.rule!r}")
      if not 0.0 <= self.skip_below <= 1.0:  # also rejects NaN
        raise ValueError(f"skip_below must be in [0, 1], got {self.skip_below!r}")
    least = 0 if self.skip_below is not None else 1
    if any(w < least for w in self.widths):
      raise ValueError(f"verification widths must be >= {least}"
                       f"{'' if least == 0 else ' (0 only with skip_below)'}, got {self.widths}")

  def verify_widths(self, gamma_max: int) -> tuple[int, ...]:
    """The sorted compiled widths (γ_max always; 0 too when rows may skip)."""
    too_big = [w for w in self.widths if w > gamma_max]
    if too_big:
      raise ValueError(f"verification widths {too_big} exceed gamma (γ_max) = {gamma_max}")
    ws = set(self.widths) or {1 << j for j in range(gamma_max.bit_length()) if 1 << j < gamma_max}
    if self.skip_below is not None:
      ws.add(0)
    return tuple(sorted(ws | {gamma_max}))

  def start_gamma(self, gamma_max: int) -> int:
    """The schedule's γ_b in the first round."""
    g = gamma_max if self.initial_gamma is None else self.initial_gamma
    if g > gamma_max:
      raise ValueError(f"initial_gamma ({g}) exceeds gamma (γ_max) = {gamma_max}")
    return g


@dataclasses.dataclass(frozen=True)
class AdaptiveLoop(Loop):
  """The adaptive loop's static record (``state.Loop``'s fields and):

  states_wanted: the draft reads the target's decoder states (``commit_with_target``).
  gamma_max: γ_max, the most draft tokens a row proposes in a round.
  lenience: A.5's l (1: exact); config: the ``AdaptiveConfig``.
  widths: the compiled verification widths k (``verify_widths``), sorted."""

  states_wanted: bool
  gamma_max: int
  lenience: float
  config: AdaptiveConfig
  widths: tuple[int, ...]

  @classmethod
  def build(cls, *common: Any, adaptive: AdaptiveConfig, gamma_max: int,
            lenience: float) -> "AdaptiveLoop":
    """The record for ``adaptive`` at γ_max (``common``: ``Loop``'s fields, states_wanted)."""
    if not isinstance(adaptive, AdaptiveConfig):
      raise ValueError(f"adaptive must be an AdaptiveConfig or None, got {adaptive!r}")
    return cls(*common, gamma_max=gamma_max, lenience=lenience, config=adaptive,
               widths=adaptive.verify_widths(gamma_max))

  def first_gamma_row(self, batch: int) -> Array | None:
    """The 'schedule' rule's γ_b [B] for the first round; None for the others."""
    if self.config.rule != "schedule":
      return None
    return jnp.full((batch,), self.config.start_gamma(self.gamma_max), jnp.int32)

  def propose(self, draft: ApproximationModel, s: SpecState, key: Array) -> Proposal:
    """Algorithm 1's first loop with a count per row c_b <= its limit (0 if done)."""
    adaptive = self.config
    limit = jnp.where(~s.done, self.gamma_max if s.gamma_row is None else s.gamma_row, 0)
    threshold = adaptive.threshold if adaptive.rule in CONFIDENCE_RULES else 0.0
    xs, q, proposed, steps, draft_state = adaptive_proposal(
        draft, s.draft_state, s.seq, s.length, self.gamma_max, self.sampling, key, limit,
        threshold, adaptive.skip_below, adaptive.rule == "cumulative",
        adaptive.confidence == "drawn")
    proposed = jnp.clip(proposed, 0, limit)  # done rows: 0; never past the row's limit
    return Proposal(xs, q, proposed, steps, draft_state)

  def verify(self, params: Any, seq: Array, n: Array, p: Proposal, cache: Any,
             key: Array) -> Verdict:
    """ONE target pass at the narrowest compiled width covering every live row's
    count, then Algorithm 1 with positions past c_b unproposed. Switch branches
    only read the cache (a writing branch copies it all); rows are written after."""
    widths = jnp.asarray(self.widths, jnp.int32)
    branch = jnp.sum(widths < jnp.max(p.proposed))
    if len(self.widths) == 1:
      out, cache, states, _ = self._pass(self.widths[0], True, params, seq, n, p, cache, key)
      return Verdict(out, cache, states, widths[branch])
    branches = [functools.partial(self._rows_pass, k, params) for k in self.widths]
    tested = p._replace(steps=None, draft_state=None)  # the branches read xs, q, proposed
    out, (rows, slots), states = jax.lax.switch(branch, branches, seq, n, tested, cache, key)
    return Verdict(out, self.target.write_rows(cache, rows, slots), states, widths[branch])

  def _pass(self, k: int, write: bool, params: Any, seq: Array, n: Array, p: Proposal,
            cache: Any, key: Array) -> tuple:
    """The pass at width k -> (``KernelOutput`` [B, γ_max], cache or rows, states, positions)."""
    logits, new, hidden, pos = target_pass(self.target, params, seq, n, k, cache, write=write,
                                           hidden=self.states_wanted)
    out = judge(self.sampling, self.lenience, logits, p.xs, p.q, key, p.proposed, self.gamma_max)
    return out, new, pad_states(hidden, pos, self.gamma_max), pos

  def _rows_pass(self, k: int, params: Any, seq: Array, n: Array, p: Proposal, cache: Any,
                 key: Array) -> tuple:
    """A ``lax.switch`` branch: the pass at width k, rows padded to γ_max + 1."""
    out, rows, states, pos = self._pass(k, False, params, seq, n, p, cache, key)
    return out, pad_rows(rows, pos, self.gamma_max + 1), states

  def next_gamma_row(self, gamma_row: Array | None, a: Array, proposed: Array,
                     live: Array) -> Array | None:
    """Hugging Face's schedule: γ_b + 2 after a fully accepted round, else γ_b - 1,
    within [1, γ_max] (None: not the 'schedule' rule)."""
    if gamma_row is None:
      return None
    grown = jnp.where(a >= proposed, jnp.minimum(gamma_row + 2, self.gamma_max),
                      jnp.maximum(gamma_row - 1, 1))
    return jnp.where(live, grown, gamma_row)
