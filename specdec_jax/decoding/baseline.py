"""The baseline: T5X ``temperature_sample``, one target call per token."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.decoding.state import (Loop, finish, init_rows, pin_state, round_keys, running,
                                        cut, validate)
from specdec_jax.drafts.base import gather_positions
from specdec_jax.models.base import TargetModel, score
from specdec_jax.partitioning import Partitioner
from specdec_jax.sampling import SamplingConfig, sample, standardize

Array = jax.Array


class DecodeOutput(NamedTuple):
  tokens: Array    # [B, max_decode_len], 0 after EOS
  log_prob: Array  # [B] sum of log p(y_t) under the model's raw softmax
  length: Array    # [B] tokens generated (including EOS)


@struct.dataclass
class BaselineState:
  """The baseline's loop state (B rows, M = max_decode_len).

  seq:          [B, M + 1] int32, decoder inputs; seq[:, t + 1] = y_t.
  length:       [B] int32, tokens generated; the next input is seq[:, length].
  done:         [B] bool, the row emitted EOS or reached M.
  log_prob:     [B] float32, Σ log p(y_t) over the row's tokens (raw softmax).
  target_cache: the target's decode cache, M slots per row.
  key:          the PRNG key of the next step (unused at T = 0)."""

  seq: Array
  length: Array
  done: Array
  log_prob: Array
  target_cache: Any
  key: Array


@dataclasses.dataclass(frozen=True)
class BaselineLoop(Loop):
  """The baseline's static record: ``state.Loop``'s fields only."""


def _baseline_step(loop: BaselineLoop, params: Any, s: BaselineState) -> BaselineState:
  """One target call: y_{length} ~ p(· | seq[:, :length + 1]) for every live row."""
  key, k_step = round_keys(s.key, loop.sampling.greedy, 2)
  pos = s.length[:, None]                                              # --> [B, 1]
  logits, cache, _ = score(loop.target, params, gather_positions(s.seq, pos), pos, s.target_cache)
  logits = logits[:, 0]                                                # --> [B, V]
  token = sample(k_step, standardize(logits, loop.sampling), loop.sampling)
  live = ~s.done
  token_lp = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], -1)[:, 0]
  seq = jnp.where(live[:, None] & (jnp.arange(s.seq.shape[1])[None] == s.length[:, None] + 1),
                  token[:, None], s.seq)
  length, done, _ = cut(token[:, None], jnp.zeros_like(s.length), s.length, s.done,
                        loop.eos_id, loop.max_decode_len)
  return pin_state(BaselineState(seq, length, done, s.log_prob + jnp.where(live, token_lp, 0.0),
                                 cache, key), loop.partitioner)


BASELINE_STATIC = ("model", "max_decode_len", "sampling", "eos_id", "partitioner")


@functools.partial(jax.jit, static_argnames=BASELINE_STATIC)
def temperature_sample(model: TargetModel, params: Any, inputs: Array, key: Array, *,
                       max_decode_len: int, sampling: SamplingConfig = SamplingConfig(),
                       eos_id: int = 1, partitioner: Partitioner | None = None) -> DecodeOutput:
  """Plain autoregressive decoding (T5X ``temperature_sample``): inputs [B, S] ->
  ``DecodeOutput`` (tokens [B, max_decode_len], 0 after EOS; log_prob, length)."""
  validate(max_decode_len)
  b = inputs.shape[0]
  encoded = model.encode(params, inputs)
  state = pin_state(BaselineState(
      *init_rows(b, max_decode_len + 1, model.config.decoder_start_id),
      log_prob=jnp.zeros((b,), jnp.float32),
      target_cache=model.init_cache(params, encoded, inputs, max_decode_len), key=key), partitioner)
  loop = BaselineLoop(model, sampling, eos_id, max_decode_len, partitioner)
  state = jax.lax.while_loop(running, functools.partial(_baseline_step, loop, params), state)
  tokens, length = finish(state, max_decode_len)
  return DecodeOutput(tokens, state.log_prob, length)
