"""The dry run of every Table 2 row on one TPU v4 chip (the paper's setting),
v5e-8, v4-8 and v6e-8 (v5p-8 on request), as markdown tables that make up
docs/dry_run_tables.md (the file is written whole), with the draft the model
predicts fastest per topology.

Usage:
  python scripts/dry_run_table.py [--config_dir=configs/table2 ...]
      [--hardware=v4-1 ...] [--rows=ende_small_t0,...] [--out=docs/dry_run_tables.md]
      [--cache=runs/dry_run_table.json] [--workers=2] [--compile_loops] [--render_only]

Each cell is ``specdec_jax.run.dry_run_programs.dry_run`` of the row's
config with the hardware's overlay (``configs/tpu_*.gin``) for its topology.
By default it compiles the cost model's pieces alone (a target pass over 1
and over γ + 1 positions and a draft step, each at 1 and 2 decoder layers,
extrapolated to the model's depth: seconds per cell) and takes the memory
from ``memory.plan`` (weights and caches per device); ``--compile_loops``
also compiles the speculative loop for the topology, for its memory per
device from the executable (minutes per cell for T5 1.1 XXL on a small CPU).
The columns: memory and whether it fits the chip's HBM, the model's c, its
milliseconds per token (baseline and speculative) and Theorem 3.8's speedup
at the paper's α, beside the paper's measured speedup (Table 2) and Theorem
3.8 at the paper's own α, γ and c (Table 4). Rows come from
``configs/table2`` and, where it exists, ``configs/table2_t5_1_0``; a
repeated ``--config_dir`` replaces that list. Needs libtpu (``pip install -e
'.[tpu]'``) and no accelerator. Every finished cell is kept in ``--cache``
and a rerun compiles only what is missing (delete the file to start over).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from specdec_jax.dryrun import costs, driver
from specdec_jax.run import dry_run_programs
from specdec_jax.dryrun.chips import CHIPS
from specdec_jax.scripting import script_args
from specdec_jax.run.cli import parse_config

from lab import trees

REPO = script_args.REPO_ROOT
# label -> (overlay, topology, mesh as the overlay binds it)
HARDWARE = {
    "v4-1": ("configs/tpu_v4_1.gin", "v4:1x1x1", "(1, 1)"),
    "v4-8": ("configs/tpu_v4_8.gin", "v4:2x2x1", "(1, 4)"),
    "v5e-8": ("configs/tpu_v5e_8.gin", "v5e:2x4", "(1, 8)"),
    "v5p-8": ("configs/tpu_v5p_8.gin", "v5p:2x2x1", "(1, 4)"),
    "v6e-8": ("configs/tpu_v6e_8.gin", "v6e:2x4", "(1, 8)"),
}
DEFAULT_HARDWARE = ("v4-1", "v5e-8", "v4-8", "v6e-8")
# Other drafts for the same rows (extra gin bindings), compiled on VARIANT_HARDWARE.
VARIANTS = {"int8": ("Experiment.draft_quantization = 'int8'",)}
VARIANT_HARDWARE = ("v4-1", "v5e-8")
CONFIG_DIRS = ("configs/table2", "configs/table2_t5_1_0")
DEFAULT_OUT = "docs/dry_run_tables.md"
# The page's head: the file is generated whole (hand-written prose lives in docs/dry_run.md
# and docs/cost_model.md, which link here).
TITLE = """\
# The dry run of every Table 2 row

Generated whole by `python scripts/dry_run_table.py`: do not edit by hand,
run it again. What the dry run is and how the cost model prices each piece:
[dry_run.md](dry_run.md), [cost_model.md](cost_model.md).
"""


def key(row: str, hardware: str, variant: str = "") -> str:
  """A cell's name in the cache: 'ende_small_t0@v4-1', 'ende_small_t0+int8@v4-1'."""
  return f"{Path(row).stem}{'+' + variant if variant else ''}@{hardware}"


def cell(row: str, hardware: str, compile_loop: bool = False, variant: str = "") -> dict:
  """One row on one hardware (with a ``VARIANTS`` entry's bindings): the dry
  run's figures as JSON-ready values. Runs in a worker process (gin's
  settings and JAX's caches are per process; the caches are cleared after
  each cell, or the traced XXL programs pile up)."""
  topology = HARDWARE[hardware][1]
  try:
    exp = parse_config([row, str(REPO / HARDWARE[hardware][0])], list(VARIANTS.get(variant, ())))
    widths = (1, exp.gamma_max + 1)
    r = dry_run_programs.dry_run(exp, topology, programs=("speculative",) if compile_loop else (),
                                workers=1, widths=widths)
  except ValueError as e:
    return {"error": str(e)}
  finally:
    jax.clear_caches()
  if compile_loop:
    p = r.programs[0]
    out: dict[str, Any] = {"memory": p.total, "estimate": p.estimate, "fits": r.fits,
                           "memory_from": "compiled", "compile_s": p.compile_s,
                           "error": p.error}
  else:
    plan = sum(r.ctx.resident.values())
    out = {"memory": plan, "estimate": plan, "fits": plan <= r.chip.hbm_bytes,
           "memory_from": "plan", "error": None}
  out.update(hbm=r.chip.hbm_bytes, gamma=r.exp.gamma_max, wall_s=r.wall_s)
  if r.roofline is not None and r.roofline.draft is not None:
    d = r.roofline.draft
    # The draft step's priced terms, for the token-tree recommendation.
    out["draft_piece"] = [d.flops, d.bytes, d.ops, [list(k) + [n] for k, n in d.collectives]]
    out.update(c=r.roofline.c(), v=r.roofline.v(r.exp.gamma_max + 1),
               ratio=r.roofline.target[1].bytes / r.roofline.floor,
               baseline_ms=r.roofline.baseline_ms_per_token())
  if r.paper is not None:
    out.update(alpha=r.paper.alpha, paper=r.paper.speedup, paper_c=r.paper.c,
               paper_theorem=r.paper.theorem(),
               predicted=r.predicted(), predicted_v=r.predicted(True))
    if r.roofline is not None and r.roofline.draft is not None:
      out["speculative_ms"] = r.speculative_ms_per_token()
  return out


def _cell_text(c: Optional[dict]) -> str:
  if c is None:
    return "not run"
  if c.get("error") and "memory" not in c:
    return "NO: " + ("does not fit (plan)" if "does not fit" in c["error"] else c["error"][:60])
  if c.get("error"):
    return "NO: " + c["error"][:60]
  gib = c["memory"] / 2 ** 30
  text = f"{gib:.2f} GiB{' (plan)' if c.get('memory_from') == 'plan' else ''} " \
      f"{'ok' if c['fits'] else 'NO'}"
  if c.get("predicted") is not None:
    text += f", {c['predicted']:.2f}x ({c['predicted_v']:.2f}x with v), c {c['c']:.3f}"
  if c.get("baseline_ms") is not None:
    text += f", {c['baseline_ms']:.2f} ms/token baseline"
    if c.get("speculative_ms") is not None:
      text += f", {c['speculative_ms']:.2f} speculative"
  return text


def _group(stem: str) -> tuple[str, str, str, str]:
  """(family, task, draft size, temperature) of a row's config name."""
  family = "T5 1.0" if stem.startswith("t5_1_0_") else "T5 1.1"
  task, size, temp = stem.removeprefix("t5_1_0_").split("_")
  return family, task, size, temp


def _num(c: Optional[dict], key: str, fmt: str) -> str:
  return "-" if not c or c.get(key) is None else format(c[key], fmt)


def topology_table(rows: list[str], hardware: str, cells: dict) -> str:
  """One topology's table: a row per config."""
  head = ["row", "γ", "paper α", "paper speedup", "Thm 3.8 at paper's c", "memory GiB",
          "c", "v(γ+1)", "baseline ms/token", "speculative ms/token", "Thm 3.8 at model's c",
          "with v"]
  variants = [v for v in VARIANTS if any(key(r, hardware, v) in cells for r in rows)]
  for v in variants:
    head += [f"{v} draft: c", f"{v}: speculative ms/token", f"{v}: Thm 3.8 with v"]
  body = []
  for row in rows:
    name = Path(row).stem
    c = cells.get(f"{name}@{hardware}")
    extra = []
    for v in variants:
      cv = cells.get(key(row, hardware, v))
      extra += [_num(cv, "c", ".4f"), _num(cv, "speculative_ms", ".2f"),
                _num(cv, "predicted_v", ".2f") + ("x" if cv and cv.get("predicted_v") else "")]
    if c is None or (c.get("error") and "memory" not in c):
      why = "not run" if c is None else "does not fit (plan)" if "does not fit" in c[
          "error"] else c["error"][:80]
      body.append([name] + ["-"] * 4 + [why] + ["-"] * 6 + extra)
      continue
    mem = f"{c['memory'] / 2 ** 30:.2f}{'' if c['fits'] else ' (too big)'}"
    if c.get("memory_from") == "compiled":
      mem += " (compiled)"
    body.append([name, c.get("gamma", "-"), c.get("alpha", "-"),
                 f"{c['paper']}x" if c.get("paper") else "-",
                 f"{c['paper_theorem']:.2f}x (c {c['paper_c']})" if c.get("paper_theorem")
                 else "-", mem, _num(c, "c", ".4f"), _num(c, "v", ".3f"),
                 _num(c, "baseline_ms", ".2f"), _num(c, "speculative_ms", ".2f"),
                 _num(c, "predicted", ".2f") + "x", _num(c, "predicted_v", ".2f") + "x"]
                + extra)
  return script_args.markdown_table(head, body)


# Topologies lab.trees can price (its stored one-chip T5 1.1 pieces):
# label -> (chip, chips the target is split over).
TREE_HARDWARE = {"v4-1": ("v4", 1), "v5e-8": ("v5e", 8)}


def _best_tree(family: str, draft: str, cell_: dict, hardware: str) -> str:
  """The best token tree of at most 64 nodes for a T5 1.1 row's draft under
  ``lab.trees``' model (rank rates: the paper's α with the demo pair's
  fall-off, an assumption), the draft's step as the cell priced it (its
  quantization included) where the cell holds it, as text; '' where it
  cannot be priced."""
  alpha = cell_.get("alpha")
  if family != "T5 1.1" or alpha is None or hardware not in TREE_HARDWARE:
    return ""
  chip, devices = TREE_HARDWARE[hardware]
  model = trees.step_model(CHIPS[chip], devices, draft)
  if cell_.get("draft_piece"):
    flops, nbytes, ops, coll = cell_["draft_piece"]
    model = dataclasses.replace(model, draft=costs.Piece(
        flops, nbytes, ops, tuple(((k, b, g), n) for k, b, g, n in coll)))
  rates = trees.scaled_rates(alpha)
  tree, speedup = trees.best_tree(model, rates, 64)
  return (f"a {tree.num_nodes}-node tree (depth {tree.max_depth}): "
          f"{model.ms_per_token(tree, rates):.2f} ms ({speedup:.2f}x)")


def tree_table(rows: list[str], cells: dict, variant: str = "int8") -> str:
  """Per T5 1.1 row on ``TREE_HARDWARE``: the ``variant`` draft's chain at
  the paper's γ and its best token tree (``_best_tree``) beside the paper's
  measured speedup."""
  head = ["row", "paper speedup (one TPU-v4)"]
  for hw in TREE_HARDWARE:
    head += [f"{hw}: {variant} chain, ms/token", f"{hw}: {variant} draft + best tree"]
  body = []
  for row in rows:
    family, *_ = _group(Path(row).stem)
    c0 = cells.get(key(row, next(iter(TREE_HARDWARE)), variant), {})
    if family != "T5 1.1" or not c0.get("paper"):
      continue
    line = [Path(row).stem, f"{c0['paper']}x"]
    for hw in TREE_HARDWARE:
      c = cells.get(key(row, hw, variant), {})
      size = _group(Path(row).stem)[2]
      line += [f"{c['predicted_v']:.2f}x, {c['speculative_ms']:.2f}" if c.get("speculative_ms")
               else "-", _best_tree(family, size, c, hw) or "-"]
    body.append(line)
  return script_args.markdown_table(head, body)


def recommendations(rows: list[str], hardware: list[str], cells: dict) -> str:
  """Per topology and (family, task, temperature): the draft whose
  speculative milliseconds per token the model predicts lowest, and by how
  much it beats the next draft and the baseline."""
  groups: dict[tuple, dict[str, str]] = {}
  for row in rows:
    family, task, size, temp = _group(Path(row).stem)
    groups.setdefault((family, task, temp), {})[size] = row
  body = []
  for (family, task, temp), sizes in sorted(groups.items()):
    line = [f"{family} {task} T={temp[1:]}"]
    for hw in hardware:
      options = {(size, v): cells[key(row, hw, v)] for size, row in sizes.items()
                 for v in ("",) + tuple(VARIANTS) if key(row, hw, v) in cells}
      ms = {o: c["speculative_ms"] for o, c in options.items()
            if c.get("speculative_ms") is not None and c.get("fits")}
      if not ms:
        line.append("-")
        continue
      best = min(ms, key=ms.get)
      base = options[best]["baseline_ms"]
      name = best[0] + (f", {best[1]}" if best[1] else "")
      text = f"**{name}**: {ms[best]:.2f} ms ({base / ms[best]:.2f}x the baseline)"
      rest = sorted((v, k) for k, v in ms.items() if k != best)
      if rest:
        nxt = rest[0][1][0] + (f", {rest[0][1][1]}" if rest[0][1][1] else "")
        text += f"; next: {nxt}, {rest[0][0]:.2f} ms"
      tree = _best_tree(family, best[0], options[best], hw)
      if tree:
        text += f"; {tree}"
      line.append(text)
    body.append(line)
  return script_args.markdown_table(["family, task, T"] + [
      f"{h} {HARDWARE[h][2]}" for h in hardware], body)


def render(rows: list[str], hardware: list[str], cells: dict, wall_s: float) -> str:
  """The generated part of the section: how it was made, the fastest draft
  per topology, then one table per topology."""
  ratios = [c["ratio"] for c in cells.values() if c and "ratio" in c]
  total = len(rows) * len(hardware)
  done = sum(f"{Path(r).stem}@{h}" in cells for r in rows for h in hardware)
  count = f"{total} cells" if done == total else (
      f"{done} of {total} cells so far; 'not run' cells are compiled by running the command "
      "again")
  compiled = sum(1 for c in cells.values() if c and c.get("memory_from") == "compiled")
  lines = [
      "Generated by `python scripts/dry_run_table.py` (no accelerator; "
      f"{count}; {wall_s / 3600:.2f} h of compiling on "
      f"{script_args.machine_description()}). Columns: the paper's γ, α (Table 3) and "
      "measured speedup (Table 2, one TPU-v4); Theorem 3.8 at the paper's own α, γ and c "
      "(Table 4: the paper's EXP); the weights and caches per device (memory.plan"
      + (f"; '(compiled)' where the speculative loop was compiled, {compiled} cells"
         if compiled else "") + "; the compiled speculative loop of ende_small_t0 on one v4 "
      "chip holds 24.32 GiB against the plan's 21.13, the compiler's temporaries) and whether "
      "they fit the chip's HBM; the cost model's c, "
      "v(γ+1), milliseconds per token of the baseline (one target step) and of speculative "
      "decoding (γ draft steps and one pass over γ+1 positions per round, over the tokens a "
      "round yields at the paper's α), and Theorem 3.8's speedup at the paper's α and γ with "
      "the model's c, then with its v(γ+1) too. The cost model (cost_model.md) "
      "prices each compiled piece at max(flops / peak, bytes / HBM bandwidth) with Google "
      "Cloud's published figures, plus its collectives and a fixed cost per launched "
      "operation calibrated on T5-small's c on one TPU-v4 alone; it is a model, not a "
      "measurement. On a mesh the target is split and the draft replicated, so c grows with "
      "the mesh while each token gets faster. T5 1.0 rows (`t5_1_0_*`) use the paper's α "
      "for the T5 1.1 row of the same task, draft size and temperature: their own α is not "
      "known.", ""]
  if ratios:
    span = f"{min(ratios):.2f}x" + (f" to {max(ratios):.2f}x" if max(ratios) - min(ratios)
                                    >= 0.005 else "")
    lines += [f"Bytes read per one-position target pass over its floor (the decoder and "
              f"output-layer weights each device reads per step): {span}.", ""]
  lines += ["**The fastest draft per topology** (lowest speculative ms/token in the model, "
            "among the rows' chains at the paper's γ: each draft size in the row's dtype and, "
            f"on {' and '.join(VARIANT_HARDWARE)}, as {' / '.join(VARIANTS)} "
            "(`Experiment.draft_quantization`)), and for T5 1.1 on one v4 chip and on "
            "v5e-8 the best token tree of at most 64 nodes for that draft (`scripts/"
            "best_trees.py`'s model: the stored one-chip pieces, rank acceptance rates = the "
            "paper's α with the demo pair's fall-off for the runner-up choices, an "
            "assumption):", "",
            recommendations(rows, hardware, cells), ""]
  if any("+" in k for k in cells):
    lines += ["**An int8 draft with the best token tree** per T5 1.1 row (the same tree "
              "model; the draft's step as the int8 cell priced it):", "",
              tree_table(rows, cells), ""]
  for hw in hardware:
    lines += [f"**{hw}** ({HARDWARE[hw][1]}, mesh {HARDWARE[hw][2]}):", "",
              topology_table(rows, hw, cells), ""]
  return "\n".join(lines).rstrip("\n")


def write_page(path: Path, generated: str) -> None:
  """Writes the whole page: its title, then ``generated``."""
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(f"{TITLE}\n{generated}\n")


def main() -> int:
  parser = script_args.new_parser(__doc__)
  parser.add_argument("--config_dir", action="append", default=None,
                      help="a directory of Table 2 row configs (repeatable; default "
                      f"{' and '.join(CONFIG_DIRS)} where it exists)")
  parser.add_argument("--hardware", action="append", default=None, choices=sorted(HARDWARE),
                      help="a topology (repeatable; default " + ", ".join(DEFAULT_HARDWARE) + ")")
  parser.add_argument("--rows", default="", help="comma-separated row names (config stems) "
                      "to run; default all")
  parser.add_argument("--out", default=DEFAULT_OUT, help="markdown file to write (whole)")
  parser.add_argument("--cache", default="runs/dry_run_table.json",
                      help="finished cells, reused by a rerun")
  parser.add_argument("--workers", type=int, default=driver.default_workers(),
                      help="cells compiled at once (one process each)")
  parser.add_argument("--compile_loops", action="store_true",
                      help="also compile each cell's speculative loop for its memory per "
                      "device (minutes per cell; default: memory.plan's)")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help=f"other drafts for every row on {', '.join(VARIANT_HARDWARE)} "
                      f"(comma-separated, of {sorted(VARIANTS)}; '' for none)")
  parser.add_argument("--render_only", action="store_true",
                      help="write the table from --cache as it is ('not run' where a cell is "
                      "missing), compiling nothing")
  args = script_args.parse(parser, paths=("out", "cache"))
  dirs = args.config_dir or [d for d in CONFIG_DIRS if (REPO / d).is_dir()]
  hardware = args.hardware or list(DEFAULT_HARDWARE)
  wanted = set(script_args.comma_list(args.rows))
  rows = []
  for d in dirs:
    found = Path(script_args.resolve(d))
    if not found.is_dir():
      raise FileNotFoundError(f"--config_dir={d}: no such directory")
    rows += [str(p) for p in sorted(found.glob("*.gin"))
             if not wanted or p.stem in wanted]
  if not rows:
    raise ValueError(f"no row configs in {dirs}" + (f" named {sorted(wanted)}" if wanted
                                                     else ""))
  cache_path = Path(args.cache)
  cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
  cells, spent = cache.get("cells", {}), cache.get("wall_s", 0.0)
  def missing(name: str) -> bool:
    return name not in cells or (args.compile_loops and
                                 cells[name].get("memory_from") != "compiled")
  variants = script_args.comma_list(args.variants)
  todo = [] if args.render_only else [(r, h, "") for r in rows for h in hardware
                                        if missing(key(r, h))]
  if not args.render_only:
    todo += [(r, h, v) for v in variants for r in rows for h in hardware
             if h in VARIANT_HARDWARE and key(r, h, v) not in cells]
  done = sum(f"{Path(r).stem}@{h}" in cells for r in rows for h in hardware)
  print(f"{len(rows)} rows x {len(hardware)} topologies: {done} cells in {cache_path}, "
        f"{len(todo)} to compile", flush=True)
  t0 = time.perf_counter()
  # Fresh worker processes every few cells: the TPU compiler's memory is
  # returned to the system only at exit. (A pool with max_tasks_per_child
  # stopped replacing its worker on Python 3.11, so each batch gets a pool.)
  context = multiprocessing.get_context("spawn")
  batch = 4 * max(1, args.workers)
  for start in range(0, len(todo), batch):
    with concurrent.futures.ProcessPoolExecutor(max(1, args.workers),
                                                mp_context=context) as pool:
      futures = [(row, hw, v, pool.submit(cell, row, hw, args.compile_loops and not v, v))
                 for row, hw, v in todo[start:start + batch]]
      for row, hw, v, future in futures:
        c = future.result()
        cells[key(row, hw, v)] = c
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps({"cells": cells,
                                          "wall_s": spent + time.perf_counter() - t0},
                                         indent=1, sort_keys=True))
        print(f"[{time.perf_counter() - t0:6.0f} s] {key(row, hw, v)}: "
              f"{_cell_text(c)}", flush=True)
  wall = spent + time.perf_counter() - t0
  write_page(Path(args.out), render(rows, hardware, cells, wall))
  print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s this run)")
  return 0
