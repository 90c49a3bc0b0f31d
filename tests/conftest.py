"""Shared fixtures: tiny random T5 models (small shapes, so tests compile fast).

Session-scoped so that every test reuses the same params, and jitted functions
called with the same static arguments and shapes compile once per session.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from specdec_jax.models.t5 import T5Config, T5Model  # noqa: E402

TINY = T5Config(vocab_size=64, d_model=32, num_heads=4, head_dim=8, num_encoder_layers=2,
                num_decoder_layers=2, d_ff=48)


def sharpen(params, scale: float = 8.0):
  """Scale the output layer so argmax has clear margins (no float near-ties)."""
  params = jax.tree_util.tree_map(lambda x: x, params)
  params["decoder"]["logits_dense"]["kernel"] = params["decoder"]["logits_dense"]["kernel"] * scale
  return params


@pytest.fixture(scope="session")
def tiny_target():
  model = T5Model(TINY)
  return model, sharpen(model.init(jax.random.PRNGKey(0)))


@pytest.fixture(scope="session")
def tiny_draft():
  model = T5Model(TINY.replace(num_encoder_layers=1, num_decoder_layers=1))
  return model, sharpen(model.init(jax.random.PRNGKey(7)))
