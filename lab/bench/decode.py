"""Decode speed at batch 1 against what the hardware allows: the baseline's
decode step against the bytes it must read at the measured bandwidth
(``ratio_report``, ``scripts/bench_decode.py``) and the verification cost
v(k), the k-token pass relative to one token, next to bare matmuls of the
same weights (``vk_report``, ``scripts/bench_vk.py``; paper §3.4). Each
script's docstring says what its table holds."""

from __future__ import annotations

import functools
import importlib.util
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from specdec_jax import memory, timing
from specdec_jax.checkpoints import load_checkpoint
from specdec_jax.decoding import temperature_sample
from specdec_jax.models.t5 import PRESETS, T5Config, T5Model
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting import script_args
from specdec_jax.scripting.script_args import markdown_header

from lab.bench.common import Bandwidth, decode_loop, random_params
from lab.common import count_params, load_average, machine_description, time_call

SIZES = {"small": "t5_1_1_small", "base": "t5_1_1_base"}


def _median_time(fn, repeats: int) -> float:
  """Median seconds of ``repeats`` calls of ``fn`` (``lab.common.time_call``, no warm-up)."""
  return timing.median(time_call(fn, repeats, warmup=0))


def bench_one(size: str, dtype: str, steps: int, repeats: int, input_len: int,
              params_cache: dict, bw: Bandwidth, reader: str) -> dict:
  config = PRESETS[SIZES[size]].replace(dtype=dtype)
  model = T5Model(config)
  if size not in params_cache:
    params_cache.clear()  # keep at most one model's weights alive
    params_cache[size] = jax.jit(model.init)(jax.random.PRNGKey(0))
  params = params_cache[size]
  inputs = jax.random.randint(jax.random.PRNGKey(1), (1, input_len), 2, config.vocab_size,
                              dtype=jnp.int32)
  key = jax.random.PRNGKey(2)
  greedy = SamplingConfig()

  def run():
    return temperature_sample(model, params, inputs, key, max_decode_len=steps,
                              sampling=greedy, eos_id=-1)

  out = jax.block_until_ready(run())  # compile
  assert int(out.length[0]) == steps, out.length
  prefill_fn = jax.jit(lambda p, x: model.init_cache(p, model.encode(p, x), x, steps))
  jax.block_until_ready(prefill_fn(params, inputs))
  prefill = _median_time(lambda: prefill_fn(params, inputs), repeats)
  param_dtype = max(jax.tree.leaves(params), key=lambda x: x.size).dtype
  wbytes = memory.step_weight_bytes(config, None, param_dtype)
  # Interleave: one decode call, then one bandwidth pass, ``repeats`` times;
  # the ratio is taken per pair, so slow drifts in machine load cancel.
  totals, bws, ratios = [], [], []
  for _ in range(repeats):
    total = _median_time(run, 1)
    gbps = bw.once(reader)
    step = (total - prefill) / steps
    totals.append(total)
    bws.append(gbps)
    ratios.append(step / (wbytes / (gbps * 1e9)))
  total = timing.median(totals)
  return dict(size=size, dtype=dtype, params=count_params(params),
              ms_token=1e3 * total / steps, ms_step=1e3 * (total - prefill) / steps,
              prefill_ms=1e3 * prefill, weight_bytes=wbytes,
              kv_bytes=memory.cache_bytes(config, memory.planning_partitioner(None), 1,
                                          input_len, steps, dtype),
              bw=timing.median(bws), ratio=timing.median(ratios),
              ratio_min=min(ratios), ratio_max=max(ratios))


# ------------------------------------------------------------------- v(k)

VK_MODELS = {"demo": script_args.TARGET, "small": "t5_1_1_small", "base": "t5_1_1_base",
             "xl": "t5_1_1_xl"}


def load_t5_module(path: str):
  """A ``models/t5.py`` from ``path`` as its own module (before/after rows)."""
  name = f"_t5_compare_{abs(hash(path))}"
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod  # dataclasses look their module up while defining
  spec.loader.exec_module(mod)
  return mod


def step_kernels(params: dict, config: T5Config) -> tuple[list[tuple], Any, bool]:
  """The matrices one cached decode step multiplies by, per decoder layer.

  Per layer: self-attention query/key/value/out, cross-attention query/out
  (its key/value are applied once per example, by ``init_cache``), and the
  MLP's wi_0, wi_1, wo (1.1) or wi, wo (1.0). Then the logits matrix
  [d, V] (1.1) or the embedding [V, d] used transposed (1.0, flag True).
  """
  dec = params["decoder"]
  layers = []
  for i in range(config.num_decoder_layers):
    lp = dec[f"layers_{i}"]
    sa, ca, mlp = lp["self_attention"], lp["encoder_decoder_attention"], lp["mlp"]
    wi = ((mlp["wi_0"]["kernel"], mlp["wi_1"]["kernel"]) if config.gated
          else (mlp["wi"]["kernel"],))
    layers.append((sa["query"]["kernel"], sa["key"]["kernel"], sa["value"]["kernel"],
                   sa["out"]["kernel"], ca["query"]["kernel"], ca["out"]["kernel"])
                  + wi + (mlp["wo"]["kernel"],))
  if config.logits_via_embedding:
    return layers, params["token_embedder"]["embedding"], True
  return layers, dec["logits_dense"]["kernel"], False


@functools.partial(jax.jit, static_argnames=("transposed", "n"))
def _matmul_steps(layers, logits_w, x0, transposed: bool, n: int):
  """n chained passes of x [k, d] through ``step_kernels``' matrices.

  Each product feeds the next (a few adds/multiplies of [k, d_ff] glue them,
  as in the model), and each pass starts from the previous one's result, so
  XLA can neither hoist nor drop any matmul.
  """
  def body(i, acc):
    x = x0 + acc * 1e-30
    for w in layers:
      wq, wk, wv, wo, cq, co = w[:6]
      x = x + (x @ wq + x @ wk + x @ wv) @ wo
      x = x + (x @ cq) @ co
      h = (x @ w[6]) * (x @ w[7]) if len(w) == 9 else x @ w[6]
      x = x + h @ w[-1]
    logits = x @ logits_w.T if transposed else x @ logits_w
    return acc + jnp.sum(logits)
  return jax.lax.fori_loop(0, n, body, jnp.float32(0))


def vk_rows(label: str, params: dict, config: T5Config, models: dict, ks: list[int],
            cache_len: int, position: int, input_len: int, inner: int,
            repeats: int) -> list[dict]:
  """v(k) of each model in ``models`` (name -> T5Model class of some t5.py)
  and of the bare matmuls, all timed interleaved (see module docstring)."""
  inputs = jax.random.randint(jax.random.PRNGKey(1), (1, input_len), 2, config.vocab_size,
                              dtype=jnp.int32)
  layers, logits_w, transposed = step_kernels(params, config)
  pieces: dict[tuple[str, int], Callable[[], Any]] = {}
  for name, model_cls in models.items():
    model = model_cls(config)
    cache = jax.jit(lambda p, x, m=model: m.init_cache(p, m.encode(p, x), x, cache_len))(
        params, inputs)
    for k in ks:
      pieces[(name, k)] = functools.partial(jax.jit(decode_loop(model, k, position, inner)),
                                            params, cache)
  for k in ks:
    # Distinct rows: identical ones would let XLA compute one and copy it.
    x0 = jax.random.normal(jax.random.PRNGKey(k), (k, config.d_model), config.dtype)
    pieces[("matmul", k)] = functools.partial(_matmul_steps, layers, logits_w, x0,
                                              transposed, inner)
  for (name, k), fn in pieces.items():  # compile + warm up
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    print(f"# v(k) piece {name} k={k}: compiled and run once in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)
  # Medians of interleaved calls, ms per inner call -> seconds.
  med = {key: ms / 1e3 for key, ms in timing.interleaved_medians_ms(pieces, repeats,
                                                                   inner).items()}
  rows = []
  for name in list(models) + ["matmul"]:
    for k in ks:
      rows.append(dict(model=label, impl=name, k=k, ms=1e3 * med[(name, k)],
                       ratio=med[(name, k)] / med[(name, ks[0])],
                       mm_ratio=med[("matmul", k)] / med[("matmul", ks[0])],
                       mm_ms=1e3 * med[("matmul", k)]))
  return rows


def vk_report(args: Any) -> None:
  """``scripts/bench_vk.py``: the v(k) table of each of --vk-models."""
  ks = sorted({int(k) for k in args.vk_ks.split(",")})
  if ks[0] != 1:
    raise SystemExit("--vk-ks must include 1 (v(k) is relative to k = 1)")
  models = {"decode": T5Model}
  if args.vk_compare:
    models = {"decode (--vk-compare)": load_t5_module(args.vk_compare).T5Model, **models}
  print(f"Machine: {machine_description()}")
  print(f"load average at start: {load_average()}")
  print(f"batch 1, cache length {args.vk_cache_len}, positions {args.vk_position}.. "
        f"(alternating +0/+1), encoder input length {args.input_len}; each piece "
        f"{args.vk_inner} back-to-back calls inside one jit, {args.repeats} timed calls per "
        f"piece interleaved after 1 compile call; medians\n")
  print(markdown_header(["model", "what", "k", "ms per call", "ratio to k=1", "bare-matmul ms",
                         "bare-matmul ratio", "ratio / bare-matmul ratio", "non-matmul ms"]))
  for name in [m for m in args.vk_models.split(",") if m]:
    if name not in VK_MODELS:
      raise SystemExit(f"unknown --vk-models entry {name!r}; choose from {sorted(VK_MODELS)}")
    if name == "demo":
      params, config = load_checkpoint(script_args.resolve(VK_MODELS[name]))
      label = (f"demo target (d{config.d_model}, {config.num_decoder_layers} dec layers, "
               f"V={config.vocab_size}, {count_params(params) / 1e6:.1f}M)")
    else:
      config = PRESETS[VK_MODELS[name]].replace(dtype=args.vk_dtype)
      # Random weights kept as the runner keeps them at param_dtype = --vk-dtype.
      t0 = time.perf_counter()
      params = random_params(T5Model(config), jax.random.PRNGKey(0), args.vk_dtype)
      print(f"# {VK_MODELS[name]}: random weights in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr, flush=True)
      label = (f"{VK_MODELS[name]} random (d{config.d_model}, {config.num_decoder_layers} dec "
               f"layers, V={config.vocab_size})")
    rows = vk_rows(label, params, config, models, ks, args.vk_cache_len, args.vk_position,
                   args.input_len, args.vk_inner, args.repeats)
    for r in rows:
      matmul = r["impl"] == "matmul"
      rel = "" if matmul else f"{r['ratio'] / r['mm_ratio']:.2f}"
      extra = "" if matmul else f"{r['ms'] - r['mm_ms']:.3f}"
      print(f"| {r['model']} | {'bare matmuls' if matmul else r['impl']} | {r['k']} "
            f"| {r['ms']:.3f} | {r['ratio']:.2f} | {r['mm_ms']:.3f} | {r['mm_ratio']:.2f} "
            f"| {rel} | {extra} |", flush=True)
    del params
  print(f"\nload average at end: {load_average()}")


def ratio_report(args: Any) -> None:
  """``scripts/bench_decode.py``: the bandwidth, then one row per --sizes x
  --dtypes."""
  sizes = [s for s in args.sizes.split(",") if s]
  dtypes = [d for d in args.dtypes.split(",") if d]
  for s in sizes:
    if s not in SIZES:
      raise ValueError(f"--sizes: unknown size {s!r}; choose from {sorted(SIZES)}")

  print(f"Machine: {machine_description()}")
  bw = Bandwidth(args.bandwidth_mb)
  rates = bw.measure_all(max(args.repeats, 5))
  reader = max(bw.reads, key=rates.get)
  print(f"Memory bandwidth (GB/s, median of >=5 passes over {args.bandwidth_mb} MiB; "
        f"lab.bench.common.Bandwidth): " + ", ".join(f"{k} {v:.2f}" for k, v in rates.items())
        + f"; reference reader = fastest read = {reader}")
  print(f"batch 1, input length {args.input_len}, {args.steps} greedy steps (eos_id=-1), "
        f"{args.repeats} timed calls after 1 compile call, each followed by one "
        f"{reader} pass; medians reported (ratio: median of per-pair ratios, [min-max])\n")

  print(markdown_header(["model", "act dtype", "params (M)", "ms/token (e2e)", "prefill ms",
                         "ms/step", "weight MB/step", "KV MB", "implied GB/s", "measured GB/s",
                         "ratio step/(bytes/bw)"]))
  params_cache: dict = {}
  for size in sizes:
    for dtype in dtypes:
      r = bench_one(size, dtype, args.steps, args.repeats, args.input_len, params_cache,
                    bw, reader)
      implied = r["weight_bytes"] / (r["ms_step"] * 1e-3) / 1e9
      print(f"| {SIZES[size]} | {dtype} | {r['params'] / 1e6:.1f} | {r['ms_token']:.2f} "
            f"| {r['prefill_ms']:.1f} | {r['ms_step']:.2f} | {r['weight_bytes'] / 1e6:.1f} "
            f"| {r['kv_bytes'] / 1e6:.1f} | {implied:.2f} | {r['bw']:.2f} "
            f"| {r['ratio']:.2f} [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] |", flush=True)
