"""timing: the adaptive warm-up helper and the round costs it measures (the
rest of timing.py is covered by the profile and runner tests)."""

import jax
import numpy as np
import pytest

from specdec_jax import drafts
from specdec_jax.sampling import SamplingConfig


def test_warm_up_widths_stops_once_every_width_ran():
  """Counts map to the smallest compiled width covering them; the warm-up
  stops after the batch that completes the set, and runs all batches if some
  width is never reached."""
  from types import SimpleNamespace
  from specdec_jax.timing import warm_up_widths
  hists = [[[0, 3, 0, 0, 0]], [[0, 0, 1, 0, 0]], [[0, 0, 0, 0, 2]], [[0, 1, 0, 0, 0]]]
  calls = []

  def run(i):
    calls.append(i)
    return SimpleNamespace(stats=SimpleNamespace(gamma_hist=np.asarray(hists[i])))

  # widths (1, 2, 4): counts 1 -> 1, 2 -> 2, 4 -> 4; complete after batch 2.
  assert warm_up_widths(run, range(4), (1, 2, 4)) == {1, 2, 4}
  assert calls == [0, 1, 2]
  calls.clear()
  # widths (1, 4): count 2 runs at width 4; width 0 never reached -> all batches.
  assert warm_up_widths(run, range(4), (0, 1, 4)) == {1, 4}
  assert calls == [0, 1, 2, 3]


@pytest.mark.slow
def test_costs_for_several_gammas_share_one_interleaved_step(tiny_target, tiny_draft):
  from specdec_jax.timing import measure_costs_many
  model, params = tiny_target
  dm, dp = tiny_draft
  draft = drafts.T5Draft(params=dp, model=dm)
  x = jax.random.randint(jax.random.PRNGKey(2), (1, 10), 2, 64)
  costs = measure_costs_many(model, params, draft, x, [3, 1], SamplingConfig(), repeats=3,
                             inner=2)
  assert sorted(costs) == [1, 3]
  # One target-step piece is the unit of every γ's c and v: each γ's round
  # record holds its own γ and the shared step.
  assert costs[1].step_ms == costs[3].step_ms > 0
  for g, c in costs.items():
    assert (c.gamma, c.draft_calls, c.positions) == (g, g, g + 1)
    assert c.c > 0 and c.v > 0 and c.c_se >= 0 and c.v_se >= 0 and c.round_se >= 0
    # In-context costs scale both by the round's interplay, so that γ c' + v'
    # is the round timed whole (in target steps).
    assert c.interplay > 0
    assert g * c.c_in_context + c.v_in_context == pytest.approx(
        (g * c.c + c.v) * c.interplay)
  with pytest.raises(ValueError, match="gammas must be >= 1"):
    measure_costs_many(model, params, draft, x, [0, 2], SamplingConfig())
