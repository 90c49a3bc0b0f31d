"""Wall-clock measurement (medians, compile excluded) of jitted pieces of what
the loops run, and the theory's cost coefficients: c = draft time per proposed
token / one target step (Def. 3.7); v = target pass over γ+1 tokens / one
step; interplay = the two alternating, as a round runs them / (γ c + v).
Theorem 3.8 assumes v = 1 (§3.3); ``theory.walltime_improvement`` takes v."""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.drafts.base import ApproximationModel, init_draft, proposal_steps
from specdec_jax.theory import RoundCost
from specdec_jax.models.t5 import T5Model
from specdec_jax.partitioning import Partitioner, constrain_cache
from specdec_jax.sampling import SamplingConfig, sample, standardize

Array = jax.Array


def block(x: Any) -> Any:
  return jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready")
                                else a, x)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
  t0 = time.perf_counter()
  out = block(fn())
  return out, time.perf_counter() - t0


median = statistics.median


def interleaved_times(fns: dict[Any, Callable[[], Any]], repeats: int,
                      inner: int = 1) -> dict[Any, list[float]]:
  """The way to time pieces against each other: after one untimed call each, ``repeats``
  passes call every piece in turn -> {key: seconds per inner call in each pass}."""
  for fn in fns.values():
    block(fn())
  times: dict[Any, list[float]] = {key: [] for key in fns}
  for _ in range(repeats):
    for key, fn in fns.items():
      times[key].append(timed(fn)[1] / inner)
  return times


def interleaved_medians_ms(fns: dict[Any, Callable[[], Any]], repeats: int,
                           inner: int = 1) -> dict[Any, float]:
  return {key: 1e3 * median(v) for key, v in interleaved_times(fns, repeats, inner).items()}


def median_se(xs: list[float]) -> float:
  """Robust standard error of a median: 1.2533 σ / sqrt(n), σ = 1.4826 · MAD (0 for n < 2)."""
  if len(xs) < 2:
    return 0.0
  m = statistics.median(xs)
  mad = statistics.median([abs(x - m) for x in xs])
  return 1.2533 * 1.4826 * mad / len(xs) ** 0.5


def total(tree: Any) -> Array:
  return sum((jnp.sum(a.astype(jnp.float32)) for a in jax.tree_util.tree_leaves(tree)),
             jnp.float32(0))


def repeat(body: Callable[[Array, Any], tuple[Any, Any]], carry: Any, n: int) -> tuple[Any, Array]:
  """The way to time a piece: ``body(i, carry)`` for i < n in one ``lax.fori_loop`` (no
  dispatch counted, the carry passed on, outputs summed so nothing is dropped; vary the
  inputs with i, or XLA hoists work) -> (carry, sum)."""
  def step(i, state):
    carry, acc = state
    carry, out = body(i, carry)
    return carry, acc + total(out)
  return jax.lax.fori_loop(0, n, step, (carry, jnp.float32(0)))


@functools.partial(jax.jit, static_argnames=("model", "sampling", "n", "partitioner"))
def target_steps(model: T5Model, params, cache, tokens, positions, key, sampling, n,
                 partitioner: Optional[Partitioner] = None):
  """n decode calls (+ standardize + sample), positions alternating by one."""
  def body(i, cache):
    logits, cache = model.decode(params, tokens, positions + i % 2, cache)
    cache = constrain_cache(cache, partitioner, "target cache")  # the loops' layout
    probs = standardize(logits, sampling)
    tok = sample(jax.random.fold_in(key, i), probs[:, -1], sampling)
    return cache, (tok, probs[..., 0])
  return repeat(body, cache, n)[1]


@functools.partial(jax.jit, static_argnames=("gamma", "sampling", "n"))
def _proposes(draft: ApproximationModel, state, seq, length, key, gamma, sampling, n):
  def body(i, state):
    tokens, q, state = draft.propose(state, seq, length + i % 2, gamma, sampling,
                                     jax.random.fold_in(key, i))
    return state, (tokens, q[..., 0])
  return repeat(body, state, n)[1]


@functools.partial(jax.jit, static_argnames=("model", "gamma", "sampling", "n", "partitioner"))
def _rounds(model: T5Model, params, cache, draft: ApproximationModel, state, seq, length, key,
            gamma, sampling, n, partitioner: Optional[Partitioner] = None):
  """n rounds' model work: γ draft steps, then the target's pass, caches carried."""
  b = seq.shape[0]
  first = jnp.full((b, 1), 3, jnp.int32)

  def body(i, carry):
    cache, state = carry
    k_draft, k_target = jax.random.split(jax.random.fold_in(key, i))
    tokens, q, state = draft.propose(state, seq, length + i % 2, gamma, sampling, k_draft)
    pos = length[:, None] + i % 2 + jnp.arange(gamma + 1, dtype=jnp.int32)[None]
    logits, cache = model.decode(params, jnp.concatenate([first, tokens], 1), pos, cache)
    cache = constrain_cache(cache, partitioner, "target cache")
    probs = standardize(logits, sampling)
    tok = sample(k_target, probs[:, -1], sampling)
    return (cache, state), (tok, q[..., 0], probs[..., 0])
  return repeat(body, (cache, state), n)[1]


@functools.partial(jax.jit, static_argnames=("model", "cache_len"))
def baseline_prefill(model: T5Model, params, inputs, cache_len):
  """The target's encoder and cache (``temperature_sample`` before its first step)."""
  return model.init_cache(params, model.encode(params, inputs), inputs, cache_len)


@functools.partial(jax.jit, static_argnames=("target", "cache_len"))
def speculative_prefill(target: T5Model, params, draft: ApproximationModel, inputs, cache_len: int):
  """Both encoders and caches (``speculative_decode`` before its first round)."""
  encoded = target.encode(params, inputs)
  cache = target.init_cache(params, encoded, inputs, cache_len)
  return cache, init_draft(draft, inputs, cache_len, encoded)


@functools.partial(jax.jit, static_argnames=("cache_len",))
def _draft_init(draft: ApproximationModel, inputs, cache_len):
  return draft.init(inputs, cache_len)


def measure_costs_many(target: T5Model, target_params: Any, draft: ApproximationModel,
                       inputs: Array, gammas: Sequence[int],
                       sampling: SamplingConfig = SamplingConfig(), cache_len: int | None = None,
                       position: int = 16, repeats: int = 15, inner: int = 16,
                       partitioner: Optional[Partitioner] = None) -> dict[int, RoundCost]:
  """Each γ's ``RoundCost`` at ``position``: medians of ``repeats`` passes of ``inner``
  runs, all γ interleaved with one shared step piece, with standard errors. Pass the
  loop's ``cache_len``."""
  gammas = sorted(set(int(g) for g in gammas))
  if not gammas or gammas[0] < 1:
    raise ValueError(f"gammas must be >= 1, got {gammas}")
  b = inputs.shape[0]
  cache_len = max(cache_len or 0, position + gammas[-1] + 3)  # +1: steps alternate positions
  # With a partitioner, arrays are placed as the loops place theirs (their layout timed).
  place = partitioner.shard_batch if partitioner is not None else jnp.asarray
  if not isinstance(inputs, jax.Array) or partitioner is not None and \
      inputs.sharding != partitioner.batch_sharding(inputs.shape):
    inputs = place(np.asarray(inputs))
  cache = baseline_prefill(target, target_params, inputs, cache_len)
  dstate = _draft_init(draft, inputs, cache_len)
  key = jax.random.PRNGKey(0)
  seq = place(np.full((b, cache_len + 1), 3, np.int32))
  length = place(np.full((b,), position, np.int32))
  n = inner

  def target_piece(k):
    tok = place(np.full((b, k), 3, np.int32))
    pos = place(position + np.broadcast_to(np.arange(k, dtype=np.int32), (b, k)))
    return lambda: target_steps(target, target_params, cache, tok, pos, key, sampling, n,
                                partitioner)

  pieces = {"step": target_piece(1)}
  for g in gammas:
    pieces[("verify", g)] = target_piece(g + 1)
    pieces[("draft", g)] = (lambda g=g: _proposes(draft, dstate, seq, length, key, g, sampling, n))
    pieces[("round", g)] = (lambda g=g: _rounds(target, target_params, cache, draft, dstate,
                                                 seq, length, key, g, sampling, n, partitioner))
  times = interleaved_times(pieces, repeats, n)  # seconds per run of each piece
  t_step = median(times["step"])
  out = {}
  for g in gammas:
    t_verify = median(times[("verify", g)])
    # c is one draft call's (Definition 3.7): a chain makes γ, a block draft one.
    k = proposal_steps(draft, g)
    t_draft = median(times[("draft", g)]) / k
    # Per-repeat ratios pair pieces timed under the same load: their spread is the noise.
    c_reps = [d / k / s for d, s in zip(times[("draft", g)], times["step"])]
    v_reps = [vf / s for vf, s in zip(times[("verify", g)], times["step"])]
    r_reps = [r / s for r, s in zip(times[("round", g)], times["step"])]
    interplay = median(times[("round", g)]) / (k * t_draft + t_verify)
    out[g] = RoundCost(g, t_draft / t_step, t_verify / t_step, k, step_ms=1e3 * t_step,
                       interplay=interplay, c_se=median_se(c_reps), v_se=median_se(v_reps),
                       round_se=median_se(r_reps))
  return out


def warm_up_widths(run: Callable[[Array], Any], batches: Iterable[Array],
                   widths: Sequence[int]) -> set[int]:
  """Run ``run`` untimed over ``batches`` until each verify width has run once (XLA:CPU
  compiles a ``lax.switch`` branch on first use) -> the widths seen."""
  ws = sorted(widths)
  seen: set[int] = set()
  for x in batches:
    out = block(run(x))
    hist = np.asarray(out.stats.gamma_hist).reshape(-1, np.shape(out.stats.gamma_hist)[-1])
    for j in np.nonzero(hist.sum(0))[0]:
      seen.add(next(w for w in ws if w >= j))
    if seen >= set(ws):
      break
  return seen
