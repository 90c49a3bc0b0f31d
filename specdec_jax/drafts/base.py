"""The approximation-model (M_q) interface the speculative engine talks to.

An approximation model is a pytree (a ``flax.struct`` dataclass: arrays as
leaves, configuration as static fields) with three pure methods:

* ``init(inputs, cache_len) -> state``: once per example, given the encoder
  input tokens [B, S] (0 = pad). ``state`` is any pytree.
* ``propose(state, seq, length, gamma, sampling, key) -> (tokens, q, state)``:
  γ tokens [B, γ] and the distributions q [B, γ, V] they were drawn from —
  exactly those, after the same standardization (§2.2) as the target's p, since
  Algorithm 1 divides by q(x). ``seq`` [B, T] holds the decoder inputs so far:
  seq[:, 0] is the start token and seq[:, i + 1] the i-th committed output
  token; ``length`` [B] is the number of committed output tokens, so the next
  token is predicted from decoder inputs seq[:, :length + 1]. Entries past
  length + 1 are stale and must be ignored.
* ``commit(state, seq, length) -> state``: after the target's verdict, the
  new committed length. Rolling back anything computed for rejected tokens is
  the model's business (the T5 draft needs nothing: its cache is indexed by
  position and a query only reads positions before it).

Nothing in the engine depends on which model it is, so a new approximation
model needs no engine change: implement these three methods and register it
(``specdec_jax.drafts.registry``).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from specdec_jax.sampling import SamplingConfig

Array = jax.Array


class ApproximationModel(Protocol):
  """Structural type of an approximation model M_q (see module docstring)."""

  vocab_size: int

  def init(self, inputs: Array, cache_len: int) -> Any:
    ...

  def propose(self, state: Any, seq: Array, length: Array, gamma: int,
              sampling: SamplingConfig, key: Array) -> tuple[Array, Array, Any]:
    ...

  def commit(self, state: Any, seq: Array, length: Array) -> Any:
    ...


def gather_positions(seq: Array, positions: Array) -> Array:
  """seq [B, T], positions [B, k] -> seq[b, positions[b]] with clipping."""
  return jax.numpy.take_along_axis(seq, jax.numpy.clip(positions, 0, seq.shape[1] - 1),
                                   axis=1)
