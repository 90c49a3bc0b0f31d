"""A γ sweep: the baseline and speculative decoding side by side (paper App. A.3).

Used by ``scripts/bench_speculative.py`` and ``notebooks/demo.ipynb``. For each
example the baseline and every γ run back to back with the same PRNG key, so
machine drift hits all columns alike; compilation happens on a warm-up example
and is never timed; every call ends in ``block_until_ready``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import typing
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from specdec_jax import alpha, data, drafts, theory
from specdec_jax.decoding import (AdaptiveConfig, cache_length, speculative_decode,
                                  temperature_sample)
from specdec_jax.run import (Experiment, autogamma, check_before_loading, held_out_inputs,
                             load_data, load_draft, load_models)
from specdec_jax.run.settings import setting_docs
from specdec_jax.run.setup import partitioners
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting import script_args
from specdec_jax.timing import block, measure_costs_many, timed, warm_up_widths

from lab.common import parse_input_buckets


def parse_gamma(text: Union[int, str]) -> tuple[str, int]:
  """A fixed setting: '3' -> ('3', 3); 'auto' -> ('auto', 0), resolved later."""
  text = str(text).strip()
  if text.isdigit():
    return text, int(text)
  if text == "auto":
    return text, 0
  raise ValueError(f"unknown γ {text!r}: a number or 'auto' (adaptive settings are "
                   "AdaptiveConfig's, e.g. --adaptive_rule=threshold --adaptive_threshold=0.4)")


def adaptive_label(cfg: AdaptiveConfig, gamma_max: int) -> str:
  """A row label for an adaptive setting, e.g. '≤7 thr 0.4 skip 0.3 drawn'."""
  if cfg.rule == "schedule":
    return f"≤{gamma_max} sched" + (f" from {cfg.initial_gamma}" if cfg.initial_gamma else "")
  return (f"≤{gamma_max} {'thr' if cfg.rule == 'threshold' else 'cum'} {cfg.threshold:g}"
          + ("" if cfg.skip_below is None else f" skip {cfg.skip_below:g}")
          + (" drawn" if cfg.confidence == "drawn" else ""))


def parse_widths(text: str, gamma_max: int) -> tuple[int, ...]:
  """Verification widths by name: 'all' -> 1..γ_max, 'default' -> () (the
  engine's powers of two and γ_max), else a comma-separated list."""
  if text == "all":
    return tuple(range(1, gamma_max + 1))
  if text == "default":
    return ()
  return tuple(int(w) for w in text.split(","))


@dataclasses.dataclass
class _Tally:
  """One setting's sums over the timed examples (batch 1): seconds, tokens,
  accepted and rejected proposals, Σ min(p, q), target calls, per-example
  speedups, mismatches; acceptances [γ] and evaluations [γ] per position and
  rounds per proposed length [γ + 1]."""

  s: float = 0.0
  tok: int = 0
  acc: int = 0
  rej: int = 0
  mpq: float = 0.0
  calls: int = 0
  ratios: list = dataclasses.field(default_factory=list)
  mism: int = 0
  acc_at: Any = 0
  ev_at: Any = 0
  hist: Any = 0

  def add(self, o: Any, seconds: float, base: Any, base_seconds: float) -> None:
    """One example's speculative output ``o`` (plain decoding: the baseline's,
    without statistics) beside the baseline's."""
    self.s += seconds
    self.tok += int(o.length[0])
    stats = getattr(o, "stats", None)
    if stats is None:   # plain decoding: one target step per token
      self.calls += int(o.length[0])
    else:
      self.acc += int(stats.accepted[0])
      self.rej += int(stats.rejected[0])
      self.mpq += float(stats.min_pq_sum[0])
      self.calls += int(stats.target_calls[0])
      self.acc_at = self.acc_at + np.asarray(stats.accepted_at[0])
      self.ev_at = self.ev_at + np.asarray(stats.evaluated_at[0])
      self.hist = self.hist + np.asarray(stats.gamma_hist[0])
    self.ratios.append((int(o.length[0]) / seconds) / (int(base.length[0]) / base_seconds))
    self.mism += int(not np.array_equal(np.asarray(o.tokens), np.asarray(base.tokens)))


def _settings(target, target_params, named: Mapping[Any, Any], parsed: Sequence[tuple],
              x0: Any, batches: Sequence[tuple], sampling: SamplingConfig, max_decode_len: int,
              gamma_max: int, seed: int, base: Callable) -> tuple[list, dict, dict, dict]:
  """(settings, spec, costs, choices): every (draft name, row label, γ,
  adaptive) to time, the program of each, each draft's c and v per γ (one
  interleaved measurement, so that rows compare and 'auto' sees the very
  costs its row is predicted with) and each draft's 'auto' choice. An 'auto'
  that chose plain decoding runs the baseline as its row."""
  kw = dict(max_decode_len=max_decode_len, sampling=sampling, eos_id=target.config.eos_id)
  auto = any(label == "auto" for label, _, _ in parsed)
  needed = {g for _, g, _ in parsed if g} | (set(range(1, gamma_max + 1)) if auto else set())
  settings, spec, costs, choices = [], {}, {}, {}
  for name, d in named.items():
    costs[name] = measure_costs_many(target, target_params, d, x0, sorted(needed), sampling,
                                     cache_len=cache_length(max_decode_len, max(needed))
                                     ) if needed else {}
    if auto:
      choices[name] = autogamma.choose_gamma(target, target_params, d, batches,
                                             jax.random.PRNGKey(seed), sampling,
                                             max_decode_len, gamma_max, costs=costs[name])
    for label, g, a in parsed:
      if label == "auto":
        g = choices[name].gamma
        label = f"auto→{g}" if g else "auto→plain"
      settings.append((name, label, g, a))
      spec[name, label] = base if g == 0 else (lambda x, k, d=d, g=g, a=a: speculative_decode(
          target, target_params, d, x, k, gamma=g, adaptive=a, **kw))
  return settings, spec, costs, choices


def _warm_up(base: Callable, spec: Mapping, settings: Sequence[tuple], examples: list,
             widths: Mapping[int, list[int]]) -> None:
  """Every program compiled on each input width, and the adaptive loops'
  every verification branch run once (its code is generated on its first
  run, per program: ``timing.warm_up_widths``), before anything is timed."""
  for group in widths.values():
    block(base(examples[group[0]], jax.random.PRNGKey(0)))
    for fn in spec.values():
      block(fn(examples[group[0]], jax.random.PRNGKey(0)))
  for (name, label, g, a) in settings:
    if a is not None:
      for group in widths.values():
        warm_up_widths(lambda x, fn=spec[name, label]: fn(x, jax.random.PRNGKey(0)),
                       (examples[i] for i in group), a.verify_widths(g))


def _time(base: Callable, spec: Mapping, examples: list, seed: int
          ) -> tuple[float, int, dict[Any, _Tally]]:
  """(baseline seconds, baseline tokens, each setting's tally) over examples
  1.., the baseline and every setting back to back with the same key."""
  tallies = {label: _Tally() for label in spec}
  b_s, b_tok = 0.0, 0
  for i in range(1, len(examples)):
    x = examples[i]
    key = jax.random.fold_in(jax.random.PRNGKey(seed), i)
    out, t = timed(lambda: base(x, key))
    b_s += t
    b_tok += int(out.length[0])
    for label, fn in spec.items():
      o, ts = timed(lambda: fn(x, key))
      tallies[label].add(o, ts, out, t)
  return b_s, b_tok, tallies


def _row(name: Any, label: str, g: int, adaptive: Optional[AdaptiveConfig], a: _Tally,
         c: Any, b_s: float, b_tok: int, sampling: SamplingConfig, n: int,
         choice: Any) -> dict:
  """One row of ``gamma_sweep`` (``c``: the γ's ``theory.RoundCost``, None for plain
  decoding, which has no α, costs or prediction)."""
  ev = max(a.acc + a.rej, 1)
  alpha = a.acc / ev
  base_tps, spec_tps = b_tok / b_s, a.tok / a.s
  a_cap = min(alpha, 1 - 1e-9)
  fixed = adaptive is None and c is not None
  hist = np.asarray(a.hist)
  exp = lambda *costs: float(theory.walltime_improvement(a_cap, g, *costs)) if fixed else None
  return dict(
      **({} if name is None else {"draft": name}),
      temperature=sampling.temperature, baseline_tok_s=base_tps,
      gamma=g if adaptive is None and not label.startswith("auto") else label,
      speculative_tok_s=spec_tps, speedup=spec_tps / base_tps,
      median_example_speedup=statistics.median(a.ratios),
      alpha=alpha if c is not None else None,
      alpha_min_pq=a.mpq / ev if c is not None else None,
      tokens_per_target_call=a.tok / max(a.calls, 1),
      mean_gamma=float(np.dot(np.arange(hist.size), hist.ravel()) / max(hist.sum(), 1)),
      c=None if c is None else c.c, v=None if c is None else c.v,
      expected=exp(c.c) if fixed else None, expected_v=exp(c.c, c.v) if fixed else None,
      interplay=None if c is None else c.interplay,
      expected_ctx=exp(c.c_in_context, c.v_in_context) if fixed else None,
      # measured / EXP(v) = tokens_factor * round_factor (exactly): where the
      # prediction's error sits. tokens: tokens per target call vs Eq. (1)
      # at the measured α (finite sequences: the last round is cut at EOS);
      # round: the predicted cost of a round, γc + v target steps, vs its
      # measured time in units of the baseline's time per token (< 1: rounds
      # carry more overhead than baseline steps do, e.g. the draft's own
      # encoder and cache). Both use only times measured side by side in one
      # loop; the timed step piece's absolute time drifts between calls.
      tokens_factor=(a.tok / max(a.calls, 1) / float(theory.expected_tokens(a_cap, g))
                     if fixed else None),
      round_factor=((g * c.c + c.v) * (b_s / b_tok) / (a.s / max(a.calls, 1))
                    if fixed else None),
      acceptance_at=(a.acc_at / np.maximum(a.ev_at, 1)).tolist() if c is not None else [],
      mismatches=a.mism if sampling.greedy else None, examples=n,
      **({"auto": choice.as_record()} if label.startswith("auto") else {}))


def gamma_sweep(target, target_params, draft: Union[Any, Mapping[str, Any]],
                inputs: np.ndarray, gammas: Sequence[Union[int, str]],
                sampling: SamplingConfig, max_decode_len: int, seed: int = 0,
                gamma_max: int = 8, alpha_inputs: Optional[np.ndarray] = None,
                alpha_batch: int = 8, adaptive: Sequence[AdaptiveConfig] = (),
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
  Settings: each of ``gammas``, a fixed γ or 'auto', the γ that
  ``autogamma.choose_gamma`` picks from α on ``alpha_inputs`` (e.g. held-out
  validation examples, in batches of ``alpha_batch``; default: the warm-up
  example alone, a noisy estimate) and timed pieces (c, v for 1..gamma_max),
  labelled 'auto→γ' and timed like the others ('auto→plain' where it chose
  plain decoding: the baseline runs as its row);
  then each of ``adaptive`` (``decoding.AdaptiveConfig``, γ_max = ``gamma_max``),
  whose rows report the mean γ used and no prediction (Theorem 3.8 is for a
  fixed γ). All settings run back to back per example.
  ``input_buckets``: each example's inputs are cut to the smallest bucket that
  holds them (``data.fit_to_bucket``; the runner's ``Experiment.input_buckets``),
  every bucket used compiled before timing; () keeps the full width S.
  """
  examples = [data.fit_to_bucket(inputs[i:i + 1], input_buckets) for i in range(len(inputs))]
  parsed = ([(*parse_gamma(g), None) for g in gammas]
            + [(adaptive_label(a, gamma_max), gamma_max, a) for a in adaptive])
  named = dict(draft) if isinstance(draft, Mapping) else {None: draft}
  base = lambda x, k: temperature_sample(target, target_params, x, k,
                                         max_decode_len=max_decode_len, sampling=sampling,
                                         eos_id=target.config.eos_id)
  x0 = examples[0]
  block(base(x0, jax.random.PRNGKey(0)))
  batches = [(x0, 1)]
  if any(label == "auto" for label, _, _ in parsed) and alpha_inputs is not None \
      and len(alpha_inputs):
    batches = alpha.alpha_batches(alpha_inputs, len(alpha_inputs), alpha_batch)
  settings, spec, costs, choices = _settings(target, target_params, named, parsed, x0, batches,
                                             sampling, max_decode_len, gamma_max, seed, base)
  _warm_up(base, spec, settings, examples, data.by_width(examples))
  b_s, b_tok, tallies = _time(base, spec, examples, seed)
  return [_row(name, label, g, a, tallies[name, label], costs[name][g] if g else None, b_s,
               b_tok, sampling, len(inputs) - 1, choices.get(name))
          for name, label, g, a in settings]


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


def many_flags(parser: argparse.ArgumentParser, cls: type, prefix: str = "",
               skip: Sequence[str] = ()) -> None:
  """``--{prefix}{name}`` for each field of ``cls`` but ``skip``: comma-separated
  values, one per setting (``dataclasses_from_flags``), its help the field's
  docstring entry."""
  docs = setting_docs(cls)
  for f in dataclasses.fields(cls):
    if f.name not in skip:
      text = f"{cls.__name__}.{f.name}" + (f": {docs[f.name]}" if f.name in docs else "")
      parser.add_argument(f"--{prefix}{f.name}", default=None, metavar="VALUE[,VALUE...]",
                          help=(text + " (one value per setting, or one for all)")
                          .replace("%", "%%"))


def dataclasses_from_flags(cls: type, args: argparse.Namespace, prefix: str = "",
                           **fixed: Any) -> list[Any]:
  """The settings ``many_flags``' flags describe: setting i takes each flag's
  i-th value (or its one value); [] when no flag is given."""
  hints = typing.get_type_hints(cls)
  given: dict[str, list[Any]] = {}
  for f in dataclasses.fields(cls):
    text = None if f.name in fixed else getattr(args, prefix + f.name, None)
    if text is None:
      continue
    try:
      whole = typing.get_origin(script_args.hint_types(hints[f.name])[0]) is tuple
      given[f.name] = [script_args.parse_value(hints[f.name], v)
                       for v in ([text] if whole else text.split(","))]
    except ValueError as e:
      raise ValueError(f"--{prefix}{f.name}={text}: {e}") from None
  if not given:
    return []
  n = max(len(v) for v in given.values())
  wrong = [f"--{prefix}{k} ({len(v)})" for k, v in given.items() if len(v) not in (1, n)]
  if wrong:
    raise ValueError(f"{', '.join(wrong)}: give one value, or one per setting ({n})")
  return [cls(**{k: v[i] if len(v) > 1 else v[0] for k, v in given.items()}, **fixed)
          for i in range(n)]


# --adaptive: six settings, as if given by their flags.
ADAPTIVE_PRESET = dict(rule="threshold,threshold,threshold,cumulative,cumulative,schedule",
                       threshold="0.4,0.7,0.4,0.3,0.3,none",
                       skip_below="none,none,0.4,none,0.4,none")


def adaptive_settings(args) -> list[AdaptiveConfig]:
  """The adaptive settings of the --adaptive_<field> flags (or --adaptive's),
  each verifying at --adaptive_widths."""
  if args.adaptive:
    for name, values in ADAPTIVE_PRESET.items():
      setattr(args, f"adaptive_{name}", values)
  return dataclasses_from_flags(
      AdaptiveConfig, args, prefix="adaptive_",
      widths=parse_widths(args.adaptive_widths, args.gamma_max))


def report(args: Any) -> str:
  """``scripts/bench_speculative.py``: the sweep of its flags at each of
  --temperatures, as a markdown table, and what each 'auto' row saw."""
  gammas = script_args.comma_list(args.gammas)
  adaptive = adaptive_settings(args)
  numeric = [int(g) for g in gammas if g.isdigit()]
  if getattr(args, "drafts_name", None) is None and any(
      getattr(args, f"drafts_{f}", None) for f in ("checkpoint", "shortlist", "label")):
    raise ValueError("--drafts_checkpoint, --drafts_shortlist and --drafts_label describe the "
                     "drafts --drafts_name lists: give --drafts_name")
  compared = dataclasses_from_flags(DraftRow, args, prefix="drafts_")
  specs = (draft_rows(compared) if compared
           else {None: (args.draft_name, args.draft, args.draft_shortlist)})
  exps = {label: Experiment(
      task=args.task, source=args.source, vocab_path=args.vocab,
      target_checkpoint=args.target, draft_name=name,
      draft_checkpoint=ckpt if ckpt and drafts.takes(name, "model") else "",
      draft_shortlist=shortlist,
      max_input_len=args.max_input_len, max_decode_len=args.max_decode_len,
      num_warmup=1, num_examples=args.num_examples, dtype=args.dtype,
      gamma=max(numeric + [args.gamma_max]), ngram_corpus=args.ngram_corpus)
      for label, (name, ckpt, shortlist) in specs.items()}
  for e in exps.values():   # every draft checked before anything is loaded
    check_before_loading(e)
  exp = next(iter(exps.values()))
  data = load_data(exp)
  setup = load_models(exp, data)   # the target once; each further draft beside it
  _, draft_part = partitioners(exp)
  named = {label: setup.draft if e is exp
           else load_draft(e, data, setup.target, draft_part, setup.target_params)
           for label, e in exps.items()}
  draft = named if compared else setup.draft
  alpha_inputs = None
  if "auto" in gammas and args.auto_alpha_examples > 0:
    alpha_inputs = held_out_inputs(exp, args.auto_alpha_source, args.auto_alpha_examples)
  buckets = parse_input_buckets(args.input_buckets, args.max_input_len)
  rows = []
  for temp in script_args.comma_list(args.temperatures, float):
    rows += gamma_sweep(setup.target, setup.target_params, draft, setup.inputs, gammas,
                        SamplingConfig(temperature=temp), exp.max_decode_len, args.seed,
                        gamma_max=args.gamma_max, alpha_inputs=alpha_inputs,
                        adaptive=adaptive, input_buckets=buckets)
    # A temperature's programs are not run again: dropping them keeps the
    # compiled code (one program per draft x setting x bucket) within the
    # process's memory maps (bench_speculative's docstring).
    jax.clear_caches()
  lines = [markdown_table(rows)]
  for r in rows:
    if "auto" in r:  # what 'auto' saw and why it chose its γ (autogamma.GammaChoice)
      a = r["auto"]
      curve = ", ".join(f"{g}: {x:.2f}x ± {a['gap_se'][g]:.2f}"
                        for g, x in a["predicted"].items())
      who = f" {r['draft']}" if "draft" in r else ""
      lines.append(f"\nT={r['temperature']:g}{who} auto: α {a['alpha_warmup']:.3f} ± "
                   f"{a['alpha_se']:.3f} on {a['alpha_tokens']} tokens; predicted (± s.e. of "
                   f"the gap to the best) "
                   f"{curve}; argmax {a['argmax']}, chosen {a['gamma']}"
                   + (" (plain decoding: no γ is predicted to pay)" if a["gamma"] == 0 else ""))
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class DraftRow:
  """One approximation model of a ``--drafts_*`` comparison (the flags
  ``--drafts_<field>``, one value per draft or one for all).

  name: the registered approximation model, e.g. t5, prompt_lookup, lookup_t5.
  checkpoint: its checkpoint ('' for a draft that reads none).
  shortlist: its vocabulary shortlist (Experiment.draft_shortlist; '' for none).
  label: the row's label ('': the checkpoint's directory name, prefixed by the
    draft's name for drafts other than t5, '+shortlist' added with one).
  """

  name: str
  checkpoint: str = ""
  shortlist: str = ""
  label: str = ""


def draft_rows(rows: Sequence[DraftRow]) -> dict[str, tuple[str, str, str]]:
  """{row label: (draft name, checkpoint, shortlist)} for ``rows``, each
  checked (a registered name; a checkpoint where the draft needs one; labels
  distinct)."""
  out: dict[str, tuple[str, str, str]] = {}
  for r in rows:
    if r.name not in drafts.REGISTRY:
      raise ValueError(f"--drafts_name: unknown draft {r.name!r}; registered: "
                       f"{', '.join(sorted(drafts.REGISTRY))}")
    if "model" in drafts.requires(r.name) and not r.checkpoint:
      raise ValueError(f"--drafts_name={r.name} needs a checkpoint: give its "
                       "--drafts_checkpoint")
    base = Path(r.checkpoint.rstrip("/")).name if r.checkpoint else ""
    label = r.label or ((base if r.name == "t5" else f"{r.name}:{base}" if base else r.name)
                        + ("+shortlist" if r.shortlist else ""))
    if label in out:
      raise ValueError(f"two drafts would both be labelled {label!r}; name them with "
                       "--drafts_label")
    out[label] = (r.name, r.checkpoint, r.shortlist)
  return out
