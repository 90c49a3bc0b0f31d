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
with ``specdec_jax.drafts.register`` (README, "Adding an approximation
model"). The runner calls ``check_interface`` once before compiling anything.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

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


class DraftInterfaceError(ValueError):
  """An approximation model that does not keep the interface above."""


def check_interface(name: str, draft: Any, inputs: Array, vocab_size: int, gamma: int,
                    cache_len: int, sampling: SamplingConfig, concrete: bool = True) -> None:
  """Checks ``draft`` once, before the decoding loops are compiled.

  Traces init -> propose -> commit abstractly (no compilation) to check the
  shapes; with ``concrete``, also runs them once on ``inputs`` to check that
  q is a distribution that gives each proposed token positive probability.
  Errors name the draft, the method and the shapes.
  """
  where = f"approximation model {name!r} ({type(draft).__module__}.{type(draft).__qualname__})"
  for method in ("init", "propose", "commit"):
    if not callable(getattr(draft, method, None)):
      raise DraftInterfaceError(f"{where} has no method {method}(); see "
                                "specdec_jax/drafts/base.py for the interface")
  if getattr(draft, "vocab_size", None) != vocab_size:
    raise DraftInterfaceError(f"{where}.vocab_size is {getattr(draft, 'vocab_size', None)!r}; "
                              f"it must equal the target's vocab_size {vocab_size}")
  b = inputs.shape[0]
  seq = jnp.zeros((b, cache_len + 1), jnp.int32)
  length = jnp.zeros((b,), jnp.int32)

  def call(inputs, seq, length, key):
    state = draft.init(inputs, cache_len)
    tokens, q, state = draft.propose(state, seq, length, gamma, sampling, key)
    draft.commit(state, seq, length + 1)
    return tokens, q

  key = jax.random.PRNGKey(0)
  try:
    tokens, q = jax.eval_shape(call, inputs, seq, length, key)
  except Exception as e:  # report which draft failed, whatever the cause
    raise DraftInterfaceError(
        f"{where}: init(inputs {tuple(inputs.shape)}, cache_len={cache_len}) -> "
        f"propose(state, seq {tuple(seq.shape)}, length {tuple(length.shape)}, gamma={gamma}, "
        f"sampling, key) -> commit failed when traced: {type(e).__name__}: {e}") from e
  want_tokens, want_q = (b, gamma), (b, gamma, vocab_size)
  if (tuple(tokens.shape) != want_tokens or not jnp.issubdtype(tokens.dtype, jnp.integer)
      or tuple(q.shape) != want_q or not jnp.issubdtype(q.dtype, jnp.floating)):
    raise DraftInterfaceError(
        f"{where}.propose returned tokens {tuple(tokens.shape)} {tokens.dtype} and q "
        f"{tuple(q.shape)} {q.dtype}; expected tokens [B, gamma] = {want_tokens} (integers) "
        f"and q [B, gamma, V] = {want_q} (floats; V = the target's vocab_size)")
  if not concrete:
    return
  tokens, q = jax.jit(call)(inputs, seq, length, key)
  q = np.asarray(q, np.float64)
  sums = q.sum(-1)
  picked = np.take_along_axis(q, np.asarray(tokens)[..., None].clip(0, vocab_size - 1), -1)
  if not np.all(np.isfinite(q)) or q.min() < -1e-6 or np.abs(sums - 1).max() > 1e-3:
    raise DraftInterfaceError(
        f"{where}.propose returned a q {q.shape} that is not a distribution over its last "
        f"axis: sums in [{sums.min():.4g}, {sums.max():.4g}], min entry {q.min():.4g}; q must "
        "be the (standardized) probabilities the tokens were drawn from (one-hot for "
        "deterministic proposals)")
  if (picked <= 0).any():
    raise DraftInterfaceError(
        f"{where}.propose returned tokens that have probability 0 under its own q; q must be "
        "the distribution each token was drawn from (one-hot of the token if deterministic)")
