"""Quality of a target and its drafts on held-out pairs (the demo's report).

Per model: teacher-forced token cross-entropy on the references, greedy outputs
(the baseline's jitted decoding, batched) scored by sacrebleu's corpus BLEU and
chrF against the references, and the share of outputs that hit the decode
limit (a looping model). Per draft: agreement with the target along the
target's own greedy outputs (greedy match = α at T=0 on those prefixes;
the mean of Σ min(p, q) = α at T=1, paper Definition 3.1 and Corollary 3.6),
and the one-token decode-step cost ratio (1/c at batch 1, Definition 3.7).
"""

from __future__ import annotations

import functools
import os
import tempfile
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specdec_jax import distill, training
from specdec_jax.models.t5 import T5Model, shift_right
from specdec_jax.sampling import SamplingConfig
from specdec_jax.timing import interleaved_medians_ms, target_steps


def greedy_outputs(model: T5Model, params: Any, inputs: Sequence[Sequence[int]],
                   max_decode_len: int, batch_size: int = 64) -> list[list[int]]:
  """Greedy outputs (EOS included when reached) for every input, batched."""
  with tempfile.TemporaryDirectory() as d:
    out = distill.generate_target_outputs(model, params, inputs, os.path.join(d, "o.jsonl"),
                                          max_decode_len=max_decode_len,
                                          batch_size=batch_size, log_fn=lambda m: None)
  return [out[(i, "greedy")] for i in range(len(inputs))]


STEP_INNER = 32    # single-token steps per timed call (one jitted loop)
STEP_REPEATS = 15  # interleaved timed calls per model and pass


def decode_step_piece(model: T5Model, params: Any, src_len: int = 64, cache_len: int = 128,
                      position: int = 40) -> Callable[[], Any]:
  """One timed call: ``STEP_INNER`` single-token cached decode steps (with
  their greedy standardize and sample), batch 1, inside one jitted loop
  (``timing.target_steps``), as the decoding loops run them. Timed as single
  calls from Python instead, the per-call dispatch would weigh most on the
  smallest model and make the draft/target ratio noisy."""
  inputs = jnp.ones((1, src_len), jnp.int32)
  cache = model.init_cache(params, model.encode(params, inputs), inputs, cache_len)
  tokens = jnp.ones((1, 1), jnp.int32)
  pos = jnp.full((1, 1), position, jnp.int32)
  key = jax.random.PRNGKey(0)
  return lambda: target_steps(model, params, cache, tokens, pos, key, SamplingConfig(),
                              STEP_INNER)


def decode_step_ms(models: dict[str, tuple[T5Model, Any]], passes: int = 1) -> dict[str, float]:
  """Median ms of one single-token step of each model, batch 1, the models
  timed interleaved (``timing.interleaved_medians_ms``: load from other
  processes hits every model alike), ``passes`` x ``STEP_REPEATS`` calls each."""
  pieces = {name: decode_step_piece(model, params) for name, (model, params) in models.items()}
  return interleaved_medians_ms(pieces, passes * STEP_REPEATS, STEP_INNER)


def evaluate_models(models: dict[str, tuple[T5Model, Any]], target: str,
                    pairs: Sequence[training.Pair], decode: Callable[[list[int]], str],
                    references: Sequence[str], max_decode_len: int = 128,
                    batch_tokens: int = 4096, timing_repeats: int = 3,
                    log_fn: Callable[[str], None] = print) -> dict:
  """The report: see the module docstring. ``pairs`` are (input ids, reference
  ids) with EOS; ``references`` the reference texts in the same order."""
  import sacrebleu
  out: dict[str, Any] = {"pairs": len(pairs)}
  batches = training.fixed_batches(pairs, batch_tokens)
  inputs = [x for x, _ in pairs]
  outputs = {}
  for name, (model, params) in models.items():
    ce = mean_ce(model, batches)(params)
    outputs[name] = greedy_outputs(model, params, inputs, max_decode_len)
    eos = model.config.eos_id
    texts = [decode([t for t in o if t != eos]) for o in outputs[name]]
    hit = sum(1 for o in outputs[name] if len(o) >= max_decode_len and o[-1] != eos)
    out[name] = {"test_ce": ce,
                 "bleu": sacrebleu.corpus_bleu(texts, [list(references)]).score,
                 "chrf": sacrebleu.corpus_chrf(texts, [list(references)]).score,
                 "hit_max_decode_len": hit / len(pairs),
                 "mean_output_tokens": float(np.mean([len(o) for o in outputs[name]]))}
    out[name]["_texts"] = texts
    log_fn(f"{name}: " + ", ".join(f"{k}={v:.4g}" for k, v in out[name].items()
                                   if not k.startswith("_")))
  tmodel, tparams = models[target]
  along = training.fixed_batches([(x, o) for x, o in zip(inputs, outputs[target]) if o],
                                 batch_tokens)
  for name, (model, params) in models.items():
    if name != target:
      out[name].update(distill.agreement(tmodel, tparams, model, params, along))
  ms = decode_step_ms(models, timing_repeats)
  for name in models:
    out[name]["decode_step_ms_b1"] = ms[name]
    out[name]["target_step_over_this"] = ms[target] / ms[name]
  return out


def token_ce_sums(model: T5Model, params, inputs, targets,
                  dropout_rng: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
  logits = model(params, inputs, shift_right(targets, model.config.decoder_start_id), dropout_rng)
  mask = (targets != model.config.pad_id).astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(ce * mask), jnp.sum(mask)


def ce_loss(model: T5Model) -> Callable:
  """loss_fn for plain training: mean token cross-entropy, with the config's dropout."""
  def loss_fn(params, batch):
    rng = batch["step_key"] if model.config.dropout_rate > 0 else None
    total, n = token_ce_sums(model, params, batch["inputs"], batch["targets"], rng)
    loss = total / jnp.maximum(n, 1.0)
    return loss, {"ce": loss}
  return loss_fn


def mean_ce(model: T5Model, batches: Sequence[training.Batch]) -> Callable[[Any], float]:
  """evaluate-style closure: token-weighted mean cross-entropy over fixed batches."""
  sums = jax.jit(functools.partial(token_ce_sums, model))  # no dropout rng: deterministic

  def evaluate(params) -> float:
    total, count = 0.0, 0.0
    for b in batches:
      s, n = sums(params, b["inputs"], b["targets"])
      total += float(s)
      count += float(n)
    return total / max(count, 1.0)
  return evaluate
