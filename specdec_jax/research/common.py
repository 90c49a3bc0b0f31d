"""Helpers the research studies share: picking one of two stacked input sets
inside a timed loop, summing a piece's outputs into the loop carry so XLA
keeps its work, and timing one call. Every study times a piece of Algorithm 1's
round (paper §2.3) this way; none of them is part of the engine."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

Array = jax.Array


def pick(stack: Any, i: Array) -> Any:
  """Element i % 2 of a pytree of arrays stacked on a leading axis of 2."""
  return jax.tree_util.tree_map(lambda a: a[i % 2], stack)


def total(tree: Any) -> Array:
  """The sum of every leaf of ``tree`` as one float32 scalar (a loop carry)."""
  return sum(jnp.sum(a.astype(jnp.float32)) for a in jax.tree_util.tree_leaves(tree))


def seconds(fn: Callable[[], Any]) -> float:
  """Wall-clock seconds of one call of ``fn`` until its result is ready
  (compile included if ``fn`` is cold: warm it up first)."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t0
