"""Per-device memory of Table 2's target/draft pairs on common accelerator meshes.

Usage:
  python scripts/plan_memory.py [--configs=configs/table2] [--batch_sizes=1,32]
      [--headroom=0.9] [--targets=t5_1_1_large,t5_1_1_xl,t5_1_1_xxl,t5_11b]
      [--drafts=t5_1_1_small,t5_1_1_base,t5_1_1_large]
      [--hardware='TPU v4-8:32:1x4' ...]

Lengths (max_input_len, max_decode_len), γ and the activation dtype are read
from the Table 2 gin configs (their includes followed), per task and draft;
where a task's t=0 and t=1 rows use different γ for one draft, the larger is
planned (a longer cache). A draft with no row of its own (e.g. T5 1.0's
t5_small) is planned with the γ of the row whose draft has its size (small,
base, large), else with the task's largest γ. Targets and drafts are
``specdec_jax.models.t5.PRESETS`` names: T5 1.1 (t5_1_1_*) and T5 1.0
(t5_small ... t5_11b, the paper's T5-XXL). Every number is
``specdec_jax.memory.plan``: shapes from ``jax.eval_shape``, layouts from the
runner's ``Partitioner`` over an abstract mesh, so this runs on a CPU in seconds
and needs no accelerator.
"""

from __future__ import annotations

import math
import os
import pathlib
from typing import Any, Optional, Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from gin import config_parser

from specdec_jax import memory
from specdec_jax.models.t5 import PRESETS
from specdec_jax.partitioning import PartitioningError
from specdec_jax.scripting import script_args

REPO = script_args.REPO_ROOT

# (label, GiB per device, (data, model) mesh). Chips, not cores: a v4 or v5p
# chip is one JAX device (megacore). Model-parallel only, data = 1, because the
# paper decodes at batch 1 and a data axis must divide the batch.
HARDWARE = (
    ("TPU v4-8", 32, (1, 4)),
    ("TPU v5e-8", 16, (1, 8)),
    ("TPU v5p-8", 95, (1, 4)),
    ("8xA100-40GB", 40, (1, 8)),
    ("1xH100-80GB", 80, (1, 1)),
)
TARGETS = ("t5_1_1_large", "t5_1_1_xl", "t5_1_1_xxl", "t5_11b")
DRAFTS = ("t5_1_1_small", "t5_1_1_base", "t5_1_1_large")
SHORT = {"t5_1_1_small": "small", "t5_1_1_base": "base", "t5_1_1_large": "large",
         "t5_1_1_xl": "XL", "t5_1_1_xxl": "XXL", "t5_small": "1.0-small",
         "t5_base": "1.0-base", "t5_large": "1.0-large", "t5_3b": "1.0-3B",
         "t5_11b": "1.0-11B"}
TASKS = {"wmt_ende": "WMT EnDe", "cnn_dailymail": "CNN/DM"}


class _Delegate(config_parser.ParserDelegate):
  """Macros and references are kept as markers; only literals are planned on."""

  def configurable_reference(self, scoped_name: str, evaluate: bool) -> Any:
    return ("@", scoped_name)

  def macro(self, name: str) -> Any:
    return ("%", name)


def read_experiment(path: pathlib.Path, root: pathlib.Path = REPO) -> dict[str, Any]:
  """The ``Experiment.*`` literal bindings of a gin file, includes followed
  (relative to ``root``, as the runner finds them), later bindings winning."""
  out: dict[str, Any] = {}
  for stmt in config_parser.ConfigParser(path.read_text(), _Delegate()):
    if isinstance(stmt, config_parser.IncludeStatement):
      inc = pathlib.Path(stmt.filename)
      out.update(read_experiment(inc if inc.is_absolute() else root / inc, root))
    elif (isinstance(stmt, config_parser.BindingStatement) and stmt.selector == "Experiment"
          and not stmt.scope):
      out[stmt.arg_name] = stmt.value
  return out


def table2_settings(config_dir: pathlib.Path) -> dict[str, dict[str, Any]]:
  """Per task: lengths, activation dtype, target preset and γ per draft preset."""
  tasks: dict[str, dict[str, Any]] = {}
  files = sorted(config_dir.glob("*.gin"))
  if not files:
    raise SystemExit(f"no .gin files in {config_dir}")
  for f in files:
    exp = read_experiment(f)
    t = tasks.setdefault(exp["task"], dict(max_input_len=exp["max_input_len"],
                                           max_decode_len=exp["max_decode_len"],
                                           dtype=exp.get("dtype", "float32"),
                                           target=exp.get("target_preset"), gamma={}))
    for key in ("max_input_len", "max_decode_len", "dtype"):
      if exp.get(key, t[key]) != t[key]:
        raise SystemExit(f"{f}: {key}={exp.get(key)!r} differs from other {exp['task']} rows")
    d = exp["draft_preset"]
    t["gamma"][d] = max(t["gamma"].get(d, 0), exp["gamma"])
  return tasks


def _gib(n: int) -> str:
  return f"{n / memory.GiB:.2f}"


def _mesh(mesh: Sequence[int]) -> Optional[tuple]:
  return None if tuple(mesh) == (1, 1) else tuple(mesh)


def draft_gamma(draft: str, s: dict) -> tuple[int, Optional[str]]:
  """The γ ``draft`` is planned with in task ``s``: its own rows' (note None),
  else that of the row whose draft has its size, else the task's largest (the
  note says which)."""
  if draft in s["gamma"]:
    return s["gamma"][draft], None
  size = draft.rsplit("_", 1)[-1]
  same = [d for d in s["gamma"] if d.rsplit("_", 1)[-1] == size]
  if same:
    return s["gamma"][same[0]], f"that of the {SHORT.get(same[0], same[0])} draft's rows"
  return max(s["gamma"].values()), "the task's largest"


def _partitioner(role: str, mesh: Sequence[int]):
  """The runner's partitioner for the target (STANDARD_RULES) or a draft
  (DATA_PARALLEL_RULES: replicated) over ``mesh``."""
  return memory.planning_partitioner(
      _mesh(mesh), None if role == "target" else memory.DATA_PARALLEL_RULES)


def _label_width(labels: Sequence[str], least: int) -> int:
  return max([least] + [len(label) + 1 for label in labels])


def components(hardware: Sequence, tasks: dict, targets: Sequence[str],
               drafts: Sequence[str]) -> list[str]:
  """Weights and one example's caches, per device, for each mesh."""
  dtype = next(iter(tasks.values()))["dtype"]
  meshes = sorted({tuple(m) for _, _, m in hardware}, key=lambda m: (m[1], m[0]))
  models = [("target", n) for n in targets] + [("draft", n) for n in drafts]
  w = _label_width([f"{role} {SHORT[n]}" for role, n in models], 14)
  head = "".join(f" | {'mesh ' + str(m):>17}" for m in meshes)
  sub = "".join(f" | {'bf16':>8} {'f32':>8}" for _ in meshes)
  lines = ["Weights per device, GiB (target: STANDARD_RULES; draft: DATA_PARALLEL_RULES, "
           "replicated)", f"{'model':<{w}}{head}", f"{'':<{w}}{sub}"]
  for role, name in models:
    cells = []
    for m in meshes:
      part = _partitioner(role, m)
      cells.append(f" | {_gib(memory.param_bytes(name, part, 'bfloat16')):>8} "
                   f"{_gib(memory.param_bytes(name, part, 'float32')):>8}")
    lines.append(f"{role + ' ' + SHORT[name]:<{w}}" + "".join(cells))
  lines += ["", f"Decoder caches per device for ONE example, GiB ({dtype}; self K/V over "
            "max_decode_len + gamma + 1, cross K/V over max_input_len)",
            f"{'model':<{w}}" + "".join(f" | {'mesh ' + str(m):>17}" for m in meshes),
            f"{'':<{w}}" + "".join(f" | {'EnDe':>8} {'CNN/DM':>8}" for _ in meshes)]
  order = [t for t in ("wmt_ende", "cnn_dailymail") if t in tasks]
  for role, name in models:
    cells = []
    for m in meshes:
      part = _partitioner(role, m)
      vals = []
      for task in order:
        s = tasks[task]
        # The target's cache follows the longest γ of the task's rows.
        g = max(s["gamma"].values()) if role == "target" else draft_gamma(name, s)[0]
        vals.append(_gib(memory.cache_bytes(name, part, 1, s["max_input_len"],
                                            s["max_decode_len"] + g + 1, dtype)))
      cells.append(" | " + " ".join(f"{v:>8}" for v in vals))
    lines.append(f"{role + ' ' + SHORT[name]:<{w}}" + "".join(cells))
  return lines


def fit_table(hardware: Sequence, task: str, s: dict, targets: Sequence[str],
              drafts: Sequence[str], batch_sizes: Sequence[int], headroom: float) -> list[str]:
  """Total per-device GiB for each pair, weight dtype and batch, with fit marks;
  a closing line when no pair fits anywhere."""
  gammas = ", ".join(f"{SHORT.get(d, d)} {g}" for d, g in sorted(
      s["gamma"].items(), key=lambda kv: DRAFTS.index(kv[0]) if kv[0] in DRAFTS else 99))
  lines = [f"{TASKS.get(task, task)}: max_input_len {s['max_input_len']}, max_decode_len "
           f"{s['max_decode_len']}, gamma by draft ({gammas}), activations {s['dtype']}"]
  for draft in drafts:
    gamma, note = draft_gamma(draft, s)
    if note:
      lines.append(f"  {draft} has no row in the configs: planned with gamma {gamma}, {note}")
  cols = [f"{label} {tuple(m)}" for label, _, m in hardware]
  width = max(13, *(len(c) for c in cols))
  w = _label_width([SHORT[n] for n in (*targets, *drafts)], 7)
  lines.append(f"{'target':<{w}}{'draft':<{w}}{'weights':<8}{'batch':>5}"
               + "".join(f" | {c:>{width}}" for c in cols))
  marks = set()
  for target in targets:
    for draft in drafts:
      gamma = draft_gamma(draft, s)[0]
      for wdt, wlabel in (("bfloat16", "bf16"), ("float32", "f32")):
        for b in batch_sizes:
          cells = []
          for _, gib, m in hardware:
            try:
              p = memory.plan(target, draft, _mesh(m), wdt, s["dtype"], b, s["max_input_len"],
                              s["max_decode_len"], gamma)
              ok = memory.fits(p["total"], gib * memory.GiB, headroom)
              cells.append(f"{_gib(p['total'])} {'ok' if ok else 'NO'}")
              marks.add("ok" if ok else "NO")
            except PartitioningError:
              cells.append("indivisible")
              marks.add("indivisible")
          lines.append(f"{SHORT[target]:<{w}}{SHORT[draft]:<{w}}{wlabel:<8}{b:>5}"
                       + "".join(f" | {c:>{width}}" for c in cells))
  if "ok" not in marks:
    why = {"NO": f"every total is over {headroom:.0%} of its device's memory",
           "indivisible": "no mesh divides the models' dimensions"}
    lines.append("Nothing fits: " + "; ".join(why[m] for m in sorted(marks)) + ".")
  return lines


def _hardware(specs: Sequence[str]) -> tuple:
  out = []
  for spec in specs:
    try:
      label, gib, mesh = spec.rsplit(":", 2)
      data, model = (int(x) for x in mesh.lower().split("x"))
      out.append((label, float(gib), (data, model)))
    except ValueError:
      raise SystemExit(f"--hardware {spec!r}: expected 'LABEL:GIB_PER_DEVICE:DATAxMODEL', "
                       "e.g. 'TPU v4-8:32:1x4'") from None
  return tuple(out)


def _names(ap, flag: str, text: str) -> list[str]:
  names = script_args.comma_list(text)
  unknown = [n for n in names if n not in PRESETS]
  if unknown or not names:
    ap.error(f"{flag}: {'unknown ' + ', '.join(unknown) if unknown else 'no names'}; valid: "
             f"{', '.join(PRESETS)}")
  return names


def main(argv: Optional[Sequence[str]] = None) -> None:
  ap = script_args.new_parser(__doc__)
  ap.add_argument("--configs", default=str(REPO / "configs" / "table2"),
                  help="directory of Table 2 row configs (default: the repository's)")
  ap.add_argument("--batch_sizes", default="1,32",
                  help="comma-separated batch sizes (positive integers) to plan each pair at")
  ap.add_argument("--headroom", type=float, default=0.9,
                  help="fraction of device memory the plan may use (rest: XLA temporaries)")
  ap.add_argument("--targets", default=",".join(TARGETS),
                  help=f"comma-separated target presets; valid: {', '.join(PRESETS)}")
  ap.add_argument("--drafts", default=",".join(DRAFTS),
                  help="comma-separated draft presets (valid: as --targets); a draft with no "
                       "Table 2 row takes the γ of the row of its size")
  ap.add_argument("--hardware", action="append", default=[],
                  help="LABEL:GIB_PER_DEVICE:DATAxMODEL (repeatable; replaces the defaults)")
  args = script_args.parse(ap, argv, paths=("configs",))
  targets = _names(ap, "--targets", args.targets)
  drafts = _names(ap, "--drafts", args.drafts)
  try:
    batch_sizes = script_args.comma_list(args.batch_sizes, int)
  except ValueError:
    batch_sizes = []
  if not batch_sizes or min(batch_sizes) < 1:
    ap.error(f"--batch_sizes={args.batch_sizes!r}: expected positive integers, e.g. 1,32")
  tasks = table2_settings(pathlib.Path(args.configs))
  hardware = _hardware(args.hardware) if args.hardware else HARDWARE
  for name in targets + drafts:
    SHORT.setdefault(name, name)

  print("Per-device memory of speculative decoding (specdec_jax.memory.plan): both models' "
        "weights\n(kernels and embedding at the weight dtype, norms and relative-position "
        "tables float32)\nand both decoder caches. Devices:")
  for label, gib, m in hardware:
    print(f"  {label:<14} {math.prod(m)} x {gib:g} GiB   mesh (data, model) = {tuple(m)}")
  print(f"'ok': total <= {args.headroom:.0%} of the device's memory; the rest is left for XLA "
        "temporaries\n(encoder activations and attention scores, logits), which are not "
        "counted. 'NO': does not fit.\n")
  for line in components(hardware, tasks, targets, drafts):
    print(line)
  for task in [t for t in ("wmt_ende", "cnn_dailymail") if t in tasks] + sorted(
      t for t in tasks if t not in TASKS):
    print()
    for line in fit_table(hardware, task, tasks[task], targets, drafts, batch_sizes,
                          args.headroom):
      print(line)
