"""The paper's published numbers (Leviathan et al., 2023), transcribed once:
Table 2 (T5 1.1 XXL target on a TPU-v4: walltime improvement and α per task,
draft and temperature, at the paper's γ), Table 4 (A.3: c and Theorem 3.8's
expected improvement) and Table 3's other α rows."""

from __future__ import annotations

import dataclasses
from typing import Optional

from specdec_jax.theory import RoundCost

# The paper's hardware for Tables 2 and 4.
CHIP = "TPU-v4"
# Table 4: c, a T5 1.1 draft's step over T5 1.1 XXL's, on one TPU-v4.
DRAFT_C = {"small": 0.02, "base": 0.04, "large": 0.11}


@dataclasses.dataclass(frozen=True)
class Row:
  """One row of Table 2 with its Table 4 entries."""

  task: str            # 'ende' (WMT EnDe) or 'cnndm' (CNN/DM)
  draft: str           # draft size: 'small', 'base' or 'large'
  temperature: int     # 0 (argmax) or 1
  gamma: int
  alpha: float
  speedup: float       # Table 2's measured walltime improvement (Table 4's EMP)
  expected: float      # Table 4's EXP: Theorem 3.8 at this α, γ and c

  @property
  def c(self) -> float:
    """Table 4's c for the row's draft."""
    return DRAFT_C[self.draft]

  def theorem(self) -> float:
    """Theorem 3.8 at the row's own α, γ and c (v = 1, as the paper assumes)."""
    return RoundCost(self.gamma, self.c).predicted(self.alpha)


TABLE2: tuple[Row, ...] = (
    Row("ende", "small", 0, 7, 0.75, 3.4, 3.2),
    Row("ende", "base", 0, 7, 0.80, 2.8, 3.3),
    Row("ende", "large", 0, 7, 0.82, 1.7, 2.5),
    Row("ende", "small", 1, 7, 0.62, 2.6, 2.3),
    Row("ende", "base", 1, 5, 0.68, 2.4, 2.4),
    Row("ende", "large", 1, 3, 0.71, 1.4, 2.0),
    Row("cnndm", "small", 0, 5, 0.65, 3.1, 2.4),
    Row("cnndm", "base", 0, 5, 0.73, 3.0, 2.6),
    Row("cnndm", "large", 0, 3, 0.74, 2.2, 2.0),
    Row("cnndm", "small", 1, 5, 0.53, 2.3, 1.9),
    Row("cnndm", "base", 1, 3, 0.55, 2.2, 1.8),
    Row("cnndm", "large", 1, 3, 0.56, 1.7, 1.6),
)

# Table 3's rows that are not Table 2's: (target, task, draft, temperature, α).
TABLE3_OTHER: tuple[tuple[str, str, str, int, float], ...] = (
    ("GPT-like (97M)", "lm1b", "unigram", 0, 0.03),
    ("GPT-like (97M)", "lm1b", "bigram", 0, 0.05),
    ("GPT-like (97M)", "lm1b", "gpt-like-6m", 0, 0.88),
    ("GPT-like (97M)", "lm1b", "unigram", 1, 0.03),
    ("GPT-like (97M)", "lm1b", "bigram", 1, 0.05),
    ("GPT-like (97M)", "lm1b", "gpt-like-6m", 1, 0.89),
    ("T5-XXL", "ende", "unigram", 0, 0.08),
    ("T5-XXL", "ende", "bigram", 0, 0.20),
    ("T5-XXL", "ende", "unigram", 1, 0.07),
    ("T5-XXL", "ende", "bigram", 1, 0.19),
    ("T5-XXL", "cnndm", "unigram", 0, 0.13),
    ("T5-XXL", "cnndm", "bigram", 0, 0.23),
    ("T5-XXL", "cnndm", "unigram", 1, 0.08),
    ("T5-XXL", "cnndm", "bigram", 1, 0.16),
    ("LaMDA (137B)", "dialog", "lamda-100m", 0, 0.61),
    ("LaMDA (137B)", "dialog", "lamda-2b", 0, 0.71),
    ("LaMDA (137B)", "dialog", "lamda-8b", 0, 0.75),
    ("LaMDA (137B)", "dialog", "lamda-100m", 1, 0.57),
    ("LaMDA (137B)", "dialog", "lamda-2b", 1, 0.71),
    ("LaMDA (137B)", "dialog", "lamda-8b", 1, 0.74),
)


def table2_row(task: str, draft: str, temperature: int) -> Optional[Row]:
  """Table 2's row for (task, draft size, temperature), or None."""
  return next((r for r in TABLE2 if (r.task, r.draft, r.temperature) ==
               (task, draft, temperature)), None)
