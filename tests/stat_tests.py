"""Goodness-of-fit helper shared by the exactness tests."""

import numpy as np
from scipy import stats


def pooled_chisquare_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
  """Chi-square p-value of observed counts against probabilities.

  Cells with expected count < 5 are pooled into one (the chi-square
  approximation needs it); a count in a zero-probability cell fails outright.
  """
  counts = np.asarray(counts, float)
  expected = np.asarray(probs, float) * counts.sum()
  assert counts[expected == 0].sum() == 0, "an outcome of probability 0 was produced"
  big = expected >= 5
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  keep = exp > 0
  obs, exp = obs[keep], exp[keep]
  return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
