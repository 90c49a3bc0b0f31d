"""Decoding loops: the plain T5X-style baseline and speculative decoding.

Both are one ``lax.while_loop`` under ``jax.jit`` that runs until every row has
ended — no host round trip per step — over fixed-shape state:

  seq     [B, T_buf] int32  decoder inputs: seq[:, 0] = start, seq[:, i+1] = y_i
  length  [B] int32         committed output tokens per row (the per-row index)
  done    [B] bool          row emitted EOS or reached max_decode_len

A row stops changing once done. Outputs are ``seq[:, 1:max_decode_len+1]`` with
every position at or past ``length`` set to 0, so a row is padded with 0 after
its EOS (T5X semantics).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.drafts.base import (ApproximationModel, adaptive_proposal, commit_tree,
                                     gather_positions, init_draft, tree_proposal)
from specdec_jax.models.t5 import DecoderCache, T5Model
from specdec_jax.partitioning import Partitioner, constrain_batch, constrain_cache
from specdec_jax.sampling import SamplingConfig, argmax, sample, standardize
from specdec_jax.speculative import KernelOutput, greedy_kernel, speculative_sampling
from specdec_jax.tree import TreeShape, tree_greedy_kernel, tree_speculative_sampling

Array = jax.Array


def _validate(max_decode_len: int, gamma: int | None = None,
              lenience: float | None = None) -> None:
  if max_decode_len < 1:
    raise ValueError(f"max_decode_len must be >= 1, got {max_decode_len}")
  if gamma is not None and gamma < 1:
    raise ValueError(f"gamma must be >= 1 (draft tokens per target call), got {gamma}")
  if lenience is not None and not 0.0 < lenience <= 1.0:
    raise ValueError(f"lenience must be in (0, 1] (1 is exact), got {lenience}")


def _outputs(seq: Array, length: Array, max_decode_len: int) -> Array:
  out = seq[:, 1:max_decode_len + 1]
  return jnp.where(jnp.arange(max_decode_len)[None] < length[:, None], out, 0)


def _init_seq(batch: int, buf_len: int, start_id: int) -> Array:
  seq = jnp.zeros((batch, buf_len), jnp.int32)
  return seq.at[:, 0].set(start_id)


# ------------------------------------------------------------------ baseline


class DecodeOutput(NamedTuple):
  tokens: Array    # [B, max_decode_len], 0 after EOS
  log_prob: Array  # [B] sum of log p(y_t) under the model's raw softmax
  length: Array    # [B] tokens generated (including EOS)


@struct.dataclass
class _BaselineState:
  seq: Array
  length: Array
  done: Array
  log_prob: Array
  cache: DecoderCache
  key: Array


def _pin(seq: Array, length: Array, done: Array, partitioner: Partitioner | None):
  """The loop's per-row state, batch over the mesh's 'data' axis (if sharded)."""
  return (constrain_batch(seq, partitioner, "seq"), constrain_batch(length, partitioner, "length"),
          constrain_batch(done, partitioner, "done"))


@functools.partial(jax.jit, static_argnames=("model", "max_decode_len", "sampling",
                                             "eos_id", "partitioner"))
def temperature_sample(model: T5Model, params: Any, inputs: Array, key: Array, *,
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
  cfg = model.config
  encoded = model.encode(params, inputs)
  cache = model.init_cache(params, encoded, inputs, max_decode_len)
  seq, length, done = _pin(_init_seq(b, max_decode_len + 1, cfg.decoder_start_id),
                           jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), partitioner)
  state = _BaselineState(
      seq=seq, length=length, done=done, log_prob=jnp.zeros((b,), jnp.float32),
      cache=constrain_cache(cache, partitioner, "target cache"), key=key)

  def body(s: _BaselineState) -> _BaselineState:
    # Argmax draws nothing: no key split per step at temperature 0.
    key, k_step = (s.key, s.key) if sampling.greedy else jax.random.split(s.key)
    pos = s.length[:, None]
    logits, cache = model.decode(params, gather_positions(s.seq, pos), pos, s.cache)
    logits = logits[:, 0]
    token = sample(k_step, standardize(logits, sampling), sampling)
    live = ~s.done
    token_lp = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], -1)[:, 0]
    seq = jnp.where(live[:, None] & (jnp.arange(s.seq.shape[1])[None] == s.length[:, None] + 1),
                    token[:, None], s.seq)
    length = s.length + live
    done = s.done | (live & (token == eos_id)) | (length >= max_decode_len)
    seq, length, done = _pin(seq, length, done, partitioner)
    return _BaselineState(seq, length, done, s.log_prob + jnp.where(live, token_lp, 0.0),
                          constrain_cache(cache, partitioner, "target cache"), key)

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  return DecodeOutput(_outputs(state.seq, state.length, max_decode_len), state.log_prob,
                      state.length)


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
  seq: Array
  length: Array
  done: Array
  target_cache: DecoderCache
  draft_state: Any
  key: Array
  stats: SpecStats
  gamma_row: Any = None  # [B] int32 under the 'schedule' rule, else None


@functools.partial(jax.jit, static_argnames=("target", "gamma", "max_decode_len", "sampling",
                                             "lenience", "eos_id", "partitioner", "adaptive"))
def speculative_decode(target: T5Model, target_params: Any, draft: ApproximationModel,
                       inputs: Array, key: Array, *, gamma: int, max_decode_len: int,
                       sampling: SamplingConfig = SamplingConfig(), lenience: float = 1.0,
                       eos_id: int = 1, partitioner: Partitioner | None = None,
                       adaptive: Optional[AdaptiveConfig] = None) -> SpecOutput:
  """Speculative decoding (Algorithm 1 in a loop), batched with per-row acceptance.

  Each round: the draft proposes γ tokens (its own jit-compiled loop); the
  target scores all γ+1 positions in ONE forward pass; the kernel keeps a
  prefix and adds the correction/bonus token; each row advances by its own
  count. Rollback of both caches is implicit in the per-row length (keys past
  a query's position are masked and later overwritten).

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
  if adaptive is not None:
    if not isinstance(adaptive, AdaptiveConfig):
      raise ValueError(f"adaptive must be an AdaptiveConfig or None, got {adaptive!r}")
    widths = adaptive.verify_widths(gamma)
    start_gamma = adaptive.start_gamma(gamma) if adaptive.rule == "schedule" else None
  b = inputs.shape[0]
  cfg = target.config
  if draft.vocab_size != cfg.vocab_size:
    raise ValueError(f"vocab mismatch: target vocab_size {cfg.vocab_size} != draft "
                     f"vocab_size {draft.vocab_size}; p and q must cover the same tokens")
  # Rows finish at most at max_decode_len; a round writes γ+1 past the length.
  buf_len = max_decode_len + gamma + 2
  cache_len = max_decode_len + gamma + 1
  encoded = target.encode(target_params, inputs)
  seq, length, done = _pin(_init_seq(b, buf_len, cfg.decoder_start_id),
                           jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), partitioner)
  gamma_row = None
  if adaptive is not None and adaptive.rule == "schedule":
    gamma_row = constrain_batch(jnp.full((b,), start_gamma, jnp.int32), partitioner, "gamma")
  state = _SpecState(
      seq=seq, length=length, done=done,
      target_cache=constrain_cache(target.init_cache(target_params, encoded, inputs, cache_len),
                                   partitioner, "target cache"),
      draft_state=init_draft(draft, inputs, cache_len, encoded), key=key,
      stats=SpecStats.zeros(b, gamma), gamma_row=gamma_row)
  offsets = jnp.arange(gamma + 1, dtype=jnp.int32)[None]
  idx = offsets[:, :gamma] + 1                                         # 1..γ
  # A draft that reads the target's decoder states (``feature_bridge``) gets
  # each pass's, padded to γ+1 positions, through ``commit_with_target``.
  states_wanted = bool(getattr(draft, "wants_target_states", False))

  def verify(k: int, seq: Array, n: Array, xs: Array, q: Array, cache: DecoderCache,
             key: Array, proposed: Array | None = None, write: bool = True
             ) -> tuple[KernelOutput, Any, Any]:
    """ONE target pass over [y_{n-1}, x_1..x_k] at positions n..n+k -> p_1..p_{k+1};
    Algorithm 1 on x_1..x_k. With ``proposed`` [B] (<= k), row b's positions
    past proposed[b] count as not proposed; outputs are padded to γ. With
    ``write=False``, in place of the updated cache come the new cache rows
    padded to γ+1 with their positions (-1: padding) for
    ``T5Model.write_rows`` after a ``lax.switch``: a branch that wrote the
    cache would copy all of it. The third result is (the target's final
    decoder states [B, γ+1, d], their positions [B, γ+1], -1: padding) if the
    draft wants them, else None."""
    pos = n[:, None] + offsets[:, :k + 1]
    tokens = gather_positions(seq, pos)
    if write:
      res = target.decode(target_params, tokens, pos, cache, return_hidden=states_wanted)
      logits, new_cache = res[:2]
    else:
      res = target.decode_rows(target_params, tokens, pos, cache, return_hidden=states_wanted)
      logits, new_cache = res[0], T5Model.pad_rows(res[1], pos, gamma + 1)
    feats = None
    if states_wanted:
      feats = (jnp.pad(res[2], ((0, 0), (0, gamma - k), (0, 0))),
               jnp.pad(pos, ((0, 0), (0, gamma - k)), constant_values=-1))
    # Rows that proposed c < k: Algorithm 1 for γ = c inside the kernel (one
    # draw: the correction, or the bonus from p_{c+1}).
    capped = None if proposed is None else jnp.minimum(proposed, k)
    if sampling.greedy and lenience == 1.0:
      # p is the one-hot of the target's argmax: the kernel needs the argmax only.
      best = argmax(logits.astype(jnp.float32))                        # [B, k+1]
      if k == 0:
        return _skipped_round(b, gamma, best[:, 0]), new_cache, feats
      out = greedy_kernel(xs[:, :k], q[:, :k], best, capped)
    else:
      p = standardize(logits, sampling)
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

  def body(s: _SpecState) -> _SpecState:
    # At temperature 0 the output is the target's argmax whatever the draft
    # proposes, and the kernel draws nothing: no key split per round.
    if sampling.greedy:
      key = k_draft = k_kernel = s.key
    else:
      key, k_draft, k_kernel = jax.random.split(s.key, 3)
    n = s.length
    live = ~s.done
    rows = jnp.arange(b)[:, None]
    if adaptive is None:
      xs, q, draft_state = draft.propose(s.draft_state, s.seq, n, gamma, sampling, k_draft)
    else:
      limit = jnp.where(live, gamma if s.gamma_row is None else s.gamma_row, 0)
      threshold = adaptive.threshold if adaptive.rule in CONFIDENCE_RULES else 0.0
      xs, q, proposed, steps, draft_state = adaptive_proposal(
          draft, s.draft_state, s.seq, n, gamma, sampling, k_draft, limit, threshold,
          adaptive.skip_below, adaptive.rule == "cumulative", adaptive.confidence == "drawn")
      proposed = jnp.clip(proposed, 0, limit)  # done rows: 0; never past the row's limit
    # Candidates go to seq[n+1 .. n+γ]; for live rows those slots are past the
    # committed prefix, and done rows are never read again.
    seq = s.seq.at[rows, n[:, None] + offsets[:, 1:]].set(xs)
    if adaptive is None:
      out, target_cache, feats = verify(gamma, seq, n, xs, q, s.target_cache, k_kernel)
      proposed, steps, width = jnp.full((b,), gamma, jnp.int32), gamma, gamma
    else:
      # The narrowest compiled width covering every live row's proposal.
      widths_arr = jnp.asarray(widths, jnp.int32)
      branch = jnp.sum(widths_arr < jnp.max(proposed))
      if len(widths) == 1:
        out, target_cache, feats = verify(widths[0], seq, n, xs, q, s.target_cache, k_kernel,
                                          proposed)
      else:
        out, (rows, row_pos), feats = jax.lax.switch(
            branch, [functools.partial(verify, k, write=False) for k in widths], seq, n, xs,
            q, s.target_cache, k_kernel, proposed)
        target_cache = target.write_rows(s.target_cache, rows, row_pos)
      width = widths_arr[branch]
    a = out.num_accepted
    seq = seq.at[jnp.arange(b), n + a + 1].set(out.next_token)
    # Committed this round: seq[n+1 .. n+a+1]; cut at the first EOS / max length.
    pos = n[:, None] + offsets
    new_tok = gather_positions(seq, pos + 1)                          # [B, γ+1]
    is_eos = (new_tok == eos_id) & (offsets <= a[:, None])
    first_eos = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1) + 1, a + 1)
    count = jnp.minimum(first_eos, max_decode_len - n)
    length = jnp.where(live, n + count, n)
    done = s.done | (live & (jnp.any(is_eos, 1) | (length >= max_decode_len)))
    if states_wanted:
      draft_state = draft.commit_with_target(draft_state, seq, length, *feats)
    else:
      draft_state = draft.commit(draft_state, seq, length)

    # Statistics over positions whose verdict produced committed tokens (a
    # position past a row's proposals was never evaluated).
    reached = jnp.minimum(jnp.minimum(a + 1, count), proposed)
    evaluated = live[:, None] & (idx <= reached[:, None])
    accepted = evaluated & out.accepted
    rejected = live & (a < proposed) & (a + 1 <= count)
    st = s.stats
    stats = SpecStats(
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
    gamma_row = s.gamma_row
    if gamma_row is not None:
      # HF's schedule: +2 after a round that accepted all γ_b drafts, else -1.
      grown = jnp.where(a >= proposed, jnp.minimum(gamma_row + 2, gamma),
                        jnp.maximum(gamma_row - 1, 1))
      gamma_row = constrain_batch(jnp.where(live, grown, gamma_row), partitioner, "gamma")
    seq, length, done = _pin(seq, length, done, partitioner)
    target_cache = constrain_cache(target_cache, partitioner, "target cache")
    return _SpecState(seq, length, done, target_cache, draft_state, key, stats, gamma_row)

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  return SpecOutput(_outputs(state.seq, state.length, max_decode_len), state.length,
                    state.stats)


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


@struct.dataclass
class _TreeState:
  seq: Array
  length: Array
  done: Array
  target_cache: DecoderCache
  draft_state: Any
  key: Array
  stats: TreeStats


@functools.partial(jax.jit, static_argnames=("target", "tree", "max_decode_len", "sampling",
                                             "eos_id", "partitioner"))
def tree_speculative_decode(target: T5Model, target_params: Any, draft: ApproximationModel,
                            inputs: Array, key: Array, *, tree: TreeShape, max_decode_len: int,
                            sampling: SamplingConfig = SamplingConfig(), eos_id: int = 1,
                            partitioner: Partitioner | None = None) -> TreeSpecOutput:
  """Speculative decoding over a token tree: one target pass scores every node.

  Each round: the draft fills the static ``tree`` (``drafts.base.tree_proposal``;
  node 0 is the last committed token); the target scores all N nodes in ONE
  pass with tree attention (``T5Model.decode_tree``: node j at position n +
  depth(j), cache slot n + j); ``tree.tree_greedy_kernel`` (T = 0) or
  ``tree.tree_speculative_sampling`` keeps the accepted path and emits one
  more token; the path's keys/values move into place (``T5Model.commit_path``)
  in the target's cache and, through ``commit_tree``, the draft's. A chain of
  γ (``TreeShape.chain``) is Algorithm 1's round.

  Arguments as ``speculative_decode`` (no adaptive γ, no lenience). Returns
  ``TreeSpecOutput``: tokens [B, max_decode_len] (0 after EOS), length [B],
  stats (``TreeStats``). The output distribution is the baseline's (token for
  token at temperature 0) for any draft keeping the ``propose_tree``
  contract; proof: docs/exactness.md, section 10.
  """
  if not isinstance(tree, TreeShape):
    raise ValueError(f"tree must be a TreeShape, got {tree!r}")
  cache_len = tree.cache_len(max_decode_len)  # also checks that the tree fits
  b = inputs.shape[0]
  cfg = target.config
  if draft.vocab_size != cfg.vocab_size:
    raise ValueError(f"vocab mismatch: target vocab_size {cfg.vocab_size} != draft "
                     f"vocab_size {draft.vocab_size}; p and q must cover the same tokens")
  depth = tree.max_depth
  buf_len = max_decode_len + depth + 2
  encoded = target.encode(target_params, inputs)
  seq, length, done = _pin(_init_seq(b, buf_len, cfg.decoder_start_id),
                           jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), partitioner)
  state = _TreeState(
      seq=seq, length=length, done=done,
      target_cache=constrain_cache(target.init_cache(target_params, encoded, inputs, cache_len),
                                   partitioner, "target cache"),
      draft_state=init_draft(draft, inputs, cache_len, encoded), key=key,
      stats=TreeStats.zeros(b, tree))
  offsets = jnp.arange(depth + 1, dtype=jnp.int32)[None]
  rank = jnp.asarray(tree.sibling_rank)
  # A draft that reads the target's decoder states (``feature_bridge``) gets
  # those of each round's committed nodes through ``commit_with_target``.
  states_wanted = bool(getattr(draft, "wants_target_states", False))

  def body(s: _TreeState) -> _TreeState:
    if sampling.greedy:
      key = k_draft = k_kernel = s.key
    else:
      key, k_draft, k_kernel = jax.random.split(s.key, 3)
    n = s.length
    live = ~s.done
    tokens, q, valid, steps, draft_state = tree_proposal(draft, s.draft_state, s.seq, n, tree,
                                                         sampling, k_draft)
    tokens = tokens.at[:, 0].set(gather_positions(s.seq, n[:, None])[:, 0])  # the root
    res = target.decode_tree(target_params, tokens, n, tree, s.target_cache,
                             return_hidden=states_wanted, partitioner=partitioner)
    logits, target_cache = res[:2]
    if sampling.greedy:
      out = tree_greedy_kernel(tree, tokens, argmax(logits), valid)
    else:
      out = tree_speculative_sampling(k_kernel, tree, tokens, q, standardize(logits, sampling),
                                      valid)
    a = out.num_accepted
    target_cache = T5Model.commit_path(target_cache, n, out.path, a, partitioner)
    # Committed this round: the path's tokens, then next_token, at n+1 .. n+a+1.
    new_tok = jnp.concatenate([out.path_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    new_tok = jnp.where(offsets == a[:, None], out.next_token[:, None], new_tok)
    rows = jnp.arange(b)[:, None]
    seq = s.seq.at[rows, n[:, None] + 1 + offsets].set(new_tok)  # past n+a+1: stale, unread
    is_eos = (new_tok == eos_id) & (offsets <= a[:, None])
    first_eos = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1) + 1, a + 1)
    count = jnp.minimum(first_eos, max_decode_len - n)
    length = jnp.where(live, n + count, n)
    done = s.done | (live & (jnp.any(is_eos, 1) | (length >= max_decode_len)))
    draft_state = commit_tree(draft, draft_state, seq, length, n, out)
    if states_wanted:
      # The target's final states at the committed nodes (root, then the
      # path) and their positions n .. n+a (-1 past the path).
      nodes = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), out.path], axis=1)
      hidden = jnp.take_along_axis(res[2], jnp.maximum(nodes, 0)[..., None], axis=1)
      positions = jnp.where(nodes >= 0, n[:, None] + offsets, -1)
      draft_state = draft.commit_with_target(draft_state, seq, length, hidden, positions)
    # Accepted nodes that produced committed tokens (the cut at EOS included).
    kept = jnp.minimum(a, count)
    on_path = live[:, None] & (jnp.arange(1, depth + 1)[None] <= kept[:, None])
    ranks = rank[jnp.maximum(out.path, 0)]
    st = s.stats
    stats = TreeStats(
        target_calls=st.target_calls + live,
        draft_calls=st.draft_calls + live * steps,
        accepted=st.accepted + jnp.where(live, kept, 0),
        depth_hist=st.depth_hist + (live[:, None] & (offsets == kept[:, None])),
        rank_hist=st.rank_hist + jnp.sum(
            on_path[:, :, None] & (ranks[:, :, None] == jnp.arange(tree.max_branching)), 1),
        target_positions=st.target_positions + live * tree.num_nodes)
    seq, length, done = _pin(seq, length, done, partitioner)
    target_cache = constrain_cache(target_cache, partitioner, "target cache")
    return _TreeState(seq, length, done, target_cache, draft_state, key, stats)

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  return TreeSpecOutput(_outputs(state.seq, state.length, max_decode_len), state.length,
                        state.stats)
