"""T5X's orbax layout ``checkpoint_<step>/state/``: only the parameters are restored."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from specdec_jax.checkpoints import orbax_ts, placement
from specdec_jax.checkpoints.common import (T5X_ORBAX_ITEM, CheckpointError, check_shapes,
                                            is_gcs, join, metadata_shapes, orbax_metadata_tree,
                                            require_dir, subtree_keys)
from specdec_jax.models.t5 import T5Config
from specdec_jax.partitioning import Partitioner


def find_params_subtree(tree: Mapping, directory: str) -> tuple[str, ...]:
  keys = subtree_keys(tree, (("target",), ("params",), ("optimizer", "target"),
                             ("state", "params")))
  if keys is None:
    raise CheckpointError(f"{directory}: no 'target' or 'params' subtree in the orbax "
                          f"checkpoint; top-level keys: {sorted(tree)}")
  return keys


def load_t5x_orbax(step_dir: str, config: T5Config, param_dtype: Any,
                   partitioner: Optional[Partitioner] = None) -> dict:
  item_dir = join(step_dir, T5X_ORBAX_ITEM)
  require_dir(item_dir)
  # gs://: TensorStore reads orbax's layout itself (orbax's file layer would need TF or gcsfs).
  remote = is_gcs(item_dir)
  tree = orbax_ts.metadata_tree(item_dir) if remote else orbax_metadata_tree(item_dir)
  keys = find_params_subtree(tree, item_dir)
  sub = tree
  for k in keys:
    sub = sub[k]
  check_shapes(metadata_shapes(sub), config, item_dir)
  restore = orbax_ts.restore if remote else placement.restore_orbax
  return restore(item_dir, tree, keys, param_dtype, partitioner)
