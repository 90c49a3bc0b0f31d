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

Each piece runs ``inner`` times back to back inside one jitted loop
(``timing.repeat``; the caches carried from one call to the next, inputs alternating between
two prepared sets so that nothing is loop-invariant), so Python dispatch is
not counted, as in the decoding loop. A piece's outputs are summed into the
loop carry so XLA cannot drop any of its work; the sum is a few µs, counted
in the piece. ``standardize`` is timed together with the kernel, its real
consumer (XLA fuses across the two, as it does in the loop):
standardize p = (standardize p + kernel) - kernel.

The full round is measured on the real loop: ``speculative_decode`` on
examples (batch 1), minus the same example's prefill (encoders, cross K/V,
empty caches; timed by its own jitted call), divided by the target calls.
Every timing is the median over ``repeats`` interleaved passes
(``timing.interleaved_times``: pieces and examples alternate, so machine
drift hits all alike); compile excluded;
``block_until_ready`` before reading the clock.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from specdec_jax.decoding import cache_length, speculative_decode
from specdec_jax.drafts.base import ApproximationModel, gather_positions
from specdec_jax.models.t5 import T5Model
from specdec_jax.sampling import SamplingConfig, standardize
from lab.common import load_average
from specdec_jax.scripting.script_args import comma_list
from specdec_jax.speculative import speculative_sampling
from specdec_jax.timing import interleaved_times, repeat, speculative_prefill

from lab.common import pick, prepare_pair

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


@functools.partial(jax.jit, static_argnames=("gamma", "sampling", "n"))
def _draft_loop(draft: ApproximationModel, state, seqs, lengths, key, gamma: int,
                sampling: SamplingConfig, n: int):
  def body(i, state):
    tokens, q, state = draft.propose(state, pick(seqs, i), pick(lengths, i), gamma, sampling,
                                     jax.random.fold_in(key, i))
    return state, (tokens, q)
  return repeat(body, state, n)[1]


@functools.partial(jax.jit, static_argnames=("model", "n"))
def _target_loop(model: T5Model, params, cache, tokens, positions, n: int):
  def body(i, cache):
    logits, cache = model.decode(params, pick(tokens, i), pick(positions, i), cache)
    return cache, logits
  return repeat(body, cache, n)[1]


@functools.partial(jax.jit, static_argnames=("sampling", "n"))
def _standardize_q_loop(logits_rows, sampling: SamplingConfig, n: int):
  """n standardize calls on one [B, V] row each (as the draft makes them)."""
  return repeat(lambda i, c: (c, standardize(pick(logits_rows, i), sampling)), (), n)[1]


@functools.partial(jax.jit, static_argnames=("sampling", "with_standardize", "n"))
def _kernel_loop(key, xs, q, p_or_logits, sampling: SamplingConfig, with_standardize: bool,
                 n: int):
  def body(i, carry):
    p = pick(p_or_logits, i)
    if with_standardize:
      p = standardize(p, sampling)
    return carry, speculative_sampling(jax.random.fold_in(key, i), pick(xs, i), pick(q, i), p,
                                       1.0, sampling.greedy)
  return repeat(body, (), n)[1]


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
    tcache, dstate, length = carry
    k_draft, k_kernel = jax.random.split(jax.random.fold_in(key, i))
    xs, q, dstate = draft.propose(dstate, seq, length, gamma, sampling, k_draft)
    pos = length[:, None] + offsets
    tokens = jnp.concatenate([gather_positions(seq, pos[:, :1]), xs], axis=1)
    logits, tcache = target.decode(params, tokens, pos, tcache)
    out = speculative_sampling(k_kernel, xs, q, standardize(logits, sampling), 1.0,
                               sampling.greedy)
    length = length + out.num_accepted + 1
    length = jnp.where(length > limit, start, length)
    return (tcache, dstate, length), out
  return repeat(body, (tcache, dstate, jnp.full((b,), start, jnp.int32)), n)[1]


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


def profile_round(target: T5Model, params: Any, draft: ApproximationModel,
                  examples: Sequence[Array], gamma: int, sampling: SamplingConfig,
                  max_decode_len: int, position: int = 32, inner: int = 8,
                  repeats: int = 5, seed: int = 0) -> RoundProfile:
  """Times one round's pieces and the full round (see module docstring).

  ``examples``: encoder inputs [1, S] each (one padded length, so one
  compilation); the first is also where the pieces' caches come from.
  """
  key = jax.random.PRNGKey(seed)
  cache_len = cache_length(max_decode_len, gamma)
  fns = piece_fns(target, params, draft, examples[0], gamma, sampling, cache_len, position,
                  inner, key)

  def spec(x):
    return speculative_decode(target, params, draft, x, key, gamma=gamma,
                              max_decode_len=max_decode_len, sampling=sampling,
                              eos_id=target.config.eos_id)

  def prefill(x):
    return speculative_prefill(target, params, draft, x, cache_len)

  outs = [jax.block_until_ready(spec(x)) for x in examples]
  rounds = sum(int(o.stats.target_calls[0]) for o in outs)
  tokens = sum(int(o.length[0]) for o in outs)
  timed_fns: dict[Any, Callable[[], Any]] = dict(fns)
  for j, x in enumerate(examples):  # each example back to back with its own prefill
    timed_fns[("spec", j)] = functools.partial(spec, x)
    timed_fns[("prefill", j)] = functools.partial(prefill, x)
  times = interleaved_times(timed_fns, repeats)
  per_run = {name: [t / inner for t in times[name]] for name in fns}
  per_run["round"] = [sum(times[("spec", j)][r] - times[("prefill", j)][r]
                          for j in range(len(examples))) / rounds for r in range(repeats)]
  med = {k: 1e3 * statistics.median(v) for k, v in per_run.items()}
  return RoundProfile(
      temperature=sampling.temperature, gamma=gamma, draft_ms=med["draft"],
      standardize_q_ms=med["standardize_q"], target_ms=med["target"],
      standardize_p_ms=med["standardize_kernel"] - med["kernel"], kernel_ms=med["kernel"],
      chained_ms=med["chained"], round_ms=med["round"], rounds=rounds, tokens=tokens)


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


def report(args: Any) -> None:
  """``scripts/profile_round.py``: prints the profile of every (T, γ) of
  --temperatures x --gammas on the pair of ``common.study_parser``'s flags,
  row by row, then the table."""
  exp, setup = prepare_pair(args)
  # The warm-up example is skipped, as the runner does.
  examples = [jnp.asarray(setup.inputs[i:i + 1]) for i in range(1, len(setup.inputs))]
  print(f"# profile_round: target={args.target} draft={args.draft} "
        f"shortlist={exp.draft_shortlist or 'none'} examples={len(examples)} "
        f"batch 1, max_decode_len {args.max_decode_len}, inner {args.inner}, repeats "
        f"{args.repeats}; backend={jax.default_backend()}; load average {load_average()}",
        flush=True)
  rows = []
  for temp in comma_list(args.temperatures, float):
    for gamma in comma_list(args.gammas, int):
      rows.append(profile_round(setup.target, setup.target_params, setup.draft, examples, gamma,
                                SamplingConfig(temperature=temp), args.max_decode_len,
                                position=args.position, inner=args.inner,
                                repeats=args.repeats))
      print(markdown(rows[-1:]).split("\n")[-1], flush=True)
  print(f"\n{markdown(rows)}\n\nload average at end {load_average()}")
