"""Everything a run measures before its timed loop (§4): γ (§3.5), the
warm-up, c and v (Definition 3.7) and each example's prefill. Nothing here
is timed into the results.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import jax
import numpy as np
from absl import logging

from specdec_jax import alpha, data
from specdec_jax.decoding import cache_length
from specdec_jax.run import account, autogamma, logs
from specdec_jax.run.programs import Programs, batch_indices, pad_batch
from specdec_jax.run.setup import Setup
from specdec_jax.theory import RoundCost
from specdec_jax.timing import block, measure_costs_many, warm_up_widths

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Calibration:
  """What the timed loop writes beside each example's own measurements.

  gamma_auto: ``GammaChoice.as_record()`` for gamma='auto', else None.
  costs: the round's cost at the run's γ (plain decoding: at the best γ,
    which ruled speculation out); for 'auto', the choice's own measurement.
  prefill: input width -> (baseline ms, speculative ms) before the first step.
  """

  gamma_auto: Optional[dict]
  costs: RoundCost
  prefill: dict[int, tuple[float, float]]


def gamma_of_run(setup: Setup, records: Sequence[dict], root: Array
                 ) -> tuple[int, Optional[autogamma.GammaChoice]]:
  """(γ, gamma='auto''s choice or None): the fixed γ or tree's N - 1, the
  choice an earlier part of the run made, or ``autogamma.choose_gamma`` on the
  held-out or warm-up inputs with costs timed here. 0 is plain decoding."""
  exp = setup.exp
  if exp.tree_shape is not None:
    return exp.gamma_max, None
  if exp.gamma != "auto":
    return exp.gamma, None
  if records:
    choice = autogamma.GammaChoice.from_record(records[0]["gamma_auto"])
    logging.info("gamma='auto': resuming with the gamma chosen before, %d", choice.gamma)
    return choice.gamma, choice
  place = setup.partitioner.shard_batch if setup.partitioner else (lambda x: x)
  inputs, n = setup.inputs, exp.num_warmup
  if setup.held_out is not None:
    inputs, n = setup.held_out, len(setup.held_out)
  batches = [(place(x), rows) for x, rows in alpha.alpha_batches(inputs, n, exp.batch_size)]
  logging.info("Choosing γ (§3.5): α along the target's outputs for %d example%s, then c and v "
               "for γ = 1..%d (each compiled once)…", n, "s" if n != 1 else "",
               exp.gamma_max)
  choice = autogamma.choose_gamma(setup.target, setup.target_params, setup.draft, batches, root,
                                  exp.sampling, exp.max_decode_len, exp.gamma_max,
                                  setup.partitioner,
                                  costs=costs_many(setup, range(1, exp.gamma_max + 1)))
  return choice.gamma, choice


def warm_up(setup: Setup, progs: Programs, root: Array) -> float:
  """Compiles and runs both programs untimed on the warm-up examples, every
  input bucket used and (adaptive) every verification width; -> the fastest
  pace per compiled program, at which later steps are estimated."""
  exp = setup.exp
  t0 = time.perf_counter()
  warm = [pad_batch(setup.inputs, idx, exp.batch_size, exp.input_buckets)
          for idx in (list(batch_indices(exp.num_warmup, 0, exp.batch_size)) or [[0]])]
  adaptive = exp.adaptive
  bucketed = []
  if exp.input_buckets or adaptive is not None:
    batches = [pad_batch(setup.inputs, idx, exp.batch_size, exp.input_buckets)
               for idx in batch_indices(len(setup.examples), 0, exp.batch_size)]
    groups = data.by_width(batches)  # one program per input bucket
    if exp.input_buckets:
      bucketed = [batches[group[0]] for group in groups.values()]
  widths = list(dict.fromkeys(int(x.shape[1]) for x in warm + bucketed))
  what = "the baseline program" if progs.plain else "the baseline and speculative programs"
  logging.info("Compiling %s for %d input width%s (%s) and warming them up…", what,
               len(widths), "s" if len(widths) > 1 else "", ", ".join(map(str, widths)))
  done: dict[int, float] = {}

  def run_both(x: np.ndarray) -> None:
    t = time.perf_counter()
    block(progs.baseline(x, root))
    t_base = time.perf_counter() - t
    block(progs.speculative(x, root))
    width = int(x.shape[1])
    if width in done:
      return
    done[width] = time.perf_counter() - t
    left = len(widths) - len(done)
    times = (f"{done[width]:.1f} s" if progs.plain else
             f"baseline {t_base:.1f} s, speculative {done[width] - t_base:.1f} s")
    # The fastest width so far: the first may also pay one-time costs.
    logging.info("  width %d: %s%s", width, times,
                 f" (about {left * min(done.values()):.0f} s more for the other {left})"
                 if left else "")

  for x in warm + bucketed:
    run_both(x)
  if exp.input_buckets:
    logging.info("Input buckets used: %s", sorted(groups), extra=logs.DETAIL)
  if adaptive is not None:
    logging.info("Running each verification width of the adaptive program once…")
    for length, group in sorted(groups.items()):
      seen = warm_up_widths(lambda x: progs.speculative(x, root), (batches[i] for i in group),
                            adaptive.verify_widths(progs.gamma))
      logging.info("Adaptive warm-up ran verification widths %s (inputs of length %d)",
                   sorted(seen), length, extra=logs.DETAIL)
  logging.info("Warm-up (compilation included) took %.1f s", time.perf_counter() - t0,
               extra=logs.DETAIL)
  return min(done.values()) / (1 if progs.plain else 2)


def costs_many(setup: Setup, gammas: Sequence[int]) -> dict[int, RoundCost]:
  """``timing.measure_costs_many`` at each γ in ``gammas`` on the run's first input."""
  exp = setup.exp
  return measure_costs_many(setup.target, setup.target_params, setup.draft,
                            pad_batch(setup.inputs, [0], exp.batch_size, exp.input_buckets),
                            gammas, exp.sampling,
                            cache_len=cache_length(exp.max_decode_len, max(gammas)),
                            repeats=exp.cost_repeats, partitioner=setup.partitioner)


def costs_at(setup: Setup, gamma: int, measured: Optional[dict[int, RoundCost]] = None
             ) -> RoundCost:
  """The round's cost at ``gamma``, from ``measured`` or timed now."""
  c = (measured or {}).get(gamma) or costs_many(setup, [gamma])[gamma]
  logging.info("Costs: c %.3f, v %.2f (target step %.2f ms, verification %.2f ms, draft "
               "token %.3f ms), interplay %.2f", *c.record().values(), extra=logs.DETAIL)
  return c


def prefill(setup: Setup, todo: Sequence[int], gamma: int, plain: bool
            ) -> dict[int, tuple[float, float]]:
  """Each example's fixed cost before its first step (encoders, caches) per
  input width of ``todo``'s batches; plain decoding's is the baseline's."""
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
               {w: (round(b, 2), round(p, 2)) for w, (b, p) in ms.items()}, extra=logs.DETAIL)
  return ms


def prefill_widths(setup: Setup, todo: Sequence[int]) -> int:
  """How many input widths the batches of ``todo`` are padded to."""
  exp = setup.exp
  return len({int(pad_batch(setup.inputs, [todo[i] for i in idx], exp.batch_size,
                            exp.input_buckets).shape[1])
              for idx in batch_indices(len(todo), 0, exp.batch_size)})


def calibrate(setup: Setup, progs: Programs, gamma_auto: Optional[autogamma.GammaChoice],
              todo: Sequence[int], root: Array) -> Calibration:
  """Warm-up, costs (gamma='auto': its choice's) and prefill for ``todo``."""
  pace = warm_up(setup, progs, root)
  # Plain decoding: the costs at the γ the choice found best (what ruled it out).
  cost_gamma = progs.gamma if not progs.plain else gamma_auto.argmax
  reused = gamma_auto.costs if gamma_auto is not None else None
  # The cost pieces and prefill's two per width: each about half a loop's compile.
  pieces = (0 if reused is not None else 4) + 2 * prefill_widths(setup, todo)
  logging.info("Measuring %sthe prefill (%d small programs to compile, then %d "
               "interleaved repeats; about %.0f s at the warm-up's pace)…",
               "" if reused is not None else "c, v and ", pieces, setup.exp.cost_repeats,
               pieces * pace / 2)
  costs = costs_at(setup, cost_gamma, reused)
  if setup.exp.tree_shape is not None:   # a tree's round: one draft call per depth
    costs = dataclasses.replace(costs, draft_calls=setup.exp.tree_shape.max_depth)
  return Calibration(None if gamma_auto is None else gamma_auto.as_record(), costs,
                     prefill(setup, todo, cost_gamma, progs.plain))
