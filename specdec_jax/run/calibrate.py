"""Everything a run measures before its timed loop (paper §4's protocol):
γ (fixed, kept from an earlier part of the run, or chosen by measurement,
§3.5), the compile-and-warm-up of both programs, the costs c and v
(Definition 3.7 and the verification cost, ``timing``) and each example's
fixed cost before its first step (the prefill, ``account``). Nothing here is
timed into the results; the timed loop is ``loop``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import jax
from absl import logging

from specdec_jax import alpha, data
from specdec_jax.decoding import cache_length
from specdec_jax.run import account, autogamma
from specdec_jax.run.programs import Programs, batch_indices, pad_batch
from specdec_jax.run.setup import Setup
from specdec_jax.timing import Costs, block, measure_costs_many, warm_up_widths

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Calibration:
  """What the timed loop writes beside each example's own measurements.

  gamma: draft tokens per round (0: plain decoding; a tree run's scored
    positions less one).
  gamma_auto: ``autogamma.GammaChoice.as_record()`` for gamma='auto', else None.
  costs: c, v, the step and verification times and the interplay
    (``report.COST_KEYS``), measured at ``gamma`` (plain decoding: at the γ
    the choice found best, the costs that ruled speculation out).
  prefill: input width -> (baseline ms, speculative ms) before the first step.
  """

  gamma: int
  gamma_auto: Optional[dict]
  costs: dict[str, float]
  prefill: dict[int, tuple[float, float]]


def gamma_of_run(setup: Setup, records: Sequence[dict], root: Array
                  ) -> tuple[int, Optional[dict]]:
  """(γ, the choice's record or None) for this run: the fixed one, the tree's
  positions less one, the one an earlier part of this run chose (resume), or
  ``autogamma.choose_gamma`` on the held-out inputs (``Setup.held_out``) or
  else the warm-up examples; 0 is plain decoding."""
  exp = setup.exp
  if exp.tree_shape is not None:
    return exp.verify_gamma, None
  if exp.gamma != "auto":
    return exp.gamma, None
  if records:
    choice = records[0]["gamma_auto"]
    logging.info("gamma='auto': resuming with the gamma chosen before, %d", choice["gamma"])
    return choice["gamma"], choice
  place = setup.partitioner.shard_batch if setup.partitioner else (lambda x: x)
  inputs, n = setup.inputs, exp.num_warmup
  if setup.held_out is not None:
    inputs, n = setup.held_out, len(setup.held_out)
  batches = [(place(x), rows) for x, rows in alpha.alpha_batches(inputs, n, exp.batch_size)]
  choice = autogamma.choose_gamma(setup.target, setup.target_params, setup.draft, batches, root,
                                  exp.sampling, exp.max_decode_len, exp.auto_gamma_max,
                                  setup.partitioner)
  return choice.gamma, choice.as_record()


def warm_up(setup: Setup, progs: Programs, root: Array) -> None:
  """Compiles and runs both programs, untimed: on the warm-up examples (or
  the first batch), on every input bucket the examples use, and for an
  adaptive run every verification width (its code is generated on its first
  run, per program: ``timing.warm_up_widths``)."""
  exp = setup.exp
  t0 = time.perf_counter()
  for idx in (list(batch_indices(exp.num_warmup, 0, exp.batch_size)) or [[0]]):
    x = pad_batch(setup.inputs, idx, exp.batch_size, exp.input_buckets)
    block(progs.baseline(x, root))
    block(progs.speculative(x, root))
  adaptive = exp.adaptive
  if exp.input_buckets or adaptive is not None:
    batches = [pad_batch(setup.inputs, idx, exp.batch_size, exp.input_buckets)
               for idx in batch_indices(len(setup.examples), 0, exp.batch_size)]
    groups = data.by_width(batches)  # one program per input bucket
  if exp.input_buckets:
    for group in groups.values():
      block(progs.baseline(batches[group[0]], root))
      block(progs.speculative(batches[group[0]], root))
    logging.info("Input buckets used: %s", sorted(groups))
  if adaptive is not None:
    for length, group in sorted(groups.items()):
      seen = warm_up_widths(lambda x: progs.speculative(x, root), (batches[i] for i in group),
                            adaptive.verify_widths(progs.gamma))
      logging.info("Adaptive warm-up ran verification widths %s (inputs of length %d)",
                   sorted(seen), length)
  logging.info("Warm-up (compilation included) took %.1f s", time.perf_counter() - t0)


def costs_many(setup: Setup, gammas: Sequence[int]) -> dict[int, Costs]:
  """``timing.measure_costs_many`` at each γ in ``gammas`` (one interleaved
  measurement) on the run's first input, at the loop's cache length for the
  largest γ, placed as the run's partitioner places the loops' arrays."""
  exp = setup.exp
  return measure_costs_many(setup.target, setup.target_params, setup.draft,
                            pad_batch(setup.inputs, [0], exp.batch_size, exp.input_buckets),
                            gammas, exp.sampling,
                            cache_len=cache_length(exp.max_decode_len, max(gammas)),
                            repeats=exp.cost_repeats, partitioner=setup.partitioner)


def costs_at(setup: Setup, gamma: int) -> dict[str, float]:
  """c and v at ``gamma`` (``costs_many``) with the step times
  behind them, in the form every line carries."""
  c = costs_many(setup, [gamma])[gamma]
  costs = {"c": c.c, "v": c.v, "target_step_ms": 1e3 * c.target_step_s,
           "verify_ms": 1e3 * c.verify_s, "draft_token_ms": 1e3 * c.draft_token_s,
           "interplay": c.interplay}
  logging.info("Costs: c %.3f, v %.2f (target step %.2f ms, verification %.2f ms, draft "
               "token %.3f ms), interplay %.2f", c.c, c.v, costs["target_step_ms"],
               costs["verify_ms"], costs["draft_token_ms"], c.interplay)
  return costs


def prefill(setup: Setup, todo: Sequence[int], gamma: int, plain: bool
            ) -> dict[int, tuple[float, float]]:
  """Each example's fixed cost before its first step or round (the encoders
  and caches), timed per input width of the batches ``todo`` makes: the
  whole-run account (``account``). Plain decoding's speculative loop is the
  baseline, and so is its prefill."""
  exp = setup.exp
  place = setup.partitioner.shard_batch if setup.partitioner else (lambda x: x)
  first = {}
  for idx in batch_indices(len(todo), 0, exp.batch_size):
    x = pad_batch(setup.inputs, [todo[i] for i in idx], exp.batch_size, exp.input_buckets)
    first.setdefault(int(x.shape[1]), place(x))
  ms = account.prefill_ms(setup.target, setup.target_params, setup.draft, first,
                          exp.max_decode_len, gamma, repeats=max(1, exp.cost_repeats // 3))
  if plain:
    ms = {w: (b, b) for w, (b, _) in ms.items()}
  logging.info("Prefill ms (baseline, speculative) by input width: %s",
               {w: (round(b, 2), round(p, 2)) for w, (b, p) in ms.items()})
  return ms


def calibrate(setup: Setup, progs: Programs, gamma_auto: Optional[dict], todo: Sequence[int],
              root: Array) -> Calibration:
  """Warm-up, costs and prefill, in that order, for the examples ``todo``."""
  warm_up(setup, progs, root)
  # Plain decoding: the costs at the γ the choice found best (what ruled it out).
  cost_gamma = progs.gamma if not progs.plain else int(gamma_auto["argmax"])
  costs = costs_at(setup, cost_gamma)
  return Calibration(progs.gamma, gamma_auto, costs,
                     prefill(setup, todo, cost_gamma, progs.plain))
