"""The encoder bridge: a T5 draft whose encoder input is embed_q(x) + H_p W, H_p
[B, S, d_p] the target's encoder output (from its prefill), W [d_p, d_q]
learned (0: the plain draft). Only the encoder pass changes, so c does not;
exact, as H_p depends on the input alone (docs/exactness.md, section 7).
Stored as ``encoder_bridge.npz`` beside the draft's checkpoint."""

from __future__ import annotations

import io
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import storage
from specdec_jax.models.t5 import T5Model

Array = jax.Array
FILENAME = "encoder_bridge.npz"


def zeros(target: T5Model, draft: T5Model) -> Array:
  """A bridge that adds nothing: the draft computes exactly what it did before."""
  return jnp.zeros((target.config.d_model, draft.config.d_model), jnp.float32)


def project(kernel: Array, target_encoded: Array) -> Array:
  """H_p W [B, S, d_q] from the target's [B, S, d_p] (no gradient into the target)."""
  h = jax.lax.stop_gradient(target_encoded).astype(jnp.float32)
  return jnp.einsum("bsd,de->bse", h, kernel)


def extra(kernel: Array, target: T5Model, target_params: Any, inputs: Array) -> Array:
  """``project`` of the target's encoder output for ``inputs`` [B, S]."""
  return project(kernel, target.encode(target_params, inputs))


def check(kernel: Any, target: T5Model, draft: T5Model, source: str) -> None:
  """The kernel must map the target's d_model to the draft's."""
  want = (target.config.d_model, draft.config.d_model)
  if tuple(np.shape(kernel)) != want:
    raise ValueError(f"{source}: encoder bridge kernel has shape {tuple(np.shape(kernel))}; "
                     f"this target (d_model {want[0]}) and draft (d_model {want[1]}) need "
                     f"{want}: was the draft distilled toward another target?")


def save_arrays(directory: str, filename: str, arrays: dict) -> None:
  """Writes ``directory/filename`` (.npz, float32) atomically."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, filename)
  tmp = path + ".tmp.npz"
  np.savez(tmp, **{k: np.asarray(jax.device_get(v), np.float32) for k, v in arrays.items()})
  os.replace(tmp, path)


def load_arrays(directory: str, filename: str, keys: tuple[str, ...], what: str) -> Optional[dict]:
  """``keys`` of ``directory/filename`` (local or ``gs://``) as finite 2-D float32
  arrays, or None without the file; errors name the path and ``what``."""
  path = storage.join(directory, filename)
  if not storage.is_file(path):
    return None
  raw = storage.read_bytes(path, what)
  try:
    with np.load(io.BytesIO(raw)) as f:
      out = {k: np.asarray(f[k], np.float32) for k in keys}
  except Exception as e:  # a torn or foreign file: say which
    raise ValueError(f"{path}: not a readable {what} ({type(e).__name__}: {e})") from e
  if any(v.ndim != 2 or not np.all(np.isfinite(v)) for v in out.values()):
    raise ValueError(f"{path}: {what} arrays must be finite and 2-D, got shapes "
                     f"{ {k: v.shape for k, v in out.items()} }")
  return out


def save(directory: str, kernel: Any) -> None:
  """Writes ``directory/encoder_bridge.npz`` (float32)."""
  save_arrays(directory, FILENAME, {"kernel": kernel})


def load(directory: str) -> Optional[np.ndarray]:
  """The bridge kernel stored with a draft checkpoint, or None if it has none."""
  out = load_arrays(directory, FILENAME, ("kernel",), "encoder bridge")
  return None if out is None else out["kernel"]
