"""Section 3's closed forms that only the studies, the notebook and the tests use
(Leviathan et al., 2023); the engine's own ones live in ``specdec_jax.theory``."""

from __future__ import annotations

from typing import Mapping, Optional, Union

import numpy as np

from specdec_jax import theory
from specdec_jax.theory import TIE_RTOL, ArrayLike, to_output

DEFAULT_MAX_GAMMA = 64


def operations_factor(alpha: ArrayLike, gamma: ArrayLike, c_hat: ArrayLike) -> ArrayLike:
  """Theorem 3.11: (1 - alpha)(gamma c_hat + gamma + 1) / (1 - alpha^(gamma+1))."""
  tokens = np.asarray(theory.expected_tokens(alpha, gamma))
  theory.walltime_improvement(alpha, gamma, c_hat)  # c_hat >= 0, like c
  g = np.asarray(gamma, dtype=float)
  return to_output((g * np.asarray(c_hat, dtype=float) + g + 1.0) / tokens)


def improvement_exists(alpha: ArrayLike, c: ArrayLike) -> Union[bool, np.ndarray]:
  """Corollary 3.9: some gamma improves walltime iff alpha > c (v = 1)."""
  theory.walltime_improvement(alpha, 1, c)  # alpha in [0, 1], c >= 0
  return to_output(np.asarray(alpha, dtype=float) > np.asarray(c, dtype=float))


def min_improvement(alpha: ArrayLike, c: ArrayLike) -> ArrayLike:
  """Corollary 3.9's bound (1 + alpha) / (1 + c); 1.0 where alpha <= c."""
  a, c_arr = np.asarray(alpha, dtype=float), np.asarray(c, dtype=float)
  return to_output(np.where(improvement_exists(alpha, c), (1.0 + a) / (1.0 + c_arr), 1.0))


def optimal_gamma(alpha: ArrayLike, c: ArrayLike, v: ArrayLike = 1.0,
                  max_gamma: int = DEFAULT_MAX_GAMMA) -> Union[int, np.ndarray]:
  """Integer gamma in [1, max_gamma] maximizing walltime_improvement (§3.5, Fig. 3).

  0 where none beats standard decoding. Ties within ``TIE_RTOL`` go to the
  smallest gamma (fewer wasted operations, Theorem 3.11; stable on flat curves)."""
  if int(max_gamma) < 1:
    raise ValueError(f"max_gamma must be >= 1, got {max_gamma!r}")
  theory.walltime_improvement(alpha, 1, c, v)  # alpha in [0, 1], c >= 0, v > 0
  a, c_arr, v_arr = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (alpha, c, v)))
  gammas = np.arange(1, int(max_gamma) + 1, dtype=float)
  # Candidate gammas on a trailing axis so any input shape broadcasts.
  g = gammas.reshape((1,) * a.ndim + (-1,))
  speedups = np.asarray(
      theory.walltime_improvement(a[..., None], g, c_arr[..., None], v_arr[..., None]))
  best_speedup = np.max(speedups, axis=-1)
  near_best = speedups >= best_speedup[..., None] * (1.0 - TIE_RTOL)
  best = np.argmax(near_best, axis=-1)  # first True -> smallest gamma
  helps = best_speedup > 1.0 + TIE_RTOL
  return to_output(np.where(helps, gammas[best].astype(int), 0))


def best_gamma_measured(alpha: float, c: Mapping[int, float], v: Mapping[int, float],
                        alpha_se: float = 0.0, c_se: Optional[Mapping[int, float]] = None,
                        v_se: Optional[Mapping[int, float]] = None) -> tuple[int, dict[int, float]]:
  """γ maximizing the v-generalized Theorem 3.8 over measured per-γ c[γ], v[γ]
  (§3.5). -> (γ, {γ: prediction}); never 0; ties go to the smaller γ. With
  standard errors, the smallest γ within one standard error of the argmax."""
  choice = theory.gamma_curve(alpha, c, v, alpha_se, c_se, v_se)
  return choice.gamma, choice.curve
