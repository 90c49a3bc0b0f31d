"""The γ sweep behind scripts/bench_speculative.py: rows, exactness column,
and the decomposition of measured / EXP(with v) into its two factors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specdec_jax import drafts
from specdec_jax.sampling import SamplingConfig
from lab.sweep import gamma_sweep, markdown_table


def test_sweep_rows_and_the_factors_of_measured_over_predicted(tiny_target, tiny_draft):
  model, params = tiny_target
  dm, dp = tiny_draft
  draft = drafts.T5Draft(params=dp, model=dm)
  inputs = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (3, 10), 2, 64), np.int32)
  rows = gamma_sweep(model, params, draft, inputs, [2], SamplingConfig(), max_decode_len=12)
  (r,) = rows
  assert r["gamma"] == 2 and r["examples"] == 2
  assert r["mismatches"] == 0                       # T=0: token for token
  assert 0 <= r["alpha"] <= 1 and 1 <= r["tokens_per_target_call"] <= 3
  # measured / EXP(v) is exactly the product of the two factors.
  product = r["tokens_factor"] * r["round_factor"]
  assert product == pytest.approx(r["speedup"] / r["expected_v"], rel=1e-9)
  # The in-context prediction is EXP(with v) with γc + v scaled by the interplay.
  assert r["interplay"] > 0
  assert r["expected_ctx"] == pytest.approx(r["expected_v"] / r["interplay"], rel=1e-9)
  table = markdown_table(rows)
  assert "× (γc+v) ÷ round in baseline tokens" in table and table.count("\n") == 2
  assert "| EXP (in context) |" in table and "measured / EXP(in context)" in table


def _bench_speculative():
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_speculative.py"
  spec = importlib.util.spec_from_file_location("bench_speculative", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_adaptive_settings_are_the_dataclass_fields_as_flags():
  """bench_speculative's adaptive settings: AdaptiveConfig's fields as
  --adaptive_<field> flags, one value per setting or one for all; labels
  name each; a fixed γ is a number or 'auto', nothing else."""
  from lab.sweep import adaptive_label, parse_gamma, parse_widths
  from specdec_jax.decoding import AdaptiveConfig
  mod = _bench_speculative()
  from lab.sweep import adaptive_settings
  settings = lambda *argv: adaptive_settings(mod.parser().parse_args(argv))
  assert settings() == []
  thr, cum = settings("--adaptive_rule=threshold,cumulative", "--adaptive_threshold=0.4,0.3",
                      "--adaptive_skip_below=0.3,none", "--gamma_max=7")
  assert (thr.rule, thr.threshold, thr.skip_below, thr.widths) == (
      "threshold", 0.4, 0.3, tuple(range(1, 8)))   # --adaptive_widths: all by default
  assert (cum.rule, cum.threshold, cum.skip_below) == ("cumulative", 0.3, None)
  assert adaptive_label(thr, 7) == "≤7 thr 0.4 skip 0.3"
  assert adaptive_label(cum, 7) == "≤7 cum 0.3"
  (drawn,) = settings("--adaptive_rule=cumulative", "--adaptive_threshold=0.25",
                      "--adaptive_confidence=drawn", "--adaptive_widths=default")
  assert adaptive_label(drawn, 8) == "≤8 cum 0.25 drawn" and drawn.widths == ()
  assert drawn.verify_widths(7) == (1, 2, 4, 7)
  (sched,) = settings("--adaptive_rule=schedule", "--adaptive_initial_gamma=2")
  assert adaptive_label(sched, 8) == "≤8 sched from 2"
  # --adaptive: six settings spelled with the same flags.
  assert len(settings("--adaptive")) == 6
  assert parse_widths("all", 4) == (1, 2, 3, 4) and parse_widths("1,3", 4) == (1, 3)
  assert parse_gamma("3") == ("3", 3) and parse_gamma("auto") == ("auto", 0)
  with pytest.raises(ValueError, match="'top', 'drawn'"):
    settings("--adaptive_rule=cumulative", "--adaptive_threshold=0.2",
             "--adaptive_confidence=drwan")
  with pytest.raises(ValueError, match=r"--adaptive_rule \(2\): give one value, or one per"):
    settings("--adaptive_rule=threshold,cumulative", "--adaptive_threshold=0.1,0.2,0.3")
  with pytest.raises(ValueError, match="--adaptive_threshold=x: could not convert"):
    settings("--adaptive_rule=threshold", "--adaptive_threshold=x")
  with pytest.raises(ValueError, match="unknown γ 'threshold:0.4'"):
    parse_gamma("threshold:0.4")
  assert isinstance(thr, AdaptiveConfig)


def test_several_drafts_share_one_baseline_in_one_sweep(tiny_target, tiny_draft):
  """--drafts: every draft's rows are timed beside the same baseline, and each
  draft keeps its own α (a T5 draft and prompt lookup cannot agree by chance
  on every token of two examples)."""
  model, params = tiny_target
  dm, dp = tiny_draft
  named = {"t5": drafts.T5Draft(params=dp, model=dm),
           "lookup": drafts.build("prompt_lookup", vocab_size=model.config.vocab_size)}
  inputs = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (3, 10), 2, 64), np.int32)
  rows = gamma_sweep(model, params, named, inputs, [2], SamplingConfig(), max_decode_len=12)
  assert [(r["draft"], r["gamma"]) for r in rows] == [("t5", 2), ("lookup", 2)]
  assert len({r["baseline_tok_s"] for r in rows}) == 1
  assert all(r["mismatches"] == 0 for r in rows)
  assert rows[0]["c"] != rows[1]["c"]              # each draft's own cost measurement
  table = markdown_table(rows)
  assert table.splitlines()[0].startswith("| draft | temp |")
  assert [l.split("|")[1].strip() for l in table.splitlines()[2:]] == ["t5", "lookup"]


def test_bench_speculative_compares_drafts_given_by_the_dataclass_flags():
  """--drafts_<field>: DraftRow's fields as flags, one value per draft or one
  for all; labels derived or given; a bad draft is one ValueError."""
  from lab.sweep import DraftRow, dataclasses_from_flags, draft_rows
  mod = _bench_speculative()
  rows = lambda *argv: draft_rows(dataclasses_from_flags(
      DraftRow, mod.parser().parse_args(argv), prefix="drafts_"))
  assert rows("--drafts_name=t5,t5,prompt_lookup,lookup_t5",
              "--drafts_checkpoint=ck/draft_small,ck/draft_tiny/,,ck/x") == {
      "draft_small": ("t5", "ck/draft_small", ""), "draft_tiny": ("t5", "ck/draft_tiny/", ""),
      "prompt_lookup": ("prompt_lookup", "", ""), "lookup_t5:x": ("lookup_t5", "ck/x", "")}
  assert rows("--drafts_name=t5", "--drafts_checkpoint=a/x,b/x", "--drafts_label=old,new") == {
      "old": ("t5", "a/x", ""), "new": ("t5", "b/x", "")}
  assert rows("--drafts_name=t5", "--drafts_checkpoint=a/x", "--drafts_shortlist=,s.json") == {
      "x": ("t5", "a/x", ""), "x+shortlist": ("t5", "a/x", "s.json")}
  for bad, msg in [(["--drafts_name=t5"], "needs a checkpoint"),
                   (["--drafts_name=nope"], "unknown draft 'nope'"),
                   (["--drafts_name=t5", "--drafts_checkpoint=a/x,b/x"], "both be labelled 'x'")]:
    with pytest.raises(ValueError, match=msg):
      rows(*bad)


def test_auto_that_chooses_plain_decoding_runs_the_baseline_as_its_row(tiny_target, tiny_draft,
                                                                       monkeypatch):
  """'auto' where the measured costs (forced: verification 5 steps, the draft
  0.9 of one) leave every γ below 1x: the row is 'auto→plain', decoded by the
  baseline (token for token its outputs, no α, costs or prediction)."""
  from lab import sweep
  from specdec_jax.theory import RoundCost
  slow = RoundCost(1, 0.9, 5.0, step_ms=1.0)
  monkeypatch.setattr(sweep, "measure_costs_many",
                      lambda target, params, draft, x, gammas, *a, **k: {g: slow for g in gammas})
  monkeypatch.setattr(sweep, "speculative_decode",
                      lambda *a, **k: pytest.fail("speculative decoding ran"))
  model, params = tiny_target
  dm, dp = tiny_draft
  inputs = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (3, 10), 2, 64), np.int32)
  (r,) = gamma_sweep(model, params, drafts.T5Draft(params=dp, model=dm), inputs, ["auto"],
                     SamplingConfig(), max_decode_len=12, gamma_max=3)
  assert r["gamma"] == "auto→plain" and r["auto"]["gamma"] == 0 and r["auto"]["plain"]
  assert r["mismatches"] == 0 and r["tokens_per_target_call"] == 1
  assert r["alpha"] is None and r["c"] is None and r["expected_v"] is None
  assert "| auto→plain |" in markdown_table([r])
