"""What both halves of the exactness matrix share: a cell's id and its decoding call."""

from __future__ import annotations

from typing import Any

import pytest

from exactness_cases import Cell
from specdec_jax.decoding import AdaptiveConfig, speculative_decode, tree_speculative_decode
from specdec_jax.models.t5 import T5Model, fuse_projections
from specdec_jax.sampling import SamplingConfig

THRESHOLD = lambda t, **kw: AdaptiveConfig("threshold", t, **kw)  # noqa: E731


def cell_param(cell: Cell, name: str, slow: bool = False):
  """A matrix cell as a test parameter; ``slow``: in the full suite only
  (``-m "not slow"`` leaves it out), for cells whose property another fast
  cell already carries."""
  return pytest.param(cell, id=f"{cell.loop}-{name}", marks=[pytest.mark.slow] if slow else [])


def decode(cell: Cell, model: T5Model, params: Any, draft: Any, inputs, key, eos: int,
           max_len: int, sampling: SamplingConfig):
  if cell.fixed:  # every target call scores cell.fixed positions
    model = T5Model(model.config.replace(fixed_positions=cell.fixed))
  if cell.fused:  # the target's projections fused in memory
    model = T5Model(model.config.replace(fused_projections=True))
    params = fuse_projections(params)
  if cell.loop == "tree":
    return tree_speculative_decode(model, params, draft, inputs, key, tree=cell.shape,
                                   max_decode_len=max_len, sampling=sampling, eos_id=eos)
  return speculative_decode(model, params, draft, inputs, key, gamma=cell.gamma,
                            max_decode_len=max_len, sampling=sampling, eos_id=eos,
                            adaptive=cell.adaptive)
