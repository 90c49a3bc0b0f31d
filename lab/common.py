"""What the research studies share besides ``timing``'s loop (``timing.repeat``)
and interleaving (``timing.interleaved_times``): picking one of two stacked
input sets inside a timed loop, so that no input is loop-invariant. Every
study times a piece of Algorithm 1's round (paper §2.3) this way; none of them
is part of the engine."""

from __future__ import annotations

from typing import Any

import jax

Array = jax.Array


def pick(stack: Any, i: Array) -> Any:
  """Element i % 2 of a pytree of arrays stacked on a leading axis of 2."""
  return jax.tree_util.tree_map(lambda a: a[i % 2], stack)
