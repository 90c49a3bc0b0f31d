r"""The distillation's TPU dry run: compile a ``DistillJob``'s programs for a
TPU topology on any machine.

  python scripts/distill_draft.py --target_preset=t5_1_1_xxl ... --dry_run=v4:2x2x1

validates the job, then lowers and compiles, for the topology's devices
(libtpu's compile-only devices, ``run.chips``) and on abstract arrays
(``jax.ShapeDtypeStruct`` with the shardings the job would place them in),
the programs distillation runs for hours:

* **generate (MODE)**: the target generating its training outputs
  (``decoding.temperature_sample``, as ``distill.generate_target_outputs``
  calls it): ``generate_batch_size`` rows split over 'data', at the longest
  input bucket (``max_input_len``), the target's weights in their shards at
  ``param_dtype``; one program per output mode ('greedy' at temperature 0,
  'sample' at ``sample_temperature``; the held-out outputs are greedy, the
  same program).
* **train step**: the draft's training step (``training.make_train_step``
  over ``distill.distill_loss``, with the job's optimizer): the draft and
  its optimizer state replicated in float32, the batch's rows split over
  'data' (``training.batch_rows`` at the longest bucket, the largest
  activations a step has), the target's weights an argument in their
  shards. Bridges the job adds (``encoder_bridge``, ``feature_bridge``) are
  in it; a bridge already stored beside the draft is not read, so pass the
  flag to include it.

No weight, vocabulary or example is read and nothing is written or
downloaded: the architectures come from ``target_preset`` / ``draft_preset``
(or a local checkpoint's ``config.json``), the checkpoint and data paths
need not exist here.

Each program is reported per device from the compiled executable's memory
analysis (arguments + temporaries + outputs, less outputs that reuse a donated
argument's buffer) against the chip's HBM, with the collectives it runs
(generation: one iteration of its loop; the train step: the whole step) and
any collective whose operand is a weight, the target's or the draft's
(``weight_moves``), which is an error. When a program does not fit,
the dry run looks for settings that would: a smaller ``batch_tokens``
(train step) or ``generate_batch_size`` (generation), the first halving whose
compile fits; ``format_report`` prints what it found.

Bad input is one line (``ValueError``) before any compile: an unknown
topology, settings ``DistillJob.validate`` refuses, an architecture the dry
run cannot know without reading, a draft whose vocabulary differs from the
target's, a mesh the topology's device count does not match, a dimension the
mesh does not divide, and weights that alone exceed the chip's HBM (with the
mesh that would hold them, where one would).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import re
import sys
import time
from typing import Any, Callable, Optional, Sequence, TextIO

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from specdec_jax import checkpoints, distill, partitioning, storage, training
from specdec_jax.decoding import temperature_sample
from specdec_jax.drafts import bridge, feature_bridge
from specdec_jax.models.t5 import T5Config, T5Model
from specdec_jax.partitioning import Partitioner
from specdec_jax.run import hlo
from specdec_jax.run.chips import Chip, topology_devices
from specdec_jax.run.dryrun import (CompiledVerdict, GiB, Program, abstract_params,
                                   default_workers, gib, program_header, program_lines, size)
from specdec_jax.sampling import SamplingConfig

# The job's fields naming what a run reads; the dry run reads none of them.
READ_FIELDS = ("target_checkpoint", "draft_checkpoint", "vocab_path", "source", "eval_source")
# At most this many halvings are compiled when looking for settings that fit.
MAX_HALVINGS = 4


# ------------------------------------------------------------------ checks


@dataclasses.dataclass
class Context:
  """What ``check`` established, for the compiles."""

  job: distill.DistillJob
  topology: str
  chip: Chip
  devices: tuple
  target_config: T5Config
  draft_config: T5Config          # grown, where the job grows it
  target_part: Optional[Partitioner]
  draft_part: Optional[Partitioner]
  unread: list                    # (field, value) the dry run did not read
  input_len: int                  # generation's longest input bucket
  train_len: int                  # the train step's longest bucket
  weights: dict                   # 'target' / 'draft' -> weight bytes per device

  @property
  def device(self) -> Any:
    return self.devices[0]

  @property
  def data_axis(self) -> int:
    return 1 if self.job.mesh_shape is None else self.job.mesh_shape[0]

  def train_rows(self, batch_tokens: Optional[int] = None) -> int:
    """Rows of a train batch at ``train_len`` (``training.batch_rows``)."""
    return training.batch_rows(self.train_len, batch_tokens or self.job.batch_tokens,
                               self.data_axis)


def architecture(role: str, path: str, fmt: str, preset: Optional[str]) -> T5Config:
  """A model's architecture without reading anything remote and no weight:
  its preset, else a local checkpoint's ``config.json``; activations float32,
  as distillation runs them. One line if neither says."""
  local = bool(path) and not storage.is_gcs(path) and "://" not in path \
      and os.path.isdir(path)
  cfg = checkpoints.peek_config(path, fmt, preset) if preset or local else None
  if cfg is None:
    raise ValueError(f"the dry run reads no checkpoint, so it needs the {role}'s architecture: "
                     f"pass --{role}_preset (DistillJob.{role}_preset, e.g. 't5_1_1_xxl'), or "
                     f"a local --{role}_checkpoint with a config.json")
  return cfg


def weight_bytes(params: Any) -> int:
  """Bytes per device of an abstract parameter tree: each leaf's shard shape
  (``sharding.shard_shape``) at its dtype."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(params))


def _partitioners(job: distill.DistillJob, target: T5Config, devices: Sequence[Any],
                  where: str) -> tuple[Optional[Partitioner], Optional[Partitioner]]:
  """The target's and the draft's partitioners over the topology's devices,
  as ``distill.partitioners`` builds them over the machine's; a mesh of
  another size names the one that holds the target in the fewest bytes."""
  if job.mesh_shape is None:
    return None, None
  try:
    mesh = partitioning.make_mesh(job.mesh_shape, devices)
  except partitioning.PartitioningError as e:
    best = _meshes_holding(target, job, devices, math.inf)
    hint = (f"; for this target, --mesh_shape={','.join(map(str, best[0][0]))} holds the "
            "fewest weight bytes per device" if best else "")
    raise ValueError(f"{where}: DistillJob.mesh_shape: {e}{hint}") from None
  return (partitioning.from_settings(job.mesh_shape, job.logical_axis_rules,
                                     job.partition_fallback, mesh=mesh),
          partitioning.from_settings(job.mesh_shape, partitioning.DATA_PARALLEL_RULES,
                                     job.partition_fallback, mesh=mesh))


def _meshes_holding(cfg: T5Config, job: distill.DistillJob, devices: Sequence[Any],
                    room: float) -> list[tuple[tuple[int, int], int]]:
  """(mesh shape, target weight bytes per device) for every (data, model)
  mesh over ``devices`` that shards the target and leaves its weights within
  ``room`` bytes, fewest bytes first."""
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
      need = weight_bytes(abstract_params(cfg, part, job.param_dtype, devices[0]))
    except partitioning.PartitioningError:
      continue
    if need <= room:
      out.append((shape, need))
  return sorted(out, key=lambda x: (x[1], x[0]))


def check(job: distill.DistillJob, topology: str) -> Context:
  """Every check before a compile, each failure one line (``ValueError``):
  the topology, the job's settings (``DistillJob.validate`` without its path
  checks: nothing is read), the architectures and their vocabularies, the
  mesh against the topology's devices, every dimension the mesh must divide,
  and the weights (the target's at ``param_dtype``, the draft's float32 copy)
  against the chip's HBM."""
  chip, devices = topology_devices(topology)
  job.validate(check_paths=False)
  target_cfg = architecture("target", job.target_checkpoint, job.target_format,
                            job.target_preset)
  draft_cfg = architecture("draft", job.draft_checkpoint, job.draft_format, job.draft_preset)
  distill.check_vocabularies(target_cfg, draft_cfg, job)
  draft_cfg = draft_cfg.replace(
      num_encoder_layers=draft_cfg.num_encoder_layers + job.grow_encoder_layers,
      num_decoder_layers=draft_cfg.num_decoder_layers + job.grow_decoder_layers)
  where = f"--dry_run={topology} ({len(devices)} devices, one per {chip.device_kind} chip)"
  target_part, draft_part = _partitioners(job, target_cfg, devices, where)
  weights = {}
  for role, cfg, part, dtype in (("target", target_cfg, target_part, job.param_dtype),
                                 ("draft", draft_cfg, draft_part, "float32")):
    try:
      weights[role] = weight_bytes(abstract_params(cfg, part, dtype, devices[0]))
    except partitioning.PartitioningError as e:
      raise ValueError(f"{where}: mesh_shape={tuple(job.mesh_shape)} cannot shard the {role} "
                       f"({getattr(job, role + '_checkpoint')}): {e}") from None
  if sum(weights.values()) > chip.hbm_bytes:
    mesh = f"mesh_shape={tuple(job.mesh_shape)}" if job.mesh_shape else "one device"
    room = chip.hbm_bytes - weights["draft"]
    holding = _meshes_holding(target_cfg, job, devices, room)
    hint = (f"--mesh_shape={','.join(map(str, holding[0][0]))} holds the target in "
            f"{holding[0][1] / GiB:.2f} GiB per device" if holding else
            "no (data, model) mesh of this topology holds it: use more chips")
    raise ValueError(f"{where}: the weights alone do not fit on {mesh}: the target's need "
                     f"{weights['target'] / GiB:.2f} GiB per device at param_dtype="
                     f"{job.param_dtype} and the draft's float32 copy "
                     f"{weights['draft'] / GiB:.2f} GiB, but a {chip.label} chip has "
                     f"{chip.hbm_bytes / GiB:.0f} GiB of HBM; {hint}")
  unread = [(f, getattr(job, f)) for f in READ_FIELDS if getattr(job, f)]
  buckets = training.buckets_upto(max(job.max_input_len, job.max_decode_len))  # as run_job
  return Context(job, topology, chip, devices, target_cfg, draft_cfg, target_part, draft_part,
                 unread, training.bucket_len(job.max_input_len, buckets), buckets[-1], weights)


# ------------------------------------------------------------ the programs


def _sharded(part: Optional[Partitioner], device: Any, shape: Sequence[int], dtype: Any,
             what: str) -> jax.ShapeDtypeStruct:
  """A batch-major abstract array, rows over 'data' (``Partitioner.batch_sharding``)."""
  sharding = part.batch_sharding(shape, what) if part else SingleDeviceSharding(device)
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _placed(tree: Any, sharding: Any) -> Any:
  """An abstract tree with every leaf at ``sharding``."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _key(part: Optional[Partitioner], device: Any) -> jax.ShapeDtypeStruct:
  shape = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  return jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                              sharding=part.replicated() if part else SingleDeviceSharding(device))


def _mode_sampling(job: distill.DistillJob, mode: str) -> SamplingConfig:
  """The sampling ``generate_target_outputs`` uses for ``mode``."""
  return SamplingConfig(0.0 if mode == "greedy" else job.sample_temperature)


def lower_generate(ctx: Context, mode: str, batch_size: Optional[int] = None) -> Any:
  """The target's generation of its outputs in ``mode``, lowered: ``batch_size``
  (default ``generate_batch_size``) rows at the longest input bucket."""
  job, tp = ctx.job, ctx.target_part
  b = batch_size or job.generate_batch_size
  params = abstract_params(ctx.target_config, tp, job.param_dtype, ctx.device)
  inputs = _sharded(tp, ctx.device, (b, ctx.input_len), jnp.int32,
                    "generate_batch_size (target outputs)")
  return temperature_sample.lower(T5Model(ctx.target_config), params, inputs,
                                  _key(tp, ctx.device), max_decode_len=job.max_decode_len,
                                  sampling=_mode_sampling(job, mode),
                                  eos_id=ctx.target_config.eos_id, partitioner=tp)


def _bridged(job: distill.DistillJob) -> bool:
  return job.encoder_bridge or job.feature_bridge


def abstract_draft(ctx: Context) -> Any:
  """The draft's trained parameters as ``run_job`` hands them to ``fit``:
  float32, replicated; wrapped with the bridges the job adds."""
  params = abstract_params(ctx.draft_config, ctx.draft_part, "float32", ctx.device)
  if not _bridged(ctx.job):
    return params
  target, draft = T5Model(ctx.target_config), T5Model(ctx.draft_config)
  wrapped = {"draft": params}
  if ctx.job.encoder_bridge:
    wrapped["bridge"] = jax.eval_shape(lambda: bridge.zeros(target, draft))
  if ctx.job.feature_bridge:
    wrapped["feature"] = jax.eval_shape(
        lambda: feature_bridge.zeros(target, draft, ctx.job.feature_staleness))
  repl = ctx.draft_part.replicated() if ctx.draft_part else SingleDeviceSharding(ctx.device)
  return {k: v if k == "draft" else _placed(v, repl) for k, v in wrapped.items()}


def lower_train(ctx: Context, batch_tokens: Optional[int] = None) -> Any:
  """The draft's training step, lowered as ``fit`` runs it: ``(params,
  opt_state, batch, frozen)`` with the target's weights as ``frozen``, at the
  longest bucket with ``training.batch_rows`` rows (``batch_tokens``:
  default the job's)."""
  job, dp = ctx.job, ctx.draft_part
  target, draft = T5Model(ctx.target_config), T5Model(ctx.draft_config)
  bridged = _bridged(job)
  cfg = distill.DistillConfig(job.divergence, job.ce_weight, 1.0, job.on_policy_fraction)
  _, opt = distill.train_optimizer(job, bridged)
  params = abstract_draft(ctx)
  repl = dp.replicated() if dp else SingleDeviceSharding(ctx.device)
  opt_state = _placed(jax.eval_shape(opt.init, params), repl)
  rows = ctx.train_rows(batch_tokens)
  batch = {k: _sharded(dp, ctx.device, (rows, ctx.train_len), jnp.int32, f"batch {k!r}")
           for k in ("inputs", "targets")}
  batch["step_key"] = _key(dp, ctx.device)
  frozen = abstract_params(ctx.target_config, ctx.target_part, job.param_dtype, ctx.device)
  step = training.make_train_step(distill.distill_loss(draft, target, cfg, bridged), opt, dp)
  return step.lower(params, opt_state, batch, frozen)


def lowerers(ctx: Context) -> dict[str, Callable[[], Any]]:
  """Program name -> a thunk lowering it: 'generate (MODE)' for each of the
  job's output modes, and 'train step'."""
  out: dict[str, Callable[[], Any]] = {
      f"generate ({m})": (lambda m=m: lower_generate(ctx, m)) for m in ctx.job.modes}
  out["train step"] = lambda: lower_train(ctx)
  return out


def is_weight(param: hlo.Instr) -> bool:
  """An entry parameter holding a weight: the target's ('params' in the
  generation loop, 'frozen' in the train step) or the draft's ('params')."""
  return param.op_name.startswith(("params[", "frozen["))


class MovedWeights(hlo.WeightFlow):
  """``hlo.WeightFlow`` for programs with a backward pass: a fusion passes a
  weight on only if every op in it moves, slices or converts (no arithmetic).
  The base class also follows fusions that only compute elementwise, which in
  a gradient includes an activation-sized product with a broadcast weight
  (an RMS-norm scale times the incoming gradient): a new value, not the
  weight, and moving it is not moving a weight."""

  MOVE_OPS = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "copy",
                        "reshape", "transpose", "convert", "bitcast-convert", "slice",
                        "dynamic-slice"})

  def _fused_only_moves(self, comp: str) -> bool:
    return comp in self.module.computations and all(
        i.opcode in self.MOVE_OPS for i in self.module.instrs(comp))


def weight_moves(module: hlo.Module) -> list[hlo.Collective]:
  """Every collective whose operand is a weight (``is_weight``) or a piece,
  copy or conversion of one (``MovedWeights``): weights moved between
  devices at run time."""
  flow = MovedWeights(module, is_weight)
  return [c for comp in module.computations for ins in module.instrs(comp)
          for c in _collective(ins, comp)
          if any(flow.derived(comp, o) for o in ins.operands)]


def _collective(ins: hlo.Instr, where: str) -> list[hlo.Collective]:
  """[the collective ``ins`` is] or []."""
  kind = ins.opcode.removesuffix("-start")
  if kind not in hlo.COLLECTIVES:
    return []
  return [hlo.Collective(kind, re.sub(r"\{[^}]*\}", "", ins.shape), hlo.array_bytes(ins.shape),
                         where, ins.op_name)]


def all_collectives(module: hlo.Module) -> list[hlo.Collective]:
  """Every collective of a program without a decoding loop (the train step),
  each computation's once."""
  return [c for comp in module.computations for ins in module.instrs(comp)
          for c in _collective(ins, "")]


def compile_program(name: str, lowered: Any) -> Program:
  """Compiles ``lowered`` into a ``dryrun.Program``: the executable's memory
  analysis, its weight arguments' bytes, its collectives (one loop iteration
  when it has a loop, else all) and those that move a weight (``weight_moves``). A program the
  compiler refuses (e.g. out of memory) gets the compiler's first line in
  ``error``."""
  p = Program(name, 0)
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:  # out of memory, or a program the compiler refuses
    text = str(e).strip()
    p.error = text.splitlines()[0] if text else type(e).__name__
    p.compile_s = time.perf_counter() - t0
    return p
  p.compile_s = time.perf_counter() - t0
  p.take_memory(compiled)
  module = hlo.parse(compiled.as_text())
  params = hlo.parameters(module)
  p.padded_arguments = sum(hlo.array_bytes(i.shape, padded=True) for i in params)
  p.weights = sum(hlo.array_bytes(i.shape) for i in params if is_weight(i))
  p.collectives = (hlo.loop_collectives(module) if hlo.main_loop(module) is not None
                   else all_collectives(module))
  p.weight_moves = weight_moves(module)
  return p


# ------------------------------------------------------------------ results


@dataclasses.dataclass(frozen=True)
class Fix:
  """A setting that makes a program fit, found by compiling it."""

  program: str
  flag: str          # 'batch_tokens' or 'generate_batch_size'
  value: int
  compiled: Program  # the program compiled at that value
  tried: tuple       # the values compiled, in order


@dataclasses.dataclass
class DistillDryRun(CompiledVerdict):
  """Everything a distillation dry run found (``format_report`` prints it)."""

  ctx: Context
  programs: list = dataclasses.field(default_factory=list)   # dryrun.Program
  fixes: list = dataclasses.field(default_factory=list)      # Fix, for programs that do not fit
  unfixed: list = dataclasses.field(default_factory=list)    # programs no halving made fit
  wall_s: float = 0.0

  @property
  def chip(self) -> Chip:
    return self.ctx.chip



def _fits(p: Program, chip: Chip) -> bool:
  return not p.error and p.total <= chip.hbm_bytes


def _find_fix(ctx: Context, name: str) -> Optional[Fix]:
  """Halves the program's batch (``batch_tokens`` for the train step, keeping
  at least one row per 'data' shard; ``generate_batch_size`` for generation,
  a multiple of 'data') and compiles each until one fits, at most
  ``MAX_HALVINGS`` times."""
  job, tried = ctx.job, []
  if name == "train step":
    flag, value, floor = "batch_tokens", job.batch_tokens, ctx.train_len * ctx.data_axis
    lower = lambda v: lower_train(ctx, v)
  else:
    mode = name[len("generate ("):-1]
    flag, value, floor = "generate_batch_size", job.generate_batch_size, ctx.data_axis
    lower = lambda v: lower_generate(ctx, mode, v)
  for _ in range(MAX_HALVINGS):
    value //= 2
    if flag == "generate_batch_size":
      value -= value % ctx.data_axis
    if value < floor:
      return None
    tried.append(value)
    p = compile_program(name, lower(value))
    if _fits(p, ctx.chip):
      return Fix(name, flag, value, p, tuple(tried))
  return None


def dry_run(job: distill.DistillJob, topology: str, programs: Optional[Sequence[str]] = None,
            workers: Optional[int] = None, find_fixes: bool = True) -> DistillDryRun:
  """Checks ``job`` for ``topology`` (``check``), compiles its programs
  (``programs``: a subset of ``lowerers``' names, default all) in ``workers``
  threads and, with ``find_fixes``, looks for a setting that makes each one
  that does not fit fit (``_find_fix``). Raises ``ValueError`` (one line)
  for bad input, before any compile; a program the compiler refuses is
  reported in its ``Program.error``."""
  t0 = time.perf_counter()
  ctx = check(job, topology)
  thunks = lowerers(ctx)
  names = list(thunks) if programs is None else list(programs)
  unknown = [n for n in names if n not in thunks]
  if unknown:
    raise ValueError(f"unknown program(s) {unknown}; this job's: {list(thunks)}")
  workers = default_workers() if workers is None else max(1, workers)
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # the compiler releases the GIL
    futures = [pool.submit(compile_program, n, thunks[n]()) for n in names]
    compiled = [f.result() for f in futures]
  out = DistillDryRun(ctx, compiled)
  if find_fixes:
    for p in compiled:
      if not _fits(p, ctx.chip):
        fix = _find_fix(ctx, p.name)
        (out.fixes if fix else out.unfixed).append(fix or p.name)
  out.wall_s = time.perf_counter() - t0
  return out


# ------------------------------------------------------------------ report


def format_report(r: DistillDryRun) -> str:
  """The dry run as text: the setup, each program's memory per device against
  the chip's HBM, its collectives, and the settings that would fit."""
  ctx, chip, job = r.ctx, r.chip, r.ctx.job
  mesh = f"mesh (data, model) = {tuple(job.mesh_shape)}" if job.mesh_shape else "one device"
  lines = [f"Distillation dry run for {ctx.topology}: {len(ctx.devices)} devices, one per "
           f"{chip.label} chip ({chip.device_kind}"
           + (", megacore: 2 TensorCores as one device" if chip.tensorcores == 2 else "")
           + f"), {chip.hbm_bytes / GiB:.0f} GiB HBM each. Nothing was read: "
           + ", ".join(f"{f} {v!r}" for f, v in ctx.unread) + ".",
           f"target {job.target_preset or 'from config.json'} (weights {job.param_dtype}, "
           f"{gib(ctx.weights['target'])} per device), draft "
           f"{job.draft_preset or 'from config.json'} (float32, replicated, "
           f"{gib(ctx.weights['draft'])}); {mesh}; activations float32.",
           f"generation: {job.generate_batch_size} rows x input {ctx.input_len}, decode "
           f"{job.max_decode_len}; train step: {ctx.train_rows()} rows x {ctx.train_len} tokens "
           f"(batch_tokens {job.batch_tokens}, the longest bucket), divergence "
           f"{job.divergence}, optimizer {job.optimizer}"
           + (", with " + " and ".join(b for b, on in (("encoder bridge", job.encoder_bridge),
                                                       ("feature bridge", job.feature_bridge))
                                       if on) if _bridged(job) else "") + ".",
           "", f"Compiled programs, per device (XLA's memory analysis of the {chip.label} "
           "executable; total = arguments + temporaries + outputs - aliased, against "
           f"{chip.hbm_bytes / GiB:.0f} GiB):",
           program_header(20, ("aliased", "total"))]
  lines += program_lines(r.programs, chip, 20, ("aliased", "total"))
  code = max((p.code for p in r.programs if not p.error), default=0)
  lines += [f"  (the programs' code, up to {gib(code)}, is not in the totals)", ""]
  shown = [(p, p.name) for p in r.programs if not p.error] + [
      (f.compiled, f"{f.program} at --{f.flag}={f.value}") for f in r.fixes]
  for p, label in shown:
    per = "one iteration of the" if "generate" in p.name else "the"
    total = sum(c.nbytes for c in p.collectives)
    groups: dict = {}
    for c in p.collectives:
      key = (c.where, c.kind, c.shape, c.nbytes)
      groups[key] = groups.get(key, 0) + 1
    lines.append(f"Collectives in {per} {label} ({len(p.collectives)}, {size(total)} per "
                 "device)" + (":" if groups else ": none"))
    lines += [f"  {n:4d} x {kind} {shape} ({size(nb)} each)" + (f" [{w}]" if w else "")
              for (w, kind, shape, nb), n in sorted(groups.items())]
    if p.weight_moves:
      lines.append(f"  ERROR: {len(p.weight_moves)} collective(s) move a weight, e.g. "
                   f"{p.weight_moves[0].kind} {p.weight_moves[0].shape} "
                   f"({p.weight_moves[0].op_name})")
    else:
      lines.append("  no collective moves a weight")
  lines.append("")
  if r.fits:
    lines.append(f"Largest program: {gib(r.memory)} per device: the job fits "
                 f"{ctx.topology} as given. Dry run took {r.wall_s:.0f} s.")
    return "\n".join(lines)
  too_big = [p.name + (" (the compiler ran out of memory)" if p.error else
                        f" ({gib(p.total)} per device)")
             for p in r.programs if not _fits(p, chip)]
  lines.append(f"The job does NOT fit {ctx.topology} as given: " + ", ".join(too_big) + ".")
  for f in r.fixes:
    lines.append(f"  {f.program}: --{f.flag}={f.value} fits ({gib(f.compiled.total)} per "
                 f"device, {100 * f.compiled.total / chip.hbm_bytes:.0f}%, compiled; tried "
                 f"{', '.join(map(str, f.tried))})")
  for name in r.unfixed:
    lines.append(f"  {name}: no halving of its batch fits; shard the target over more "
                 "chips (--mesh_shape) or a larger topology")
  if r.fixes and not r.unfixed:
    chosen: dict = {}
    for f in r.fixes:  # the generation programs share one flag: the smallest value
      chosen[f.flag] = min(f.value, chosen.get(f.flag, f.value))
    lines.append("  With " + " ".join(f"--{k}={v}" for k, v in chosen.items())
                 + " every program fits.")
  lines.append(f"Dry run took {r.wall_s:.0f} s.")
  return "\n".join(lines)


def main(job: distill.DistillJob, topology: str, out: Optional[TextIO] = None) -> DistillDryRun:
  """``scripts/distill_draft.py --dry_run``: runs ``dry_run`` and prints the
  report; a collective that moves a weight is then an error (``ValueError``)."""
  r = dry_run(job, topology)
  out = out or sys.stdout
  print(format_report(r), file=out)
  out.flush()
  moved = sorted({p.name for p in r.programs + [f.compiled for f in r.fixes] if p.weight_moves})
  if moved:
    raise ValueError(f"--dry_run={topology}: the {', '.join(moved)} move(s) weights between "
                     "devices at run time (see the collectives above); check the logical "
                     "axis rules")
  return r
