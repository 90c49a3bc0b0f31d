"""Decoding loops: the plain T5X-style baseline and speculative decoding.

Each loop is one ``lax.while_loop`` under ``jax.jit`` that runs until every row
has ended — no host round trip per step — over a fixed-shape state
(``_BaselineState``, ``_SpecState``) whose core is

  seq     [B, T_buf] int32  decoder inputs: seq[:, 0] = start, seq[:, i+1] = y_i
  length  [B] int32         committed output tokens per row (the per-row index)
  done    [B] bool          row emitted EOS or reached max_decode_len

A row stops changing once done. Outputs are ``seq[:, 1:max_decode_len+1]`` with
every position at or past ``length`` set to 0, so a row is padded with 0 after
its EOS (T5X semantics).

Every loop is written as setup, a round (the ``while_loop`` body), the shared
condition ``_running`` and the shared ``_finish``. The rounds share their
bookkeeping: ``_round_keys`` (the key split), ``_cut`` (which committed tokens
count: the EOS / length cut) and ``_pin_state`` (the state's layout on a mesh).
Three loops use it:

* ``temperature_sample``: one target call per token, the baseline;
* ``speculative_decode``: Algorithm 1 (paper §2.3) in a loop, with a fixed γ or
  with an adaptive draft length (``AdaptiveConfig``);
* ``tree_speculative_decode``: Algorithm 1 over a token tree.

They reach the target model only through ``models.base.TargetModel`` (which
``models.t5.T5Model`` satisfies) and the draft only through the
approximation-model interface of ``drafts.base``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.drafts.base import (ApproximationModel, adaptive_proposal, commit_tree,
                                     gather_positions, init_draft, proposal_steps, tree_proposal)
from specdec_jax.models.base import TargetModel
from specdec_jax.partitioning import Partitioner, constrain_batch, constrain_cache
from specdec_jax.sampling import SamplingConfig, argmax, sample, standardize
from specdec_jax.speculative import KernelOutput, greedy_kernel, speculative_sampling
from specdec_jax.tree import TreeOutput, TreeShape, tree_greedy_kernel, tree_speculative_sampling

Array = jax.Array


# ------------------------------------------------------- shared bookkeeping


def _validate(max_decode_len: int, gamma: int | None = None,
              lenience: float | None = None) -> None:
  if max_decode_len < 1:
    raise ValueError(f"max_decode_len must be >= 1, got {max_decode_len}")
  if gamma is not None and gamma < 1:
    raise ValueError(f"gamma must be >= 1 (draft tokens per target call), got {gamma}")
  if lenience is not None and not 0.0 < lenience <= 1.0:
    raise ValueError(f"lenience must be in (0, 1] (1 is exact), got {lenience}")


def _check_vocab(target: TargetModel, draft: ApproximationModel) -> None:
  if draft.vocab_size != target.config.vocab_size:
    raise ValueError(f"vocab mismatch: target vocab_size {target.config.vocab_size} != draft "
                     f"vocab_size {draft.vocab_size}; p and q must cover the same tokens")


def _init_rows(batch: int, buf_len: int, start_id: int) -> tuple[Array, Array, Array]:
  """The empty rows: (seq [B, buf_len] with seq[:, 0] = start, length [B] = 0,
  done [B] = False)."""
  seq = jnp.zeros((batch, buf_len), jnp.int32).at[:, 0].set(start_id)
  return seq, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool)


def _round_keys(key: Array, greedy: bool, num: int) -> tuple[Array, ...]:
  """(the next round's key, then num - 1 keys for this round's draws).

  At temperature 0 nothing is drawn (argmax; the speculative kernels then
  need only the target's argmax, whatever the draft proposes), so the key is
  not split at all and every key is the incoming one."""
  if greedy:
    return (key,) * num
  return tuple(jax.random.split(key, num))


def _cut(new_tokens: Array, num_accepted: Array, length: Array, done: Array, eos_id: int,
         max_decode_len: int) -> tuple[Array, Array, Array]:
  """Which of a round's tokens count, and which rows end.

  new_tokens [B, W]: the tokens a round committed at positions length + 1 ..
  length + num_accepted + 1 (columns past num_accepted [B] are ignored). A
  live row keeps them up to its first EOS and at most up to max_decode_len.
  -> (length [B] after the round, done [B], count [B]: tokens kept; for done
  rows length is unchanged and count is not used)."""
  offsets = jnp.arange(new_tokens.shape[1], dtype=jnp.int32)[None]
  live = ~done
  is_eos = (new_tokens == eos_id) & (offsets <= num_accepted[:, None])  # --> [B, W]
  ended = jnp.any(is_eos, 1)
  first_eos = jnp.where(ended, jnp.argmax(is_eos, 1) + 1, num_accepted + 1)
  count = jnp.minimum(first_eos, max_decode_len - length)
  new_length = jnp.where(live, length + count, length)
  return new_length, done | (live & (ended | (new_length >= max_decode_len))), count


def _pin_state(state: Any, partitioner: Partitioner | None) -> Any:
  """A loop state's per-row arrays (seq, length, done and, if any, gamma_row)
  with their batch over the mesh's 'data' axis, and its target cache in the
  T5X layout (``partitioning.constrain_cache``); a no-op without a
  partitioner. The draft pins its own state."""
  if partitioner is None:
    return state
  pinned = dict(seq=constrain_batch(state.seq, partitioner, "seq"),
                length=constrain_batch(state.length, partitioner, "length"),
                done=constrain_batch(state.done, partitioner, "done"),
                target_cache=constrain_cache(state.target_cache, partitioner, "target cache"))
  if getattr(state, "gamma_row", None) is not None:
    pinned["gamma_row"] = constrain_batch(state.gamma_row, partitioner, "gamma")
  return state.replace(**pinned)


def _running(state: Any) -> Array:
  """The loops' condition: some row has not ended."""
  return ~jnp.all(state.done)


def _finish(state: Any, max_decode_len: int) -> tuple[Array, Array]:
  """(tokens [B, max_decode_len], 0 at and past each row's length; length [B])."""
  out = state.seq[:, 1:max_decode_len + 1]
  mask = jnp.arange(max_decode_len)[None] < state.length[:, None]
  return jnp.where(mask, out, 0), state.length


@dataclasses.dataclass(frozen=True)
class _Loop:
  """What every round of one loop reads and never changes (static under jit).

  target: the target model M_p; sampling: §2.2's standardization of p and q;
  eos_id, max_decode_len: where rows end; partitioner: the mesh layout (None:
  one device); states_wanted: the draft reads the target's decoder states
  (``feature_bridge``), passed through ``commit_with_target``.
  Chain loop: gamma (γ; γ_max with ``adaptive``), lenience, adaptive and
  widths (its compiled verification widths). Tree loop: tree.
  """

  target: TargetModel
  sampling: SamplingConfig
  eos_id: int
  max_decode_len: int
  partitioner: Partitioner | None
  states_wanted: bool = False
  gamma: int = 0
  lenience: float = 1.0
  adaptive: Optional[AdaptiveConfig] = None
  widths: tuple[int, ...] = ()
  tree: Optional[TreeShape] = None


# ------------------------------------------------------------------ baseline


class DecodeOutput(NamedTuple):
  tokens: Array    # [B, max_decode_len], 0 after EOS
  log_prob: Array  # [B] sum of log p(y_t) under the model's raw softmax
  length: Array    # [B] tokens generated (including EOS)


@struct.dataclass
class _BaselineState:
  """The baseline's loop state (B rows, M = max_decode_len).

  seq: [B, M + 1] int32, decoder inputs; seq[:, t + 1] = y_t once committed.
  length: [B] int32, tokens generated so far; the next decoder input is
    seq[:, length], at position length.
  done: [B] bool, the row emitted EOS or reached M.
  log_prob: [B] float32, Σ log p(y_t) over the row's tokens (raw softmax).
  target_cache: the target's decode cache, M slots per row (for T5,
    ``DecoderCache``: self-attention K/V [B, M, H, dh] per layer).
  key: the PRNG key of the next step (unused at temperature 0).
  """

  seq: Array
  length: Array
  done: Array
  log_prob: Array
  target_cache: Any
  key: Array


def _baseline_step(loop: _Loop, params: Any, s: _BaselineState) -> _BaselineState:
  """One target call: y_{length} ~ p(· | seq[:, :length + 1]) for every live row."""
  key, k_step = _round_keys(s.key, loop.sampling.greedy, 2)
  pos = s.length[:, None]                                              # --> [B, 1]
  logits, cache = loop.target.decode(params, gather_positions(s.seq, pos), pos, s.target_cache)
  logits = logits[:, 0]                                                # --> [B, V]
  token = sample(k_step, standardize(logits, loop.sampling), loop.sampling)
  live = ~s.done
  token_lp = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], -1)[:, 0]
  seq = jnp.where(live[:, None] & (jnp.arange(s.seq.shape[1])[None] == s.length[:, None] + 1),
                  token[:, None], s.seq)
  length, done, _ = _cut(token[:, None], jnp.zeros_like(s.length), s.length, s.done,
                         loop.eos_id, loop.max_decode_len)
  return _pin_state(_BaselineState(seq, length, done, s.log_prob + jnp.where(live, token_lp, 0.0),
                                   cache, key), loop.partitioner)


_BASELINE_STATIC = ("model", "max_decode_len", "sampling", "eos_id", "partitioner")


@functools.partial(jax.jit, static_argnames=_BASELINE_STATIC)
def temperature_sample(model: TargetModel, params: Any, inputs: Array, key: Array, *,
                       max_decode_len: int, sampling: SamplingConfig = SamplingConfig(),
                       eos_id: int = 1, partitioner: Partitioner | None = None) -> DecodeOutput:
  """Plain autoregressive decoding with T5X ``temperature_sample`` semantics.

  One target call per token. inputs [B, S] int32 (0 = pad); key: PRNG key
  (unused at temperature 0). Returns ``DecodeOutput``: tokens [B,
  max_decode_len] (0 after EOS), log_prob [B], length [B]. The baseline every
  speedup is measured against: the same cached decode as the engine uses.
  With a ``partitioner`` (``specdec_jax.partitioning``), params are expected
  on its mesh and the caches and per-row state are pinned to its layout.
  """
  _validate(max_decode_len)
  b = inputs.shape[0]
  encoded = model.encode(params, inputs)
  state = _pin_state(_BaselineState(
      *_init_rows(b, max_decode_len + 1, model.config.decoder_start_id),
      log_prob=jnp.zeros((b,), jnp.float32),
      target_cache=model.init_cache(params, encoded, inputs, max_decode_len), key=key),
      partitioner)
  loop = _Loop(model, sampling, eos_id, max_decode_len, partitioner)
  state = jax.lax.while_loop(_running, functools.partial(_baseline_step, loop, params), state)
  tokens, length = _finish(state, max_decode_len)
  return DecodeOutput(tokens, state.log_prob, length)


# ----------------------------------------------------------------- speculative


@struct.dataclass
class SpecStats:
  """Per-example statistics of one speculative generation (all [B] unless noted).

  target_calls, draft_calls: serial forward passes of M_p / M_q.
  accepted_at [B, γ]: times draft position i was accepted.
  evaluated_at [B, γ]: times position i was evaluated (reached by the test).
  accepted, rejected: totals over evaluated positions; positions after the
    first rejection of a round were never evaluated and are not counted.
  min_pq_sum: sum over evaluated positions of sum_x min(p(x), q(x)).
  gamma_hist [B, γ + 1]: rounds in which the row proposed γ_row = j tokens,
    at column j (with a fixed γ, all at column γ). Σ_j j·gamma_hist = drafts
    proposed; Σ_j gamma_hist = target_calls.
  target_positions: positions the target scored, Σ over rounds of k + 1
    for the compiled verification width k that ran ((γ + 1)·target_calls
    with a fixed γ): the target's arithmetic (Theorem 3.11's accounting).

  With adaptive γ, draft_calls counts the draft steps the batch actually ran
  in the row's live rounds (T5Draft exits early; at batch 1 that is the
  row's own proposals), and γ is γ_max.
  """

  target_calls: Array
  draft_calls: Array
  accepted_at: Array
  evaluated_at: Array
  accepted: Array
  rejected: Array
  min_pq_sum: Array
  gamma_hist: Array
  target_positions: Array

  @classmethod
  def zeros(cls, batch: int, gamma: int) -> "SpecStats":
    z = jnp.zeros((batch,), jnp.int32)
    zg = jnp.zeros((batch, gamma), jnp.int32)
    return cls(z, z, zg, zg, z, z, jnp.zeros((batch,), jnp.float32),
               jnp.zeros((batch, gamma + 1), jnp.int32), z)


class SpecOutput(NamedTuple):
  tokens: Array   # [B, max_decode_len], 0 after EOS
  length: Array   # [B]
  stats: SpecStats


def alpha_estimates(stats: SpecStats) -> dict[str, Array]:
  """α two ways (paper §3.1-3.2), per row, plus tokens per target call.

  alpha: accepted / (accepted + rejected) over evaluated positions.
  alpha_min_pq: mean of sum_x min(p, q) over evaluated positions (Corollary
    3.6): the expected acceptance, lower variance than counting.
  """
  evaluated = stats.accepted + stats.rejected
  denom = jnp.maximum(evaluated, 1)
  return {"alpha": stats.accepted / denom, "alpha_min_pq": stats.min_pq_sum / denom}


ADAPTIVE_RULES = ("threshold", "cumulative", "schedule")
# The rules that stop on the draft's confidence (``threshold``, ``skip_below``).
CONFIDENCE_RULES = ("threshold", "cumulative")
# What the confidence rules read after x_i: max_x q_i(x), or q_i(x_i).
CONFIDENCES = ("top", "drawn")


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
  """Adaptive draft length: γ chosen per row and per round, at most γ_max.

  The paper fixes γ (§3.5 "Choosing γ") and names varying it during inference
  as future work (§3.5, §6). With this config ``speculative_decode``'s
  ``gamma`` is γ_max; each round row b proposes c_b <= γ_max tokens and is
  verified as Algorithm 1 with γ = c_b, inside the same jitted loop.

  rule: 'threshold' | 'cumulative' | 'schedule'.
    'threshold': propose x_1, then continue after x_i while i < γ_max and the
      draft's confidence at position i is > ``threshold``.
    'cumulative': continue while the product of the confidences at positions
      1..i is > ``threshold`` (the draft's own estimate that all i proposals
      will be accepted; after SpecDec++, Huang et al. 2024).
    'schedule' (Hugging Face's 'heuristic'): row b proposes γ_b tokens;
      γ_b += 2 after a round where all γ_b were accepted, else γ_b -= 1,
      within [1, γ_max].
  threshold: in [0, 1]; required by the confidence rules, refused by
    'schedule'. 0 never stops early; 1 always stops after x_1.
  skip_below: None, or in [0, 1] (confidence rules only): a row proposes
    nothing in a round whose q_1 has top probability <= skip_below, making the
    round a plain target step (width 0, y ~ p_1). Always reads q_1's top
    probability, whatever ``confidence`` says.
  confidence: 'top' reads max_x q_i(x) (``drafts.base.top_probability``; at
    T = 0 the draft's own softmax, since q is one-hot); 'drawn' reads q_i(x_i)
    (``drafts.base.drawn_probability``). Confidence rules only.
  initial_gamma: None (= γ_max) or >= 1: the schedule's γ_b in the first
    round ('schedule' only; must not exceed γ_max).
  widths: the verification widths k compiled (the target scores k + 1
    positions); each round runs the smallest k covering the longest live
    proposal, through ``lax.switch``. Default: the powers of two below γ_max.
    γ_max is always added, and 0 with ``skip_below``; each must be <= γ_max.

  Every rule decides whether to propose x_i before drawing it, from the past
  and the draft alone, so the output distribution is the target's exactly;
  proof: docs/exactness.md, section 5 (which also shows two rules that fail).
  """

  rule: str
  threshold: Optional[float] = None
  initial_gamma: Optional[int] = None
  widths: tuple[int, ...] = ()
  skip_below: Optional[float] = None
  confidence: str = "top"

  def __post_init__(self):
    if self.rule not in ADAPTIVE_RULES:
      raise ValueError(f"adaptive rule must be one of {ADAPTIVE_RULES}, got {self.rule!r}")
    if self.confidence not in CONFIDENCES:
      raise ValueError(f"adaptive confidence must be one of {CONFIDENCES}, got "
                       f"{self.confidence!r}")
    if self.confidence != "top" and self.rule not in CONFIDENCE_RULES:
      raise ValueError(f"confidence {self.confidence!r} applies to rules {CONFIDENCE_RULES} "
                       f"only, not {self.rule!r}")
    if self.rule in CONFIDENCE_RULES:
      if self.threshold is None or not 0.0 <= self.threshold <= 1.0:  # also rejects NaN
        raise ValueError(f"adaptive rule {self.rule!r} needs a threshold in [0, 1] (0: never "
                         f"stop early, 1: one draft token per round), got {self.threshold!r}")
      if self.initial_gamma is not None:
        raise ValueError(f"initial_gamma ({self.initial_gamma}) applies to rule 'schedule' "
                         f"only, not {self.rule!r}")
    else:
      if self.threshold is not None:
        raise ValueError(f"threshold ({self.threshold}) applies to rules {CONFIDENCE_RULES} "
                         "only, not 'schedule'")
      if self.initial_gamma is not None and self.initial_gamma < 1:
        raise ValueError(f"initial_gamma must be >= 1, got {self.initial_gamma}")
    if self.skip_below is not None:
      if self.rule not in CONFIDENCE_RULES:
        raise ValueError(f"skip_below ({self.skip_below}) applies to rules {CONFIDENCE_RULES} "
                         f"only, not {self.rule!r}")
      if not 0.0 <= self.skip_below <= 1.0:  # also rejects NaN
        raise ValueError(f"skip_below must be in [0, 1], got {self.skip_below!r}")
    least = 0 if self.skip_below is not None else 1
    if any(w < least for w in self.widths):
      raise ValueError(f"verification widths must be >= {least}"
                       f"{'' if least == 0 else ' (0 only with skip_below)'}, got {self.widths}")

  def verify_widths(self, gamma_max: int) -> tuple[int, ...]:
    """The sorted compiled widths for γ_max (γ_max always among them; 0, a
    plain target step, too when rows may skip a round)."""
    too_big = [w for w in self.widths if w > gamma_max]
    if too_big:
      raise ValueError(f"verification widths {too_big} exceed gamma (γ_max) = {gamma_max}")
    ws = set(self.widths) or {1 << j for j in range(gamma_max.bit_length()) if 1 << j < gamma_max}
    if self.skip_below is not None:
      ws.add(0)
    return tuple(sorted(ws | {gamma_max}))

  def start_gamma(self, gamma_max: int) -> int:
    """The schedule's γ_b in the first round."""
    g = gamma_max if self.initial_gamma is None else self.initial_gamma
    if g > gamma_max:
      raise ValueError(f"initial_gamma ({g}) exceeds gamma (γ_max) = {gamma_max}")
    return g


def _skipped_round(b: int, gamma: int, next_token: Array) -> KernelOutput:
  """A round where every live row proposed nothing: y ~ p_1, nothing tested."""
  zeros = jnp.zeros((b, gamma))
  return KernelOutput(num_accepted=jnp.zeros((b,), jnp.int32), next_token=next_token,
                      accepted=zeros.astype(bool), min_pq=zeros)


@struct.dataclass
class _SpecState:
  """The speculative loops' state (chain, adaptive and tree; B rows, M =
  max_decode_len, W = the most tokens a round commits: γ + 1 in the chain
  loop, γ_max + 1 with adaptive γ, D + 1 for a tree of depth D).

  seq: [B, M + W + 1] int32, decoder inputs; seq[:, t + 1] = y_t once
    committed. A round writes its candidates and next token at positions
    length + 1 .. length + W; slots past a row's length are stale and never
    read.
  length: [B] int32, committed tokens n; the next round starts from seq[:, n].
  done: [B] bool, the row emitted EOS or reached M.
  target_cache: the target's decode cache, M + W slots per row (chain) or
    M + N (a tree of N nodes, ``TreeShape.cache_len``); slots past length
    are stale, so rollback is moving length (for T5, ``DecoderCache``:
    self-attention K/V [B, slots, H, dh] per layer).
  draft_state: the approximation model's own state (a pytree; its cache).
  key: the PRNG key of the next round (unused at temperature 0).
  stats: ``SpecStats`` (chain loop) or ``TreeStats`` (tree loop), per row.
  gamma_row: [B] int32, the 'schedule' rule's γ_b for the next round; None
    in every other loop.
  """

  seq: Array
  length: Array
  done: Array
  target_cache: Any
  draft_state: Any
  key: Array
  stats: Any
  gamma_row: Any = None


def _start(target: TargetModel, target_params: Any, draft: ApproximationModel, inputs: Array,
           key: Array, *, buf_len: int, cache_len: int, stats: Any,
           partitioner: Partitioner | None, gamma_row: Array | None = None) -> _SpecState:
  """The speculative loops' first state: both models encode the inputs (the
  target once, for its cache and for a draft that reads its encoder output),
  both caches start empty, no row has a token."""
  _check_vocab(target, draft)
  encoded = target.encode(target_params, inputs)
  seq, length, done = _init_rows(inputs.shape[0], buf_len, target.config.decoder_start_id)
  state = _SpecState(
      seq=seq, length=length, done=done,
      target_cache=target.init_cache(target_params, encoded, inputs, cache_len),
      draft_state=init_draft(draft, inputs, cache_len, encoded), key=key, stats=stats,
      gamma_row=gamma_row)
  return _pin_state(state, partitioner)


def _propose(loop: _Loop, draft: ApproximationModel, s: _SpecState, key: Array
             ) -> tuple[Array, Array, Array, Any, Any]:
  """Algorithm 1's first loop: x_1..x_γ ~ q_1..q_γ from the draft. ->
  (xs [B, γ], q [B, γ, V], proposed [B]: the row's count c_b (γ unless
  adaptive; 0 for done rows), steps: draft steps run, draft_state)."""
  gamma, adaptive = loop.gamma, loop.adaptive
  if adaptive is None:
    xs, q, draft_state = draft.propose(s.draft_state, s.seq, s.length, gamma, loop.sampling, key)
    return (xs, q, jnp.full((s.seq.shape[0],), gamma, jnp.int32), proposal_steps(draft, gamma),
            draft_state)
  limit = jnp.where(~s.done, gamma if s.gamma_row is None else s.gamma_row, 0)
  threshold = adaptive.threshold if adaptive.rule in CONFIDENCE_RULES else 0.0
  xs, q, proposed, steps, draft_state = adaptive_proposal(
      draft, s.draft_state, s.seq, s.length, gamma, loop.sampling, key, limit, threshold,
      adaptive.skip_below, adaptive.rule == "cumulative", adaptive.confidence == "drawn")
  proposed = jnp.clip(proposed, 0, limit)  # done rows: 0; never past the row's limit
  return xs, q, proposed, steps, draft_state


def _verify(loop: _Loop, target_params: Any, k: int, seq: Array, n: Array, xs: Array, q: Array,
            cache: Any, key: Array, proposed: Array | None = None, write: bool = True
            ) -> tuple[KernelOutput, Any, Any]:
  """ONE target pass over [y_{n-1}, x_1..x_k] at positions n..n+k -> p_1..p_{k+1};
  Algorithm 1 on x_1..x_k. With ``proposed`` [B] (<= k), row b's positions
  past proposed[b] count as not proposed; outputs are padded to γ. With
  ``write=False``, in place of the updated cache come the new cache rows
  padded to γ+1 with their positions (-1: padding) for the target's
  ``write_rows`` after a ``lax.switch``: a branch that wrote the cache would
  copy all of it. The third result is (the target's final decoder states
  [B, γ+1, d], their positions [B, γ+1], -1: padding) if the draft wants
  them, else None."""
  target, sampling, gamma, lenience = loop.target, loop.sampling, loop.gamma, loop.lenience
  b = seq.shape[0]
  pos = n[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]           # --> [B, k+1]
  tokens = gather_positions(seq, pos)
  if write:
    res = target.decode(target_params, tokens, pos, cache, return_hidden=loop.states_wanted)
    logits, new_cache = res[:2]
  else:
    res = target.decode_rows(target_params, tokens, pos, cache, return_hidden=loop.states_wanted)
    logits, new_cache = res[0], target.pad_rows(res[1], pos, gamma + 1)
  feats = None
  if loop.states_wanted:
    feats = (jnp.pad(res[2], ((0, 0), (0, gamma - k), (0, 0))),
             jnp.pad(pos, ((0, 0), (0, gamma - k)), constant_values=-1))
  # Rows that proposed c < k: Algorithm 1 for γ = c inside the kernel (one
  # draw: the correction, or the bonus from p_{c+1}).
  capped = None if proposed is None else jnp.minimum(proposed, k)
  if sampling.greedy and lenience == 1.0:
    # p is the one-hot of the target's argmax: the kernel needs the argmax only.
    best = argmax(logits.astype(jnp.float32))                          # --> [B, k+1]
    if k == 0:
      return _skipped_round(b, gamma, best[:, 0]), new_cache, feats
    out = greedy_kernel(xs[:, :k], q[:, :k], best, capped)
  else:
    p = standardize(logits, sampling)                                  # --> [B, k+1, V]
    if k == 0:  # every live row skipped: a plain target step, y ~ p_1
      return _skipped_round(b, gamma, sample(key, p[:, 0], sampling)), new_cache, feats
    p_raw = jax.nn.softmax(logits[:, :k]) if (sampling.greedy and lenience < 1) else None
    out = speculative_sampling(key, xs[:, :k], q[:, :k], p, lenience, sampling.greedy, p_raw,
                               capped)
  if proposed is None:
    return out, new_cache, feats
  pad = ((0, 0), (0, gamma - k))
  out = out._replace(accepted=jnp.pad(out.accepted, pad), min_pq=jnp.pad(out.min_pq, pad))
  return out, new_cache, feats


def _verify_round(loop: _Loop, target_params: Any, seq: Array, n: Array, xs: Array, q: Array,
                  cache: Any, key: Array, proposed: Array) -> tuple[KernelOutput, Any, Any, Any]:
  """``_verify`` at γ, or with adaptive γ at the narrowest compiled width k
  covering every live row's proposal (``lax.switch`` over ``loop.widths``).
  -> (kernel output, target cache, target states or None, k)."""
  if loop.adaptive is None:
    out, cache, feats = _verify(loop, target_params, loop.gamma, seq, n, xs, q, cache, key)
    return out, cache, feats, loop.gamma
  widths = loop.widths
  widths_arr = jnp.asarray(widths, jnp.int32)
  branch = jnp.sum(widths_arr < jnp.max(proposed))
  if len(widths) == 1:
    out, cache, feats = _verify(loop, target_params, widths[0], seq, n, xs, q, cache, key,
                                proposed)
  else:
    branches = [functools.partial(_verify, loop, target_params, k, write=False) for k in widths]
    out, (rows, row_pos), feats = jax.lax.switch(branch, branches, seq, n, xs, q, cache, key,
                                                 proposed)
    cache = loop.target.write_rows(cache, rows, row_pos)
  return out, cache, feats, widths_arr[branch]


def _chain_stats(st: SpecStats, out: KernelOutput, live: Array, proposed: Array, steps: Any,
                 width: Any, count: Array) -> SpecStats:
  """``SpecStats`` after one round, over the positions whose verdict produced
  committed tokens (a position past a row's proposals, or past its first
  rejection, was never evaluated); count [B]: tokens the row kept (``_cut``)."""
  a = out.num_accepted
  gamma = st.accepted_at.shape[1]
  idx = jnp.arange(1, gamma + 1, dtype=jnp.int32)[None]                # 1..γ
  reached = jnp.minimum(jnp.minimum(a + 1, count), proposed)
  evaluated = live[:, None] & (idx <= reached[:, None])                # --> [B, γ]
  accepted = evaluated & out.accepted
  rejected = live & (a < proposed) & (a + 1 <= count)
  return SpecStats(
      target_calls=st.target_calls + live,
      draft_calls=st.draft_calls + live * steps,
      accepted_at=st.accepted_at + accepted,
      evaluated_at=st.evaluated_at + evaluated,
      accepted=st.accepted + jnp.sum(accepted, 1),
      rejected=st.rejected + rejected,
      min_pq_sum=st.min_pq_sum + jnp.sum(jnp.where(evaluated, out.min_pq, 0.0), 1),
      gamma_hist=st.gamma_hist + (live[:, None] & (jnp.arange(gamma + 1)[None]
                                                   == proposed[:, None])),
      target_positions=st.target_positions + live * (width + 1))


def _next_gamma_row(gamma_row: Array | None, a: Array, proposed: Array, live: Array,
                    gamma: int) -> Array | None:
  """Hugging Face's schedule: γ_b + 2 after a round that accepted all γ_b
  drafts, else γ_b - 1, within [1, γ_max] (None: not the 'schedule' rule)."""
  if gamma_row is None:
    return None
  grown = jnp.where(a >= proposed, jnp.minimum(gamma_row + 2, gamma),
                    jnp.maximum(gamma_row - 1, 1))
  return jnp.where(live, grown, gamma_row)


def _chain_round(loop: _Loop, target_params: Any, draft: ApproximationModel,
                 s: _SpecState) -> _SpecState:
  """One round of Algorithm 1 for every live row: propose, ONE target pass,
  the kernel, commit n accepted tokens + one, cut at EOS / max length."""
  b, gamma = s.seq.shape[0], loop.gamma
  key, k_draft, k_kernel = _round_keys(s.key, loop.sampling.greedy, 3)
  n, live = s.length, ~s.done
  xs, q, proposed, steps, draft_state = _propose(loop, draft, s, k_draft)
  offsets = jnp.arange(gamma + 1, dtype=jnp.int32)[None]               # 0..γ
  # Candidates go to seq[n+1 .. n+γ]; for live rows those slots are past the
  # committed prefix, and done rows are never read again.
  seq = s.seq.at[jnp.arange(b)[:, None], n[:, None] + offsets[:, 1:]].set(xs)
  out, target_cache, feats, width = _verify_round(
      loop, target_params, seq, n, xs, q, s.target_cache, k_kernel,
      None if loop.adaptive is None else proposed)
  a = out.num_accepted
  seq = seq.at[jnp.arange(b), n + a + 1].set(out.next_token)
  # Committed this round: seq[n+1 .. n+a+1].
  new_tok = gather_positions(seq, n[:, None] + offsets + 1)            # --> [B, γ+1]
  length, done, count = _cut(new_tok, a, n, s.done, loop.eos_id, loop.max_decode_len)
  if loop.states_wanted:
    draft_state = draft.commit_with_target(draft_state, seq, length, *feats)
  else:
    draft_state = draft.commit(draft_state, seq, length)
  stats = _chain_stats(s.stats, out, live, proposed, steps, width, count)
  gamma_row = _next_gamma_row(s.gamma_row, a, proposed, live, gamma)
  return _pin_state(_SpecState(seq, length, done, target_cache, draft_state, key, stats,
                               gamma_row), loop.partitioner)


def _wants_states(draft: ApproximationModel) -> bool:
  """A draft that reads the target's decoder states (``feature_bridge``) gets
  those of each round's committed positions through ``commit_with_target``."""
  return bool(getattr(draft, "wants_target_states", False))


def cache_length(max_decode_len: int, gamma: int) -> int:
  """Self-attention cache slots per row of the speculative loop at γ (γ_max
  when adaptive): rows finish at most at ``max_decode_len`` and a round
  writes γ + 1 positions past a row's length (§2.3: the target scores
  x_1..x_γ and one more). What every cost, memory and timing of that loop
  sizes its caches with; a tree's is ``TreeShape.cache_len``."""
  return max_decode_len + gamma + 1


_CHAIN_STATIC = ("target", "gamma", "max_decode_len", "sampling", "lenience", "eos_id",
                 "partitioner", "adaptive")


@functools.partial(jax.jit, static_argnames=_CHAIN_STATIC)
def speculative_decode(target: TargetModel, target_params: Any, draft: ApproximationModel,
                       inputs: Array, key: Array, *, gamma: int, max_decode_len: int,
                       sampling: SamplingConfig = SamplingConfig(), lenience: float = 1.0,
                       eos_id: int = 1, partitioner: Partitioner | None = None,
                       adaptive: Optional[AdaptiveConfig] = None) -> SpecOutput:
  """Speculative decoding (Algorithm 1 in a loop), batched with per-row acceptance.

  Each round (``_chain_round``): the draft proposes γ tokens (its own
  jit-compiled loop); the target scores all γ+1 positions in ONE forward
  pass; the kernel keeps a prefix and adds the correction/bonus token; each
  row advances by its own count. Rollback of both caches is implicit in the
  per-row length (keys past a query's position are masked and later
  overwritten).

  inputs [B, S] int32 (0 = pad) are fed to both encoders; ``draft`` is any
  approximation model (``specdec_jax.drafts``) over the same vocabulary.
  With a ``partitioner``, the target's params are expected on its mesh and its
  cache and the per-row state are pinned to its layout (a T5 draft built with
  the same partitioner pins its own cache).

  With ``adaptive`` (``AdaptiveConfig``), ``gamma`` is γ_max and each row
  proposes its own count c_b <= γ_max per round
  (``drafts.base.adaptive_proposal``); the target runs the narrowest compiled
  width covering max_b c_b, and a row's positions past c_b count as not
  proposed: its next token comes from p_{c_b + 1}. None is the fixed-γ loop.

  Returns ``SpecOutput``: tokens [B, max_decode_len] (0 after EOS), length
  [B], stats (``SpecStats``). With lenience 1 the output distribution is the
  baseline's (token for token at temperature 0) for any draft; proof:
  docs/exactness.md, sections 3-5.
  """
  _validate(max_decode_len, gamma, lenience)
  b = inputs.shape[0]
  widths, gamma_row = (), None
  if adaptive is not None:
    if not isinstance(adaptive, AdaptiveConfig):
      raise ValueError(f"adaptive must be an AdaptiveConfig or None, got {adaptive!r}")
    widths = adaptive.verify_widths(gamma)
    if adaptive.rule == "schedule":
      gamma_row = jnp.full((b,), adaptive.start_gamma(gamma), jnp.int32)
  loop = _Loop(target, sampling, eos_id, max_decode_len, partitioner, _wants_states(draft),
               gamma=gamma, lenience=lenience, adaptive=adaptive, widths=widths)
  # Rows finish at most at max_decode_len; a round writes γ+1 past the length.
  state = _start(target, target_params, draft, inputs, key, buf_len=max_decode_len + gamma + 2,
                 cache_len=cache_length(max_decode_len, gamma), stats=SpecStats.zeros(b, gamma),
                 partitioner=partitioner, gamma_row=gamma_row)
  state = jax.lax.while_loop(_running, functools.partial(_chain_round, loop, target_params, draft),
                             state)
  return SpecOutput(*_finish(state, max_decode_len), state.stats)


# ---------------------------------------------------------------- token trees


@struct.dataclass
class TreeStats:
  """Per-example statistics of one tree-speculative generation ([B] unless noted).

  target_calls, draft_calls: serial forward passes of M_p / M_q.
  accepted: proposals committed (Σ over rounds of the accepted depth).
  depth_hist [B, D + 1]: rounds whose accepted depth was j, at column j.
  rank_hist [B, K]: accepted nodes by their place among their siblings
    (column 0: the first child, the chain's own token; column k: the k-th
    alternative), i.e. which branch won.
  target_positions: positions the target scored (N per call).
  """

  target_calls: Array
  draft_calls: Array
  accepted: Array
  depth_hist: Array
  rank_hist: Array
  target_positions: Array

  @classmethod
  def zeros(cls, batch: int, tree: TreeShape) -> "TreeStats":
    z = jnp.zeros((batch,), jnp.int32)
    return cls(z, z, z, jnp.zeros((batch, tree.max_depth + 1), jnp.int32),
               jnp.zeros((batch, tree.max_branching), jnp.int32), z)


class TreeSpecOutput(NamedTuple):
  tokens: Array   # [B, max_decode_len], 0 after EOS
  length: Array   # [B]
  stats: TreeStats



def _tree_commit_states(draft: ApproximationModel, draft_state: Any, seq: Array, length: Array,
                        n: Array, out: TreeOutput, hidden: Array) -> Any:
  """Hands a draft that reads the target's decoder states (``feature_bridge``)
  those of the committed nodes: the root, then the path (hidden [B, N, d] ->
  [B, D+1, d]), at positions n .. n+a (-1 past the path)."""
  b, depth = out.path.shape
  offsets = jnp.arange(depth + 1, dtype=jnp.int32)[None]
  nodes = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), out.path], axis=1)  # --> [B, D+1]
  states = jnp.take_along_axis(hidden, jnp.maximum(nodes, 0)[..., None], axis=1)
  positions = jnp.where(nodes >= 0, n[:, None] + offsets, -1)
  return draft.commit_with_target(draft_state, seq, length, states, positions)


def _tree_stats(st: TreeStats, tree: TreeShape, out: TreeOutput, live: Array, steps: Any,
                count: Array) -> TreeStats:
  """``TreeStats`` after one round, over the accepted nodes that produced
  committed tokens (the cut at EOS included; count [B] from ``_cut``)."""
  depth = tree.max_depth
  kept = jnp.minimum(out.num_accepted, count)
  on_path = live[:, None] & (jnp.arange(1, depth + 1)[None] <= kept[:, None])  # --> [B, D]
  ranks = jnp.asarray(tree.sibling_rank)[jnp.maximum(out.path, 0)]
  return TreeStats(
      target_calls=st.target_calls + live,
      draft_calls=st.draft_calls + live * steps,
      accepted=st.accepted + jnp.where(live, kept, 0),
      depth_hist=st.depth_hist + (live[:, None] & (jnp.arange(depth + 1, dtype=jnp.int32)[None]
                                                   == kept[:, None])),
      rank_hist=st.rank_hist + jnp.sum(
          on_path[:, :, None] & (ranks[:, :, None] == jnp.arange(tree.max_branching)), 1),
      target_positions=st.target_positions + live * tree.num_nodes)


def _tree_round(loop: _Loop, target_params: Any, draft: ApproximationModel,
                s: _SpecState) -> _SpecState:
  """One tree round: the draft fills the tree, ONE target pass scores every
  node, the kernel keeps a path and emits one more token, both caches move
  the path into place, cut at EOS / max length."""
  tree, target = loop.tree, loop.target
  b = s.seq.shape[0]
  key, k_draft, k_kernel = _round_keys(s.key, loop.sampling.greedy, 3)
  n, live = s.length, ~s.done
  tokens, q, valid, steps, draft_state = tree_proposal(draft, s.draft_state, s.seq, n, tree,
                                                       loop.sampling, k_draft)
  tokens = tokens.at[:, 0].set(gather_positions(s.seq, n[:, None])[:, 0])  # the root
  res = target.decode_tree(target_params, tokens, n, tree, s.target_cache,
                           return_hidden=loop.states_wanted, partitioner=loop.partitioner)
  logits, target_cache = res[:2]                                       # --> [B, N, V]
  if loop.sampling.greedy:
    out = tree_greedy_kernel(tree, tokens, argmax(logits), valid)
  else:
    out = tree_speculative_sampling(k_kernel, tree, tokens, q,
                                    standardize(logits, loop.sampling), valid)
  a = out.num_accepted
  target_cache = target.commit_path(target_cache, n, out.path, a, loop.partitioner)
  # Committed this round: the path's tokens, then next_token, at n+1 .. n+a+1.
  offsets = jnp.arange(tree.max_depth + 1, dtype=jnp.int32)[None]      # 0..D
  new_tok = jnp.concatenate([out.path_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
  new_tok = jnp.where(offsets == a[:, None], out.next_token[:, None], new_tok)  # --> [B, D+1]
  # Slots past n+a+1 get stale tokens, never read.
  seq = s.seq.at[jnp.arange(b)[:, None], n[:, None] + 1 + offsets].set(new_tok)
  length, done, count = _cut(new_tok, a, n, s.done, loop.eos_id, loop.max_decode_len)
  draft_state = commit_tree(draft, draft_state, seq, length, n, out)
  if loop.states_wanted:
    draft_state = _tree_commit_states(draft, draft_state, seq, length, n, out, res[2])
  stats = _tree_stats(s.stats, tree, out, live, steps, count)
  return _pin_state(_SpecState(seq, length, done, target_cache, draft_state, key, stats),
                    loop.partitioner)


_TREE_STATIC = ("target", "tree", "max_decode_len", "sampling", "eos_id", "partitioner")


@functools.partial(jax.jit, static_argnames=_TREE_STATIC)
def tree_speculative_decode(target: TargetModel, target_params: Any, draft: ApproximationModel,
                            inputs: Array, key: Array, *, tree: TreeShape, max_decode_len: int,
                            sampling: SamplingConfig = SamplingConfig(), eos_id: int = 1,
                            partitioner: Partitioner | None = None) -> TreeSpecOutput:
  """Speculative decoding over a token tree: one target pass scores every node.

  Each round (``_tree_round``): the draft fills the static ``tree``
  (``drafts.base.tree_proposal``; node 0 is the last committed token); the
  target scores all N nodes in ONE pass with tree attention (the target's
  ``decode_tree``: node j at position n + depth(j), cache slot n + j);
  ``tree.tree_greedy_kernel`` (T = 0) or ``tree.tree_speculative_sampling``
  keeps the accepted path and emits one more token; the path's keys/values
  move into place (the target's ``commit_path``) in the target's cache and,
  through ``commit_tree``, the draft's. A chain of γ (``TreeShape.chain``)
  is Algorithm 1's round.

  Arguments as ``speculative_decode`` (no adaptive γ, no lenience). Returns
  ``TreeSpecOutput``: tokens [B, max_decode_len] (0 after EOS), length [B],
  stats (``TreeStats``). The output distribution is the baseline's (token for
  token at temperature 0) for any draft keeping the ``propose_tree``
  contract; proof: docs/exactness.md, section 10.
  """
  if not isinstance(tree, TreeShape):
    raise ValueError(f"tree must be a TreeShape, got {tree!r}")
  cache_len = tree.cache_len(max_decode_len)  # also checks that the tree fits
  loop = _Loop(target, sampling, eos_id, max_decode_len, partitioner, _wants_states(draft),
               tree=tree)
  state = _start(target, target_params, draft, inputs, key,
                 buf_len=max_decode_len + tree.max_depth + 2, cache_len=cache_len,
                 stats=TreeStats.zeros(inputs.shape[0], tree), partitioner=partitioner)
  state = jax.lax.while_loop(_running, functools.partial(_tree_round, loop, target_params, draft),
                             state)
  return TreeSpecOutput(*_finish(state, max_decode_len), state.stats)


# ------------------------------------------------------ compiler options


# XLA's GPU command buffers (CUDA graphs): a loop's kernels, and with WHILE and
# CONDITIONAL its while_loop and lax.switch, are recorded once and replayed as
# one launch, so the per-kernel launch cost of a step of hundreds of small
# kernels is paid once per graph. Profiling turns them off: time them with
# the clock.
COMMAND_BUFFER_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
_LOOP_STATIC = {temperature_sample: _BASELINE_STATIC, speculative_decode: _CHAIN_STATIC,
                tree_speculative_decode: _TREE_STATIC}


def command_buffer_options(min_graph_size: int) -> dict[str, Any]:
  """XLA compiler options that put a compiled function's GPU kernels into
  command buffers, any run of at least ``min_graph_size`` kernels (>= 1)."""
  if isinstance(min_graph_size, bool) or not isinstance(min_graph_size, int) or min_graph_size < 1:
    raise ValueError(f"command buffers need a minimum graph size >= 1, got {min_graph_size!r}")
  return {"xla_gpu_enable_command_buffer": COMMAND_BUFFER_COMMANDS,
          "xla_gpu_graph_min_graph_size": min_graph_size}


@functools.lru_cache(maxsize=None)
def with_command_buffers(loop: Any, min_graph_size: int, backend: Optional[str] = None) -> Any:
  """``loop`` (``temperature_sample``, ``speculative_decode`` or
  ``tree_speculative_decode``) compiled with XLA's command buffers
  (``command_buffer_options``) when the backend (default: JAX's default
  backend) is a GPU; the loop itself, unchanged, for ``min_graph_size`` 0 or
  another backend. Same arguments, same results: only how the kernels are
  launched changes."""
  if loop not in _LOOP_STATIC:
    raise ValueError(f"with_command_buffers takes one of the decoding loops, got {loop!r}")
  options = command_buffer_options(min_graph_size) if min_graph_size else None
  if options is None or (backend or jax.default_backend()) != "gpu":
    return loop
  return jax.jit(loop.__wrapped__, static_argnames=_LOOP_STATIC[loop], compiler_options=options)
