"""How much a target pass slows down when the draft's data passes through the
caches between passes (paper Theorem 3.8): the theorem's cost model
adds the two models' times as if each ran alone; in a round (Algorithm 1)
the draft's γ steps run between two target passes and evict part of the
target's working set. ``cache_contention`` times a k-token target pass alone
and after reading a buffer of each size; ``decode_working_set_mb`` says how
large the target's own working set is."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from specdec_jax.models.t5 import T5Model
from lab.common import load_average
from specdec_jax.scripting.script_args import comma_list
from specdec_jax.timing import interleaved_medians_ms, repeat

from lab.common import pick, prepare_pair

Array = jax.Array


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
    acc = _read(junk, acc)
    logits, cache = model.decode(params, pick(tokens, i), pick(positions, i), cache)
    return (cache, acc + jnp.sum(logits[..., :8]) * 1e-9), ()
  return repeat(body, (cache, jnp.float32(0)), n)[0][1]


def _read(junk: Array, prev: Array) -> Array:
  """A full read of ``junk`` that depends on the previous one (not hoisted)."""
  return prev + jnp.sum(junk * (1.0 + prev * 1e-30)) * 1e-9


@functools.partial(jax.jit, static_argnames=("n",))
def _read_loop(junk, n: int):
  return repeat(lambda i, read: (_read(junk, read), ()), jnp.float32(0), n)[0]


def cache_contention(model: T5Model, params: Any, inputs: Array, ks: Sequence[int],
                     megabytes: Sequence[float], cache_len: int, position: int = 32,
                     inner: int = 16, repeats: int = 11) -> list[ContentionRow]:
  """How much a k-token target pass slows down when other data passes
  through the caches between passes, as the draft's steps do in a round.

  Theorem 3.8's cost model adds the two models' times as if each ran alone;
  timed alone (``timing.measure_costs_many``), a target whose decode working set
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


def contention_markdown(rows: Sequence[ContentionRow]) -> str:
  lines = ["| k | MB read before each pass | pass ms (read subtracted) | alone ms | slowdown "
           "| read alone ms |", "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r.k} | {r.megabytes:g} | {r.pass_ms:.3f} | {r.alone_ms:.3f} "
                 f"| {r.slowdown:.2f}x | {r.read_ms:.3f} |")
  return "\n".join(lines)


def report(args: Any) -> None:
  """``scripts/cache_contention.py``: the target pass's slowdown at each
  --ks width after each --megabytes read, on the pair of
  ``common.study_parser``'s flags, as a table."""
  _, setup = prepare_pair(args)
  draft_cfg = getattr(getattr(setup.draft, "model", None), "config", None)
  print(f"# cache contention: target={args.target} (decode working set "
        f"{decode_working_set_mb(setup.target.config):.1f} MB)"
        + (f", draft={args.draft} ({decode_working_set_mb(draft_cfg):.1f} MB)" if draft_cfg
           else "")
        + f"; batch 1, inner {args.inner}, repeats {args.repeats}; load average "
        f"{load_average()}\n", flush=True)
  ks = comma_list(args.ks, int)
  rows = cache_contention(setup.target, setup.target_params, jnp.asarray(setup.inputs[:1]),
                          ks, comma_list(args.megabytes, float),
                          # the runner's cache length at γ = k - 1, as the other pieces
                          cache_len=args.max_decode_len + max(ks), position=args.position,
                          inner=args.inner, repeats=args.repeats)
  print(f"{contention_markdown(rows)}\n\nload average at end {load_average()}")
