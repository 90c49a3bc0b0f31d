"""Baseline ``temperature_sample`` against an uncached reference.

The reference calls the teacher-forced model on the growing prefix every step
(no cache). To compile it once, the prefix lives in a fixed [B, MAXLEN] buffer
whose tail is 0; the decoder is causal, so the logits at step t depend only on
buffer[:, :t+1]. All baseline calls share B, S and MAXLEN so that each
(sampling, eos_id) compiles once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.decoding import temperature_sample
from specdec_jax.sampling import SamplingConfig

B, S, MAXLEN = 4, 6, 10
GREEDY = SamplingConfig()
T1 = SamplingConfig(temperature=1.0)
TOP2 = SamplingConfig(temperature=1.0, topk=2)


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, inputs, dec_inputs):
  return model(params, inputs, dec_inputs)


def _inputs():
  return jnp.array([[5, 9, 17, 33, 2, 40], [7, 11, 3, 60, 0, 0],
                    [21, 22, 23, 0, 0, 0], [44, 8, 8, 8, 30, 12]], jnp.int32)


def _soft(params):
  """Undo conftest.sharpen (x8 on the output layer): flatter distributions, so
  temperature-1 sampling is really random. Same shapes: no recompilation."""
  params = jax.tree_util.tree_map(lambda x: x, params)
  params["decoder"]["logits_dense"]["kernel"] = params["decoder"]["logits_dense"]["kernel"] / 8
  return params


def _teacher_forced_logits(model, params, inputs, tokens):
  """Logits [B, MAXLEN, V] for predicting tokens[:, t] from start + tokens[:, :t]."""
  dec = jnp.concatenate([jnp.zeros((tokens.shape[0], 1), jnp.int32), tokens[:, :-1]], 1)
  return np.asarray(_forward(model, params, inputs, dec))


def _greedy_reference(model, params, inputs):
  """Uncached argmax loop, ignoring EOS: tokens [B, MAXLEN] and their logits."""
  dec = np.zeros((B, MAXLEN), np.int32)  # dec[:, 0] = start token 0
  toks = np.zeros((B, MAXLEN), np.int32)
  logits = np.zeros((B, MAXLEN, model.config.vocab_size), np.float32)
  for t in range(MAXLEN):
    lg = np.asarray(_forward(model, params, inputs, jnp.asarray(dec)))[:, t]
    logits[:, t] = lg
    toks[:, t] = lg.argmax(-1)
    if t + 1 < MAXLEN:
      dec[:, t + 1] = toks[:, t]
  return toks, logits


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _pick_eos(toks):
  """A token whose first occurrence differs across rows, with one row never
  emitting it (so that row is cut by max_decode_len)."""
  best = None
  for e in range(2, 64):
    hit = toks == e
    lengths = np.where(hit.any(1), hit.argmax(1) + 1, MAXLEN)
    n_distinct = len(set(lengths.tolist()))
    if n_distinct >= 2 and (~hit.any(1)).any():
      if best is None or n_distinct > best[1]:
        best = (e, n_distinct, lengths)
  return best


def test_greedy_matches_uncached_argmax_loop(tiny_target):
  model, params = tiny_target
  inputs = _inputs()
  ref, ref_logits = _greedy_reference(model, params, inputs)
  picked = _pick_eos(ref)
  assert picked is not None, f"no usable EOS in greedy paths {ref}"
  eos, _, ref_len = picked
  assert len(set(ref_len.tolist())) >= 2            # rows end at different steps
  assert (ref_len == MAXLEN).any() and (ref_len < MAXLEN).any()  # EOS and max-len cut
  ref_tokens = np.where(np.arange(MAXLEN)[None] < ref_len[:, None], ref, 0)

  out = temperature_sample(model, params, inputs, jax.random.PRNGKey(0),
                           max_decode_len=MAXLEN, sampling=GREEDY, eos_id=eos)
  np.testing.assert_array_equal(np.asarray(out.length), ref_len)
  np.testing.assert_array_equal(np.asarray(out.tokens), ref_tokens)
  # Rows that ended on EOS: EOS is the last kept token, zeros after.
  for b in range(B):
    if ref_len[b] < MAXLEN:
      assert int(out.tokens[b, ref_len[b] - 1]) == eos
      assert np.all(np.asarray(out.tokens[b, ref_len[b]:]) == 0)

  # log_prob = sum of log_softmax(logits)[token] over the kept tokens.
  lp = np.take_along_axis(_log_softmax(ref_logits), ref[..., None], -1)[..., 0]
  ref_lp = np.where(np.arange(MAXLEN)[None] < ref_len[:, None], lp, 0).sum(1)
  np.testing.assert_allclose(np.asarray(out.log_prob), ref_lp, rtol=1e-5, atol=1e-4)
  assert out.log_prob.dtype == jnp.float32


def test_sampling_reproducible_and_key_dependent(tiny_target):
  model, params = tiny_target
  params = _soft(params)
  inputs = _inputs()
  run = functools.partial(temperature_sample, model, params, inputs,
                          max_decode_len=MAXLEN, sampling=T1, eos_id=-1)
  a = run(jax.random.PRNGKey(1))
  a2 = run(jax.random.PRNGKey(1))
  b = run(jax.random.PRNGKey(2))
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(a2.tokens))
  np.testing.assert_array_equal(np.asarray(a.log_prob), np.asarray(a2.log_prob))
  np.testing.assert_array_equal(np.asarray(a.length), [MAXLEN] * B)  # eos -1: never stops
  n_diff = int(jnp.sum(a.tokens != b.tokens))
  assert n_diff >= 5, n_diff
  # log_prob along a sampled path (temperature 1: raw softmax == sampled dist).
  lg = _teacher_forced_logits(model, params, inputs, a.tokens)
  tok = np.asarray(a.tokens)
  ref_lp = np.take_along_axis(_log_softmax(lg), tok[..., None], -1)[..., 0].sum(1)
  np.testing.assert_allclose(np.asarray(a.log_prob), ref_lp, rtol=1e-5, atol=1e-4)


def test_topk_tokens_stay_in_top_k(tiny_target):
  model, params = tiny_target
  params = _soft(params)
  inputs = _inputs()
  second_best = 0
  total = 0
  for seed in range(8):  # 8 runs x 4 rows x 10 steps = 320 sampled tokens
    out = temperature_sample(model, params, inputs, jax.random.PRNGKey(100 + seed),
                             max_decode_len=MAXLEN, sampling=TOP2, eos_id=-1)
    tok = np.asarray(out.tokens)
    lg = _teacher_forced_logits(model, params, inputs, out.tokens)
    srt = -np.sort(-lg, -1)  # logits in decreasing order
    tok_logit = np.take_along_axis(lg, tok[..., None], -1)[..., 0]
    # In the top 2: at least the 2nd-largest logit (1e-5 slack: the cached
    # baseline and this teacher-forced pass differ by float rounding).
    assert np.all(tok_logit >= srt[..., 1] - 1e-5), (tok_logit, srt[..., :3])
    second_best += int(np.sum(tok_logit < srt[..., 0] - 1e-5))
    total += tok.size
    # log_prob is under the raw (unfiltered) softmax, per DecodeOutput's doc.
    ref_lp = np.take_along_axis(_log_softmax(lg), tok[..., None], -1)[..., 0].sum(1)
    np.testing.assert_allclose(np.asarray(out.log_prob), ref_lp, rtol=1e-5, atol=1e-4)
  # Both of the two allowed tokens actually get sampled (not argmax in disguise).
  assert 0.05 * total < second_best < 0.95 * total, (second_best, total)


def test_max_decode_len_validation(tiny_target):
  model, params = tiny_target
  with pytest.raises(ValueError, match="max_decode_len must be >= 1, got 0"):
    temperature_sample(model, params, _inputs(), jax.random.PRNGKey(0), max_decode_len=0)
