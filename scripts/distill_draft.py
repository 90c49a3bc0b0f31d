"""Distill a T5 draft toward a T5 target (thin wrapper over specdec_jax.distill).

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
import dataclasses
import json
import typing
from typing import Optional, Sequence

from specdec_jax import distill
from specdec_jax.pair import PairSettings
from specdec_jax.scripting import script_args

# The flags that name files to read: resolved as the runner resolves paths.
READ_PATHS = ("target_checkpoint", "draft_checkpoint", "source", "eval_source", "vocab_path")
# Pair settings (``PairSettings``) a flag does not spell: the Python API's only.
NO_FLAG = ("logical_axis_rules", "config_dirs")


def parser() -> argparse.ArgumentParser:
  """The flags: every ``DistillJob`` field (its default), --max_examples,
  --eval_max_examples, --max_minutes, --smoke and --verbose."""
  p = script_args.new_parser(__doc__)
  job = distill.DistillJob(output_dir="", workdir="")
  _pair_flags(p, job)
  for name in ("output_dir", "workdir", "source", "split", "task", "eval_split", "divergence",
               "optimizer"):
    p.add_argument(f"--{name}", default=getattr(job, name) or None, help=f"DistillJob.{name}")
  for name in ("prefix", "tfds_data_dir", "eval_source"):
    p.add_argument(f"--{name}", default=None, help=f"DistillJob.{name}")
  for name in ("max_input_len", "max_decode_len", "generate_batch_size", "steps",
               "batch_tokens", "eval_every", "seed", "grow_encoder_layers",
               "grow_decoder_layers", "feature_staleness", "block_size", "block_cuts"):
    p.add_argument(f"--{name}", type=int, default=getattr(job, name), help=f"DistillJob.{name}")
  p.add_argument("--max_examples", type=int, default=None,
                 help="training inputs to use (default: all)")
  p.add_argument("--eval_max_examples", type=int, default=500,
                 help="held-out pairs for the agreement log")
  for name in ("sample_temperature", "ce_weight", "on_policy_fraction", "learning_rate",
               "bridge_learning_rate"):
    p.add_argument(f"--{name}", type=float, default=getattr(job, name),
                   help=f"DistillJob.{name}")
  p.add_argument("--max_minutes", type=float, default=None,
                 help="wall-clock cap on the training phase")
  p.add_argument("--modes", type=lambda s: tuple(script_args.comma_list(s)),
                 default=tuple(job.modes), help="target outputs to learn: greedy,sample")
  p.add_argument("--encoder_bridge", action="store_true",
                 help="DistillJob.encoder_bridge: the draft also reads the target's encoder "
                      "output (specdec_jax.drafts.bridge)")
  p.add_argument("--feature_bridge", action="store_true",
                 help="DistillJob.feature_bridge: the draft also reads the target's decoder "
                      "states of the committed prefix (specdec_jax.drafts.feature_bridge)")
  p.add_argument("--export_quantization", default=None, choices=("int8", "int4"),
                 help="DistillJob.export_quantization: record that the exported draft runs "
                 "with weight-only int8 / int4 kernels (per-channel scales); the runner "
                 "quantizes it when it loads it")
  p.add_argument("--resume", action="store_true",
                 help="continue a run in an existing workdir/output_dir")
  p.add_argument("--smoke", action="store_true",
                 help="random micro models, a few steps, all under --workdir")
  p.add_argument("--dry_run", default=None, metavar="TOPOLOGY",
                 help="compile the job's programs for a TPU topology (e.g. v4:2x2x1, v5e:2x4) "
                      "on this machine and report their memory; reads, writes and trains "
                      "nothing (specdec_jax.dryrun.distill_programs)")
  return p


def _pair_flags(p: argparse.ArgumentParser, job: distill.DistillJob) -> None:
  """A flag for each pair setting (``PairSettings``, in its order) but those
  distillation holds fixed (``distill.FIXED_PAIR_SETTINGS``) and ``NO_FLAG``:
  a str, int or float setting (or an Optional one) is typed from its
  annotation, a bool is --name / --no-name; any other needs its entry in
  ``special`` below."""
  special = {
      "mesh_shape": dict(type=_mesh_shape, help="DistillJob.mesh_shape: DATA,MODEL device "
                         "mesh, e.g. 1,8 (default: one device)"),
      "param_dtype": dict(choices=distill.PARAM_DTYPES, help="DistillJob.param_dtype: the "
                          "target's weights in device memory (bfloat16 halves them; the "
                          "draft trains in float32)"),
      "partition_fallback": dict(help="DistillJob.partition_fallback: 'error' or 'replicate' "
                                 "for dimensions the mesh does not divide"),
  }
  hints = typing.get_type_hints(PairSettings)
  for f in dataclasses.fields(PairSettings):
    if f.name in NO_FLAG or f.name in distill.FIXED_PAIR_SETTINGS:
      continue
    kind = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)]
    kw = dict(default=getattr(job, f.name), help=f"DistillJob.{f.name}")
    if f.name in special:
      kw.update(special[f.name])
    elif kind == [bool]:
      kw["action"] = argparse.BooleanOptionalAction   # --name / --no-name
    elif len(kind) == 1 and kind[0] in (str, int, float):
      kw["type"] = kind[0]
    else:
      raise TypeError(f"pair setting {f.name} ({hints[f.name]}) has no flag: give it an entry "
                      "in _pair_flags's special flags or in NO_FLAG")
    p.add_argument(f"--{f.name}", **kw)


def _mesh_shape(text: str) -> tuple[int, ...]:
  """'1,8' -> (1, 8); DistillJob.validate checks the values."""
  try:
    return tuple(script_args.comma_list(text, int))
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected DATA,MODEL (two ints), got {text!r}") from None


def _job(args: argparse.Namespace) -> distill.DistillJob:
  """The ``DistillJob`` of the flags (each flag the field of its name)."""
  fields = distill.DistillJob.__dataclass_fields__
  return distill.DistillJob(**{f: getattr(args, f) for f in fields if hasattr(args, f)})


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the job (or its --smoke version, or its --dry_run); returns the
  exit status: 1 when a dry run finds the job does not fit, else 0."""
  args = script_args.parse(parser(), argv, paths=READ_PATHS)
  if args.dry_run:
    if args.smoke:
      raise ValueError("--dry_run compiles the job given by the flags; drop --smoke")
    from specdec_jax.dryrun import distill_programs, driver  # pylint: disable=import-outside-toplevel
    r = driver.main(distill_programs.DistillPrograms(_job(args)), args.dry_run)
    return 0 if r.fits else 1
  if args.smoke:
    summary = distill.smoke_job(args.workdir or "runs/distill_smoke",
                                encoder_bridge=args.encoder_bridge,
                                feature_bridge=args.feature_bridge)
  else:
    summary = distill.run_job(_job(args))
  print(json.dumps({k: v for k, v in summary.items() if k not in ("log", "job")}, indent=1))
  return 0


if __name__ == "__main__":
  script_args.run_main(main)
