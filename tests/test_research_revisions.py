"""The kernel against a git revision (lab.revisions)."""

from __future__ import annotations

from lab.revisions import compare_acceptance


def test_compare_acceptance_against_a_revision():
  """The old kernel is loaded from git with its own sampler and timed beside
  the current one; at T = 0 their outputs must agree whatever the revision."""
  rows = compare_acceptance("HEAD", vocab_size=64, gammas=[2], temperatures=[0.0, 1.0],
                            inner=2, repeats=1)
  assert [r["what"] for r in rows] == ["standardize p + kernel"] * 2 + [
      "softmax + sample_any (one row)"]
  assert all(r["rev_us"] > 0 and r["now_us"] > 0 for r in rows)
  assert rows[0]["temperature"] == 0.0 and rows[0]["identical"] == [True] * 4
