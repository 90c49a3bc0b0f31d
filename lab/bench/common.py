"""What every section of the accelerator benchmark shares: the sizes it runs
at (the GPU run's or the smoke test's), random weights, a timed piece (n
cached decode calls in one jitted loop), the card's bandwidth and the output
files (``bench_gpu.json``: one key per section; ``bench_gpu.md``)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import paper
from specdec_jax.models.t5 import PRESETS, T5Config, T5Model, stored_dtype
from specdec_jax.scripting import script_args
from specdec_jax.timing import median

from lab.common import machine_description, time_call

# Table 2 (EnDe, T = 0, γ 7 in every row) and Table 4 of the paper: α of each
# T5 1.1 draft beside T5-XXL, and the paper's c, its EXP (Theorem 3.8) and its
# measured speedup on a TPU-v4.
PAPER_GAMMA = 7
PAPER_ENDE_T0 = {r.draft: dict(alpha=r.alpha, c=r.c, exp=r.expected, speed=r.speedup)
                 for r in paper.TABLE2 if r.task == "ende" and r.temperature == 0}
# The six T = 0 rows of Table 2, in order of value (EnDe small's 3.4X first).
T0_ROWS = tuple((r.task, r.draft) for r in paper.TABLE2 if r.temperature == 0)


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
  new_tokens: int        # tokens each generate call makes (hf sections, loops)
  hf_repeats: int
  bandwidth_mib: int
  demo_examples: int
  demo_warmup: int
  max_decode_len: int
  exact_examples: int
  exact_warmup: int
  profile_calls: int     # timed calls traced for the first target's kernel profile
  loop_rows: tuple       # (task, draft) rows of Table 2 at T = 0 the loops section runs
  loop_repeats: int      # timed calls of each loop (interleaved), median
  tree_max_nodes: int    # the largest tree the loops section's tree search may pick
  mismatch_inputs: int   # random inputs of the XXL-sized T = 0 mismatch count
  mismatch_tokens: int   # tokens decoded per input there
  hf_gamma: int          # draft tokens per round, HF assisted and ours (hf section)


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
    max_decode_len=128, exact_examples=100, exact_warmup=2, profile_calls=3,
    loop_rows=T0_ROWS, loop_repeats=3, tree_max_nodes=64, mismatch_inputs=100,
    mismatch_tokens=32, hf_gamma=3)

SMOKE = Sizes(
    targets={"xxl": _toy(64, 2), "xl": _toy(32, 2)},
    drafts={"small": _toy(16, 1)},
    ks=(1, 8), cache_len=16, position=4, input_len=8, inner=2, repeats=2,
    new_tokens=8, hf_repeats=1, bandwidth_mib=8, demo_examples=1, demo_warmup=0,
    max_decode_len=8, exact_examples=1, exact_warmup=1, profile_calls=1,
    loop_rows=(("ende", "small"), ("cnndm", "small")), loop_repeats=1, tree_max_nodes=8, mismatch_inputs=1,
    mismatch_tokens=8, hf_gamma=2)


def draft_seed(name: str) -> int:
  """The seed of a draft size's random weights, the same in every section."""
  return 100 + ("small", "base", "large").index(name)


def describe(config: T5Config) -> str:
  return (f"d {config.d_model}, {config.num_decoder_layers} decoder layers, "
          f"d_ff {config.d_ff}, V {config.vocab_size}")


# ------------------------------------------------------------------ output


def machine_info() -> dict:
  """The device, the driver (nvidia-smi, where there is one) and versions."""
  d = jax.devices()[0]
  info = dict(device=d.device_kind, platform=d.platform, device_count=jax.device_count(),
              jax=jax.__version__, host=machine_description())
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


# ----------------------------------------------------------- random weights


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(key, scale, shape: tuple, dtype):
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def random_params(model: T5Model, key, param_dtype) -> dict:
  """Random weights in ``model.init``'s tree, leaves in ``stored_dtype``
  (as ``cast_params(model.init(key), param_dtype)`` keeps them): arrays of
  two or more dimensions normal with standard deviation 1/sqrt(first
  dimension), vectors (norm scales) ones. For timing, where values do not
  matter: one small program per distinct shape, where Flax's ``init`` of an
  XL-sized model is one program that took a minute to compile on a CPU.
  """
  shapes = jax.eval_shape(model.init, key)
  flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  keys = jax.random.split(key, len(flat))
  leaves = []
  for i, (path, leaf) in enumerate(flat):
    dtype = stored_dtype("/".join(str(getattr(p, "key", p)) for p in path), param_dtype)
    shape = tuple(leaf.shape)
    leaves.append(jnp.ones(shape, dtype) if len(shape) < 2
                  else _normal(keys[i], 1.0 / np.sqrt(shape[0]), shape, dtype))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def random_inputs(config: T5Config, batch: int, length: int, seed: int) -> jax.Array:
  """Random encoder inputs [batch, length] (no padding, no EOS)."""
  return jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 2, config.vocab_size,
                            dtype=jnp.int32)


# ------------------------------------------------------------ timed pieces


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
  def random(cls, name: str, config: T5Config, sz: Sizes, seed: int,
             params: Any = None) -> "Model":
    """Random weights (or ``params``, e.g. another config's same weights)
    and a cache whose cross-attention keys/values come from a random encoder
    output: the encoder's weights are never read by a decode step."""
    t0 = time.perf_counter()
    model = T5Model(config)
    if params is None:
      params = random_params(model, jax.random.PRNGKey(seed), "bfloat16")
    encoded = jax.random.normal(jax.random.PRNGKey(seed + 1), (1, sz.input_len, config.d_model),
                                config.jnp_dtype)
    inputs = jnp.full((1, sz.input_len), 5, jnp.int32)
    cache = jax.jit(model.init_cache, static_argnums=3)(params, encoded, inputs, sz.cache_len)
    jax.block_until_ready(cache)
    log(f"{name}: weights and cache in {time.perf_counter() - t0:.1f} s")
    return cls(name, config, params, cache)

  def piece(self, k: int, sz: Sizes) -> tuple[Callable[[], Any], float]:
    fn, secs = compiled(decode_loop(T5Model(self.config), k, sz.position, sz.inner),
                        self.params, self.cache)
    log(f"{self.name} k={k}: compiled in {secs:.1f} s")
    return fn, secs


def pass_name(k: int) -> str:
  return "one-token step" if k == 1 else f"{k}-position pass"


# --------------------------------------------------------------- bandwidth


class Bandwidth:
  """Memory bandwidth, the one measurement of it: GB/s (1e9 bytes) of passes
  over one ``mib`` MiB float32 buffer, the bytes a pass moves over the median
  time of its calls. Two passes read and write every byte (counted twice): a
  device-to-device copy and an elementwise xor of the bits (which no compiler
  can drop). The others only read (``READS``): a jitted sum, a matrix-vector
  product (a decode step's access pattern) and, on a CPU, where one thread may
  not saturate memory, numpy's sum on one thread and on one thread per core
  (numpy releases the GIL). The buffer stays allocated, so that single passes
  can be interleaved with other timings (``once``)."""

  COPY = "device-to-device copy"
  XOR = "elementwise pass (x ^ 1)"

  def __init__(self, mib: int):
    n = mib * 2 ** 20 // 4
    self.x = jax.block_until_ready(
        jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.float32))
    nbytes = self.x.nbytes
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint32)
    xor = jax.jit(lambda a: jax.lax.bitcast_convert_type(bits(a) ^ jnp.uint32(1), jnp.float32))
    cols = 4096 if n % 4096 == 0 else 1
    gemv = jax.jit(lambda a, v: a.reshape(-1, cols) @ v)
    v = jnp.ones((cols,), jnp.float32)
    copy, total = jax.jit(jnp.copy), jax.jit(jnp.sum)
    self.passes: dict[str, tuple[int, Callable[[], Any]]] = {
        self.COPY: (2 * nbytes, lambda: copy(self.x)),
        self.XOR: (2 * nbytes, lambda: xor(self.x)),
        "jax sum (read)": (nbytes, lambda: total(self.x)),
        "jax matrix-vector product (read)": (nbytes, lambda: gemv(self.x, v)),
    }
    if jax.default_backend() == "cpu":
      host = np.asarray(self.x)   # the same buffer, not a copy
      workers = os.cpu_count() or 1
      parts = np.array_split(host, workers)
      self._pool = concurrent.futures.ThreadPoolExecutor(workers)
      self.passes["numpy sum, 1 thread (read)"] = (nbytes, host.sum)
      self.passes[f"numpy sum, {workers} threads (read)"] = (
          nbytes, lambda: list(self._pool.map(np.sum, parts)))
    for _, fn in self.passes.values():
      jax.block_until_ready(fn())   # compiled before anything is timed

  @property
  def reads(self) -> list[str]:
    """The passes that read each byte once (no writes)."""
    return [name for name in self.passes if name not in (self.COPY, self.XOR)]

  def once(self, name: str) -> float:
    """GB/s of one call of pass ``name``."""
    nbytes, fn = self.passes[name]
    return nbytes / median(time_call(fn, repeats=1, warmup=0)) / 1e9

  def measure_all(self, repeats: int = 20) -> dict[str, float]:
    """GB/s of every pass, each the median of ``repeats`` calls."""
    return {name: nbytes / median(time_call(fn, repeats=repeats, warmup=1)) / 1e9
            for name, (nbytes, fn) in self.passes.items()}


def measure_bandwidth(mib: int, repeats: int = 20) -> tuple[dict[str, float], str]:
  """(GB/s of every ``Bandwidth`` pass, the pass floors are taken at): the
  fastest of the passes that read and write every byte (copy, xor), the
  bandwidth this benchmark's floors have always used."""
  rates = Bandwidth(mib).measure_all(repeats)
  return rates, max((Bandwidth.COPY, Bandwidth.XOR), key=rates.get)


def section_bandwidth(sz: Sizes, out: Path, smoke: bool = False) -> None:
  del smoke
  rates, best = measure_bandwidth(sz.bandwidth_mib)
  lines = [script_args.markdown_header(["pass", "buffer MiB", "bytes moved per call (GB)",
                                        "GB/s (bytes moved)"])]
  for name, r in rates.items():
    moved = (1 if name.endswith("(read)") else 2) * sz.bandwidth_mib * 2 ** 20 / 1e9
    lines.append(script_args.markdown_row([name, sz.bandwidth_mib, f"{moved:.2f}", f"{r:.0f}"]))
  lines += ["", f"Achievable bandwidth (the fastest pass that reads and writes every byte): "
                f"**{rates[best]:.0f} GB/s** ({best})."]
  record(out, "bandwidth", dict(gbps=rates[best], passes=rates, buffer_mib=sz.bandwidth_mib),
         emit(lines))


def bandwidth_for(sz: Sizes, out: Path) -> tuple[float, str]:
  """The bandwidth floors are taken at: the bandwidth section's, else
  measured now (and recorded, so that later sections take the same)."""
  done = earlier(out, "bandwidth")
  if done:
    return float(done["gbps"]), "the bandwidth section's"
  rates, best = measure_bandwidth(sz.bandwidth_mib)
  record(out, "bandwidth", dict(gbps=rates[best], passes=rates, buffer_mib=sz.bandwidth_mib),
         None)
  return rates[best], f"measured by the first section that needed it ({best})"
