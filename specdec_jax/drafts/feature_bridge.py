"""The feature bridge: a T5 draft that also reads the target's last verified decoder state.

The draft's input at position t is embed_q(x_t) + h_s K + e_j, s = t - 1 - j the
last committed position with a target state, K [d_p, d_q], e [J, d_q] learned
(zeros: the plain draft). EAGLE (Li et al. 2024) restricted to committed
positions, so decoding stays exact (docs/exactness.md, section 7)."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import storage
from specdec_jax.drafts import bridge as bridge_lib
from specdec_jax.models.t5 import T5Model

Array = jax.Array
FILENAME = "feature_bridge.npz"


def zeros(target: T5Model, draft: T5Model, max_staleness: int) -> dict:
  """A bridge that adds nothing: {'kernel': [d_p, d_q], 'staleness': [J, d_q]}."""
  d_p, d_q = target.config.d_model, draft.config.d_model
  return {"kernel": jnp.zeros((d_p, d_q), jnp.float32),
          "staleness": jnp.zeros((max_staleness, d_q), jnp.float32)}


def project_states(bridge: dict, hidden: Array) -> Array:
  """h K [..., d_q] for target states [..., d_p] (no gradient into the target)."""
  h = jax.lax.stop_gradient(hidden).astype(jnp.float32)
  return jnp.einsum("...d,de->...e", h, bridge["kernel"])


def add_staleness(bridge: dict, projected: Array, staleness: Array) -> Array:
  """h K + e_j for projected states at staleness j (clipped; j < 0: zeros)."""
  table = bridge["staleness"]
  e = table[jnp.clip(staleness, 0, table.shape[0] - 1)]
  return jnp.where((staleness >= 0)[..., None], projected + e, 0.0)


def project(bridge: dict, hidden: Array, staleness: Array) -> Array:
  """h K + e_j [..., d_q] for target states [..., d_p] (``add_staleness``)."""
  return add_staleness(bridge, project_states(bridge, hidden), staleness)


def teacher_forced_extra(bridge: dict, target_hidden: Array, key: Array) -> Array:
  """The extra [B, T, d_q] along a sequence: position t reads h_{t-1-j}, j ~ U{0..J-1}."""
  b, t = target_hidden.shape[:2]
  j = jax.random.randint(key, (b, t), 0, bridge["staleness"].shape[0])
  s = jnp.arange(t)[None, :] - 1 - j
  h = jnp.take_along_axis(target_hidden, jnp.clip(s, 0, t - 1)[..., None], axis=1)
  return project(bridge, h, jnp.where(s >= 0, j, -1))


def check(bridge: Any, target: T5Model, draft: T5Model, source: str) -> None:
  """The kernel maps the target's d_model to the draft's; the table has the draft's width."""
  d_p, d_q = target.config.d_model, draft.config.d_model
  kernel, table = np.shape(bridge["kernel"]), np.shape(bridge["staleness"])
  if tuple(kernel) != (d_p, d_q) or len(table) != 2 or table[1] != d_q or table[0] < 1:
    raise ValueError(f"{source}: feature bridge has kernel {tuple(kernel)} and staleness table "
                     f"{tuple(table)}; this target (d_model {d_p}) and draft (d_model {d_q}) "
                     f"need ({d_p}, {d_q}) and (J >= 1, {d_q}): was the draft distilled toward "
                     "another target?")


def save(directory: str, bridge: Any) -> None:
  """Writes ``directory/feature_bridge.npz`` (float32)."""
  bridge_lib.save_arrays(directory, FILENAME, bridge)


def load(directory: str) -> Optional[dict]:
  """The feature bridge stored with a draft checkpoint (local or ``gs://``), or None."""
  return bridge_lib.load_arrays(directory, FILENAME, ("kernel", "staleness"), "feature bridge")
