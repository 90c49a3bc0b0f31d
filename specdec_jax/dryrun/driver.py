"""The dry-run driver: check a job (a ``ProgramList``: the runner's or
distillation's) for a TPU topology, compile its programs on abstract arrays
for libtpu's compile-only devices on any machine, and report their memory
against HBM and their collectives. Each failed check is one line.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import functools
import hashlib
import os
import pathlib
import pickle
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence, TextIO

import jax
from absl import logging
from jax.sharding import SingleDeviceSharding

from specdec_jax import checkpoints, partitioning, quantization
from specdec_jax.dryrun import hlo
from specdec_jax.dryrun.chips import Chip, topology_devices
from specdec_jax.models.t5 import T5Config, param_shapes, stored_dtype
from specdec_jax.partitioning import Partitioner, flatten_names, unflatten_names

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Compile:
  """One program a job compiles: ``lower`` gives its ``jax.stages.Lowered``."""

  name: str
  lower: Callable[[], Any]
  estimate: int = 0                  # memory.plan's bytes for what it holds resident
  options: Optional[dict] = None     # XLA compile options (the roofline's pieces)
  backward: bool = False             # a training step: weights followed through moves only
  key: Any = None                    # how the job finds it among the results (default name)


@dataclasses.dataclass
class Program:
  """One compiled program's per-device figures."""

  name: str
  estimate: int                  # memory.plan's bytes for what it holds resident
  compile_s: float = 0.0
  arguments: int = 0
  temporaries: int = 0
  outputs: int = 0
  aliased: int = 0
  code: int = 0
  weights: int = 0               # the weight arguments' bytes, logical shard shapes
  padded_arguments: int = 0      # every argument's bytes as its compiled layout pads it
  flops: float = 0.0             # XLA's cost analysis (a loop body counted once)
  bytes: float = 0.0             # its 'bytes accessed' (every memory level)
  has_loop: bool = False         # collectives are one iteration's (else the whole program's)
  ops: int = 0                   # operations one call launches (hlo.op_count; the fixed costs)
  collectives: list = dataclasses.field(default_factory=list)     # hlo.Collective
  weight_moves: list = dataclasses.field(default_factory=list)    # hlo.Collective
  weight_copies: list = dataclasses.field(default_factory=list)   # hlo.WeightCopy
  error: str = ""                # the compiler's first line when it failed
  loaded: bool = False           # its record read back from an earlier compile (compile_s 0)

  @property
  def total(self) -> int:
    """Device memory: arguments + temporaries + outputs - aliased (code apart)."""
    return self.arguments + self.temporaries + self.outputs - self.aliased

  def take_memory(self, compiled: Any) -> None:
    m = compiled.memory_analysis()
    self.arguments, self.temporaries = m.argument_size_in_bytes, m.temp_size_in_bytes
    self.outputs, self.aliased = m.output_size_in_bytes, m.alias_size_in_bytes
    self.code = m.generated_code_size_in_bytes

  def take_module(self, module: hlo.Module, backward: bool) -> None:
    params = hlo.parameters(module)
    self.padded_arguments = sum(hlo.array_bytes(i.shape, padded=True) for i in params)
    self.weights = sum(hlo.array_bytes(i.shape) for i in params if is_weight(i))
    self.has_loop = hlo.main_loop(module) is not None
    self.ops = hlo.op_count(module)
    self.collectives = (hlo.loop_collectives(module) if self.has_loop
                        else hlo.all_collectives(module))
    self.weight_moves = hlo.weight_collectives(module, is_weight, moves_only=backward)
    if not backward:
      self.weight_copies = hlo.weight_copies(module, is_weight)


def is_weight(param: hlo.Instr) -> bool:
  """An entry parameter under a 'params' tree (or a training step's 'frozen')."""
  return "params[" in param.op_name or param.op_name.startswith("frozen[")


# Compiled programs by (topology, options, program text): each compiles once.
_COMPILED: dict[str, Program] = {}
# This code's version: a record made by other code is not read back.
_CODE = hashlib.sha256(b"".join(pathlib.Path(f).read_bytes() for f in (__file__, hlo.__file__)))


def _record_path(key: str) -> Optional[str]:
  """A compiled program's record, kept beside JAX's compilation cache when one
  is set (a local folder): JAX's own entries for compile-only TPU devices
  cannot be loaded back, so a later dry run or --calibrate would compile again."""
  folder = jax.config.jax_compilation_cache_dir
  return None if not folder or "://" in folder else os.path.join(
      folder, "specdec_jax_dry_run", f"{key}.pkl")


def _load_record(path: str) -> Optional[Program]:
  try:
    with open(path, "rb") as f:
      return pickle.load(f)
  except Exception:  # none yet, or unreadable: compiled again
    return None


def _store_record(path: str, p: Program) -> None:
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.{os.getpid()}", "wb") as f:
      pickle.dump(p, f)
    os.replace(f"{path}.{os.getpid()}", path)  # readers see a whole record or none
  except OSError as e:
    logging.warning("could not keep the dry run's record of %s in %s: %s", p.name, path, e)


def compile_program(name: str, lowered: Any, topology: str = "", estimate: int = 0,
                    options: Optional[dict] = None, backward: bool = False) -> Program:
  """Compiles ``lowered`` into a ``Program``; one the compiler refuses gets
  its first line in ``error``. A program compiled before, in this process or
  (with a compilation cache set) in another, is not compiled again."""
  text = lowered.as_text()
  key = hashlib.sha256(f"{topology}\n{options}\n{backward}\n".encode()
                       + text.encode() + _CODE.digest()).hexdigest()
  record = _record_path(key)
  if key not in _COMPILED and record and (loaded := _load_record(record)) is not None:
    _COMPILED[key] = dataclasses.replace(loaded, compile_s=0.0, loaded=True)
  if key in _COMPILED:
    return dataclasses.replace(_COMPILED[key], name=name, estimate=estimate)
  p = Program(name, estimate)
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile(options) if options else lowered.compile()
  except Exception as e:  # out of memory, or a program the compiler refuses
    text = str(e).strip()
    p.error = text.splitlines()[0] if text else type(e).__name__
    p.compile_s = time.perf_counter() - t0
    return p
  p.compile_s = time.perf_counter() - t0
  p.take_memory(compiled)
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  p.flops, p.bytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
  p.take_module(hlo.parse(compiled.as_text()), backward)
  _COMPILED[key] = p
  if record:
    _store_record(record, p)
  return p


def default_workers() -> int:
  """Compiles run in this many threads (the TPU compiler releases the GIL)."""
  return max(1, min(2, os.cpu_count() or 1))


def compile_all(topology: str, specs: Sequence[Compile],
                workers: Optional[int] = None) -> list[Program]:
  """Each spec lowered here and compiled in a worker thread (lowering overlaps
  compiling), logging each as it finishes; in ``specs``' order."""
  workers = default_workers() if workers is None else max(1, workers)
  logging.info("Compiling %d program%s for %s, %d at a time: %s…", len(specs),
               "s" if len(specs) != 1 else "", topology, workers,
               ", ".join(s.name for s in specs))
  done: list[str] = []

  def one(s: Compile, lowered: Any) -> Program:
    p = compile_program(s.name, lowered, topology, s.estimate, s.options, s.backward)
    with _LOCK:
      done.append(s.name)
      logging.info("  %s: %s (%d/%d)", s.name, "NOT COMPILED" if p.error else
                   "compiled before" if p.loaded else f"{p.compile_s:.0f} s", len(done),
                   len(specs))
    return p

  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    futures = [pool.submit(one, s, s.lower()) for s in specs]
    return [f.result() for f in futures]


_LOCK = threading.Lock()   # one progress line at a time, counted in order


@functools.lru_cache(maxsize=None)
def abstract_params(cfg: T5Config, part: Optional[Partitioner], param_dtype: str,
                    device: Any, quant: Optional[str] = None) -> dict:
  """The parameter tree as sharded ShapeDtypeStructs; with ``quant`` each
  kernel is the ``QArray`` ``quantization.quantize_params`` makes."""
  one = SingleDeviceSharding(device)

  def leaf(n: str, shape: tuple) -> Any:
    if quant is None or not quantization.quantized(n):
      return jax.ShapeDtypeStruct(shape, stored_dtype(n, param_dtype),
                                  sharding=part.param_sharding(n, shape) if part else one)
    axes = partitioning.param_logical_axes(n)
    return quantization.abstract_kernel(
        shape, quant, lambda s, which: one if part is None else part.sharding(
            axes if which == "qvalue" else quantization.scale_axes(axes), s,
            f"parameter {n} {which}"))
  shapes = flatten_names(param_shapes(cfg.replace(dtype="float32")))
  return unflatten_names({n: leaf(n, x.shape) for n, x in shapes.items()})


def sharded(part: Optional[Partitioner], device: Any, axes: Sequence, shape: Sequence[int],
            dtype: Any, what: str) -> jax.ShapeDtypeStruct:
  """An abstract array over logical ``axes`` (one device without ``part``)."""
  sharding = part.sharding(axes, shape, what) if part else SingleDeviceSharding(device)
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def placed(tree: Any, sharding: Any) -> Any:
  """An abstract tree with every leaf at ``sharding``."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def abstract_key(part: Optional[Partitioner], device: Any) -> jax.ShapeDtypeStruct:
  """A PRNG key, replicated."""
  shape = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  return jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                              sharding=part.replicated() if part else SingleDeviceSharding(device))


def weight_bytes(params: Any) -> int:
  """Bytes per device of an abstract parameter tree (each leaf's shard)."""
  return sum(quantization.array_bytes(x.sharding.shard_shape(x.shape), x.dtype)
             for x in jax.tree.leaves(params))


def architecture(role: str, path: str, fmt: str, preset: Optional[str],
                 dtype: str, how: tuple[str, str]) -> T5Config:
  """A model's architecture from its preset or a local ``config.json``, no
  weight read; ``how``: (verb, prefix) naming a setting, e.g. ('pass', '--')."""
  local = bool(path) and "://" not in path and os.path.isdir(path)
  cfg = checkpoints.peek_config(path, fmt, preset, dtype) if preset or local else None
  if cfg is None:
    raise ValueError(f"the dry run reads no checkpoint, so it needs the {role}'s architecture: "
                     f"{how[0]} {how[1]}{role}_preset (e.g. 't5_1_1_xxl'), or a local "
                     f"{how[1]}{role}_checkpoint with a config.json")
  return cfg


def mesh_partitioners(mesh_shape: Optional[Sequence[int]], rules: Optional[Sequence],
                      draft_rules: Sequence, fallback: str, devices: Sequence[Any]
                      ) -> tuple[Optional[Partitioner], Optional[Partitioner]]:
  """The target's and the draft's partitioners over ``devices`` (None, None without a mesh)."""
  if mesh_shape is None:
    return None, None
  mesh = partitioning.make_mesh(mesh_shape, devices)
  return (partitioning.from_settings(mesh_shape, rules, fallback, mesh=mesh),
          partitioning.from_settings(mesh_shape, draft_rules, fallback, mesh=mesh))


@dataclasses.dataclass
class Context:
  """What ``check`` established, for the compiles."""

  topology: str
  chip: Chip
  devices: tuple
  settings: Any                   # the run's Experiment or the distillation's DistillJob
  target_config: T5Config
  draft_config: Optional[T5Config]
  target_part: Optional[Partitioner]
  draft_part: Optional[Partitioner]
  unread: list                    # (field, value) the dry run did not read
  resident: dict = dataclasses.field(default_factory=dict)  # part -> bytes per device

  @property
  def device(self) -> Any:
    return self.devices[0]

  @property
  def where(self) -> str:
    n = len(self.devices)
    return (f"--dry_run={self.topology} ({n} device{'s' if n != 1 else ''}, one per "
            f"{self.chip.device_kind} chip)")


class ProgramList(abc.ABC):
  """A job the driver checks and compiles. Checks raise one-line ``ValueError``s."""

  settings: Any

  @abc.abstractmethod
  def validate(self) -> list:
    """The settings' checks; -> the (field, value) the dry run does not read."""

  @abc.abstractmethod
  def architectures(self) -> tuple[T5Config, Optional[T5Config]]:
    """The target's and the draft's architectures (None: a draft without weights)."""

  @abc.abstractmethod
  def partitioners(self, ctx: Context) -> tuple[Optional[Partitioner], Optional[Partitioner]]:
    """The partitioners over ``ctx.devices``, every dimension checked."""

  @abc.abstractmethod
  def resident(self, ctx: Context) -> dict[str, int]:
    """What stays resident, part -> bytes per device."""

  @abc.abstractmethod
  def too_big(self, ctx: Context) -> str:
    """Why ``resident`` does not fit the chip's HBM, and what would."""

  @abc.abstractmethod
  def programs(self, ctx: Context) -> list[Compile]:
    """What to compile."""

  @abc.abstractmethod
  def finish(self, ctx: Context, compiled: dict) -> "DryRun":
    """The result, from ``compiled``: each ``Compile.key`` -> its ``Program``."""


def check(job: ProgramList, topology: str) -> Context:
  """Every check before a compile: topology, settings, architectures, mesh,
  and what stays resident against the chip's HBM."""
  chip, devices = topology_devices(topology)
  unread = job.validate()
  target, draft = job.architectures()
  ctx = Context(topology, chip, devices, job.settings, target, draft, None, None, unread)
  ctx.target_part, ctx.draft_part = job.partitioners(ctx)
  ctx.resident = job.resident(ctx)
  if sum(ctx.resident.values()) > chip.hbm_bytes:
    raise ValueError(f"{ctx.where}: {job.too_big(ctx)}")
  return ctx


@dataclasses.dataclass
class DryRun:
  """Everything a dry run found; each job's result adds its own lines."""

  ctx: Context
  programs: list = dataclasses.field(default_factory=list)   # Program
  wall_s: float = 0.0
  title: str = "Dry run"
  columns: tuple = ("total", "estimate")   # Program fields in the memory table
  name_width: int = 27

  @property
  def chip(self) -> Chip:
    return self.ctx.chip

  @property
  def num_devices(self) -> int:
    return len(self.ctx.devices)

  @property
  def memory(self) -> int:
    return max((p.total for p in self.programs if not p.error), default=0)

  @property
  def fits(self) -> bool:
    return all(not p.error for p in self.programs) and self.memory <= self.chip.hbm_bytes

  def shown(self) -> list[tuple[Program, str]]:
    """(program, label) whose collectives the report lists."""
    return [(p, p.name) for p in self.programs if not p.error]

  def settings_lines(self) -> list[str]:
    return []

  def table_note(self) -> str:
    return f"total = arguments + temporaries + outputs - aliased, against " \
        f"{self.chip.hbm_bytes / GiB:.0f} GiB"

  def code_note(self) -> str:
    return ""

  def closing_lines(self) -> list[str]:
    return []

  def summary_lines(self) -> list[str]:
    return []


def dry_run(job: ProgramList, topology: str, workers: Optional[int] = None) -> DryRun:
  """Checks ``job`` for ``topology`` and compiles its programs -> the job's result."""
  t0 = time.perf_counter()
  ctx = check(job, topology)
  specs = job.programs(ctx)
  compiled = compile_all(topology, specs, workers)
  out = job.finish(ctx, {s.name if s.key is None else s.key: p
                         for s, p in zip(specs, compiled)})
  out.wall_s = time.perf_counter() - t0
  return out


def gib(n: float) -> str:
  """Bytes as GiB (MiB below a tenth of one: tiny test models)."""
  return f"{n / GiB:.2f} GiB" if n >= GiB / 10 or n == 0 else f"{n / 2 ** 20:.2f} MiB"


def size(n: float) -> str:
  """Bytes in decimal units (collectives' payloads)."""
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if n >= scale:
      return f"{n / scale:.3g} {unit}"
  return f"{int(n)} B"


def program_lines(programs: Sequence[Program], chip: Chip, name_width: int,
                  tail: Sequence[str]) -> list[str]:
  """A header and one line per program: its memory, the fields named in
  ``tail``, and whether ``total`` fits the chip's HBM."""
  lines = [f"  {'program':{name_width}s} {'compile':>8s} {'arguments':>11s} "
           f"{'temporaries':>12s} {'outputs':>10s}" + "".join(f" {c:>10s}" for c in tail)
           + "  fits"]
  for p in programs:
    if p.error:
      lines.append(f"  {p.name:{name_width}s} {p.compile_s:7.0f}s  NOT COMPILED: {p.error}")
      continue
    fits = "yes" if p.total <= chip.hbm_bytes else "NO"
    lines.append(f"  {p.name:{name_width}s} {p.compile_s:7.0f}s {gib(p.arguments):>11s} "
                 f"{gib(p.temporaries):>12s} {gib(p.outputs):>10s}"
                 + "".join(f" {gib(getattr(p, c)):>10s}" for c in tail)
                 + f"  {fits} ({100 * p.total / chip.hbm_bytes:.0f}%)")
  return lines


def collective_lines(p: Program, label: str) -> list[str]:
  """``p``'s collectives (per loop iteration) grouped, its weight copies and moves."""
  groups: dict = {}
  for c in p.collectives:
    key = (c.where, c.kind, c.shape, c.nbytes)
    groups[key] = groups.get(key, 0) + 1
  per = "one iteration of the" if p.has_loop else "the"
  lines = [f"Collectives in {per} {label} ({len(p.collectives)}, "
           f"{size(sum(c.nbytes for c in p.collectives))} per device)"
           + (":" if groups else ": none (no data passes between devices)")]
  lines += [f"  {n:4d} x {kind} {shape} ({size(nb)} each)" + (f" [{w}]" if w else "")
            for (w, kind, shape, nb), n in sorted(groups.items())]
  for in_loop, when in ((False, "once per call, held for the loop"),
                        (True, "INSIDE the loop, every iteration")):
    held = [c for c in p.weight_copies if c.in_loop == in_loop]
    if held:
      lines.append(f"  {len(held)} weights copied whole into another memory layout or dtype "
                   "(XLA rewrites a weight in HBM, e.g. transposed for a product or "
                   f"converted to the activations' dtype), {size(sum(c.nbytes for c in held))} "
                   f"per device, {when}")
  if p.weight_moves:
    m = p.weight_moves[0]
    lines.append(f"  ERROR: {len(p.weight_moves)} collective(s) move a weight, e.g. "
                 f"{m.kind} {m.shape} ({m.op_name})")
  else:
    lines.append("  no collective moves a weight")
  return lines


def format_report(r: DryRun) -> str:
  """The dry run's full account as text (``--verbose``)."""
  ctx, chip = r.ctx, r.chip
  devices = f"{r.num_devices} device" + ("s" if r.num_devices != 1 else "")
  lines = [f"{r.title} for {ctx.topology}: {devices}, one per {chip.label} chip "
           f"({chip.device_kind}"
           + (", megacore: 2 TensorCores as one device" if chip.tensorcores == 2 else "")
           + f"), {chip.hbm_bytes / GiB:.0f} GiB HBM each. Nothing was read: "
           + ", ".join(f"{f} {v!r}" if v else f"{f} (unset)" for f, v in ctx.unread) + "."]
  lines += r.settings_lines()
  lines += ["", f"Compiled programs, per device (XLA's memory analysis of the {chip.label} "
            f"executable; {r.table_note()}):"]
  lines += program_lines(r.programs, chip, r.name_width, r.columns)
  code = max((p.code for p in r.programs if not p.error), default=0)
  lines += [f"  ({r.code_note()}the programs' code, up to {gib(code)}, is not in the totals)", ""]
  for p, label in r.shown():
    lines += collective_lines(p, label)
  lines += r.closing_lines()
  return "\n".join(lines)


def summary_report(r: DryRun) -> str:
  """The dry run in a few plain sentences: largest program against HBM, what
  does not fit or compile, weight moves, the job's own lines."""
  ctx, chip = r.ctx, r.chip
  hbm = f"{chip.hbm_bytes / GiB:.0f} GiB"
  chips = f"{r.num_devices} {chip.label} chip" + ("s" if r.num_devices != 1 else "")
  lines = [f"{r.title} for {ctx.topology} ({chips}, {hbm} of memory each): "
           f"{len(r.programs)} programs compiled in {r.wall_s:.0f} s; no weight or data was "
           "read."]
  done = [p for p in r.programs if not p.error]
  over = [p for p in done if p.total > chip.hbm_bytes]
  if done:
    big = max(done, key=lambda p: p.total)
    share = big.total / chip.hbm_bytes
    lines.append(f"Memory: the largest program, the {big.name}, needs {gib(big.total)} per "
                 f"chip, {f'{100 * share:.0f}%' if share >= 0.01 else 'under 1%'} of its {hbm}"
                 + (": it fits." if not over else "."))
  lines += [f"Does NOT fit: the {p.name} needs {gib(p.total)} per chip, more than its {hbm}."
            for p in over]
  lines += [f"Did not compile: the {p.name} ({p.error})." for p in r.programs if p.error]
  moved = [p.name for p, _ in r.shown() if p.weight_moves]
  if moved:
    lines.append(f"ERROR: the {', '.join(moved)} move(s) weights between chips at run time.")
  lines += r.summary_lines()
  lines.append("The full account (each program's memory, collectives, the cost model's "
               "pieces): add --verbose.")
  return "\n".join(lines)


def main(job: ProgramList, topology: str, out: Optional[TextIO] = None,
         full: bool = True) -> DryRun:
  """``--dry_run``: prints the report (``full`` or summary); a collective that
  moves a weight is a ``ValueError`` after it."""
  r = dry_run(job, topology)
  out = out or sys.stdout
  print(format_report(r) if full else summary_report(r), file=out)
  out.flush()
  moved = list(dict.fromkeys(p.name for p, _ in r.shown() if p.weight_moves))
  if moved:
    raise ValueError(f"--dry_run={topology}: the {', '.join(moved)} move(s) weights between "
                     "devices at run time (see the collectives above); check the logical "
                     "axis rules")
  return r
