"""The timed loop (§4): each batch decoded by the baseline and by speculative
decoding with the same inputs and key, one line of ``examples.jsonl`` per
example; ``run_alpha_only`` (§4.2, Table 3) averages Σ_x min(p, q) along the
target's outputs."""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from absl import logging

from specdec_jax import alpha
from specdec_jax.decoding import temperature_sample
from specdec_jax.drafts.base import capabilities
from specdec_jax.run import calibrate, hosts
from specdec_jax.run.calibrate import Calibration
from specdec_jax.run.counts import RowCounts
from specdec_jax.run.programs import Programs, batch_indices, pad_batch, programs
from specdec_jax.run.report import Progress, summarize, summarize_alpha
from specdec_jax.run.settings import Experiment
from specdec_jax.run.setup import Setup
from specdec_jax.run.workdir import Workdir
from specdec_jax.timing import timed


def detokenize(vocab, tokens: np.ndarray) -> str:
  return vocab.decode([int(t) for t in tokens])


def counts_of(setup: Setup, progs: Programs, out: Any) -> RowCounts:
  """The speculative program's per-row counts, on the host."""
  if progs.plain:
    return RowCounts.of_plain(hosts.to_host(out.length))
  if setup.exp.tree_shape is not None:
    return RowCounts.of_tree(hosts.to_host(out.stats), setup.exp.tree_shape)
  return RowCounts.of_chain(hosts.to_host(out.stats))


def run_info(exp: Experiment, gamma: int, cal: Calibration) -> dict[str, Any]:
  """What every line carries about the run: its round's cost and γ (or tree)."""
  if exp.tree_shape is not None:
    kind = {"tree": exp.tree, "tree_nodes": exp.tree_shape.num_nodes,
            "tree_depth": exp.tree_shape.max_depth}
  else:
    kind = {"gamma": gamma, **({} if cal.gamma_auto is None
                               else {"gamma_auto": cal.gamma_auto})}
  return {**cal.costs.record(), **kind}


def example_line(setup: Setup, i: int, j: int, x: np.ndarray, seconds: tuple[float, float],
                 outputs: tuple[Any, Any], counts: RowCounts, progs: Programs,
                 cal: Calibration, batch_size: int) -> dict[str, Any]:
  """Example ``i``'s line: row ``j`` of a batch x [B, S]; ``outputs``:
  (tokens [B, T], length [B]) of each loop, on the host."""
  (base_tok, base_len), (spec_tok, spec_len) = outputs
  base_s, spec_s = seconds
  ex, width = setup.examples[i], int(x.shape[1])
  return {
      "index": i, "id": ex.id,
      "baseline_s": base_s / batch_size, "speculative_s": spec_s / batch_size,
      "batch_baseline_s": base_s, "batch_speculative_s": spec_s, "batch_size": batch_size,
      "baseline_tokens": int(base_len[j]), "tokens": int(spec_len[j]),
      **counts.line(j),
      "tokens_per_target_call": int(spec_len[j]) / max(int(counts.target_calls[j]), 1),
      "matches_baseline": bool(np.array_equal(base_tok[j], spec_tok[j])),
      "output": detokenize(setup.vocab, spec_tok[j]),
      "baseline_output": detokenize(setup.vocab, base_tok[j]),
      "reference": ex.reference, "input_truncated": i in setup.truncated,
      "mode": "speculative", "input_width": width,
      "prefill_baseline_ms": cal.prefill[width][0],
      "prefill_speculative_ms": cal.prefill[width][1],
      **run_info(setup.exp, progs.gamma, cal),
  }


class ETA:
  """Seconds left in the timed loop: the pace since the first batch (which may
  pay one-time costs), or the first's until a second is done."""

  def __init__(self, total: int):
    self.total, self.start = total, time.perf_counter()
    self.first: tuple[int, float] | None = None   # (examples, time) after the first batch

  def update(self, done: int) -> float:
    now = time.perf_counter()
    if self.first is None:
      self.first = (done, now)
      return (now - self.start) / done * (self.total - done)
    n0, t0 = self.first
    return (now - t0) / max(done - n0, 1) * (self.total - done)


def _progress_text(s: dict, eta: float) -> str:
  alpha_text = "" if s["alpha"] is None or np.isnan(s["alpha"]) else f"α {s['alpha']:.2f}  "
  return f"{alpha_text}speedup {s['speedup']:.2f}x  ETA {eta:.0f} s"


def run_speculative(setup: Setup, workdir: Workdir) -> dict:
  """Calibrates, then times both loops on every example not yet in ``workdir``."""
  exp = setup.exp
  root = jax.random.PRNGKey(exp.seed)
  gamma, gamma_auto = calibrate.gamma_of_run(setup, workdir.records, root)
  progs = programs(setup, gamma)
  todo = pending(exp, len(setup.examples), workdir, alpha_only=False)
  cal = calibrate.calibrate(setup, progs, gamma_auto, todo, root)
  logging.info("Timing the baseline and %s on %d example%s (the ETA follows the first)…",
               "plain decoding" if progs.plain else "speculative decoding", len(todo),
               "s" if len(todo) != 1 else "")
  processed = 0
  eta = ETA(len(todo))
  progress = Progress(len(setup.examples) - exp.num_warmup)
  for idx in batch_indices(len(todo), 0, exp.batch_size):
    rows = [todo[i] for i in idx]
    x = pad_batch(setup.inputs, rows, exp.batch_size, exp.input_buckets)
    key = jax.random.fold_in(root, rows[0])
    base, base_s = timed(lambda: progs.baseline(x, key))
    spec, spec_s = timed(lambda: progs.speculative(x, key))
    counts = counts_of(setup, progs, spec)
    outputs = hosts.to_host(((base.tokens, base.length), (spec.tokens, spec.length)))
    for j, i in enumerate(rows):
      workdir.append(example_line(setup, i, j, x, (base_s, spec_s), outputs, counts, progs,
                                  cal, len(rows)))
    processed += len(rows)
    s = summarize(exp, workdir.records)
    progress.update(len(workdir.records), _progress_text(s, eta.update(processed)))
    workdir.write_summary(s)
  summary = summarize(exp, workdir.records)
  workdir.write_summary(summary)
  return summary


def pending(exp: Experiment, n_examples: int, workdir: Workdir, alpha_only: bool) -> list[int]:
  """Indices still to decode (warm-up examples are never measured)."""
  if alpha_only and sum(r["tokens"] for r in workdir.records) >= exp.alpha_only_tokens:
    return []
  done = {r["index"] for r in workdir.records}
  return [i for i in range(exp.num_warmup, n_examples) if i not in done]


def min_pq_sums(setup: Setup, x: Any, key: Any) -> tuple[Any, Any, Any]:
  """(the target's outputs, Σ min(p, q) [B], positions evaluated [B]) for a
  placed batch x [B, S] (Corollary 3.6)."""
  exp, target, tparams = setup.exp, setup.target, setup.target_params
  if capabilities(setup.draft).target_states:
    # Its q depends on where rounds start: measured in the engine's own rounds.
    return alpha.min_pq_in_rounds(target, tparams, setup.draft, x, key, exp.gamma_max,
                                  exp.max_decode_len, exp.sampling, setup.partitioner)
  out = temperature_sample(target, tparams, x, key, max_decode_len=exp.max_decode_len,
                           sampling=exp.sampling, eos_id=target.config.eos_id,
                           partitioner=setup.partitioner)
  sums = alpha.min_pq_along(target, tparams, setup.draft, x, out.tokens, out.length, exp.sampling)
  return out, sums, out.length


def run_alpha_only(setup: Setup, workdir: Workdir) -> dict:
  """§4.2: E[sum_x min(p, q)] along the target's tokens, on the run's examples
  (warm-up skipped) until ``alpha_only_tokens``."""
  exp = setup.exp
  root = jax.random.PRNGKey(exp.seed)
  todo = pending(exp, len(setup.examples), workdir, alpha_only=True)
  logging.info("Generating with the target and summing min(p, q) along its outputs until %d "
               "tokens (the first batch compiles both)…", exp.alpha_only_tokens)
  progress = Progress(exp.alpha_only_tokens)
  for idx in batch_indices(len(todo), 0, exp.batch_size):
    if sum(r["tokens"] for r in workdir.records) >= exp.alpha_only_tokens:
      break
    rows = [todo[k] for k in idx]
    x = pad_batch(setup.inputs, rows, exp.batch_size, exp.input_buckets)
    if setup.partitioner is not None:
      x = setup.partitioner.shard_batch(x)
    key = jax.random.fold_in(root, rows[0])
    out, sums, evaluated = min_pq_sums(setup, x, key)
    lengths, sums, evaluated = hosts.to_host((out.length, sums, evaluated))
    for j, i in enumerate(rows):
      n, m = int(lengths[j]), int(evaluated[j])
      workdir.append({"index": i, "id": setup.examples[i].id, "mode": "alpha_only",
                      "tokens": n, "evaluated": m, "min_pq_sum": float(sums[j]),
                      "alpha_min_pq": float(sums[j]) / max(m, 1),
                      "input_truncated": i in setup.truncated})
    tokens = sum(r["tokens"] for r in workdir.records)
    progress.update(min(tokens, exp.alpha_only_tokens), "tokens; α {:.2f}".format(
        sum(r["min_pq_sum"] for r in workdir.records) / max(tokens, 1)))
  summary = summarize_alpha(exp, workdir.records, len(setup.examples) - exp.num_warmup)
  workdir.write_summary(summary)
  return summary
