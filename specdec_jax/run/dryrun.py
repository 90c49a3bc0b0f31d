r"""The TPU dry run: compile a run's programs for a TPU topology on any machine.

  python -m specdec_jax.run --config=configs/table2/ende_small_t0.gin \
      --config=configs/tpu_v5e_8.gin --dry_run=v5e:2x4

builds the experiment's settings, validates them, and lowers and compiles for
the topology's devices (libtpu's compile-only devices, ``run.chips``) the
programs the run would execute, on abstract arrays: ``jax.ShapeDtypeStruct``
with the shardings of the experiment's ``Partitioner`` (its mesh and logical
axis rules), parameter shapes from ``models.t5.param_shapes`` at the
configured ``param_dtype`` (``stored_dtype``). No weight, vocabulary or
example is read; the checkpoint paths need not exist here.

Programs (speculative mode): the baseline loop (``decoding.temperature_sample``),
the speculative loop at its γ (``decoding.speculative_decode``; under adaptive
decoding one program holding every compiled verification width) and the draft
(its init and one round of γ proposals). ``--alpha_only``: the target's
generation (the baseline loop) and the α pass (``autogamma.min_pq_along``,
paper §4.2). Each is reported per device, from the compiled executable:

* memory (arguments, temporaries, outputs) beside ``memory.plan``'s estimate,
  and whether it fits the chip's HBM;
* the collectives one loop iteration runs, with their sizes; a collective
  whose operand is a weight (``hlo.weight_collectives``) is an error.

Then a roofline model (speculative mode), which is a model, not a
measurement: one target pass over k = 1 .. γ+1 positions and one draft step,
each compiled on its own (``decode`` with the loop's cache length), priced as
max(flops / peak, bytes accessed / HBM bandwidth) with the chip's published
figures (``chips.CHIPS``). So c = draft step / target step (Definition 3.7),
v(k) = pass over k positions / one-position pass, and Theorem 3.8's speedup
at the paper's α for the row (its Table 3) and γ, printed beside the paper's
measured speedup (Table 2) and its c (Table 4). Collective and launch
latencies are not priced.

The roofline pieces are compiled with XLA's ``exec_time_optimization_effort``
= -1, at decoder depths 1 and 2, and extrapolated linearly to the model's
depth (the layers are identical, so flops and bytes are affine in the depth;
``tests/test_dry_run.py`` checks this against a full-depth compile). At that
effort the TPU compiler does not stage weights through on-chip VMEM, so
'bytes accessed' counts HBM traffic. The loops are compiled at the default
effort, exactly as the run compiles them; there XLA's 'bytes accessed' also
counts each weight's staging copies through VMEM (read, write, read again),
which is not HBM traffic. Each device must read at least its shard of the
decoder and output-layer weights per step at batch 1 (the cross-attention K/V
kernels excluded: they run once per example); the report divides a
one-position pass's bytes by that floor.

Bad input is one line before any long compile: an unknown topology, a mesh
the topology's device count does not match, a dimension the mesh does not
divide, a row whose weights and caches (``memory.plan``) exceed the chip's
HBM.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.sharding import SingleDeviceSharding

from specdec_jax import checkpoints, data, drafts, memory, partitioning, theory
from specdec_jax.decoding import speculative_decode, temperature_sample, tree_speculative_decode
from specdec_jax.drafts.base import tree_proposal
from specdec_jax.models.t5 import T5Config, T5Model, param_shapes, stored_dtype
from specdec_jax.partitioning import CACHE_AXES, Partitioner, flatten_names, unflatten_names
from specdec_jax.run import hlo
from specdec_jax.run.autogamma import min_pq_along
from specdec_jax.run.chips import Chip, topology_devices
from specdec_jax.run.settings import Experiment, is_remote, resolve_path
from specdec_jax.run.setup import check_partitioning, estimate_bytes
from specdec_jax.sampling import SamplingConfig
from specdec_jax.tree import TreeShape

GiB = 2 ** 30
# Where the dry run reads nothing: paths it swaps for a placeholder before
# validating, so that a row whose checkpoints live elsewhere (or are unset)
# can be checked here.
PATH_FIELDS = ("target_checkpoint", "draft_checkpoint", "vocab_path", "source")
PLACEHOLDER = "gs://dry-run-reads-nothing/"
# Roofline pieces: XLA's fast-compile setting (no VMEM staging of weights, so
# 'bytes accessed' is HBM traffic) and the decoder depths extrapolated from.
PIECE_OPTIONS = {"exec_time_optimization_effort": -1.0}
PIECE_DEPTHS = (1, 2)


@dataclasses.dataclass(frozen=True)
class PaperRow:
  """One row of the paper's Table 2 (γ, α, measured speedup on a TPU-v4) with
  Table 4's c for its draft; Table 2's α are Table 3's."""

  gamma: int
  alpha: float
  speedup: float
  c: float


# (task, draft size, temperature) -> the paper's row (T5 1.1 XXL target).
PAPER_TABLE2: dict[tuple[str, str, int], PaperRow] = {
    ("ende", "small", 0): PaperRow(7, 0.75, 3.4, 0.02),
    ("ende", "base", 0): PaperRow(7, 0.80, 2.8, 0.04),
    ("ende", "large", 0): PaperRow(7, 0.82, 1.7, 0.11),
    ("ende", "small", 1): PaperRow(7, 0.62, 2.6, 0.02),
    ("ende", "base", 1): PaperRow(5, 0.68, 2.4, 0.04),
    ("ende", "large", 1): PaperRow(3, 0.71, 1.4, 0.11),
    ("cnndm", "small", 0): PaperRow(5, 0.65, 3.1, 0.02),
    ("cnndm", "base", 0): PaperRow(5, 0.73, 3.0, 0.04),
    ("cnndm", "large", 0): PaperRow(3, 0.74, 2.2, 0.11),
    ("cnndm", "small", 1): PaperRow(5, 0.53, 2.3, 0.02),
    ("cnndm", "base", 1): PaperRow(3, 0.55, 2.2, 0.04),
    ("cnndm", "large", 1): PaperRow(3, 0.56, 1.7, 0.11),
}


def paper_row(exp: Experiment) -> Optional[PaperRow]:
  """The paper's Table 2 row for the experiment's task, draft size and
  temperature (argmax or plain sampling only), or None."""
  task = exp.task.lower()
  task = "ende" if "ende" in task else "cnndm" if "cnn" in task else None
  name = f"{exp.draft_preset or ''} {exp.draft_label or ''}".lower()
  size = next((s for s in ("small", "base", "large") if s in name), None)
  s = exp.sampling
  temp = int(s.temperature) if s.temperature in (0.0, 1.0) and not (s.topk or s.topp) else None
  if exp.draft_name not in ("t5", "lookup_t5") or None in (task, size, temp):
    return None
  return PAPER_TABLE2.get((task, size, temp))


# ------------------------------------------------------------------ results


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
  collectives: list = dataclasses.field(default_factory=list)     # hlo.Collective
  weight_moves: list = dataclasses.field(default_factory=list)    # hlo.Collective
  weight_copies: list = dataclasses.field(default_factory=list)   # hlo.WeightCopy
  error: str = ""                # the compiler's first line when it failed

  @property
  def total(self) -> int:
    """Device memory the executable needs: arguments + temporaries +
    outputs, less outputs that reuse argument buffers (program code apart)."""
    return self.arguments + self.temporaries + self.outputs - self.aliased

  def take_memory(self, compiled: Any) -> None:
    """Fills the byte counts from XLA's memory analysis of ``compiled``."""
    m = compiled.memory_analysis()
    self.arguments, self.temporaries = m.argument_size_in_bytes, m.temp_size_in_bytes
    self.outputs, self.aliased = m.output_size_in_bytes, m.alias_size_in_bytes
    self.code = m.generated_code_size_in_bytes


@dataclasses.dataclass(frozen=True)
class Piece:
  """One roofline piece's per-device cost (XLA's cost analysis)."""

  flops: float
  bytes: float

  def seconds(self, chip: Chip) -> float:
    return max(self.flops / chip.peak_flops, self.bytes / chip.hbm_bandwidth)

  def bound(self, chip: Chip) -> str:
    return "compute" if self.flops / chip.peak_flops > self.bytes / chip.hbm_bandwidth \
        else "memory"


@dataclasses.dataclass
class Roofline:
  """Predicted costs on one chip (a model, not a measurement)."""

  chip: Chip
  target: dict          # k (positions scored) -> Piece
  draft: Optional[Piece]
  floor: int            # decoder + output-layer weight bytes per device
  draft_floor: int = 0  # the same for the draft

  def c(self) -> float:
    """Definition 3.7: one draft step over one target step."""
    return 0.0 if self.draft is None else self.draft.seconds(self.chip) / \
        self.target[1].seconds(self.chip)

  def v(self, k: int) -> float:
    """A pass over k positions over a one-position pass."""
    return self.target[k].seconds(self.chip) / self.target[1].seconds(self.chip)

  def speedup(self, alpha: float, gamma: int, with_v: bool = False) -> float:
    """Theorem 3.8 (v = 1), or with ``with_v`` its v-generalized form
    (``theory.walltime_improvement``), at the model's c."""
    return float(theory.walltime_improvement(alpha, gamma, self.c(),
                                             self.v(gamma + 1) if with_v else 1.0))


class CompiledVerdict:
  """What a dry run's compiled ``programs`` (``Program``) say on its ``chip``."""

  @property
  def memory(self) -> int:
    """The largest per-device total among the compiled programs."""
    return max((p.total for p in self.programs if not p.error), default=0)

  @property
  def fits(self) -> bool:
    return all(not p.error for p in self.programs) and self.memory <= self.chip.hbm_bytes


@dataclasses.dataclass
class DryRun(CompiledVerdict):
  """Everything a dry run found (``format_report`` prints it)."""

  topology: str
  chip: Chip
  num_devices: int
  exp: Experiment
  gamma: int
  target_config: T5Config
  draft_config: Optional[T5Config]
  estimate: dict                  # setup.estimate_bytes: part -> bytes per device
  unread: list                    # (field, value) the dry run did not read
  programs: list = dataclasses.field(default_factory=list)
  roofline: Optional[Roofline] = None
  paper: Optional[PaperRow] = None
  wall_s: float = 0.0

  def predicted(self, with_v: bool = False) -> Optional[float]:
    if self.roofline is None or self.paper is None or self.roofline.draft is None:
      return None
    return self.roofline.speedup(self.paper.alpha, self.gamma, with_v)


# ------------------------------------------------------------- the checks


def _checkable(exp: Experiment) -> tuple[Experiment, list]:
  """The experiment with every path the dry run does not read, and that is
  unset or absent here, swapped for a remote placeholder (validation checks
  local paths exist); and the list of those (field, value)."""
  needs_ckpt = bool({"model", "params"} & set(drafts.requires(exp.draft_name))) \
      if exp.draft_name in drafts.REGISTRY else False
  swap, unread = {}, []
  for name in PATH_FIELDS:
    value = getattr(exp, name)
    if name == "draft_checkpoint" and not value and not needs_ckpt:
      continue
    unread.append((name, value))
    if not value or (not is_remote(value) and not Path(resolve_path(value)).exists()):
      swap[name] = PLACEHOLDER + name
  return dataclasses.replace(exp, **swap), unread


def architecture(role: str, path: str, fmt: str, preset: Optional[str],
                 dtype: str) -> T5Config:
  """A model's architecture without reading weights: its preset, else a
  local checkpoint's config.json (``checkpoints.peek_config``; remote ones
  are not read)."""
  local = resolve_path(path) if path and not path.startswith(PLACEHOLDER) else ""
  cfg = None
  if preset or (local and not is_remote(local) and Path(local).is_dir()):
    cfg = checkpoints.peek_config(local, fmt, preset, dtype)
  if cfg is None:
    raise ValueError(f"the dry run reads no checkpoint, so it needs the {role}'s "
                     f"architecture: bind Experiment.{role}_preset (e.g. 't5_1_1_xxl'), or "
                     f"point Experiment.{role}_checkpoint at a local checkpoint with a "
                     "config.json")
  return cfg


@dataclasses.dataclass
class _Context:
  """What the checks established, for the compiles."""

  exp: Experiment
  chip: Chip
  devices: tuple
  target_cfg: T5Config
  draft_cfg: Optional[T5Config]
  target_part: Optional[Partitioner]
  draft_part: Optional[Partitioner]
  gamma: int
  estimate: dict
  unread: list


def check(exp: Experiment, topology: str, alpha_only: bool = False) -> _Context:
  """Every check before a compile, each failure one line (``ValueError``):
  the topology, the settings (paths the dry run does not read excepted), the
  architectures and their vocabularies, the mesh against the topology's
  devices, every dimension the mesh must divide, and the plan's bytes against
  the chip's HBM."""
  chip, devices = topology_devices(topology)
  exp_c, unread = _checkable(exp)
  exp_c.validate()
  if alpha_only and exp.gamma == "auto":
    raise ValueError("Experiment.gamma='auto' chooses γ from timed speculative pieces; "
                     "--alpha_only uses no γ: bind a number (or drop --alpha_only)")
  if exp.draft_shortlist:
    raise ValueError("Experiment.draft_shortlist: the dry run does not model a shortlisted "
                     "draft (its token list is read from a file); bind "
                     "Experiment.draft_shortlist = '' to compile the full-vocabulary draft")
  needs = set(drafts.requires(exp.draft_name))
  if "corpus" in needs:
    raise ValueError(f"approximation model {exp.draft_name!r} is estimated from a corpus "
                     "when the run starts; the dry run reads no data, so it compiles drafts "
                     "built without any ('t5', 'lookup_t5', 'prompt_lookup')")
  dtype = exp.dtype
  target_cfg = architecture("target", exp_c.target_checkpoint, exp.target_format,
                            exp.target_preset, dtype)
  draft_cfg = None
  if needs & {"model", "params"}:
    draft_cfg = architecture("draft", exp_c.draft_checkpoint, exp.draft_format,
                             exp.draft_preset, dtype)
    data.check_vocab_compatible(target_cfg.vocab_size, draft_cfg.vocab_size,
                                target_pad_id=target_cfg.pad_id, draft_pad_id=draft_cfg.pad_id,
                                target_eos_id=target_cfg.eos_id, draft_eos_id=draft_cfg.eos_id)
  where = f"--dry_run={topology} ({len(devices)} devices, one per {chip.device_kind} chip)"
  if exp.mesh_shape is None:
    target_part = draft_part = None
  else:
    try:
      mesh = partitioning.make_mesh(exp.mesh_shape, devices)
    except partitioning.PartitioningError as e:
      raise ValueError(f"{where}: Experiment.mesh_shape: {e}") from None
    target_part = partitioning.Partitioner(
        mesh, partitioning.STANDARD_RULES if exp.logical_axis_rules is None
        else exp.logical_axis_rules, exp.partition_fallback)
    draft_part = partitioning.Partitioner(
        mesh, partitioning.DATA_PARALLEL_RULES if exp.draft_logical_axis_rules is None
        else exp.draft_logical_axis_rules, exp.partition_fallback)
  check_partitioning(exp_c, target_part, draft_part)
  estimate = estimate_bytes(exp_c, alpha_only)
  need = sum(estimate.values())
  if need > chip.hbm_bytes:
    detail = ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in estimate.items())
    raise ValueError(f"{where}: the row does not fit: its weights and caches need "
                     f"{need / GiB:.2f} GiB per device ({detail}; memory.plan) but a "
                     f"{chip.label} chip has {chip.hbm_bytes / GiB:.0f} GiB of HBM; shard over "
                     "more chips (Experiment.mesh_shape), use bfloat16 weights or lower "
                     "Experiment.batch_size / max_decode_len")
  return _Context(exp, chip, devices, target_cfg, draft_cfg, target_part, draft_part,
                  exp.gamma_bound, estimate, unread)


# ------------------------------------------------------------ the programs


@functools.lru_cache(maxsize=None)
def _shapes(cfg: T5Config) -> dict:
  return flatten_names(param_shapes(cfg.replace(dtype="float32")))


def abstract_params(cfg: T5Config, part: Optional[Partitioner], param_dtype: str,
                    device: Any) -> dict:
  """The parameter tree as ShapeDtypeStructs: ``stored_dtype`` at
  ``param_dtype``, each with its sharding (``part``; one device without)."""
  one = SingleDeviceSharding(device)
  return unflatten_names({
      n: jax.ShapeDtypeStruct(x.shape, stored_dtype(n, param_dtype),
                              sharding=part.param_sharding(n, x.shape) if part else one)
      for n, x in _shapes(cfg).items()})


def _sharded(part: Optional[Partitioner], device: Any, axes: Sequence, shape: Sequence[int],
             dtype: Any, what: str) -> jax.ShapeDtypeStruct:
  sharding = part.sharding(axes, shape, what) if part else SingleDeviceSharding(device)
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def weight_floor(cfg: T5Config, part: Optional[Partitioner], param_dtype: str) -> int:
  """Bytes of weights each device must read per decoding step at batch 1:
  its shards of the decoder's and the output layer's weights (T5 1.0: the
  tied embedding), the cross-attention K/V kernels excluded (they run once
  per example, in ``init_cache``)."""
  total = 0
  for n, x in _shapes(cfg).items():
    cross_kv = "encoder_decoder_attention/key/" in n or "encoder_decoder_attention/value/" in n
    if (n.startswith("decoder/") and not cross_kv) or (
        n == "token_embedder/embedding" and cfg.logits_via_embedding):
      shard = part.param_sharding(n, x.shape).shard_shape(x.shape) if part else x.shape
      total += math.prod(shard) * stored_dtype(n, param_dtype).itemsize
  return total


def _cache(cfg: T5Config, part: Optional[Partitioner], device: Any, batch: int, input_len: int,
           cache_len: int):
  """An abstract ``DecoderCache`` pinned as ``partitioning.constrain_cache`` pins it."""
  shapes = memory.cache_shapes(cfg, batch, input_len, cache_len)
  return jax.tree.map(lambda x: _sharded(part, device, CACHE_AXES if x.ndim == 4
                                         else ("batch", "length"), x.shape, x.dtype, "cache"),
                      shapes)


@functools.partial(jax.jit, static_argnames=("gamma", "cache_len", "sampling", "tree"))
def draft_round(draft: Any, inputs: jax.Array, key: jax.Array, *, gamma: int, cache_len: int,
                sampling: SamplingConfig, tree: Optional[TreeShape] = None
                ) -> tuple[jax.Array, jax.Array]:
  """The draft on its own: its init (encoder and cache) and one round of γ
  proposals from an empty prefix -> (tokens [B, γ], q [B, γ, V]); with a
  ``tree``, one tree proposal (tokens [B, N], q [B, N, V])."""
  b = inputs.shape[0]
  state = draft.init(inputs, cache_len)
  seq = jnp.zeros((b, cache_len + 1), jnp.int32)
  length = jnp.zeros((b,), jnp.int32)
  if tree is not None:
    tokens, q = tree_proposal(draft, state, seq, length, tree, sampling, key)[:2]
    return tokens, q
  tokens, q, _ = draft.propose(state, seq, length, gamma, sampling, key)
  return tokens, q


def _pass(model: T5Model, part: Optional[Partitioner]) -> Callable:
  def one_pass(params, tokens, positions, cache):
    logits, cache = model.decode(params, tokens, positions, cache)
    return logits, partitioning.constrain_cache(cache, part, "cache")
  return one_pass


def _lower_pass(cfg: T5Config, part: Optional[Partitioner], device: Any, exp: Experiment,
                k: int, cache_len: int) -> Any:
  """One decoder pass over k positions (``T5Model.decode``), lowered alone,
  its weights in the layout the compiler prefers (``Layout.AUTO``): the
  loops copy a weight into another layout once per call, outside the loop
  (``hlo.weight_copies``), so a pass in the loop reads it as stored."""
  b = exp.batch_size
  params = abstract_params(cfg, part, exp.param_dtype, device)
  tokens = _sharded(part, device, ("batch", None), (b, k), jnp.int32, "tokens")
  cache = _cache(cfg, part, device, b, exp.max_input_len, cache_len)
  shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
  formats = jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), params)
  return jax.jit(_pass(T5Model(cfg), part), donate_argnums=(3,),
                 in_shardings=(formats, shardings(tokens), shardings(tokens), shardings(cache))
                 ).lower(params, tokens, tokens, cache)


# Compiled programs, by (topology, lowered program text, options): a table of
# rows compiles each distinct program once.
_COMPILED: dict[str, Program] = {}


def _compile(name: str, estimate: int, topology: str, lowered: Any,
             options: Optional[dict] = None) -> Callable[[], Program]:
  """A thunk compiling ``lowered`` (in a worker thread) into a ``Program``."""
  text = lowered.as_text()
  key = hashlib.sha256(f"{topology}\n{options}\n".encode() + text.encode()).hexdigest()

  def run() -> Program:
    if key in _COMPILED:
      return dataclasses.replace(_COMPILED[key], name=name, estimate=estimate)
    p = Program(name, estimate)
    t0 = time.perf_counter()
    try:
      compiled = lowered.compile(options) if options else lowered.compile()
    except Exception as e:  # out of memory, or a program the compiler refuses
      p.error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      p.compile_s = time.perf_counter() - t0
      return p
    p.compile_s = time.perf_counter() - t0
    p.take_memory(compiled)
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    p.flops, p.bytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    module = hlo.parse(compiled.as_text())
    params = hlo.parameters(module)
    p.padded_arguments = sum(hlo.array_bytes(i.shape, padded=True) for i in params)
    p.weights = sum(hlo.array_bytes(i.shape) for i in params if _is_weight(i))
    p.collectives = hlo.loop_collectives(module)
    p.weight_moves = hlo.weight_collectives(module, _is_weight)
    p.weight_copies = hlo.weight_copies(module, _is_weight)
    _COMPILED[key] = p
    return p
  return run


def _is_weight(param: hlo.Instr) -> bool:
  """An entry parameter holding a weight: jit names parameters by their
  argument path, and every weight lives under a 'params' tree."""
  return "params[" in param.op_name


def default_workers() -> int:
  """Compiles run in this many threads (the TPU compiler releases the GIL)."""
  return max(1, min(2, os.cpu_count() or 1))


def dry_run(exp: Experiment, topology: str, alpha_only: bool = False,
            programs: Optional[Sequence[str]] = None, roofline: bool = True,
            workers: Optional[int] = None) -> DryRun:
  """Checks ``exp`` for ``topology`` (``check``), then compiles its programs
  and the roofline pieces; returns the ``DryRun`` (``format_report`` prints
  it). ``programs``: a subset of ('baseline', 'speculative', 'draft') or,
  with ``alpha_only``, of ('baseline', 'alpha'); default all. Raises
  ``ValueError`` (one line) for bad input; a program the compiler refuses
  (e.g. out of memory) is reported in its ``Program.error``."""
  t0 = time.perf_counter()
  ctx = check(exp, topology, alpha_only)
  exp, gamma, device = ctx.exp, ctx.gamma, ctx.devices[0]
  tp, dp = ctx.target_part, ctx.draft_part
  target = T5Model(ctx.target_cfg)
  b, s, t = exp.batch_size, exp.max_input_len, exp.max_decode_len
  cache_len = t + gamma + 1
  tparams = abstract_params(ctx.target_cfg, tp, exp.param_dtype, device)
  kw: dict[str, Any] = dict(vocab_size=ctx.target_cfg.vocab_size, vocab=None,
                            max_ngram=exp.prompt_lookup_max_ngram)
  if dp is not None:
    kw["partitioner"] = dp
  if ctx.draft_cfg is not None:
    kw.update(model=T5Model(ctx.draft_cfg), bridge=None,
              params=abstract_params(ctx.draft_cfg, dp, exp.param_dtype, device))
  draft = drafts.build(exp.draft_name, **kw)
  inputs = _sharded(tp, device, ("batch", None), (b, s), jnp.int32, "inputs")
  key_shape = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  key = jax.ShapeDtypeStruct(key_shape.shape, key_shape.dtype,
                             sharding=tp.replicated() if tp else SingleDeviceSharding(device))
  est = _estimates(ctx)
  loop_kw = dict(max_decode_len=t, sampling=exp.sampling, eos_id=ctx.target_cfg.eos_id,
                 partitioner=tp)
  lowerers = {
      "baseline": lambda: temperature_sample.lower(target, tparams, inputs, key, **loop_kw),
      # A tree run (Experiment.tree) compiles its own loop; gamma is then
      # N - 1, so the roofline prices the tree's pass of N positions.
      "speculative": lambda: speculative_decode.lower(
          target, tparams, draft, inputs, key, gamma=gamma, lenience=exp.lenience,
          adaptive=exp.adaptive, **loop_kw) if exp.tree_shape is None else
      tree_speculative_decode.lower(target, tparams, draft, inputs, key, tree=exp.tree_shape,
                                    **loop_kw),
      "draft": lambda: draft_round.lower(draft, inputs, key, gamma=gamma, cache_len=cache_len,
                                         sampling=exp.sampling, tree=exp.tree_shape),
      "alpha": lambda: min_pq_along.lower(
          target, tparams, draft, inputs,
          _sharded(tp, device, ("batch", None), (b, t), jnp.int32, "tokens"),
          _sharded(tp, device, ("batch",), (b,), jnp.int32, "lengths"), exp.sampling),
  }
  names = list(programs or (("baseline", "alpha") if alpha_only
                            else ("speculative", "baseline", "draft")))
  if ctx.draft_cfg is None and "draft" in names:
    names.remove("draft")  # a draft without weights has no program of its own
  # Each program is lowered here and compiled in a worker thread as soon as
  # it is lowered (longest first), so lowering overlaps compiling.
  workers = default_workers() if workers is None else max(1, workers)
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    submit = lambda name, est_bytes, lowered, options=None: pool.submit(
        _compile(name, est_bytes, topology, lowered, options))
    futures = [submit(LABELS[n], est[n], lowerers[n]()) for n in names]
    pieces: dict = {}
    if roofline and not alpha_only:
      for depth in PIECE_DEPTHS:
        tcfg = ctx.target_cfg.replace(num_decoder_layers=depth, num_encoder_layers=1)
        for k in range(1, gamma + 2):
          pieces[("target", depth, k)] = submit(
              f"target pass k={k} depth {depth}", 0,
              _lower_pass(tcfg, tp, device, exp, k, cache_len), PIECE_OPTIONS)
        if ctx.draft_cfg is not None:
          dcfg = ctx.draft_cfg.replace(num_decoder_layers=depth, num_encoder_layers=1)
          pieces[("draft", depth, 1)] = submit(
              f"draft step depth {depth}", 0,
              _lower_pass(dcfg, dp, device, exp, 1, cache_len), PIECE_OPTIONS)
    compiled = [f.result() for f in futures]
    got = {key: f.result() for key, f in pieces.items()}
  out = DryRun(topology, ctx.chip, len(ctx.devices), exp, gamma, ctx.target_cfg, ctx.draft_cfg,
               ctx.estimate, ctx.unread, compiled, paper=paper_row(exp))
  if got and not any(p.error for p in got.values()):
    out.roofline = Roofline(
        ctx.chip,
        {k: _extrapolate(got, "target", k, ctx.target_cfg.num_decoder_layers)
         for k in range(1, gamma + 2)},
        _extrapolate(got, "draft", 1, ctx.draft_cfg.num_decoder_layers)
        if ctx.draft_cfg is not None else None,
        weight_floor(ctx.target_cfg, tp, exp.param_dtype),
        weight_floor(ctx.draft_cfg, dp, exp.param_dtype) if ctx.draft_cfg is not None else 0)
  out.wall_s = time.perf_counter() - t0
  return out


LABELS = {"baseline": "baseline loop", "speculative": "speculative loop",
          "draft": "draft (init + γ proposals)", "alpha": "α pass (§4.2)"}


def _extrapolate(got: dict, role: str, k: int, depth: int) -> Piece:
  """Flops and bytes at ``depth`` layers from the depth-1 and depth-2
  compiles: X(L) = X(1) + (L - 1)(X(2) - X(1))."""
  one, two = got[(role, 1, k)], got[(role, 2, k)]
  return Piece(one.flops + (depth - 1) * (two.flops - one.flops),
               one.bytes + (depth - 1) * (two.bytes - one.bytes))


def _estimates(ctx: _Context) -> dict[str, int]:
  """memory.plan's bytes for what each program holds resident."""
  exp = ctx.exp
  plan = memory.plan(ctx.target_cfg, ctx.draft_cfg, exp.mesh_shape, exp.param_dtype, exp.dtype,
                     exp.batch_size, exp.max_input_len, exp.max_decode_len, ctx.gamma,
                     exp.logical_axis_rules, exp.draft_logical_axis_rules,
                     exp.partition_fallback)
  part = memory.planning_partitioner(exp.mesh_shape, exp.logical_axis_rules,
                                     exp.partition_fallback)
  base_cache = memory.cache_bytes(ctx.target_cfg, part, exp.batch_size, exp.max_input_len,
                                  exp.max_decode_len, exp.dtype, "target cache")
  pq = 3 * exp.batch_size * exp.max_decode_len * ctx.target_cfg.vocab_size * 4
  return {"baseline": plan["target_params"] + base_cache, "speculative": plan["total"],
          "draft": plan["draft_params"] + plan["draft_caches"],
          "alpha": plan["target_params"] + plan["draft_params"] + plan["draft_caches"] + pq}


# ------------------------------------------------------------------ report


def gib(n: float) -> str:
  """Bytes as GiB (MiB below a tenth of one: tiny test models)."""
  return f"{n / GiB:.2f} GiB" if n >= GiB / 10 or n == 0 else f"{n / 2 ** 20:.2f} MiB"


def program_header(name_width: int, tail: Sequence[str]) -> str:
  """The header of ``program_lines``' table."""
  return (f"  {'program':{name_width}s} {'compile':>8s} {'arguments':>11s} {'temporaries':>12s} "
          f"{'outputs':>10s}" + "".join(f" {c:>10s}" for c in tail) + "  fits")


def program_lines(programs: Sequence[Any], chip: Chip, name_width: int,
                  tail: Sequence[str]) -> list[str]:
  """One line per compiled program: compile seconds, arguments, temporaries,
  outputs, then the ``Program`` fields named in ``tail`` (e.g. 'total',
  'estimate'), and whether ``total`` fits the chip's HBM."""
  lines = []
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


def size(n: float) -> str:
  """Bytes in decimal units (collectives' payloads)."""
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if n >= scale:
      return f"{n / scale:.3g} {unit}"
  return f"{int(n)} B"


def _summarize(collectives: Sequence[hlo.Collective]) -> list[str]:
  groups: dict = {}
  for c in collectives:
    groups.setdefault((c.where, c.kind, c.shape, c.nbytes), 0)
    groups[(c.where, c.kind, c.shape, c.nbytes)] += 1
  lines = []
  for (where, kind, shape, nbytes), n in sorted(groups.items()):
    lines.append(f"{n:4d} x {kind} {shape} ({size(nbytes)} each)"
                 + (f" [{where}]" if where else ""))
  return lines


def format_report(r: DryRun, configs: Sequence[str] = ()) -> str:
  """The dry run as text: setup, per-program memory and collectives, the
  roofline model and its Theorem 3.8 prediction beside the paper's."""
  e, chip = r.exp, r.chip
  lines = [f"Dry run of {' + '.join(configs) or 'the experiment'} for {r.topology}: "
           f"{r.num_devices} devices, one per {chip.label} chip ({chip.device_kind}"
           + (", megacore: 2 TensorCores as one device" if chip.tensorcores == 2 else "")
           + f"), {chip.hbm_bytes / GiB:.0f} GiB HBM each. Nothing was read: "
           + ", ".join(f"{f} {v!r}" if v else f"{f} (unset)" for f, v in r.unread) + "."]
  draft = (f"draft {e.draft_preset or e.draft_name}" if r.draft_config is not None
           else f"draft {e.draft_name} (no weights)")
  mesh = f"mesh (data, model) = {tuple(e.mesh_shape)}" if e.mesh_shape else "one device"
  s = e.sampling
  lines.append(f"target {e.target_preset or 'from config.json'}, {draft}; {mesh}; weights "
               f"{e.param_dtype}, activations {e.dtype}; batch {e.batch_size}, input "
               f"{e.max_input_len}, decode {e.max_decode_len}, γ {r.gamma}"
               + (" (γ_max; adaptive widths "
                  f"{e.adaptive.verify_widths(r.gamma)})" if e.adaptive else "")
               + (" ('auto' compiles the γ it picks; this is its largest)"
                  if e.gamma == "auto" else "")
               + f", temperature {s.temperature:g}")
  lines.append("memory.plan estimate per device: " + ", ".join(
      f"{k} {gib(v)}" for k, v in r.estimate.items()))
  lines += ["", f"Compiled programs, per device (XLA's memory analysis of the {chip.label} "
            "executable; 'fits' compares arguments + temporaries + outputs with "
            f"{chip.hbm_bytes / GiB:.0f} GiB):",
            program_header(27, ("total", "estimate"))]
  lines += program_lines(r.programs, chip, 27, ("total", "estimate"))
  code = max((p.code for p in r.programs if not p.error), default=0)
  lines += ["  (estimate: memory.plan's weights and caches, which leaves out XLA "
            "temporaries; arguments include the inputs and the key; the programs' code, "
            f"up to {gib(code)}, is not in the totals)", ""]
  for p in r.programs:
    if p.error:
      continue
    body = _summarize(p.collectives)
    total = sum(c.nbytes for c in p.collectives)
    lines.append(f"Collectives in one iteration of the {p.name} ({len(p.collectives)}, "
                 f"{size(total)} per device)" + (":" if body else ": none"))
    lines += ["  " + l for l in body]
    copies = [c for c in p.weight_copies if not c.in_loop], \
        [c for c in p.weight_copies if c.in_loop]
    for held, label in zip(copies, ("once per call, held for the loop",
                                    "INSIDE the loop, every iteration")):
      if held:
        lines.append(f"  {len(held)} copies of weights in another layout or dtype, "
                     f"{size(sum(c.nbytes for c in held))} per device, {label}")
    if p.weight_moves:
      lines.append(f"  ERROR: {len(p.weight_moves)} collective(s) move a weight, e.g. "
                   f"{p.weight_moves[0].kind} {p.weight_moves[0].shape} "
                   f"({p.weight_moves[0].op_name})")
    else:
      lines.append("  no collective moves a weight")
  rl = r.roofline
  if rl is not None:
    lines += ["", f"Roofline MODEL, not a measurement: each piece compiled on its own and "
              f"priced as max(flops / {chip.peak_flops / 1e12:.0f} TFLOP/s, bytes / "
              f"{chip.hbm_bandwidth / 1e9:.0f} GB/s), {chip.label}'s published bf16 peak and "
              f"HBM bandwidth ({chip.source}); collectives and launch latency not priced.",
              f"  {'piece':24s} {'GFLOP':>9s} {'GB read':>9s} {'µs':>9s}  bound"]
    rows = [(f"target pass, k={k}", p) for k, p in rl.target.items()]
    if rl.draft is not None:
      rows.append(("draft step (k=1)", rl.draft))
    for label, p in rows:
      lines.append(f"  {label:24s} {p.flops / 1e9:9.2f} {p.bytes / 1e9:9.3f} "
                   f"{1e6 * p.seconds(chip):9.1f}  {p.bound(chip)}")
    last = max(rl.target)
    lines.append(f"  bytes read per target pass / floor (the decoder and output-layer weights "
                 f"each device reads per step, {size(rl.floor)}): "
                 f"{rl.target[1].bytes / rl.floor:.2f}x at k=1, "
                 f"{rl.target[last].bytes / rl.floor:.2f}x at k={last}"
                 + (f"; draft step / its floor ({size(rl.draft_floor)}): "
                    f"{rl.draft.bytes / rl.draft_floor:.2f}x" if rl.draft and rl.draft_floor
                    else ""))
    lines.append("  v(k) = " + ", ".join(f"{k}: {rl.v(k):.3f}" for k in rl.target))
    if rl.draft is not None:
      paper = r.paper
      c_line = f"  predicted c = {rl.c():.4f}"
      if paper is not None:
        c_line += f" (paper, Table 4: {paper.c})"
      lines.append(c_line)
      if paper is not None:
        caveat = "" if e.target_preset == "t5_1_1_xxl" else (
            " (the paper's α is for T5 1.1 XXL with this draft size; these models differ)")
        lines.append(f"  Theorem 3.8 at the paper's α = {paper.alpha} (Table 3){caveat}, "
                     f"γ = {r.gamma}: predicted {r.predicted():.2f}x (with v({r.gamma + 1}): "
                     f"{r.predicted(True):.2f}x); the paper measured {paper.speedup}x "
                     f"(Table 2, γ = {paper.gamma}, TPU-v4)")
      else:
        lines.append("  no paper row for this task, draft and temperature: no α to predict at")
      if e.adaptive is not None:
        lines.append("  adaptive draft lengths are not Theorem 3.8's fixed γ: the prediction "
                     "above is for a fixed γ = γ_max")
  fits = "fits" if r.fits else "does NOT fit"
  lines += ["", f"Largest program: {gib(r.memory)} per device, {fits} in "
            f"{chip.hbm_bytes / GiB:.0f} GiB. Dry run took {r.wall_s:.0f} s."]
  return "\n".join(lines)


def main(exp: Experiment, topology: str, alpha_only: bool = False,
         configs: Sequence[str] = (), out: Optional[TextIO] = None) -> DryRun:
  """``--dry_run``: runs ``dry_run`` and prints the report; a collective that
  moves a weight is an error (``ValueError``) after the report."""
  r = dry_run(exp, topology, alpha_only)
  out = out or sys.stdout
  print(format_report(r, [Path(c).stem for c in configs]), file=out)
  out.flush()
  moved = [p.name for p in r.programs if p.weight_moves]
  if moved:
    raise ValueError(f"--dry_run={topology}: the {', '.join(moved)} move(s) weights between "
                     "devices at run time (see the collectives above); check the logical "
                     "axis rules")
  return r
