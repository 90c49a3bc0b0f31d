"""The block draft (``specdec_jax.drafts.t5_block``): one decoder call per
proposal, its cache after rejections, the training layout equal to the
decoding one, its file, and the registry. Exactness of the loops with it is in
the exactness matrix (tests/test_exactness*.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import distill, drafts
from specdec_jax.decoding import speculative_decode
from specdec_jax.drafts import t5_block
from specdec_jax.drafts.base import proposal_steps
from specdec_jax.models.t5 import T5Model, shift_right
from specdec_jax.sampling import SamplingConfig

from exactness_cases import INPUTS, KEY, MAX_LEN, pick_greedy_case


def random_block(model: T5Model, params, target=None, feature: bool = False, seed: int = 9):
  """A block draft with a random, clearly non-zero mask embedding (and, with
  ``feature``, a random feature bridge reading ``target``'s states)."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  d = model.config.d_model
  kw = {}
  if feature:
    tm, tp = target
    kw = dict(feature={"kernel": 0.5 * jax.random.normal(k1, (tm.config.d_model, d)),
                       "staleness": 0.5 * jax.random.normal(k2, (3, d))},
              target_model=tm, target_params=tp)
  return drafts.build("t5_block", model=model, params=params,
                      block={"mask_embedding": 0.5 * jax.random.normal(k3, (1, d))}, **kw)


def test_a_chain_round_is_one_draft_call(tiny_target, tiny_draft):
  model, params = tiny_target
  draft = random_block(*tiny_draft)
  assert proposal_steps(draft, 5) == 1
  assert proposal_steps(drafts.build("t5", model=tiny_draft[0], params=tiny_draft[1]), 5) == 5
  eos, _ = pick_greedy_case(model, params)
  out = speculative_decode(model, params, draft, INPUTS, KEY, gamma=5, max_decode_len=MAX_LEN,
                           eos_id=eos)
  np.testing.assert_array_equal(out.stats.draft_calls, out.stats.target_calls)


@pytest.mark.slow
@pytest.mark.parametrize("feature", [False, True], ids=["plain", "feature"])
def test_cache_after_rejections_equals_a_fresh_prefix(tiny_target, tiny_draft, feature):
  """After rounds that wrote mask keys and committed fewer tokens than they
  proposed (rejections), the next block's logits equal those of a fresh cache
  fed the whole committed prefix: the masks' keys were overwritten before any
  query read them."""
  dm, dp = tiny_draft
  draft = random_block(dm, dp, tiny_target, feature)
  gamma, cache_len = 4, 40
  seq = jnp.asarray(np.random.default_rng(0).integers(2, 64, (2, cache_len + 1)), jnp.int32)
  seq = seq.at[:, 0].set(0)
  d_target = tiny_target[0].config.d_model
  hidden = jax.random.normal(jax.random.PRNGKey(4), (2, cache_len, d_target))

  def commit(state, n):
    # The target's states of every position < n (the engine hands over a
    # round's positions; this gives the same committed states).
    if not feature:
      return draft.commit(state, seq, n)
    pos = jnp.broadcast_to(jnp.arange(cache_len, dtype=jnp.int32), (2, cache_len))
    return draft.commit_with_target(state, seq, n, hidden, jnp.where(pos < n[:, None], pos, -1))

  state = draft.init(INPUTS[:2], cache_len)
  n = jnp.array([0, 0], jnp.int32)
  # Rounds commit 1 (a rejection at x_1), 3, γ + 1 (all accepted), 2 tokens.
  for step in ([1, 3], [3, 1], [gamma + 1, 2], [2, gamma + 1]):
    logits, state = draft.block_logits(state, seq, n, gamma)
    n = n + jnp.asarray(step, jnp.int32)
    state = commit(state, n)
  logits, _ = draft.block_logits(state, seq, n, gamma)
  # Fresh: one call over the whole prefix 0..n then the masks.
  fresh = commit(draft.init(INPUTS[:2], cache_len), n)
  width = int(n.max()) + 1
  want, _ = draft.block_logits(fresh, seq, n, width + gamma - 1)
  want = jnp.stack([want[b, :gamma] for b in range(2)])
  # Different numbers of positions per call reduce in another order.
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=2e-4, atol=2e-4)
  # The masks matter: without their embedding the logits differ.
  plain = draft.replace(mask=jnp.zeros_like(draft.mask))
  other, _ = plain.block_logits(fresh, seq, n, gamma)
  assert np.abs(np.asarray(other) - np.asarray(logits))[:, 1:].max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("feature", [False, True], ids=["plain", "feature"])
def test_training_layout_is_the_decoding_layout(tiny_target, tiny_draft, feature):
  """``distill.block_forward`` (teacher forcing at a cut n) gives the block
  positions' logits the draft computes when decoding at committed length n."""
  tm, tp = tiny_target
  dm, dp = tiny_draft
  draft = random_block(dm, dp, tiny_target, feature)
  gamma, cache_len = 3, 24
  targets = jnp.asarray(np.random.default_rng(1).integers(2, 64, (2, 12)), jnp.int32)
  dec_in = shift_right(targets, 0)
  cuts = jnp.array([0, 6], jnp.int32)
  params = {"draft": dp, "block": {"mask_embedding": draft.mask}}
  hidden = None
  if feature:
    params["feature"] = draft.t5.feature
    _, hidden = tm(tp, INPUTS[:2], dec_in, return_hidden=True)
  logits, block = distill.block_forward(dm, tm, gamma)(params, tp, INPUTS[:2], dec_in, cuts,
                                                       hidden)
  for b in range(2):
    n = int(cuts[b])
    state = draft.init(INPUTS[b:b + 1], cache_len)
    if feature:
      pos = jnp.arange(dec_in.shape[1], dtype=jnp.int32)[None]
      state = draft.commit_with_target(state, None, jnp.array([n]), hidden[b:b + 1],
                                       jnp.where(pos < n, pos, -1))
    seq = jnp.pad(dec_in[b:b + 1], ((0, 0), (0, cache_len)))
    # Feed the whole prefix at once (the layout, not the cache, is under test).
    want, _ = draft.block_logits(state, seq, jnp.array([n]), n + gamma)
    got = logits[b][np.asarray(block[b])]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want[0, :gamma]), rtol=2e-4,
                               atol=2e-4)


def test_tokens_are_drawn_from_their_own_q(tiny_draft):
  """At T = 1 each x_i follows q_i: over many rows the empirical frequency of
  each position's tokens matches that position's q (identical rows)."""
  dm, dp = tiny_draft
  draft = random_block(dm, dp)
  rows, gamma = 4000, 3
  inputs = jnp.repeat(INPUTS[:1], rows, 0)
  seq = jnp.zeros((rows, 20), jnp.int32)
  state = draft.init(inputs, 16)
  tokens, q, _ = draft.propose(state, seq, jnp.zeros((rows,), jnp.int32), gamma,
                               SamplingConfig(1.0), jax.random.PRNGKey(3))
  q = np.asarray(q[0])
  for i in range(gamma):
    freq = np.bincount(np.asarray(tokens[:, i]), minlength=64) / rows
    assert np.abs(freq - q[i]).max() < 0.04, i
  # Positions are drawn with their own uniforms: not the same token everywhere.
  assert (np.asarray(tokens[:, 0]) != np.asarray(tokens[:, 1])).mean() > 0.3


def test_mask_file_round_trip_and_errors(tmp_path, tiny_draft):
  dm, dp = tiny_draft
  mask = {"mask_embedding": np.arange(32, dtype=np.float32)[None]}
  t5_block.save(str(tmp_path), mask)
  back = t5_block.load(str(tmp_path))
  np.testing.assert_array_equal(back["mask_embedding"], mask["mask_embedding"])
  with np.load(tmp_path / t5_block.FILENAME) as f:
    assert list(f.keys()) == [t5_block.MASK_NAME]
  assert t5_block.load(str(tmp_path / "nothing")) is None
  with pytest.raises(ValueError, match=r"needs \(1, 32\)"):
    t5_block.check({"mask_embedding": np.zeros((1, 16))}, dm, "ckpt")
  with pytest.raises(ValueError, match="block_draft.npz"):
    drafts.build("t5_block", model=dm, params=dp)
  with pytest.raises(ValueError, match="block_size"):
    distill.DistillConfig(block_size=1)


def test_the_demo_block_draft_is_shipped_with_its_mask():
  """checkpoints/demo/draft_tiny_block: a block draft (mask embedding of its
  width, both bridges) under 10 MB, and configs/demo_block.gin selects it."""
  import json
  import os
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  where = os.path.join(repo, "checkpoints/demo/draft_tiny_block")
  with open(os.path.join(where, "config.json")) as f:
    d_model = json.load(f)["d_model"]
  mask = t5_block.load(where)
  assert mask["mask_embedding"].shape == (1, d_model)
  assert np.abs(mask["mask_embedding"]).max() > 0     # trained, not the zero start
  assert os.path.isfile(os.path.join(where, "feature_bridge.npz"))
  size = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(where) for n in ns)
  assert size <= 10 * 2 ** 20, size
  with open(os.path.join(repo, "configs/demo_block.gin")) as f:
    gin = f.read()
  assert "draft_name = 't5_block'" in gin and "checkpoints/demo/draft_tiny_block" in gin


@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_output_layer_alone_equals_the_decoders_logits(version):
  """The block call sends only its γ block positions through the output
  layer (``T5Model.output_logits`` on the decoder's final states): the same
  logits as the decoder's own, for T5 1.0's tied embedding and 1.1's kernel."""
  from specdec_jax.models.t5 import T5Config
  cfg = T5Config(vocab_size=64, d_model=16, num_heads=2, head_dim=8, num_encoder_layers=1,
                 num_decoder_layers=1, d_ff=32, version=version)
  model = T5Model(cfg)
  params = model.init(jax.random.PRNGKey(3))
  inputs = jnp.array([[5, 6, 7, 1]], jnp.int32)
  dec_in = jnp.array([[0, 9, 10, 11, 12]], jnp.int32)
  logits, hidden = model(params, inputs, dec_in, return_hidden=True)
  np.testing.assert_allclose(np.asarray(model.output_logits(params, hidden[:, 2:])),
                             np.asarray(logits[:, 2:]), rtol=1e-5, atol=1e-5)
