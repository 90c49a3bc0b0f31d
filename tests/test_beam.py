"""Beam search equals T5X's ``decoding.beam_search``; speculative beam search
(paper Appendix A.4) equals beam search.

The reference below is written from T5X's beam search as documented and
coded there, independently of ``specdec_jax.beam``: one example at a time, in
numpy, the model's teacher-forced logits over the whole decoder input each
step (no cache), T5X's rules spelled out step by step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import beam
from specdec_jax.models.t5 import T5Config, T5Model

NEG_INF = np.float32(-1.0e7)
EOS = 1
M = 10  # max_decode_len

CONFIGS = {
    "1.1": T5Config(vocab_size=64, d_model=32, num_heads=4, head_dim=8, num_encoder_layers=2,
                    num_decoder_layers=2, d_ff=48, version="1.1"),
    "1.0": T5Config(vocab_size=64, d_model=32, num_heads=4, head_dim=8, num_encoder_layers=2,
                    num_decoder_layers=2, d_ff=48, version="1.0"),
}
INPUTS = np.array([[5, 9, 12, 7, 1, 0], [33, 4, 4, 20, 61, 1], [8, 1, 0, 0, 0, 0],
                   [40, 41, 42, 43, 44, 1]], np.int32)


def _models(version: str):
  """A tiny target and a one-layer draft of one version, their output layer
  scaled so that beams separate clearly and EOS comes up within M steps."""
  out = []
  for layers, seed in ((2, 0), (1, 7)):
    config = CONFIGS[version].replace(num_encoder_layers=layers, num_decoder_layers=layers)
    model = T5Model(config)
    params = jax.tree.map(lambda x: x, model.init(jax.random.PRNGKey(seed)))
    if version == "1.1":
      kernel = params["decoder"]["logits_dense"]["kernel"] * 6.0
      params["decoder"]["logits_dense"]["kernel"] = kernel.at[:, EOS].multiply(3.0)
    else:
      embedding = params["token_embedder"]["embedding"] * 3.0
      params["token_embedder"]["embedding"] = embedding.at[EOS].multiply(-5.0)
    out.append((model, params))
  return out


@pytest.fixture(scope="module", params=["1.1", "1.0"])
def pair(request):
  return _models(request.param)


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)


def _penalty(alpha: float, length: int) -> np.float32:
  return np.float32(((5.0 + length) / 6.0) ** alpha)


def _best(values: np.ndarray, k: int) -> np.ndarray:
  """Indices of the k largest values, larger first, ties to the lower index
  (lax.top_k's order)."""
  return np.argsort(-values, kind="stable")[:k]


def reference_beam_search(logits_at, w: int, alpha: float):
  """T5X's beam search for one example. logits_at(decoder_inputs [w, t]) ->
  logits [w, V] after the last input. -> (sequences [w, M], scores [w]),
  ascending by score."""
  live_seqs = np.zeros((w, M), np.int32)
  live_lp = np.array([0.0] + [NEG_INF] * (w - 1), np.float32)
  fin_seqs = np.zeros((w, M), np.int32)
  fin_scores = np.full(w, NEG_INF, np.float32)
  fin_flags = np.zeros(w, bool)
  cur = 0
  while True:
    # T5X's loop condition.
    if cur >= M:
      break
    min_penalty = _penalty(alpha, M + 1)
    best_live = live_lp[-1] / min_penalty
    worst_fin = np.where(fin_flags, fin_scores.min(), NEG_INF)
    if np.all(worst_fin > best_live) or (cur > 0 and best_live < NEG_INF / min_penalty):
      break
    dec = np.concatenate([np.zeros((w, 1), np.int32), live_seqs[:, :cur]], axis=1)
    log_p = _log_softmax(logits_at(dec))                                # [w, V]
    v = log_p.shape[1]
    cand = (log_p + live_lp[:, None]).reshape(-1)
    top = _best(cand, 2 * w)
    top_lp, top_tok, top_par = cand[top], top % v, top // v
    top_seqs = live_seqs[top_par].copy()
    top_seqs[:, cur] = top_tok
    ended = top_tok == EOS
    # Live: best w of the 2w after pushing ended ones down by NEG_INF; ascending.
    masked = (top_lp + np.where(ended, NEG_INF, np.float32(0))).astype(np.float32)
    keep = _best(masked, w)[::-1]
    live_seqs, live_lp = top_seqs[keep], masked[keep]
    # Finished: the ended ones scored by the brevity penalty, merged; ascending.
    scores = (top_lp / _penalty(alpha, cur + 1)).astype(np.float32)
    scores = scores + np.where(ended, np.float32(0), NEG_INF)
    all_seqs = np.concatenate([fin_seqs, top_seqs])
    all_scores = np.concatenate([fin_scores, scores]).astype(np.float32)
    all_flags = np.concatenate([fin_flags, ended])
    best = _best(all_scores, w)[::-1]
    fin_seqs, fin_scores, fin_flags = all_seqs[best], all_scores[best], all_flags[best]
    cur += 1
  if fin_flags.any():
    return fin_seqs, fin_scores, cur
  return live_seqs, live_lp, cur


def _reference(model: T5Model, params, w: int, alpha: float):
  full = jax.jit(lambda x, d: model(params, x, d))
  out = []
  for x in INPUTS:
    def logits_at(dec, x=x):
      # Padded to one width (one compilation): the decoder is causal, so the
      # logits after the last input do not see the padding.
      padded = np.pad(dec, ((0, 0), (0, M + 1 - dec.shape[1])))
      logits = full(jnp.asarray(np.repeat(x[None], dec.shape[0], 0)), jnp.asarray(padded))
      return np.asarray(logits[:, dec.shape[1] - 1])
    out.append(reference_beam_search(logits_at, w, alpha))
  return out


@pytest.mark.parametrize("w,alpha", [(2, 0.6), (4, 0.6), (2, 0.0), (4, 0.0)])
def test_beam_search_equals_t5x(pair, w, alpha):
  """All beams (tokens, order) and scores of T5X's beam search, T5 1.0 and 1.1,
  w 2 and 4, alpha 0.6 and 0; the examples include early stops and rows whose
  finished beams fill every slot."""
  (model, params), _ = pair
  got = beam.beam_search(model, params, jnp.asarray(INPUTS), beam_size=w, alpha=alpha,
                         max_decode_len=M, eos_id=EOS)
  ref = _reference(model, params, w, alpha)
  for i, (seqs, scores, steps) in enumerate(ref):
    np.testing.assert_array_equal(np.asarray(got.sequences[i]), seqs, err_msg=f"example {i}")
    np.testing.assert_allclose(np.asarray(got.scores[i]), scores, rtol=1e-5, atol=1e-5,
                               err_msg=f"example {i}")
    assert int(got.steps[i]) == steps
  # Not vacuous: some beams ended in EOS, and some row stopped before M.
  assert any(np.any(seqs == EOS) for seqs, _, _ in ref)
  assert min(steps for _, _, steps in ref) < M


@pytest.mark.parametrize("w,u,gamma,alpha", [
    (2, 3, 1, 0.0),
    pytest.param(4, 6, 3, 0.6, marks=pytest.mark.slow),
    pytest.param(2, 2, 3, 0.6, marks=pytest.mark.slow),
    pytest.param(4, 4, 2, 0.0, marks=pytest.mark.slow)])
def test_speculative_beam_search_equals_beam_search(pair, w, u, gamma, alpha):
  """Speculative beam search (Appendix A.4) returns beam search's beams and
  scores, with fewer target calls than beam steps."""
  (target, t_params), (draft, d_params) = pair
  inputs = jnp.asarray(INPUTS)
  want = beam.beam_search(target, t_params, inputs, beam_size=w, alpha=alpha,
                          max_decode_len=M, eos_id=EOS)
  got, stats = beam.speculative_beam_search(target, t_params, draft, d_params, inputs,
                                            beam_size=w, draft_beam_size=u, gamma=gamma,
                                            alpha=alpha, max_decode_len=M, eos_id=EOS)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  np.testing.assert_allclose(np.asarray(got.scores), np.asarray(want.scores), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_array_equal(np.asarray(got.steps), np.asarray(want.steps))
  np.testing.assert_array_equal(np.asarray(stats.steps), np.asarray(want.steps))
  hist = np.asarray(stats.steps_per_round)
  np.testing.assert_array_equal(hist.sum(1), np.asarray(stats.rounds))
  np.testing.assert_array_equal((hist * np.arange(gamma + 2)).sum(1), np.asarray(stats.steps))
  assert np.all(np.asarray(stats.draft_calls) == gamma * np.asarray(stats.rounds))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["t5", "lookup"])
def test_chain_drafts_equal_beam_search(kind):
  """A draft that cannot run beam search proposes each live beam's greedy
  chain: beam search's beams and scores all the same. The target as a T5
  draft (its cache rows follow their beams) covers some rounds' steps, so
  several steps are taken from one pass; prompt lookup has no state."""
  from specdec_jax.drafts import PromptLookupDraft, T5Draft  # pylint: disable=g-import-not-at-top
  (target, t_params), _ = _models("1.1")
  draft = (T5Draft(params=t_params, model=target) if kind == "t5"
           else PromptLookupDraft(vocab_size=target.config.vocab_size))
  inputs, w, gamma = jnp.asarray(INPUTS), 2, 2
  want = beam.beam_search(target, t_params, inputs, beam_size=w, alpha=0.6, max_decode_len=M,
                          eos_id=EOS)
  got, stats = beam.speculative_beam_search(target, t_params, draft, None, inputs, beam_size=w,
                                            gamma=gamma, alpha=0.6, max_decode_len=M, eos_id=EOS)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  np.testing.assert_allclose(np.asarray(got.scores), np.asarray(want.scores), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_array_equal(np.asarray(stats.steps), np.asarray(want.steps))
  hist = np.asarray(stats.steps_per_round)
  np.testing.assert_array_equal((hist * np.arange(gamma + 2)).sum(1), np.asarray(stats.steps))
  if kind == "t5":
    assert hist[:, 2:].sum() > 0 and np.all(np.asarray(stats.rounds) <= np.asarray(want.steps))
    assert np.any(np.asarray(stats.rounds) < np.asarray(want.steps))


@pytest.mark.slow
def test_self_draft_accepts_every_step(pair):
  """The target as its own draft at u = w: its beams are the target's, so every
  round takes γ + 1 steps (but the last, cut by the stop)."""
  (target, t_params), _ = pair
  gamma = 3
  got, stats = beam.speculative_beam_search(target, t_params, target, t_params,
                                            jnp.asarray(INPUTS), beam_size=2, draft_beam_size=2,
                                            gamma=gamma, alpha=0.6, max_decode_len=M, eos_id=EOS)
  steps, rounds = np.asarray(stats.steps), np.asarray(stats.rounds)
  np.testing.assert_array_equal(rounds, -(-steps // (gamma + 1)))


def test_bad_settings_are_refused(pair):
  (target, t_params), (draft, d_params) = pair
  x = jnp.asarray(INPUTS)
  with pytest.raises(ValueError, match="u must be >= the beam width"):
    beam.speculative_beam_search(target, t_params, draft, d_params, x, beam_size=4,
                                 draft_beam_size=2, gamma=2, max_decode_len=M)
  with pytest.raises(ValueError, match="alpha"):
    beam.beam_search(target, t_params, x, beam_size=2, alpha=-1.0, max_decode_len=M)
  from specdec_jax.drafts import T5Draft  # pylint: disable=g-import-not-at-top
  featured = T5Draft(params=d_params, model=draft, feature={"kernel": jnp.zeros((32, 32))})
  with pytest.raises(ValueError, match="reads the target's decoder states"):
    beam.speculative_beam_search(target, t_params, featured, None, x, beam_size=2, gamma=2,
                                 max_decode_len=M)


# ------------------------------------------------------------------- the runner


def _beam_experiment(**kw):
  from specdec_jax.run.settings import Experiment  # pylint: disable=g-import-not-at-top
  fields = dict(target_checkpoint="checkpoints/demo/target",
                draft_checkpoint="checkpoints/demo/draft_tiny",
                vocab_path="checkpoints/demo/spm.model", decode_method="beam", gamma=2)
  return Experiment(**{**fields, **kw})


def test_beam_settings_are_checked():
  _beam_experiment().validate()
  # Drafts that cannot run beam search propose greedy chains.
  _beam_experiment(draft_name="prompt_lookup", draft_checkpoint="").validate()
  _beam_experiment(draft_shortlist="checkpoints/demo/draft_shortlist.json").validate()
  assert _beam_experiment().draft_beam_width == 4
  assert _beam_experiment(draft_beam_size=8).draft_beam_width == 8
  for kw, message in [
      (dict(decode_method="greedy"), r"^Experiment.decode_method must be 'sample' or 'beam'"),
      (dict(beam_size=0), r"^Experiment.beam_size must be >= 1"),
      (dict(draft_beam_size=2), r"^Experiment.draft_beam_size \(2\) must be >= "),
      (dict(beam_alpha=-0.5), r"^Experiment.beam_alpha must be >= 0"),
      (dict(tree="full:2,1"), r"cannot run with Experiment.tree="),
]:
    with pytest.raises(ValueError, match=message):
      _beam_experiment(**kw).validate()


@pytest.mark.slow
def test_runner_beam_mode(tmp_path):
  """configs/demo_beam.gin through the runner on 2 examples: summary.json's
  counts are the lines' and every beam matched."""
  import json  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  work = tmp_path / "run"
  subprocess.run([sys.executable, "-m", "specdec_jax.run", "--config=configs/demo_beam.gin",
                  "--gin_bindings=Experiment.num_examples = 2",
                  "--gin_bindings=Experiment.num_warmup = 1",
                  "--gin_bindings=Experiment.max_decode_len = 24",
                  "--gin_bindings=Experiment.draft_beam_size = 8",
                  "--gin_bindings=Experiment.gamma = 2", f"--workdir={work}"],
                 check=True, capture_output=True, text=True)
  s = json.loads((work / "summary.json").read_text())
  lines = [json.loads(l) for l in (work / "examples.jsonl").read_text().splitlines()]
  assert s["mode"] == "beam" and s["examples"] == len(lines) == 2
  assert s["matches_baseline"] == 2
  assert s["beam_steps"] == sum(l["steps"] for l in lines)
  assert s["target_calls"] == sum(l["target_calls"] for l in lines) < s["beam_steps"]
  assert s["target_calls_per_step"] == pytest.approx(s["target_calls"] / s["beam_steps"])
