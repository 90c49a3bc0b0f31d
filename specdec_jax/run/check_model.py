r"""``--calibrate=v4:1x1x1``: the dry run's cost model beside one real run's
costs: the target's step, v(k), c (Definition 3.7) and, on a mesh, one loop
iteration's collectives, each beside the model's, with Theorem 3.8 from both
and the cost per operation that makes the model's c the measured one;
``calibrate.json`` keeps it all."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specdec_jax import paper, storage, theory, timing
from specdec_jax.dryrun import chips, costs
from specdec_jax.dryrun.costs import Roofline
from specdec_jax.run import calibrate, dry_run_programs, hosts
from specdec_jax.run.settings import Experiment
from specdec_jax.run.setup import check_before_loading, load_data, load_models
from specdec_jax.run.workdir import check_workdir

FILENAME = "calibrate.json"
AUTO = "auto"
# Collectives the timing knows how to run (``_collective_body``).
TIMED_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def check_flags(calibrate_flag: str, dry_run: Optional[str], alpha_only: bool) -> None:
  """One line for a flag ``--calibrate`` cannot be combined with."""
  if dry_run:
    raise ValueError(f"--calibrate={calibrate_flag} and --dry_run={dry_run}: choose one "
                     "(--dry_run compiles for a TPU and runs nothing; --calibrate measures "
                     "on this machine and sets the dry run's model beside it)")
  if alpha_only:
    raise ValueError(f"--calibrate={calibrate_flag} measures the speculative pieces (c, v); "
                     "drop --alpha_only")


def parse_flag(value: str) -> str:
  """``value`` if it is 'auto' or a known topology, checked before libtpu loads."""
  if value == AUTO:
    return value
  try:
    chips.parse_topology(value)
  except ValueError:
    raise ValueError(f"--calibrate={value!r}: unknown TPU topology; expected CHIP:GRID with "
                     f"CHIP one of {', '.join(chips.CHIPS)}, e.g. {chips.EXAMPLES}; or "
                     "'auto' on a TPU VM") from None
  return value


def topology_of(devices: Sequence[Any]) -> str:
  """The topology string of TPU ``devices``, e.g. 'v4:1x1x1' or 'v5e:2x4'."""
  platform = devices[0].platform
  if platform != "tpu":
    raise ValueError(f"--calibrate=auto: the devices here are {platform}, not TPUs; name the "
                     "topology to model, e.g. --calibrate=v4:1x1x1")
  kind = devices[0].device_kind
  chip = next((c for c in chips.CHIPS.values() if c.device_kind == kind), None)
  if chip is None:
    raise ValueError(f"--calibrate=auto: the dry run has no figures for {kind!r}; it knows "
                     f"{', '.join(c.device_kind for c in chips.CHIPS.values())}")
  coords = np.asarray([tuple(d.coords) for d in devices])
  dims = 2 if "lite" in chip.device_kind else 3  # v5e:2x4, v6e:2x4; v4:2x2x1, v5p:2x2x1
  grid = coords[:, :dims].max(0) - coords[:, :dims].min(0) + 1
  return f"{chip.name}:{'x'.join(str(int(g)) for g in grid)}"


def run_devices(exp: Experiment) -> list:
  """The devices a run of ``exp`` uses (the first ones, as the mesh takes them)."""
  return list(jax.devices())[:math.prod(exp.mesh_shape) if exp.mesh_shape else 1]


def machine_note(devices: Sequence[Any], topology: str) -> Optional[str]:
  """None where ``devices`` are the topology's chips; else why not to compare."""
  chip, grid = chips.parse_topology(topology)
  n = math.prod(grid)
  d = devices[0]
  if d.platform == "tpu" and d.device_kind == chip.device_kind and len(devices) == n:
    return None
  here = d.platform if d.platform != "tpu" else d.device_kind
  return (f"measured on {here} ({len(devices)} device{'s' * (len(devices) != 1)}), model for "
          f"{topology} ({n} {chip.label} chip{'s' * (n != 1)}): compare only on that TPU")


@dataclasses.dataclass(frozen=True)
class Side:
  """One column of the comparison (milliseconds, ratios, microseconds)."""

  step_ms: float                  # the target's one-token step
  v: dict                         # k -> v(k), a pass over k positions / one
  draft_step_ms: Optional[float]  # the draft's step (measured: per proposed token)
  c: Optional[float]              # Definition 3.7
  collectives_us: Optional[float]  # one loop iteration's; None: none run (one device)


def loop_collectives(rl: Roofline, gamma: int) -> dict:
  """(kind, bytes per device, group) -> count in one modelled loop iteration
  (γ draft steps and a target pass over γ+1 positions)."""
  out: dict = {}
  pieces = [(rl.target[gamma + 1], 1)] + ([(rl.draft, gamma)] if rl.draft is not None else [])
  for piece, times in pieces:
    for key, n in piece.collectives:
      out[key] = out.get(key, 0) + n * times
  return out


def modelled(rl: Roofline, gamma: int) -> Side:
  """The model's column: its pieces priced on its chip."""
  chip = rl.chip
  loop = loop_collectives(rl, gamma)
  us = 1e6 * sum(n * costs.collective_seconds(kind, nb, g, chip)
                 for (kind, nb, g), n in loop.items())
  return Side(1e3 * rl.target[1].seconds(chip), {k: rl.v(k) for k in sorted(rl.target)},
              1e3 * rl.draft.seconds(chip) if rl.draft is not None else None,
              rl.c() if rl.draft is not None else None, us)


def measured(per_gamma: dict, gamma: int, collectives_us: Optional[float]) -> Side:
  """The measured column from ``calibrate.costs_many`` at γ' = 1 .. γ."""
  at = per_gamma[gamma]
  v = {1: 1.0, **{g + 1: per_gamma[g].v for g in sorted(per_gamma)}}
  return Side(at.step_ms, v, at.c * at.step_ms, at.c, collectives_us)


def model_side(exp: Experiment, topology: str) -> tuple[dry_run_programs.RunDryRun, list[str]]:
  """The dry run's priced pieces for ``exp`` on ``topology`` and notes on what
  the model leaves out (a shortlist)."""
  notes = []
  if exp.draft_shortlist:
    notes.append("the model prices the draft over its full vocabulary (the run's draft "
                 "uses a shortlist)")
    exp = dataclasses.replace(exp, draft_shortlist="")
  try:
    r = dry_run_programs.dry_run(exp, topology, programs=(), roofline=True)
  except ValueError as e:
    raise ValueError(str(e).replace(f"--dry_run={topology}", f"--calibrate={topology}")) \
        from None
  if r.roofline is None:
    raise ValueError(f"--calibrate={topology}: the dry run could not compile the priced pieces "
                     f"for this row; --dry_run={topology} says why")
  return r, notes


def _dtype_for(nbytes: int, dtype: str) -> Any:
  """The activations' dtype where it divides ``nbytes``, else bytes."""
  d = jnp.dtype(dtype)
  return d if nbytes % d.itemsize == 0 else jnp.dtype(jnp.uint8)


def group_mesh(mesh: Mesh, group: int) -> Optional[Mesh]:
  """A ('rest', 'group') mesh whose rows are replica groups of ``group``
  devices (along a mesh axis of that size, else consecutive); None if
  ``group`` does not divide the mesh."""
  devs = np.asarray(mesh.devices)
  for axis in reversed(range(devs.ndim)):
    if devs.shape[axis] == group:
      return Mesh(np.moveaxis(devs, axis, -1).reshape(-1, group), ("rest", "group"))
  if group < 1 or devs.size % group:
    return None
  return Mesh(devs.reshape(-1, group), ("rest", "group"))


def _collective_body(kind: str, group: int) -> Any:
  """x -> x after one collective of ``kind`` over 'group', shape kept (so none is hoisted)."""
  ax = "group"
  if kind == "all-reduce":
    return lambda x: jax.lax.psum(x, ax)
  if kind == "all-gather":
    return lambda x: jax.lax.all_gather(x, ax, tiled=True)[:x.shape[0]]
  if kind == "reduce-scatter":
    return lambda x: jax.lax.dynamic_update_slice(x, jax.lax.psum_scatter(x, ax, tiled=True), (0,))
  if kind == "all-to-all":
    return lambda x: jax.lax.all_to_all(x, ax, 0, 0, tiled=True)
  if kind == "collective-permute":
    return lambda x: jax.lax.ppermute(x, ax, [(i, (i + 1) % group) for i in range(group)])
  raise ValueError(f"cannot time a {kind}")


def _local_elements(kind: str, nbytes: int, group: int, itemsize: int) -> int:
  """Elements per device of the carry, for a result of ``nbytes`` per device."""
  n = max(1, nbytes // itemsize)
  if kind == "all-gather":
    return max(1, n // group)
  if kind == "reduce-scatter":
    return n * group
  return max(group, n - n % group) if kind == "all-to-all" else n


def time_collectives(mesh: Mesh, keys: Sequence[tuple], dtype: str = "bfloat16",
                     repeats: int = 15, inner: int = 16) -> dict:
  """µs per collective for each (kind, bytes, group) in ``keys``: ``inner``
  back to back in one jitted loop, median over ``repeats``; None for a key
  that cannot run here."""
  fns, out = {}, {}
  for key in keys:
    kind, nbytes, group = key
    sub = group_mesh(mesh, group) if kind in TIMED_KINDS and group > 1 else None
    if sub is None:
      out[key] = None
      continue
    dt = _dtype_for(int(nbytes), dtype)
    m = _local_elements(kind, int(nbytes), group, dt.itemsize)
    spec = PartitionSpec(("rest", "group"))
    body = _collective_body(kind, group)
    loop = jax.jit(jax.shard_map(
        lambda x, body=body: timing.repeat(lambda i, y: (body(y), ()), x, inner)[0],
        mesh=sub, in_specs=spec, out_specs=spec, check_vma=False))
    x = jax.device_put(jnp.zeros((m * sub.devices.size,), dt), NamedSharding(sub, spec))
    fns[key] = functools.partial(loop, x)
  if fns:
    ms = timing.interleaved_medians_ms(fns, repeats, inner)
    out.update({key: 1e3 * t for key, t in ms.items()})
  return out


def measured_collectives_us(partitioner: Any, loop: dict, dtype: str, repeats: int
                            ) -> tuple[Optional[float], dict]:
  """(µs of one loop iteration's collectives, µs each by key); (None, {}) on one device."""
  if partitioner is None or np.asarray(partitioner.mesh.devices).size < 2 or not loop:
    return None, {}
  each = time_collectives(partitioner.mesh, sorted(loop), dtype, repeats)
  return sum(n * (each[k] or 0.0) for k, n in loop.items()), each


def theorem_speedups(side: Side, alpha: float, gamma: int) -> tuple[Optional[float],
                                                                     Optional[float]]:
  """Theorem 3.8 at ``alpha``, ``gamma`` and the side's c: (v = 1, with v(γ+1))."""
  if side.c is None:
    return None, None
  cost = theory.RoundCost(gamma, side.c, side.v[gamma + 1])
  return cost.predicted(alpha, with_v=False), cost.predicted(alpha)


def solve_op_seconds(rl: Roofline, c: float) -> float:
  """The fixed cost per operation at which the model's c equals ``c``."""
  if rl.draft is None:
    raise ValueError("the row's draft has no weights: the model has no c to fit")
  return costs.calibrate_op_seconds(rl.target[1], rl.draft, rl.chip, c)


def with_op_seconds(rl: Roofline, op_seconds: float) -> Roofline:
  """The same model with its chip's fixed cost per operation replaced."""
  return dataclasses.replace(rl, chip=dataclasses.replace(rl.chip, op_seconds=op_seconds))


def chips_line(chip: chips.Chip, op_seconds: float, how: str) -> str:
  """The line of ``specdec_jax/dryrun/chips.py`` that puts ``op_seconds`` in the model."""
  if chip.name == "v4":
    return f"V4_OP_SECONDS = {op_seconds:.4e}  # {how}"
  return f'CHIPS["{chip.name}"]: op_seconds={op_seconds:.4e}, op_source="{how}"'


def rows(meas: Side, model: Side, gamma: int, row: Optional[paper.Row]) -> list[tuple]:
  """(quantity, measured, model) for every quantity compared."""
  out = [("target step (ms)", meas.step_ms, model.step_ms)]
  out += [(f"v({k})", meas.v.get(k), model.v.get(k)) for k in sorted(set(meas.v) | set(model.v))]
  out += [("draft step (ms)", meas.draft_step_ms, model.draft_step_ms),
          ("c", meas.c, model.c),
          ("collectives per loop iteration (µs)", meas.collectives_us, model.collectives_us)]
  if row is not None:
    m, p = theorem_speedups(meas, row.alpha, gamma), theorem_speedups(model, row.alpha, gamma)
    out += [(f"Theorem 3.8 speedup, α {row.alpha}, γ {gamma} (v = 1)", m[0], p[0]),
            (f"  with v({gamma + 1})", m[1], p[1])]
  return out


def _cell(x: Optional[float], what: str) -> str:
  if x is None:
    return "no collectives (one device)" if what.startswith("collectives") else "n/a"
  if x == 0:
    return "0"
  return f"{x:.4f}" if abs(x) < 1 else f"{x:.3f}" if abs(x) < 100 else f"{x:.1f}"


def table(result: dict) -> str:
  """The comparison as text (``result``: what ``calibrate.json`` holds)."""
  lines = [f"Cost model check: measured here ({result['measured_on']}) | the dry run's model "
           f"for {result['topology']} (pieces only, no loop), γ {result['gamma']}"]
  if result["note"]:
    lines.append(f"NOTE: {result['note']}.")
  lines += [f"NOTE: {n}." for n in result["model_notes"]]
  width = max(len(q) for q, _, _ in result["rows"]) + 2
  lines.append(f"  {'quantity':{width}s} {'measured here':>27s} {'model':>10s} "
               f"{'model/measured':>15s}")
  for q, meas, model in result["rows"]:
    r = model / meas if model is not None and meas else None
    lines.append(f"  {q:{width}s} {_cell(meas, q):>27s} {_cell(model, q):>10s} "
                 f"{'' if r is None else f'{r:.2f}':>15s}")
    if q.startswith("collectives"):
      lines += collective_lines(result["collectives"])
  row = result["paper"]
  if row is None:
    lines.append("  (no paper row for this task, draft and temperature: no α for Theorem 3.8)")
  else:
    lines.append(f"  the paper (Table 2, one {paper.CHIP}): c {row['c']}, measured speedup "
                 f"{row['speedup']}x at γ {row['gamma']}"
                 + ("" if result["paper_models"] else "; its α is for T5 1.1 XXL with this "
                    "draft size, and these models differ"))
  fit = result["op_seconds"]
  if fit.get("error"):
    lines.append(f"Fixed cost per operation: {fit['error']}")
  else:
    lines += [f"Fixed cost per operation that makes the model's c equal the measured c: "
              f"{fit['fitted'] * 1e6:.4g} µs (the model has {fit['current'] * 1e6:.4g} µs; "
              f"its c at the fitted cost: {fit['c_at_fitted']:.4f})",
              ("  in specdec_jax/dryrun/chips.py: " if not result["note"] else
               "  NOT for chips.py (measured on another machine); on that TPU the line would "
               "be: ") + fit["chips_line"]]
  return "\n".join(lines)


def collective_lines(collectives: Sequence[dict], most: int = 8) -> list[str]:
  """Per collective of a loop iteration, largest share first, µs measured and modelled."""
  ordered = sorted(collectives, key=lambda c: -c["per_iteration"] * c["model_us"])
  out = [f"    {c['per_iteration']:g} x {c['kind']} of {c['bytes']} B over {c['group']} "
         f"devices: {_cell(c['measured_us'], 'µs')} µs measured, {c['model_us']:.3g} µs "
         "modelled, each" for c in ordered[:most]]
  if len(ordered) > most:
    out.append(f"    ... and {len(ordered) - most} more (calibrate.json)")
  return out


def compare(rl: Roofline, gamma: int, meas: Side, row: Optional[paper.Row], topology: str,
            here: str, note: Optional[str], model_notes: Sequence[str] = (),
            collective_detail: Optional[dict] = None, paper_models: bool = True) -> dict:
  """Everything ``calibrate.json`` holds: both sides, the table's rows, the
  collectives, the paper's row, the model's pieces and the fitted fixed cost."""
  model = modelled(rl, gamma)
  fit: dict[str, Any] = {"current": rl.chip.op_seconds}
  try:
    t = solve_op_seconds(rl, meas.c)
    how = f"measured c = {meas.c:.4f} on {topology} (--calibrate)"
    fit.update(fitted=t, c_at_fitted=with_op_seconds(rl, t).c(),
               chips_line=chips_line(rl.chip, t, how))
  except ValueError as e:
    fit["error"] = str(e)
  loop = loop_collectives(rl, gamma)
  detail = collective_detail or {}
  return {
      "topology": topology, "measured_on": here, "note": note, "comparable": note is None,
      "model_notes": list(model_notes), "gamma": gamma, "paper_models": paper_models,
      "measured": dataclasses.asdict(meas), "model": dataclasses.asdict(model),
      "rows": rows(meas, model, gamma, row),
      "collectives": [{"kind": k, "bytes": nb, "group": g, "per_iteration": n,
                       "model_us": 1e6 * costs.collective_seconds(k, nb, g, rl.chip),
                       "measured_us": detail.get((k, nb, g))}
                      for (k, nb, g), n in sorted(loop.items())],
      "paper": dataclasses.asdict(row) | {"c": row.c} if row is not None else None,
      "chip": rl.chip.name,
      "pieces": {**{f"target k={k}": dataclasses.asdict(p) for k, p in rl.target.items()},
                 **({"draft": dataclasses.asdict(rl.draft)} if rl.draft is not None else {})},
      "op_seconds": fit,
  }


def write(workdir: str, result: dict) -> str:
  """``calibrate.json`` in ``workdir`` (created if need be); its path."""
  path = storage.join(workdir, FILENAME)
  storage.write_bytes(path, (json.dumps(result, indent=2, default=str) + "\n").encode())
  return path


def describe(devices: Sequence[Any]) -> str:
  """'cpu, 1 device' or 'TPU v4, 4 devices'."""
  d = devices[0]
  kind = d.platform if d.platform != "tpu" else d.device_kind
  return f"{kind}, {len(devices)} device{'s' * (len(devices) != 1)}"


def main(exp: Experiment, flag: str, workdir: str, dry_run: Optional[str] = None,
         alpha_only: bool = False) -> dict:
  """``--calibrate=flag``: every check before any weight is read, then the
  measurement, the table and ``calibrate.json``."""
  check_flags(flag, dry_run, alpha_only)
  parse_flag(flag)
  check_workdir(workdir)
  check_before_loading(exp)
  if exp.tree_shape is not None:
    raise ValueError(f"--calibrate={flag}: a tree run's pass is priced with its own mask; "
                     "--calibrate compares a chain (unbind Experiment.tree)")
  devices = run_devices(exp)
  topology = topology_of(devices) if flag == AUTO else flag
  logging.info("Compiling the row's pieces for %s (the dry run's cost model)…", topology)
  r, notes = model_side(exp, topology)
  gamma = r.exp.gamma_max
  logging.info("Loading the target and the draft…")
  setup = load_models(exp, load_data(exp))
  logging.info("Timing c and v for γ = 1..%d on %s (%d interleaved repeats), then the "
               "loop's collectives…", gamma, describe(devices), exp.cost_repeats)
  per_gamma = calibrate.costs_many(setup, range(1, gamma + 1))
  coll_us, each = measured_collectives_us(setup.partitioner, loop_collectives(r.roofline, gamma),
                                          exp.dtype, exp.cost_repeats)
  result = compare(r.roofline, gamma, measured(per_gamma, gamma, coll_us), r.paper, topology,
                   describe(devices), machine_note(devices, topology), notes, each,
                   paper_models=exp.target_preset == "t5_1_1_xxl")
  if hosts.is_writer():
    path = write(workdir, result)
    print(table(result))
    print(f"Wrote {path}; nothing was decoded.")
  return result
