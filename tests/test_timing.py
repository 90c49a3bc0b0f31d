"""timing: the adaptive warm-up helper (the rest of timing.py is covered by the
sweep, profile and runner tests)."""

import numpy as np


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
