"""Beam search with T5X's semantics, and speculative beam search (paper Appendix A.4).

``beam_search`` is T5X's ``decoding.beam_search`` as one jitted loop (EOS
candidates scored log p / ((5 + length) / 6)^alpha; beams returned ascending by
score). ``speculative_beam_search`` gives the same beams with fewer target
calls: the draft runs beam search at width u >= w for γ steps (or proposes
each beam's greedy chain), the target scores the w + uγ nodes in one tree pass,
and the baseline's step (``beam_step``) is replayed on those logits while every
live beam is a node, plus one step, as Algorithm 1 emits one token after a
rejection. Each example's cache is one row of w regions of R slots (``_Layout``).
Shapes: B rows, w beams, u draft beams, M = max_decode_len, N = w + uγ nodes."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec_jax.drafts import base as drafts_base
from specdec_jax.sampling import SamplingConfig

Array = jax.Array

# T5X's "effective negative infinity" for beam scores (exact in float32).
NEG_INF = -1.0e7


def brevity_penalty(alpha: float, length: Any) -> Array:
  """((5 + length) / 6)^alpha, T5X's length normalization (Wu et al. 2016)."""
  return jnp.power((5.0 + jnp.asarray(length, jnp.float32)) / 6.0, jnp.asarray(alpha, jnp.float32))


@struct.dataclass
class BeamState:
  """Beam search's bookkeeping (B rows, w beams, M = max_decode_len).

  live_seqs:       [B, w, M] int32, the live beams' tokens (0 after), ascending by
                   live_logprobs (T5X's order).
  live_logprobs:   [B, w] float32, Σ log p(y_t) (NEG_INF on top for kept EOS beams).
  finished_seqs:   [B, w, M] int32, the finished beams' tokens (EOS included).
  finished_scores: [B, w] float32, log p / brevity penalty, ascending; NEG_INF if empty.
  finished_flags:  [B, w] bool, the slot holds a finished beam.
  cur:             [B] int32, tokens in every live beam (T5X's cur_index).
  done:            [B] bool, the row has stopped."""

  live_seqs: Array
  live_logprobs: Array
  finished_seqs: Array
  finished_scores: Array
  finished_flags: Array
  cur: Array
  done: Array


class BeamOutput(NamedTuple):
  sequences: Array  # [B, w, M] int32, 0 after EOS, ascending by score (best last)
  scores: Array     # [B, w] float32: finished beams' scores, or live log p if none finished
  steps: Array      # [B] int32, beam-search steps taken (target calls of the baseline)


def init_beams(batch: int, beam_size: int, max_decode_len: int) -> BeamState:
  """T5X's initial state: one live beam of log p 0, w - 1 fillers at NEG_INF."""
  lp = jnp.tile(jnp.array([0.0] + [NEG_INF] * (beam_size - 1), jnp.float32), (batch, 1))
  zeros = jnp.zeros((batch, beam_size, max_decode_len), jnp.int32)
  return BeamState(live_seqs=zeros, live_logprobs=lp, finished_seqs=zeros,
                   finished_scores=jnp.full((batch, beam_size), NEG_INF, jnp.float32),
                   finished_flags=jnp.zeros((batch, beam_size), bool),
                   cur=jnp.zeros((batch,), jnp.int32), done=jnp.zeros((batch,), bool))


def _stopped(s: BeamState, alpha: float, max_decode_len: int) -> Array:
  """[B] bool: T5X's loop condition fails (max_decode_len reached; every
  finished slot beats the best live beam at the largest brevity penalty; or the
  best live beam is below NEG_INF, T5X's ``min_log_prob``)."""
  min_penalty = brevity_penalty(alpha, max_decode_len + 1)
  best_live = s.live_logprobs[:, -1] / min_penalty
  worst_finished = jnp.min(s.finished_scores, axis=1)
  worst = jnp.where(s.finished_flags, worst_finished[:, None], NEG_INF)
  terminated = jnp.all(worst > best_live[:, None], axis=1)
  hopeless = (best_live < NEG_INF / min_penalty) & (s.cur > 0)
  return (s.cur >= max_decode_len) | terminated | hopeless


def _take(x: Array, idx: Array) -> Array:
  """x [B, n, ...] gathered along axis 1 at idx [B, k] -> [B, k, ...]."""
  return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def beam_step(s: BeamState, log_probs: Array, active: Array, *, alpha: float, eos_id: int,
              max_decode_len: int) -> tuple[BeamState, Array, Array]:
  """One T5X beam-search step for rows where ``active`` [B]; log_probs [B, w, V].
  -> (state, parents [B, w], tokens [B, w]); inactive rows unchanged."""
  b, w, v = log_probs.shape
  m = s.live_seqs.shape[2]
  cand = (log_probs + s.live_logprobs[:, :, None]).reshape(b, w * v)
  top_lp, top_idx = jax.lax.top_k(cand, 2 * w)                          # [B, 2w]
  top_tok, top_par = top_idx % v, top_idx // v
  at_cur = jnp.arange(m)[None, None] == s.cur[:, None, None]
  top_seq = jnp.where(at_cur, top_tok[:, :, None], _take(s.live_seqs, top_par))
  newly_finished = top_tok == eos_id
  # Live: the best w candidates that did not end in EOS, ascending.
  live_lp = top_lp + newly_finished * jnp.float32(NEG_INF)
  keep = jax.lax.top_k(live_lp, w)[1][:, ::-1]
  # Finished: the best w of the old finished and the new EOS candidates, ascending.
  scores = top_lp / brevity_penalty(alpha, s.cur + 1)[:, None]
  scores = scores + (~newly_finished) * jnp.float32(NEG_INF)
  all_scores = jnp.concatenate([s.finished_scores, scores], axis=1)
  best = jax.lax.top_k(all_scores, w)[1][:, ::-1]
  new = BeamState(
      live_seqs=_take(top_seq, keep), live_logprobs=_take(live_lp, keep),
      finished_seqs=_take(jnp.concatenate([s.finished_seqs, top_seq], axis=1), best),
      finished_scores=_take(all_scores, best),
      finished_flags=_take(jnp.concatenate([s.finished_flags, newly_finished], axis=1), best),
      cur=s.cur + 1, done=s.done)
  new = new.replace(done=_stopped(new, alpha, max_decode_len))
  pick = lambda x, y: jnp.where(active.reshape((b,) + (1,) * (x.ndim - 1)), x, y)
  state = jax.tree.map(pick, new, s)
  parents = pick(_take(top_par, keep), jnp.broadcast_to(jnp.arange(w), (b, w)))
  return state, parents.astype(jnp.int32), _take(top_tok, keep).astype(jnp.int32)


def beam_output(s: BeamState) -> BeamOutput:
  """T5X's result: the finished beams, or the live ones for a row with none."""
  any_finished = jnp.any(s.finished_flags, axis=1)
  seqs = jnp.where(any_finished[:, None, None], s.finished_seqs, s.live_seqs)
  scores = jnp.where(any_finished[:, None], s.finished_scores, s.live_logprobs)
  return BeamOutput(seqs, scores, s.cur)


def _input_at(seqs: Array, position: Array, start_id: int) -> Array:
  """The decoder input at ``position`` [B] of every beam (0: the start) -> [B, w]."""
  idx = jnp.clip(position - 1, 0, seqs.shape[2] - 1)[:, None, None]
  tok = jnp.take_along_axis(seqs, jnp.broadcast_to(idx, seqs.shape[:2] + (1,)), axis=2)[..., 0]
  return jnp.where((position > 0)[:, None], tok, start_id).astype(jnp.int32)


def _check(beam_size: int, max_decode_len: int, alpha: float) -> None:
  if beam_size < 1:
    raise ValueError(f"beam_size must be >= 1, got {beam_size}")
  if max_decode_len < 1:
    raise ValueError(f"max_decode_len must be >= 1, got {max_decode_len}")
  if not np.isfinite(alpha) or alpha < 0:
    raise ValueError(f"the brevity penalty's alpha must be a finite number >= 0, got {alpha}")


@struct.dataclass
class _BaselineState:
  """The baseline's loop state.

  beams: ``BeamState``.
  cache: the decode cache, [B·w, M, ...], beam i of example b in row b·w + i."""

  beams: BeamState
  cache: Any


def _gather_rows(cache: Any, rows: Array) -> Any:
  """The self-attention cache's rows [B·w] re-ordered by ``rows`` [B·w]."""
  return _map_self_attention(cache, lambda c: jnp.take(c, rows, axis=0))


def _map_self_attention(cache: Any, fn: Any) -> Any:
  """``fn`` applied to every layer's self-attention keys and values."""
  return cache.replace(self_k=tuple(map(fn, cache.self_k)), self_v=tuple(map(fn, cache.self_v)))


def beam_search(model: Any, params: Any, inputs: Array, *, beam_size: int = 4,
                alpha: float = 0.6, max_decode_len: int, eos_id: int = 1) -> BeamOutput:
  """T5X beam search, one target call per step for all beams; inputs [B, S] int32,
  alpha traced. -> ``BeamOutput`` (sequences [B, w, M], scores ascending, steps)."""
  _check(beam_size, max_decode_len, alpha)
  return beam_search_jit(model, params, inputs, jnp.float32(alpha), beam_size=beam_size,
                         max_decode_len=max_decode_len, eos_id=eos_id)


@functools.partial(jax.jit, static_argnames=("model", "beam_size", "max_decode_len", "eos_id"))
def beam_search_jit(model: Any, params: Any, inputs: Array, alpha: Array, *, beam_size: int,
                    max_decode_len: int, eos_id: int) -> BeamOutput:
  """``beam_search`` after its checks, alpha a float32 scalar."""
  b, w = inputs.shape[0], beam_size
  rep = lambda x: jnp.repeat(x, w, axis=0)
  encoded = model.encode(params, inputs)
  cache = model.init_cache(params, rep(encoded), rep(inputs), max_decode_len)
  start = model.config.decoder_start_id

  def step(s: _BaselineState) -> _BaselineState:
    beams = s.beams
    tokens = _input_at(beams.live_seqs, beams.cur, start).reshape(b * w, 1)
    positions = jnp.repeat(beams.cur, w)[:, None]
    logits, cache = model.decode(params, tokens, positions, s.cache)
    log_probs = jax.nn.log_softmax(logits[:, 0]).reshape(b, w, -1)
    beams, parents, _ = beam_step(beams, log_probs, ~beams.done, alpha=alpha, eos_id=eos_id,
                                  max_decode_len=max_decode_len)
    rows = (jnp.arange(b)[:, None] * w + parents).reshape(-1)
    return _BaselineState(beams, _gather_rows(cache, rows))

  state = _BaselineState(init_beams(b, w, max_decode_len), cache)
  state = jax.lax.while_loop(lambda s: jnp.any(~s.beams.done), step, state)
  return beam_output(state.beams)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where a round's nodes live (static): roots j < w (live beam j's last token),
  then u draft beams per depth 1..γ; region R = M + uγ + 1 slots per beam."""

  w: int
  u: int
  gamma: int
  region: int

  @property
  def num_nodes(self) -> int:
    return self.w + self.u * self.gamma

  @property
  def cache_len(self) -> int:
    return self.w * self.region

  def depth(self, j: Array) -> Array:
    """Node j's depth (0 for the roots)."""
    return jnp.where(j < self.w, 0, 1 + (j - self.w) // self.u)

  def slot(self, j: Array, root: Array, cur: Array) -> Array:
    """Node j's slot in its root's region: roots at cur, others cur + 1 + (j - w)."""
    within = jnp.where(j < self.w, cur, cur + 1 + j - self.w)
    return root * self.region + within

  def key_positions(self, cur: Array) -> Array:
    """[B, w·R] int32: each slot's key position this round."""
    off = jnp.arange(self.cache_len, dtype=jnp.int32) % self.region
    node = off[None] - cur[:, None] - 1 + self.w
    scratch = (off[None] > cur[:, None]) & (node < self.num_nodes)
    return jnp.where(scratch, cur[:, None] + self.depth(node), off[None])

  def mask(self, root: Array, prefix: Array, seen: Array) -> Array:
    """[B, k, w·R] bool: node i sees its root's region below ``prefix`` and ``seen``
    [B, k, P] (itself and its ancestors; -1 pads)."""
    slot = jnp.arange(self.cache_len, dtype=jnp.int32)
    in_prefix = ((slot // self.region)[None, None] == root[..., None]) & (
        (slot % self.region)[None, None] < prefix[..., None])
    return in_prefix | jnp.any(slot[None, None, None] == seen[..., None], axis=2)


class BeamStats(NamedTuple):
  """Per-example counts [B]: rounds (target calls), steps, draft_calls;
  steps_per_round [B, γ + 2], rounds by steps taken."""

  rounds: Array
  steps: Array
  draft_calls: Array
  steps_per_round: Array


class SpecBeamOutput(NamedTuple):
  output: BeamOutput
  stats: BeamStats


@struct.dataclass
class _SpecBeamState:
  """The speculative loop's state.

  beams:         ``BeamState``.
  target_cache:  one row per example of w regions of R slots (``_Layout``).
  draft_cache:   likewise (may lack slot cur - 1: refed each round), or a chain
                 draft's own state, row b·w + i for live beam i.
  rounds, draft_calls: [B] int32; hist: [B, γ + 2] int32 (``BeamStats``)."""

  beams: BeamState
  target_cache: Any
  draft_cache: Any
  rounds: Array
  draft_calls: Array
  hist: Array


def _draft_tree(draft: Any, draft_params: Any, lay: _Layout, beams: BeamState, cache: Any,
                start: int, eos_id: int) -> tuple[Array, Array, Array, Any]:
  """The draft's beam search at width u for γ steps from the live beams (EOS
  never extends a beam). -> (tokens [B, N], parents [B, N] (-1 for roots),
  roots [B, N], cache). The first call also refeeds position cur - 1."""
  w, u, g = lay.w, lay.u, lay.gamma
  b = beams.cur.shape[0]
  cur = beams.cur
  roots = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
  root_tok = _input_at(beams.live_seqs, cur, start)
  prev_tok = _input_at(beams.live_seqs, cur - 1, start)
  root_slot = lay.slot(roots, roots, cur[:, None])
  prev_slot = jnp.where((cur > 0)[:, None], root_slot - 1, -1)
  kp = lay.key_positions(cur)
  # Call 1: the tokens before the roots (if any) and the roots.
  tokens = jnp.concatenate([prev_tok, root_tok], axis=1)
  positions = jnp.concatenate([jnp.broadcast_to(cur[:, None] - 1, (b, w)),
                               jnp.broadcast_to(cur[:, None], (b, w))], axis=1)
  slots = jnp.concatenate([prev_slot, root_slot], axis=1)
  prefix = positions
  mask = lay.mask(jnp.concatenate([roots, roots], 1), prefix, slots[..., None])
  logits, cache = draft.decode_nodes(draft_params, tokens, positions, slots, kp, mask, cache)
  log_q = jax.nn.log_softmax(logits[:, w:])                             # [B, w, V]
  score = beams.live_logprobs
  node_of = roots                                    # the current draft beams' node indices
  beam_root = roots
  seen = root_slot[..., None]                        # [B, beams, depth + 1] slots of the path
  all_tok, all_par, all_root = [root_tok], [jnp.full((b, w), -1, jnp.int32)], [roots]
  for t in range(1, g + 1):
    if t > 1:
      nodes = w + (t - 2) * u + jnp.arange(u, dtype=jnp.int32)
      logits, cache = draft.decode_nodes(
          draft_params, all_tok[-1], cur[:, None] + t - 1, seen[:, :, -1], kp,
          lay.mask(beam_root, jnp.broadcast_to(cur[:, None], (b, u)), seen), cache)
      log_q = jax.nn.log_softmax(logits)                                # [B, u, V]
      node_of = jnp.broadcast_to(nodes, (b, u))
    v = log_q.shape[-1]
    cand = score[:, :, None] + log_q.at[:, :, eos_id].set(-jnp.inf)
    score, idx = jax.lax.top_k(cand.reshape(b, -1), u)
    par, tok = idx // v, (idx % v).astype(jnp.int32)
    new_nodes = w + (t - 1) * u + jnp.arange(u, dtype=jnp.int32)
    beam_root = _take(beam_root, par)
    seen = jnp.concatenate([_take(seen, par),
                            lay.slot(new_nodes[None], beam_root, cur[:, None])[..., None]], 2)
    all_tok.append(tok)
    all_par.append(_take(node_of, par))
    all_root.append(beam_root)
  cat = lambda xs: jnp.concatenate(xs, axis=1)
  return cat(all_tok), cat(all_par), cat(all_root), cache


def _is_beam_draft(draft: Any) -> bool:
  """Whether the draft runs beam search itself (has ``decode_nodes``)."""
  return callable(getattr(draft, "decode_nodes", None))


def _beam_rows(b: int, w: int, seqs: Array, start: int) -> Array:
  """Every live beam's decoder inputs as one row: seqs [B, w, M] -> [B·w, M + 1]."""
  m = seqs.shape[2]
  return jnp.concatenate([jnp.full((b, w, 1), start, jnp.int32), seqs], 2).reshape(b * w, m + 1)


def _chain_tree(draft: Any, lay: _Layout, beams: BeamState, state: Any,
                start: int) -> tuple[Array, Array, Array, Any]:
  """Each live beam's greedy chain of γ tokens (draft row b·w + i) as draft beams
  of width w. As ``_draft_tree``."""
  w, g = lay.w, lay.gamma
  b = beams.cur.shape[0]
  seq = _beam_rows(b, w, beams.live_seqs, start)
  chain, _, state = draft.propose(state, seq, jnp.repeat(beams.cur, w), g,
                                  SamplingConfig(temperature=0.0), jax.random.PRNGKey(0))
  chain = jnp.swapaxes(chain.astype(jnp.int32).reshape(b, w, g), 1, 2).reshape(b, g * w)
  node = jnp.arange(lay.num_nodes, dtype=jnp.int32)
  tok = jnp.concatenate([_input_at(beams.live_seqs, beams.cur, start), chain], axis=1)
  par = jnp.broadcast_to(jnp.where(node < w, -1, node - w), tok.shape)
  return tok, par, jnp.broadcast_to(node % w, tok.shape), state


def _follow_beams(draft: Any, state: Any, beams: BeamState, roots: Array, start: int) -> Any:
  """A chain draft's state after the round: row b·w + i takes live beam i's root's
  row, then ``commit``."""
  b, w = roots.shape
  rows = (jnp.arange(b, dtype=jnp.int32)[:, None] * w + roots).reshape(-1)
  take = lambda x: jnp.take(x, rows, axis=0) if x.ndim and x.shape[0] == b * w else x
  state = jax.tree.map(take, state)
  return draft.commit(state, _beam_rows(b, w, beams.live_seqs, start), jnp.repeat(beams.cur, w))


def _paths(lay: _Layout, parents: Array, roots: Array, cur: Array) -> Array:
  """[B, N, γ + 1] int32: the slots of every node's ancestors and itself, -1 padded."""
  b, n = parents.shape
  node = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
  out = []
  for _ in range(lay.gamma + 1):
    out.append(jnp.where(node >= 0, lay.slot(node, roots, cur[:, None]), -1))
    node = jnp.where(node >= 0, jnp.take_along_axis(parents, jnp.maximum(node, 0), 1), -1)
  return jnp.stack(out, axis=2)


def _rebuild(cache: Any, lay: _Layout, cur: Array, steps: Array, path: Array, roots: Array) -> Any:
  """Region i <- its root's region with the path's nodes (path [B, w, γ + 1])
  moved to slots cur + 1 .. cur + steps - 1; one gather per layer."""
  off = jnp.arange(lay.region, dtype=jnp.int32)
  d = off[None, None] - cur[:, None, None]                             # [B, 1, R]
  in_path = (d >= 1) & (d < steps[:, None, None])
  d = jnp.broadcast_to(d, path.shape[:2] + (lay.region,))
  node = jnp.take_along_axis(path, jnp.clip(d, 0, lay.gamma), axis=2)  # [B, w, R]
  src = jnp.where(in_path, lay.slot(node, roots[..., None], cur[:, None, None]),
                  roots[..., None] * lay.region + off[None, None])
  src = src.reshape(src.shape[0], -1)
  return _map_self_attention(cache, lambda c: jnp.take_along_axis(c, src[:, :, None, None], 1))


def _round(target: Any, target_params: Any, draft: Any, draft_params: Any, lay: _Layout,
           alpha: float, eos_id: int, max_decode_len: int, s: _SpecBeamState) -> _SpecBeamState:
  """One round: the draft's beams, one target pass over the N nodes, the target's
  beam steps replayed while its live beams are nodes."""
  w, u, g = lay.w, lay.u, lay.gamma
  beams = s.beams
  b, cur = beams.cur.shape[0], beams.cur
  start = target.config.decoder_start_id
  if _is_beam_draft(draft):
    tok, par, root, draft_cache = _draft_tree(draft, draft_params, lay, beams, s.draft_cache,
                                              start, eos_id)
  else:
    tok, par, root, draft_cache = _chain_tree(draft, lay, beams, s.draft_cache, start)
  node = jnp.arange(lay.num_nodes, dtype=jnp.int32)
  seen = _paths(lay, par, root, cur)
  positions = cur[:, None] + lay.depth(node)[None]
  logits, target_cache = target.decode_nodes(
      target_params, tok, positions, seen[:, :, 0], lay.key_positions(cur),
      lay.mask(root, jnp.broadcast_to(cur[:, None], root.shape), seen), s.target_cache)
  log_p = jax.nn.log_softmax(logits)                                    # [B, N, V]
  # Replay the target's beam steps on the pass's logits.
  at = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))         # live beams' nodes
  path = jnp.concatenate([at[..., None], jnp.full((b, w, g), -1, jnp.int32)], axis=2)
  active = ~beams.done
  steps = jnp.zeros((b,), jnp.int32)
  for k in range(1, g + 2):
    beams, parents, new_tok = beam_step(beams, _take(log_p, at), active, alpha=alpha,
                                        eos_id=eos_id, max_decode_len=max_decode_len)
    path = jnp.where(active[:, None, None], _take(path, parents), path)
    steps = steps + active
    if k > g:
      break
    depth_k = w + (k - 1) * u + jnp.arange(u, dtype=jnp.int32)
    parent_node = _take(at, parents)                                    # [B, w]
    match = ((par[:, None, depth_k] == parent_node[..., None])
             & (tok[:, None, depth_k] == new_tok[..., None]))           # [B, w, u]
    child = depth_k[jnp.argmax(match, axis=2)]
    covered = jnp.all(jnp.any(match, axis=2), axis=1)
    go = active & covered & ~beams.done
    at = jnp.where(go[:, None], child, at)
    path = path.at[:, :, k].set(jnp.where(go[:, None], child, path[:, :, k]))
    active = go
  live = ~s.beams.done
  roots = path[:, :, 0]
  target_cache = _rebuild(target_cache, lay, cur, steps, path, roots)
  if _is_beam_draft(draft):
    draft_cache, calls = _rebuild(draft_cache, lay, cur, steps, path, roots), g
  else:
    draft_cache = _follow_beams(draft, draft_cache, beams, roots, start)
    calls = drafts_base.proposal_steps(draft, g)
  hist = s.hist + jax.nn.one_hot(steps, g + 2, dtype=jnp.int32) * live[:, None]
  return _SpecBeamState(beams, target_cache, draft_cache, s.rounds + live,
                        s.draft_calls + calls * live, hist)


_SPEC_STATIC = ("target", "draft", "beam_size", "draft_beam_size", "gamma", "max_decode_len",
                "eos_id")


def speculative_beam_search(target: Any, target_params: Any, draft: Any, draft_params: Any,
                            inputs: Array, *, beam_size: int = 4, draft_beam_size: int = 4,
                            gamma: int = 3, alpha: float = 0.6, max_decode_len: int,
                            eos_id: int = 1) -> SpecBeamOutput:
  """Speculative beam search (Appendix A.4): ``beam_search``'s beams with one
  target pass per round of up to γ + 1 steps.

  target, draft: models with ``encode``, ``init_cache`` and ``decode_nodes``
  over one vocabulary, draft_beam_size u >= w; or an approximation model as
  draft (greedy chains, u = w). -> ``SpecBeamOutput`` (``BeamOutput``, ``BeamStats``)."""
  _check(beam_size, max_decode_len, alpha)
  if draft_beam_size < beam_size:
    raise ValueError(f"the draft's beam width u must be >= the beam width w: got u = "
                     f"{draft_beam_size}, w = {beam_size}")
  if gamma < 1:
    raise ValueError(f"gamma (draft steps per round) must be >= 1, got {gamma}")
  vocab = draft.config.vocab_size if _is_beam_draft(draft) else draft.vocab_size
  if target.config.vocab_size != vocab:
    raise ValueError(f"the draft's vocabulary ({vocab}) differs from the target's "
                     f"({target.config.vocab_size})")
  if not _is_beam_draft(draft):
    if drafts_base.capabilities(draft).target_states:
      raise ValueError(f"{type(draft).__name__} reads the target's decoder states, which "
                       "speculative beam search does not hand over: use a draft without a "
                       "feature bridge")
    draft, draft_params = None, draft  # a pytree: traced, not a static argument
    draft_beam_size = beam_size  # one greedy chain per beam
  return speculative_beam_search_jit(target, target_params, draft, draft_params, inputs,
                                     jnp.float32(alpha), beam_size=beam_size,
                                     draft_beam_size=draft_beam_size, gamma=gamma,
                                     max_decode_len=max_decode_len, eos_id=eos_id)


@functools.partial(jax.jit, static_argnames=_SPEC_STATIC)
def speculative_beam_search_jit(target: Any, target_params: Any, draft: Any, draft_params: Any,
                                inputs: Array, alpha: Array, *, beam_size: int,
                                draft_beam_size: int, gamma: int, max_decode_len: int,
                                eos_id: int) -> SpecBeamOutput:
  """``speculative_beam_search`` after its checks (draft None: a chain draft)."""
  lay = _Layout(beam_size, draft_beam_size, gamma, max_decode_len + draft_beam_size * gamma + 1)
  b = inputs.shape[0]
  encoded = target.encode(target_params, inputs)
  t_cache = target.init_cache(target_params, encoded, inputs, lay.cache_len)
  if draft is None:
    draft = draft_params
    rep = lambda x: jnp.repeat(x, beam_size, axis=0)
    d_cache = drafts_base.init_draft(draft, rep(inputs), max_decode_len + gamma + 1, rep(encoded))
  else:
    d_cache = draft.init_cache(draft_params, draft.encode(draft_params, inputs), inputs,
                               lay.cache_len)
  zeros = jnp.zeros((b,), jnp.int32)
  state = _SpecBeamState(init_beams(b, beam_size, max_decode_len), t_cache, d_cache, zeros,
                         zeros, jnp.zeros((b, gamma + 2), jnp.int32))
  body = functools.partial(_round, target, target_params, draft, draft_params, lay, alpha,
                           eos_id, max_decode_len)
  state = jax.lax.while_loop(lambda s: jnp.any(~s.beams.done), body, state)
  stats = BeamStats(state.rounds, state.beams.cur, state.draft_calls, state.hist)
  return SpecBeamOutput(beam_output(state.beams), stats)
