"""A run's results: ``summary.json`` recomputed from the examples' lines, the
paper's Table 2 (§4.1) and Table 3 (§4.2) rows, and the closing sentence."""

from __future__ import annotations

import math
import sys

import jax
import numpy as np

from specdec_jax.run import account
from specdec_jax.run.settings import Experiment
from specdec_jax.theory import RoundCost, expected_tokens_by_position


def summarize(exp: Experiment, records: list[dict]) -> dict:
  """summary.json from examples.jsonl's lines alone (costs: their median)."""
  costs = median_costs(records)
  gamma = None if exp.tree else (records[0]["gamma"] if records else exp.gamma)
  summary = {
      **_settings(exp), "gamma": gamma, **_measured(records, chain=not exp.tree), **costs,
      "num_examples": len(records),
      "costs_from": f"median over {len(records)} examples' lines",
      "cost_segments": cost_segments(records),
      "mismatches_vs_baseline": (int(sum(not r["matches_baseline"] for r in records))
                                 if exp.sampling.greedy else None),
  }
  if records and "gamma_auto" in records[0]:
    summary["gamma_auto"] = records[0]["gamma_auto"]
  if gamma == 0:
    summary["gamma_label"] = "0 (plain decoding)"
  if exp.adaptive is not None:
    summary.update(_adaptive(exp, records))
  if exp.tree:
    summary.update(_tree(exp, records))
  # Theorem 3.8 is for a fixed γ ≥ 1 chain: adaptive, tree and plain runs have no prediction.
  fixed = (bool(records) and not math.isnan(summary["alpha"]) and exp.adaptive is None
           and not exp.tree and gamma != 0)
  summary.update(_by_position(records, exp.tree_shape.max_depth if exp.tree else None))
  calls = summary["draft_calls_per_round"]
  round_cost = (RoundCost.from_record(costs, gamma, int(round(calls)) if calls else None)
                if fixed else None)
  summary.update(_predictions(summary["alpha"], round_cost))
  summary["tokens_per_round_by_position"] = None
  summary["expected_speedup_by_position"] = None
  if summary["alpha_by_position"] is not None and (fixed or exp.tree):
    tokens = expected_tokens_by_position(summary["alpha_by_position"])
    summary["tokens_per_round_by_position"] = tokens
    if round_cost is not None:
      summary["expected_speedup_by_position"] = float(round_cost.speedup(tokens))
  whole = None
  if fixed and exp.batch_size == 1 and all("prefill_speculative_ms" in r for r in records):
    # ... and with each example's prefill: the whole-run prediction (``account``).
    a = account.attribute(records, account.prefill_of(records), [r["input_width"] for r in records])
    whole = a.expected_whole_run
    summary["prefill_baseline_ms"] = a.prefill_baseline_ms
    summary["prefill_speculative_ms"] = a.prefill_speculative_ms
  summary["expected_speedup_whole_run"] = whole
  return summary


def median_costs(records: list[dict]) -> dict[str, float]:
  """The lines' cost measurements, median over lines (no 'interplay': 1)."""
  return {k: float(np.median([r.get(k, 1.0 if k == "interplay" else None) for r in records]))
          if records else float("nan") for k in RoundCost.RECORD_KEYS}


def _settings(exp: Experiment) -> dict:
  """What the run was configured to do (γ aside: the lines record it)."""
  return {**_labels(exp, "speculative"), "lenience": exp.lenience,
          "batch_size": exp.batch_size,
          "mesh_shape": list(exp.mesh_shape) if exp.mesh_shape else None,
          "param_dtype": exp.param_dtype, "dtype": exp.dtype,
          "draft_shortlist": exp.draft_shortlist or None}


def _measured(records: list[dict], chain: bool) -> dict:
  """α two ways (§3.1, Corollary 3.6; Σ min(p, q) for chains only), tokens
  per target call and the walltimes."""
  tot = lambda k: float(sum(r[k] for r in records))
  evaluated = tot("accepted") + tot("rejected")
  alpha = tot("accepted") / evaluated if evaluated else float("nan")
  with_sums = chain and bool(records) and all("min_pq_sum" in r for r in records)
  alpha_min_pq = (tot("min_pq_sum") / evaluated if evaluated else float("nan")) if with_sums \
      else None
  base_s, spec_s = tot("baseline_s"), tot("speculative_s")
  return {"alpha": alpha, "alpha_min_pq": alpha_min_pq,
          "tokens_per_target_call": tot("tokens") / max(tot("target_calls"), 1),
          "baseline_ms_per_token": 1e3 * base_s / max(tot("baseline_tokens"), 1),
          "speculative_ms_per_token": 1e3 * spec_s / max(tot("tokens"), 1),
          "baseline_s": base_s, "speculative_s": spec_s,
          "speedup": base_s / spec_s if spec_s else float("nan")}


def _by_position(records: list[dict], tree_depth: int | None) -> dict:
  """α_i = P(proposal i accepted | 1..i−1 accepted) for i = 1..γ (a tree: by
  depth), and the draft calls per round."""
  tot = lambda k: float(sum(r.get(k, 0) for r in records))
  calls = tot("draft_calls") / tot("target_calls") if tot("target_calls") else None
  alphas = None
  if records and tree_depth is not None and all("depth_hist" in r for r in records):
    hist = np.sum([r["depth_hist"] for r in records], 0).astype(float)
    reached = np.cumsum(hist[::-1])[::-1]              # rounds that accepted >= d levels
    alphas = [float(reached[d] / reached[d - 1]) if reached[d - 1] else None
              for d in range(1, len(hist))]
  elif records and all("accepted_at" in r for r in records):
    acc = np.sum([r["accepted_at"] for r in records], 0).astype(float)
    ev = np.sum([r["evaluated_at"] for r in records], 0).astype(float)
    alphas = [float(a / e) if e else None for a, e in zip(acc, ev)]
  return {"alpha_by_position": alphas, "draft_calls_per_round": calls}


def _adaptive(exp: Experiment, records: list[dict]) -> dict:
  """An adaptive run's rule and the γ its rounds used."""
  a = exp.adaptive
  hist = np.sum([r["gamma_hist"] for r in records], 0) if records else np.zeros(1)
  return {"adaptive": a.rule, "adaptive_threshold": a.threshold,
          "adaptive_skip_below": a.skip_below, "adaptive_confidence": a.confidence,
          "gamma_hist": hist.tolist(),       # rounds that proposed j tokens, at j
          "mean_gamma": float(np.dot(np.arange(len(hist)), hist) / max(hist.sum(), 1)),
          "gamma_label": (f"≤{exp.gamma_max} {a.rule}"
                          + (f" {a.threshold:g}" if a.threshold is not None else "")
                          + (f" skip {a.skip_below:g}" if a.skip_below is not None else "")
                          + (" drawn" if a.confidence == "drawn" else ""))}


def _tree(exp: Experiment, records: list[dict]) -> dict:
  """A tree run's shape and where its rounds stopped."""
  depth = np.sum([r["depth_hist"] for r in records], 0) if records else np.zeros(1)
  return {"tree": exp.tree, "tree_nodes": exp.tree_shape.num_nodes,
          "depth_hist": depth.tolist(),     # rounds that accepted j levels, at j
          "rank_hist": (np.sum([r["rank_hist"] for r in records], 0).tolist()
                        if records else []),  # accepted nodes by sibling rank
          "gamma_label": f"tree {exp.tree}"}


def _predictions(alpha: float, round_cost: RoundCost | None) -> dict:
  """Theorem 3.8 at the run's α with c alone, with v and in context, and
  Eq. (1)'s tokens per target call; None without a fixed-γ round."""
  if round_cost is None:
    return dict.fromkeys(("expected_speedup", "expected_speedup_v",
                          "expected_speedup_in_context", "tokens_per_target_call_eq1"))
  return {"expected_speedup": round_cost.predicted(alpha, with_v=False),
          "expected_speedup_v": round_cost.predicted(alpha),
          "expected_speedup_in_context": round_cost.predicted(alpha, in_context=True),
          "tokens_per_target_call_eq1": round_cost.expected_tokens(min(alpha, 1.0))}


def _gamma_words(s: dict) -> str:
  if s.get("tree"):
    return f"tree {s['tree']}, {s['tokens_per_target_call']:.2f} tokens per target call"
  return f"γ {s['gamma']}"


def cost_segments(records: list[dict]) -> list[dict]:
  """Each resumed segment's cost measurement (consecutive equal lines), in order."""
  out: list[dict] = []
  for r in records:
    costs = {k: r.get(k) for k in RoundCost.RECORD_KEYS}
    if out and all(out[-1][k] == costs[k] for k in RoundCost.RECORD_KEYS):
      out[-1]["examples"] += 1
    else:
      out.append({**costs, "examples": 1})
  return out


def table2_row(s: dict, verbose: bool = False) -> str:
  """The paper's Table 2 layout with the measured v, c and Theorem 3.8's EXP;
  ``verbose`` adds the cost account (``account``)."""
  fmt = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"
  row = (f"| {s['task']} | {s['draft']} | {s['temperature']:g} | "
         f"{s.get('gamma_label') or s['gamma']} | {fmt(s['alpha'])} | {fmt(s['speedup'])}X | ")
  if not verbose:
    # v and c beside EXP: a CPU's speedup means something only beside its v.
    head = "| TASK | M_q | TEMP | γ | α | SPEED | v | c | EXP (Thm 3.8 at this v and c) |"
    return "\n".join([head, "|---|---|---|---|---|---|---|---|---|",
                      row + f"{fmt(s.get('v'))} | {fmt(s.get('c'), 3)} | "
                      f"{fmt(s['expected_speedup_v'])}X |"])
  head = "| TASK | M_q | TEMP | γ | α | SPEED | EXP (Thm 3.8) | EXP (with v) | mismatches |"
  sep = "|---|---|---|---|---|---|---|---|---|"
  row += (f"{fmt(s['expected_speedup'])}X | {fmt(s['expected_speedup_v'])}X | "
          f"{'-' if s['mismatches_vs_baseline'] is None else s['mismatches_vs_baseline']} |")
  lines = [head, sep, row]
  segments = s.get("cost_segments") or []
  if len(segments) > 1:
    lines.append(f"c and v: {s['costs_from']} from {len(segments)} measurements (one per "
                 "resumed segment: " + ", ".join(
                     f"c {g['c']:.3f} v {g['v']:.2f} on {g['examples']}" for g in segments)
                 + " examples)")
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
  return {**_labels(exp, "alpha_only"), "num_tokens": tokens,
          "num_examples": len(records),
          "alpha_only_tokens": exp.alpha_only_tokens,
          "budget_reached": tokens >= exp.alpha_only_tokens,
          "examples_available": available,
          "alpha_min_pq": sum(r["min_pq_sum"] for r in records) / max(
              sum(r.get("evaluated", r["tokens"]) for r in records), 1)}


def _labels(exp: Experiment, mode: str) -> dict:
  target, draft = exp.labels
  return {"mode": mode, "task": exp.task, "target": target, "draft": draft,
          "temperature": exp.sampling.temperature, "topk": exp.sampling.topk,
          "topp": exp.sampling.topp}


def alpha_row(s: dict) -> str:
  """One Table-3-style line; says so when the examples ran out before the budget."""
  row = (f"| {s['task']} | {s['target']} | {s['draft']} | T={s['temperature']:g} | "
         f"alpha {s['alpha_min_pq']:.3f} | {s['num_tokens']} tokens |")
  if not s.get("budget_reached", True):
    row += (f"\nnote: the examples ran out after {s['num_examples']} examples and "
            f"{s['num_tokens']} tokens, before Experiment.alpha_only_tokens="
            f"{s['alpha_only_tokens']}; raise Experiment.num_examples or use a larger source")
  return row


def conclusion(s: dict, workdir: str) -> str:
  """The run in plain sentences: the speedup (and why, if slower), whether the
  outputs matched the baseline's, and where the results are."""
  where = f"Results: {workdir}/ (examples.jsonl, summary.json, config.gin)."
  n = s["num_examples"]
  if s.get("mode") == "alpha_only":
    return (f"α = {s['alpha_min_pq']:.2f} (E[Σ min(p, q)], §4.2) over {s['num_tokens']} "
            f"tokens the target generated for {n} examples.\n{where}")
  speed = s["speedup"]
  if s.get("gamma") == 0:
    text = (f"{plain_reason(s)}, so the run decoded with the target alone, at {speed:.2f}× "
            f"the baseline's speed on {n} held-out examples (T = {s['temperature']:g}).")
  else:
    same = same_speed(speed)
    verdict = ("the same speed as" if same else f"{speed:.2f}× faster than" if speed >= 1
               else f"{1 / speed:.2f}× slower than")
    text = (f"Speculative decoding {'ran at' if same else 'was'} {verdict} the baseline on {n} "
            f"held-out examples (α {s['alpha']:.2f}, {_gamma_words(s)}, T = "
            f"{s['temperature']:g})" + (f": {slowdown_reason(s)}." if speed < 1 and not same
                                        else "."))
  return f"{text} {_outputs_words(s)}\n{where}"


def same_speed(speedup: float) -> bool:
  """Whether a speedup or its inverse reads as 1.00 (not "1.00× slower")."""
  return speedup > 0 and (f"{speedup:.2f}" == "1.00" or f"{1 / speedup:.2f}" == "1.00")


def _outputs_words(s: dict) -> str:
  n, bad = s["num_examples"], s["mismatches_vs_baseline"]
  if bad is None:
    return ("At T > 0 the two loops draw their own samples, so outputs are not compared "
            "token for token (the distribution is the target's: docs/exactness.md).")
  if bad == 0:
    return f"Outputs identical to the baseline's on all {n}."
  return (f"Outputs differ from the baseline's on {bad} of {n}"
          + (" (lenience < 1 is not exact)." if s.get("lenience", 1) < 1 else
             " (matches_baseline in examples.jsonl)."))


def _cost_words(positions: int, v: float, c: float) -> str:
  """What a round costs in one-token target steps, in words."""
  cost = f"scoring {positions} positions costs {v:.1f} one-token steps"
  if v >= 1.5:   # an accelerator scores a few positions in about the time of one
    cost = f"on this machine {cost} (on an accelerator: about 1)"
  return f"{cost} and the draft costs c = {c:.2f} of a step"


def slowdown_reason(s: dict) -> str:
  """Why a slower run was slower: v, c, α and Theorem 3.8 from them; where
  that predicts a gain, the interplay or what the theorem leaves out."""
  tree = bool(s.get("tree"))
  text = _cost_words(s["tree_nodes"] if tree else s["gamma"] + 1, s["v"], s["c"])
  predicted, alpha = s.get("expected_speedup_v"), s["alpha"]
  in_context = s.get("expected_speedup_in_context")
  if predicted is None:   # tree or adaptive rounds: no fixed-γ prediction
    text += f", and at α {alpha:.2f} the tokens its rounds accept do not pay for them"
  elif predicted < 1:
    text += (f", so with α {alpha:.2f} γ = {s['gamma']} cannot pay (Theorem 3.8 predicts "
             f"{predicted:.2f}×)")
  elif in_context is not None and in_context < 1:
    text += (f"; Theorem 3.8 predicts {predicted:.2f}× with α {alpha:.2f} and γ = "
             f"{s['gamma']}, but run alternately, as a round runs them, the two models cost "
             f"{s['interplay']:.2f}× their cost timed apart, which leaves {in_context:.2f}×")
  else:
    whole = s.get("expected_speedup_whole_run")
    text += (f"; Theorem 3.8 predicts {predicted:.2f}× with α {alpha:.2f} and γ = "
             f"{s['gamma']}, so the loss lies in what it leaves out: each round's own work "
             "and each example's prefill"
             + (f" (the whole-run account predicts {whole:.2f}×)" if whole is not None else ""))
  return text + "; see docs/benchmarks.md"


def plain_reason(s: dict) -> str:
  """Why gamma='auto' chose plain decoding: no γ's prediction beat 1 by more
  than its standard error (``autogamma``)."""
  auto = s["gamma_auto"]
  best = int(auto["argmax"])
  key = str(best)
  se = auto.get("predicted_se", {}).get(key)   # absent in records of older runs
  return (f"gamma='auto' chose plain decoding (γ = 0): with α {auto['alpha_warmup']:.2f} "
          f"measured on {auto['alpha_tokens']} tokens, Theorem 3.8 predicts at most "
          f"{auto['predicted'][key]:.2f}×" + (f" ± {se:.2f}" if se is not None else "")
          + f" for any γ ≤ {max(int(g) for g in auto['predicted'])} "
          f"(at γ = {best}: {_cost_words(best + 1, auto['v'][key], auto['c'][key])})"
          + (", a gain within its standard error" if se is not None
             and auto["predicted"][key] > 1 else ""))


class Progress:
  """One progress line on stderr, in place on a terminal, else every tenth."""

  def __init__(self, total: int, stream=None):
    self.total, self.stream = max(total, 1), stream or sys.stderr
    self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
    self.last_tenth = -1

  def update(self, done: int, text: str) -> None:
    if jax.process_index() != 0:  # one line per run, not per host
      return
    line = f"[{done}/{self.total}] {text}"
    if self.tty:
      self.stream.write("\r" + line.ljust(79))
      if done >= self.total:
        self.stream.write("\n")
    elif done * 10 // self.total > self.last_tenth or done >= self.total:
      self.last_tenth = done * 10 // self.total
      self.stream.write(line + "\n")
    self.stream.flush()
