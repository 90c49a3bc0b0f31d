"""Our own format: ``config.json`` (the ``T5Config`` fields) and ``params/``
(an orbax-checkpoint PyTree of the T5X-named tree, possibly bfloat16)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Optional

import jax
import numpy as np

from specdec_jax.checkpoints import orbax_ts, placement
from specdec_jax.checkpoints.common import (SPECDEC_PARAMS_DIR, check_shapes, check_writable,
                                            config_from_dict, is_gcs, join, metadata_shapes,
                                            orbax_metadata_tree, params_dtype_tree, read_json,
                                            reconcile_config, require_dir)
from specdec_jax.models.t5 import T5Config
from specdec_jax.partitioning import Partitioner


def save_checkpoint(directory: str, params: Any, config: T5Config,
                    dtype: Optional[str] = None, overwrite: bool = False) -> None:
  """Write ``params`` and ``config`` in our format, arrays cast to ``dtype`` on disk."""
  import orbax.checkpoint as ocp
  directory, _ = check_writable(directory, params, config, overwrite, "saving", "save")
  # Only remove what we write ourselves, never unrelated files.
  params_dir = os.path.join(directory, SPECDEC_PARAMS_DIR)
  if os.path.isdir(params_dir):
    shutil.rmtree(params_dir)
  os.makedirs(directory, exist_ok=True)
  tree = params_dtype_tree(params, dtype)
  if jax.process_count() > 1:  # Orbax refuses process-local jax.Arrays there
    tree = jax.tree.map(np.asarray, tree)
  _checkpointer(ocp).save(params_dir, tree)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(dataclasses.asdict(config), f, indent=2, sort_keys=True)


def _checkpointer(ocp: Any) -> Any:
  """Orbax's checkpointer for arrays written by this process alone (no barriers with others)."""
  if jax.process_count() == 1:
    return ocp.PyTreeCheckpointer()
  me = jax.process_index()
  only_me = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                               barrier_sync_key_prefix=f"export{me}")
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=only_me),
                          multiprocessing_options=only_me)


def load_specdec(path: str, config: Optional[T5Config], param_dtype: Any,
                 partitioner: Optional[Partitioner] = None) -> tuple[dict, T5Config]:
  config_path = join(path, "config.json")
  config = reconcile_config(config_from_dict(read_json(config_path), config_path), config, path)
  params_dir = join(path, SPECDEC_PARAMS_DIR)
  require_dir(params_dir)
  # gs://: TensorStore reads orbax's layout itself (orbax's file layer would need TF or gcsfs).
  tree = orbax_ts.metadata_tree(params_dir) if is_gcs(params_dir) else orbax_metadata_tree(
      params_dir)
  check_shapes(metadata_shapes(tree), config, params_dir)
  restore = orbax_ts.restore if is_gcs(params_dir) else placement.restore_orbax
  return restore(params_dir, tree, (), param_dtype, partitioner), config
