"""Where a run's speedup goes between Theorem 3.8 (with v) and the clock, each
step replacing one assumption by what the run measured:

  EXP (with v)      Eq. (1) tokens per round over γ c + v, c and v timed apart.
  x interplay       the round's two models timed alternating.
  x tokens/call     the measured tokens per target call instead of Eq. (1)'s.
  + prefill         each example's encoders and caches.

SPEED over the last prediction is what the model does not explain."""

from __future__ import annotations

import functools
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from specdec_jax.decoding import cache_length
from specdec_jax.drafts.base import ApproximationModel
from specdec_jax.models.t5 import T5Model
from specdec_jax.theory import RoundCost
from specdec_jax.timing import baseline_prefill, interleaved_medians_ms, speculative_prefill

Array = jax.Array


def prefill_ms(target: T5Model, params: Any, draft: ApproximationModel,
               inputs: Mapping[int, Array], max_decode_len: int, gamma: int,
               repeats: int = 15) -> dict[int, tuple[float, float]]:
  """{width: (baseline ms, speculative ms)} of the prefill, one batch per
  padded width; interleaved medians over ``repeats``, at the loops' cache lengths."""
  fns = {}
  for w, x in inputs.items():
    fns[(w, 0)] = functools.partial(baseline_prefill, target, params, x, max_decode_len)
    fns[(w, 1)] = functools.partial(speculative_prefill, target, params, draft, x,
                                    cache_length(max_decode_len, gamma))
  med = interleaved_medians_ms(fns, repeats)
  return {w: (med[(w, 0)], med[(w, 1)]) for w in inputs}


def prefill_of(records: Sequence[Mapping[str, Any]]) -> dict[int, tuple[float, float]]:
  """The lines' prefill times, {width: (baseline ms, speculative ms)}, medians."""
  by_width: dict[int, list[tuple[float, float]]] = {}
  for r in records:
    by_width.setdefault(int(r["input_width"]), []).append(
        (r["prefill_baseline_ms"], r["prefill_speculative_ms"]))
  return {w: (float(np.median([b for b, _ in v])), float(np.median([s for _, s in v])))
          for w, v in by_width.items()}


class Attribution(NamedTuple):
  gamma: int
  alpha: float
  tokens_per_call_theory: float     # Eq. (1) at the run's α
  tokens_per_call: float            # measured: Σ tokens / Σ target calls
  prefill_baseline_ms: float        # mean per example
  prefill_speculative_ms: float
  expected_v: float                 # Theorem 3.8 with c, v timed apart
  expected_in_context: float        # x interplay
  expected_measured_tau: float      # x measured tokens per call / Eq. (1)'s
  expected_whole_run: float         # + prefill: whole examples
  speed: float                      # measured
  baseline_vs_model: float          # measured baseline walltime / its model
  speculative_vs_model: float       # measured speculative walltime / its model

  @property
  def unexplained(self) -> float:
    """SPEED over the whole-run prediction."""
    return self.speed / self.expected_whole_run


def attribute(records: Sequence[Mapping[str, Any]], prefill: Mapping[int, tuple[float, float]],
              widths: Sequence[int]) -> Attribution:
  """The account for a fixed-γ batch-1 run's records; ``widths[i]``: record
  i's padded input width."""
  if not records:
    raise ValueError("no records to attribute")
  if len(widths) != len(records):
    raise ValueError(f"{len(widths)} widths for {len(records)} records")
  for key in ("gamma", "c", "v", "interplay", "target_step_ms", "baseline_s", "speculative_s",
              "baseline_tokens", "tokens", "target_calls", "accepted", "rejected"):
    if any(key not in r for r in records):
      raise ValueError(f"records lack {key!r}: a speculative run's examples.jsonl is needed")
  if any(r.get("batch_size", 1) != 1 for r in records):
    raise ValueError("attribute models batch-1 runs; these records have batch_size > 1")
  gammas = {int(r["gamma"]) for r in records}
  hists = [r.get("gamma_hist") for r in records]
  if len(gammas) != 1 or any(h and any(h[:-1]) for h in hists):
    raise ValueError("attribute models a fixed-γ run; these records have per-round γ "
                     f"(gammas {sorted(gammas)} or an adaptive gamma_hist)")
  gamma = gammas.pop()
  missing = sorted({int(w) for w in widths} - set(prefill))
  if missing:
    raise ValueError(f"no prefill time for input widths {missing}")
  # The run's round cost is one measurement, written on every record.
  cost = RoundCost.from_record({k: float(np.median([r[k] for r in records]))
                                for k in ("c", "v", "interplay", "target_step_ms")}, gamma)
  # α as the runner's summary counts it (accepted over accepted + rejected).
  accepted = sum(r["accepted"] for r in records)
  alpha = min(accepted / max(accepted + sum(r["rejected"] for r in records), 1), 1.0)
  tokens = np.array([r["tokens"] for r in records], float)
  base_tokens = np.array([r["baseline_tokens"] for r in records], float)
  calls = np.array([r["target_calls"] for r in records], float)
  tau_theory = cost.expected_tokens(alpha)
  tau = float(tokens.sum() / max(calls.sum(), 1.0))
  exp_v = float(cost.speedup(tau_theory))
  exp_ctx = float(cost.speedup(tau_theory, in_context=True))
  exp_tau = exp_ctx * tau / tau_theory
  s = cost.step_ms
  round_ms = float(cost.steps(in_context=True)) * s
  pb = np.array([prefill[int(w)][0] for w in widths])
  ps = np.array([prefill[int(w)][1] for w in widths])
  model_base = pb + base_tokens * s
  model_spec = ps + calls * round_ms
  base_ms = 1e3 * np.array([r["baseline_s"] for r in records])
  spec_ms = 1e3 * np.array([r["speculative_s"] for r in records])
  return Attribution(
      gamma=gamma, alpha=alpha, tokens_per_call_theory=tau_theory, tokens_per_call=tau,
      prefill_baseline_ms=float(pb.mean()), prefill_speculative_ms=float(ps.mean()),
      expected_v=exp_v, expected_in_context=exp_ctx, expected_measured_tau=exp_tau,
      expected_whole_run=float(model_base.sum() / model_spec.sum()),
      speed=float(base_ms.sum() / spec_ms.sum()),
      baseline_vs_model=float(base_ms.sum() / model_base.sum()),
      speculative_vs_model=float(spec_ms.sum() / model_spec.sum()))
