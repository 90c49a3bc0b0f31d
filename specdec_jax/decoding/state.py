"""What every decoding loop shares: the rows' state, the round's bookkeeping and
one target pass judged by Algorithm 1.

Outputs are ``seq[:, 1:M+1]`` with positions at or past ``length`` set to 0
(T5X semantics: a row is 0 after its EOS). A row stops changing once done."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.drafts.base import ApproximationModel, gather_positions, init_draft
from specdec_jax.models.base import TargetModel, score
from specdec_jax.partitioning import Partitioner, constrain_batch, constrain_cache
from specdec_jax.sampling import SamplingConfig, argmax, sample, standardize
from specdec_jax.speculative import KernelOutput, greedy_kernel, speculative_sampling

Array = jax.Array


def validate(max_decode_len: int, gamma: int | None = None, lenience: float | None = None) -> None:
  """A loop's arguments, checked before anything is traced."""
  if max_decode_len < 1:
    raise ValueError(f"max_decode_len must be >= 1, got {max_decode_len}")
  if gamma is not None and gamma < 1:
    raise ValueError(f"gamma must be >= 1 (draft tokens per target call), got {gamma}")
  if lenience is not None and not 0.0 < lenience <= 1.0:
    raise ValueError(f"lenience must be in (0, 1] (1 is exact), got {lenience}")


def init_rows(batch: int, buf_len: int, start_id: int) -> tuple[Array, Array, Array]:
  """The empty rows: seq [B, buf_len] (seq[:, 0] = start), length 0, done False."""
  seq = jnp.zeros((batch, buf_len), jnp.int32).at[:, 0].set(start_id)
  return seq, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool)


def round_keys(key: Array, greedy: bool, num: int) -> tuple[Array, ...]:
  """(the next round's key, then num - 1 draw keys); at T = 0 all the incoming one."""
  return (key,) * num if greedy else tuple(jax.random.split(key, num))


def cut(new_tokens: Array, num_accepted: Array, length: Array, done: Array, eos_id: int,
        max_decode_len: int) -> tuple[Array, Array, Array]:
  """Which of a round's tokens count, and which rows end: new_tokens [B, W] at
  positions length + 1 .. length + num_accepted + 1, kept up to the first EOS and
  max_decode_len. -> (length [B], done [B], count [B])."""
  offsets = jnp.arange(new_tokens.shape[1], dtype=jnp.int32)[None]
  live = ~done
  is_eos = (new_tokens == eos_id) & (offsets <= num_accepted[:, None])  # --> [B, W]
  ended = jnp.any(is_eos, 1)
  first_eos = jnp.where(ended, jnp.argmax(is_eos, 1) + 1, num_accepted + 1)
  count = jnp.minimum(first_eos, max_decode_len - length)
  new_length = jnp.where(live, length + count, length)
  return new_length, done | (live & (ended | (new_length >= max_decode_len))), count


def pin_state(state: Any, partitioner: Partitioner | None) -> Any:
  """Per-row arrays over the mesh's 'data' axis, the target cache in T5X layout."""
  if partitioner is None:
    return state
  pinned = dict(seq=constrain_batch(state.seq, partitioner, "seq"),
                length=constrain_batch(state.length, partitioner, "length"),
                done=constrain_batch(state.done, partitioner, "done"),
                target_cache=constrain_cache(state.target_cache, partitioner, "target cache"))
  if isinstance(state, SpecState) and state.gamma_row is not None:
    pinned["gamma_row"] = constrain_batch(state.gamma_row, partitioner, "gamma")
  return state.replace(**pinned)


def running(state: Any) -> Array:
  """The loops' condition: some row has not ended."""
  return ~jnp.all(state.done)


def finish(state: Any, max_decode_len: int) -> tuple[Array, Array]:
  """(tokens [B, max_decode_len], 0 at and past each row's length; length [B])."""
  out = state.seq[:, 1:max_decode_len + 1]
  mask = jnp.arange(max_decode_len)[None] < state.length[:, None]
  return jnp.where(mask, out, 0), state.length


@dataclasses.dataclass(frozen=True)
class Loop:
  """What every round of a loop reads and never changes (static under jit).

  target: M_p; sampling: §2.2's standardization; eos_id, max_decode_len: where
  rows end; partitioner: the mesh layout (None: one device)."""

  target: TargetModel
  sampling: SamplingConfig
  eos_id: int
  max_decode_len: int
  partitioner: Optional[Partitioner]


@struct.dataclass
class SpecState:
  """The speculative loops' state (B rows, M = max_decode_len, W = the most tokens
  a round commits: γ + 1, γ_max + 1 adaptive, D + 1 for a tree).

  seq:          [B, M + W + 1] int32, decoder inputs: seq[:, 0] = start,
                seq[:, t + 1] = y_t; slots past length are stale.
  length:       [B] int32, committed tokens n; the next round starts from seq[:, n].
  done:         [B] bool, the row emitted EOS or reached M.
  target_cache: M + W slots per row (a tree: ``TreeShape.cache_len``); stale past
                length, so rollback is moving length.
  draft_state:  the approximation model's own state (a pytree).
  key:          the PRNG key of the next round (unused at T = 0).
  stats:        ``SpecStats`` (chain loops) or ``TreeStats`` (tree loop), per row.
  gamma_row:    [B] int32, the 'schedule' rule's γ_b for the next round, else None."""

  seq: Array
  length: Array
  done: Array
  target_cache: Any
  draft_state: Any
  key: Array
  stats: Any
  gamma_row: Any = None


def start(target: TargetModel, target_params: Any, draft: ApproximationModel, inputs: Array,
          key: Array, *, buf_len: int, cache_len: int, stats: Any,
          partitioner: Partitioner | None, gamma_row: Array | None = None) -> SpecState:
  """The speculative loops' first state: both models encode, both caches empty."""
  if draft.vocab_size != target.config.vocab_size:
    raise ValueError(f"vocab mismatch: target vocab_size {target.config.vocab_size} != draft "
                     f"vocab_size {draft.vocab_size}; p and q must cover the same tokens")
  encoded = target.encode(target_params, inputs)
  seq, length, done = init_rows(inputs.shape[0], buf_len, target.config.decoder_start_id)
  state = SpecState(seq=seq, length=length, done=done,
                    target_cache=target.init_cache(target_params, encoded, inputs, cache_len),
                    draft_state=init_draft(draft, inputs, cache_len, encoded), key=key, stats=stats,
                    gamma_row=gamma_row)
  return pin_state(state, partitioner)


def cache_length(max_decode_len: int, gamma: int) -> int:
  """Cache slots per row at γ (γ_max if adaptive): max_decode_len + γ + 1 (§2.3)."""
  return max_decode_len + gamma + 1


def target_pass(target: TargetModel, params: Any, seq: Array, n: Array, k: int, cache: Any, *,
                write: bool = True, hidden: bool = False) -> tuple[Array, Any, Any, Array]:
  """ONE target pass over [y_{n-1}, x_1..x_k] at positions n..n+k -> (logits
  [B, k+1, V], cache (or new rows with ``write=False``), final states
  [B, k+1, d] if ``hidden`` else None, positions [B, k+1])."""
  pos = n[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
  logits, new, states = score(target, params, gather_positions(seq, pos), pos, cache, write=write,
                              hidden=hidden)
  return logits, new, states, pos


def judge(sampling: SamplingConfig, lenience: float, logits: Array, xs: Array, q: Array,
          key: Array, proposed: Array | None, width: int) -> KernelOutput:
  """Algorithm 1 on x_1..x_k [B, >= k] with q [B, >= k, V], given logits
  [B, k + 1, V]. ``proposed`` [B]: row b's positions past min(proposed[b], k)
  count as unproposed. k = 0 is a plain target step. ``accepted`` and
  ``min_pq`` are padded to ``width`` columns."""
  b, k = logits.shape[0], logits.shape[1] - 1
  capped = None if proposed is None else jnp.minimum(proposed, k)
  if sampling.greedy and lenience == 1.0:
    # p is the one-hot of the target's argmax: the kernel needs the argmax only.
    best = argmax(logits.astype(jnp.float32))                          # --> [B, k+1]
    if k == 0:
      return _skipped_round(b, width, best[:, 0])
    out = greedy_kernel(xs[:, :k], q[:, :k], best, capped)
  else:
    p = standardize(logits, sampling)                                  # --> [B, k+1, V]
    if k == 0:
      return _skipped_round(b, width, sample(key, p[:, 0], sampling))
    p_raw = jax.nn.softmax(logits[:, :k]) if (sampling.greedy and lenience < 1) else None
    out = speculative_sampling(key, xs[:, :k], q[:, :k], p, lenience, sampling.greedy, p_raw,
                               capped)
  if width == k:
    return out
  pad = ((0, 0), (0, width - k))
  return out._replace(accepted=jnp.pad(out.accepted, pad), min_pq=jnp.pad(out.min_pq, pad))


def _skipped_round(b: int, width: int, next_token: Array) -> KernelOutput:
  """A round where every live row proposed nothing: y ~ p_1, nothing tested."""
  zeros = jnp.zeros((b, width))
  return KernelOutput(num_accepted=jnp.zeros((b,), jnp.int32), next_token=next_token,
                      accepted=zeros.astype(bool), min_pq=zeros)


def pad_states(hidden: Array | None, positions: Array, width: int) -> tuple[Array, Array] | None:
  """The pass's states [B, k + 1, d] and positions padded to width + 1 (-1)."""
  if hidden is None:
    return None
  extra = width + 1 - positions.shape[1]
  return (jnp.pad(hidden, ((0, 0), (0, extra), (0, 0))),
          jnp.pad(positions, ((0, 0), (0, extra)), constant_values=-1))


class Proposal(NamedTuple):
  """A round's proposals: xs [B, W], q [B, W, V] (past a row's count arbitrary),
  proposed [B] int32 (the count), steps (draft steps run), draft_state."""

  xs: Array
  q: Array
  proposed: Array
  steps: Any
  draft_state: Any


class Verdict(NamedTuple):
  """A round's pass and verdict: out (``KernelOutput``, [B, W]), target_cache,
  target_states ((hidden, positions) or None), width (k scored, int or traced)."""

  out: KernelOutput
  target_cache: Any
  target_states: Optional[tuple[Array, Array]]
  width: Any
