"""What adaptive draft lengths cost per round (paper §3.5, γ chosen per round
rather than fixed; Algorithm 1 with a per-round γ).

``adaptive_pieces`` times a round's two model pieces at k proposals as the
fixed-γ loop runs them and as an adaptive round runs them (an early-exit
proposal loop, a ``lax.switch`` over verification widths). ``adaptive_replay``
records the widths an adaptive rule chooses, replays them as a fixed schedule
(``WidthSchedule``: same rounds, same tokens, checked), shuffled, and at each
constant width, so that a rule's cost per round is split into what its widths
cost and what its stopping itself costs."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec_jax.decoding import (AdaptiveConfig, cache_length, speculative_decode,
                                  temperature_sample)
from specdec_jax.drafts.base import (ApproximationModel, adaptive_proposal, capabilities,
                                     init_draft)
from specdec_jax.models.base import pad_rows
from specdec_jax.models.t5 import T5Model
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting.script_args import comma_list, markdown_header
from specdec_jax.timing import (interleaved_medians_ms, repeat, speculative_prefill,
                                warm_up_widths)

from lab import probes, stopping
from lab.common import load_average, prepare_pair
from lab.sweep import adaptive_label

Array = jax.Array


class AdaptivePieceRow(NamedTuple):
  """ms per call of a round's two model pieces at k proposals, as the fixed-γ
  loop runs them and as an adaptive round (γ_max) runs them."""
  k: int
  draft_fixed_ms: float      # draft.propose(γ = k)
  draft_adaptive_ms: float   # draft.propose_adaptive(γ_max, limit k, threshold 0)
  verify_fixed_ms: float     # target.decode over k + 1 tokens (cache written inside)
  verify_adaptive_ms: float  # lax.switch over widths 1..γ_max of decode(write=False), + write_rows


@functools.partial(jax.jit, static_argnames=("gamma", "sampling", "n", "adaptive"))
def _propose_loop(draft, state, seq, limit, gamma: int, sampling: SamplingConfig, n: int,
                  adaptive: bool, position: int = 32):
  def body(i, state):
    length = jnp.full((seq.shape[0],), position, jnp.int32) + i % 2
    key = jax.random.PRNGKey(i)
    if adaptive:
      xs, _, count, _, state = draft.propose_adaptive(state, seq, length, gamma, sampling, key,
                                                      limit, 0.0)
      return state, (xs[:, 0], count)
    xs, _, state = draft.propose(state, seq, length, gamma, sampling, key)
    return state, xs[:, 0]
  return repeat(body, state, n)[1]


@functools.partial(jax.jit, static_argnames=("model", "k", "widths", "n"))
def _verify_loop(model: T5Model, params, cache, branch, k: int, widths: tuple, n: int,
                 position: int = 32):
  """n target passes over k + 1 tokens: direct ``decode`` (widths ()) or the
  adaptive loop's ``lax.switch`` over ``decode(write=False)`` at ``widths`` (branch
  chosen at run time, as in a round) followed by ``write_rows``."""
  b, g = cache.self_k[0].shape[0], max(widths or (k,))

  def rows_at(w, cache, start):
    pos = start + jnp.broadcast_to(jnp.arange(w + 1, dtype=jnp.int32), (b, w + 1))
    logits, rows = model.decode(params, jnp.full((b, w + 1), 3, jnp.int32), pos, cache, write=False)
    return (jnp.sum(logits[..., :8]),) + pad_rows(rows, pos, g + 1)

  def body(i, cache):
    start = position + i % 2
    if not widths:
      pos = start + jnp.broadcast_to(jnp.arange(k + 1, dtype=jnp.int32), (b, k + 1))
      logits, cache = model.decode(params, jnp.full((b, k + 1), 3, jnp.int32), pos, cache)
      return cache, logits[..., :8]
    x, rows, rpos = jax.lax.switch(branch, [functools.partial(rows_at, w) for w in widths],
                                   cache, start)
    return model.write_rows(cache, rows, rpos), x
  return repeat(body, cache, n)[1]


def adaptive_pieces(target: T5Model, params: Any, draft: ApproximationModel, inputs: Array,
                    ks: Sequence[int], gamma_max: int, sampling: SamplingConfig,
                    cache_len: int, inner: int = 16, repeats: int = 11
                    ) -> list[AdaptivePieceRow]:
  """What an adaptive round pays for its machinery: the draft's k proposals
  through ``propose`` (the fixed-γ loop) and through ``propose_adaptive``
  with γ_max and a limit of k (its early-exit while_loop), and the target's
  pass over k + 1 tokens directly and as the adaptive loop runs it
  (``lax.switch`` over widths 1..γ_max, rows written after the switch). Same
  tokens and positions; interleaved repeats, medians, compile excluded."""
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
    return capabilities(self.inner).target_states

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
  while_loop and ``lax.switch``). Timed per example, interleaved with the
  plain baseline and the example's prefill (both encoders and caches,
  ``speculative_prefill``), which is subtracted before dividing by the
  rounds; the order of the settings reverses every repeat. If ms per round at
  constant widths predicts the replay but not the rule, the excess comes from
  the rule's stopping itself, not from varying widths. Compile excluded;
  ``block_until_ready`` before each clock read; times are sums over examples
  and repeats.
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

  cache_len = cache_length(max_decode_len, gamma_max)
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


def pieces_report(args: Any) -> None:
  """``scripts/adaptive_pieces.py``: ``adaptive_pieces`` at each --ks and
  each T of --temperatures (γ_max = max of --gammas), as tables."""
  _, setup = prepare_pair(args)
  gamma_max = max(comma_list(args.gammas, int))
  for temp in comma_list(args.temperatures, float):
    rows = adaptive_pieces(setup.target, setup.target_params, setup.draft,
                           jnp.asarray(setup.inputs[:1]), comma_list(args.ks, int), gamma_max,
                           SamplingConfig(temperature=temp),
                           cache_length(args.max_decode_len, gamma_max), inner=args.inner,
                           repeats=args.repeats)
    print(f"T={temp:g}, γ_max {gamma_max}, load average {load_average()}\n"
          f"{adaptive_pieces_markdown(rows)}\n", flush=True)


def replay_report(args: Any, rule: AdaptiveConfig) -> None:
  """``scripts/adaptive_replay.py``: ``adaptive_replay`` of ``rule`` at each T
  of --temperatures (γ_max = max of --gammas), and at T = 0 the stopping rules
  replayed offline with the widths' measured ms (``stopping_table``)."""
  _, setup = prepare_pair(args)
  gamma_max = max(comma_list(args.gammas, int))
  for temp in comma_list(args.temperatures, float):
    load = load_average()
    result = adaptive_replay(setup.target, setup.target_params, setup.draft,
                             jnp.asarray(setup.inputs[1:]), jax.random.PRNGKey(0), rule,
                             gamma_max, SamplingConfig(temperature=temp), args.max_decode_len,
                             repeats=args.repeats)
    print(f"{adaptive_label(rule, gamma_max)}, T={temp:g}, {len(setup.inputs) - 1} examples × "
          f"{args.repeats} passes; load average {load} → {load_average()}\n"
          f"{adaptive_replay_markdown(result)}\n", flush=True)
    if temp == 0 and hasattr(setup.draft, "model"):
      print(stopping_table(setup, result, gamma_max, args.max_decode_len, rule.skip_below),
            flush=True)


def stopping_table(setup: Any, result: ReplayResult, gamma_max: int, max_decode_len: int,
                   skip_below: Any = None) -> str:
  """Offline T=0 replay of stopping rules (``stopping.simulate_stopping``)
  priced with the constant-width ms per round of ``result``."""
  round_ms = {int(r.setting.split()[1]): r.ms_per_round for r in result.rows
              if r.setting.startswith("width ")}
  # Fixed γ is priced by the fixed-γ loop's own rounds, the rules by the
  # adaptive loop's constant widths: the comparison the benchmark makes.
  fixed_ms = {int(r.setting.split()[1]): r.ms_per_round for r in result.rows
              if r.setting.startswith("fixed ")}
  # The engine's own fixed-γ_max rounds at T=0: the draft's confidences as
  # the rules read them (with its bridges and shortlist) and the verdicts.
  rec = probes.engine_records(setup.target, setup.target_params, setup.draft,
                              jnp.asarray(setup.inputs[1:]), jax.random.PRNGKey(0), gamma_max,
                              SamplingConfig(), max_decode_len)
  conf, ok, seen = probes.along_outputs(rec)
  bonus = sum(int((~m).sum()) for m in seen)
  fixed = {g: stopping.simulate_stopping(conf, ok, fixed_ms, "fixed", g) for g in fixed_ms}
  best = min(fixed, key=lambda g: fixed[g].ms_per_token)
  acc = np.concatenate(ok)
  lines = [f"Stopping rules replayed offline along the target's greedy outputs (T=0, "
           f"{len(acc)} positions, draft accepts {acc.mean():.3f}; the draft's confidences and "
           f"verdicts from the engine's own γ={gamma_max} rounds; {bonus} bonus positions, which "
           f"no draft step saw, count as accepted with confidence 1), with the ms per round of "
           f"the adaptive loop's constant widths above (fixed γ: the fixed loop's); relative "
           f"to the best fixed γ ({best}):\n",
           markdown_header(["rule", "ms per token", "tokens per round", "mean width",
                            "vs best fixed"])]
  rows = [(f"fixed {g}", r) for g, r in fixed.items()]
  # With a measured width-0 round (the rule has skip_below), also the
  # threshold rules with that skip_below.
  skips = [None] + ([skip_below] if skip_below is not None and 0 in round_ms else [])
  for rule in ("threshold", "cumulative"):
    for skip in skips:
      for t in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
        rows.append((f"{rule} {t:g}" + ("" if skip is None else f" skip {skip:g}"),
                     stopping.simulate_stopping(conf, ok, round_ms, rule, gamma_max, t, skip)))
  rows.append(("oracle (perfect acceptance predictor)",
               stopping.simulate_stopping(conf, ok, round_ms, "oracle", gamma_max)))
  lines += [f"| {name} | {r.ms_per_token:.3f} | {r.tokens_per_round:.2f} | {r.mean_width:.2f} "
            f"| {fixed[best].ms_per_token / r.ms_per_token:.3f}x |" for name, r in rows]
  return "\n".join(lines) + "\n"
