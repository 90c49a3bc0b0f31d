"""The runner's beam mode (``Experiment.decode_method = 'beam'``): T5X-style
beam search timed against speculative beam search (Appendix A.4) on the same
batches, one line of ``examples.jsonl`` per example.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from absl import logging

from specdec_jax import beam
from specdec_jax.run import hosts
from specdec_jax.run.programs import batch_indices, pad_batch
from specdec_jax.run.report import Progress
from specdec_jax.run.settings import Experiment
from specdec_jax.run.setup import Setup
from specdec_jax.run.workdir import Workdir
from specdec_jax.timing import timed


def draft_model(setup: Setup) -> tuple[Any, Any]:
  """(model, params) of a plain T5 draft (it runs beam search itself); any
  other draft as it is, with None (each beam's greedy chain)."""
  d = setup.draft
  extras = [name for name in ("bridge", "feature", "shortlist")
            if getattr(d, name, None) is not None]
  if hasattr(d, "model") and hasattr(d, "params") and not extras:
    return d.model, d.params
  return d, None


def draft_width(setup: Setup) -> int:
  """The draft's beam width u (w for greedy chains)."""
  chains = draft_model(setup)[1] is None
  return setup.exp.beam_size if chains else setup.exp.draft_beam_width


def programs(setup: Setup) -> tuple[Any, Any]:
  """(baseline, speculative): each x [B, S] -> the call's outputs."""
  exp, target, tparams = setup.exp, setup.target, setup.target_params
  dmodel, dparams = draft_model(setup)
  kw = dict(beam_size=exp.beam_size, alpha=exp.beam_alpha, max_decode_len=exp.max_decode_len,
            eos_id=target.config.eos_id)
  base = lambda x: beam.beam_search(target, tparams, x, **kw)
  spec = lambda x: beam.speculative_beam_search(target, tparams, dmodel, dparams, x,
                                                draft_beam_size=draft_width(setup),
                                                gamma=exp.gamma, **kw)
  return base, spec


def example_line(setup: Setup, i: int, j: int, x: np.ndarray, seconds: tuple[float, float],
                 base: beam.BeamOutput, spec: beam.SpecBeamOutput, rows: int) -> dict:
  """Example ``i``'s line, from row ``j`` of host outputs of a batch of ``rows``."""
  exp, ex = setup.exp, setup.examples[i]
  out, st = spec
  same = bool(np.array_equal(base.sequences[j], out.sequences[j])
              and base.steps[j] == out.steps[j])
  eos = setup.target.config.eos_id
  best = lambda seqs: setup.vocab.decode([int(t) for t in seqs[-1] if t not in (0, eos)])
  return {
      "index": i, "id": ex.id, "mode": "beam",
      "baseline_s": seconds[0] / rows, "speculative_s": seconds[1] / rows,
      "batch_baseline_s": seconds[0], "batch_speculative_s": seconds[1], "batch_size": rows,
      "beam_size": exp.beam_size, "draft_beam_size": draft_width(setup),
      "draft_chains": draft_model(setup)[1] is None, "gamma": exp.gamma,
      "beam_alpha": exp.beam_alpha,
      "steps": int(base.steps[j]), "target_calls": int(st.rounds[j]),
      "draft_calls": int(st.draft_calls[j]),
      "steps_per_round": [int(n) for n in st.steps_per_round[j]],
      "matches_baseline": same,
      "max_score_diff": float(np.max(np.abs(base.scores[j] - out.scores[j]))),
      "scores": [float(s) for s in out.scores[j]],
      "output": best(out.sequences[j]), "baseline_output": best(base.sequences[j]),
      "reference": ex.reference, "input_truncated": i in setup.truncated,
      "input_width": int(x.shape[1]),
  }


def summarize(exp: Experiment, records: list[dict]) -> dict:
  """The run's totals, every one recomputable from the lines."""
  n = len(records)
  total = lambda k: float(sum(r[k] for r in records))
  steps, calls = total("steps"), total("target_calls")
  hist = np.sum([r["steps_per_round"] for r in records], axis=0).tolist() if records else []
  return {
      "mode": "beam", "examples": n, "beam_size": exp.beam_size,
      "draft_beam_size": records[0]["draft_beam_size"] if records else exp.draft_beam_width,
      "draft_chains": bool(records and records[0].get("draft_chains")),
      "gamma": exp.gamma, "beam_alpha": exp.beam_alpha,
      "max_decode_len": exp.max_decode_len, "batch_size": exp.batch_size,
      "baseline_s": total("baseline_s"), "speculative_s": total("speculative_s"),
      "speedup": total("baseline_s") / max(total("speculative_s"), 1e-12),
      "beam_steps": int(steps), "target_calls": int(calls),
      "draft_calls": int(total("draft_calls")),
      "target_calls_per_step": calls / max(steps, 1.0),
      "steps_per_round": steps / max(calls, 1.0),
      "steps_per_round_histogram": hist,
      "matches_baseline": int(sum(r["matches_baseline"] for r in records)),
      "max_score_diff": max((r["max_score_diff"] for r in records), default=0.0),
  }


def row(s: dict) -> str:
  """The result in one line."""
  draft = "greedy chains" if s.get("draft_chains") else f"u={s['draft_beam_size']}"
  return (f"beam search w={s['beam_size']} vs speculative beam search {draft} "
          f"γ={s['gamma']}: {s['examples']} examples, speedup {s['speedup']:.2f}x, "
          f"{s['target_calls_per_step']:.3f} target calls per beam step "
          f"({s['steps_per_round']:.2f} steps per round), all beams identical on "
          f"{s['matches_baseline']}/{s['examples']}")


def run_beam(setup: Setup, workdir: Workdir) -> dict:
  """Compiles both programs for every input width, then times both on every
  example not yet in ``workdir``."""
  exp = setup.exp
  base_fn, spec_fn = programs(setup)
  done = {r["index"] for r in workdir.records}
  todo = [i for i in range(exp.num_warmup, len(setup.examples)) if i not in done]
  batches = [pad_batch(setup.inputs, [todo[i] for i in idx], exp.batch_size, exp.input_buckets)
             for idx in batch_indices(len(todo), 0, exp.batch_size)]
  warm = [pad_batch(setup.inputs, [i], exp.batch_size, exp.input_buckets)
          for i in range(min(exp.num_warmup, len(setup.examples)))]
  widths = {}
  for x in warm + batches:
    widths.setdefault(int(x.shape[1]), x)
  logging.info("Compiling beam search and speculative beam search for %d input width%s…",
               len(widths), "s" if len(widths) != 1 else "")
  for x in list(widths.values()) + warm:
    jax.block_until_ready((base_fn(x), spec_fn(x)))
  logging.info("Timing beam search and speculative beam search on %d example%s…", len(todo),
               "s" if len(todo) != 1 else "")
  progress = Progress(len(setup.examples) - exp.num_warmup)
  for idx, x in zip(batch_indices(len(todo), 0, exp.batch_size), batches):
    rows = [todo[i] for i in idx]
    base, base_s = timed(lambda: base_fn(x))
    spec, spec_s = timed(lambda: spec_fn(x))
    base, spec = hosts.to_host((base, spec))
    for j, i in enumerate(rows):
      workdir.append(example_line(setup, i, j, x, (base_s, spec_s), base, spec, len(rows)))
    s = summarize(exp, workdir.records)
    progress.update(len(workdir.records), f"speedup {s['speedup']:.2f}x  "
                    f"{s['target_calls_per_step']:.2f} target calls per step")
    workdir.write_summary(s)
  summary = summarize(exp, workdir.records)
  workdir.write_summary(summary)
  return summary
