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

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.drafts.base import ApproximationModel, gather_positions
from specdec_jax.models.t5 import DecoderCache, T5Model
from specdec_jax.partitioning import Partitioner, constrain_batch, constrain_cache
from specdec_jax.sampling import SamplingConfig, sample, standardize
from specdec_jax.speculative import speculative_sampling

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

  One target call per token. inputs [B, S] int32 (0 = pad). The baseline every
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
    key, k_step = jax.random.split(s.key)
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
  """

  target_calls: Array
  draft_calls: Array
  accepted_at: Array
  evaluated_at: Array
  accepted: Array
  rejected: Array
  min_pq_sum: Array

  @classmethod
  def zeros(cls, batch: int, gamma: int) -> "SpecStats":
    z = jnp.zeros((batch,), jnp.int32)
    zg = jnp.zeros((batch, gamma), jnp.int32)
    return cls(z, z, zg, zg, z, z, jnp.zeros((batch,), jnp.float32))


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


@struct.dataclass
class _SpecState:
  seq: Array
  length: Array
  done: Array
  target_cache: DecoderCache
  draft_state: Any
  key: Array
  stats: SpecStats


@functools.partial(jax.jit, static_argnames=("target", "gamma", "max_decode_len", "sampling",
                                             "lenience", "eos_id", "partitioner"))
def speculative_decode(target: T5Model, target_params: Any, draft: ApproximationModel,
                       inputs: Array, key: Array, *, gamma: int, max_decode_len: int,
                       sampling: SamplingConfig = SamplingConfig(), lenience: float = 1.0,
                       eos_id: int = 1, partitioner: Partitioner | None = None) -> SpecOutput:
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
  """
  _validate(max_decode_len, gamma, lenience)
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
  state = _SpecState(
      seq=seq, length=length, done=done,
      target_cache=constrain_cache(target.init_cache(target_params, encoded, inputs, cache_len),
                                   partitioner, "target cache"),
      draft_state=draft.init(inputs, cache_len), key=key,
      stats=SpecStats.zeros(b, gamma))
  offsets = jnp.arange(gamma + 1, dtype=jnp.int32)[None]

  def body(s: _SpecState) -> _SpecState:
    key, k_draft, k_kernel = jax.random.split(s.key, 3)
    n = s.length
    live = ~s.done
    xs, q, draft_state = draft.propose(s.draft_state, s.seq, n, gamma, sampling, k_draft)
    # Candidates go to seq[n+1 .. n+γ]; for live rows those slots are past the
    # committed prefix, and done rows are never read again.
    rows = jnp.arange(b)[:, None]
    seq = s.seq.at[rows, n[:, None] + offsets[:, 1:]].set(xs)
    # ONE target pass over [y_{n-1}, x_1..x_γ] at positions n..n+γ -> p_1..p_{γ+1}.
    pos = n[:, None] + offsets
    logits, target_cache = target.decode(target_params, gather_positions(seq, pos), pos,
                                         s.target_cache)
    p = standardize(logits, sampling)
    p_raw = jax.nn.softmax(logits[:, :gamma]) if (sampling.greedy and lenience < 1) else None
    out = speculative_sampling(k_kernel, xs, q, p, lenience, sampling.greedy, p_raw)
    a = out.num_accepted
    seq = seq.at[jnp.arange(b), n + a + 1].set(out.next_token)
    # Committed this round: seq[n+1 .. n+a+1]; cut at the first EOS / max length.
    new_tok = gather_positions(seq, pos + 1)                          # [B, γ+1]
    is_eos = (new_tok == eos_id) & (offsets <= a[:, None])
    first_eos = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1) + 1, a + 1)
    count = jnp.minimum(first_eos, max_decode_len - n)
    length = jnp.where(live, n + count, n)
    done = s.done | (live & (jnp.any(is_eos, 1) | (length >= max_decode_len)))
    draft_state = draft.commit(draft_state, seq, length)

    # Statistics over positions whose verdict produced committed tokens.
    idx = offsets[:, :gamma] + 1                                       # 1..γ
    evaluated = live[:, None] & (idx <= jnp.minimum(a + 1, count)[:, None])
    accepted = evaluated & out.accepted
    rejected = live & (a < gamma) & (a + 1 <= count)
    st = s.stats
    stats = SpecStats(
        target_calls=st.target_calls + live,
        draft_calls=st.draft_calls + live * gamma,
        accepted_at=st.accepted_at + accepted,
        evaluated_at=st.evaluated_at + evaluated,
        accepted=st.accepted + jnp.sum(accepted, 1),
        rejected=st.rejected + rejected,
        min_pq_sum=st.min_pq_sum + jnp.sum(jnp.where(evaluated, out.min_pq, 0.0), 1))
    seq, length, done = _pin(seq, length, done, partitioner)
    target_cache = constrain_cache(target_cache, partitioner, "target cache")
    return _SpecState(seq, length, done, target_cache, draft_state, key, stats)

  state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  return SpecOutput(_outputs(state.seq, state.length, max_decode_len), state.length,
                    state.stats)
