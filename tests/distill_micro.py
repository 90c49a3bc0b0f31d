"""The micro distillation job the multi-device and multi-process tests share
(tests/sharded_distill_worker.py, tests/multihost_worker.py): random target
and draft checkpoints whose every sharded dimension divides 8, the demo
vocabulary, 16 validation verses, a few steps."""

from __future__ import annotations

import os

import numpy as np

from specdec_jax import checkpoints, distill, partitioning
from specdec_jax.models.t5 import T5Config, param_shapes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 8 heads, vocab 8000 (the demo SentencePiece model's ids), d_ff 64: every
# dimension the target's rules shard divides 8.
TARGET = T5Config(vocab_size=8000, d_model=32, num_heads=8, head_dim=4, num_encoder_layers=1,
                  num_decoder_layers=1, d_ff=64)
DRAFT = TARGET.replace(d_model=16, num_heads=2, head_dim=8, d_ff=32)
STEPS = 4


def random_params(cfg: T5Config, seed: int) -> dict:
  """Random weights of ``cfg``'s shapes (numpy: no initializer to compile)."""
  rng = np.random.default_rng(seed)
  shapes = partitioning.flatten_names(param_shapes(cfg))
  return partitioning.unflatten_names({
      n: np.ones(s.shape, np.float32) if n.endswith("/scale")
      else (rng.standard_normal(s.shape) / np.sqrt(s.shape[0])).astype(np.float32)
      for n, s in shapes.items()})


def save_models(root: str) -> None:
  tparams = random_params(TARGET, 0)
  # Sharpened so the target's greedy outputs have clear argmax margins (the
  # meshes reorder its float sums).
  tparams["decoder"]["logits_dense"]["kernel"] *= 8
  checkpoints.save_checkpoint(os.path.join(root, "target"), tparams, TARGET, overwrite=True)
  checkpoints.save_checkpoint(os.path.join(root, "draft"), random_params(DRAFT, 1), DRAFT,
                              overwrite=True)


def job(root: str, name: str, mesh, **kw) -> distill.DistillJob:
  settings = dict(
      target_checkpoint=os.path.join(root, "target"),
      draft_checkpoint=os.path.join(root, "draft"),
      output_dir=os.path.join(root, name, "distilled"), workdir=os.path.join(root, name, "run"),
      source=os.path.join(REPO, "data/bible/validation.tsv"), max_examples=16,
      vocab_path=os.path.join(REPO, "checkpoints/demo/spm.model"), max_input_len=16,
      max_decode_len=16, modes=("greedy",), generate_batch_size=16, steps=STEPS,
      batch_tokens=128, eval_every=1, mesh_shape=mesh)
  return distill.DistillJob(**{**settings, **kw})
