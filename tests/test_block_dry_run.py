"""The dry run's cost model prices a block draft's proposal (``t5_block``) as
one call per round: the roofline compiles that call (a pass over its catch-up
and mask positions) beside the one-token draft step, and the round it prices
is that one call and the target's pass, for a chain and for a token tree.
No compile: the pieces' analyses are given."""

from __future__ import annotations

import types

import pytest

from specdec_jax.dryrun import chips, driver
from specdec_jax.dryrun.costs import PIECE_DEPTHS
from specdec_jax.models.t5 import T5Config
from specdec_jax.run import dry_run_programs
from specdec_jax.run.settings import Experiment

TARGET = T5Config(vocab_size=512, d_model=64, num_heads=2, head_dim=32, num_encoder_layers=1,
                  num_decoder_layers=4, d_ff=128)
DRAFT = TARGET.replace(num_decoder_layers=2)
CHIP = chips.CHIPS["v4"]
GAMMA = 5


def experiment(**kw) -> Experiment:
  return Experiment(target_checkpoint="not/read/target", draft_checkpoint="not/read/draft",
                    vocab_path="not/read/spm.model", source="not/read/test.tsv", task="wmt_ende",
                    draft_label="T5-small", batch_size=1, max_input_len=16, max_decode_len=8,
                    gamma=GAMMA, **kw)


def analysed(key: tuple) -> types.SimpleNamespace:
  """A compiled piece's analyses, memory-bound: a target pass 1 ms, a draft
  step 0.1 ms and a draft pass over k positions 0.1 + 0.01 (k − 1) ms."""
  role, _, k = key
  seconds = 1e-3 if role == "target" else 1e-4 * (1 + 0.1 * (k - 1))
  return types.SimpleNamespace(flops=0.0, bytes=seconds * CHIP.hbm_bandwidth, ops=0,
                               collectives=(), error=None)


def priced(exp: Experiment) -> tuple[list, dry_run_programs.RunDryRun]:
  ctx = driver.Context("v4:1x1", CHIP, (None,), exp, TARGET, DRAFT, None, None, [])
  keys = [s.key for s in dry_run_programs.piece_compiles(ctx)]
  result = dry_run_programs.RunnerPrograms(exp).finish(ctx, {k: analysed(k) for k in keys})
  return keys, result


def test_a_block_chain_round_is_one_call():
  keys, r = priced(experiment(draft_name="t5_block"))
  width = 2 * GAMMA  # γ + 1 catch-up and γ − 1 mask positions
  assert all(("draft", d, width) in keys and ("draft", d, 1) in keys for d in PIECE_DEPTHS)
  rc = r.round_cost()
  call = 1e-4 * (1 + 0.1 * (width - 1)) / 1e-3
  assert rc.draft_calls == 1 and rc.c == pytest.approx(call, rel=1e-9)
  assert rc.steps() == pytest.approx(call + r.roofline.v(GAMMA + 1), rel=1e-9)
  assert r.roofline.c() == pytest.approx(0.1, rel=1e-9)  # Definition 3.7's c: one step
  # The same experiment with the autoregressive draft: γ calls of one step.
  _, chain = priced(experiment(draft_name="t5"))
  assert chain.round_cost().draft_calls == GAMMA and chain.roofline.block is None
  assert r.predicted() > chain.predicted()
  text = "\n".join(dry_run_programs.roofline_lines(r))
  assert f"draft block call, k={width}" in text and f"one call over {width} positions" in text
  assert f"its block proposal one call of {call:.3f}" in dry_run_programs.summary_lines(r)[0]


def test_a_block_tree_round_is_one_call_of_its_depth():
  keys, r = priced(experiment(draft_name="t5_block", tree="full:2,1"))
  depth = r.exp.tree_shape.max_depth
  assert all(("draft", d, 2 * depth) in keys for d in PIECE_DEPTHS)
  rc = r.round_cost()
  assert rc.draft_calls == 1
  assert rc.c == pytest.approx(1e-4 * (1 + 0.1 * (2 * depth - 1)) / 1e-3, rel=1e-9)
  assert "1 draft call and one" in "\n".join(dry_run_programs.prediction_lines(r))
