"""What the studies share besides ``timing``'s loop (``timing.repeat``) and
interleaving (``timing.interleaved_times``): picking one of two stacked input
sets inside a timed loop, so that no input is loop-invariant (every study
times a piece of Algorithm 1's round, paper §2.3, this way), the flags and
set-up of the scripts that run a study on a pair of models, timing one call,
a decoding step's roofline inputs (bytes read, parameters) and a line
describing the machine."""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import time
from typing import Any, Callable, Optional

import jax

from specdec_jax import data, memory, storage
from specdec_jax.drafts import bridge, feature_bridge
from specdec_jax.memory import ConfigLike
from specdec_jax.models.t5 import get_config, param_shapes, stored_dtype
from specdec_jax.partitioning import Partitioner, flatten_names
from specdec_jax.run import Experiment, Setup, prepare
from specdec_jax.scripting import script_args
from specdec_jax.timing import block

Array = jax.Array


def pick(stack: Any, i: Array) -> Any:
  """Element i % 2 of a pytree of arrays stacked on a leading axis of 2."""
  return jax.tree_util.tree_map(lambda a: a[i % 2], stack)


INPUT_BUCKETS = "32,48,64,96"   # as configs/demo.gin's Experiment.input_buckets


def add_decoding_arguments(parser: argparse.ArgumentParser, gammas: Optional[str] = None,
                           gammas_help: str = "", temperatures: str = "0,1",
                           input_buckets: bool = True, seed: bool = True) -> None:
  """--max_input_len, --max_decode_len, --temperatures and, as asked, --gammas,
  --input_buckets and --seed."""
  if gammas is not None:
    parser.add_argument("--gammas", default=gammas,
                        help="comma-separated γ (draft tokens per round)"
                             + (f"; {gammas_help}" if gammas_help else ""))
  parser.add_argument("--temperatures", default=temperatures,
                      help="comma-separated sampling temperatures (0: argmax)")
  parser.add_argument("--max_input_len", type=int, default=128,
                      help="input tokens kept per example (longer inputs are truncated)")
  parser.add_argument("--max_decode_len", type=int, default=128, help="most tokens generated")
  if input_buckets:
    parser.add_argument("--input_buckets", default=INPUT_BUCKETS,
                        help="input lengths each example is padded to, the smallest that holds "
                             "it (Experiment.input_buckets, as in configs/demo.gin); 'none': "
                             "always --max_input_len")
  if seed:
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed of the sampling keys")


def study_parser(doc: str, gammas: str = "1,3,5") -> argparse.ArgumentParser:
  """The flags every study of a round shares: the pair (``script_args``'s demo
  defaults), its shortlist, --gammas, --temperatures, the decode lengths,
  --num_examples, --repeats, --inner and --position."""
  p = script_args.new_parser(doc)
  script_args.add_pair_arguments(p)
  script_args.add_shortlist_argument(p)
  add_decoding_arguments(p, gammas=gammas, input_buckets=False, seed=False)
  p.add_argument("--num_examples", type=int, default=8, help="examples (the first warms up)")
  p.add_argument("--repeats", type=int, default=5, help="interleaved passes (medians)")
  p.add_argument("--inner", type=int, default=8, help="runs of a piece per timed call")
  p.add_argument("--position", type=int, default=32, help="decoder position of the pieces")
  return p


def prepare_pair(args: argparse.Namespace) -> tuple[Experiment, Setup]:
  """The experiment of a ``study_parser``'s flags (a T5 draft, γ = max of
  --gammas, the first example a warm-up) and its loaded models and inputs."""
  exp = Experiment(task=args.task, source=args.source, vocab_path=args.vocab,
                   target_checkpoint=args.target, draft_name="t5", draft_checkpoint=args.draft,
                   draft_shortlist=args.draft_shortlist, max_input_len=args.max_input_len,
                   max_decode_len=args.max_decode_len, num_warmup=1,
                   num_examples=args.num_examples,
                   gamma=max(script_args.comma_list(args.gammas, int)))
  return exp, prepare(exp)


def time_call(fn: Callable[[], Any], repeats: int = 10, warmup: int = 1) -> list[float]:
  """Seconds per call of ``fn()`` (each call blocked until ready); compile
  happens in the warm-up calls, which are not timed."""
  for _ in range(warmup):
    block(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    block(fn())
    times.append(time.perf_counter() - t0)
  return times


def step_params(cfg: ConfigLike) -> int:
  """How many parameters a decoding step reads (``memory.reads_per_step``): a
  step's matmuls cost 2 flops per parameter per position."""
  cfg = get_config(cfg) if isinstance(cfg, str) else cfg
  return sum(math.prod(x.shape) for name, x in flatten_names(param_shapes(cfg)).items()
             if memory.reads_per_step(name, cfg))


def step_bytes(cfg: ConfigLike, part: Optional[Partitioner] = None,
               param_dtype: Any = "float32", dtype: Optional[str] = None, batch: int = 1,
               input_len: int = 512, cache_len: int = 256) -> int:
  """Bytes each device reads per decoding step: its weights
  (``memory.step_weight_bytes``) and its decoder cache (``memory.cache_bytes``: self-
  attention K/V over ``cache_len`` positions, cross-attention K/V over
  ``input_len``; activations at ``dtype``)."""
  part = memory.planning_partitioner(None) if part is None else part
  return memory.step_weight_bytes(cfg, part, param_dtype) + memory.cache_bytes(
      cfg, part, batch, input_len, cache_len, dtype)


def _cpu_model() -> str:
  model = platform.processor() or "?"
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
  except OSError:
    return model
  for line in out.splitlines():
    if line.startswith("Model name:"):
      model = line.split(":", 1)[1].strip()
  return model


def _memory() -> str:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          return f"{int(line.split()[1]) / 2**20:.1f} GiB"
  except OSError:
    pass
  return "?"


def machine_description() -> str:
  """One line: the CPUs this process may use (of all), their model, the RAM,
  and JAX's version, backend and devices."""
  usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  devices = jax.devices()
  return (f"{usable} of {os.cpu_count()} CPUs ({_cpu_model()}), RAM {_memory()}; "
          f"jax {jax.__version__} on {jax.default_backend()}: {len(devices)} x "
          f"{devices[0].device_kind}")


def load_average() -> str:
  """The 1, 5 and 15 minute load averages, e.g. '0.52 0.40 0.33'."""
  return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cast_params(params: Any, param_dtype: Any) -> Any:
  """A parameter tree cast by ``stored_dtype`` (in memory; loaders cast on read)."""
  def cast(path, x):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    return x.astype(stored_dtype(name, param_dtype))
  return jax.tree_util.tree_map_with_path(cast, params)


def count_params(params: Any) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))


def bridges_in(directory: str) -> list[str]:
  """The bridge files a draft checkpoint holds (such a draft needs the target)."""
  return [name for name in (bridge.FILENAME, feature_bridge.FILENAME)
          if storage.is_file(storage.join(directory, name))]


def parse_input_buckets(text: str, max_len: int, what: str = "--input_buckets") -> tuple[int, ...]:
  """'32,48,64' -> (32, 48, 64), checked; '' or 'none' -> () (no bucketing)."""
  if text.strip() in ("", "none"):
    return ()
  try:
    buckets = tuple(int(n) for n in text.split(","))
  except ValueError:
    raise ValueError(f"{what} must be a comma-separated list of ints or 'none', "
                     f"got {text!r}") from None
  data.check_input_buckets(buckets, max_len, what)
  return buckets
