"""The measured loops (paper §4): each timed batch decoded by the baseline
and by speculative decoding with the same inputs, max length, sampling
settings and key, each call ending in ``block_until_ready``.

Measurement protocol:

* the first ``num_warmup`` examples compile and warm both loops, untimed;
* c and v are measured once, up front, with the same jitted pieces;
* per example, one line of ``examples.jsonl`` (appended and flushed as it
  completes); ``summary.json`` is recomputed from all lines, so every number
  it holds can be recomputed from ``examples.jsonl``.

``run_alpha_only`` (paper §4.2, Table 3) generates with the target alone and
averages sum_x min(p, q) along the generated tokens.
"""

from __future__ import annotations

import time
import types
from typing import Any, Optional

import jax
import numpy as np
from absl import logging

from specdec_jax import data
from specdec_jax.decoding import (TreeStats, alpha_estimates, speculative_decode,
                                  temperature_sample, tree_speculative_decode)
from specdec_jax.run import account, autogamma, hosts
from specdec_jax.run.report import Progress, summarize, summarize_alpha
from specdec_jax.run.settings import Experiment
from specdec_jax.run.setup import Setup, held_out_inputs
from specdec_jax.run.workdir import Workdir
from specdec_jax.timing import block, measure_costs, timed, warm_up_widths
from specdec_jax.tree import TreeShape


def batch_indices(n: int, start: int, batch: int):
  for i in range(start, n, batch):
    yield list(range(i, min(i + batch, n)))


def pad_batch(inputs: np.ndarray, idx: list[int], batch: int,
              buckets: tuple = ()) -> np.ndarray:
  """Rows ``idx`` of ``inputs`` as one [batch, width] host array (the last
  row repeated to fill the batch; ignored), padded to the smallest bucket.
  Host arrays: every process builds the same one, and placing it makes the
  global batch."""
  rows = idx + [idx[-1]] * (batch - len(idx))
  return np.asarray(data.fit_to_bucket(inputs[rows], buckets))


def detokenize(vocab, tokens: np.ndarray) -> str:
  return vocab.decode([int(t) for t in tokens])


def _auto_gamma(setup: Setup, workdir: Workdir, root) -> tuple[int, Optional[dict]]:
  """γ for this run: the fixed one, the one an earlier part of this run chose
  (resume), or ``autogamma.choose_gamma`` on the warm-up examples."""
  exp = setup.exp
  if exp.gamma != "auto":
    return exp.gamma, None
  if workdir.records:
    choice = workdir.records[0]["gamma_auto"]
    logging.info("gamma='auto': resuming with the gamma chosen before, %d", choice["gamma"])
    return choice["gamma"], choice
  place = setup.partitioner.shard_batch if setup.partitioner else (lambda x: x)
  inputs, n = setup.inputs, exp.num_warmup
  if exp.auto_alpha_source:
    inputs = held_out_inputs(exp, exp.auto_alpha_source, exp.auto_alpha_examples)
    n = len(inputs)
  batches = [(place(x), rows) for x, rows in autogamma.alpha_batches(inputs, n, exp.batch_size)]
  choice = autogamma.choose_gamma(setup.target, setup.target_params, setup.draft, batches, root,
                                  exp.sampling, exp.max_decode_len, exp.auto_gamma_max,
                                  setup.partitioner)
  return choice.gamma, choice.as_record()


def tree_counts(st: TreeStats, tree: TreeShape) -> tuple[Any, dict]:
  """A tree run's per-row statistics (host arrays) in the chain's record
  fields: a round 'rejects' when it accepts fewer than D levels, so α is the
  rate at which a tree level is accepted through any of its branches (the
  chain's α for a chain). Fields the chain's kernel fills per position
  (accepted_at, evaluated_at, min_pq_sum) stay empty; gamma_hist holds the
  rounds' accepted depths."""
  b = st.target_calls.shape[0]
  rejected = st.target_calls - st.depth_hist[:, tree.max_depth]
  alpha = st.accepted / np.maximum(st.accepted + rejected, 1)
  empty = np.zeros((b, 0), np.int32)
  rows = types.SimpleNamespace(
      target_calls=st.target_calls, draft_calls=st.draft_calls, accepted=st.accepted,
      rejected=rejected, min_pq_sum=np.zeros(b), accepted_at=empty, evaluated_at=empty,
      gamma_hist=st.depth_hist, target_positions=st.target_positions,
      depth_hist=st.depth_hist, rank_hist=st.rank_hist)
  return rows, {"alpha": alpha, "alpha_min_pq": np.full(b, np.nan)}


def run_speculative(setup: Setup, workdir: Workdir) -> dict:
  exp = setup.exp
  sampling = exp.sampling
  target, tparams, draft = setup.target, setup.target_params, setup.draft
  kw = dict(max_decode_len=exp.max_decode_len, sampling=sampling, eos_id=target.config.eos_id,
            partitioner=setup.partitioner)
  place = setup.partitioner.shard_batch if setup.partitioner else (lambda x: x)
  base_fn = lambda x, k: temperature_sample(target, tparams, place(x), k, **kw)
  root = jax.random.PRNGKey(exp.seed)
  tree = exp.tree_shape
  if tree is None:
    gamma, gamma_auto = _auto_gamma(setup, workdir, root)
    spec_fn = lambda x, k: speculative_decode(target, tparams, draft, place(x), k,
                                              gamma=gamma, lenience=exp.lenience,
                                              adaptive=exp.adaptive, **kw)
  else:
    # c, v and the caches are sized by the positions a round scores (N).
    gamma, gamma_auto = exp.verify_gamma, None
    spec_fn = lambda x, k: tree_speculative_decode(target, tparams, draft, place(x), k,
                                                   tree=tree, **kw)
  n_total = len(setup.examples)
  # Warm-up: compile both loops on the warm-up examples (or the first batch).
  t0 = time.perf_counter()
  for idx in (list(batch_indices(exp.num_warmup, 0, exp.batch_size)) or [[0]]):
    x = pad_batch(setup.inputs, idx, exp.batch_size, exp.input_buckets)
    block(base_fn(x, root))
    block(spec_fn(x, root))
  adaptive = exp.adaptive
  if exp.input_buckets or adaptive is not None:
    batches = [pad_batch(setup.inputs, idx, exp.batch_size, exp.input_buckets)
               for idx in batch_indices(n_total, 0, exp.batch_size)]
    groups = data.by_width(batches)  # one program per input bucket
  if exp.input_buckets:
    # Every bucket the examples use compiled and run once here, untimed.
    for group in groups.values():
      block(base_fn(batches[group[0]], root))
      block(spec_fn(batches[group[0]], root))
    logging.info("Input buckets used: %s", sorted(groups))
  if adaptive is not None:
    # Every verification branch run once, untimed (its code is generated on
    # its first run, per program: timing.warm_up_widths); over the examples of
    # each input bucket, as far as needed.
    for length, group in sorted(groups.items()):
      seen = warm_up_widths(lambda x: spec_fn(x, root), (batches[i] for i in group),
                            adaptive.verify_widths(gamma))
      logging.info("Adaptive warm-up ran verification widths %s (inputs of length %d)",
                   sorted(seen), length)
  logging.info("Warm-up (compilation included) took %.1f s", time.perf_counter() - t0)
  c = measure_costs(target, tparams, draft,
                    pad_batch(setup.inputs, [0], exp.batch_size, exp.input_buckets),
                    gamma, sampling, cache_len=exp.max_decode_len + gamma + 1,
                    repeats=exp.cost_repeats, partitioner=setup.partitioner)
  costs = {"c": c.c, "v": c.v, "target_step_ms": 1e3 * c.target_step_s,
           "verify_ms": 1e3 * c.verify_s, "draft_token_ms": 1e3 * c.draft_token_s,
           "interplay": c.interplay}
  logging.info("Costs: c %.3f, v %.2f (target step %.2f ms, verification %.2f ms, draft "
               "token %.3f ms), interplay %.2f", c.c, c.v, costs["target_step_ms"],
               costs["verify_ms"], costs["draft_token_ms"], c.interplay)
  # Each example's fixed cost before its first step or round (the encoders and
  # caches), timed per input width: the whole-run account (``accounting``).
  done_ids = {r["index"] for r in workdir.records}
  todo = [i for i in range(exp.num_warmup, n_total) if i not in done_ids]
  first = {}
  for idx in batch_indices(len(todo), 0, exp.batch_size):
    x = pad_batch(setup.inputs, [todo[i] for i in idx], exp.batch_size, exp.input_buckets)
    first.setdefault(int(x.shape[1]), place(x))
  prefill = account.prefill_ms(target, tparams, draft, first, exp.max_decode_len, gamma,
                               repeats=max(1, exp.cost_repeats // 3))
  logging.info("Prefill ms (baseline, speculative) by input width: %s",
               {w: (round(b, 2), round(p, 2)) for w, (b, p) in prefill.items()})
  extra = {"gamma": gamma} if gamma_auto is None else {"gamma": gamma, "gamma_auto": gamma_auto}
  if tree is not None:
    extra = {"tree": exp.tree, "tree_nodes": tree.num_nodes, "tree_depth": tree.max_depth}

  t_start = time.perf_counter()
  processed = 0
  progress = Progress(n_total - exp.num_warmup)
  for idx in batch_indices(len(todo), 0, exp.batch_size):
    rows = [todo[i] for i in idx]
    x = pad_batch(setup.inputs, rows, exp.batch_size, exp.input_buckets)
    key = jax.random.fold_in(root, rows[0])
    base, base_s = timed(lambda: base_fn(x, key))
    spec, spec_s = timed(lambda: spec_fn(x, key))
    if tree is None:
      alphas = hosts.to_host(alpha_estimates(spec.stats))
      st = hosts.to_host(spec.stats)
    else:
      st, alphas = tree_counts(hosts.to_host(spec.stats), tree)
    base_tok, spec_tok = hosts.to_host((base.tokens, spec.tokens))
    base_len, spec_len = hosts.to_host((base.length, spec.length))
    for j, i in enumerate(rows):
      ex = setup.examples[i]
      workdir.append({
          "index": i, "id": ex.id,
          "baseline_s": base_s / len(rows), "speculative_s": spec_s / len(rows),
          "batch_baseline_s": base_s, "batch_speculative_s": spec_s, "batch_size": len(rows),
          "baseline_tokens": int(base_len[j]), "tokens": int(spec_len[j]),
          "target_calls": int(st.target_calls[j]), "draft_calls": int(st.draft_calls[j]),
          "accepted": int(st.accepted[j]), "rejected": int(st.rejected[j]),
          "min_pq_sum": float(st.min_pq_sum[j]),
          "accepted_at": st.accepted_at[j].tolist(), "evaluated_at": st.evaluated_at[j].tolist(),
          "gamma_hist": st.gamma_hist[j].tolist(),
          **({} if tree is None else {"depth_hist": st.depth_hist[j].tolist(),
                                      "rank_hist": st.rank_hist[j].tolist()}),
          "target_positions": int(st.target_positions[j]),
          "alpha": float(alphas["alpha"][j]), "alpha_min_pq": float(alphas["alpha_min_pq"][j]),
          "tokens_per_target_call": int(spec_len[j]) / max(int(st.target_calls[j]), 1),
          "matches_baseline": bool(np.array_equal(base_tok[j], spec_tok[j])),
          "output": detokenize(setup.vocab, spec_tok[j]),
          "baseline_output": detokenize(setup.vocab, base_tok[j]),
          "reference": ex.reference, "input_truncated": i in setup.truncated,
          "mode": "speculative",
          "input_width": int(x.shape[1]), "prefill_baseline_ms": prefill[int(x.shape[1])][0],
          "prefill_speculative_ms": prefill[int(x.shape[1])][1],
          **costs, **extra,
      })
    processed += len(rows)
    s = summarize(exp, workdir.records)
    eta = (time.perf_counter() - t_start) / processed * (len(todo) - processed)
    progress.update(len(workdir.records),
                    f"α {s['alpha']:.2f}  speedup {s['speedup']:.2f}x  ETA {eta:.0f} s")
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


def run_alpha_only(setup: Setup, workdir: Workdir) -> dict:
  """Paper §4.2: E[sum_x min(p, q)] along tokens generated by the target.

  Uses the same examples as a speculative run (the warm-up ones are skipped:
  nothing here is timed) until ``alpha_only_tokens`` tokens are generated.
  """
  exp = setup.exp
  sampling = exp.sampling
  target, tparams = setup.target, setup.target_params
  root = jax.random.PRNGKey(exp.seed)
  todo = pending(exp, len(setup.examples), workdir, alpha_only=True)
  progress = Progress(exp.alpha_only_tokens)
  for idx in batch_indices(len(todo), 0, exp.batch_size):
    if sum(r["tokens"] for r in workdir.records) >= exp.alpha_only_tokens:
      break
    rows = [todo[k] for k in idx]
    x = pad_batch(setup.inputs, rows, exp.batch_size, exp.input_buckets)
    if setup.partitioner is not None:
      x = setup.partitioner.shard_batch(x)
    key = jax.random.fold_in(root, rows[0])
    if getattr(setup.draft, "wants_target_states", False):
      # Its q depends on where rounds start (the staleness of the target state
      # it reads), so α is measured in the engine's own rounds at γ.
      out, sums, evaluated = autogamma.min_pq_in_rounds(
          target, tparams, setup.draft, x, key, exp.gamma_bound, exp.max_decode_len, sampling,
          setup.partitioner)
    else:
      out = temperature_sample(target, tparams, x, key, max_decode_len=exp.max_decode_len,
                               sampling=sampling, eos_id=target.config.eos_id,
                               partitioner=setup.partitioner)
      sums = autogamma.min_pq_along(target, tparams, setup.draft, x, out.tokens, out.length,
                                    sampling)
      evaluated = out.length
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
