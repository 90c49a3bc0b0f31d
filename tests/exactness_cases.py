"""What the exactness tests share: the greedy batch, the drafts built for them,
and the whole-sequence enumeration used at temperature > 0.

Temperature 0: a batch of 4 inputs on the tiny target (``conftest.TINY``),
decoded to at most ``MAX_LEN`` tokens with an EOS chosen so that rows stop at
different positions and one runs to the limit (``pick_greedy_case``).

Temperature > 0: a tiny model pair (vocab 8, 3 output tokens, EOS = 1). All
8^3 paths are enumerated to get the target's exact distribution over outputs
(tokens after EOS are 0); ``SEQ_N`` sequences drawn in one batch with a fixed
seed are compared with it by a chi-square test at ``SIGNIFICANCE`` (cells with
expected count < 5 pooled): a correct engine fails with probability 0.001 per
case over seeds, and the same test rejects an inexact engine (power).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import drafts
from specdec_jax.decoding import AdaptiveConfig, temperature_sample
from specdec_jax.drafts import shortlist as shortlist_lib
from specdec_jax.models.t5 import T5Config, T5Model, shift_right
from specdec_jax.sampling import SamplingConfig, standardize
from specdec_jax.tree import TreeShape
from stat_tests import pooled_chisquare_pvalue

# ------------------------------------------------------------------- T = 0

MAX_LEN = 20
INPUTS = jax.random.randint(jax.random.PRNGKey(1), (4, 12), 2, 64).astype(jnp.int32)
KEY = jax.random.PRNGKey(0)


def pick_greedy_case(model: T5Model, params: Any) -> tuple[int, Any]:
  """(eos, baseline): a token as EOS whose first occurrence differs across the
  rows of ``INPUTS``' greedy outputs, leaving at least one row running to
  ``MAX_LEN`` (so the length cut is tested too), and the baseline with it."""
  free = temperature_sample(model, params, INPUTS, KEY, max_decode_len=MAX_LEN, eos_id=-1)
  toks = np.asarray(free.tokens)
  best = None
  for tok in np.unique(toks):
    first = [int(np.argmax(r == tok)) if (r == tok).any() else MAX_LEN for r in toks]
    if len(set(first)) >= 3 and max(first) == MAX_LEN and min(first) >= 2:
      best = int(tok)
      break
  assert best is not None, toks
  base = temperature_sample(model, params, INPUTS, KEY, max_decode_len=MAX_LEN, eos_id=best)
  lengths = np.asarray(base.length)
  assert len(set(lengths.tolist())) >= 3 and lengths.max() == MAX_LEN
  return best, base


def alpha(stats: Any) -> float:
  """Mean over rows of accepted / evaluated drafts (paper §3.1)."""
  accepted, rejected = np.asarray(stats.accepted), np.asarray(stats.rejected)
  return float((accepted / np.maximum(accepted + rejected, 1)).mean())


# ------------------------------------------------------- cells and checks

@dataclasses.dataclass(frozen=True)
class Cell:
  """One loop run: ``draft`` names one of the test's draft builders; ``gamma``
  is γ (chain) or γ_max (adaptive); ``expect`` names the cell's extra checks
  (``check_adaptive``, ``check_tree``, and the test's own)."""
  loop: str                     # 'chain' | 'adaptive' | 'tree'
  draft: str
  gamma: int = 0
  adaptive: Optional[AdaptiveConfig] = None
  shape: Optional[TreeShape] = None
  setting: str = "greedy"       # a key of SETTINGS at T > 0
  expect: tuple[str, ...] = ()
  fixed: int = 0                # the target's T5Config.fixed_positions (0: off)
  fused: bool = False           # the target's T5Config.fused_projections


def check_chain(st: Any, base: Any, gamma: int, steps: Optional[int] = None) -> None:
  """Every target call commits >= 1 token and at most γ+1; γ draft steps a call
  (``steps`` for a draft that declares another count: a block draft's 1)."""
  length = np.asarray(base.length)
  assert np.all(st.target_calls >= np.ceil(length / (gamma + 1)))
  assert np.all(st.target_calls <= length)
  np.testing.assert_array_equal(st.draft_calls, (gamma if steps is None else steps)
                                * st.target_calls)
  np.testing.assert_array_equal(st.accepted_at.sum(1), st.accepted)


def check_adaptive(st: Any, cell: Cell) -> None:
  """γ histograms count every round; evaluated positions never exceed the
  proposals; plus the cell's ``expect``."""
  gamma_max, hist, calls = cell.gamma, st.gamma_hist, st.target_calls
  np.testing.assert_array_equal(hist.sum(1), calls)
  np.testing.assert_array_equal(st.accepted_at.sum(1), st.accepted)
  assert np.all(st.accepted + st.rejected <= hist @ np.arange(gamma_max + 1))
  if cell.adaptive.skip_below is None:
    assert np.all(hist[:, 0] == 0), hist  # a live row always proposes x_1
  used = np.flatnonzero(hist.sum(0))
  expect = set(cell.expect)
  if "alpha" in expect:  # acceptance is partial
    assert 0.2 < alpha(st) < 0.9, alpha(st)
  if "fixed_costs" in expect:  # threshold 0 never stops early: the fixed-γ loop's costs
    assert used.tolist() == [gamma_max]
    np.testing.assert_array_equal(st.draft_calls, gamma_max * calls)
    np.testing.assert_array_equal(st.target_positions, (gamma_max + 1) * calls)
  if "one_step" in expect:
    # Threshold 1 stops every row after x_1: one draft step a round and the
    # width-1 branch (2 target positions a call), though γ_max is larger.
    assert used.tolist() == [1]
    np.testing.assert_array_equal(st.draft_calls, calls)
    np.testing.assert_array_equal(st.target_positions, 2 * calls)
    np.testing.assert_array_equal(hist[:, 1], calls)
  if "varies" in expect:  # the threshold really varies γ, and stops early
    assert len(used) >= 3, hist
    assert np.all(st.draft_calls < gamma_max * calls)
  if "varies_in_total" in expect:
    # Steps are the batch's (the longest row's), so compare totals.
    assert st.draft_calls.sum() < gamma_max * calls.sum(), st.draft_calls
    assert (hist.sum(0)[1:] > 0).sum() >= 3, hist
  if "schedule_from_1" in expect:
    # From 1 the schedule grows by 2 (odd γ only): an even γ proves a -1 step.
    assert hist[:, 1].min() >= 1 and hist[:, 3].sum() > 0 and hist[:, 2::2].sum() > 0, hist
  if "skips" in expect:  # some rounds proposed nothing: each a plain target step
    assert hist[:, 0].sum() > calls.sum() // 20, hist
  if "skips_some" in expect:  # plain target steps where the context has no match
    assert hist[:, 0].sum() > 0 and hist[:, 1:].sum() > 0, hist


def check_tree(st: Any, out: Any, cell: Cell) -> None:
  """Every round has a depth, every accepted token a sibling rank, and every
  call commits at most one token beyond the accepted; plus the cell's
  ``expect``."""
  assert int(st.depth_hist.sum()) == int(st.target_calls.sum())
  assert int(st.accepted.sum()) == int(st.rank_hist.sum())
  assert int((np.asarray(out.length) - st.accepted).sum()) <= int(st.target_calls.sum())
  # The test means something only if paths went deep and, for drafts with
  # alternatives, through runner-up siblings (a chain-only draft's one-hot q
  # at T = 0 has none, so its tree is its chain).
  if "deep" in cell.expect:
    assert int(st.depth_hist[:, 2:].sum()) > 0, st.depth_hist
  if "siblings" in cell.expect:
    assert int(st.rank_hist[:, 1:].sum()) > 0, st.rank_hist
  if "no_siblings" in cell.expect:
    assert int(st.rank_hist[:, 1:].sum()) == 0, st.rank_hist


# ------------------------------------------------------------------ drafts

def noisy(params: Any, scale: float, seed: int = 3) -> Any:
  """Gaussian noise of ``scale`` times each weight's std on every weight."""
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree_util.tree_unflatten(
      tree, [x + scale * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def noisy_output_layer(params: Any, scale: float, seed: int) -> Any:
  """Noise on the output layer only: the argmax often agrees with the
  original's and its runner-up sometimes wins."""
  out = jax.tree_util.tree_map(lambda x: x, params)
  k = out["decoder"]["logits_dense"]["kernel"]
  out["decoder"]["logits_dense"]["kernel"] = k + scale * jnp.std(k) * jax.random.normal(
      jax.random.PRNGKey(seed), k.shape)
  return out


def bridged(draft_model: T5Model, draft_params: Any, target_model: T5Model, target_params: Any,
            seed: int = 0, scale: float = 0.5) -> Any:
  """A T5 draft whose encoder also reads the target's (``specdec_jax.drafts.bridge``),
  with a random, clearly non-zero bridge kernel."""
  shape = (target_model.config.d_model, draft_model.config.d_model)
  kernel = scale * jax.random.normal(jax.random.PRNGKey(seed), shape)
  return drafts.build("t5", model=draft_model, params=draft_params, bridge=kernel,
                      target_model=target_model, target_params=target_params)


def featured(draft_model: T5Model, draft_params: Any, target_model: T5Model,
             target_params: Any, seed: int = 0, scale: float = 0.5, staleness: int = 3,
             name: str = "t5") -> Any:
  """A T5 draft (``name`` 't5' or 'lookup_t5') whose decoder also reads the
  target's decoder states (``specdec_jax.drafts.feature_bridge``), with random,
  clearly non-zero weights and a staleness table of ``staleness`` rows."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  d_p, d_q = target_model.config.d_model, draft_model.config.d_model
  feature = {"kernel": scale * jax.random.normal(k1, (d_p, d_q)),
             "staleness": scale * jax.random.normal(k2, (staleness, d_q))}
  return drafts.build(name, model=draft_model, params=draft_params, feature=feature,
                      target_model=target_model, target_params=target_params, max_ngram=2)


def block(draft_model: T5Model, draft_params: Any, target: Optional[tuple] = None,
          seed: int = 9, scale: float = 0.5, staleness: int = 3) -> Any:
  """A block draft (``specdec_jax.drafts.t5_block``) with a random, clearly
  non-zero mask embedding; with ``target`` (model, params) its decoder also
  reads the target's states through a random feature bridge of ``staleness``
  rows."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  d = draft_model.config.d_model
  kw: dict = {}
  if target is not None:
    tm, tp = target
    kw = dict(feature={"kernel": scale * jax.random.normal(k1, (tm.config.d_model, d)),
                       "staleness": scale * jax.random.normal(k2, (staleness, d))},
              target_model=tm, target_params=tp)
  return drafts.build("t5_block", model=draft_model, params=draft_params,
                      block={"mask_embedding": scale * jax.random.normal(k3, (1, d))}, **kw)


def trained_block(target: tuple, small: tuple, steps: int = 80, gamma: int = 4) -> Any:
  """A block draft trained briefly by distillation's block objective
  (``distill.block_loss``, Adam) on the target's greedy outputs for
  ``INPUTS`` and four other inputs: its mask positions are right often
  enough to be accepted, and wrong often enough to be rejected, so the
  identity tests exercise every position of the block."""
  import optax
  from specdec_jax import distill
  from specdec_jax.drafts import t5_block
  tm, tp = target
  dm, dp = small
  inputs = jnp.concatenate([INPUTS, jax.random.randint(jax.random.PRNGKey(2), (4, 12), 2, 64)])
  outs = temperature_sample(tm, tp, inputs, KEY, max_decode_len=MAX_LEN, eos_id=-1).tokens
  loss_fn = distill.block_loss(dm, tm, distill.DistillConfig("fkl", block_size=gamma))
  params = {"draft": dp, "block": t5_block.zeros(dm)}
  opt = optax.adam(5e-3)

  def step(carry, key):
    params, state = carry
    grads = jax.grad(lambda p: loss_fn(p, {"inputs": inputs, "targets": outs,
                                           "step_key": key}, tp)[0])(params)
    updates, state = opt.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), None

  (params, _), _ = jax.jit(lambda p, keys: jax.lax.scan(step, (p, opt.init(p)), keys))(
      params, jax.random.split(jax.random.PRNGKey(0), steps))
  return drafts.build("t5_block", model=dm, params=params["draft"], block=params["block"])


def shortlisted(model: T5Model, params: Any, ids: np.ndarray, with_inputs: bool = True) -> Any:
  """A T5 draft whose q lives on the token ids ``ids`` (plus, with
  ``with_inputs``, each input's own tokens): ``specdec_jax.drafts.shortlist``."""
  return drafts.T5Draft(params=params, model=model,
                        shortlist=shortlist_lib.Shortlist.for_draft(model, params, ids,
                                                                    with_inputs))


def quantized(params: Any, mode: str) -> Any:
  """The T5 draft's params with weight-only ``mode`` kernels ('int8' / 'int4',
  ``specdec_jax.quantization``), as ``Experiment.draft_quantization`` loads them;
  skips without the qwix library (the 'quant' extra)."""
  pytest.importorskip("qwix", reason="the 'quant' extra (qwix) is not installed")
  from specdec_jax import quantization
  return quantization.quantize_params(params, mode)


def lookup_t5(t5: Any) -> Any:
  """Prompt lookup with ``t5`` after the copied run; min_ngram 1, so it copies
  wherever any token repeats and rounds mix copied and T5 positions."""
  return drafts.LookupT5Draft(t5=t5, max_ngram=2, min_ngram=1)


# ------------------------------------------------------------------- T > 0

SEQ_V, SEQ_LEN, SEQ_N, SEQ_EOS = 8, 3, 20_000, 1
SEQ_CFG = T5Config(vocab_size=SEQ_V, d_model=16, num_heads=2, head_dim=8, num_encoder_layers=1,
                   num_decoder_layers=1, d_ff=16)
SEQ_INPUT = jnp.array([[3, 5, 2, 7, 4]], jnp.int32)
SEQ_KEY = jax.random.PRNGKey(5)
SIGNIFICANCE = 1e-3

SETTINGS = {
    "temp1": SamplingConfig(temperature=1.0),
    "temp0.7_topk3": SamplingConfig(temperature=0.7, topk=3),
    "temp1_topp0.8": SamplingConfig(temperature=1.0, topp=0.8),
}


def seq_models() -> tuple[T5Model, Any, Any]:
  """(model, target params, draft params) of the vocab-8 pair; the target's
  logits spread a little so that its distributions are not near-uniform."""
  model = T5Model(SEQ_CFG)
  target = model.init(jax.random.PRNGKey(11))
  draft = model.init(jax.random.PRNGKey(12))
  target["decoder"]["logits_dense"]["kernel"] = target["decoder"]["logits_dense"]["kernel"] * 3
  return model, target, draft


def exact_sequence_distribution(model: T5Model, params: Any,
                                sampling: SamplingConfig) -> dict[tuple, float]:
  """{output tuple: probability} under the target alone (EOS-terminated)."""
  paths = np.array(list(itertools.product(range(SEQ_V), repeat=SEQ_LEN)), np.int32)
  logits = model(params, jnp.repeat(SEQ_INPUT, len(paths), 0), shift_right(jnp.asarray(paths)))
  probs = np.asarray(standardize(logits, sampling), np.float64)
  dist: dict[tuple, float] = {}
  for path, pr in zip(paths, probs):
    total, out = 1.0, []
    for t, tok in enumerate(path):
      total *= pr[t, tok]
      out.append(int(tok))
      if tok == SEQ_EOS:
        break
    if len(out) < len(path) and any(path[len(out):]):
      continue  # count each EOS-terminated output once (the all-zero tail)
    key = tuple(out + [0] * (SEQ_LEN - len(out)))
    dist[key] = dist.get(key, 0.0) + total
  return dist


def sequence_pvalue(samples: np.ndarray, dist: dict) -> float:
  """Chi-square p-value of sampled output sequences [N, SEQ_LEN] against
  ``dist``; an output the target cannot produce fails outright."""
  keys = list(dist)
  index = {k: i for i, k in enumerate(keys)}
  counts = np.zeros(len(keys))
  for row in map(tuple, np.asarray(samples).tolist()):
    assert row in index, f"impossible output {row}"
    counts[index[row]] += 1
  return pooled_chisquare_pvalue(counts, np.array([dist[k] for k in keys]))


def seq_inputs() -> jnp.ndarray:
  """``SEQ_N`` copies of ``SEQ_INPUT``: one batch, one draw per row."""
  return jnp.repeat(SEQ_INPUT, SEQ_N, 0)
