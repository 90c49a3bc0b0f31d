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

import os
import tempfile
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import distill, training
from specdec_jax.models.t5 import T5Model
from specdec_jax.sampling import SamplingConfig
from specdec_jax.timing import target_steps, time_call


def greedy_outputs(model: T5Model, params: Any, inputs: Sequence[Sequence[int]],
                   max_decode_len: int, batch_size: int = 64) -> list[list[int]]:
  """Greedy outputs (EOS included when reached) for every input, batched."""
  with tempfile.TemporaryDirectory() as d:
    out = distill.generate_target_outputs(model, params, inputs, os.path.join(d, "o.jsonl"),
                                          max_decode_len=max_decode_len,
                                          batch_size=batch_size, log_fn=lambda m: None)
  return [out[(i, "greedy")] for i in range(len(inputs))]


def decode_step_seconds(model: T5Model, params: Any, src_len: int = 64, cache_len: int = 128,
                        reps: int = 15, position: int = 40, inner: int = 32) -> float:
  """Seconds of one single-token cached decode step (with its greedy
  standardize and sample), batch 1: the median over ``reps`` of ``inner``
  steps run inside one jitted loop (``timing.target_steps``), as the decoding
  loops run them. Timed as single calls from Python instead, the per-call
  dispatch would weigh most on the smallest model and make the draft/target
  ratio noisy."""
  inputs = jnp.ones((1, src_len), jnp.int32)
  cache = model.init_cache(params, model.encode(params, inputs), inputs, cache_len)
  tokens = jnp.ones((1, 1), jnp.int32)
  pos = jnp.full((1, 1), position, jnp.int32)
  key = jax.random.PRNGKey(0)
  times = time_call(lambda: target_steps(model, params, cache, tokens, pos, key,
                                         SamplingConfig(), inner), repeats=reps)
  return float(np.median(times)) / inner


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
    ce = training.mean_ce(model, batches)(params)
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
  # Interleaved repeats: load from other processes hits every model alike.
  times: dict[str, list[float]] = {n: [] for n in models}
  for _ in range(timing_repeats):
    for name, (model, params) in models.items():
      times[name].append(decode_step_seconds(model, params))
  for name in models:
    out[name]["decode_step_ms_b1"] = 1e3 * float(np.median(times[name]))
    out[name]["target_step_over_this"] = float(np.median(times[target]) /
                                               np.median(times[name]))
  return out
