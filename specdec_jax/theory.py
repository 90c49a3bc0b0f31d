"""Closed-form analysis of speculative decoding (Leviathan et al., 2023, Section 3).

Functions take floats or numpy arrays (broadcast) and return a scalar for
scalar inputs. ``alpha`` is E(beta) (Definition 3.1), ``gamma`` the draft
tokens per iteration, ``c`` the cost coefficient (Definition 3.7), ``c_hat``
the operations ratio (Definition 3.10); betas are assumed i.i.d. numpy only."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np

ArrayLike = Union[float, int, np.ndarray]

# Within this distance of alpha = 1 Eq. (1) is 0/0: its limit gamma + 1 is used.
_ALPHA_ONE_ATOL = 1e-9

# Relative difference below which two walltime improvements tie (gamma_curve,
# lab.theory.optimal_gamma).
TIE_RTOL = 1e-12


def to_output(x: np.ndarray) -> ArrayLike:
  """A python scalar for 0-d results (scalar callers get floats/bools), else the array."""
  x = np.asarray(x)
  return x.item() if x.ndim == 0 else x


def _check_alpha(alpha: ArrayLike) -> np.ndarray:
  a = np.asarray(alpha, dtype=float)
  if np.any((a < 0.0) | (a > 1.0)) or np.any(np.isnan(a)):
    raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
  return a


def _check_nonneg(name: str, x: ArrayLike) -> np.ndarray:
  arr = np.asarray(x, dtype=float)
  if np.any(arr < 0.0) or np.any(np.isnan(arr)):
    raise ValueError(f"{name} must be >= 0, got {x!r}")
  return arr


def _expected_tokens(a: np.ndarray, g: np.ndarray) -> np.ndarray:
  """Eq. (1) on validated float arrays (no scalar conversion)."""
  near_one = np.abs(1.0 - a) < _ALPHA_ONE_ATOL
  safe_a = np.where(near_one, 0.5, a)  # keeps the unused branch finite
  closed_form = (1.0 - safe_a ** (g + 1.0)) / (1.0 - safe_a)
  return np.where(near_one, g + 1.0, closed_form)


def expected_tokens(alpha: ArrayLike, gamma: ArrayLike) -> ArrayLike:
  """Eq. (1): (1 - alpha^(gamma+1)) / (1 - alpha), gamma + 1 at alpha = 1."""
  a = _check_alpha(alpha)
  g = _check_nonneg("gamma", gamma)
  return to_output(_expected_tokens(a, g))


def expected_tokens_by_position(alphas: Sequence[float]) -> float:
  """1 + Σ_i Π_{j ≤ i} α_j: Eq. (1) when α_i falls with the position i."""
  a = np.array([0.0 if x is None else x for x in alphas], np.float64)
  a = np.clip(np.nan_to_num(a), 0.0, 1.0)
  return float(1.0 + np.sum(np.cumprod(a)))


def walltime_improvement(alpha: ArrayLike, gamma: ArrayLike, c: ArrayLike,
                         v: ArrayLike = 1.0) -> ArrayLike:
  """Theorem 3.8 with a verification cost ``v`` in target steps (v = 1: the
  theorem): (1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + v))."""
  a = _check_alpha(alpha)
  g = _check_nonneg("gamma", gamma)
  c_arr = _check_nonneg("c", c)
  v_arr = np.asarray(v, dtype=float)
  if np.any(v_arr <= 0.0):
    raise ValueError(f"v must be > 0, got {v!r}")
  return to_output(RoundCost(g, c_arr, v_arr).speedup(_expected_tokens(a, g)))


@dataclasses.dataclass(frozen=True)
class RoundCost:
  """THE cost of one round and Theorem 3.8's prediction from it (§3.3-3.4): draft_calls
  draft calls and one pass over γ + 1 positions, draft_calls c + v target steps.
  Measured by ``timing``, modelled by ``dryrun.costs.Roofline``, kept by ``record()``.

  gamma: proposals the target scores per round (a tree: its N - 1 nodes).
  c: one draft call over one target step (Definition 3.7).
  v: the target's pass over ``positions`` over one target step (paper: 1).
  draft_calls: draft calls per round (None: ``gamma``; a tree: its depth).
  step_ms: one target step in ms (nan where only ratios are known).
  interplay: the round timed whole over γ c + v timed apart (1: not measured).
  c_se, v_se, round_se: standard errors (0 where not measured)."""

  gamma: Any
  c: Any
  v: Any = 1.0
  draft_calls: Any = None
  step_ms: float = math.nan
  interplay: float = 1.0
  c_se: float = 0.0
  v_se: float = 0.0
  round_se: float = 0.0

  # The record's keys in examples.jsonl and summary.json (``record``).
  RECORD_KEYS = ("c", "v", "target_step_ms", "verify_ms", "draft_token_ms", "interplay")

  def __post_init__(self):
    if self.draft_calls is None:
      object.__setattr__(self, "draft_calls", self.gamma)

  @classmethod
  def for_tree(cls, tree: Any, c: float, v: float = 1.0, **kw: Any) -> "RoundCost":
    """A token tree's round: one draft call per depth, one pass over its N nodes."""
    return cls(tree.num_nodes - 1, c, v, draft_calls=tree.max_depth, **kw)

  @property
  def positions(self) -> int:
    """Positions the target scores per round: γ + 1."""
    return self.gamma + 1

  def steps(self, with_v: bool = True, in_context: bool = False) -> Any:
    """Cost in target steps: draft_calls c + v (1 without ``with_v``), x interplay."""
    cost = self.draft_calls * self.c + (self.v if with_v else 1.0)
    return cost * self.interplay if in_context else cost

  def speedup(self, tokens: Any, with_v: bool = True, in_context: bool = False) -> Any:
    """Tokens per round over the round's cost (with Eq. (1)'s tokens: Theorem 3.8)."""
    return tokens / self.steps(with_v, in_context)

  def expected_tokens(self, alpha: float) -> float:
    """Eq. (1) at this round's γ and acceptance rate α."""
    return float(expected_tokens(alpha, self.gamma))

  def predicted(self, alpha: float, with_v: bool = True, in_context: bool = False) -> float:
    """Theorem 3.8 at α for a chain of γ (arguments as ``steps``)."""
    return float(self.speedup(self.expected_tokens(min(alpha, 1.0)), with_v, in_context))

  def ms_per_token(self, tokens: float) -> float:
    """Milliseconds per token at ``tokens`` per round."""
    return self.step_ms * float(self.steps()) / tokens

  @property
  def c_in_context(self) -> float:
    """c with the round's interplay: γ c' + v' is the round timed whole."""
    return self.c * self.interplay

  @property
  def v_in_context(self) -> float:
    return self.v * self.interplay

  def record(self) -> dict[str, float]:
    """The JSON form examples.jsonl and summary.json carry (``RECORD_KEYS``)."""
    return {"c": float(self.c), "v": float(self.v), "target_step_ms": float(self.step_ms),
            "verify_ms": float(self.v * self.step_ms),
            "draft_token_ms": float(self.c * self.step_ms),
            "interplay": float(self.interplay)}

  @classmethod
  def from_record(cls, record: Mapping[str, float], gamma: int,
                  draft_calls: Optional[int] = None) -> "RoundCost":
    """``record()``'s form back, for a round of ``gamma`` proposals."""
    return cls(gamma, record["c"], record["v"], draft_calls,
               step_ms=record.get("target_step_ms", math.nan),
               interplay=record.get("interplay", 1.0))


class GammaCurve(NamedTuple):
  """``gamma_curve``'s choice, argmax, prediction per γ and each γ's gap's standard error."""

  gamma: int
  argmax: int
  curve: dict[int, float]
  gap_se: dict[int, float]


def gamma_curve(alpha: float, c: Mapping[int, float], v: Mapping[int, float],
                alpha_se: float = 0.0, c_se: Optional[Mapping[int, float]] = None,
                v_se: Optional[Mapping[int, float]] = None) -> GammaCurve:
  """γ maximizing the v-generalized Theorem 3.8 over measured per-γ c[γ], v[γ] (§3.5):
  never 0, ties to the smaller γ; with standard errors, the smallest γ within one
  standard error of the argmax (``prediction_gap_se``)."""
  if not c or set(c) != set(v):
    raise ValueError(f"c and v must be measured for the same gammas, got {sorted(c)} and "
                     f"{sorted(v)}")
  if min(c) < 1:
    raise ValueError(f"gammas must be >= 1, got {sorted(c)}")
  if not alpha_se >= 0.0:
    raise ValueError(f"alpha_se must be >= 0, got {alpha_se!r}")
  a = min(float(_check_alpha(alpha)), 1.0 - 1e-12)  # α = 1: the limit, not 0/0
  curve = {g: float(walltime_improvement(a, g, c[g], v[g])) for g in sorted(c)}
  best = max(curve.values())
  argmax = min(g for g, s in curve.items() if s >= best * (1.0 - TIE_RTOL))
  gap_se = prediction_gap_se(a, c, v, argmax, alpha_se, c_se, v_se)
  gamma = min(g for g in curve if curve[argmax] - curve[g] <= gap_se[g])
  return GammaCurve(gamma, argmax, curve, gap_se)


def prediction_gap_se(alpha: float, c: Mapping[int, float], v: Mapping[int, float], best: int,
                      alpha_se: float = 0.0, c_se: Optional[Mapping[int, float]] = None,
                      v_se: Optional[Mapping[int, float]] = None) -> dict[int, float]:
  """Standard error of S(best) - S(γ) per γ by first-order propagation (α shared,
  c and v independent per γ); zero without standard errors."""
  c_se, v_se = c_se or {}, v_se or {}
  out = {}
  for g in sorted(c):
    if g == best:
      out[g] = 0.0
      continue
    var = (((_dS_dalpha(alpha, best, c[best], v[best]) - _dS_dalpha(alpha, g, c[g], v[g]))
            * alpha_se) ** 2
           + _timing_var(alpha, best, c[best], v[best], c_se.get(best, 0.0), v_se.get(best, 0.0))
           + _timing_var(alpha, g, c[g], v[g], c_se.get(g, 0.0), v_se.get(g, 0.0)))
    out[g] = float(np.sqrt(var))
  return out


def improvement_se(alpha: float, gamma: int, c: float, v: float, alpha_se: float = 0.0,
                   c_se: float = 0.0, v_se: float = 0.0) -> float:
  """Standard error of S = (1 - α^(γ+1)) / ((1 - α)(γ c + v)), first order."""
  a = min(float(_check_alpha(alpha)), 1.0 - 1e-12)
  var = (_dS_dalpha(a, gamma, c, v) * alpha_se) ** 2 + _timing_var(a, gamma, c, v, c_se, v_se)
  return float(np.sqrt(var))


def _dS_dalpha(alpha: float, gamma: int, c: float, v: float, h: float = 1e-5) -> float:
  """∂S/∂α of ``walltime_improvement`` by a central difference inside [0, 1)."""
  lo, hi = max(alpha - h, 0.0), min(alpha + h, 1.0 - 1e-12)
  return (walltime_improvement(hi, gamma, c, v) - walltime_improvement(lo, gamma, c, v)) / (hi - lo)


def _timing_var(alpha: float, gamma: int, c: float, v: float, c_se: float, v_se: float) -> float:
  """S's variance from c and v: ∂S/∂c = -S γ / (γ c + v), ∂S/∂v = -S / (γ c + v)."""
  denom = gamma * c + v
  s = walltime_improvement(alpha, gamma, c, v)
  return (s * gamma / denom * c_se) ** 2 + (s / denom * v_se) ** 2
