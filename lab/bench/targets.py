"""The targets' and drafts' passes on the card: the one-token step, v(k) (a
pass over k positions relative to the step, paper §3.4), each draft's c
(Definition 3.7), each pass as a percentage of its weight-bytes floor, and
per-kernel profiles of the passes (a ``jax.profiler`` trace read back)."""

from __future__ import annotations

import dataclasses
import glob
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

import jax

from specdec_jax import memory, theory
from specdec_jax.models.t5 import T5Config
from specdec_jax.scripting import script_args
from specdec_jax.timing import interleaved_medians_ms

from lab.bench.common import (PAPER_ENDE_T0, PAPER_GAMMA, Model, Sizes,
                              bandwidth_for, describe, emit, log, record)


def section_targets(sz: Sizes, out: Path, smoke: bool = False) -> None:
  del smoke
  gbps, source = bandwidth_for(sz, out)
  gamma_pass = PAPER_GAMMA + 1
  if gamma_pass not in sz.ks or 1 not in sz.ks:
    raise ValueError(f"ks {sz.ks} must hold 1 and γ + 1 = {gamma_pass}")
  drafts = {name: Model.random(f"draft {name}", cfg, sz, seed=100 + i)
            for i, (name, cfg) in enumerate(sz.drafts.items())}
  draft_pieces = {name: m.piece(1, sz) for name, m in drafts.items()}
  print(f"Batch 1, random bfloat16 weights, self-attention cache {sz.cache_len}, passes at "
        f"positions {sz.position}.. (+0/+1 alternating), {sz.input_len} encoder positions; "
        f"{sz.inner} calls per timed call, {sz.repeats} timed calls per piece interleaved; "
        f"floors at {gbps:.0f} GB/s ({source}).\n", flush=True)
  payload: dict[str, Any] = dict(gbps=gbps, targets={})
  lines_all = []
  failed = []
  for i, (tname, tcfg) in enumerate(sz.targets.items()):
    try:
      target_rows(sz, out, gbps, drafts, draft_pieces, payload, lines_all, i, tname, tcfg)
    except Exception as e:  # noqa: BLE001 (the next target still runs; the exit says it)
      print(f"# target {tname} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
      failed.append(tname)
  if failed:
    raise SystemExit(f"targets failed: {', '.join(failed)}")


def target_rows(sz: Sizes, out: Path, gbps: float, drafts: dict, draft_pieces: dict,
                payload: dict, lines_all: list, i: int, tname: str, tcfg: T5Config) -> None:
  """One target's two tables (its passes and the drafts' steps; Theorem 3.8),
  printed and recorded."""
  gamma_pass = PAPER_GAMMA + 1
  head = ["model", "pass", "k", "ms", "v(k) / c", "weight GB read", "floor ms",
          "% of floor", "compile s"]
  target = Model.random(f"target {tname}", tcfg, sz, seed=i)
  pieces = {("target", k): target.piece(k, sz) for k in sz.ks}
  pieces.update({("draft", name): p for name, p in draft_pieces.items()})
  ms = interleaved_medians_ms({key: fn for key, (fn, _) in pieces.items()}, sz.repeats,
                              sz.inner)
  step = ms[("target", 1)]
  rows, trow = [], {}
  lines = [f"T5 1.1 {tname.upper()}-sized target ({describe(tcfg)}):", "",
           script_args.markdown_header(head)]
  for key, (_, csecs) in pieces.items():
    kind, what = key
    m = target if kind == "target" else drafts[what]
    k = what if kind == "target" else 1
    # What a pass reads of the weights (memory.reads_per_step: the decoder's,
    # the output layer included, not the cross-attention keys/values).
    wbytes = memory.step_weight_bytes(m.config, None, "bfloat16")
    floor_ms = 1e3 * wbytes / (gbps * 1e9)
    ratio = ms[key] / step
    label = (f"target {tname}" if kind == "target"
             else f"draft {what} ({describe(m.config)})")
    name = "one-token step" if k == 1 else f"{k}-position pass"
    rel = f"v = {ratio:.2f}" if kind == "target" else f"c = {ratio:.3f}"
    lines.append(script_args.markdown_row(
        [label, name, k, f"{ms[key]:.3f}", rel, f"{wbytes / 1e9:.3f}", f"{floor_ms:.3f}",
         f"{100 * floor_ms / ms[key]:.0f}%", f"{csecs:.1f}"]))
    rows.append(dict(kind=kind, name=str(what), k=k, ms=ms[key], ratio=ratio,
                     weight_bytes=wbytes, floor_ms=floor_ms,
                     pct_of_floor=100 * floor_ms / ms[key], compile_s=csecs))
  v_gamma = ms[("target", gamma_pass)] / step
  lines += ["", f"Theorem 3.8 at the paper's α (Table 2, EnDe, T = 0, γ {PAPER_GAMMA}) with "
            f"this target's c and v(γ + 1) = v({gamma_pass}) = {v_gamma:.2f}; the paper's "
            "c, EXP and measured speedup (TPU-v4, Table 4) beside them:", "",
            script_args.markdown_header(["target", "draft", "α", "γ", "c", f"v({gamma_pass})",
                                         "EXP (Thm 3.8)", "EXP (with v)", "paper c",
                                         "paper EXP", "paper speedup"])]
  exp_rows = []
  for dname, paper in PAPER_ENDE_T0.items():
    if dname not in drafts:
      continue
    c = ms[("draft", dname)] / step
    exp1 = theory.walltime_improvement(paper["alpha"], PAPER_GAMMA, c)
    expv = theory.walltime_improvement(paper["alpha"], PAPER_GAMMA, c, v_gamma)
    lines.append(script_args.markdown_row(
        [tname, dname, paper["alpha"], PAPER_GAMMA, f"{c:.3f}", f"{v_gamma:.2f}",
         f"{exp1:.2f}X", f"{expv:.2f}X", paper["c"], f"{paper['exp']}X",
         f"{paper['speed']}X"]))
    exp_rows.append(dict(draft=dname, alpha=paper["alpha"], gamma=PAPER_GAMMA, c=c,
                         v=v_gamma, exp=exp1, exp_v=expv))
  if i == 0 and sz.profile_calls:
    try:
      floor = memory.step_weight_bytes(tcfg, None, "bfloat16") / (gbps * 1e9) * 1e3
      entries = [("one-token step" if k == 1 else f"{k}-position pass",
                  pieces[("target", k)][0], ms[("target", k)], floor)
                 for k in (1, PAPER_GAMMA + 1)]
      plines, trow["profile"] = profile_tables(f"the {tname.upper()}-sized target", entries, sz)
      lines += ["", *plines]
    except Exception as e:  # noqa: BLE001 (the timings above stand without it)
      lines += ["", f"(profile failed: {type(e).__name__}: {str(e)[:200]})"]
  lines_all.append(emit(lines + [""]))
  trow.update(config=dataclasses.asdict(tcfg), passes=rows, step_ms=step, theorem=exp_rows)
  payload["targets"][tname] = trow
  record(out, "targets", payload, lines_all[-1])  # each target's rows as soon as they exist
  del target, pieces


# ----------------------------------------------------------------- profile

# Kernel names of matrix products: cuBLAS (sm90_xmma_*, nvjet_* on Hopper),
# CUTLASS, XLA's Triton GEMM fusions and gemv kernels.
_GEMM = re.compile(r"gemm|gemv|xmma|nvjet|cutlass|cublas|matmul|dot", re.I)
_SUMMARY_LINES = ("XLA Modules", "XLA Ops", "Steps", "Framework", "Launch", "Source", "TensorFlow")


def kernel_profile(fn: Callable[[], Any], calls: int) -> list[dict]:
  """Every device kernel that ``calls`` calls of ``fn`` ran, from a
  ``jax.profiler`` trace read back with ``jax.profiler.ProfileData``: per
  kernel name, how many times it ran and its total time. On a GPU these are
  the device plane's stream lines; where the trace has none (a CPU run),
  the host's XLA thread lines stand in so that the code path is exercised."""
  jax.block_until_ready(fn())
  with tempfile.TemporaryDirectory(prefix="bench_gpu_trace_") as tmp:
    jax.profiler.start_trace(tmp)
    for _ in range(calls):
      jax.block_until_ready(fn())
    jax.profiler.stop_trace()
    paths = sorted(glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True))
    data = jax.profiler.ProfileData.from_file(paths[-1])
  on_device = [line for plane in data.planes if plane.name.startswith("/device:")
               for line in plane.lines]
  # Stream lines hold the kernels; the others (XLA Modules, XLA Ops, ...)
  # repeat them grouped by program or HLO op.
  device = ([line for line in on_device if "stream" in line.name.lower()]
            or [line for line in on_device if not line.name.startswith(_SUMMARY_LINES)])
  lines = device or [line for plane in data.planes if plane.name.startswith("/host:")
                     for line in plane.lines if line.name.startswith("tf_XLA")]
  log("profile lines: " + ", ".join(sorted({line.name for line in on_device}))[:300])
  agg: dict[str, list] = {}
  for line in lines:
    for ev in line.events:
      a = agg.setdefault(ev.name, [0, 0.0])
      a[0] += 1
      a[1] += ev.duration_ns / 1e6
  return [dict(name=n, count=c, ms=ms, gemm=bool(_GEMM.search(n)), on_device=bool(device))
          for n, (c, ms) in sorted(agg.items(), key=lambda kv: -kv[1][1])]


def profile_rows(label: str, fn: Callable[[], Any], wall_ms: float, floor_ms: float,
                 passes_per_call: int, calls: int, top: int = 8) -> tuple[list[str], dict]:
  """Where one pass's time goes: kernels per pass, their busy time split into
  matrix products and everything else, and the time no kernel ran (launch
  gaps, host work), against the pass's measured time and its weight-bytes
  floor; then the ``top`` kernels by time."""
  kernels = kernel_profile(fn, calls)
  n = calls * passes_per_call
  busy = sum(k["ms"] for k in kernels) / n
  gemm = sum(k["ms"] for k in kernels if k["gemm"]) / n
  launches = sum(k["count"] for k in kernels) / n
  summary = dict(label=label, kernels_per_pass=launches, busy_ms=busy, gemm_ms=gemm,
                 other_ms=busy - gemm, idle_ms=max(wall_ms - busy, 0.0), wall_ms=wall_ms,
                 floor_ms=floor_ms, on_device=bool(kernels and kernels[0]["on_device"]),
                 top=[dict(k, count=k["count"] / n, ms=k["ms"] / n) for k in kernels[:top]])
  lines = [script_args.markdown_row(
      [label, f"{launches:.0f}", f"{wall_ms:.3f}", f"{floor_ms:.3f}", f"{gemm:.3f}",
       f"{busy - gemm:.3f}", f"{max(wall_ms - busy, 0.0):.3f}",
       f"{100 * floor_ms / gemm:.0f}%" if gemm else "-"])]
  return lines, summary


def profile_tables(title: str, entries: list[tuple[str, Callable[[], Any], float, float]],
                   sz: Sizes) -> tuple[list[str], list[dict]]:
  """The per-kernel profile of each (label, piece, timed ms, floor ms) entry:
  one summary row each, then each one's top kernels."""
  head = ["pass", "kernels per pass", "ms (timed)", "floor ms", "matrix-product kernels ms",
          "other kernels ms", "no kernel running ms", "products at % of floor"]
  lines = [f"Per-kernel profile of {title} (a jax.profiler trace of {sz.profile_calls} timed "
           f"calls, {sz.inner} passes each; kernel times summed per pass):", "",
           script_args.markdown_header(head)]
  summaries = []
  for label, fn, wall_ms, floor_ms in entries:
    rows, summary = profile_rows(label, fn, wall_ms, floor_ms, sz.inner, sz.profile_calls)
    lines += rows
    summaries.append(summary)
  for summary in summaries:
    lines += ["", f"Top kernels of the {summary['label']} (per pass):", "",
              script_args.markdown_header(["kernel", "product?", "runs per pass", "ms per pass",
                                           "% of pass"])]
    for k in summary["top"]:
      lines.append(script_args.markdown_row(
          [f"`{k['name'][:70]}`", "yes" if k["gemm"] else "no", f"{k['count']:.1f}",
           f"{k['ms']:.4f}", f"{100 * k['ms'] / summary['wall_ms']:.1f}%"]))
  return lines, summaries


def section_profile(sz: Sizes, out: Path, smoke: bool = False) -> None:
  """Where the time of the passes furthest from their floor goes: the
  small and base drafts' one-token steps (c) and the XL- and XXL-sized
  targets' one-token steps beside the XL's 2-position pass (v(2) < 1), each
  step also with ``T5Config.min_rows = 2`` (one-row products padded to two
  rows, so that XLA keeps them matrix products): same weights, timed
  interleaved."""
  gbps, source = bandwidth_for(sz, out)
  models = [Model.random(f"draft {n}", sz.drafts[n], sz, seed=100 + i)
            for i, n in enumerate(("small", "base")) if n in sz.drafts]
  models += [Model.random(f"target {n}", sz.targets[n], sz, seed=i)
             for i, n in enumerate(("xl", "xxl")) if n in sz.targets
             and not (smoke and n == "xxl")]  # smoke: one target shows the path
  padded = [dataclasses.replace(m, name=f"{m.name} (min_rows 2)",
                                config=m.config.replace(min_rows=2)) for m in models]
  by_name = {m.name: m for m in models + padded}
  pieces = {(m.name, 1): m.piece(1, sz) for m in models + padded}
  if "target xl" in by_name:
    pieces[("target xl", 2)] = by_name["target xl"].piece(2, sz)
  ms = interleaved_medians_ms({key: fn for key, (fn, _) in pieces.items()}, sz.repeats, sz.inner)
  entries = []
  for (name, k), (fn, _) in pieces.items():
    m = by_name[name]
    floor = 1e3 * memory.step_weight_bytes(m.config, None, "bfloat16") / (gbps * 1e9)
    what = "one-token step" if k == 1 else f"{k}-position pass"
    entries.append((f"{m.name} {what}", fn, ms[(name, k)], floor))
  lines, summaries = profile_tables(f"the drafts' and targets' steps (floors at {gbps:.0f} "
                                    f"GB/s, {source})", entries, sz)
  record(out, "profile", dict(gbps=gbps, rows=summaries), emit(lines))

