"""The γ sweep behind scripts/bench_speculative.py: rows, exactness column,
and the decomposition of measured / EXP(with v) into its two factors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specdec_jax import drafts
from specdec_jax.sampling import SamplingConfig
from specdec_jax.sweep import gamma_sweep, markdown_table


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
  table = markdown_table(rows)
  assert "× (γc+v) ÷ round in baseline tokens" in table and table.count("\n") == 2
