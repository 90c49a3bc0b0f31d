"""What a run decodes: host batches and the two programs it times (§4)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator, Optional

import jax
import numpy as np

from specdec_jax import data
from specdec_jax.decoding import (STATIC_ARGNAMES, speculative_decode, temperature_sample,
                                  tree_speculative_decode)
from specdec_jax.run.setup import Setup

Array = jax.Array


def batch_indices(n: int, start: int, batch: int) -> Iterator[list[int]]:
  """[start, start + batch), ... up to n: the positions of each batch."""
  for i in range(start, n, batch):
    yield list(range(i, min(i + batch, n)))


def pad_batch(inputs: np.ndarray, idx: list[int], batch: int, buckets: tuple = ()) -> np.ndarray:
  """Rows ``idx`` of ``inputs`` as one [batch, width] host array (the last row
  repeated to fill it), padded to the smallest bucket."""
  rows = idx + [idx[-1]] * (batch - len(idx))
  return np.asarray(data.fit_to_bucket(inputs[rows], buckets))


# XLA's GPU command buffers (CUDA graphs): kernels, loops and switches recorded
# once and replayed as one launch. Profiling turns them off.
COMMAND_BUFFER_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"


def command_buffer_options(min_graph_size: int) -> dict[str, Any]:
  """XLA options putting every run of ``min_graph_size`` GPU kernels in a command buffer."""
  if isinstance(min_graph_size, bool) or not isinstance(min_graph_size, int) or min_graph_size < 1:
    raise ValueError(f"command buffers need a minimum graph size >= 1, got {min_graph_size!r}")
  return {"xla_gpu_enable_command_buffer": COMMAND_BUFFER_COMMANDS,
          "xla_gpu_graph_min_graph_size": min_graph_size}


@functools.lru_cache(maxsize=None)
def with_command_buffers(loop: Any, min_graph_size: int, backend: Optional[str] = None) -> Any:
  """A decoding ``loop`` compiled with command buffers on a GPU (same results);
  the loop itself for ``min_graph_size`` 0 or another backend."""
  if loop not in STATIC_ARGNAMES:
    raise ValueError(f"with_command_buffers takes one of the decoding loops, got {loop!r}")
  options = command_buffer_options(min_graph_size) if min_graph_size else None
  if options is None or (backend or jax.default_backend()) != "gpu":
    return loop
  return jax.jit(loop.__wrapped__, static_argnames=STATIC_ARGNAMES[loop], compiler_options=options)


@dataclasses.dataclass(frozen=True)
class Programs:
  """The two programs a run times, on host inputs [B, S] and a key -> tokens
  [B, max_decode_len], length [B] (and statistics).

  gamma: THE run's γ once chosen (γ_max for adaptive rounds; a tree's N - 1;
    0 for plain decoding, where ``speculative`` is the baseline).
  """

  baseline: Callable[[np.ndarray, Array], Any]
  speculative: Callable[[np.ndarray, Array], Any]
  gamma: int

  @property
  def plain(self) -> bool:
    return self.gamma == 0


def programs(setup: Setup, gamma: int) -> Programs:
  """The baseline and the run's speculative loop (chain, tree, or with
  ``gamma`` 0 the baseline again)."""
  exp = setup.exp
  loop = lambda fn: with_command_buffers(fn, exp.command_buffers)
  target, tparams, draft = setup.target, setup.target_params, setup.draft
  kw = dict(max_decode_len=exp.max_decode_len, sampling=exp.sampling,
            eos_id=target.config.eos_id, partitioner=setup.partitioner)
  place = setup.partitioner.shard_batch if setup.partitioner else (lambda x: x)
  base_fn = lambda x, k: loop(temperature_sample)(target, tparams, place(x), k, **kw)
  tree = exp.tree_shape
  if tree is not None:
    spec_fn = lambda x, k: loop(tree_speculative_decode)(target, tparams, draft, place(x), k,
                                                         tree=tree, **kw)
  elif gamma == 0:
    spec_fn = base_fn
  else:
    spec_fn = lambda x, k: loop(speculative_decode)(target, tparams, draft, place(x), k,
                                                    gamma=gamma, lenience=exp.lenience,
                                                    adaptive=exp.adaptive, **kw)
  return Programs(base_fn, spec_fn, gamma)
