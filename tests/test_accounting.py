"""specdec_jax.run.account: SPEED against Theorem 3.8, step by step."""

import jax
import numpy as np
import pytest

from specdec_jax import theory
from specdec_jax.run import account as accounting
from specdec_jax.drafts.t5_draft import T5Draft

GAMMA, C, V, F, STEP = 3, 0.05, 1.4, 1.1, 1.3   # γ, c, v, interplay, target step ms
PREFILL = {32: (3.0, 3.5), 48: (4.0, 4.6)}


def _records(extra_spec_ms: float = 0.0):
  """Records whose walltimes are exactly the whole-run model's (plus
  ``extra_spec_ms`` per speculative round)."""
  rng = np.random.default_rng(0)
  round_ms = (GAMMA * C + V) * F * STEP
  recs, widths = [], []
  for i in range(12):
    w = (32, 48)[i % 2]
    calls = int(rng.integers(5, 20))
    rejected = int(rng.integers(1, calls))
    accepted = int(rng.integers(calls, 3 * calls))
    tokens = accepted + calls
    recs.append({
        "index": i, "mode": "speculative", "gamma": GAMMA, "batch_size": 1,
        "c": C, "v": V, "interplay": F, "target_step_ms": STEP,
        "baseline_tokens": tokens, "tokens": tokens, "target_calls": calls,
        "accepted": accepted, "rejected": rejected, "gamma_hist": [0, 0, 0, calls],
        "baseline_s": (PREFILL[w][0] + tokens * STEP) / 1e3,
        "speculative_s": (PREFILL[w][1] + calls * (round_ms + extra_spec_ms)) / 1e3})
    widths.append(w)
  return recs, widths


def test_every_ms_accounted_for_when_the_walltimes_follow_the_model():
  recs, widths = _records()
  a = accounting.attribute(recs, PREFILL, widths)
  acc = sum(r["accepted"] for r in recs)
  alpha = acc / (acc + sum(r["rejected"] for r in recs))
  assert a.alpha == pytest.approx(alpha)
  assert a.expected_v == pytest.approx(float(theory.walltime_improvement(alpha, GAMMA, C, V)))
  # The runner's "EXP in context": c and v both scaled by the interplay.
  assert a.expected_in_context == pytest.approx(
      float(theory.walltime_improvement(alpha, GAMMA, C * F, V * F)))
  tau = sum(r["tokens"] for r in recs) / sum(r["target_calls"] for r in recs)
  assert a.tokens_per_call == pytest.approx(tau)
  assert a.expected_measured_tau == pytest.approx(a.expected_in_context * tau
                                                  / float(theory.expected_tokens(alpha, GAMMA)))
  assert a.baseline_vs_model == pytest.approx(1.0)
  assert a.speculative_vs_model == pytest.approx(1.0)
  assert a.unexplained == pytest.approx(1.0)
  assert a.prefill_baseline_ms == pytest.approx(3.5)        # half the records at each width
  assert a.prefill_speculative_ms == pytest.approx(4.05)
  from lab.accounting import markdown
  table = markdown(a)
  assert f"{a.speed:.3f}x" in table and "interplay" in table and "prefill" in table


def test_a_slower_speculative_loop_shows_as_unexplained_on_its_side():
  recs, widths = _records(extra_spec_ms=0.2)
  a = accounting.attribute(recs, PREFILL, widths)
  model_spec = sum(PREFILL[w][1] + r["target_calls"] * (GAMMA * C + V) * F * STEP
                   for r, w in zip(recs, widths))
  spent = sum(1e3 * r["speculative_s"] for r in recs)
  assert a.speculative_vs_model == pytest.approx(spent / model_spec)
  assert a.speculative_vs_model > 1.05
  assert a.baseline_vs_model == pytest.approx(1.0)
  assert a.unexplained == pytest.approx(1.0 / a.speculative_vs_model)


@pytest.mark.parametrize("change, message", [
    (lambda rs, ws: (rs, ws[:-1]), "widths for"),
    (lambda rs, ws: ([dict(r, gamma_hist=[0, 1, 0, 3]) for r in rs], ws), "fixed-γ"),
    (lambda rs, ws: ([dict(r, batch_size=2) for r in rs], ws), "batch-1"),
    (lambda rs, ws: (rs, [64] + ws[1:]), r"input widths \[64\]"),
    (lambda rs, ws: ([{k: v for k, v in r.items() if k != "interplay"} for r in rs], ws),
     "'interplay'"),
    (lambda rs, ws: ([], []), "no records"),
])
def test_records_it_cannot_model_are_refused(change, message):
  recs, widths = change(*_records())
  with pytest.raises(ValueError, match=message):
    accounting.attribute(recs, PREFILL, widths)


def test_prefill_is_timed_per_width_for_both_loops(tiny_target, tiny_draft):
  (tm, tp), (dm, dp) = tiny_target, tiny_draft
  draft = T5Draft(dp, dm)
  rng = np.random.default_rng(0)
  inputs = {w: jax.numpy.asarray(rng.integers(2, tm.config.vocab_size, (1, w)), jax.numpy.int32)
            for w in (8, 16)}
  out = accounting.prefill_ms(tm, tp, draft, inputs, max_decode_len=8, gamma=2, repeats=3)
  assert set(out) == {8, 16}
  assert all(np.isfinite(b) and b > 0 and np.isfinite(s) and s > 0 for b, s in out.values())
