r"""The GPU tables of docs/benchmarks.md, one section per call.

  python scripts/bench_gpu.py --section=bandwidth --out=DIR          # on the GPU
  python scripts/bench_gpu.py --section=targets --out=DIR --smoke    # toy sizes, CPU

``scripts/bench_accelerator.sh`` runs every section in this order (the order
of value), each in its own process under a time limit, so that one that fails
or runs out of time (or memory) does not stop the next. Each section prints
its markdown table as soon as it is measured and adds its rows to
DIR/bench_gpu.json (one key per section) and DIR/bench_gpu.md.

Sections:

  bandwidth    The card's achievable memory bandwidth: a device-to-device copy
               of a large buffer and an elementwise pass over it (each reads
               and writes every byte once), bytes read + written / median time.
               The fastest is the bandwidth every floor below is taken at.
  targets      T5 1.1 XXL- and XL-sized targets with random bfloat16 weights,
               batch 1: the one-token cached step, v(k) (a pass over k
               positions relative to the step, paper §3.4) for k = 1, 2, 4, 8,
               16, and the one-token steps of T5 1.1 small-, base- and
               large-sized drafts, whose ratio to the target's step is c
               (Definition 3.7). Each pass also as a percentage of its floor:
               the weight bytes it reads over the measured bandwidth. Then
               Theorem 3.8's speedup at the paper's α for each draft (Table 2,
               EnDe, T = 0, γ 7), with v = 1 and with the measured v(γ + 1).
  hf           The XXL-sized target on Hugging Face transformers
               (``T5ForConditionalGeneration``, bfloat16, on the same card, the
               same weights): its one-token step and γ + 1 = 8-position pass
               (eager, dynamic cache), and greedy ``generate`` tokens/s with
               its default dynamic cache, beside ours (``temperature_sample``)
               on the same input.
  hf_compiled  HF ``generate`` with ``cache_implementation='static'``, which
               transformers compiles on a GPU (``torch.compile``, mode
               'reduce-overhead': CUDA graphs); states whether it compiled, and
               falls back to the static cache uncompiled, with a note, if not.
  demo         The demo pair end to end (``scripts/bench_vs_hf.py``): our
               baseline and speculative decoding against HF ``generate`` and
               HF assisted generation with the same draft (draft_tiny, no
               shortlist on either side), T = 0, tokens/s, outputs compared.
  exactness    T = 0 outputs of speculative decoding against the baseline on
               configs/demo.gin's pair (draft_tiny_feat with its shortlist),
               100 held-out verses: float32 at JAX's default matmul precision
               (TF32 products on NVIDIA GPUs), float32 at 'highest', and
               bfloat16 weights and activations; with each setting's tokens/s.
  profile      A per-kernel profile (jax.profiler trace) of the small and
               base drafts' one-token steps and the XL-sized target's step and
               2-position pass: kernels per pass, product vs other kernel time,
               time with no kernel running, top kernels. (The targets section
               profiles the first target's step and γ + 1 pass the same way.)

Timing: every jitted piece is compiled once before it is timed
(``jax.jit(...).lower(...).compile()`` where the compile time is printed);
pieces run ``inner`` times inside one jitted loop (no per-call dispatch), are
timed interleaved and reported as medians. Random weights come from
``scripts/bench_decode.py``'s ``random_params`` (one small program per
distinct shape, on the device).

--smoke runs every section at toy sizes (small random models, a few examples)
so that a CPU test covers every code path; its numbers mean nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

# torch shares the card with JAX in some sections: JAX must not take 75% of
# its memory up front. Set before jax is imported, so that nothing can start
# the GPU client first; XLA's pool still grows and is reused after warm-up.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specdec_jax import checkpoints, data, memory, theory
from specdec_jax.decoding import speculative_decode, temperature_sample
from specdec_jax.models.t5 import PRESETS, T5Config, T5Model
from specdec_jax.partitioning import flatten_names
from specdec_jax.run import Experiment, prepare
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting import script_args
from specdec_jax.timing import interleaved_medians_ms, median, time_call, timed

from bench_decode import random_params  # noqa: E402 (scripts/ is on sys.path)

SECTIONS = ("bandwidth", "targets", "hf", "hf_compiled", "demo", "exactness", "profile")
# Sections that put torch beside JAX on the card: JAX must not preallocate.
TORCH_SECTIONS = ("hf", "hf_compiled", "demo")

# Table 2 (EnDe, T = 0, γ 7 in every row) and Table 4 of the paper: α of each
# T5 1.1 draft beside T5-XXL, and the paper's c, its EXP (Theorem 3.8) and its
# measured speedup on a TPU-v4.
PAPER_GAMMA = 7
PAPER_ENDE_T0 = {
    "small": dict(alpha=0.75, c=0.02, exp=3.2, speed=3.4),
    "base": dict(alpha=0.80, c=0.04, exp=3.3, speed=2.8),
    "large": dict(alpha=0.82, c=0.11, exp=2.5, speed=1.7),
}


@dataclasses.dataclass(frozen=True)
class Sizes:
  """What each section runs: the GPU run's sizes or the smoke test's."""
  targets: dict          # name -> T5Config (bfloat16 activations)
  drafts: dict           # name -> T5Config
  ks: tuple              # positions per pass for v(k); must hold 1 and γ + 1
  cache_len: int         # self-attention cache (runner: max_decode_len + γ + 1)
  position: int          # first position written by the timed passes
  input_len: int         # encoder positions
  inner: int             # calls per timed jit call
  repeats: int           # timed calls per piece (interleaved), median
  new_tokens: int        # tokens each generate call makes (hf sections)
  hf_repeats: int
  bandwidth_mib: int
  demo_examples: int
  demo_warmup: int
  max_decode_len: int
  exact_examples: int
  exact_warmup: int
  profile_calls: int     # timed calls traced for the first target's kernel profile


def _bf16(name: str) -> T5Config:
  return PRESETS[name].replace(dtype="bfloat16")


def _toy(d: int, layers: int, vocab: int = 512) -> T5Config:
  return T5Config(vocab_size=vocab, d_model=d, num_heads=2, head_dim=d // 2,
                  num_encoder_layers=layers, num_decoder_layers=layers, d_ff=2 * d,
                  dtype="bfloat16")


FULL = Sizes(
    targets={"xxl": _bf16("t5_1_1_xxl"), "xl": _bf16("t5_1_1_xl")},
    drafts={"small": _bf16("t5_1_1_small"), "base": _bf16("t5_1_1_base"),
            "large": _bf16("t5_1_1_large")},
    ks=(1, 2, 4, 8, 16), cache_len=136, position=64, input_len=64, inner=16, repeats=7,
    new_tokens=64, hf_repeats=20, bandwidth_mib=4096, demo_examples=20, demo_warmup=2,
    max_decode_len=128, exact_examples=100, exact_warmup=2, profile_calls=3)

SMOKE = Sizes(
    targets={"xxl": _toy(64, 2), "xl": _toy(32, 2)},
    drafts={"small": _toy(16, 1)},
    ks=(1, 8), cache_len=16, position=4, input_len=8, inner=2, repeats=2,
    new_tokens=4, hf_repeats=1, bandwidth_mib=8, demo_examples=1, demo_warmup=0,
    max_decode_len=8, exact_examples=1, exact_warmup=1, profile_calls=1)


# ------------------------------------------------------------------ output


def machine_info() -> dict:
  """The device, the driver (nvidia-smi, where there is one) and versions."""
  d = jax.devices()[0]
  info = dict(device=d.device_kind, platform=d.platform, device_count=jax.device_count(),
              jax=jax.__version__, host=script_args.machine_description())
  if shutil.which("nvidia-smi"):
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                        "--format=csv,noheader"], capture_output=True, text=True)
    info["nvidia_smi"] = q.stdout.strip().splitlines()[:1]
  return info


def record(out: Path, section: str, payload: dict, markdown: Optional[str]) -> None:
  """Puts a section's rows in out/bench_gpu.json (replacing what it put
  there before) and adds ``markdown``, if any, to out/bench_gpu.md."""
  out.mkdir(parents=True, exist_ok=True)
  path = out / "bench_gpu.json"
  doc = json.loads(path.read_text()) if path.exists() else {}
  doc.setdefault("machine", machine_info())
  doc.setdefault("sections", {})[section] = payload
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(doc, indent=1, sort_keys=True, default=float))
  tmp.replace(path)
  if markdown is not None:
    with open(out / "bench_gpu.md", "a") as f:
      f.write(f"### {section}\n\n{markdown}\n\n")


def earlier(out: Path, section: str) -> Optional[dict]:
  """A section's payload from an earlier process of the same run, if any."""
  path = out / "bench_gpu.json"
  if not path.exists():
    return None
  return json.loads(path.read_text()).get("sections", {}).get(section)


def emit(lines: list[str]) -> str:
  text = "\n".join(lines)
  print(text, flush=True)
  return text


def log(msg: str) -> None:
  print(f"# {msg}", file=sys.stderr, flush=True)


def compiled(fn: Callable, *args) -> tuple[Callable[[], Any], float]:
  """(a no-argument call of ``jax.jit(fn)`` compiled for ``args``, compile seconds)."""
  t0 = time.perf_counter()
  exe = jax.jit(fn).lower(*args).compile()
  return functools.partial(exe, *args), time.perf_counter() - t0


# --------------------------------------------------------------- bandwidth


def measure_bandwidth(mib: int, repeats: int = 20) -> dict[str, float]:
  """GB/s (1e9 bytes) of two passes that read and write every byte of a
  ``mib`` MiB buffer once: a copy and an elementwise xor (which no compiler
  can drop). Bytes read + written over the median time of one call."""
  n = mib * 2 ** 20 // 4
  x = jax.block_until_ready(jnp.arange(n, dtype=jnp.uint32))
  passes = {"device-to-device copy": jax.jit(jnp.copy),
            "elementwise pass (x ^ 1)": jax.jit(lambda a: a ^ jnp.uint32(1))}
  rates = {}
  for name, fn in passes.items():
    secs = median(time_call(lambda: fn(x), repeats=repeats, warmup=2))
    rates[name] = 2 * x.nbytes / secs / 1e9
  return rates


def section_bandwidth(sz: Sizes, out: Path) -> None:
  rates = measure_bandwidth(sz.bandwidth_mib)
  best = max(rates, key=rates.get)
  lines = [script_args.markdown_header(["pass", "buffer MiB", "bytes moved per call (GB)",
                                        "GB/s (read + written)"])]
  for name, r in rates.items():
    lines.append(script_args.markdown_row(
        [name, sz.bandwidth_mib, f"{2 * sz.bandwidth_mib * 2 ** 20 / 1e9:.2f}", f"{r:.0f}"]))
  lines += ["", f"Achievable bandwidth (the fastest): **{rates[best]:.0f} GB/s** ({best})."]
  record(out, "bandwidth", dict(gbps=rates[best], passes=rates, buffer_mib=sz.bandwidth_mib),
         emit(lines))


def bandwidth_for(sz: Sizes, out: Path) -> tuple[float, str]:
  """The bandwidth floors are taken at: the bandwidth section's, else measured now."""
  done = earlier(out, "bandwidth")
  if done:
    return float(done["gbps"]), "the bandwidth section's"
  return max(measure_bandwidth(sz.bandwidth_mib).values()), "measured in this section"


# ----------------------------------------------------------------- targets


def decode_loop(model: T5Model, k: int, position: int, n: int) -> Callable:
  """(params, cache) -> a scalar: n cached k-token ``decode`` calls in one
  loop, the cache carried from one to the next, positions alternating
  between position.. and position+1.. (nothing is loop-invariant)."""
  tokens = 3 + jnp.arange(k, dtype=jnp.int32)[None]
  pos0 = position + jnp.arange(k, dtype=jnp.int32)[None]

  def run(params, cache):
    def body(i, carry):
      cache, acc, off = carry
      logits, cache = model.decode(params, tokens, pos0 + off, cache)
      return cache, acc + jnp.sum(logits), 1 - off
    return jax.lax.fori_loop(0, n, body, (cache, jnp.float32(0), jnp.int32(0)))[1]
  return run


@dataclasses.dataclass
class Model:
  """Random bfloat16 weights of one config and a filled cache to decode over."""
  name: str
  config: T5Config
  params: Any
  cache: Any

  @classmethod
  def random(cls, name: str, config: T5Config, sz: Sizes, seed: int) -> "Model":
    t0 = time.perf_counter()
    model = T5Model(config)
    params = random_params(model, jax.random.PRNGKey(seed), "bfloat16")
    # The cache's cross-attention keys/values from a random encoder output:
    # the encoder's weights are never read by a decode step.
    encoded = jax.random.normal(jax.random.PRNGKey(seed + 1), (1, sz.input_len, config.d_model),
                                config.jnp_dtype)
    inputs = jnp.full((1, sz.input_len), 5, jnp.int32)
    cache = jax.jit(model.init_cache, static_argnums=3)(params, encoded, inputs, sz.cache_len)
    jax.block_until_ready(cache)
    log(f"{name}: random weights and cache in {time.perf_counter() - t0:.1f} s")
    return cls(name, config, params, cache)

  def piece(self, k: int, sz: Sizes) -> tuple[Callable[[], Any], float]:
    fn, secs = compiled(decode_loop(T5Model(self.config), k, sz.position, sz.inner),
                        self.params, self.cache)
    log(f"{self.name} k={k}: compiled in {secs:.1f} s")
    return fn, secs


def describe(config: T5Config) -> str:
  return (f"d {config.d_model}, {config.num_decoder_layers} decoder layers, "
          f"d_ff {config.d_ff}, V {config.vocab_size}")


def section_targets(sz: Sizes, out: Path) -> None:
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


# ---------------------------------------------------------------------- hf


def hf_from_params(params: Any, config: T5Config, dtype: str):
  """A transformers ``T5ForConditionalGeneration`` holding ``params``, built
  where they are (GPU or host memory) through ``checkpoints.export_hf``'s own
  mapping (``hf_name_map``, ``t5_to_hf_config``): no file is written (an
  XXL-sized export is 22 GB). Tensors that need no transpose or cast are
  shared with JAX through DLPack; transposes are new arrays on the device."""
  import torch
  import transformers

  transformers.logging.set_verbosity_error()
  tdtype = getattr(torch, dtype)
  flat = flatten_names(params)
  state = {}
  for ours, (key, transpose) in checkpoints.hf_name_map(config).items():
    x = jax.block_until_ready(jnp.transpose(flat[ours]) if transpose else flat[ours])
    t = torch.from_dlpack(x)
    state[key] = t if t.dtype == tdtype else t.to(tdtype)
  hf_cfg = transformers.T5Config(**checkpoints.t5_to_hf_config(config))
  with torch.device("meta"):
    model = transformers.T5ForConditionalGeneration(hf_cfg)
  _, unexpected = model.load_state_dict(state, strict=False, assign=True)
  # The encoder's and decoder's token embeddings are the shared one (and so is
  # T5 1.0's output layer); T5 1.1's lm_head stays its own (tie_weights would
  # tie it too).
  model.set_input_embeddings(model.shared)
  if config.logits_via_embedding:
    model.lm_head.weight = model.shared.weight
  empty = [n for n, p in model.named_parameters() if p.is_meta]
  if unexpected or empty:
    raise RuntimeError(f"HF model from params: unexpected {unexpected[:3]}, unset {empty[:3]}")
  return model.eval()


def torch_device(model) -> str:
  return str(next(model.parameters()).device)


def hf_sync(model) -> None:
  import torch
  if torch_device(model).startswith("cuda"):
    torch.cuda.synchronize()


def cache_kwarg(model) -> str:
  """The name ``forward`` takes the cache by: 'cache' in newer transformers
  (which still accept the deprecated 'past_key_values'), else 'past_key_values'."""
  return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_pass_ms(model, input_ids, prefix_len: int, k: int, repeats: int) -> float:
  """Median ms of one eager decoder pass over k new positions after a
  ``prefix_len``-token dynamic cache (cropped back after each call)."""
  import torch
  from transformers.cache_utils import DynamicCache, EncoderDecoderCache

  dev = input_ids.device
  mask = torch.ones_like(input_ids)
  with torch.inference_mode():
    enc = model.get_encoder()(input_ids=input_ids, attention_mask=mask)
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    kw = {cache_kwarg(model): cache, "use_cache": True}
    prefix = torch.full((1, prefix_len), 5, dtype=torch.long, device=dev)
    model(encoder_outputs=enc, attention_mask=mask, decoder_input_ids=prefix, **kw)
    new = 3 + torch.arange(k, dtype=torch.long, device=dev)[None]
    times = []
    for i in range(repeats + 2):
      hf_sync(model)
      t0 = time.perf_counter()
      model(encoder_outputs=enc, attention_mask=mask, decoder_input_ids=new, **kw)
      hf_sync(model)
      if i >= 2:
        times.append(time.perf_counter() - t0)
      cache.crop(-k)
  return 1e3 * median(times)


def hf_generate_timed(model, input_ids, new_tokens: int, repeats: int, warmup: int,
                      **kw) -> tuple[np.ndarray, float]:
  """(greedy tokens, median seconds) of ``new_tokens`` tokens from HF generate
  (EOS suppressed by min_new_tokens, so every call makes all of them)."""
  import torch

  mask = torch.ones_like(input_ids)
  cfg = model.config
  args = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, num_beams=1, decoder_start_token_id=cfg.decoder_start_token_id,
              eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, **kw)
  times = []
  with torch.inference_mode():
    for i in range(warmup + repeats):
      hf_sync(model)
      t0 = time.perf_counter()
      out = model.generate(input_ids, **args)
      hf_sync(model)
      if i >= warmup:
        times.append(time.perf_counter() - t0)
  return out[0, 1:].cpu().numpy(), median(times)


def first_difference(a, b) -> Optional[int]:
  n = min(len(a), len(b))
  diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
  return int(diff[0]) if len(diff) else (None if len(a) == len(b) else n)


def hf_setup(sz: Sizes):
  """The XXL-sized target's random weights (the targets section's: same seed)
  and a random input; JAX must not preallocate the card (torch shares it)."""
  config = sz.targets["xxl"]
  model = T5Model(config)
  params = random_params(model, jax.random.PRNGKey(0), "bfloat16")
  inputs = jax.random.randint(jax.random.PRNGKey(1), (1, sz.input_len), 2, config.vocab_size,
                              dtype=jnp.int32)
  return config, model, params, inputs


def versions() -> str:
  import torch
  import transformers
  return f"torch {torch.__version__}, transformers {transformers.__version__}"


def section_hf(sz: Sizes, out: Path) -> None:
  import torch

  config, model, params, inputs = hf_setup(sz)
  key = jax.random.PRNGKey(2)
  run = lambda: temperature_sample(model, params, inputs, key, max_decode_len=sz.new_tokens,
                                   sampling=SamplingConfig(), eos_id=-1)
  first, csecs = timed(run)
  log(f"ours temperature_sample: compiled and run once in {csecs:.1f} s")
  ours_s = median(time_call(run, repeats=sz.hf_repeats // 4 + 1, warmup=0))
  ours_tokens = np.asarray(first.tokens[0, :int(first.length[0])])
  hf = hf_from_params(params, config, "bfloat16")
  del params
  dev = torch_device(hf)
  ids = torch.as_tensor(np.array(inputs), dtype=torch.long, device=dev)
  step = hf_pass_ms(hf, ids, sz.position, 1, sz.hf_repeats)
  verify = hf_pass_ms(hf, ids, sz.position, PAPER_GAMMA + 1, sz.hf_repeats)
  hf_tokens, hf_s = hf_generate_timed(hf, ids, sz.new_tokens, sz.hf_repeats // 4 + 1, 1)
  ours_step = (earlier(out, "targets") or {}).get("targets", {}).get("xxl", {}).get("step_ms")
  n = sz.new_tokens
  lines = [f"T5 1.1 XXL-sized target ({describe(config)}), random bfloat16 weights, the same "
           f"on both sides; batch 1, {sz.input_len} input tokens, {n} greedy tokens per "
           f"generate call (EOS never ends it); {versions()}, HF attention "
           f"'{hf.config._attn_implementation}', on {dev}.", "",
           script_args.markdown_header(["implementation", "what", "ms", "tokens/s",
                                        "ours / HF (tokens/s)"])]
  if ours_step is not None:
    lines.append(script_args.markdown_row(["ours", "one-token step (targets section)",
                                           f"{ours_step:.3f}", "-", "-"]))
  lines += [
      script_args.markdown_row(["HF eager", "one-token step (dynamic cache)", f"{step:.3f}",
                                "-", "-"]),
      script_args.markdown_row(["HF eager", f"{PAPER_GAMMA + 1}-position pass",
                                f"{verify:.3f}", "-", "-"]),
      script_args.markdown_row(["ours", "temperature_sample, per token (encoder included)",
                                f"{1e3 * ours_s / n:.3f}", f"{n / ours_s:.1f}",
                                f"**{hf_s / ours_s:.2f}x**"]),
      script_args.markdown_row(["HF", "generate, dynamic cache (its default), per token",
                                f"{1e3 * hf_s / n:.3f}", f"{n / hf_s:.1f}", "1.00x"]),
  ]
  d = first_difference(ours_tokens, hf_tokens)
  lines += ["", f"Greedy tokens, ours vs HF: {'identical' if d is None else f'first differ at index {d}'} "
            "(random bfloat16 weights: near-ties are common, a difference is expected)."]
  record(out, "hf", dict(ours_step_ms=ours_step, hf_step_ms=step, hf_verify_ms=verify,
                         verify_k=PAPER_GAMMA + 1, ours_tok_s=n / ours_s, hf_tok_s=n / hf_s,
                         ours_compile_s=csecs, new_tokens=n, versions=versions(), device=dev,
                         first_difference=d), emit(lines))


def section_hf_compiled(sz: Sizes, out: Path) -> None:
  import torch

  config, _, params, inputs = hf_setup(sz)
  hf = hf_from_params(params, config, "bfloat16")
  del params
  dev = torch_device(hf)
  ids = torch.as_tensor(np.array(inputs), dtype=torch.long, device=dev)
  n = sz.new_tokens
  t0 = time.perf_counter()
  note = ""
  try:
    _, secs = hf_generate_timed(hf, ids, n, sz.hf_repeats // 4 + 1, 2,
                                cache_implementation="static")
    compiled_ = getattr(hf, "_compiled_call", None) is not None
    how = ("static cache, torch.compile (transformers' default CompileConfig: inductor, "
           "mode 'reduce-overhead')" if compiled_ else
           f"static cache, not compiled (transformers compiles only on a GPU; device {dev})")
  except Exception as e:  # noqa: BLE001 (the fallback is reported, not hidden)
    note = f"static cache with compilation failed ({type(e).__name__}: {str(e)[:200]}); "
    print(f"# {note}falling back to the static cache uncompiled", flush=True)
    _, secs = hf_generate_timed(hf, ids, n, sz.hf_repeats // 4 + 1, 1,
                                cache_implementation="static", disable_compile=True)
    compiled_, how = False, "static cache, not compiled (fallback)"
  warm = time.perf_counter() - t0
  ours = (earlier(out, "hf") or {}).get("ours_tok_s")
  lines = [f"T5 1.1 XXL-sized target, the hf section's weights and input; {versions()}; "
           f"{note}warm-up and timed calls took {warm:.1f} s.", "",
           script_args.markdown_header(["implementation", "options", "ms per token", "tokens/s",
                                        "ours / HF (tokens/s)"]),
           script_args.markdown_row(["HF generate", how, f"{1e3 * secs / n:.3f}",
                                     f"{n / secs:.1f}",
                                     "-" if ours is None else f"**{ours * secs / n:.2f}x**"])]
  record(out, "hf_compiled", dict(hf_tok_s=n / secs, compiled=compiled_, options=how,
                                  note=note, versions=versions(), device=dev), emit(lines))


# -------------------------------------------------------------------- demo


def toy_checkpoints(root: Path, vocab_size: int) -> tuple[str, str]:
  """A random toy target and draft saved under ``root`` (smoke mode), with
  the demo vocabulary's size so that the demo's text inputs fit."""
  paths = []
  for name, cfg, seed in (("target", T5Config(vocab_size=vocab_size, d_model=32, num_heads=2,
                                              head_dim=16, num_encoder_layers=2,
                                              num_decoder_layers=2, d_ff=64), 0),
                          ("draft", T5Config(vocab_size=vocab_size, d_model=16, num_heads=2,
                                             head_dim=8, num_encoder_layers=1,
                                             num_decoder_layers=1, d_ff=32), 1)):
    path = root / f"toy_{name}"
    checkpoints.save_checkpoint(str(path), T5Model(cfg).init(jax.random.PRNGKey(seed)), cfg,
                                overwrite=True)
    paths.append(str(path))
  return paths[0], paths[1]


def demo_pair(smoke: bool, root: Path, feature_draft: bool) -> tuple[str, str, str]:
  """(target, draft, shortlist) paths: the demo's, or toy ones in smoke mode."""
  if smoke:
    target, draft = toy_checkpoints(root, data.SentencePieceVocab(
        script_args.resolve(script_args.VOCAB)).vocab_size)
    return target, draft, ""
  if feature_draft:
    return (script_args.resolve(script_args.TARGET), script_args.resolve(script_args.DRAFT),
            script_args.resolve(script_args.SHORTLIST))
  return script_args.resolve(script_args.TARGET), script_args.resolve(script_args.PLAIN_DRAFT), ""


def section_demo(sz: Sizes, out: Path, smoke: bool) -> None:
  import bench_vs_hf as bvh

  gamma = 4
  with tempfile.TemporaryDirectory(prefix="bench_gpu_demo_") as tmp:
    target, draft, _ = demo_pair(smoke, Path(tmp), feature_draft=False)
    ours, tp, tcfg, dp, dcfg = bvh.load_ours(target, draft)
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    hf_target = bvh.load_hf(bvh.export_for_hf(tp, tcfg, f"{tmp}/hf_target"), device=device)
    hf_draft = bvh.load_hf(bvh.export_for_hf(dp, dcfg, f"{tmp}/hf_draft"), device=device)
  vocab = data.SentencePieceVocab(script_args.resolve(script_args.VOCAB))
  examples = data.load_local(script_args.resolve(script_args.SOURCE))
  examples = examples[:sz.demo_warmup + sz.demo_examples]
  inputs, _ = data.encode_batch(vocab, [e.input for e in examples], 128,
                                prefix=data.PREFIXES[script_args.TASK])
  s = bvh.bench_setting(ours, hf_target, hf_draft, inputs, [e.id for e in examples],
                        temperature=0.0, gamma=gamma, max_decode_len=sz.max_decode_len,
                        num_warmup=sz.demo_warmup, seed=0, methods=bvh.METHODS,
                        log=lambda m: print(m, file=sys.stderr, flush=True),
                        input_buckets=())
  for m in s.mismatches:
    print(f"MISMATCH example {m[0]}: {m[1]} first differs from HF generate at index {m[2]}")
  lines = [f"The demo target and draft_tiny ({'toy random stand-ins, ' if smoke else ''}the "
           f"same weights on both sides, float32, no shortlist), {sz.demo_examples} test "
           f"verses after {sz.demo_warmup} warm-up, γ {gamma}, inputs padded to 128 tokens "
           f"(one compiled program each); HF on {device} ({versions()}), eager, its default "
           "dynamic cache.", "", script_args.markdown_header(bvh.TABLE_HEAD),
           *bvh.setting_table(s), "", *bvh.summary_lines([s]),
           *(f"- {bvh.LABELS[m]}: failed in this transformers version and left out ({err})."
             for m, err in s.failed.items())]
  acc = {m: dict(tokens=sum(a.tokens), seconds=sum(a.seconds), tok_s=a.tps)
         for m, a in s.accs.items()}
  record(out, "demo", dict(methods=acc, mismatches=len(s.mismatches), compared=s.compared,
                           gamma=gamma, examples=sz.demo_examples, failed=s.failed), emit(lines))


# --------------------------------------------------------------- exactness


EXACTNESS_SETTINGS = (("float32", "default"), ("float32", "highest"), ("bfloat16", "default"))


def section_exactness(sz: Sizes, out: Path, smoke: bool) -> None:
  gamma = 3
  rows, lines = [], [
      f"configs/demo.gin's pair ({'toy random stand-ins' if smoke else 'draft_tiny_feat with its shortlist'}), "
      f"γ {gamma}, T = 0, {sz.exact_examples} test verses after {sz.exact_warmup} warm-up, inputs "
      "padded to 128 tokens; a mismatch is a verse whose speculative output differs from the "
      "baseline's.", "",
      script_args.markdown_header(["activations and weights", "matmul precision", "verses",
                                   "mismatches", "first mismatching verses", "baseline tok/s",
                                   "speculative tok/s", "speedup"])]
  print("\n".join(lines), flush=True)
  with tempfile.TemporaryDirectory(prefix="bench_gpu_exact_") as tmp:
    target, draft, shortlist = demo_pair(smoke, Path(tmp), feature_draft=True)
    # Smoke mode skips float32 at the default precision: bfloat16's row takes
    # the same path (no precision context), 'highest' the other.
    for dtype, precision in EXACTNESS_SETTINGS[1:] if smoke else EXACTNESS_SETTINGS:
      try:
        row = exactness_row(sz, target, draft, shortlist, gamma, dtype, precision)
      except Exception as e:  # noqa: BLE001 (one setting's failure is a row; the others run)
        print(f"# exactness {dtype}/{precision} failed: {type(e).__name__}: {e}", flush=True)
        row = dict(dtype=dtype, precision=precision, error=f"{type(e).__name__}: {e}")
        lines.append(script_args.markdown_row([dtype, precision, "failed", "-", "-", "-", "-",
                                               "-"]))
      else:
        lines.append(script_args.markdown_row(
            [dtype, precision, sz.exact_examples, f"**{row['mismatches']}**",
             ", ".join(map(str, row["mismatching"][:5])) or "-",
             f"{row['baseline_tok_s']:.1f}", f"{row['speculative_tok_s']:.1f}",
             f"{row['speedup']:.2f}x"]))
      rows.append(row)
      print(lines[-1], flush=True)
      record(out, "exactness", dict(rows=rows, gamma=gamma), None)  # each row as it exists
  record(out, "exactness", dict(rows=rows, gamma=gamma), "\n".join(lines))


@contextlib.contextmanager
def matmul_precision(precision: str):
  """JAX's default matmul precision set to ``precision`` inside the block
  (the context manager where this jax has it, else the config option)."""
  if hasattr(jax, "default_matmul_precision"):
    with jax.default_matmul_precision(precision):
      yield
    return
  before = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", precision)
  try:
    yield
  finally:
    jax.config.update("jax_default_matmul_precision", before)


def exactness_row(sz: Sizes, target: str, draft: str, shortlist: str, gamma: int, dtype: str,
                  precision: str) -> dict:
  """One setting of the exactness table: baseline and speculative decoding
  of the same verses, outputs compared, total tokens/s of each."""
  exp = Experiment(target_checkpoint=target, draft_checkpoint=draft,
                   draft_shortlist=shortlist, gamma=gamma, max_input_len=128,
                   input_buckets=(), max_decode_len=sz.max_decode_len, dtype=dtype,
                   param_dtype=dtype, num_warmup=sz.exact_warmup,
                   num_examples=sz.exact_examples, source=script_args.SOURCE,
                   vocab_path=script_args.VOCAB)
  setup = prepare(exp)
  eos = setup.target.config.eos_id
  greedy = SamplingConfig(temperature=0.0)
  ctx = matmul_precision(precision) if precision != "default" else contextlib.nullcontext()
  bad, secs, toks = [], [0.0, 0.0], [0, 0]
  with ctx:
    for i in range(setup.inputs.shape[0]):
      x, key = setup.inputs[i:i + 1], jax.random.fold_in(jax.random.PRNGKey(0), i)
      b, tb = timed(lambda: temperature_sample(
          setup.target, setup.target_params, x, key, max_decode_len=sz.max_decode_len,
          sampling=greedy, eos_id=eos))
      p, tp = timed(lambda: speculative_decode(
          setup.target, setup.target_params, setup.draft, x, key, gamma=gamma,
          max_decode_len=sz.max_decode_len, sampling=greedy, eos_id=eos))
      if i < sz.exact_warmup:
        continue
      nb, npp = int(b.length[0]), int(p.length[0])
      if nb != npp or not np.array_equal(np.asarray(b.tokens[0, :nb]),
                                         np.asarray(p.tokens[0, :npp])):
        bad.append(setup.examples[i].id)
      secs[0] += tb
      secs[1] += tp
      toks[0] += nb
      toks[1] += npp
  tps = [t / s for t, s in zip(toks, secs)]
  return dict(dtype=dtype, precision=precision, verses=sz.exact_examples,
              mismatches=len(bad), mismatching=bad, baseline_tok_s=tps[0],
              speculative_tok_s=tps[1], speedup=secs[0] / secs[1])


# -------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> None:
  p = script_args.new_parser(__doc__)
  p.add_argument("--section", required=True, choices=SECTIONS)
  p.add_argument("--out", default=None,
                 help="where bench_gpu.json and bench_gpu.md go (default: a temporary folder)")
  p.add_argument("--smoke", action="store_true", help="toy sizes (a CPU test of every path)")
  args = script_args.parse(p, argv)
  if args.section in TORCH_SECTIONS and args.smoke:
    import torch
    # One thread: torch's thread pool beside JAX's on a small CPU spends its
    # time waiting (100x slower steps on 2 cores).
    torch.set_num_threads(1)
  out = Path(args.out or tempfile.mkdtemp(prefix="bench_gpu_"))
  sz = SMOKE if args.smoke else FULL
  t0 = time.perf_counter()
  if args.section == "bandwidth":
    section_bandwidth(sz, out)
  elif args.section == "targets":
    section_targets(sz, out)
  elif args.section == "hf":
    section_hf(sz, out)
  elif args.section == "hf_compiled":
    section_hf_compiled(sz, out)
  elif args.section == "demo":
    section_demo(sz, out, args.smoke)
  elif args.section == "exactness":
    section_exactness(sz, out, args.smoke)
  else:
    section_profile(sz, out, args.smoke)
  log(f"section {args.section}: {time.perf_counter() - t0:.1f} s; results in {out}")


if __name__ == "__main__":
  script_args.run_main(main)
