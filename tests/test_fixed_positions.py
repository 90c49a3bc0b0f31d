"""``T5Config.fixed_positions``: every cached decode call scores R positions,
so a position's logits do not depend on how many positions the call scores.

* the one-token step and a k-position pass (``decode`` and ``decode(write=False)``,
  k = 2..R) give BIT-equal logits at every position, float32 and bfloat16,
  batch 1 and 3; without the setting they differ on this CPU (so the
  assertion can fail);
* T = 0 speculative decoding in bfloat16 on a random model with near-ties
  (no sharpened output layer) reproduces the baseline token for token, in a
  case where the loop without the setting does not (the adaptive loop's
  ``decode(write=False)`` there attends over two blocks, one softmax in another order).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.common import cast_params
from specdec_jax import drafts
from specdec_jax.decoding import AdaptiveConfig, speculative_decode, temperature_sample
from specdec_jax.models.t5 import T5Config, T5Model

R = 8            # fixed positions: γ + 1 for γ = 7
STARTS = (3, 6)  # where the passes start
STEPS = max(STARTS) + R  # one-token steps: every position a pass scores
CFG = T5Config(vocab_size=256, d_model=64, num_heads=4, head_dim=16, num_encoder_layers=1,
               num_decoder_layers=2, d_ff=128)


@functools.partial(jax.jit, static_argnums=0)
def _decode(model, params, tokens, positions, cache):
  return model.decode(params, tokens, positions, cache)


@functools.partial(jax.jit, static_argnums=0)
def _decode_rows(model, params, tokens, positions, cache):
  return model.decode(params, tokens, positions, cache, write=False)[0]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _empty_cache(model, params, inputs, cache_len):
  return model.init_cache(params, model.encode(params, inputs), inputs, cache_len)


@functools.lru_cache(maxsize=None)
def _params(dtype: str):
  return cast_params(T5Model(CFG).init(jax.random.PRNGKey(0)), dtype)


def _mismatches(dtype: str, batch: int, fixed: int, ks) -> list[tuple]:
  """(function, start, k) of every pass whose logits are not bit-equal to the
  one-token steps' at the same positions (same cache, same tokens)."""
  model = T5Model(CFG.replace(dtype=dtype, fixed_positions=fixed))
  params = _params(dtype)
  inputs = jax.random.randint(jax.random.PRNGKey(1), (batch, 7), 2, CFG.vocab_size)
  dec = jax.random.randint(jax.random.PRNGKey(2), (batch, STEPS), 2, CFG.vocab_size)
  cache = _empty_cache(model, params, inputs, 2 * STEPS)
  steps = []
  for t in range(STEPS):
    logits, cache = _decode(model, params, dec[:, t:t + 1], jnp.full((batch, 1), t, jnp.int32),
                            cache)
    steps.append(np.asarray(logits[:, 0]))
  steps = np.stack(steps, 1)
  bad = []
  for n in STARTS:
    for k in ks:
      pos = jnp.broadcast_to(n + jnp.arange(k, dtype=jnp.int32), (batch, k))
      for name, fn in (("decode", lambda *a: _decode(*a)[0]), ("decode_rows", _decode_rows)):
        logits = np.asarray(fn(model, params, dec[:, n:n + k], pos, cache))
        if not np.array_equal(logits, steps[:, n:n + k]):
          bad.append((name, n, k))
  return bad


def test_step_and_pass_are_bit_equal():
  assert _mismatches("bfloat16", 3, R, (2, R)) == []


@pytest.mark.slow
@pytest.mark.parametrize("dtype,batch", [("float32", 1), ("float32", 3), ("bfloat16", 1),
                                         ("bfloat16", 3)])
def test_step_and_pass_are_bit_equal_every_k(dtype, batch):
  assert _mismatches(dtype, batch, R, range(2, R + 1)) == []


@pytest.mark.slow
def test_without_the_setting_they_differ():
  """The property is not free: without fixed positions the k-position pass
  reduces in another order than the step (here at float32, every pass)."""
  bad = _mismatches("float32", 1, 0, (2, R))
  assert {b[0] for b in bad} == {"decode", "decode_rows"}, bad


def test_too_many_positions_is_refused():
  model = T5Model(CFG.replace(fixed_positions=2))
  params = _params("float32")
  inputs = jnp.full((1, 4), 5, jnp.int32)
  cache = _empty_cache(model, params, inputs, 8)
  with pytest.raises(ValueError, match="scores 3 positions but T5Config.fixed_positions is 2"):
    model.decode(params, jnp.ones((1, 3), jnp.int32), jnp.arange(3)[None], cache)


def test_fixed_positions_must_be_a_nonnegative_int():
  with pytest.raises(ValueError, match="fixed_positions must be an int >= 0"):
    CFG.replace(fixed_positions=-1)


# ----------------------------------------------- T = 0, bfloat16, near-ties

BF16 = CFG.replace(vocab_size=512, dtype="bfloat16")
MAX_LEN = 32


@pytest.fixture(scope="module")
def bf16_case():
  """A random bfloat16 target (weights and activations) whose logits have
  near-ties, a 1-layer random draft, 16 inputs; EOS never ends a row."""
  target = cast_params(T5Model(BF16).init(jax.random.PRNGKey(0)), "bfloat16")
  dm = T5Model(BF16.replace(num_decoder_layers=1))
  draft = drafts.build("t5", model=dm, params=cast_params(dm.init(jax.random.PRNGKey(5)),
                                                          "bfloat16"))
  inputs = jax.random.randint(jax.random.PRNGKey(1), (16, 10), 2, BF16.vocab_size)
  return target, draft, inputs


def _rows_differing(case, fixed: int, **loop) -> int:
  params, draft, inputs = case
  model = T5Model(BF16.replace(fixed_positions=fixed))
  key = jax.random.PRNGKey(0)
  base = temperature_sample(model, params, inputs, key, max_decode_len=MAX_LEN, eos_id=-1)
  out = speculative_decode(model, params, draft, inputs, key, max_decode_len=MAX_LEN, eos_id=-1,
                           **loop)
  assert np.asarray(out.stats.rejected).sum() > 0  # the draft is wrong often
  return int((np.asarray(out.tokens) != np.asarray(base.tokens)).any(1).sum())


ADAPTIVE = dict(gamma=R - 1, adaptive=AdaptiveConfig("schedule", initial_gamma=1))


@pytest.mark.slow
def test_bf16_adaptive_differs_without_the_setting(bf16_case):
  """The case has near-ties that the two reduction orders flip."""
  assert _rows_differing(bf16_case, 0, **ADAPTIVE) > 0


@pytest.mark.slow
@pytest.mark.parametrize("loop", [pytest.param(ADAPTIVE, id="adaptive-g7"),
                                  pytest.param(dict(gamma=R - 1), id="chain-g7")])
def test_bf16_identical_with_the_setting(bf16_case, loop):
  assert _rows_differing(bf16_case, R, **loop) == 0


# ----------------------------------------------------------------- the setting

def test_the_setting_reaches_the_target_only():
  from specdec_jax.run.settings import Experiment  # pylint: disable=g-import-not-at-top
  exp = Experiment(target_checkpoint="checkpoints/demo/target",
                   draft_checkpoint="checkpoints/demo/draft_small",
                   vocab_path="checkpoints/demo/spm.model", fixed_positions=8)
  assert exp.pair.load("target")[0].config.fixed_positions == 8
  assert exp.pair.load("draft")[0].config.fixed_positions == 0
  with pytest.raises(ValueError, match=r"^Experiment.fixed_positions must be an int >= 0"):
    dataclasses.replace(exp, fixed_positions=-1).pair.check_values()


# ------------------------------------------------------ command buffers

@pytest.mark.slow
def test_command_buffer_loops_decode_the_same(tiny_target, tiny_draft):
  """The loops compiled with command buffers (forced as for a GPU backend;
  the CPU compiler accepts and ignores the GPU options) are the same
  programs: same tokens. Off, or on another backend, the loop is itself."""
  from specdec_jax.run.programs import (  # pylint: disable=g-import-not-at-top
      command_buffer_options, with_command_buffers)
  model, params = tiny_target
  draft = drafts.build("t5", model=tiny_draft[0], params=tiny_draft[1])
  inputs = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 2, 64)
  key = jax.random.PRNGKey(0)
  assert with_command_buffers(speculative_decode, 0, "gpu") is speculative_decode
  assert with_command_buffers(speculative_decode, 2, "cpu") is speculative_decode
  graphed = with_command_buffers(speculative_decode, 2, "gpu")
  assert graphed is not speculative_decode
  kw = dict(gamma=3, max_decode_len=8, eos_id=-1)
  np.testing.assert_array_equal(graphed(model, params, draft, inputs, key, **kw).tokens,
                                speculative_decode(model, params, draft, inputs, key, **kw).tokens)
  assert command_buffer_options(2)["xla_gpu_graph_min_graph_size"] == 2
  with pytest.raises(ValueError, match="minimum graph size >= 1"):
    command_buffer_options(0)
  with pytest.raises(ValueError, match="takes one of the decoding loops"):
    with_command_buffers(len, 1, "gpu")


def test_command_buffers_setting_is_checked():
  from specdec_jax.run.settings import Experiment  # pylint: disable=g-import-not-at-top
  exp = Experiment(target_checkpoint="checkpoints/demo/target",
                   draft_checkpoint="checkpoints/demo/draft_small",
                   vocab_path="checkpoints/demo/spm.model", command_buffers=-1)
  with pytest.raises(ValueError, match=r"^Experiment.command_buffers must be an int >= 0"):
    exp.validate()


def test_fixed_positions_must_hold_a_round():
  from specdec_jax.run.settings import Experiment  # pylint: disable=g-import-not-at-top
  exp = Experiment(target_checkpoint="checkpoints/demo/target",
                   draft_checkpoint="checkpoints/demo/draft_small",
                   vocab_path="checkpoints/demo/spm.model", gamma=7, fixed_positions=7)
  with pytest.raises(ValueError, match=r"^Experiment.fixed_positions = 7 cannot hold γ \+ 1 = 8"):
    exp.validate()
  dataclasses.replace(exp, fixed_positions=8).validate()
  with pytest.raises(ValueError, match=r"cannot hold the tree's 11 nodes"):
    dataclasses.replace(exp, tree="full:2,2,1", fixed_positions=8).validate()
