r"""The runner's programs for the TPU dry run (``driver``), compiled for a
topology on abstract arrays, reading nothing (``--dry_run=v4:1x1x1``): the
baseline, the speculative (or tree) loop and the draft, or with
``--alpha_only`` the baseline and the α pass (§4.2); then the roofline model
(``costs``): c (Definition 3.7), v(k) and Theorem 3.8 at the paper's α beside
Tables 2 and 4. A pass's bytes are divided by the per-step weight floor (a
compiled loop's 'bytes accessed' also counts VMEM staging copies).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout

from specdec_jax import data, drafts, memory, paper, partitioning
from specdec_jax.decoding import (cache_length, speculative_decode, temperature_sample,
                                  tree_speculative_decode)
from specdec_jax.drafts import t5_block
from specdec_jax.drafts.base import dynamic_tree_proposal, tree_proposal
from specdec_jax.dryrun import driver
from specdec_jax.dryrun.costs import PIECE_DEPTHS, PIECE_OPTIONS, Roofline, extrapolate
from specdec_jax.dryrun.driver import (GiB, Compile, Context, DryRun, abstract_key,
                                       abstract_params, gib, sharded, size)
from specdec_jax.models.t5 import T5Config, T5Model
from specdec_jax.partitioning import CACHE_AXES, Partitioner
from specdec_jax.alpha import min_pq_along
from specdec_jax.run.settings import Experiment, is_remote
from specdec_jax.run.setup import check_partitioning, estimate_bytes
from specdec_jax.sampling import SamplingConfig
from specdec_jax.theory import RoundCost
from specdec_jax.measured import DEMO_RANK_PROFILE
from specdec_jax.tree import DynamicTree, RoundTree, TreeShape, scaled_rank_rates

# Paths swapped for a placeholder before validating: the dry run reads none.
PATH_FIELDS = ("target_checkpoint", "draft_checkpoint", "vocab_path", "source")
PLACEHOLDER = "gs://dry-run-reads-nothing/"
LABELS = {"baseline": "baseline loop", "speculative": "speculative loop",
          "draft": "draft (init + γ proposals)", "alpha": "α pass (§4.2)"}


def priced_tree(tree: TreeShape | DynamicTree, rates: Sequence[float]) -> TreeShape:
  """The static tree the cost model prices: ``tree``, or for a ``DynamicTree``
  the best static tree of its size and depth at ``rates`` (an ASSUMPTION;
  docs/benchmarks.md)."""
  if isinstance(tree, DynamicTree):
    return TreeShape.from_acceptance(rates, tree.num_nodes, tree.max_depth)
  return tree


def paper_row(exp: Experiment) -> Optional[paper.Row]:
  """The paper's Table 2 row for the experiment (T = 0 or plain T = 1), or None."""
  task = exp.task.lower()
  task = "ende" if "ende" in task else "cnndm" if "cnn" in task else None
  name = f"{exp.draft_preset or ''} {exp.draft_label or ''}".lower()
  draft_size = next((s for s in ("small", "base", "large") if s in name), None)
  s = exp.sampling
  temp = int(s.temperature) if s.temperature in (0.0, 1.0) and not (s.topk or s.topp) else None
  if exp.draft_name not in ("t5", "lookup_t5", "t5_block") or None in (task, draft_size, temp):
    return None
  return paper.table2_row(task, draft_size, temp)


def block_width(exp: Experiment) -> int:
  """Positions of a block draft's proposal call (2D, D = γ or the tree's
  depth); 0 for a draft proposing a token a call."""
  if not drafts.takes(exp.draft_name, "block"):
    return 0
  tree = exp.tree_shape
  return 2 * (tree.max_depth if tree is not None else exp.gamma_max)


def _checkable(exp: Experiment) -> tuple[Experiment, list]:
  """The experiment with unset or absent unread paths swapped for a
  placeholder, and the (field, value) pairs it does not read."""
  needs_ckpt = exp.draft_name in drafts.REGISTRY and _has_weights(exp)
  swap, unread = {}, []
  for name in PATH_FIELDS:
    value = getattr(exp, name)
    if name == "draft_checkpoint" and not value and not needs_ckpt:
      continue
    unread.append((name, value))
    if not value or (not is_remote(value) and not Path(exp.resolve(value)).exists()):
      swap[name] = PLACEHOLDER + name
  return dataclasses.replace(exp, **swap), unread


def _has_weights(exp: Experiment) -> bool:
  return bool({"model", "params"} & set(drafts.requires(exp.draft_name)))


def _architecture(exp: Experiment, role: str) -> T5Config:
  path = getattr(exp, f"{role}_checkpoint")
  local = exp.resolve(path) if path and not path.startswith(PLACEHOLDER) else ""
  # The runtime choices (min_rows, fixed_positions, ...), as at load (ModelPair.load).
  return exp.pair.runtime(driver.architecture(role, local, getattr(exp, f"{role}_format"),
                                              getattr(exp, f"{role}_preset"), exp.dtype,
                                              ("bind", "Experiment.")), role)


class RunnerPrograms(driver.ProgramList):
  """The run's programs (``LABELS``) and roofline pieces. ``programs``: a
  subset (empty: the pieces alone); ``widths``: the target pieces' widths."""

  def __init__(self, exp: Experiment, alpha_only: bool = False,
               programs: Optional[Sequence[str]] = None, roofline: bool = True,
               configs: Sequence[str] = (), widths: Optional[Sequence[int]] = None):
    self.settings, self.alpha_only, self.roofline = exp, alpha_only, roofline
    self.widths = widths
    self.names = list(programs if programs is not None else
                      ("baseline", "alpha") if alpha_only
                      else ("speculative", "baseline", "draft"))
    self.configs = [Path(c).stem for c in configs]
    self.checkable = exp

  def validate(self) -> list:
    exp = self.settings
    self.checkable, unread = _checkable(exp)
    self.checkable.validate()
    if self.alpha_only and exp.gamma == "auto":
      raise ValueError("Experiment.gamma='auto' chooses γ from timed speculative pieces; "
                       "--alpha_only uses no γ: bind a number (or drop --alpha_only)")
    if exp.draft_shortlist:
      raise ValueError("Experiment.draft_shortlist: the dry run does not model a shortlisted "
                       "draft (its token list is read from a file); bind "
                       "Experiment.draft_shortlist = '' to compile the full-vocabulary draft")
    if "corpus" in drafts.requires(exp.draft_name):
      raise ValueError(f"approximation model {exp.draft_name!r} is estimated from a corpus "
                       "when the run starts; the dry run reads no data, so it compiles drafts "
                       "built without any ('t5', 'lookup_t5', 'prompt_lookup')")
    return unread

  def architectures(self) -> tuple[T5Config, Optional[T5Config]]:
    target = _architecture(self.checkable, "target")
    if not _has_weights(self.settings):
      return target, None
    draft = _architecture(self.checkable, "draft")
    data.check_vocab_compatible(target.vocab_size, draft.vocab_size,
                                target_pad_id=target.pad_id, draft_pad_id=draft.pad_id,
                                target_eos_id=target.eos_id, draft_eos_id=draft.eos_id)
    return target, draft

  def partitioners(self, ctx: Context) -> tuple[Optional[Partitioner], Optional[Partitioner]]:
    exp = self.settings
    try:
      parts = driver.mesh_partitioners(
          exp.mesh_shape, exp.logical_axis_rules,
          exp.draft_logical_axis_rules or partitioning.DATA_PARALLEL_RULES,
          exp.partition_fallback, ctx.devices)
    except partitioning.PartitioningError as e:
      raise ValueError(f"{ctx.where}: Experiment.mesh_shape: {e}") from None
    check_partitioning(self.checkable, *parts)
    return parts

  def resident(self, ctx: Context) -> dict[str, int]:
    return estimate_bytes(self.checkable, self.alpha_only)

  def too_big(self, ctx: Context) -> str:
    need = sum(ctx.resident.values())
    detail = ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in ctx.resident.items())
    return (f"the row does not fit: its weights and caches need {need / GiB:.2f} GiB per "
            f"device ({detail}; memory.plan) but a {ctx.chip.label} chip has "
            f"{ctx.chip.hbm_bytes / GiB:.0f} GiB of HBM; shard over more chips "
            "(Experiment.mesh_shape), use bfloat16 weights or lower Experiment.batch_size / "
            "max_decode_len")

  def programs(self, ctx: Context) -> list[Compile]:
    lowerers = _lowerers(ctx)
    est = _estimates(ctx)
    names = [n for n in self.names if n != "draft" or ctx.draft_config is not None]
    specs = [Compile(LABELS[n], lowerers[n], est[n], key=n) for n in names]
    if self.roofline and not self.alpha_only:
      specs += piece_compiles(ctx, self.widths)
    return specs

  def finish(self, ctx: Context, compiled: dict) -> "RunDryRun":
    exp = self.settings
    programs = [compiled[n] for n in self.names if n in compiled]
    title = f"Dry run of {' + '.join(self.configs) or 'the experiment'}"
    out = RunDryRun(ctx, programs, title=title, paper=paper_row(exp))
    pieces = {k: p for k, p in compiled.items() if isinstance(k, tuple)}
    if pieces and not any(p.error for p in pieces.values()):
      tcfg, dcfg = ctx.target_config, ctx.draft_config
      n = len(ctx.devices)
      out.roofline = Roofline(
          ctx.chip,
          {k: extrapolate(pieces, "target", k, tcfg.num_decoder_layers, n)
           for k in sorted({k for role, _, k in pieces if role == "target"})},
          extrapolate(pieces, "draft", 1, dcfg.num_decoder_layers, n) if dcfg else None,
          memory.step_weight_bytes(tcfg, ctx.target_part, exp.param_dtype),
          memory.step_weight_bytes(dcfg, ctx.draft_part, exp.param_dtype, draft_quant(exp))
          if dcfg else 0,
          # A block draft's proposal is one call (``Roofline.round_cost``).
          extrapolate(pieces, "draft", block_width(exp), dcfg.num_decoder_layers, n)
          if dcfg and block_width(exp) else None)
    return out


def dry_run(exp: Experiment, topology: str, alpha_only: bool = False,
            programs: Optional[Sequence[str]] = None, roofline: bool = True,
            workers: Optional[int] = None, widths: Optional[Sequence[int]] = None) -> "RunDryRun":
  """``driver.dry_run`` of the run's programs (``RunnerPrograms``)."""
  return driver.dry_run(RunnerPrograms(exp, alpha_only, programs, roofline, widths=widths),
                        topology, workers)


def draft_quant(exp: Experiment) -> Optional[str]:
  """The draft's weight-only quantization as the run loads it; None without weights."""
  return None if not _has_weights(exp) else exp.pair.quantization_of_draft()


def _cache(cfg: T5Config, part: Optional[Partitioner], device: Any, batch: int, input_len: int,
           cache_len: int):
  """An abstract ``DecoderCache`` pinned as ``partitioning.constrain_cache`` pins it."""
  shapes = memory.cache_shapes(cfg, batch, input_len, cache_len)
  return jax.tree.map(lambda x: sharded(part, device, CACHE_AXES if x.ndim == 4
                                        else ("batch", "length"), x.shape, x.dtype, "cache"),
                      shapes)


@functools.partial(jax.jit, static_argnames=("gamma", "cache_len", "sampling", "tree"))
def draft_round(draft: Any, inputs: jax.Array, key: jax.Array, *, gamma: int, cache_len: int,
                sampling: SamplingConfig, tree: Optional[TreeShape | DynamicTree] = None
                ) -> tuple[jax.Array, jax.Array]:
  """The draft's init and one round from an empty prefix -> (tokens [B, γ],
  q [B, γ, V]); with a ``tree``, one tree proposal ([B, N], [B, N, V])."""
  b = inputs.shape[0]
  state = draft.init(inputs, cache_len)
  seq = jnp.zeros((b, cache_len + 1), jnp.int32)
  length = jnp.zeros((b,), jnp.int32)
  if isinstance(tree, DynamicTree):
    return dynamic_tree_proposal(draft, state, seq, length, tree, sampling, key)[:2]
  if tree is not None:
    return tree_proposal(draft, state, seq, length, tree, sampling, key)[:2]
  tokens, q, _ = draft.propose(state, seq, length, gamma, sampling, key)
  return tokens, q


def _pass(model: T5Model, part: Optional[Partitioner]) -> Callable:
  def one_pass(params, tokens, positions, cache):
    logits, cache = model.decode(params, tokens, positions, cache)
    return logits, partitioning.constrain_cache(cache, part, "cache")
  return one_pass


def lower_pass(cfg: T5Config, part: Optional[Partitioner], device: Any, exp: Experiment,
               k: int, cache_len: int, quant: Optional[str] = None) -> Any:
  """One decoder pass over k positions, lowered alone, weights in the
  compiler's preferred layout (the loops copy them so once per call,
  ``hlo.weight_copies``). ``quant``: a quantized draft's kernels."""
  b = exp.batch_size
  params = abstract_params(cfg, part, exp.param_dtype, device, quant)
  tokens = sharded(part, device, ("batch", None), (b, k), jnp.int32, "tokens")
  cache = _cache(cfg, part, device, b, exp.max_input_len, cache_len)
  return _lower_auto(_pass(T5Model(cfg), part), params, tokens, tokens, cache)


def _lower_auto(fn: Callable, params: Any, *args: Any) -> Any:
  """``fn(params, *args)`` lowered with the weights in ``Layout.AUTO`` and the
  cache (argument 3) donated."""
  shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
  formats = jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), params)
  return jax.jit(fn, donate_argnums=(3,), in_shardings=(formats, *map(shardings, args))
                 ).lower(params, *args)


def _tree_pass(model: T5Model, part: Optional[Partitioner],
               tree: TreeShape | DynamicTree) -> Callable:
  def one_pass(params, tokens, lengths, cache, parents):
    shape = tree
    if isinstance(tree, DynamicTree):  # the round's parents are data
      shape = RoundTree.from_parents(parents, tree.max_depth, tree.max_branching)
    return model.decode_tree(params, tokens, lengths, shape, cache, partitioner=part)
  return one_pass


def lower_tree_pass(cfg: T5Config, part: Optional[Partitioner], device: Any, exp: Experiment,
                    tree: TreeShape | DynamicTree, cache_len: int) -> Any:
  """One pass over a tree's N nodes (``T5Model.decode_tree``), lowered as
  ``lower_pass``; a ``DynamicTree``'s takes the round's parents [B, N]."""
  b = exp.batch_size
  params = abstract_params(cfg, part, exp.param_dtype, device)
  tokens = sharded(part, device, ("batch", None), (b, tree.num_nodes), jnp.int32, "tokens")
  lengths = sharded(part, device, ("batch",), (b,), jnp.int32, "lengths")
  cache = _cache(cfg, part, device, b, exp.max_input_len, cache_len)
  return _lower_auto(_tree_pass(T5Model(cfg), part, tree), params, tokens, lengths, cache, tokens)


def _lowerers(ctx: Context) -> dict[str, Callable[[], Any]]:
  """Program name -> a thunk lowering it on abstract arrays."""
  exp, device, tp, dp = ctx.settings, ctx.device, ctx.target_part, ctx.draft_part
  gamma = exp.gamma_max
  target = T5Model(ctx.target_config)
  b, s, t = exp.batch_size, exp.max_input_len, exp.max_decode_len
  tparams = abstract_params(ctx.target_config, tp, exp.param_dtype, device)
  kw: dict[str, Any] = dict(vocab_size=ctx.target_config.vocab_size, vocab=None,
                            max_ngram=exp.prompt_lookup_max_ngram)
  if dp is not None:
    kw["partitioner"] = dp
  if ctx.draft_config is not None:
    kw.update(model=T5Model(ctx.draft_config), bridge=None,
              params=abstract_params(ctx.draft_config, dp, exp.param_dtype, device,
                                     draft_quant(exp)))
    if block_width(exp):  # a block draft's mask embedding (its values do not matter here)
      kw["block"] = t5_block.zeros(kw["model"])
  draft = drafts.build(exp.draft_name, **kw)
  inputs = sharded(tp, device, ("batch", None), (b, s), jnp.int32, "inputs")
  key = abstract_key(tp, device)
  loop_kw = dict(max_decode_len=t, sampling=exp.sampling, eos_id=ctx.target_config.eos_id,
                 partitioner=tp)
  return {
      "baseline": lambda: temperature_sample.lower(target, tparams, inputs, key, **loop_kw),
      "speculative": lambda: speculative_decode.lower(
          target, tparams, draft, inputs, key, gamma=gamma, lenience=exp.lenience,
          adaptive=exp.adaptive, **loop_kw) if exp.tree_shape is None else
      tree_speculative_decode.lower(target, tparams, draft, inputs, key, tree=exp.tree_shape,
                                    **loop_kw),
      "draft": lambda: draft_round.lower(draft, inputs, key, gamma=gamma,
                                         cache_len=cache_length(t, gamma), sampling=exp.sampling,
                                         tree=exp.tree_shape),
      "alpha": lambda: min_pq_along.lower(
          target, tparams, draft, inputs,
          sharded(tp, device, ("batch", None), (b, t), jnp.int32, "tokens"),
          sharded(tp, device, ("batch",), (b,), jnp.int32, "lengths"), exp.sampling),
  }


def piece_compiles(ctx: Context, widths: Optional[Sequence[int]] = None,
                   roles: Sequence[str] = ("target", "draft")) -> list[Compile]:
  """The roofline's pieces at each of ``PIECE_DEPTHS``, keyed (role, depth,
  k): target passes over ``widths`` (default 1 .. γ+1) and a draft step (and
  a block draft's call)."""
  exp, device = ctx.settings, ctx.device
  gamma, tree = exp.gamma_max, exp.tree_shape
  cache_len = cache_length(exp.max_decode_len, gamma)
  if widths is None:  # a tree run: a one-position pass and the tree's own pass
    widths = (1, gamma + 1) if tree is not None else tuple(range(1, gamma + 2))
  out = []
  for depth in PIECE_DEPTHS:
    if "target" in roles:
      tcfg = ctx.target_config.replace(num_decoder_layers=depth, num_encoder_layers=1)
      for k in widths:
        if tree is not None and k == tree.num_nodes > 1:
          lower = functools.partial(lower_tree_pass, tcfg, ctx.target_part, device, exp, tree,
                                    cache_len)
          label = f"target tree pass N={k} depth {depth}"
        else:
          lower = functools.partial(lower_pass, tcfg, ctx.target_part, device, exp, k, cache_len)
          label = f"target pass k={k} depth {depth}"
        out.append(Compile(label, lower, options=PIECE_OPTIONS, key=("target", depth, k)))
    if ctx.draft_config is not None and "draft" in roles:
      dcfg = ctx.draft_config.replace(num_decoder_layers=depth, num_encoder_layers=1)
      for k in (1, block_width(exp)):
        if k:
          label = "draft step" if k == 1 else f"draft block call k={k}"
          out.append(Compile(f"{label} depth {depth}",
                             functools.partial(lower_pass, dcfg, ctx.draft_part, device, exp,
                                               k, cache_len, draft_quant(exp)),
                             options=PIECE_OPTIONS, key=("draft", depth, k)))
  return out


def _estimates(ctx: Context) -> dict[str, int]:
  """memory.plan's bytes for what each program holds resident."""
  exp = ctx.settings
  plan = memory.plan(ctx.target_config, ctx.draft_config, exp.mesh_shape, exp.param_dtype,
                     exp.dtype, exp.batch_size, exp.max_input_len, exp.max_decode_len,
                     exp.gamma_max, exp.logical_axis_rules, exp.draft_logical_axis_rules,
                     exp.partition_fallback, draft_quant(exp))
  part = memory.planning_partitioner(exp.mesh_shape, exp.logical_axis_rules, exp.partition_fallback)
  base_cache = memory.cache_bytes(ctx.target_config, part, exp.batch_size, exp.max_input_len,
                                  exp.max_decode_len, exp.dtype, "target cache")
  pq = 3 * exp.batch_size * exp.max_decode_len * ctx.target_config.vocab_size * 4
  return {"baseline": plan["target_params"] + base_cache, "speculative": plan["total"],
          "draft": plan["draft_params"] + plan["draft_caches"],
          "alpha": plan["target_params"] + plan["draft_params"] + plan["draft_caches"] + pq}


@dataclasses.dataclass
class RunDryRun(DryRun):
  """The run's dry run: its programs, the roofline model and the paper's row."""

  roofline: Optional[Roofline] = None
  paper: Optional[paper.Row] = None

  @property
  def exp(self) -> Experiment:
    return self.ctx.settings

  def round_cost(self) -> Optional[RoundCost]:
    """The modelled round (a chain at γ, or the run's tree); None unless priced."""
    if not self._priced():
      return None
    tree = self.exp.tree_shape
    return self.roofline.round_cost(self.exp.gamma_max) if tree is None else \
        self.roofline.tree_round_cost(tree)

  def tokens_per_round(self) -> float:
    """Expected tokens per round at the paper's α (Eq. (1); a tree: at rank
    rates scaled from it, an assumption)."""
    tree = self.exp.tree_shape
    if tree is None:
      return self.round_cost().expected_tokens(self.paper.alpha)
    rates = scaled_rank_rates(self.paper.alpha, DEMO_RANK_PROFILE)
    return priced_tree(tree, rates).expected_tokens(rates)

  def predicted(self, with_v: bool = False) -> Optional[float]:
    """Theorem 3.8 at the paper's α and the model's c (with v(γ + 1) if
    ``with_v`` or a tree run)."""
    cost = self.round_cost()
    if cost is None:
      return None
    return float(cost.speedup(self.tokens_per_round(),
                              with_v=with_v or self.exp.tree_shape is not None))

  def speculative_ms_per_token(self) -> Optional[float]:
    """The model's milliseconds per token at the paper's α."""
    cost = self.round_cost()
    ms = math.nan if cost is None else cost.ms_per_token(self.tokens_per_round())
    return None if math.isnan(ms) else ms

  def _priced(self) -> bool:
    return self.roofline is not None and self.paper is not None and \
        self.roofline.draft is not None

  def settings_lines(self) -> list[str]:
    e, s = self.exp, self.exp.sampling
    draft = (f"draft {e.draft_preset or e.draft_name}" if self.ctx.draft_config is not None
             else f"draft {e.draft_name} (no weights)")
    mesh = f"mesh (data, model) = {tuple(e.mesh_shape)}" if e.mesh_shape else "one device"
    if self.ctx.draft_config is not None and draft_quant(e):
      draft += f" (kernels {draft_quant(e)}, per-channel scales)"
    return [f"target {e.target_preset or 'from config.json'}, {draft}; {mesh}; weights "
            f"{e.param_dtype}, activations {e.dtype}; batch {e.batch_size}, input "
            f"{e.max_input_len}, decode {e.max_decode_len}, γ {e.gamma_max}"
            + (" (γ_max; adaptive widths "
               f"{e.adaptive.verify_widths(e.gamma_max)})" if e.adaptive else "")
            + (" ('auto' compiles the γ it picks; this is its largest)"
               if e.gamma == "auto" else "")
            + f", temperature {s.temperature:g}",
            "memory.plan estimate per device: " + ", ".join(
                f"{k} {gib(v)}" for k, v in self.ctx.resident.items())]

  def table_note(self) -> str:
    return ("'fits' compares arguments + temporaries + outputs with "
            f"{self.chip.hbm_bytes / GiB:.0f} GiB")

  def code_note(self) -> str:
    return ("estimate: memory.plan's weights and caches, which leaves out XLA temporaries; "
            "arguments include the inputs and the key; ")

  def summary_lines(self) -> list[str]:
    return summary_lines(self)

  def closing_lines(self) -> list[str]:
    fits = "fits" if self.fits else "does NOT fit"
    return roofline_lines(self) + [
        "", f"Largest program: {gib(self.memory)} per device, {fits} in "
        f"{self.chip.hbm_bytes / GiB:.0f} GiB. Dry run took {self.wall_s:.0f} s."]


def summary_lines(r: RunDryRun) -> list[str]:
  """The prediction in one sentence for the short report, beside the paper."""
  rl, row = r.roofline, r.paper
  if rl is None or rl.draft is None:
    return []
  head = (f"Prediction (a cost model, not a measurement): the draft costs c = {rl.c():.3f} of "
          "a target step")
  if rl.block is not None:
    head += (f" a step, and its block proposal one call of {rl.block_c():.3f} "
             f"({rl.block_c() / rl.c():.2f} draft steps) a round")
  base = rl.baseline_ms_per_token()
  if row is None:
    return [head + f", the baseline {base:.3f} ms per token; the paper has no row for this "
            "task, draft and temperature, so no α to predict a speedup at."]
  return [head + f"; at the paper's α = {row.alpha}, {r.speculative_ms_per_token():.3f} ms per "
          f"token against the baseline's {base:.3f}, {r.predicted(True):.2f}× (the paper "
          f"measured {row.speedup}× with c = {row.c} on one {paper.CHIP})."]


def roofline_lines(r: RunDryRun) -> list[str]:
  """The roofline's pieces, c, v(k) and Theorem 3.8's prediction."""
  rl, chip = r.roofline, r.chip
  if rl is None:
    return []
  lines = ["", f"Roofline MODEL, not a measurement: each piece compiled on its own and "
           f"priced as max(flops / {chip.peak_flops / 1e12:.0f} TFLOP/s, bytes / "
           f"{chip.hbm_bandwidth / 1e9:.0f} GB/s) ({chip.label}'s published bf16 peak and "
           f"HBM bandwidth, {chip.source}) + its collectives (hops x "
           f"{chip.hop_latency * 1e6:g} µs per hop, assumed, + bytes / "
           f"{2 * chip.ici_link_bandwidth / 1e9:.0f} GB/s over an ICI link both ways; "
           f"{chip.ici_source}) + operations x {chip.op_seconds * 1e6:.3g} µs "
           f"({chip.op_source}).",
           f"  {'piece':24s} {'GFLOP':>9s} {'GB read':>9s} {'ops':>6s} {'coll.':>6s} "
           f"{'roofline':>9s} {'+coll.':>8s} {'+fixed':>8s} {'µs':>9s}  largest"]
  tree = r.exp.tree_shape
  rows = [(f"target tree pass, N={k}" if tree is not None and k == tree.num_nodes > 1
           else f"target pass, k={k}", p) for k, p in rl.target.items()]
  if rl.draft is not None:
    rows.append(("draft step (k=1)", rl.draft))
  if rl.block is not None:
    rows.append((f"draft block call, k={block_width(r.exp)}", rl.block))
  lines += [f"  {label:24s} {p.flops / 1e9:9.2f} {p.bytes / 1e9:9.3f} {p.ops:6.0f} "
            f"{sum(n for _, n in p.collectives):6.0f} {1e6 * p.roofline_seconds(chip):9.1f} "
            f"{1e6 * p.collective_seconds(chip):8.1f} {1e6 * p.fixed_seconds(chip):8.1f} "
            f"{1e6 * p.seconds(chip):9.1f}  {p.bound(chip)}" for label, p in rows]
  last = max(rl.target)
  lines.append(f"  bytes read per target pass / floor (the decoder and output-layer weights "
               f"each device reads per step, {size(rl.floor)}): "
               f"{rl.target[1].bytes / rl.floor:.2f}x at k=1, "
               f"{rl.target[last].bytes / rl.floor:.2f}x at k={last}"
               + (f"; draft step / its floor ({size(rl.draft_floor)}): "
                  f"{rl.draft.bytes / rl.draft_floor:.2f}x" if rl.draft and rl.draft_floor
                  else ""))
  lines.append("  v(k) = " + ", ".join(f"{k}: {rl.v(k):.3f}" for k in rl.target))
  if rl.block is not None:
    lines.append(f"  block draft: a round's proposal is one call over {block_width(r.exp)} "
                 f"positions, {rl.block_c():.4f} of a target step ({rl.block_c() / rl.c():.2f} "
                 "draft steps)")
  if rl.draft is not None:
    lines += prediction_lines(r)
  return lines


def prediction_lines(r: RunDryRun) -> list[str]:
  """c, ms per token and Theorem 3.8 at the paper's α, beside the paper's
  measured speedup and Theorem 3.8 at its own α, γ and c (Table 4)."""
  rl, row, e = r.roofline, r.paper, r.exp
  base_ms = rl.baseline_ms_per_token()
  if row is None:
    return [f"  predicted c = {rl.c():.4f}; baseline {base_ms:.3f} ms/token",
            "  no paper row for this task, draft and temperature: no α to predict at"]
  caveat = "" if e.target_preset == "t5_1_1_xxl" else (
      " (the paper's α is for T5 1.1 XXL with this draft size; these models differ)")
  spec_ms = r.speculative_ms_per_token()
  tree = e.tree_shape
  if tree is None:
    theorem = (f"  Theorem 3.8 at the paper's α = {row.alpha} (Table 3){caveat}, "
               f"γ = {e.gamma_max}: predicted {r.predicted():.2f}x (with v({e.gamma_max + 1}): "
               f"{r.predicted(True):.2f}x)")
  else:
    rates = scaled_rank_rates(row.alpha, DEMO_RANK_PROFILE)
    calls = 1 if rl.block is not None else tree.max_depth  # a block draft: one call
    per_round = (" chosen per round, priced as the best static tree of its size at these "
                 "rates (an assumption)" if isinstance(tree, DynamicTree) else "")
    theorem = (f"  The tree ({tree.num_nodes} nodes, depth {tree.max_depth}{per_round}) at the "
               f"paper's α = {row.alpha}{caveat}, runner-up draft choices accepted at the demo "
               f"pair's fall-off scaled to it (an assumption): "
               f"{priced_tree(tree, rates).expected_tokens(rates):.2f} tokens per round of "
               f"{calls} draft call{'s' if calls != 1 else ''} and one "
               f"{tree.num_nodes}-node pass: predicted "
               f"{r.predicted():.2f}x")
  lines = [f"  predicted c = {rl.c():.4f} (paper, Table 4: {row.c})",
           theorem + f"; the paper measured {row.speedup}x (Table 2, γ = {row.gamma}, "
           f"{paper.CHIP}); Theorem 3.8 at the paper's α {row.alpha}, γ {row.gamma}, "
           f"c {row.c}: {row.theorem():.2f}x",
           f"  model on {r.num_devices} {r.chip.label} chip(s), ms/token: baseline {base_ms:.3f}, "
           f"speculative {spec_ms:.3f} (the paper publishes none)"]
  if e.adaptive is not None:
    lines.append("  adaptive draft lengths are not Theorem 3.8's fixed γ: the prediction "
                 "above is for a fixed γ = γ_max")
  return lines
