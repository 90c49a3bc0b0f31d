"""A tiny end-to-end setting for runner tests: a SentencePiece vocabulary,
target and draft checkpoints, a TSV of examples and a gin file."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from specdec_jax.checkpoints import save_checkpoint
from specdec_jax.models.t5 import T5Config, T5Model

WORDS = ("thou thee thy hath doth saith unto ye shall lord king house went came said "
         "people land day god man son father city behold").split()
CONFIG = T5Config(vocab_size=64, d_model=32, num_heads=4, head_dim=8, num_encoder_layers=2,
                  num_decoder_layers=2, d_ff=48)


def build(d: Path) -> Path:
  """Writes the setting into ``d``. Drafts: 'draft' (random, α near 0),
  'draft_near' (the target's weights, slightly perturbed: some proposals
  accepted, some not) and 'draft_v65' (a vocabulary of 65: refused)."""
  import sentencepiece as spm
  rng = np.random.default_rng(0)
  lines = [" ".join(rng.choice(WORDS, size=rng.integers(4, 12))) for _ in range(400)]
  (d / "corpus.txt").write_text("\n".join(lines) + "\n")
  spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "spm"),
                                 vocab_size=40, model_type="unigram", pad_id=0, eos_id=1,
                                 unk_id=2, bos_id=-1, minloglevel=2)
  cfg = CONFIG
  target = T5Model(cfg).init(jax.random.PRNGKey(0))
  for name, c, params in (
      ("target", cfg, target),
      ("draft", cfg.replace(num_encoder_layers=1, num_decoder_layers=1),
       T5Model(cfg.replace(num_encoder_layers=1, num_decoder_layers=1)).init(
           jax.random.PRNGKey(1))),
      ("draft_v65", cfg.replace(vocab_size=65, num_decoder_layers=1),
       T5Model(cfg.replace(vocab_size=65, num_decoder_layers=1)).init(jax.random.PRNGKey(2))),
      ("draft_near", cfg, jax.tree.map(
          lambda x: x * (1 + 0.05 * rng.standard_normal(np.shape(x))).astype(np.float32),
          target))):
    save_checkpoint(str(d / name), params, c)
  rows = ["id\tinput\treference"] + [f"ex{i}\t{lines[i]}\t{lines[i + 1]}" for i in range(80)]
  (d / "data.tsv").write_text("\n".join(rows) + "\n")
  (d / "exp.gin").write_text(f"""
Experiment.task = 'toy'
Experiment.source = '{d / "data.tsv"}'
Experiment.prefix = ''
Experiment.vocab_path = '{d / "spm.model"}'
Experiment.target_checkpoint = '{d / "target"}'
Experiment.draft_checkpoint = '{d / "draft"}'
Experiment.gamma = 3
Experiment.max_input_len = 24
Experiment.max_decode_len = 16
Experiment.num_warmup = 1
Experiment.num_examples = 4
""")
  return d
