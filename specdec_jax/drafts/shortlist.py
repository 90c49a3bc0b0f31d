"""A vocabulary shortlist S for the draft's output layer: the target's most frequent
tokens (``frequent``) plus the example's input tokens; q renormalized over S.
Exact for any S (§2.3, A.1: x ~ the reported q; docs/exactness.md, section 6);
S costs the target's mass outside S in β (Theorem 3.5) and buys a [d, |S|]
output product in place of [d, V] (as FR-Spec, Zhao et al. 2025)."""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec_jax import quantization, storage
from specdec_jax.models.t5 import T5Model

Array = jax.Array
FORMAT = "specdec_jax.shortlist/1"  # a file format name, kept across module moves


def frequent(sequences: Iterable[Sequence[int]], size: int, vocab_size: int,
             always: Sequence[int] = ()) -> np.ndarray:
  """The ``size`` most frequent ids (ties: lower) plus ``always``, sorted."""
  if size < 1:
    raise ValueError(f"shortlist size must be >= 1, got {size}")
  counts: collections.Counter = collections.Counter()
  for seq in sequences:
    counts.update(int(t) for t in seq)
  bad = [t for t in list(counts) + [int(a) for a in always] if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"token ids outside [0, {vocab_size}): {sorted(set(bad))[:5]}")
  keep = {int(a) for a in always}
  ranked = sorted(counts, key=lambda t: (-counts[t], t))
  for t in ranked:
    if len(keep) >= size:
      break
    keep.add(t)
  return np.array(sorted(keep), np.int32)


def sequences_from(path: str, vocab: Any, split: str = "train",
                   max_examples: int | None = None) -> Iterator[list[int]]:
  """Token sequences for ``frequent``: a JSONL with ``tokens``, or the references of
  ``seqio:<task>``/a TSV/JSONL encoded with ``vocab`` (EOS appended)."""
  if path.endswith(".jsonl") and os.path.isfile(path):
    with open(path) as f:
      first = f.readline()
    if first.strip() and "tokens" in json.loads(first):
      with open(path) as f:
        for n, line in enumerate(f, 1):
          if max_examples is not None and n > max_examples:
            return
          if line.strip():
            record = json.loads(line)
            if not isinstance(record.get("tokens"), list):
              raise ValueError(f"{path}:{n}: no 'tokens' list")
            yield record["tokens"]
      return
  from specdec_jax import data  # only here: data pulls in the seqio stack
  examples = data.load_examples(path, split=split, max_examples=max_examples)
  if not any(e.reference for e in examples):
    raise ValueError(f"{path}: no references to count (and no 'tokens' records)")
  for e in examples:
    if e.reference:
      yield list(vocab.encode(e.reference)) + [vocab.eos_id]


def save(path: str, ids: np.ndarray, vocab_size: int, **meta: Any) -> None:
  """Writes the shortlist as JSON (``FORMAT``) with its provenance ``meta``."""
  ids = check_ids(np.asarray(ids), vocab_size, path)
  record = {"format": FORMAT, "vocab_size": int(vocab_size), "size": int(ids.size), **meta,
            "token_ids": [int(t) for t in ids]}
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(record, f)
  os.replace(tmp, path)  # never a half-written shortlist at ``path``


def load(path: str, vocab_size: int) -> np.ndarray:
  """The sorted ids of a shortlist written by ``save`` (local or ``gs://``), checked."""
  if not storage.is_gcs(path) and not os.path.isfile(path):
    raise FileNotFoundError(f"draft shortlist not found: {path}")
  raw = storage.read_bytes(path, "draft shortlist")  # gs:// errors name what is missing
  try:
    record = json.loads(raw)
  except ValueError as e:
    raise ValueError(f"draft shortlist {path} is not readable JSON: {e}") from e
  if not isinstance(record, dict) or record.get("format") != FORMAT:
    raise ValueError(f"draft shortlist {path}: expected a JSON object with format {FORMAT!r} "
                     "(written by scripts/make_shortlist.py)")
  # Ids are checked against the model's vocab_size; the file's own (the
  # tokenizer's) may be smaller, as T5 pads its embedding (32100 -> 32128).
  return check_ids(np.asarray(record.get("token_ids", []), np.int64), vocab_size, path)


def check_ids(ids: np.ndarray, vocab_size: int, where: str) -> np.ndarray:
  """ids as sorted unique int32 in [0, vocab_size); a clear error otherwise."""
  if ids.ndim != 1 or ids.size == 0:
    raise ValueError(f"draft shortlist {where}: expected a non-empty list of token ids, "
                     f"got shape {ids.shape}")
  bad = ids[(ids < 0) | (ids >= vocab_size)]
  if bad.size:
    raise ValueError(f"draft shortlist {where}: token ids outside [0, {vocab_size}): "
                     f"{bad[:5].tolist()}")
  if np.unique(ids).size != ids.size:
    raise ValueError(f"draft shortlist {where}: repeated token ids")
  return np.sort(ids).astype(np.int32)


def output_columns(model: T5Model, params: Any, ids: Array) -> Array:
  """The output-layer columns for ids [...] -> [d, ...], as ``T5Model.decode``."""
  c = model.config
  if c.logits_via_embedding:
    table = params["token_embedder"]["embedding"]  # [V, d]
    return jnp.moveaxis(jnp.take(table, ids, axis=0), -1, 0) / jnp.sqrt(jnp.float32(c.d_model))
  # A quantized kernel (draft_quantization): only the shortlist's columns dequantized.
  return quantization.take_columns(params["decoder"]["logits_dense"]["kernel"], ids)


class Shortlist(struct.PyTreeNode):
  """S's fixed part: ``ids`` [N] and their output columns ``kernel`` [d, N]."""
  ids: Array
  kernel: Array
  with_inputs: bool = struct.field(pytree_node=False, default=True)

  @classmethod
  def for_draft(cls, model: T5Model, params: Any, ids: np.ndarray,
                with_inputs: bool = True) -> "Shortlist":
    ids = jnp.asarray(check_ids(np.asarray(ids), model.config.vocab_size, "ids"))
    return cls(ids, output_columns(model, params, ids).astype(jnp.float32), with_inputs)


class InputPart(struct.PyTreeNode):
  """S's per-example part: input ids [B, L] (pad mapped past V), ``kernel`` [B, d, L]."""
  ids: Array
  kernel: Array


def for_inputs(model: T5Model, params: Any, inputs: Array) -> InputPart:
  """The per-example part of S for ``inputs`` [B, L]."""
  c = model.config
  kernel = jnp.moveaxis(output_columns(model, params, inputs), 0, 1).astype(jnp.float32)
  return InputPart(jnp.where(inputs == c.pad_id, c.vocab_size, inputs).astype(jnp.int32), kernel)


def logits(shortlist: Shortlist, part: InputPart | None, hidden: Array, vocab_size: int) -> Array:
  """The draft's logits over S, −inf elsewhere: hidden [B, k, d] -> [B, k, V] float32."""
  b, k, _ = hidden.shape
  y = hidden.astype(jnp.float32)
  out = jnp.full((b, k, vocab_size), -jnp.inf, jnp.float32)
  out = out.at[:, :, shortlist.ids].set(y @ shortlist.kernel)
  if part is None:
    return out
  rows = jnp.arange(b)[:, None, None]
  steps = jnp.arange(k)[None, :, None]
  return out.at[rows, steps, part.ids[:, None, :]].set(
      jnp.einsum("bkd,bdl->bkl", y, part.kernel), mode="drop")
