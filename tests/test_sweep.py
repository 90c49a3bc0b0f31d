"""The γ sweep behind scripts/bench_speculative.py: rows, exactness column,
and the decomposition of measured / EXP(with v) into its two factors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specdec_jax import drafts
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting.sweep import gamma_sweep, markdown_table


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


def test_parse_setting():
  from specdec_jax.scripting.sweep import parse_setting
  assert parse_setting("3", 7) == ("3", 3, None)
  label, g, cfg = parse_setting("threshold:0.4:0.3", 7)
  assert (label, g, cfg.threshold, cfg.skip_below) == ("≤7 thr 0.4 skip 0.3", 7, 0.4, 0.3)
  assert cfg.verify_widths(7) == (0, 1, 2, 4, 7)
  label, _, cfg = parse_setting("threshold", 7)
  assert (label, cfg.threshold, cfg.skip_below) == ("≤7 thr 0.4", 0.4, None)
  label, _, cfg = parse_setting("cumulative:0.3:0.4", 7)
  assert (label, cfg.rule, cfg.threshold, cfg.skip_below) == (
      "≤7 cum 0.3 skip 0.4", "cumulative", 0.3, 0.4)
  from specdec_jax.scripting.sweep import parse_widths
  assert parse_widths("all", 4) == (1, 2, 3, 4) and parse_widths("default", 4) == ()
  assert parse_widths("1,3", 4) == (1, 3)
  assert parse_setting("cumulative:0.3", 4, parse_widths("all", 4))[2].verify_widths(4) == (
      1, 2, 3, 4)
  label, _, cfg = parse_setting("cumulative:0.25::drawn", 7)
  assert (label, cfg.threshold, cfg.skip_below, cfg.confidence) == (
      "≤7 cum 0.25 drawn", 0.25, None, "drawn")
  assert parse_setting("threshold:0.4:0.3:drawn", 7)[0] == "≤7 thr 0.4 skip 0.3 drawn"
  with pytest.raises(ValueError, match="'top', 'drawn'"):
    parse_setting("cumulative:0.25::drwan", 7)
  with pytest.raises(ValueError, match="threshold:t:s|unknown γ setting"):
    parse_setting("sometimes", 7)


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


def test_bench_speculative_parses_its_drafts_flag():
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_speculative.py"
  spec = importlib.util.spec_from_file_location("bench_speculative", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  assert mod.parse_drafts("t5:ck/draft_small,t5:ck/draft_tiny/,prompt_lookup,lookup_t5:ck/x") == {
      "draft_small": ("t5", "ck/draft_small", ""), "draft_tiny": ("t5", "ck/draft_tiny/", ""),
      "prompt_lookup": ("prompt_lookup", "", ""), "lookup_t5:x": ("lookup_t5", "ck/x", "")}
  assert mod.parse_drafts("old=t5:a/x,new=t5:b/x") == {"old": ("t5", "a/x", ""),
                                                       "new": ("t5", "b/x", "")}
  assert mod.parse_drafts("t5:a/x,t5:a/x@s.json") == {"x": ("t5", "a/x", ""),
                                                       "x+shortlist": ("t5", "a/x", "s.json")}
  for bad, msg in [("t5", "needs a checkpoint"), ("nope", "unknown draft 'nope'"),
                   ("t5:a/x,t5:b/x", "both be labelled 'x'"), (",", "no draft")]:
    with pytest.raises(ValueError, match=msg):
      mod.parse_drafts(bad)


def test_auto_that_chooses_plain_decoding_runs_the_baseline_as_its_row(tiny_target, tiny_draft,
                                                                       monkeypatch):
  """'auto' where the measured costs (forced: verification 5 steps, the draft
  0.9 of one) leave every γ below 1x: the row is 'auto→plain', decoded by the
  baseline (token for token its outputs, no α, costs or prediction)."""
  from specdec_jax.scripting import sweep
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
