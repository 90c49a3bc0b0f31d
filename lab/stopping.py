"""Draft-length rules replayed offline (paper §3.5: γ chosen per round rather
than fixed, in Algorithm 1's rounds).

``simulate_stopping`` walks the target's greedy outputs with the draft's
confidences and verdicts at every position (``probes.along_outputs``) and
prices each round with measured ms per round of its width
(``replay.adaptive_replay``'s constant-width rows), so that stopping rules
(fixed γ, thresholds on the draft's confidence, a perfect acceptance
predictor) are compared without running them. Only numpy is used."""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

import numpy as np


class StoppingResult(NamedTuple):
  """``simulate_stopping``'s result over all examples: ms per committed token,
  committed tokens per round and proposals (width) per round."""

  ms_per_token: float
  tokens_per_round: float
  mean_width: float


def simulate_stopping(confidence: list, accepted: list, round_ms: Mapping[int, float],
                      rule: str, gamma_max: int, threshold: float = 0.0,
                      skip_below: Optional[float] = None) -> StoppingResult:
  """A draft-length rule's walltime at temperature 0, replayed offline.

  At T = 0 every position the target evaluates has the target's greedy
  output as its prefix, so one teacher-forced pass of the draft along that
  output gives, per position t, the draft's confidence (its top probability)
  and whether its argmax equals the target's token (``confidence``,
  ``accepted``: one array per example). Rounds then follow Algorithm 1 with
  per-round γ (§3.5 "beyond fixed γ"): from committed length n the draft
  proposes positions n, n+1, ... and stops after x_i by ``rule``; the round
  commits its accepted run plus one token and costs ``round_ms[width]``
  (measured ms of a round of that width, e.g. ``replay.adaptive_replay``'s
  constant-width rows).

  rule: 'fixed' (γ_max every round), 'threshold' (continue while x_i's
  confidence > threshold), 'cumulative' (while the product of the round's
  confidences > threshold), 'oracle' (width = the accepted run, at least 1:
  what a perfect acceptance predictor would choose; an upper bound for any
  rule; it skips, width 0, where the first proposal would be rejected, if
  ``round_ms`` has a cost for width 0). ``skip_below`` (threshold rules): a
  round whose first confidence is <= it proposes nothing, commits the
  target's one token and costs ``round_ms[0]`` (``AdaptiveConfig.skip_below``).
  Approximation: a position after the round's first rejection gets
  the target path's confidence, not the draft's own; it changes only where a
  rule stops after a rejection (the width, i.e. the cost), never the tokens.
  """
  if rule not in ("fixed", "threshold", "cumulative", "oracle"):
    raise ValueError(f"unknown stopping rule {rule!r}")
  if gamma_max < 1:
    raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
  if skip_below is not None and rule not in ("threshold", "cumulative"):
    raise ValueError(f"skip_below applies to the threshold rules, not {rule!r}")
  missing = [w for w in range(0 if skip_below is not None else 1, gamma_max + 1)
             if w not in round_ms]
  if missing:
    raise ValueError(f"round_ms has no cost for widths {missing}")
  ms = tokens = rounds = width_sum = 0.0
  for conf, ok in zip(confidence, accepted):
    conf, ok = np.asarray(conf, float), np.asarray(ok, bool)
    if conf.shape != ok.shape:
      raise ValueError(f"confidence {conf.shape} and accepted {ok.shape} differ in shape")
    n, end = 0, len(ok)
    while n < end:
      room = min(gamma_max, end - n)
      run = 0
      while run < room and ok[n + run]:
        run += 1
      if rule == "oracle":
        w = run if (run or 0 in round_ms) else 1
      elif rule == "fixed":
        w = room
      elif skip_below is not None and conf[n] <= skip_below:
        w = 0
      else:
        w, running = 1, 1.0
        while w < room:
          c = conf[n + w - 1]
          running = running * c if rule == "cumulative" else c
          if running <= threshold:
            break
          w += 1
      a = min(run, w)
      n += a + 1
      tokens += a + 1
      rounds += 1
      width_sum += w
      ms += round_ms[w]
  if not tokens:
    raise ValueError("no positions to simulate")
  return StoppingResult(ms / tokens, tokens / rounds, width_sum / rounds)
