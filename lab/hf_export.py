"""Our params as a Hugging Face T5 directory (config.json + model.safetensors), through
the loader's own name map (``checkpoints.hf_name_map``) and ``t5_to_hf_config``: the
weights the Hugging Face comparisons load, and the tests' Hugging Face checkpoints."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Callable, Mapping, Optional

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specdec_jax.checkpoints import hf_name_map
from specdec_jax.checkpoints.common import CheckpointError, check_writable
from specdec_jax.models.t5 import T5Config


def t5_to_hf_config(config: T5Config) -> dict:
  c = config
  return {
      "architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
      "vocab_size": c.vocab_size, "d_model": c.d_model, "d_kv": c.head_dim, "d_ff": c.d_ff,
      "num_heads": c.num_heads, "num_layers": c.num_encoder_layers,
      "num_decoder_layers": c.num_decoder_layers,
      "relative_attention_num_buckets": c.relative_attention_num_buckets,
      "relative_attention_max_distance": c.relative_attention_max_distance,
      "layer_norm_epsilon": c.layer_norm_epsilon,
      "feed_forward_proj": "gated-gelu" if c.gated else "relu",
      # 4.x reads the logits scaling from this; 5.x turns it into scale_decoder_outputs.
      "tie_word_embeddings": c.logits_via_embedding, "is_encoder_decoder": True,
      "pad_token_id": c.pad_id, "eos_token_id": c.eos_id,
      "decoder_start_token_id": c.decoder_start_id, "initializer_factor": 1.0}


_SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                       np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float64): "F64"}


def write_safetensors(path: str, arrays: Mapping[str, Callable[[], np.ndarray]],
                      shapes: Mapping[str, tuple[int, ...]], dtype: np.dtype) -> None:
  """Write a .safetensors file (header, then the tensors one at a time)."""
  if dtype not in _SAFETENSORS_DTYPES:
    raise CheckpointError(f"{path}: cannot write dtype {dtype} to safetensors")
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  for name in arrays:
    nbytes = int(np.prod(shapes[name], dtype=np.int64)) * dtype.itemsize
    header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shapes[name]),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path, "wb") as f:
    f.write(len(blob).to_bytes(8, "little"))
    f.write(blob)
    for name in arrays:
      arr = np.ascontiguousarray(arrays[name](), dtype=dtype)
      if arr.shape != tuple(shapes[name]):
        raise CheckpointError(f"{path}: tensor {name} has shape {arr.shape}, "
                              f"expected {tuple(shapes[name])}")
      f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())


def export_hf(params: Any, config: T5Config, directory: str,
              dtype: Optional[str] = None, overwrite: bool = False) -> None:
  """Write a Hugging Face T5 directory; ``dtype`` default: the params' own."""
  directory, flat = check_writable(directory, params, config, overwrite, "exporting", "export")
  out_dtype = np.dtype(jnp.dtype(dtype) if dtype
                       else jnp.asarray(flat["token_embedder/embedding"]).dtype)
  arrays: dict[str, Callable[[], np.ndarray]] = {}
  shapes: dict[str, tuple[int, ...]] = {}
  for ours, (hf, transpose) in sorted(hf_name_map(config).items(), key=lambda kv: kv[1][0]):
    shape = tuple(np.shape(flat[ours]))
    shapes[hf] = shape[::-1] if transpose else shape
    arrays[hf] = functools.partial(
        lambda x, t: np.asarray(x).T if t else np.asarray(x), flat[ours], transpose)
  os.makedirs(directory, exist_ok=True)
  write_safetensors(os.path.join(directory, "model.safetensors"), arrays, shapes, out_dtype)
  hf_cfg = t5_to_hf_config(config)
  hf_cfg["torch_dtype"] = str(out_dtype) if out_dtype != ml_dtypes.bfloat16 else "bfloat16"
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2, sort_keys=True)
