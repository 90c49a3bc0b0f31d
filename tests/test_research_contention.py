"""Cache contention (lab.contention): the decode working set
counts what a decode step reads, and every (k, MB) pass is timed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.models.t5 import T5Config, param_shapes
from lab.contention import (cache_contention, contention_markdown,
                            decode_working_set_mb)


@pytest.mark.parametrize("tied", [False, True])
def test_decode_working_set_counts_what_a_decode_step_reads(tied):
  """The MB figure equals 4 bytes x the parameters one cached decode step
  touches: every decoder-layer kernel but the cross-attention K/V projections
  (used once per example), plus the logits matrix (the embedding when tied)."""
  cfg = T5Config(vocab_size=96, d_model=24, num_heads=2, head_dim=8, num_encoder_layers=2,
                 num_decoder_layers=3, d_ff=40, version="1.0" if tied else "1.1")
  flat = jax.tree_util.tree_flatten_with_path(param_shapes(cfg))[0]
  names = ["/".join(str(getattr(k, "key", k)) for k in path) for path, _ in flat]
  read = 0
  for name, (_, leaf) in zip(names, flat):
    in_layer = name.startswith("decoder/layers_") and "norm" not in name
    cross_kv = "encoder_decoder_attention/key" in name or "encoder_decoder_attention/value" in name
    logits = name.startswith("decoder/logits_dense") or (tied and name.startswith("token_embedder"))
    if (in_layer and not cross_kv) or logits:
      read += int(np.prod(leaf.shape))
  assert read > 0
  assert decode_working_set_mb(cfg) == pytest.approx(4 * read / 2 ** 20)


def test_cache_contention_rows(tiny_target):
  model, params = tiny_target
  inputs = jax.random.randint(jax.random.PRNGKey(0), (1, 8), 2, 64).astype(jnp.int32)
  rows = cache_contention(model, params, inputs, [1, 2], [0.25], cache_len=12, position=3,
                          inner=2, repeats=1)
  assert [(r.k, r.megabytes) for r in rows] == [(1, 0.0), (1, 0.25), (2, 0.0), (2, 0.25)]
  for r in rows:
    assert r.alone_ms > 0 and np.isfinite(r.pass_ms)
    assert (r.read_ms > 0) == (r.megabytes > 0)
    if r.megabytes == 0:
      assert r.slowdown == 1.0
  assert len(contention_markdown(rows).splitlines()) == 2 + len(rows)
