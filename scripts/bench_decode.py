"""Baseline decode speed vs the memory-bandwidth bound, on this machine.

For T5 1.1 small- and base-sized models with random weights, batch 1, greedy
``temperature_sample`` forced to run ``--steps`` steps (eos_id=-1 never
matches), this prints a markdown table with:

* ms/token end to end: median wall time of one whole call (encoder, cross K/V,
  the decode loop) divided by the number of generated tokens;
* ms/step: the decode loop alone, (end-to-end - prefill) / steps, where
  prefill = median time of a jitted ``encode`` + ``init_cache`` for the same
  input;
* MB/step: bytes of weights one decode step must read (accounting below);
* implied GB/s = MB/step / ms/step, next to the machine's measured memory read
  bandwidth (median of several passes over a large array, same script);
* ratio = ms/step / (bytes / bandwidth): 1.0 means the step runs at the speed
  of streaming its weights from memory once. The machine may be shared, so
  each timed decode call is followed by one bandwidth pass (the reader that
  was fastest in the initial measurement) and the ratio is the median of the
  per-pair ratios.

Weight accounting per decode step (batch 1): every decoder parameter except the
cross-attention key/value kernels (their outputs are computed once per example
by ``init_cache``), plus the logits matrix, plus one embedding row. Encoder
weights are excluded. Parameters are float32 in both activation dtypes (the
model keeps params in f32 and casts inside the step), so bytes are the same for
bf16 runs. The KV caches (self and cross, activations) are reported separately
(column "KV MB"), not included in the ratio.

Compile time is excluded: each configuration runs once to compile, then
``--repeats`` timed runs with ``block_until_ready``.

  PYTHONPATH=. python scripts/bench_decode.py --sizes small,base \
      --dtypes float32,bfloat16 --steps 64 --repeats 5
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.decoding import temperature_sample
from specdec_jax.models.t5 import PRESETS, T5Model, count_params
from specdec_jax.sampling import SamplingConfig

SIZES = {"small": "t5_1_1_small", "base": "t5_1_1_base"}


def machine_description() -> str:
  cpus = os.cpu_count()
  try:
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
  except OSError:
    nproc = "?"
  model = platform.processor() or "?"
  try:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
      if line.startswith("Model name:"):
        model = line.split(":", 1)[1].strip()
  except OSError:
    pass
  mem_gib = "?"
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          mem_gib = f"{int(line.split()[1]) / 2**20:.1f} GiB"
  except OSError:
    pass
  return (f"nproc={nproc} (os.cpu_count={cpus}), CPU model: {model}, RAM: {mem_gib}, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")


def _median_time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


class Bandwidth:
  """Memory bandwidth (GB/s, 1e9 bytes) over an ``mb`` MiB float32 array.

  Several readers, because a single thread may not saturate memory: a jitted
  jnp.sum, an XLA matrix-vector product (the decode step's access pattern),
  numpy sum on one thread and on one thread per core (numpy releases the GIL),
  and a numpy copy (read + write, counted as 2x the bytes; not a read rate).
  The arrays stay allocated so single passes can be interleaved with the
  decode timings (the machine is shared: both must see the same load).
  """

  def __init__(self, mb: int):
    n = mb * 2**20 // 4
    self.a = np.random.default_rng(0).random(n, dtype=np.float32)
    self.nbytes = self.a.nbytes
    self.x = jnp.asarray(self.a)
    cols = 4096
    self.m = self.x[: (n // cols) * cols].reshape(-1, cols)
    self.v = jnp.ones((cols,), jnp.float32)
    self._sum = jax.jit(jnp.sum)
    self._gemv = jax.jit(lambda m, v: m @ v)
    jax.block_until_ready((self._sum(self.x), self._gemv(self.m, self.v)))
    self.workers = os.cpu_count() or 1
    self.parts = np.array_split(self.a, self.workers)
    self.pool = concurrent.futures.ThreadPoolExecutor(self.workers)
    self.b = np.empty_like(self.a)
    self.readers = {
        "jax_sum_read": (self.nbytes, lambda: self._sum(self.x)),
        "jax_gemv_read": (self.m.size * 4, lambda: self._gemv(self.m, self.v)),
        "numpy_sum_read_1thread": (self.nbytes, lambda: self.a.sum()),
        f"numpy_sum_read_{self.workers}threads":
            (self.nbytes, lambda: list(self.pool.map(np.sum, self.parts))),
    }

  def once(self, name: str) -> float:
    nbytes, fn = self.readers[name]
    return nbytes / _median_time(fn, 1) / 1e9

  def measure_all(self, repeats: int) -> dict:
    out = {k: nb / _median_time(fn, repeats) / 1e9 for k, (nb, fn) in self.readers.items()}
    out["numpy_copy_rw"] = 2 * self.nbytes / _median_time(
        lambda: np.copyto(self.b, self.a), repeats) / 1e9
    return out


def step_weight_bytes(params) -> int:
  """Bytes of weights one batch-1 decode step reads (see module docstring)."""
  dec = params["decoder"]
  total = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(dec):
    names = [getattr(p, "key", str(p)) for p in path]
    if "encoder_decoder_attention" in names and ("key" in names or "value" in names):
      continue
    total += leaf.size * leaf.dtype.itemsize
  emb = params["token_embedder"]["embedding"]
  total += emb.shape[1] * emb.dtype.itemsize  # one embedding row
  return int(total)


def kv_bytes(config, input_len: int, cache_len: int, dtype) -> int:
  itemsize = jnp.dtype(dtype).itemsize
  per_pos = 2 * config.num_decoder_layers * config.num_heads * config.head_dim * itemsize
  return per_pos * (input_len + cache_len)


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
  wbytes = step_weight_bytes(params)
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
  total = statistics.median(totals)
  return dict(size=size, dtype=dtype, params=count_params(params),
              ms_token=1e3 * total / steps, ms_step=1e3 * (total - prefill) / steps,
              prefill_ms=1e3 * prefill, weight_bytes=wbytes,
              kv_bytes=kv_bytes(config, input_len, steps, dtype),
              bw=statistics.median(bws), ratio=statistics.median(ratios),
              ratio_min=min(ratios), ratio_max=max(ratios))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--sizes", default="small,base", help="comma list of: small, base")
  ap.add_argument("--dtypes", default="float32,bfloat16", help="activation dtypes")
  ap.add_argument("--steps", type=int, default=64, help="generated tokens per call")
  ap.add_argument("--repeats", type=int, default=5, help="timed runs (median reported)")
  ap.add_argument("--input-len", type=int, default=64)
  ap.add_argument("--bandwidth-mb", type=int, default=1024, help="array size for bandwidth")
  args = ap.parse_args()
  sizes = [s for s in args.sizes.split(",") if s]
  dtypes = [d for d in args.dtypes.split(",") if d]
  for s in sizes:
    if s not in SIZES:
      ap.error(f"unknown size {s!r}; choose from {sorted(SIZES)}")

  print(f"Machine: {machine_description()}")
  bw = Bandwidth(args.bandwidth_mb)
  rates = bw.measure_all(max(args.repeats, 5))
  reader = max((k for k in rates if k != "numpy_copy_rw"), key=rates.get)
  print(f"Memory bandwidth (GB/s, median of >=5 passes over {args.bandwidth_mb} MiB): "
        + ", ".join(f"{k}={v:.2f}" for k, v in rates.items())
        + f"; reference reader = fastest read = {reader}")
  print(f"batch 1, input length {args.input_len}, {args.steps} greedy steps (eos_id=-1), "
        f"{args.repeats} timed calls after 1 compile call, each followed by one "
        f"{reader} pass; medians reported (ratio: median of per-pair ratios, [min-max])\n")

  print("| model | act dtype | params (M) | ms/token (e2e) | prefill ms | ms/step "
        "| weight MB/step | KV MB | implied GB/s | measured GB/s | ratio step/(bytes/bw) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
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


if __name__ == "__main__":
  main()
