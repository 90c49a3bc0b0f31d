"""A γ sweep: the baseline and speculative decoding side by side (paper App. A.3).

Used by ``scripts/bench_speculative.py`` and ``notebooks/demo.ipynb``. For each
example the baseline and every γ run back to back with the same PRNG key, so
machine drift hits all columns alike; compilation happens on a warm-up example
and is never timed; every call ends in ``block_until_ready``.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from specdec_jax import data, theory
from specdec_jax.run import autogamma
from specdec_jax.decoding import (CONFIDENCE_RULES, AdaptiveConfig, speculative_decode,
                                  temperature_sample)
from specdec_jax.sampling import SamplingConfig
from specdec_jax.timing import block, measure_costs_many, timed, warm_up_widths



def parse_setting(text: Union[int, str], gamma_max: int, widths: Sequence[int] = ()
                  ) -> tuple[str, int, Optional[AdaptiveConfig]]:
  """'3' | 'auto' | 'threshold[:t[:s[:drawn]]]' | 'cumulative[:t[:s[:drawn]]]' |
  'schedule[:initial γ]' -> (label, γ, adaptive).

  Adaptive settings run with γ_max = ``gamma_max``; 'auto' is resolved later.
  'threshold:t:s' (and 'cumulative:t:s') also skips a round when q_1's
  confidence is <= s (``AdaptiveConfig.skip_below``: the round is a plain
  target step); s may be empty ('cumulative:0.25::drawn'). A last field
  'drawn' reads the drawn token's probability instead of the top one
  (``AdaptiveConfig.confidence``). ``widths``: the adaptive settings'
  compiled verification widths (``AdaptiveConfig.widths``; () = its default).
  """
  text = str(text).strip()
  if text.isdigit():
    return text, int(text), None
  if text == "auto":
    return text, 0, None
  rule, _, arg = text.partition(":")
  if rule in CONFIDENCE_RULES:
    t, _, rest = arg.partition(":")
    skip, _, confidence = rest.partition(":")
    cfg = AdaptiveConfig(rule, threshold=float(t or 0.4),
                         skip_below=float(skip) if skip else None, widths=tuple(widths),
                         confidence=confidence or "top")
    label = f"≤{gamma_max} {'thr' if rule == 'threshold' else 'cum'} {cfg.threshold:g}"
    return (label + (f" skip {cfg.skip_below:g}" if skip else "")
            + (" drawn" if cfg.confidence == "drawn" else "")), gamma_max, cfg
  if rule == "schedule":
    cfg = AdaptiveConfig("schedule", initial_gamma=int(arg) if arg else None,
                         widths=tuple(widths))
    return f"≤{gamma_max} sched" + (f" from {arg}" if arg else ""), gamma_max, cfg
  raise ValueError(f"unknown γ setting {text!r}: a number, 'auto', 'threshold[:t[:s]]', "
                   "'cumulative[:t[:s]]' or 'schedule[:initial γ]'")


def parse_widths(text: str, gamma_max: int) -> tuple[int, ...]:
  """Verification widths by name: 'all' -> 1..γ_max, 'default' -> () (the
  engine's powers of two and γ_max), else a comma-separated list."""
  if text == "all":
    return tuple(range(1, gamma_max + 1))
  if text == "default":
    return ()
  return tuple(int(w) for w in text.split(","))


def gamma_sweep(target, target_params, draft: Union[Any, Mapping[str, Any]],
                inputs: np.ndarray, gammas: Sequence[Union[int, str]],
                sampling: SamplingConfig, max_decode_len: int, seed: int = 0,
                gamma_max: int = 8, alpha_inputs: Optional[np.ndarray] = None,
                alpha_batch: int = 8, adaptive_widths: Sequence[int] = (),
                input_buckets: Sequence[int] = ()) -> list[dict]:
  """One row per (draft, γ setting): measured tokens/s, α, c, v and Theorem 3.8's
  prediction.

  ``draft``: one approximation model, or a mapping name -> model to compare
  several in the same run: every draft's every setting runs back to back on
  each example beside one baseline, so the drafts' speedups share their
  baseline and the machine's drift (runs minutes apart on a noisy VM differ
  by more than the drafts do). Rows then carry ``draft`` (the name).

  inputs [N, S]: row 0 is the warm-up example (untimed), rows 1.. are timed.
  Speedup = speculative tokens/s over baseline tokens/s on the same examples
  (equal to the time ratio at temperature 0, where outputs are identical).
  Settings (``parse_setting``): a fixed γ; 'auto', the γ that
  ``autogamma.choose_gamma`` picks from α on ``alpha_inputs`` (e.g. held-out
  validation examples, in batches of ``alpha_batch``; default: the warm-up
  example alone, a noisy estimate) and timed pieces (c, v for 1..gamma_max),
  labelled 'auto→γ' and timed like the others;
  'threshold[:t]' / 'cumulative[:t]' / 'schedule' (``decoding.AdaptiveConfig``, γ_max =
  ``gamma_max``), whose rows report the mean γ used and no prediction
  (Theorem 3.8 is for a fixed γ), verifying at ``adaptive_widths`` (()
  = ``AdaptiveConfig``'s default). All settings run back to back per example.
  ``input_buckets``: each example's inputs are cut to the smallest bucket that
  holds them (``data.fit_to_bucket``; the runner's ``Experiment.input_buckets``),
  every bucket used compiled before timing; () keeps the full width S.
  """
  examples = [data.fit_to_bucket(inputs[i:i + 1], input_buckets) for i in range(len(inputs))]
  widths = data.by_width(examples)  # one program per input width
  parsed = [parse_setting(g, gamma_max, adaptive_widths) for g in gammas]
  named = dict(draft) if isinstance(draft, Mapping) else {None: draft}
  eos = target.config.eos_id
  kw = dict(max_decode_len=max_decode_len, sampling=sampling, eos_id=eos)
  base = lambda x, k: temperature_sample(target, target_params, x, k, **kw)
  x0 = examples[0]
  block(base(x0, jax.random.PRNGKey(0)))
  auto = any(label == "auto" for label, _, _ in parsed)
  needed = {g for _, g, _ in parsed if g} | (set(range(1, gamma_max + 1)) if auto else set())
  batches = [(x0, 1)]
  if auto and alpha_inputs is not None and len(alpha_inputs):
    batches = autogamma.alpha_batches(alpha_inputs, len(alpha_inputs), alpha_batch)
  # settings: (draft name, row label, γ, adaptive); spec: the jitted call of each.
  settings, spec, costs, choices = [], {}, {}, {}
  for name, d in named.items():
    # Every γ's c and v in one interleaved measurement, so they are comparable
    # across rows and 'auto' sees the very costs its row is predicted with.
    costs[name] = measure_costs_many(target, target_params, d, x0, sorted(needed), sampling,
                                     cache_len=max_decode_len + max(needed) + 1
                                     ) if needed else {}
    if auto:
      choices[name] = autogamma.choose_gamma(target, target_params, d, batches,
                                             jax.random.PRNGKey(seed), sampling,
                                             max_decode_len, gamma_max, costs=costs[name])
    for label, g, a in parsed:
      if label == "auto":
        label, g = f"auto→{choices[name].gamma}", choices[name].gamma
      settings.append((name, label, g, a))
      spec[name, label] = (lambda x, k, d=d, g=g, a=a: speculative_decode(
          target, target_params, d, x, k, gamma=g, adaptive=a, **kw))
  for group in widths.values():
    block(base(examples[group[0]], jax.random.PRNGKey(0)))
    for fn in spec.values():
      block(fn(examples[group[0]], jax.random.PRNGKey(0)))
  # Adaptive loops: every verification branch run once before timing (its
  # code is generated on its first run, per program; timing.warm_up_widths).
  for (name, label, g, a) in settings:
    if a is not None:
      for group in widths.values():
        warm_up_widths(lambda x, fn=spec[name, label]: fn(x, jax.random.PRNGKey(0)),
                       (examples[i] for i in group), a.verify_widths(g))
  zero = lambda: dict(s=0.0, tok=0, acc=0, rej=0, mpq=0.0, calls=0, ratios=[], mism=0,
                      acc_at=0, ev_at=0, hist=0)
  acc = {label: zero() for label in spec}
  b_s, b_tok = 0.0, 0
  for i in range(1, len(inputs)):
    x = examples[i]
    key = jax.random.fold_in(jax.random.PRNGKey(seed), i)
    out, t = timed(lambda: base(x, key))
    b_s += t
    b_tok += int(out.length[0])
    for label, fn in spec.items():
      o, ts = timed(lambda: fn(x, key))
      a = acc[label]
      a["s"] += ts
      a["tok"] += int(o.length[0])
      a["acc"] += int(o.stats.accepted[0])
      a["rej"] += int(o.stats.rejected[0])
      a["mpq"] += float(o.stats.min_pq_sum[0])
      a["calls"] += int(o.stats.target_calls[0])
      a["acc_at"] = a["acc_at"] + np.asarray(o.stats.accepted_at[0])
      a["ev_at"] = a["ev_at"] + np.asarray(o.stats.evaluated_at[0])
      a["hist"] = a["hist"] + np.asarray(o.stats.gamma_hist[0])
      a["ratios"].append((int(o.length[0]) / ts) / (int(out.length[0]) / t))
      a["mism"] += int(not np.array_equal(np.asarray(o.tokens), np.asarray(out.tokens)))
  rows = []
  for name, label, g, adaptive in settings:
    a, c = acc[name, label], costs[name][g]
    ev = max(a["acc"] + a["rej"], 1)
    alpha = a["acc"] / ev
    base_tps, spec_tps = b_tok / b_s, a["tok"] / a["s"]
    a_cap = min(alpha, 1 - 1e-9)
    fixed = adaptive is None
    hist = np.asarray(a["hist"])
    rows.append(dict(
        **({} if name is None else {"draft": name}),
        temperature=sampling.temperature, baseline_tok_s=base_tps,
        gamma=g if fixed and not label.startswith("auto") else label,
        speculative_tok_s=spec_tps, speedup=spec_tps / base_tps,
        median_example_speedup=statistics.median(a["ratios"]), alpha=alpha,
        alpha_min_pq=a["mpq"] / ev, tokens_per_target_call=a["tok"] / max(a["calls"], 1),
        mean_gamma=float(np.dot(np.arange(len(hist)), hist) / max(hist.sum(), 1)),
        c=c.c, v=c.v,
        expected=float(theory.walltime_improvement(a_cap, g, c.c)) if fixed else None,
        expected_v=float(theory.walltime_improvement(a_cap, g, c.c, c.v)) if fixed else None,
        interplay=c.interplay,
        expected_ctx=(float(theory.walltime_improvement(a_cap, g, c.c_in_context,
                                                        c.v_in_context)) if fixed else None),
        # measured / EXP(v) = tokens_factor * round_factor (exactly): where the
        # prediction's error sits. tokens: tokens per target call vs Eq. (1)
        # at the measured α (finite sequences: the last round is cut at EOS);
        # round: the predicted cost of a round, γc + v target steps, vs its
        # measured time in units of the baseline's time per token (< 1: rounds
        # carry more overhead than baseline steps do, e.g. the draft's own
        # encoder and cache). Both use only times measured side by side in one
        # loop; the timed step piece's absolute time drifts between calls.
        tokens_factor=(a["tok"] / max(a["calls"], 1) / float(theory.expected_tokens(a_cap, g))
                       if fixed else None),
        round_factor=((g * c.c + c.v) * (b_s / b_tok) / (a["s"] / max(a["calls"], 1))
                      if fixed else None),
        acceptance_at=(a["acc_at"] / np.maximum(a["ev_at"], 1)).tolist(),
        mismatches=a["mism"] if sampling.greedy else None, examples=len(inputs) - 1,
        **({"auto": choices[name].as_record()} if label.startswith("auto") else {})))
  return rows


COLUMNS = [("temp", "temperature", "{:g}"), ("γ", "gamma", "{}"),
           ("baseline tok/s", "baseline_tok_s", "{:.1f}"),
           ("speculative tok/s", "speculative_tok_s", "{:.1f}"),
           ("speedup", "speedup", "{:.2f}x"),
           ("median per-example", "median_example_speedup", "{:.2f}x"),
           ("α", "alpha", "{:.3f}"), ("α (Σmin(p,q))", "alpha_min_pq", "{:.3f}"),
           ("tokens/target call", "tokens_per_target_call", "{:.2f}"),
           ("mean γ", "mean_gamma", "{:.2f}"), ("c", "c", "{:.3f}"),
           ("v", "v", "{:.2f}"), ("EXP (Thm 3.8)", "expected", "{:.2f}x"),
           ("EXP (with v)", "expected_v", "{:.2f}x"), ("interplay", "interplay", "{:.2f}"),
           ("EXP (in context)", "expected_ctx", "{:.2f}x")]


FACTORS = [("= tokens/call ÷ Eq. 1", "tokens_factor"),
           ("× (γc+v) ÷ round in baseline tokens", "round_factor")]


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
  """The sweep as a markdown table, plus measured / EXP(with v) and its two
  factors (see ``gamma_sweep``)."""
  by_draft = any("draft" in r for r in rows)   # several drafts: name each row's
  head = ((["draft"] if by_draft else []) + [c[0] for c in COLUMNS] + ["measured / EXP(v)"]
          + [f[0] for f in FACTORS] + ["measured / EXP(in context)", "mismatches"])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    cells = [str(r.get("draft", "-"))] if by_draft else []
    cells += ["-" if r[key] is None else fmt.format(r[key]) for _, key, fmt in COLUMNS]
    cells.append("-" if r["expected_v"] is None else f"{r['speedup'] / r['expected_v']:.2f}")
    cells += ["-" if r.get(key) is None else f"{r[key]:.2f}" for _, key in FACTORS]
    cells.append("-" if r.get("expected_ctx") is None
                 else f"{r['speedup'] / r['expected_ctx']:.2f}")
    cells.append("-" if r["mismatches"] is None else str(r["mismatches"]))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
