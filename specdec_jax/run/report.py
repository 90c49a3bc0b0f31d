"""A run's results: ``summary.json`` recomputed from the examples' lines,
and the paper's Table 2 (§4.1) and Table 3 (§4.2) rows printed from it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from specdec_jax import theory
from specdec_jax.decoding import CONFIDENCE_RULES
from specdec_jax.run import account
from specdec_jax.run.settings import Experiment

COST_KEYS = ("c", "v", "target_step_ms", "verify_ms", "draft_token_ms", "interplay")


def summarize(exp: Experiment, records: list[dict]) -> dict:
  """Aggregates examples.jsonl lines into summary.json.

  Each line carries the cost measurement of its process (c, v, step times), so
  a resumed run's summary uses the median over all lines: every number here
  can be recomputed from examples.jsonl alone.
  """
  tot = lambda k: float(sum(r[k] for r in records))
  # (Lines written before 'interplay' was measured count as 1: no interplay.)
  costs = {k: float(np.median([r.get(k, 1.0 if k == "interplay" else None) for r in records]))
           if records else float("nan") for k in COST_KEYS}
  evaluated = tot("accepted") + tot("rejected")
  alpha = tot("accepted") / evaluated if evaluated else float("nan")
  alpha_min_pq = tot("min_pq_sum") / evaluated if evaluated else float("nan")
  target_label, draft_label = exp.labels
  if exp.gamma == "auto" and records:  # the γ the run chose (recorded on every line)
    exp = dataclasses.replace(exp, gamma=records[0]["gamma"])
  base_s = tot("baseline_s")
  spec_s = tot("speculative_s")
  summary = {
      "mode": "speculative", "task": exp.task, "target": target_label, "draft": draft_label,
      "temperature": exp.temperature, "topk": exp.topk, "topp": exp.topp,
      "gamma": exp.gamma, "lenience": exp.lenience, "batch_size": exp.batch_size,
      "mesh_shape": list(exp.mesh_shape) if exp.mesh_shape else None,
      "param_dtype": exp.param_dtype, "dtype": exp.dtype,
      "draft_shortlist": exp.draft_shortlist or None,
      "alpha": alpha, "alpha_min_pq": alpha_min_pq,
      "tokens_per_target_call": tot("tokens") / max(tot("target_calls"), 1),
      "c": costs["c"], "v": costs["v"],
      "target_step_ms": costs["target_step_ms"], "verify_ms": costs["verify_ms"],
      "draft_token_ms": costs["draft_token_ms"], "interplay": costs["interplay"],
      "baseline_ms_per_token": 1e3 * base_s / max(tot("baseline_tokens"), 1),
      "speculative_ms_per_token": 1e3 * spec_s / max(tot("tokens"), 1),
      "baseline_s": base_s, "speculative_s": spec_s,
      "speedup": base_s / spec_s if spec_s else float("nan"),
      "num_examples": len(records),
      "mismatches_vs_baseline": (int(sum(not r["matches_baseline"] for r in records))
                                 if exp.temperature == 0 else None),
  }
  if records and "gamma_auto" in records[0]:
    summary["gamma_auto"] = records[0]["gamma_auto"]
  if exp.adaptive is not None:
    hist = np.sum([r["gamma_hist"] for r in records], 0) if records else np.zeros(1)
    summary["adaptive"] = exp.adaptive
    summary["adaptive_threshold"] = (exp.adaptive_threshold if exp.adaptive in CONFIDENCE_RULES
                                     else None)
    summary["adaptive_skip_below"] = exp.adaptive_skip_below
    summary["adaptive_confidence"] = exp.adaptive_confidence
    summary["gamma_hist"] = hist.tolist()       # rounds that proposed j tokens, at j
    summary["mean_gamma"] = float(np.dot(np.arange(len(hist)), hist) / max(hist.sum(), 1))
    summary["gamma_label"] = (f"≤{exp.gamma} {exp.adaptive}"
                              + (f" {exp.adaptive_threshold:g}"
                                 if exp.adaptive in CONFIDENCE_RULES else "")
                              + (f" skip {exp.adaptive_skip_below:g}"
                                 if exp.adaptive_skip_below is not None else "")
                              + (" drawn" if exp.adaptive_confidence == "drawn" else ""))
  # Theorem 3.8 is for a fixed γ: an adaptive run has no such prediction.
  ok = records and not math.isnan(alpha) and exp.adaptive is None
  summary["expected_speedup"] = (float(theory.walltime_improvement(min(alpha, 1.0), exp.gamma,
                                                                   costs["c"]))
                                 if ok else None)
  summary["expected_speedup_v"] = (float(theory.walltime_improvement(
      min(alpha, 1.0), exp.gamma, costs["c"], costs["v"])) if ok else None)
  # The same with the round's two models timed as they alternate in a round
  # (``timing.Costs.interplay``): what is left between this and SPEED is the
  # engine's own per-round work and the finite length of the outputs.
  f = costs["interplay"]
  summary["expected_speedup_in_context"] = (float(theory.walltime_improvement(
      min(alpha, 1.0), exp.gamma, costs["c"] * f, costs["v"] * f)) if ok else None)
  # Eq. (1)'s tokens per target call at the run's α: the measured count falls
  # short where acceptances are not independent or rounds stop at EOS
  # (``specdec_jax.run.account`` has the whole account).
  summary["tokens_per_target_call_eq1"] = (float(theory.expected_tokens(min(alpha, 1.0),
                                                                        exp.gamma))
                                           if ok else None)
  # ... and with each example's prefill: the whole-run prediction
  # (``specdec_jax.run.account``; batch 1, fixed γ, lines that carry prefill times).
  whole = None
  if ok and exp.batch_size == 1 and all("prefill_speculative_ms" in r for r in records):
    a = account.attribute(records, account.prefill_of(records),
                             [r["input_width"] for r in records])
    whole = a.expected_whole_run
    summary["prefill_baseline_ms"] = a.prefill_baseline_ms
    summary["prefill_speculative_ms"] = a.prefill_speculative_ms
  summary["expected_speedup_whole_run"] = whole
  return summary


def table2_row(s: dict) -> str:
  """The paper's Table 2 layout (TASK, M_q, TEMP, γ, α, SPEED), plus EXP."""
  head = "| TASK | M_q | TEMP | γ | α | SPEED | EXP (Thm 3.8) | EXP (with v) | mismatches |"
  sep = "|---|---|---|---|---|---|---|---|---|"
  fmt = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"
  row = (f"| {s['task']} | {s['draft']} | {s['temperature']:g} | {s['gamma']} | "
         f"{fmt(s['alpha'])} | {fmt(s['speedup'])}X | {fmt(s['expected_speedup'])}X | "
         f"{fmt(s['expected_speedup_v'])}X | "
         f"{'-' if s['mismatches_vs_baseline'] is None else s['mismatches_vs_baseline']} |")
  lines = [head, sep, row]
  if s.get("expected_speedup_in_context") is not None:
    lines.append(f"EXP in context: {fmt(s['expected_speedup_in_context'])}X (draft and target "
                 f"timed alternating as in a round: {fmt(s['interplay'])}x their cost timed "
                 f"apart); SPEED / EXP in context "
                 f"{fmt(s['speedup'] / s['expected_speedup_in_context'])}")
  if s.get("expected_speedup_whole_run") is not None:
    tokens = s["tokens_per_target_call"] / s["tokens_per_target_call_eq1"]
    measured_tau = s["expected_speedup_in_context"] * tokens
    lines.append(
        f"Whole run: EXP (with v) {fmt(s['expected_speedup_v'])}X × interplay "
        f"{fmt(1 / s['interplay'])} × tokens per target call {fmt(tokens)} "
        f"({fmt(s['tokens_per_target_call'])} against Eq. (1)'s "
        f"{fmt(s['tokens_per_target_call_eq1'])}) × prefill "
        f"{fmt(s['expected_speedup_whole_run'] / measured_tau)} "
        f"({fmt(s['prefill_baseline_ms'])} / {fmt(s['prefill_speculative_ms'])} ms per example) "
        f"= {fmt(s['expected_speedup_whole_run'])}X; SPEED / whole run "
        f"{fmt(s['speedup'] / s['expected_speedup_whole_run'])}")
  return "\n".join(lines)


def summarize_alpha(exp: Experiment, records: list[dict], available: int) -> dict:
  """summary.json of an --alpha_only run (recomputable from examples.jsonl)."""
  tokens = sum(r["tokens"] for r in records)
  target_label, draft_label = exp.labels
  return {"mode": "alpha_only", "task": exp.task, "target": target_label,
          "draft": draft_label, "temperature": exp.temperature, "topk": exp.topk,
          "topp": exp.topp, "num_tokens": tokens, "num_examples": len(records),
          "alpha_only_tokens": exp.alpha_only_tokens,
          "budget_reached": tokens >= exp.alpha_only_tokens,
          "examples_available": available,
          "alpha_min_pq": sum(r["min_pq_sum"] for r in records) / max(
              sum(r.get("evaluated", r["tokens"]) for r in records), 1)}


def alpha_row(s: dict) -> str:
  """One Table-3-style line; says so when the examples ran out before the budget."""
  row = (f"| {s['task']} | {s['target']} | {s['draft']} | T={s['temperature']:g} | "
         f"alpha {s['alpha_min_pq']:.3f} | {s['num_tokens']} tokens |")
  if not s.get("budget_reached", True):
    row += (f"\nnote: the examples ran out after {s['num_examples']} examples and "
            f"{s['num_tokens']} tokens, before Experiment.alpha_only_tokens="
            f"{s['alpha_only_tokens']}; raise Experiment.num_examples or use a larger source")
  return row
