r"""The distillation's TPU dry run (``scripts/distill_draft.py ... --dry_run=v4:2x2x1``):
'generate (MODE)', the target generating training outputs at the longest
input bucket, and 'train step', the draft's step (draft, optimizer and bridges
replicated in float32, the target's sharded weights an argument). A program
that does not fit gets the first halving of its batch whose compile fits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from specdec_jax import distill, partitioning, training
from specdec_jax.decoding import temperature_sample
from specdec_jax.drafts import bridge, feature_bridge
from specdec_jax.dryrun import driver
from specdec_jax.dryrun.driver import (GiB, Compile, Context, DryRun, Program, abstract_key,
                                       abstract_params, compile_program, gib, placed)
from specdec_jax.models.t5 import T5Config, T5Model
from specdec_jax.partitioning import Partitioner
from specdec_jax.sampling import SamplingConfig

# The job's fields naming what a run reads; the dry run reads none of them.
READ_FIELDS = ("target_checkpoint", "draft_checkpoint", "vocab_path", "source", "eval_source")
# At most this many halvings are compiled when looking for settings that fit.
MAX_HALVINGS = 4


def data_axis(ctx: Context) -> int:
  """The mesh's 'data' size (1 on one device)."""
  return 1 if ctx.settings.mesh_shape is None else ctx.settings.mesh_shape[0]


def _buckets(job: distill.DistillJob) -> list[int]:
  return training.buckets_upto(max(job.max_input_len, job.max_decode_len))  # as run_job


def input_len(ctx: Context) -> int:
  """Generation's longest input bucket."""
  return training.bucket_len(ctx.settings.max_input_len, _buckets(ctx.settings))


def train_len(ctx: Context) -> int:
  """The train step's longest bucket."""
  return _buckets(ctx.settings)[-1]


def train_rows(ctx: Context, batch_tokens: Optional[int] = None) -> int:
  """Rows of a train batch at ``train_len`` (``training.batch_rows``)."""
  return training.batch_rows(train_len(ctx), batch_tokens or ctx.settings.batch_tokens,
                             data_axis(ctx))


def _meshes_holding(cfg: T5Config, job: distill.DistillJob, devices: Sequence[Any],
                    room: float) -> list[tuple[tuple[int, int], int]]:
  """(mesh shape, target bytes per device) of each (data, model) mesh over
  ``devices`` holding the target within ``room`` bytes, fewest bytes first."""
  n, out = len(devices), []
  for model in range(1, n + 1):
    if n % model:
      continue
    shape = (n // model, model)
    if job.generate_batch_size % shape[0]:
      continue
    try:
      part = partitioning.from_settings(shape, job.logical_axis_rules, job.partition_fallback,
                                        mesh=partitioning.make_mesh(shape, devices))
      need = driver.weight_bytes(abstract_params(cfg, part, job.param_dtype, devices[0]))
    except partitioning.PartitioningError:
      continue
    if need <= room:
      out.append((shape, need))
  return sorted(out, key=lambda x: (x[1], x[0]))


class DistillPrograms(driver.ProgramList):
  """The distillation's programs; ``find_fixes``: a smaller batch for each that does not fit."""

  def __init__(self, job: distill.DistillJob, programs: Optional[Sequence[str]] = None,
               find_fixes: bool = True):
    self.settings, self.names, self.find_fixes = job, programs, find_fixes

  def validate(self) -> list:
    job = self.settings
    job.validate(check_paths=False)
    return [(f, getattr(job, f)) for f in READ_FIELDS if getattr(job, f)]

  def architectures(self) -> tuple[T5Config, Optional[T5Config]]:
    job = self.settings
    target, draft = (driver.architecture(role, getattr(job, f"{role}_checkpoint"),
                                         getattr(job, f"{role}_format"),
                                         getattr(job, f"{role}_preset"), "float32", ("pass", "--"))
                     for role in ("target", "draft"))
    job.pair.check_vocabularies(target, draft)
    return target, draft.replace(
        num_encoder_layers=draft.num_encoder_layers + job.grow_encoder_layers,
        num_decoder_layers=draft.num_decoder_layers + job.grow_decoder_layers)

  def partitioners(self, ctx: Context) -> tuple[Optional[Partitioner], Optional[Partitioner]]:
    """As ``distill.partitioners``; a wrong-size mesh names one that fits."""
    job = self.settings
    try:
      return driver.mesh_partitioners(job.mesh_shape, job.logical_axis_rules,
                                      partitioning.DATA_PARALLEL_RULES, job.partition_fallback,
                                      ctx.devices)
    except partitioning.PartitioningError as e:
      best = _meshes_holding(ctx.target_config, job, ctx.devices, math.inf)
      hint = (f"; for this target, --mesh_shape={','.join(map(str, best[0][0]))} holds the "
              "fewest weight bytes per device" if best else "")
      raise ValueError(f"{ctx.where}: DistillJob.mesh_shape: {e}{hint}") from None

  def resident(self, ctx: Context) -> dict[str, int]:
    """The weights per device: the target's and the draft's float32 copy."""
    job, out = self.settings, {}
    for role, cfg, part, dtype in (
        ("target", ctx.target_config, ctx.target_part, job.param_dtype),
        ("draft", ctx.draft_config, ctx.draft_part, "float32")):
      try:
        out[role] = driver.weight_bytes(abstract_params(cfg, part, dtype, ctx.device))
      except partitioning.PartitioningError as e:
        raise ValueError(f"{ctx.where}: mesh_shape={tuple(job.mesh_shape)} cannot shard the "
                         f"{role} ({getattr(job, role + '_checkpoint')}): {e}") from None
    return out

  def too_big(self, ctx: Context) -> str:
    job, weights, chip = self.settings, ctx.resident, ctx.chip
    mesh = f"mesh_shape={tuple(job.mesh_shape)}" if job.mesh_shape else "one device"
    holding = _meshes_holding(ctx.target_config, job, ctx.devices,
                              chip.hbm_bytes - weights["draft"])
    hint = (f"--mesh_shape={','.join(map(str, holding[0][0]))} holds the target in "
            f"{holding[0][1] / GiB:.2f} GiB per device" if holding else
            "no (data, model) mesh of this topology holds it: use more chips")
    return (f"the weights alone do not fit on {mesh}: the target's need "
            f"{weights['target'] / GiB:.2f} GiB per device at param_dtype={job.param_dtype} "
            f"and the draft's float32 copy {weights['draft'] / GiB:.2f} GiB, but a "
            f"{chip.label} chip has {chip.hbm_bytes / GiB:.0f} GiB of HBM; {hint}")

  def programs(self, ctx: Context) -> list[Compile]:
    thunks = lowerers(ctx)
    names = list(thunks) if self.names is None else list(self.names)
    unknown = [n for n in names if n not in thunks]
    if unknown:
      raise ValueError(f"unknown program(s) {unknown}; this job's: {list(thunks)}")
    return [Compile(n, thunks[n], backward=n == "train step") for n in names]

  def finish(self, ctx: Context, compiled: dict) -> "DistillDryRun":
    out = DistillDryRun(ctx, list(compiled.values()))
    if self.find_fixes:
      for p in out.programs:
        if not _fits(p, ctx.chip):
          fix = find_fix(ctx, p.name)
          (out.fixes if fix else out.unfixed).append(fix or p.name)
    return out


def dry_run(job: distill.DistillJob, topology: str, programs: Optional[Sequence[str]] = None,
            workers: Optional[int] = None, find_fixes: bool = True) -> "DistillDryRun":
  """``driver.dry_run`` of the distillation's programs (``DistillPrograms``)."""
  return driver.dry_run(DistillPrograms(job, programs, find_fixes), topology, workers)


def _mode_sampling(job: distill.DistillJob, mode: str) -> SamplingConfig:
  """The sampling ``generate_target_outputs`` uses for ``mode``."""
  return SamplingConfig(0.0 if mode == "greedy" else job.sample_temperature)


def _rows(part: Optional[Partitioner], device: Any, shape: Sequence[int],
          what: str) -> jax.ShapeDtypeStruct:
  """A batch-major int32 abstract array, rows over 'data'."""
  sharding = part.batch_sharding(shape, what) if part else SingleDeviceSharding(device)
  return jax.ShapeDtypeStruct(tuple(shape), jnp.int32, sharding=sharding)


def lower_generate(ctx: Context, mode: str, batch_size: Optional[int] = None) -> Any:
  """The target's generation in ``mode``, lowered, at the longest input bucket."""
  job, tp = ctx.settings, ctx.target_part
  b = batch_size or job.generate_batch_size
  params = abstract_params(ctx.target_config, tp, job.param_dtype, ctx.device)
  inputs = _rows(tp, ctx.device, (b, input_len(ctx)), "generate_batch_size (target outputs)")
  return temperature_sample.lower(T5Model(ctx.target_config), params, inputs,
                                  abstract_key(tp, ctx.device), max_decode_len=job.max_decode_len,
                                  sampling=_mode_sampling(job, mode),
                                  eos_id=ctx.target_config.eos_id, partitioner=tp)


def _bridged(job: distill.DistillJob) -> bool:
  return job.encoder_bridge or job.feature_bridge


def abstract_draft(ctx: Context) -> Any:
  """The draft's trained parameters as ``fit`` gets them (with the bridges)."""
  job = ctx.settings
  params = abstract_params(ctx.draft_config, ctx.draft_part, "float32", ctx.device)
  if not _bridged(job):
    return params
  target, draft = T5Model(ctx.target_config), T5Model(ctx.draft_config)
  wrapped = {"draft": params}
  if job.encoder_bridge:
    wrapped["bridge"] = jax.eval_shape(lambda: bridge.zeros(target, draft))
  if job.feature_bridge:
    wrapped["feature"] = jax.eval_shape(
        lambda: feature_bridge.zeros(target, draft, job.feature_staleness))
  repl = ctx.draft_part.replicated() if ctx.draft_part else SingleDeviceSharding(ctx.device)
  return {k: v if k == "draft" else placed(v, repl) for k, v in wrapped.items()}


def lower_train(ctx: Context, batch_tokens: Optional[int] = None) -> Any:
  """The draft's training step ``(params, opt_state, batch, frozen)`` lowered
  as ``fit`` runs it, at the longest bucket."""
  job, dp = ctx.settings, ctx.draft_part
  target, draft = T5Model(ctx.target_config), T5Model(ctx.draft_config)
  bridged = _bridged(job)
  cfg = distill.DistillConfig(job.divergence, job.ce_weight, 1.0, job.on_policy_fraction)
  _, opt = distill.train_optimizer(job, bridged)
  params = abstract_draft(ctx)
  repl = dp.replicated() if dp else SingleDeviceSharding(ctx.device)
  opt_state = placed(jax.eval_shape(opt.init, params), repl)
  rows = train_rows(ctx, batch_tokens)
  batch = {k: _rows(dp, ctx.device, (rows, train_len(ctx)), f"batch {k!r}")
           for k in ("inputs", "targets")}
  batch["step_key"] = abstract_key(dp, ctx.device)
  frozen = abstract_params(ctx.target_config, ctx.target_part, job.param_dtype, ctx.device)
  step = training.make_train_step(distill.distill_loss(draft, target, cfg, bridged), opt, dp)
  return step.lower(params, opt_state, batch, frozen)


def lowerers(ctx: Context) -> dict[str, Callable[[], Any]]:
  """Program name -> a thunk lowering it."""
  out: dict[str, Callable[[], Any]] = {
      f"generate ({m})": (lambda m=m: lower_generate(ctx, m)) for m in ctx.settings.modes}
  out["train step"] = lambda: lower_train(ctx)
  return out


@dataclasses.dataclass(frozen=True)
class Fix:
  """A setting that makes a program fit, found by compiling it."""

  program: str
  flag: str          # 'batch_tokens' or 'generate_batch_size'
  value: int
  compiled: Program  # the program compiled at that value
  tried: tuple       # the values compiled, in order


def _fits(p: Program, chip: Any) -> bool:
  return not p.error and p.total <= chip.hbm_bytes


def find_fix(ctx: Context, name: str) -> Optional[Fix]:
  """Halves the program's batch (at least a row per 'data' shard) and compiles
  it until one fits, at most ``MAX_HALVINGS`` times."""
  job, tried = ctx.settings, []
  if name == "train step":
    flag, value, floor = "batch_tokens", job.batch_tokens, train_len(ctx) * data_axis(ctx)
    lower = lambda v: lower_train(ctx, v)
  else:
    mode = name[len("generate ("):-1]
    flag, value, floor = "generate_batch_size", job.generate_batch_size, data_axis(ctx)
    lower = lambda v: lower_generate(ctx, mode, v)
  for _ in range(MAX_HALVINGS):
    value //= 2
    if flag == "generate_batch_size":
      value -= value % data_axis(ctx)
    if value < floor:
      return None
    tried.append(value)
    p = compile_program(name, lower(value), ctx.topology, backward=name == "train step")
    if _fits(p, ctx.chip):
      return Fix(name, flag, value, p, tuple(tried))
  return None


@dataclasses.dataclass
class DistillDryRun(DryRun):
  """The distillation's dry run: its programs and the settings that would fit."""

  fixes: list = dataclasses.field(default_factory=list)      # Fix, for programs that do not fit
  unfixed: list = dataclasses.field(default_factory=list)    # programs no halving made fit
  title: str = "Distillation dry run"
  columns: tuple = ("aliased", "total")
  name_width: int = 20

  def shown(self) -> list[tuple[Program, str]]:
    return super().shown() + [(f.compiled, f"{f.program} at --{f.flag}={f.value}")
                              for f in self.fixes]

  def settings_lines(self) -> list[str]:
    ctx, job = self.ctx, self.ctx.settings
    mesh = f"mesh (data, model) = {tuple(job.mesh_shape)}" if job.mesh_shape else "one device"
    bridges = " and ".join(b for b, on in (("encoder bridge", job.encoder_bridge),
                                           ("feature bridge", job.feature_bridge)) if on)
    return [f"target {job.target_preset or 'from config.json'} (weights {job.param_dtype}, "
            f"{gib(ctx.resident['target'])} per device), draft "
            f"{job.draft_preset or 'from config.json'} (float32, replicated, "
            f"{gib(ctx.resident['draft'])}); {mesh}; activations float32.",
            f"generation: {job.generate_batch_size} rows x input {input_len(ctx)}, decode "
            f"{job.max_decode_len}; train step: {train_rows(ctx)} rows x {train_len(ctx)} "
            f"tokens (batch_tokens {job.batch_tokens}, the longest bucket), divergence "
            f"{job.divergence}, optimizer {job.optimizer}"
            + (f", with {bridges}" if bridges else "") + "."]

  def closing_lines(self) -> list[str]:
    chip, topology = self.chip, self.ctx.topology
    if self.fits:
      return ["", f"Largest program: {gib(self.memory)} per device: the job fits "
              f"{topology} as given. Dry run took {self.wall_s:.0f} s."]
    too_big = [p.name + (" (the compiler ran out of memory)" if p.error else
                         f" ({gib(p.total)} per device)")
               for p in self.programs if not _fits(p, chip)]
    lines = ["", f"The job does NOT fit {topology} as given: " + ", ".join(too_big) + "."]
    lines += [f"  {f.program}: --{f.flag}={f.value} fits ({gib(f.compiled.total)} per "
              f"device, {100 * f.compiled.total / chip.hbm_bytes:.0f}%, compiled; tried "
              f"{', '.join(map(str, f.tried))})" for f in self.fixes]
    lines += [f"  {name}: no halving of its batch fits; shard the target over more chips "
              "(--mesh_shape) or a larger topology" for name in self.unfixed]
    if self.fixes and not self.unfixed:
      chosen: dict = {}
      for f in self.fixes:  # the generation programs share one flag: the smallest value
        chosen[f.flag] = min(f.value, chosen.get(f.flag, f.value))
      lines.append("  With " + " ".join(f"--{k}={v}" for k, v in chosen.items())
                   + " every program fits.")
    return lines + [f"Dry run took {self.wall_s:.0f} s."]
