"""Distill a T5 draft toward a T5 target (thin wrapper over specdec_jax.distill).

  python scripts/distill_draft.py --target_checkpoint=checkpoints/demo/target \
      --draft_checkpoint=checkpoints/demo/draft_small --output_dir=runs/draft_small_distilled \
      --workdir=runs/distill_small --source=data/bible/train.tsv \
      --eval_source=data/bible/validation.tsv

Flags carry the runner's ``Experiment`` names (source, split, task, vocab_path,
*_checkpoint, *_format, *_preset, max_input_len, max_decode_len). ``--smoke``
trains two random micro models for a few steps under --workdir (a check that the
pipeline runs, in well under a minute).
"""

from __future__ import annotations

import json
import sys

from absl import app, flags

from specdec_jax import distill

FLAGS = flags.FLAGS
_DEFAULTS = distill.DistillJob("", "", "", "")
for _name in ("target_checkpoint", "draft_checkpoint", "output_dir", "workdir", "source",
              "split", "task", "vocab_path", "target_format", "draft_format", "eval_split",
              "divergence", "optimizer"):
  flags.DEFINE_string(_name, getattr(_DEFAULTS, _name) or None, f"DistillJob.{_name}")
for _name in ("prefix", "target_preset", "draft_preset", "tfds_data_dir", "eval_source"):
  flags.DEFINE_string(_name, None, f"DistillJob.{_name}")
for _name in ("vocab_extra_ids", "max_input_len", "max_decode_len", "generate_batch_size",
              "steps", "batch_tokens", "eval_every", "seed", "grow_encoder_layers",
              "grow_decoder_layers", "feature_staleness"):
  flags.DEFINE_integer(_name, getattr(_DEFAULTS, _name), f"DistillJob.{_name}")
flags.DEFINE_integer("max_examples", None, "training inputs to use (default: all)")
flags.DEFINE_integer("eval_max_examples", 500, "held-out pairs for the agreement log")
for _name in ("sample_temperature", "ce_weight", "on_policy_fraction", "learning_rate",
              "bridge_learning_rate"):
  flags.DEFINE_float(_name, getattr(_DEFAULTS, _name), f"DistillJob.{_name}")
flags.DEFINE_float("max_minutes", None, "wall-clock cap on the training phase")
flags.DEFINE_list("modes", list(_DEFAULTS.modes), "target outputs to learn: greedy,sample")
flags.DEFINE_bool("encoder_bridge", False, "DistillJob.encoder_bridge: the draft also reads "
                  "the target's encoder output (specdec_jax.drafts.bridge)")
flags.DEFINE_bool("feature_bridge", False, "DistillJob.feature_bridge: the draft also reads "
                  "the target's decoder states of the committed prefix "
                  "(specdec_jax.drafts.feature_bridge)")
flags.DEFINE_bool("resume", False, "continue a run in an existing workdir/output_dir")
flags.DEFINE_bool("smoke", False, "random micro models, a few steps, all under --workdir")


def main(argv) -> None:
  del argv
  if FLAGS.smoke:
    summary = distill.smoke_job(FLAGS.workdir or "runs/distill_smoke",
                                encoder_bridge=FLAGS.encoder_bridge,
                                feature_bridge=FLAGS.feature_bridge)
  else:
    kw = {f: getattr(FLAGS, f) for f in distill.DistillJob.__dataclass_fields__
          if f in FLAGS and f != "modes"}
    kw["modes"] = tuple(FLAGS.modes)
    summary = distill.run_job(distill.DistillJob(**kw))
  print(json.dumps({k: v for k, v in summary.items() if k not in ("log", "job")}, indent=1))


if __name__ == "__main__":
  try:
    app.run(main)
  except (ValueError, FileNotFoundError, FileExistsError) as e:  # user errors: one line
    sys.exit(f"distill_draft.py: error: {e}")
