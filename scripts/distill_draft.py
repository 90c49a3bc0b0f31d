r"""Distill a T5 draft toward a T5 target (thin wrapper over specdec_jax.distill).

  python scripts/distill_draft.py --target_checkpoint=checkpoints/demo/target \
      --draft_checkpoint=checkpoints/demo/draft_small --output_dir=runs/draft_small_distilled \
      --workdir=runs/distill_small --source=data/bible/train.tsv \
      --eval_source=data/bible/validation.tsv

Flags carry the runner's ``Experiment`` names (source, split, task, vocab_path,
*_checkpoint, *_format, *_preset, max_input_len, max_decode_len, and every
other setting of the pair the job takes, ``specdec_jax.pair.PairSettings``);
each flag is the ``DistillJob`` field of its name. ``--smoke`` trains two
random micro models for a few steps under --workdir (a check that the pipeline
runs, in well under a minute). Relative paths to read (checkpoints, vocabulary, sources) are looked
for in the working directory, then in the repository root, as the runner does;
--output_dir and --workdir are relative to the working directory.

At scale, ``--mesh_shape=DATA,MODEL`` (product = the device count) shards the
target over a device mesh (generation on the mesh; the draft replicated and
trained data-parallel over DATA) and ``--param_dtype=bfloat16`` keeps the
target's weights in bfloat16 (half the memory; the draft trains in float32):

  python scripts/distill_draft.py ... --mesh_shape=1,4 --param_dtype=bfloat16

``--dry_run=TOPOLOGY`` (e.g. v4:2x2x1 for a v4-8, v5e:2x4 for a v5e-8) reads
nothing and trains nothing: it validates the job, compiles its programs (the
target's generation, the draft's training step) for that TPU topology on
abstract sharded arrays, and prints each one's memory per device against the
chip's HBM, whether it fits (if not, the batch that would), and any collective
that moves a weight (``specdec_jax.dryrun.distill_programs``; needs libtpu, no TPU;
--target_preset and --draft_preset, or local checkpoints with a config.json):

  python scripts/distill_draft.py ... --dry_run=v4:2x2x1
"""

from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

from specdec_jax import distill
from specdec_jax.scripting import script_args

# The flags that name files to read: resolved as the runner resolves paths.
READ_PATHS = ("target_checkpoint", "draft_checkpoint", "source", "eval_source", "vocab_path")
# Pair settings (``PairSettings``) a flag does not spell: the Python API's only.
NO_FLAG = ("logical_axis_rules", "config_dirs")


def _mesh_shape(text: str) -> tuple[int, ...]:
  """'1,8' -> (1, 8); DistillJob.validate checks the values."""
  try:
    return tuple(script_args.comma_list(text, int))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected DATA,MODEL (two ints), got {text!r}") from None


# Flags whose type or choices are more than the field's annotation says.
SPECIAL = {
    "mesh_shape": dict(type=_mesh_shape, metavar="DATA,MODEL"),
    "param_dtype": dict(choices=distill.PARAM_DTYPES),
    "export_quantization": dict(choices=("int8", "int4")),
}


def parser() -> argparse.ArgumentParser:
  """The flags: every ``DistillJob`` field (``script_args.dataclass_flags``,
  typed and defaulted as the field) but those distillation holds fixed
  (``distill.FIXED_PAIR_SETTINGS``) and ``NO_FLAG``; --smoke, --dry_run and
  --verbose."""
  p = script_args.new_parser(__doc__)
  job = distill.DistillJob(output_dir="", workdir="")
  script_args.dataclass_flags(p, distill.DistillJob, defaults=job,
                              skip=NO_FLAG + tuple(distill.FIXED_PAIR_SETTINGS), special=SPECIAL)
  p.add_argument("--smoke", action="store_true",
                 help="random micro models, a few steps, all under --workdir")
  p.add_argument("--dry_run", default=None, metavar="TOPOLOGY",
                 help="compile the job's programs for a TPU topology (e.g. v4:2x2x1, v5e:2x4) "
                      "on this machine and report their memory; reads, writes and trains "
                      "nothing (specdec_jax.dryrun.distill_programs)")
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the job (or its --smoke version, or its --dry_run); returns the
  exit status: 1 when a dry run finds the job does not fit, else 0."""
  args = script_args.parse(parser(), argv, paths=READ_PATHS)
  if args.dry_run:
    if args.smoke:
      raise ValueError("--dry_run compiles the job given by the flags; drop --smoke")
    from specdec_jax.dryrun import distill_programs, driver  # pylint: disable=import-outside-toplevel
    r = driver.main(distill_programs.DistillPrograms(script_args.dataclass_from_flags(distill.DistillJob, args)), args.dry_run)
    return 0 if r.fits else 1
  if args.smoke:
    summary = distill.smoke_job(args.workdir or "runs/distill_smoke",
                                encoder_bridge=args.encoder_bridge,
                                feature_bridge=args.feature_bridge)
  else:
    summary = distill.run_job(script_args.dataclass_from_flags(distill.DistillJob, args))
  print(json.dumps({k: v for k, v in summary.items() if k not in ("log", "job")}, indent=1))
  return 0


if __name__ == "__main__":
  script_args.run_main(main)
