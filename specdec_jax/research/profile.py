"""Where the time of one speculative round goes (paper §2.3, Algorithm 1; §3.4).

A round of ``decoding.speculative_decode`` is: the draft proposes γ tokens
(γ serial draft steps), the target scores γ+1 positions in one pass,
``standardize`` turns its logits into p (§2.2), ``speculative_sampling``
accepts a prefix and picks the next token (Algorithm 1), and the rest is
bookkeeping (writing tokens into the sequence, EOS and length cuts,
statistics). Theorem 3.8's walltime model counts only the first two; this
module times each piece at the shapes the loop runs them at, and the whole
round, so that what the model leaves out (the engine's own overhead) is
measured rather than guessed:

  rest = full round - (draft + target pass + standardize p + kernel)

and splits the rest in two with a third measurement, the four pieces chained
in one loop exactly as a round runs them but with no bookkeeping (the next
round starts at n + accepted + 1 of a fixed token sequence):

  interplay   = chained pieces - sum of the pieces timed alone
  bookkeeping = full round - chained pieces

Each piece runs ``inner`` times back to back inside one jitted ``fori_loop``
(the caches carried from one call to the next, inputs alternating between
two prepared sets so that nothing is loop-invariant), so Python dispatch is
not counted, as in the decoding loop. A piece's outputs are summed into the
loop carry so XLA cannot drop any of its work; the sum is a few µs, counted
in the piece. ``standardize`` is timed together with the kernel, its real
consumer (XLA fuses across the two, as it does in the loop):
standardize p = (standardize p + kernel) - kernel.

The full round is measured on the real loop: ``speculative_decode`` on
examples (batch 1), minus the same example's prefill (encoders, cross K/V,
empty caches; timed by its own jitted call), divided by the target calls.
Every timing is the median over ``repeats`` interleaved passes (pieces and
examples alternate, so machine drift hits all alike); compile excluded;
``block_until_ready`` before reading the clock.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import ModuleType
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec_jax import sampling as sampling_lib
from specdec_jax import speculative as speculative_lib
from specdec_jax.decoding import AdaptiveConfig, speculative_decode, temperature_sample
from specdec_jax.drafts.base import (ApproximationModel, adaptive_proposal, drawn_probability,
                                     gather_positions, init_draft, top_probability)
from specdec_jax.models.t5 import T5Model
from specdec_jax.sampling import SamplingConfig, standardize
from specdec_jax.speculative import speculative_sampling
from specdec_jax.timing import interleaved_medians_ms, speculative_prefill, warm_up_widths

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class RoundProfile:
  """Milliseconds per round of each piece (medians), for one (T, γ)."""

  temperature: float
  gamma: int
  draft_ms: float          # draft.propose: γ serial draft steps (incl. their standardize q)
  standardize_q_ms: float  # γ single-row standardize calls (part of draft_ms; shown alone)
  target_ms: float         # target.decode over γ+1 tokens
  standardize_p_ms: float  # standardize(logits [B, γ+1, V])
  kernel_ms: float         # speculative_sampling
  chained_ms: float        # the four pieces in one loop, no bookkeeping
  round_ms: float          # one round of speculative_decode, measured on examples
  rounds: int              # target calls over the examples (per repeat)
  tokens: int              # tokens generated over the examples (per repeat)

  @property
  def pieces_ms(self) -> float:
    return self.draft_ms + self.target_ms + self.standardize_p_ms + self.kernel_ms

  @property
  def rest_ms(self) -> float:
    return self.round_ms - self.pieces_ms

  @property
  def interplay_ms(self) -> float:
    return self.chained_ms - self.pieces_ms

  @property
  def bookkeeping_ms(self) -> float:
    return self.round_ms - self.chained_ms


def _pick(stack: Any, i: Array) -> Any:
  """Element i % 2 of a pytree of arrays stacked on a leading axis of 2."""
  return jax.tree_util.tree_map(lambda a: a[i % 2], stack)


def _total(tree: Any) -> Array:
  return sum(jnp.sum(a.astype(jnp.float32)) for a in jax.tree_util.tree_leaves(tree))


@functools.partial(jax.jit, static_argnames=("gamma", "sampling", "n"))
def _draft_loop(draft: ApproximationModel, state, seqs, lengths, key, gamma: int,
                sampling: SamplingConfig, n: int):
  def body(i, carry):
    state, acc = carry
    tokens, q, state = draft.propose(state, _pick(seqs, i), _pick(lengths, i), gamma, sampling,
                                     jax.random.fold_in(key, i))
    return state, acc + _total((tokens, q))
  return jax.lax.fori_loop(0, n, body, (state, jnp.float32(0)))[1]


@functools.partial(jax.jit, static_argnames=("model", "n"))
def _target_loop(model: T5Model, params, cache, tokens, positions, n: int):
  def body(i, carry):
    cache, acc = carry
    logits, cache = model.decode(params, _pick(tokens, i), _pick(positions, i), cache)
    return cache, acc + jnp.sum(logits)
  return jax.lax.fori_loop(0, n, body, (cache, jnp.float32(0)))[1]


@functools.partial(jax.jit, static_argnames=("sampling", "n"))
def _standardize_q_loop(logits_rows, sampling: SamplingConfig, n: int):
  """n standardize calls on one [B, V] row each (as the draft makes them)."""
  def body(i, acc):
    return acc + jnp.sum(standardize(_pick(logits_rows, i), sampling))
  return jax.lax.fori_loop(0, n, body, jnp.float32(0))


@functools.partial(jax.jit, static_argnames=("sampling", "with_standardize", "n"))
def _kernel_loop(key, xs, q, p_or_logits, sampling: SamplingConfig, with_standardize: bool,
                 n: int):
  def body(i, acc):
    p = _pick(p_or_logits, i)
    if with_standardize:
      p = standardize(p, sampling)
    out = speculative_sampling(jax.random.fold_in(key, i), _pick(xs, i), _pick(q, i), p,
                               1.0, sampling.greedy)
    return acc + _total(out)
  return jax.lax.fori_loop(0, n, body, jnp.float32(0))


@functools.partial(jax.jit, static_argnames=("target", "gamma", "sampling", "n"))
def _chain_loop(target: T5Model, params, draft: ApproximationModel, tcache, dstate, seq,
                start: int, key, gamma: int, sampling: SamplingConfig, n: int):
  """n rounds of the four pieces back to back, each round starting where
  the previous one's verdict left off (n + accepted + 1 over a fixed
  sequence, wrapping back to ``start`` before running off the cache)."""
  b = seq.shape[0]
  offsets = jnp.arange(gamma + 1, dtype=jnp.int32)[None]
  limit = tcache.cache_len - gamma - 2

  def body(i, carry):
    tcache, dstate, length, acc = carry
    k_draft, k_kernel = jax.random.split(jax.random.fold_in(key, i))
    xs, q, dstate = draft.propose(dstate, seq, length, gamma, sampling, k_draft)
    pos = length[:, None] + offsets
    tokens = jnp.concatenate([gather_positions(seq, pos[:, :1]), xs], axis=1)
    logits, tcache = target.decode(params, tokens, pos, tcache)
    out = speculative_sampling(k_kernel, xs, q, standardize(logits, sampling), 1.0,
                               sampling.greedy)
    length = length + out.num_accepted + 1
    length = jnp.where(length > limit, start, length)
    return tcache, dstate, length, acc + _total(out)
  length = jnp.full((b,), start, jnp.int32)
  return jax.lax.fori_loop(0, n, body, (tcache, dstate, length, jnp.float32(0)))[3]


@functools.partial(jax.jit, static_argnames=("target", "gamma", "sampling"))
def _one_round_inputs(target: T5Model, params, draft: ApproximationModel, tcache, dstate,
                      seq, length, key, gamma: int, sampling: SamplingConfig):
  """One real proposal and target pass at ``length``: the kernel's inputs."""
  xs, q, _ = draft.propose(dstate, seq, length, gamma, sampling, key)
  b = seq.shape[0]
  offsets = jnp.arange(gamma + 1, dtype=jnp.int32)[None]
  seq = seq.at[jnp.arange(b)[:, None], length[:, None] + offsets[:, 1:]].set(xs)
  pos = length[:, None] + offsets
  tokens = gather_positions(seq, pos)
  logits, _ = target.decode(params, tokens, pos, tcache)
  return xs, q, logits, tokens, pos


def _stack2(a: Any, b: Any) -> Any:
  return jax.tree_util.tree_map(lambda x, y: jnp.stack([x, y]), a, b)


def piece_fns(target: T5Model, params: Any, draft: ApproximationModel, inputs: Array,
              gamma: int, sampling: SamplingConfig, cache_len: int, position: int,
              inner: int, key: Array) -> dict[str, Callable[[], Any]]:
  """Zero-argument callables timing ``inner`` runs of each piece at batch
  ``inputs.shape[0]``, at decoder positions ``position`` and ``position + 1``
  (alternating), over caches of length ``cache_len``."""
  b = inputs.shape[0]
  tcache, dstate = speculative_prefill(target, params, draft, inputs, cache_len)
  # A plausible committed prefix: random tokens after the start token.
  seq = jax.random.randint(jax.random.fold_in(key, 7), (b, cache_len + 1), 2,
                           target.config.vocab_size, dtype=jnp.int32)
  seq = seq.at[:, 0].set(target.config.decoder_start_id)
  lengths = [jnp.full((b,), position + j, jnp.int32) for j in range(2)]
  made = [_one_round_inputs(target, params, draft, tcache, dstate, seq, n, jax.random.fold_in(
      key, j), gamma, sampling) for j, n in enumerate(lengths)]
  xs, q, logits, tokens, pos = (_stack2(made[0][i], made[1][i]) for i in range(5))
  p = jax.vmap(lambda lg: standardize(lg, sampling))(logits)
  rows = logits[:, :, 0]                     # [2, B, V]: one row per draft-like call
  seqs, lens = _stack2(seq, seq), jnp.stack(lengths)
  return {
      "draft": lambda: _draft_loop(draft, dstate, seqs, lens, key, gamma, sampling, inner),
      "standardize_q": lambda: _standardize_q_loop(rows, sampling, inner * gamma),
      "target": lambda: _target_loop(target, params, tcache, tokens, pos, inner),
      "kernel": lambda: _kernel_loop(key, xs, q, p, sampling, False, inner),
      "standardize_kernel": lambda: _kernel_loop(key, xs, q, logits, sampling, True, inner),
      "chained": lambda: _chain_loop(target, params, draft, tcache, dstate, seq, position, key,
                                     gamma, sampling, inner),
  }


def _seconds(fn: Callable[[], Any]) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t0


def profile_round(target: T5Model, params: Any, draft: ApproximationModel,
                  examples: Sequence[Array], gamma: int, sampling: SamplingConfig,
                  max_decode_len: int, position: int = 32, inner: int = 8,
                  repeats: int = 5, seed: int = 0) -> RoundProfile:
  """Times one round's pieces and the full round (see module docstring).

  ``examples``: encoder inputs [1, S] each (one padded length, so one
  compilation); the first is also where the pieces' caches come from.
  """
  key = jax.random.PRNGKey(seed)
  cache_len = max_decode_len + gamma + 1
  fns = piece_fns(target, params, draft, examples[0], gamma, sampling, cache_len, position,
                  inner, key)

  def spec(x):
    return speculative_decode(target, params, draft, x, key, gamma=gamma,
                              max_decode_len=max_decode_len, sampling=sampling,
                              eos_id=target.config.eos_id)

  def prefill(x):
    return speculative_prefill(target, params, draft, x, cache_len)

  for fn in fns.values():  # compile + warm up
    jax.block_until_ready(fn())
  outs = [jax.block_until_ready(spec(x)) for x in examples]
  jax.block_until_ready(prefill(examples[0]))
  rounds = sum(int(o.stats.target_calls[0]) for o in outs)
  tokens = sum(int(o.length[0]) for o in outs)
  times: dict[str, list[float]] = {k: [] for k in list(fns) + ["round"]}
  for _ in range(repeats):
    for name, fn in fns.items():
      times[name].append(_seconds(fn) / inner)
    loop_s = 0.0
    for x in examples:  # each example back to back with its own prefill
      loop_s += _seconds(lambda: spec(x)) - _seconds(lambda: prefill(x))
    times["round"].append(loop_s / rounds)
  med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
  return RoundProfile(
      temperature=sampling.temperature, gamma=gamma, draft_ms=med["draft"],
      standardize_q_ms=med["standardize_q"], target_ms=med["target"],
      standardize_p_ms=med["standardize_kernel"] - med["kernel"], kernel_ms=med["kernel"],
      chained_ms=med["chained"], round_ms=med["round"], rounds=rounds, tokens=tokens)


class ContentionRow(NamedTuple):
  """One k-token target pass with ``megabytes`` of other data read before it."""

  k: int
  megabytes: float
  pass_ms: float       # the target pass in that loop, the read's own time subtracted
  alone_ms: float      # the same pass with nothing read in between
  read_ms: float       # reading the buffer alone

  @property
  def slowdown(self) -> float:
    return self.pass_ms / self.alone_ms


def decode_working_set_mb(config: Any) -> float:
  """MB of parameters one cached decode step reads: the decoder's layers
  (cross-attention K/V projections excluded: they run once per example) and
  the logits matrix (the embedding when tied); float32, as the demo stores them."""
  d, inner, ff = config.d_model, config.num_heads * config.head_dim, config.d_ff
  mlp = (3 if config.gated else 2) * d * ff
  layer = 4 * d * inner + 2 * d * inner + mlp
  return 4 * (config.num_decoder_layers * layer + d * config.vocab_size) / 2 ** 20


@functools.partial(jax.jit, static_argnames=("model", "n"))
def _polluted_target_loop(model: T5Model, params, cache, tokens, positions, junk, n: int):
  """n k-token target passes, each after a full read of ``junk`` (a stand-in
  for the draft's weights and caches evicting the target's from the shared
  cache); the read feeds the carry so neither can be dropped or hoisted."""
  def body(i, carry):
    cache, acc = carry
    acc = acc + jnp.sum(junk * (1.0 + acc * 1e-30)) * 1e-9
    logits, cache = model.decode(params, _pick(tokens, i), _pick(positions, i), cache)
    return cache, acc + jnp.sum(logits[..., :8]) * 1e-9
  return jax.lax.fori_loop(0, n, body, (cache, jnp.float32(0)))[1]


@functools.partial(jax.jit, static_argnames=("n",))
def _read_loop(junk, n: int):
  return jax.lax.fori_loop(
      0, n, lambda i, acc: acc + jnp.sum(junk * (1.0 + acc * 1e-30)) * 1e-9, jnp.float32(0))


def cache_contention(model: T5Model, params: Any, inputs: Array, ks: Sequence[int],
                     megabytes: Sequence[float], cache_len: int, position: int = 32,
                     inner: int = 16, repeats: int = 11) -> list[ContentionRow]:
  """How much a k-token target pass slows down when other data passes
  through the caches between passes, as the draft's steps do in a round.

  Theorem 3.8's cost model adds the two models' times as if each ran alone;
  timed alone (``timing.measure_costs``), a target whose decode working set
  is about the size of the last-level cache keeps much of it there from one
  pass to the next. In a round the draft's steps evict part of it first.
  Each k is timed with nothing read in between and after reading a buffer of
  each size; the buffer's own read time (timed alone) is subtracted.
  Interleaved repeats, medians, compile excluded.
  """
  b = inputs.shape[0]
  cache = model.init_cache(params, model.encode(params, inputs), inputs, cache_len)
  sizes = [0.0] + [float(m) for m in megabytes if m > 0]
  bufs = {m: jnp.ones((max(int(m * 2 ** 18), 1),), jnp.float32) for m in sizes}
  fns: dict[Any, Callable[[], Any]] = {}
  for k in ks:
    tok = jnp.full((2, b, k), 3, jnp.int32)
    pos = position + jnp.arange(2, dtype=jnp.int32)[:, None, None] + jnp.arange(k)[None, None]
    pos = jnp.broadcast_to(pos, (2, b, k))
    for m in sizes:
      fns[(k, m)] = functools.partial(_polluted_target_loop, model, params, cache, tok, pos,
                                      bufs[m], inner)
  for m in sizes[1:]:
    fns[("read", m)] = functools.partial(_read_loop, bufs[m], inner)
  med = interleaved_medians_ms(fns, repeats, inner)
  rows = []
  for k in ks:
    for m in sizes:
      read = med[("read", m)] if m else 0.0  # size 0: a one-element buffer
      rows.append(ContentionRow(k, m, med[(k, m)] - read, med[(k, 0.0)], read))
  return rows


class AdaptivePieceRow(NamedTuple):
  """ms per call of a round's two model pieces at k proposals, as the fixed-γ
  loop runs them and as an adaptive round (γ_max) runs them."""
  k: int
  draft_fixed_ms: float      # draft.propose(γ = k)
  draft_adaptive_ms: float   # draft.propose_adaptive(γ_max, limit k, threshold 0)
  verify_fixed_ms: float     # target.decode over k + 1 tokens (cache written inside)
  verify_adaptive_ms: float  # lax.switch over widths 1..γ_max of decode_rows, + write_rows


@functools.partial(jax.jit, static_argnames=("gamma", "sampling", "n", "adaptive"))
def _propose_loop(draft, state, seq, limit, gamma: int, sampling: SamplingConfig, n: int,
                  adaptive: bool, position: int = 32):
  def body(i, carry):
    state, acc = carry
    length = jnp.full((seq.shape[0],), position, jnp.int32) + i % 2
    key = jax.random.PRNGKey(i)
    if adaptive:
      xs, _, count, _, state = draft.propose_adaptive(state, seq, length, gamma, sampling, key,
                                                      limit, 0.0)
      return state, acc + jnp.sum(xs[:, 0]) + jnp.sum(count)
    xs, _, state = draft.propose(state, seq, length, gamma, sampling, key)
    return state, acc + jnp.sum(xs[:, 0])
  return jax.lax.fori_loop(0, n, body, (state, 0))[1]


@functools.partial(jax.jit, static_argnames=("model", "k", "widths", "n"))
def _verify_loop(model: T5Model, params, cache, branch, k: int, widths: tuple, n: int,
                 position: int = 32):
  """n target passes over k + 1 tokens: direct ``decode`` (widths ()) or the
  adaptive loop's ``lax.switch`` over ``decode_rows`` at ``widths`` (branch
  chosen at run time, as in a round) followed by ``write_rows``."""
  b, g = cache.self_k[0].shape[0], max(widths or (k,))

  def rows_at(w, cache, start):
    pos = start + jnp.broadcast_to(jnp.arange(w + 1, dtype=jnp.int32), (b, w + 1))
    logits, rows = model.decode_rows(params, jnp.full((b, w + 1), 3, jnp.int32), pos, cache)
    return (jnp.sum(logits[..., :8]),) + T5Model.pad_rows(rows, pos, g + 1)

  def body(i, carry):
    cache, acc = carry
    start = position + i % 2
    if not widths:
      pos = start + jnp.broadcast_to(jnp.arange(k + 1, dtype=jnp.int32), (b, k + 1))
      logits, cache = model.decode(params, jnp.full((b, k + 1), 3, jnp.int32), pos, cache)
      return cache, acc + jnp.sum(logits[..., :8])
    x, rows, rpos = jax.lax.switch(branch, [functools.partial(rows_at, w) for w in widths],
                                   cache, start)
    return model.write_rows(cache, rows, rpos), acc + x
  return jax.lax.fori_loop(0, n, body, (cache, jnp.float32(0)))[1]


def adaptive_pieces(target: T5Model, params: Any, draft: ApproximationModel, inputs: Array,
                    ks: Sequence[int], gamma_max: int, sampling: SamplingConfig,
                    cache_len: int, inner: int = 16, repeats: int = 11
                    ) -> list[AdaptivePieceRow]:
  """What an adaptive round pays for its machinery (issue 11 items 4 and 6):
  the draft's k proposals through ``propose`` (the fixed-γ loop) and through
  ``propose_adaptive`` with γ_max and a limit of k (its early-exit
  while_loop), and the target's pass over k + 1 tokens directly and as the
  adaptive loop runs it (``lax.switch`` over widths 1..γ_max, rows written
  after the switch). Same tokens and positions; interleaved repeats, medians,
  compile excluded."""
  b = inputs.shape[0]
  cache = target.init_cache(params, target.encode(params, inputs), inputs, cache_len)
  state = draft.init(inputs, cache_len)
  seq = jnp.full((b, cache_len + 1), 3, jnp.int32)
  widths = tuple(range(1, gamma_max + 1))
  fns: dict[Any, Callable[[], Any]] = {}
  for k in ks:
    limit = jnp.full((b,), k, jnp.int32)
    fns[("df", k)] = functools.partial(_propose_loop, draft, state, seq, limit, k, sampling,
                                       inner, False)
    fns[("da", k)] = functools.partial(_propose_loop, draft, state, seq, limit, gamma_max,
                                       sampling, inner, True)
    fns[("vf", k)] = functools.partial(_verify_loop, target, params, cache, jnp.int32(0), k,
                                       (), inner)
    fns[("va", k)] = functools.partial(_verify_loop, target, params, cache,
                                       jnp.int32(widths.index(k)), k, widths, inner)
  med = interleaved_medians_ms(fns, repeats, inner)
  return [AdaptivePieceRow(k, med[("df", k)], med[("da", k)], med[("vf", k)], med[("va", k)])
          for k in ks]


def adaptive_pieces_markdown(rows: Sequence[AdaptivePieceRow]) -> str:
  lines = ["| k | draft propose ms | draft propose_adaptive ms | ratio | target decode ms "
           "| switch branch + write ms | ratio |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r.k} | {r.draft_fixed_ms:.3f} | {r.draft_adaptive_ms:.3f} "
                 f"| {r.draft_adaptive_ms / r.draft_fixed_ms:.2f} | {r.verify_fixed_ms:.3f} "
                 f"| {r.verify_adaptive_ms:.3f} | {r.verify_adaptive_ms / r.verify_fixed_ms:.2f} |")
  return "\n".join(lines)


# ------------------------------- an adaptive rule's rounds, replayed


class _RoundCounting:
  """A draft wrapper whose state is (inner state, round counter); only
  adaptive rounds (``propose_adaptive``) are supported."""

  @property
  def vocab_size(self) -> int:
    return self.inner.vocab_size

  def init(self, inputs: Array, cache_len: int) -> Any:
    return self.inner.init(inputs, cache_len), jnp.zeros((), jnp.int32)

  def init_with_target(self, inputs: Array, cache_len: int, target_encoded: Array) -> Any:
    # Without this the engine's prefill would call ``init``, and a bridged
    # draft would run the target's encoder a second time (timed as rounds).
    return init_draft(self.inner, inputs, cache_len, target_encoded), jnp.zeros((), jnp.int32)

  def propose(self, state, seq, length, gamma, sampling, key):
    raise NotImplementedError(f"{type(self).__name__} only runs adaptive rounds")

  def commit(self, state, seq, length):
    return self.inner.commit(state[0], seq, length), state[1]

  @property
  def wants_target_states(self) -> bool:
    return bool(getattr(self.inner, "wants_target_states", False))

  def commit_with_target(self, state, seq, length, hidden, positions):
    return self.inner.commit_with_target(state[0], seq, length, hidden, positions), state[1]


@struct.dataclass
class WidthSchedule(_RoundCounting):
  """A draft whose r-th round proposes exactly ``widths[r]`` tokens (capped by
  the loop's limit): ``inner``'s ``propose_adaptive`` with that limit and
  threshold 0, so it never stops on confidence. A data-independent adaptive
  rule for profiling; ``widths`` [R] int32 is traced, so every schedule of
  one length shares one compiled loop. Run it under an ``AdaptiveConfig``
  with threshold 0 (the rule's own stopping is bypassed), and with
  skip_below 0 if the schedule holds 0 (a round with no proposal: a plain
  target step)."""

  inner: Any
  widths: Array

  def propose_adaptive(self, state, seq, length, gamma, sampling, key, limit, threshold,
                       skip_below=None):
    del threshold, skip_below  # width 0 in the schedule is a skipped round
    inner, r = state
    cap = jnp.minimum(limit, self.widths[jnp.minimum(r, self.widths.shape[0] - 1)])
    tokens, q, count, steps, inner = adaptive_proposal(self.inner, inner, seq, length, gamma,
                                                       sampling, key, cap, 0.0)
    return tokens, q, count, steps, (inner, r + 1)


class _Sink:
  """Host-side store for ``_RecordWidths`` (identity-hashed: a static field)."""

  def __init__(self):
    self.widths: dict[int, int] = {}

  def put(self, r, count) -> None:
    self.widths[int(r)] = int(count)


@struct.dataclass
class _RecordWidths(_RoundCounting):
  """``inner`` unchanged, each round's proposal count (row 0) sent to ``sink``."""

  inner: Any
  sink: _Sink = struct.field(pytree_node=False)

  def propose_adaptive(self, state, seq, length, gamma, sampling, key, limit, threshold,
                       skip_below=None, cumulative=False, drawn=False):
    inner, r = state
    tokens, q, count, steps, inner = adaptive_proposal(
        self.inner, inner, seq, length, gamma, sampling, key, limit, threshold, skip_below,
        cumulative, drawn)
    jax.debug.callback(self.sink.put, r, jnp.clip(count[0], 0, limit[0]))
    return tokens, q, count, steps, (inner, r + 1)


class ReplayRow(NamedTuple):
  setting: str            # 'rule', 'replay', 'shuffled', 'width k' or 'fixed k'
  ms_per_round: float     # (total time - prefill) / target calls, summed over examples
  tokens_per_call: float
  speedup: float          # tokens/s over the interleaved baseline's


class ReplayResult(NamedTuple):
  rows: list[ReplayRow]
  gamma_hist: list[int]   # the rule's rounds per width (Σ over examples)
  predicted_ms: float     # Σ_w hist(w) · ms(width w) / Σ_w hist(w)


def adaptive_replay(target: T5Model, params: Any, draft: ApproximationModel, inputs: Array,
                    key: Array, adaptive: AdaptiveConfig, gamma_max: int, sampling: SamplingConfig,
                    max_decode_len: int, eos_id: int = 1, repeats: int = 2,
                    seed: int = 0) -> ReplayResult:
  """What an adaptive rule's rounds cost, decided by the rule and replayed.

  For each example (a row of ``inputs``, batch 1) the rule's per-round
  proposal counts are recorded, then the same rounds are run again by
  ``WidthSchedule`` (replay: same widths in the same order, so with the same
  key the same proposals, verdicts and tokens, checked) and shuffled (the same
  widths per example, permuted with ``seed``), and at each constant width
  1..γ_max (and 0, a round without proposals, for a rule with skip_below),
  and the fixed-γ loop at each γ 1..γ_max (what the rule competes with:
  'width k' is the adaptive loop, which pays for per-row counts, its
  while_loop and ``lax.switch``). Timed per example, interleaved with the plain baseline and the
  example's prefill (both encoders and caches, ``_prefill``), which is
  subtracted before dividing by the rounds; the order of the settings
  reverses every repeat. If ms per round at constant
  widths predicts the replay but not the rule, the excess comes from the
  rule's stopping itself, not from varying widths (docs/benchmarks_history.md,
  "Per-round overhead"). Compile excluded; ``block_until_ready`` before
  each clock read; times are sums over examples and repeats.
  """
  widths = tuple(range(1, gamma_max + 1))
  # With skip_below the rule may propose nothing (width 0); skip_below 0
  # compiles that branch into the replay loop without ever skipping on its own
  # (a confidence is > 0).
  skip = adaptive.skip_below is not None
  plain = AdaptiveConfig("threshold", threshold=0.0, widths=widths,
                         skip_below=0.0 if skip else None)
  rule_cfg = dataclasses.replace(adaptive, widths=widths)
  widths = plain.verify_widths(gamma_max)
  kw = dict(max_decode_len=max_decode_len, sampling=sampling, eos_id=eos_id)
  rounds = max_decode_len + 1  # each round commits >= 1 token
  sink = _Sink()

  def spec(d, cfg):
    return lambda x, k: speculative_decode(target, params, d, x, k, gamma=gamma_max,
                                           adaptive=cfg, **kw)

  rng = np.random.default_rng(seed)
  examples = []
  for i in range(inputs.shape[0]):
    x, k = inputs[i:i + 1], jax.random.fold_in(key, i)
    sink.widths.clear()
    ref = jax.block_until_ready(spec(_RecordWidths(draft, sink), rule_cfg)(x, k))
    n = int(ref.stats.target_calls[0])
    w = np.ones(rounds, np.int32)
    w[:n] = [sink.widths[r] for r in range(n)]
    shuffled = w.copy()
    shuffled[:n] = rng.permutation(w[:n])
    again = spec(WidthSchedule(draft, jnp.asarray(w)), plain)(x, k)
    for name in ("tokens", "length"):
      if not np.array_equal(np.asarray(getattr(again, name)), np.asarray(getattr(ref, name))):
        raise AssertionError(f"example {i}: the replayed rounds' {name} differ from the rule's")
    if not np.array_equal(np.asarray(again.stats.gamma_hist), np.asarray(ref.stats.gamma_hist)):
      raise AssertionError(f"example {i}: the replayed rounds' widths differ from the rule's")
    examples.append((x, k, jnp.asarray(w), jnp.asarray(shuffled)))

  cache_len = max_decode_len + gamma_max + 1
  settings: dict[str, Callable[[Any], Callable]] = {
      "baseline": lambda e: lambda x, k: temperature_sample(target, params, x, k, **kw),
      "prefill": lambda e: lambda x, k: speculative_prefill(target, params, draft, x, cache_len),
      "rule": lambda e: spec(draft, rule_cfg),
      "replay": lambda e: spec(WidthSchedule(draft, e[2]), plain),
      "shuffled": lambda e: spec(WidthSchedule(draft, e[3]), plain)}
  for g in widths:
    constant = WidthSchedule(draft, jnp.full((rounds,), g, jnp.int32))
    settings[f"width {g}"] = (lambda d: lambda e: spec(d, plain))(constant)
  # The fixed-γ loop at each γ: what a rule must beat (its rounds carry no
  # per-row counts, while_loop or lax.switch).
  for g in range(1, gamma_max + 1):
    settings[f"fixed {g}"] = (lambda g: lambda e: lambda x, k: speculative_decode(
        target, params, draft, x, k, gamma=g, **kw))(g)
  # Compile. This also runs every branch of the replay loop once (each
  # constant width); the rule's branches are run by warm_up_widths.
  for make in settings.values():
    jax.block_until_ready(make(examples[0])(*examples[0][:2]))
  warm_up_widths(lambda i: settings["rule"](examples[i])(*examples[i][:2]),
                 range(len(examples)), widths)
  total = {s: 0.0 for s in settings}
  tokens = {s: 0 for s in settings}
  calls = {s: 0 for s in settings}
  hist = np.zeros(gamma_max + 1, np.int64)
  for rep in range(repeats):
    order = list(settings) if rep % 2 == 0 else list(settings)[::-1]
    for e in examples:
      for s in order:
        fn = settings[s](e)
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*e[:2]))
        total[s] += time.perf_counter() - t0
        if s == "prefill":
          continue
        tokens[s] += int(out.length[0])
        if s != "baseline":
          calls[s] += int(out.stats.target_calls[0])
        if s == "rule" and rep == 0:
          hist += np.asarray(out.stats.gamma_hist[0])
  base_rate = tokens["baseline"] / total["baseline"]
  # Per round without the per-example prefill (encoders, caches): a setting
  # with more tokens per round has fewer rounds to spread it over.
  rows = [ReplayRow(s, 1e3 * (total[s] - total["prefill"]) / calls[s], tokens[s] / calls[s],
                    tokens[s] / total[s] / base_rate)
          for s in settings if s not in ("baseline", "prefill")]
  ms = {r.setting: r.ms_per_round for r in rows}
  predicted = sum(hist[g] * ms[f"width {g}"] for g in widths) / max(int(hist.sum()), 1)
  return ReplayResult(rows, hist.tolist(), float(predicted))


# ------------------------- which confidence predicts a draft's acceptance


def auc(score: np.ndarray, label: np.ndarray) -> float:
  """Area under the ROC curve of ``score`` for the boolean ``label``: the
  chance that a random positive scores above a random negative (ties count
  half; Mann-Whitney with mid-ranks). NaN if either class is empty."""
  score, label = np.asarray(score, float).ravel(), np.asarray(label, bool).ravel()
  pos, neg = int(label.sum()), int((~label).sum())
  if not pos or not neg:
    return float("nan")
  values, counts = np.unique(score, return_counts=True)
  mid = np.cumsum(counts) - (counts - 1) / 2  # 1-based mean rank of each distinct value
  ranks = mid[np.searchsorted(values, score)]
  return float((ranks[label].sum() - pos * (pos + 1) / 2) / (pos * neg))


class _ProposalSink:
  """Host-side store of each round's (length, top, drawn) for one example."""

  def __init__(self):
    self.rounds: list[tuple[int, np.ndarray, np.ndarray]] = []

  def put(self, length, top, drawn) -> None:
    self.rounds.append((int(length[0]), np.asarray(top[0]), np.asarray(drawn[0])))


class _Forwarding:
  """A draft wrapper's methods other than ``propose``: all go to ``self.inner``
  (its state is the inner draft's)."""

  @property
  def vocab_size(self) -> int:
    return self.inner.vocab_size

  def init(self, inputs: Array, cache_len: int) -> Any:
    return self.inner.init(inputs, cache_len)

  def init_with_target(self, inputs: Array, cache_len: int, target_encoded: Array) -> Any:
    return init_draft(self.inner, inputs, cache_len, target_encoded)

  def commit(self, state, seq, length):
    return self.inner.commit(state, seq, length)

  @property
  def wants_target_states(self) -> bool:
    return bool(getattr(self.inner, "wants_target_states", False))

  def commit_with_target(self, state, seq, length, hidden, positions):
    return self.inner.commit_with_target(state, seq, length, hidden, positions)


@struct.dataclass
class _RecordConfidence(_Forwarding):
  """``inner`` unchanged in fixed-γ rounds; each round's max_x q_i(x) and
  q_i(x_i) (row 0) go to ``sink``."""

  inner: Any
  sink: _ProposalSink = struct.field(pytree_node=False)

  def propose(self, state, seq, length, gamma, sampling, key):
    tokens, q, state = self.inner.propose(state, seq, length, gamma, sampling, key)
    jax.debug.callback(self.sink.put, length, top_probability(q, None, sampling),
                       drawn_probability(q, None, tokens, sampling))
    return tokens, q, state


class ConfidenceAUC(NamedTuple):
  rounds: int                 # rounds used (each output's last one left out)
  acceptance: list[float]     # P(x_i accepted | x_i evaluated), i = 1..γ
  auc: dict[str, float]       # 'top' / 'drawn' -> AUC for x_i's acceptance


def confidence_auc(target: T5Model, params: Any, draft: ApproximationModel, inputs: Array,
                   key: Array, gamma: int, sampling: SamplingConfig, max_decode_len: int,
                   eos_id: int = 1) -> ConfidenceAUC:
  """How well each confidence an adaptive rule can read after x_i
  (``AdaptiveConfig.confidence``: 'top' = max_x q_i(x), 'drawn' = q_i(x_i))
  predicts whether the target accepts x_i, in the engine's own fixed-γ
  rounds at T > 0 (batch 1, one row of ``inputs`` at a time).

  A round's accepted count n comes from the next round's start: the round
  commits n + 1 tokens. Each output's last round is left out (its count is
  cut at EOS or max_decode_len). Position i (1-based) was evaluated when
  i <= n + 1 and accepted when i <= n. No timing: load does not matter.
  """
  if sampling.greedy:
    raise ValueError("confidence_auc compares confidences at T > 0; at T = 0 q is one-hot "
                     "and 'top' and 'drawn' are the same")
  sink = _ProposalSink()
  wrapped = _RecordConfidence(draft, sink)
  top, drawn, n = [], [], []
  for i in range(inputs.shape[0]):
    sink.rounds.clear()
    jax.block_until_ready(speculative_decode(
        target, params, wrapped, inputs[i:i + 1], jax.random.fold_in(key, i), gamma=gamma,
        max_decode_len=max_decode_len, sampling=sampling, eos_id=eos_id).tokens)
    for (start, t, d), (nxt, _, _) in zip(sink.rounds, sink.rounds[1:]):
      top.append(t)
      drawn.append(d)
      n.append(nxt - start - 1)
  if not n:
    raise ValueError("no output took two rounds: nothing to measure")
  top, drawn, n = np.stack(top), np.stack(drawn), np.asarray(n)
  i = np.arange(gamma)[None]
  evaluated, accepted = i <= n[:, None], i < n[:, None]
  return ConfidenceAUC(
      rounds=len(n),
      acceptance=[float(accepted[evaluated[:, j], j].mean()) for j in range(gamma)],
      auc={"top": auc(top[evaluated], accepted[evaluated]),
           "drawn": auc(drawn[evaluated], accepted[evaluated])})


class EngineRecords(NamedTuple):
  """The draft's view of every evaluated proposal in the engine's own
  fixed-γ rounds (``engine_records``): row r is x_i of one round, i =
  ``index[r]`` + 1, evaluated by the target (i <= accepted count + 1)."""
  example: np.ndarray     # [N] int: the row of ``inputs``
  round: np.ndarray       # [N] int: the round within the example
  index: np.ndarray       # [N] int: i - 1
  hidden: np.ndarray      # [N, d]: the draft's final hidden state that q_i comes from
  top: np.ndarray         # [N]: max of the draft's own softmax (its T = 0 confidence)
  second: np.ndarray      # [N]: the second largest probability of that softmax
  entropy: np.ndarray     # [N]: its entropy (nats)
  accepted: np.ndarray    # [N] bool
  gamma: int


class _StepSink:
  """Host-side store for ``engine_records``: round starts and draft steps, in order."""

  def __init__(self):
    self.events: list[tuple] = []

  def round(self, length) -> None:
    self.events.append(("round", int(length[0])))

  def step(self, hidden, logits) -> None:
    logits = np.asarray(logits[0], np.float64)
    z = np.exp(np.where(np.isfinite(logits), logits - logits.max(), -np.inf))
    prob = np.sort(z / z.sum())[::-1]
    nz = prob[prob > 0]
    self.events.append(("step", np.asarray(hidden[0], np.float32), prob[0], prob[1],
                        float(-(nz * np.log(nz)).sum())))


@struct.dataclass
class _MarkRounds(_Forwarding):
  """``inner`` (a ``T5Draft`` with ``observe`` set) unchanged; each fixed-γ
  round's start length (row 0) goes to ``sink`` before its draft steps."""

  inner: Any
  sink: _StepSink = struct.field(pytree_node=False)

  def propose(self, state, seq, length, gamma, sampling, key):
    jax.debug.callback(self.sink.round, length, ordered=True)
    return self.inner.propose(state, seq, length, gamma, sampling, key)


def engine_records(target: T5Model, params: Any, draft: Any, inputs: Array, key: Array,
                   gamma: int, sampling: SamplingConfig, max_decode_len: int,
                   eos_id: int = 1) -> EngineRecords:
  """What a stopping rule could read, and the verdicts, in the engine's own
  rounds: ``speculative_decode`` at fixed γ on each row of ``inputs`` (batch
  1) with a ``T5Draft`` that reports every draft step (``observe``), so a
  bridged or shortlisted draft is seen exactly as the engine runs it (its
  feature bridge at the staleness a γ-round gives). A round's accepted count
  n comes from the next round's start (it commits n + 1 tokens); each
  example's last round is left out (cut at EOS or max_decode_len). No timing.
  """
  if not hasattr(draft, "observe"):
    raise ValueError(f"engine_records needs a T5Draft (it reports its steps), got "
                     f"{type(draft).__name__}")
  sink = _StepSink()
  wrapped = _MarkRounds(draft.replace(observe=sink.step), sink)
  # speculative_decode is jitted: the parameters stay arguments (a closure
  # would bake them into the program as constants).
  run = lambda x, k: speculative_decode(target, params, wrapped, x, k, gamma=gamma,
                                        max_decode_len=max_decode_len, sampling=sampling,
                                        eos_id=eos_id).length
  cols: dict[str, list] = {f: [] for f in EngineRecords._fields if f != "gamma"}
  for e in range(inputs.shape[0]):
    sink.events.clear()
    jax.block_until_ready(run(inputs[e:e + 1], jax.random.fold_in(key, e)))
    rounds: list[tuple[int, list]] = []
    for ev in sink.events:
      if ev[0] == "round":
        rounds.append((ev[1], []))
      else:
        rounds[-1][1].append(ev[1:])
    for r, ((start, steps), (nxt, _)) in enumerate(zip(rounds, rounds[1:])):
      if len(steps) != gamma:
        raise AssertionError(f"example {e}, round {r}: {len(steps)} draft steps, not γ {gamma}")
      n = nxt - start - 1
      for i, (h, top, second, ent) in enumerate(steps[:n + 1]):
        for f, v in zip(cols, (e, r, i, h, top, second, ent, i < n)):
          cols[f].append(v)
  if not cols["example"]:
    raise ValueError("no output took two rounds: nothing to record")
  return EngineRecords(**{f: np.stack(v) if f == "hidden" else np.asarray(v)
                          for f, v in cols.items()}, gamma=gamma)


def along_outputs(rec: EngineRecords
                  ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
  """At T = 0: per example, the draft's confidence (``top``) and its verdict
  at each output position in order, for ``theory.simulate_stopping``
  (every position is evaluated in exactly one round, as x_i with the
  committed prefix), and whether a draft step saw the position: a bonus
  position (after a round of γ acceptances) had no proposal; it gets
  confidence 1 and accepted."""
  conf, ok, seen = [], [], []
  for e in np.unique(rec.example):
    c, o, m = [], [], []
    mine = np.flatnonzero(rec.example == e)
    for r in np.unique(rec.round[mine]):
      rows = mine[rec.round[mine] == r]
      rows = rows[np.argsort(rec.index[rows])]
      c.extend(rec.top[rows])
      o.extend(rec.accepted[rows])
      m.extend([True] * len(rows))
      if len(rows) == rec.gamma and rec.accepted[rows].all():
        c.append(1.0)
        o.append(True)
        m.append(False)
    conf.append(np.asarray(c, float))
    ok.append(np.asarray(o, bool))
    seen.append(np.asarray(m, bool))
  return conf, ok, seen


def _head_features(rec: EngineRecords, hidden: bool) -> np.ndarray:
  eps = 1e-9
  cols = [rec.top, np.log(rec.top + eps), rec.top - rec.second, rec.entropy,
          np.log(rec.second + eps)]
  parts = [np.stack(cols, 1), np.eye(rec.gamma)[rec.index]]
  return np.concatenate(parts + ([rec.hidden] if hidden else []), 1).astype(np.float64)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3,
                 iterations: int = 50) -> Callable[[np.ndarray], np.ndarray]:
  """L2-regularized logistic regression by Newton's method on standardized
  features; returns x -> P(y = 1 | x)."""
  mu, sd = x.mean(0), x.std(0) + 1e-6
  z = np.concatenate([(x - mu) / sd, np.ones((len(x), 1))], 1)
  w = np.zeros(z.shape[1])
  reg = np.full(z.shape[1], l2 * len(x))
  reg[-1] = 0.0  # no penalty on the bias
  for _ in range(iterations):
    pr = 1.0 / (1.0 + np.exp(-z @ w))
    grad = z.T @ (pr - y) + reg * w
    hess = (z * (pr * (1 - pr))[:, None]).T @ z + np.diag(reg)
    step = np.linalg.solve(hess, grad)
    w -= step
    if np.abs(step).max() < 1e-8:
      break
  return lambda q: 1.0 / (1.0 + np.exp(-np.concatenate(
      [(q - mu) / sd, np.ones((len(q), 1))], 1) @ w))


def head_auc(train: EngineRecords, test: EngineRecords, l2: float = 1e-3) -> dict[str, float]:
  """How well an acceptance predictor trained on ``train``'s rounds predicts
  x_i's acceptance in ``test``'s (AUC on test): 'top' (the draft's top
  probability alone, untrained), 'scalars' (a logistic regression on the
  softmax's top, second, margin, entropy and i) and 'hidden' (the same plus
  the draft's hidden state: SpecDec++'s acceptance head, Huang et al. 2024,
  as a linear probe)."""
  out = {"top": auc(test.top, test.accepted)}
  for name, hidden in (("scalars", False), ("hidden", True)):
    predict = fit_logistic(_head_features(train, hidden), train.accepted.astype(float), l2)
    out[name] = auc(predict(_head_features(test, hidden)), test.accepted)
  return out


def adaptive_replay_markdown(result: ReplayResult) -> str:
  lines = ["| setting | ms per round | tokens per target call | speedup | ms per round / "
           "predicted from constant widths |", "|---|---|---|---|---|"]
  for r in result.rows:
    ratio = (f"{r.ms_per_round / result.predicted_ms:.3f}"
             if r.setting in ("rule", "replay", "shuffled") else "")
    lines.append(f"| {r.setting} | {r.ms_per_round:.3f} | {r.tokens_per_call:.2f} "
                 f"| {r.speedup:.3f}x | {ratio} |")
  lines.append(f"\nrule's rounds per width (0..γ_max): {result.gamma_hist}; predicted ms "
               f"per round from the constant widths: {result.predicted_ms:.3f}")
  return "\n".join(lines)


def contention_markdown(rows: Sequence[ContentionRow]) -> str:
  lines = ["| k | MB read before each pass | pass ms (read subtracted) | alone ms | slowdown "
           "| read alone ms |", "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r.k} | {r.megabytes:g} | {r.pass_ms:.3f} | {r.alone_ms:.3f} "
                 f"| {r.slowdown:.2f}x | {r.read_ms:.3f} |")
  return "\n".join(lines)


def markdown(rows: Sequence[RoundProfile]) -> str:
  """The profile as a markdown table (ms per round; % of the full round)."""
  head = ("| T | γ | draft propose (γ steps) | [of which standardize q] | target pass (γ+1) "
          "| standardize p | kernel | sum of pieces | chained pieces | full round "
          "| rest = round − sum (%) | of which interplay | of which bookkeeping "
          "| standardize p + kernel (%) | rounds | tokens/round |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  lines = [head]
  for r in rows:
    pct = lambda x: f"{x:.3f} ({100 * x / r.round_ms:.1f}%)"
    lines.append(
        f"| {r.temperature:g} | {r.gamma} | {r.draft_ms:.3f} | [{r.standardize_q_ms:.3f}] "
        f"| {r.target_ms:.3f} | {r.standardize_p_ms:.3f} | {r.kernel_ms:.3f} "
        f"| {r.pieces_ms:.3f} | {r.chained_ms:.3f} | {r.round_ms:.3f} | {pct(r.rest_ms)} "
        f"| {r.interplay_ms:.3f} | {r.bookkeeping_ms:.3f} "
        f"| {pct(r.standardize_p_ms + r.kernel_ms)} | {r.rounds} "
        f"| {r.tokens / r.rounds:.2f} |")
  return "\n".join(lines)


# ------------------------------------------- the kernel against a revision


def modules_at(rev: str) -> tuple[ModuleType, ModuleType]:
  """``sampling.py`` and ``speculative.py`` as they were at git revision
  ``rev``, loaded as private modules; the old kernel calls the old sampler."""
  mods = []
  for name in ("sampling", "speculative"):
    src = subprocess.run(["git", "show", f"{rev}:specdec_jax/{name}.py"], check=True,
                         capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
      f.write(src)
    mod_name = f"_{name}_at_{rev.replace('-', '_').replace('~', '_')}"
    spec = importlib.util.spec_from_file_location(mod_name, f.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    os.remove(f.name)  # the module is loaded; the source file is not needed again
    mods.append(mod)
  old_sampling, old_speculative = mods
  for fn in ("argmax", "sample_any", "sample", "standardize"):  # rebind to that revision's
    if hasattr(old_speculative, fn) and hasattr(old_sampling, fn):
      setattr(old_speculative, fn, getattr(old_sampling, fn))
  return old_sampling, old_speculative


@functools.partial(jax.jit, static_argnames=("mods", "temperature", "n"))
def _acceptance_loop(key, xs, q, logits, mods: tuple, temperature: float, n: int):
  """n runs of standardize(logits) + speculative_sampling, as a round makes them."""
  samp, spec = mods
  config = samp.SamplingConfig(temperature=temperature)

  def body(i, acc):
    p = samp.standardize(_pick(logits, i), config)
    out = spec.speculative_sampling(jax.random.fold_in(key, i), _pick(xs, i), _pick(q, i), p,
                                    1.0, config.greedy)
    return acc + _total(out)
  return jax.lax.fori_loop(0, n, body, jnp.float32(0))


@functools.partial(jax.jit, static_argnames=("samp", "n"))
def _draw_loop(key, logits, samp: ModuleType, n: int):
  """n runs of softmax + sample_any on one row, as a draft step at T > 0."""
  def body(i, acc):
    probs = jax.nn.softmax(_pick(logits, i), axis=-1)
    return acc + jnp.sum(samp.sample_any(jax.random.fold_in(key, i), probs)) + probs[0, 0]
  return jax.lax.fori_loop(0, n, body, jnp.float32(0))


def compare_acceptance(rev: str, vocab_size: int, gammas: Sequence[int],
                       temperatures: Sequence[float], inner: int = 64,
                       repeats: int = 30) -> list[dict]:
  """µs per call of standardize p + kernel, and of softmax + sample_any, for
  the code at ``rev`` and the current code, timed interleaved in one process
  on the same random inputs (batch 1, γ+1 logits rows of ``vocab_size``);
  also whether the kernel's four outputs are identical for the same key."""
  mods = {"rev": modules_at(rev), "now": (sampling_lib, speculative_lib)}
  fns: dict[tuple, Callable[[], Any]] = {}
  same: dict[tuple, list[bool]] = {}
  for temperature in temperatures:
    config = SamplingConfig(temperature=temperature)
    for gamma in gammas:
      key = jax.random.PRNGKey(gamma)
      logits = 4 * jax.random.normal(jax.random.PRNGKey(1), (2, 1, gamma + 1, vocab_size))
      q_logits = logits[:, :, :gamma] + jax.random.normal(jax.random.PRNGKey(2),
                                                          (2, 1, gamma, vocab_size))
      q = jax.vmap(lambda x: standardize(x, config))(q_logits)
      xs = jnp.stack([jax.vmap(lambda row, k: sampling_lib.sample(k, row, config))(
          q[j, 0], jax.random.split(jax.random.fold_in(key, j), gamma))[None] for j in range(2)])
      outs = {}
      for name, (samp, spec) in mods.items():
        fns[(temperature, gamma, name)] = functools.partial(
            _acceptance_loop, key, xs, q, logits, (samp, spec), temperature, inner)
        p = samp.standardize(logits[0], samp.SamplingConfig(temperature=temperature))
        outs[name] = spec.speculative_sampling(key, xs[0], q[0], p, 1.0, config.greedy)
      same[(temperature, gamma)] = [bool(jnp.array_equal(a, b))
                                    for a, b in zip(outs["rev"], outs["now"])]
  rows = jax.random.normal(jax.random.PRNGKey(3), (2, 1, vocab_size))
  for name, (samp, _) in mods.items():
    fns[("draw", name)] = functools.partial(_draw_loop, jax.random.PRNGKey(4), rows, samp, inner)
  for fn in fns.values():  # compile + warm up
    jax.block_until_ready(fn())
  times: dict[tuple, list[float]] = {k: [] for k in fns}
  for _ in range(repeats):
    for k, fn in fns.items():
      times[k].append(_seconds(fn) / inner)
  us = {k: 1e6 * statistics.median(v) for k, v in times.items()}
  result = [dict(what="standardize p + kernel", temperature=t, gamma=g, rev_us=us[(t, g, "rev")],
                 now_us=us[(t, g, "now")], identical=same[(t, g)])
            for t in temperatures for g in gammas]
  result.append(dict(what="softmax + sample_any (one row)", temperature=None, gamma=None,
                     rev_us=us[("draw", "rev")], now_us=us[("draw", "now")], identical=None))
  return result
