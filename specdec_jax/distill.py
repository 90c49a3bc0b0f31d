"""Draft distillation: train an approximation model M_q toward a target M_p.

α = 1 − E[D_LK(p, q)] (Definition 3.1, Corollary 3.6) is taken along the target's
outputs, so the draft learns from them, not the references (DistillSpec): cross-entropy
on the target's greedy/T = 1 outputs plus a token-level divergence (forward KL, total
variation = 1 − per-token acceptance, or reverse KL), optionally on the draft's own
samples. Trains through ``training.fit`` with the target's weights as ``frozen``."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specdec_jax import (checkpoints, data, partitioning, quantization, storage,  # noqa: F401
                         training)
from specdec_jax.drafts import bridge, feature_bridge, t5_block
from specdec_jax.decoding import temperature_sample
from specdec_jax.models.t5 import T5Config, T5Model, shift_right
from specdec_jax.pair import ModelPair, PairSettings, check_path
from specdec_jax.partitioning import Partitioner
from specdec_jax.sampling import SamplingConfig

DIVERGENCES = ("fkl", "tv", "rkl", "none")
OUTPUT_MODES = ("greedy", "sample")
PARAM_DTYPES = ("float32", "bfloat16")   # the target's weights in device memory
# Pair settings distillation holds fixed: (the values it takes, why).
FIXED_PAIR_SETTINGS = {
    "dtype": (("float32",), "distillation computes in float32"),
    "draft_param_dtype": ((None, "float32"), "the draft is kept and trained in float32"),
    "draft_logical_axis_rules": ((None,), "the draft is replicated and trained data-parallel "
                                 "(partitioning.DATA_PARALLEL_RULES)"),
    "draft_quantization": ((None,), "the draft trains in float; export_quantization records "
                           "the scheme the runner quantizes it with"),
}


def _bucketed_chunks(lengths: Sequence[int], batch_size: int,
                     buckets: Sequence[int]) -> list[tuple[int, list[int]]]:
  """(bucket length, indices) chunks of at most batch_size inputs, in index order."""
  by_bucket: dict[int, list[int]] = {}
  for i, n in enumerate(lengths):
    by_bucket.setdefault(training.bucket_len(n, buckets), []).append(i)
  return [(b, idx[j:j + batch_size]) for b, idx in sorted(by_bucket.items())
          for j in range(0, len(idx), batch_size)]


def read_outputs(path: str) -> dict[tuple[int, str], list[int]]:
  """{(input index, mode): tokens} from a generate_target_outputs file."""
  out: dict[tuple[int, str], list[int]] = {}
  if not os.path.exists(path):
    return out
  with open(path, encoding="utf-8") as f:
    lines = f.readlines()
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
      out[(int(rec["i"]), str(rec["mode"]))] = [int(t) for t in rec["tokens"]]
    except (ValueError, KeyError, TypeError) as e:
      if n == len(lines) and not line.endswith("\n"):
        break  # torn final write of a killed run: redone on resume
      raise ValueError(f"{path}:{n}: corrupt target-output record ({e})") from None
  return out


def generate_target_outputs(target: T5Model, params: Any, inputs: Sequence[Sequence[int]],
                            path: str, *, modes: Sequence[str] = ("greedy",),
                            max_decode_len: int = 128, batch_size: int = 64,
                            temperature: float = 1.0, seed: int = 0,
                            buckets: Sequence[int] = training.BUCKETS,
                            log_fn: Callable[[str], None] = print,
                            partitioner: Optional[Partitioner] = None) -> dict:
  """The target's outputs for every input, appended to ``path`` chunk by chunk (inputs
  there are skipped) -> {(index, mode): tokens}. Keys are folded from the seed and the
  chunk, so a resumed run samples the same; only process 0 writes."""
  for m in modes:
    if m not in OUTPUT_MODES:
      raise ValueError(f"unknown output mode {m!r}; known: {OUTPUT_MODES}")
  # What the records are outputs of: a resume under other settings must not reuse them.
  meta = {"target": dataclasses.asdict(target.config), "max_decode_len": max_decode_len,
          "temperature": temperature, "seed": seed, "num_inputs": len(inputs)}
  meta_path = path + ".meta.json"
  if os.path.exists(meta_path):
    with open(meta_path, encoding="utf-8") as f:
      old = json.load(f)
    if old != json.loads(json.dumps(meta)):
      diff = sorted(k for k in meta if old.get(k) != json.loads(json.dumps(meta))[k])
      raise ValueError(f"{path} holds target outputs made with other settings ({diff} differ, "
                       f"see {meta_path}); use another workdir")
  elif os.path.exists(path) and os.path.getsize(path):
    raise ValueError(f"{path} has records but no {meta_path}: cannot tell what made them")
  elif jax.process_index() == 0:
    with open(meta_path, "w", encoding="utf-8") as f:
      json.dump(meta, f)
  done = read_outputs(path)
  eos = target.config.eos_id
  chunks = _bucketed_chunks([len(x) for x in inputs], batch_size, buckets)
  todo = [(m, b, idx) for m in modes for b, idx in chunks if any((i, m) not in done for i in idx)]
  log_fn(f"target outputs: {len(done)} in {path}, {len(todo)} chunks to generate")
  primary = jax.process_index() == 0
  with open(path if primary else os.devnull, "a", encoding="utf-8") as f:
    for n, (mode, length, idx) in enumerate(todo):
      x = np.zeros((batch_size, length), np.int32)
      for r, i in enumerate(idx):
        x[r, :len(inputs[i])] = inputs[i]
      sampling = SamplingConfig(0.0 if mode == "greedy" else temperature)
      key = jax.random.fold_in(jax.random.PRNGKey(seed), idx[0])
      placed = (jnp.asarray(x) if partitioner is None
                else partitioner.shard_batch(x, "generate_batch_size (target outputs)"))
      out = temperature_sample(target, params, placed, key, max_decode_len=max_decode_len,
                               sampling=sampling, eos_id=eos, partitioner=partitioner)
      seqs, lens = _gathered(out.tokens), _gathered(out.length)
      for r, i in enumerate(idx):
        toks = seqs[r, :lens[r]].tolist()
        done[(i, mode)] = toks
        f.write(json.dumps({"i": i, "mode": mode, "tokens": toks}) + "\n")
      f.flush()
      if (n + 1) % 20 == 0 or n + 1 == len(todo):
        log_fn(f"target outputs: {n + 1}/{len(todo)} chunks")
  return done


def _gathered(x: jax.Array) -> np.ndarray:
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# Projections that write into the residual stream: zero them and a T5 1.1 layer
# (pre-norm, x + f(norm(x)) for each sublayer) is exactly the identity.
_RESIDUAL_OUTPUTS = ("out", "wo")


def grow_layers(params: Any, config: Any, *, encoder_layers: int = 0,
                decoder_layers: int = 0, seed: int = 0) -> tuple[Any, Any]:
  """Append layers to a T5 draft -> (params, config); their residual outputs (``out``,
  ``wo``) are zero, so each new pre-norm layer is the identity (as ReZero / Fixup)."""
  if encoder_layers < 0 or decoder_layers < 0:
    raise ValueError(f"grow_layers: layer counts must be >= 0, got encoder={encoder_layers}, "
                     f"decoder={decoder_layers}")
  new_cfg = config.replace(num_encoder_layers=config.num_encoder_layers + encoder_layers,
                           num_decoder_layers=config.num_decoder_layers + decoder_layers)
  fresh = T5Model(new_cfg).init(jax.random.PRNGKey(seed))
  grown = dict(params)
  for stack, old_n, new_n in (
      ("encoder", config.num_encoder_layers, new_cfg.num_encoder_layers),
      ("decoder", config.num_decoder_layers, new_cfg.num_decoder_layers)):
    grown[stack] = dict(params[stack])  # old layers, norms, position bias, logits
    for i in range(old_n, new_n):
      grown[stack][f"layers_{i}"] = _zero_residual_outputs(fresh[stack][f"layers_{i}"])
  return grown, new_cfg


def _zero_residual_outputs(layer: Mapping) -> dict:
  out = {}
  for name, value in layer.items():
    if isinstance(value, Mapping):
      out[name] = (jax.tree_util.tree_map(jnp.zeros_like, value) if name in _RESIDUAL_OUTPUTS
                   else _zero_residual_outputs(value))
    else:
      out[name] = value
  return out


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """divergence: 'fkl' (KL(p‖q)), 'tv' (½Σ|p−q|), 'rkl' (KL(q‖p)) or 'none'.
  ce_weight: weight of cross-entropy on the sequence's tokens. temperature: at which
  p and q are compared. on_policy_fraction: share of each batch replaced by the
  draft's own T=1 samples. block_size: 0 for an autoregressive draft, γ >= 2 for a
  block draft (``block_loss``) trained at ``block_cuts`` cut points per sequence."""

  divergence: str = "fkl"
  ce_weight: float = 1.0
  temperature: float = 1.0
  on_policy_fraction: float = 0.0
  block_size: int = 0
  block_cuts: int = 4

  def __post_init__(self):
    if self.divergence not in DIVERGENCES:
      raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
    if self.ce_weight < 0 or not self.temperature > 0:
      raise ValueError(f"ce_weight must be >= 0 and temperature > 0, got "
                       f"{self.ce_weight}, {self.temperature}")
    if not 0.0 <= self.on_policy_fraction <= 1.0:
      raise ValueError(f"on_policy_fraction must be in [0, 1], got {self.on_policy_fraction}")
    if self.divergence == "none" and self.ce_weight == 0:
      raise ValueError("divergence='none' with ce_weight=0 trains nothing")
    if self.block_size == 1 or self.block_size < 0 or self.block_cuts < 1:
      raise ValueError(f"block_size must be 0 (autoregressive) or >= 2 and block_cuts >= 1, "
                       f"got {self.block_size}, {self.block_cuts}")
    if self.block_size and self.on_policy_fraction > 0:
      raise ValueError("on_policy_fraction > 0 is not supported with block_size (the "
                       "on-policy sampler runs the draft autoregressively)")


def token_divergence(target_logits: jax.Array, draft_logits: jax.Array, kind: str,
                     temperature: float = 1.0) -> jax.Array:
  """Per-position divergence between p = softmax(target/T) and q = softmax(draft/T)."""
  lp = jax.nn.log_softmax(target_logits / temperature)
  lq = jax.nn.log_softmax(draft_logits / temperature)
  p, q = jnp.exp(lp), jnp.exp(lq)
  if kind == "fkl":
    return jnp.sum(p * (lp - lq), -1)
  if kind == "rkl":
    return jnp.sum(q * (lq - lp), -1)
  if kind == "tv":
    return 0.5 * jnp.sum(jnp.abs(p - q), -1)
  raise ValueError(f"unknown divergence {kind!r}")


def _on_policy(draft: T5Model, params, inputs, targets, key, fraction: float):
  """Replace the first ⌈fraction·B⌉ rows' targets by the draft's own T=1 samples."""
  b, length = targets.shape
  n = max(1, int(round(fraction * b)))
  out = temperature_sample(draft, jax.lax.stop_gradient(params), inputs[:n], key,
                           max_decode_len=length, sampling=SamplingConfig(1.0),
                           eos_id=draft.config.eos_id)
  sampled = jnp.where(jnp.arange(length)[None] < out.length[:, None], out.tokens, 0)
  return targets.at[:n].set(sampled.astype(targets.dtype))


def draft_forward(draft: T5Model, target: T5Model, bridged: bool) -> Callable:
  """forward(params, target_params, inputs, dec_in, target_hidden=None, key=None) -> the
  draft's teacher-forced logits; ``bridged``: params {'draft', 'bridge' and/or
  'feature'} (``drafts.bridge``, ``drafts.feature_bridge``)."""
  if not bridged:
    return lambda params, target_params, inputs, dec_in, target_hidden=None, key=None: draft(
        params, inputs, dec_in)

  def forward(params, target_params, inputs, dec_in, target_hidden=None, key=None):
    enc_extra = dec_extra = None
    if "bridge" in params:
      enc_extra = bridge.extra(params["bridge"], target, target_params, inputs)
    if "feature" in params:
      dec_extra = feature_bridge.teacher_forced_extra(params["feature"], target_hidden, key)
    return draft(params["draft"], inputs, dec_in, encoder_extra=enc_extra, decoder_extra=dec_extra)
  return forward


def _target_pass(target: T5Model, target_params: Any, inputs: jax.Array, dec_in: jax.Array,
                 hidden: bool) -> tuple[jax.Array, Optional[jax.Array]]:
  if hidden:
    logits, h = target(target_params, inputs, dec_in, return_hidden=True)
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(h)
  return jax.lax.stop_gradient(target(target_params, inputs, dec_in)), None


def distill_loss(draft: T5Model, target: T5Model, cfg: DistillConfig,
                 bridged: bool = False) -> Callable:
  """loss_fn(params, batch, target_params) for ``training.fit``: the mean over non-pad
  positions of ce_weight·CE + divergence(p, q) on batch 'inputs' and 'targets'."""
  pad, start = draft.config.pad_id, draft.config.decoder_start_id
  if cfg.block_size:
    return block_loss(draft, target, cfg)
  if bridged and cfg.on_policy_fraction > 0:
    raise ValueError("on_policy_fraction > 0 is not supported with a bridged draft "
                     "(the on-policy sampler runs the draft without its bridges)")
  forward = draft_forward(draft, target, bridged)

  def loss_fn(params, batch, target_params):
    inputs, targets = batch["inputs"], batch["targets"]
    if cfg.on_policy_fraction > 0:
      targets = _on_policy(draft, params, inputs, targets, batch["step_key"],
                           cfg.on_policy_fraction)
    dec_in = shift_right(targets, start)
    mask = (targets != pad).astype(jnp.float32)
    n = jnp.maximum(jnp.sum(mask), 1.0)
    features = bridged and "feature" in params
    p_logits = hidden = None
    if cfg.divergence != "none" or features:
      p_logits, hidden = _target_pass(target, target_params, inputs, dec_in, features)
    q_logits = forward(params, target_params, inputs, dec_in, hidden,
                       jax.random.fold_in(batch["step_key"], 7))
    ce = -jnp.take_along_axis(jax.nn.log_softmax(q_logits), targets[..., None], -1)[..., 0]
    metrics = {"ce": jnp.sum(ce * mask) / n}
    loss = cfg.ce_weight * metrics["ce"]
    if cfg.divergence != "none":
      div = token_divergence(p_logits, q_logits, cfg.divergence, cfg.temperature)
      metrics[cfg.divergence] = jnp.sum(div * mask) / n
      loss = loss + metrics[cfg.divergence]
    return loss, metrics
  return loss_fn


def _block_cuts(targets: jax.Array, pad: int, cuts: int, key: jax.Array) -> jax.Array:
  """``cuts`` committed lengths per row [B, cuts], uniform over 0 .. L − 1 (L: non-pad)."""
  lengths = jnp.sum(targets != pad, axis=-1)
  u = jax.random.uniform(key, (targets.shape[0], cuts))
  return jnp.minimum(jnp.floor(u * lengths[:, None]), jnp.maximum(lengths[:, None] - 1, 0)
                     ).astype(jnp.int32)


def block_forward(draft: T5Model, target: T5Model, gamma: int) -> Callable:
  """forward(params, target_params, inputs, dec_in, cuts, target_hidden=None) -> (logits
  [R, T, V], block [R, T] bool) of a block draft at committed lengths cuts [R]."""
  pad = draft.config.pad_id

  def forward(params, target_params, inputs, dec_in, cuts, target_hidden=None):
    enc_extra = None
    if "bridge" in params:
      enc_extra = bridge.extra(params["bridge"], target, target_params, inputs)
    tokens, dec_extra, block = t5_block.teacher_forced_block(
        dec_in, cuts, gamma, params["block"]["mask_embedding"], pad, params.get("feature"),
        target_hidden)
    logits = draft(params["draft"], inputs, tokens, encoder_extra=enc_extra,
                   decoder_extra=dec_extra)
    return logits, block
  return forward


def block_loss(draft: T5Model, target: T5Model, cfg: DistillConfig) -> Callable:
  """The block objective (γ = ``cfg.block_size``): at ``block_cuts`` cut points per
  sequence, divergence + ce_weight·CE at the γ block positions, prefix at half weight."""
  pad, start, gamma, k = (draft.config.pad_id, draft.config.decoder_start_id, cfg.block_size,
                          cfg.block_cuts)
  forward = block_forward(draft, target, gamma)

  def loss_fn(params, batch, target_params):
    inputs, targets = batch["inputs"], batch["targets"]
    dec_in = shift_right(targets, start)
    features = "feature" in params
    p_logits, hidden = _target_pass(target, target_params, inputs, dec_in, features)
    cuts = _block_cuts(targets, pad, k, jax.random.fold_in(batch["step_key"], 11)).reshape(-1)
    rep = lambda x: None if x is None else jnp.repeat(x, k, axis=0)
    targets_r, p_r = rep(targets), rep(p_logits)
    q_logits, block = forward(params, target_params, rep(inputs), rep(dec_in), cuts, rep(hidden))
    nonpad = targets_r != pad
    pos = jnp.arange(targets.shape[1])[None]
    weights = {"block": (block & nonpad).astype(jnp.float32),
               "prefix": ((pos < cuts[:, None]) & nonpad).astype(jnp.float32)}
    ce = -jnp.take_along_axis(jax.nn.log_softmax(q_logits), targets_r[..., None], -1)[..., 0]
    per_pos = cfg.ce_weight * ce
    if cfg.divergence != "none":
      per_pos = per_pos + token_divergence(p_r, q_logits, cfg.divergence, cfg.temperature)
    mean = lambda x, w: jnp.sum(x * w) / jnp.maximum(jnp.sum(w), 1.0)
    metrics = {"ce": mean(ce, weights["block"]), "prefix_ce": mean(ce, weights["prefix"])}
    loss = mean(per_pos, weights["block"]) + 0.5 * mean(per_pos, weights["prefix"])
    return loss, metrics
  return loss_fn


@functools.partial(jax.jit, static_argnums=(0, 1, 6, 7))
def _block_agreement_sums(target: T5Model, draft: T5Model, tp, dp, inputs, targets,
                          gamma: int, cuts: int):
  """Per block position: summed greedy matches, Σ min(p, q) and counts."""
  pad = draft.config.pad_id
  dec_in = shift_right(targets, draft.config.decoder_start_id)
  logits, hidden = _target_pass(target, tp, inputs, dec_in, "feature" in dp)
  n = _block_cuts(targets, pad, cuts, jax.random.PRNGKey(0)).reshape(-1)
  rep = lambda x: None if x is None else jnp.repeat(x, cuts, axis=0)
  q_logits, _ = block_forward(draft, target, gamma)(dp, tp, rep(inputs), rep(dec_in), n,
                                                    rep(hidden))
  at = n[:, None] + jnp.arange(gamma)[None]                             # [R, γ]
  take = lambda x: jnp.take_along_axis(x, jnp.clip(at, 0, x.shape[1] - 1)[..., None], axis=1)
  lp, lq = jax.nn.log_softmax(take(rep(logits))), jax.nn.log_softmax(take(q_logits))
  valid = (jnp.take_along_axis(rep(targets), jnp.clip(at, 0, targets.shape[1] - 1), axis=1)
           != pad) & (at < targets.shape[1])
  valid = valid.astype(jnp.float32)
  greedy = (jnp.argmax(lp, -1) == jnp.argmax(lq, -1)).astype(jnp.float32)
  overlap = jnp.sum(jnp.minimum(jnp.exp(lp), jnp.exp(lq)), -1)
  return (jnp.sum(greedy * valid, 0), jnp.sum(overlap * valid, 0), jnp.sum(valid, 0))


def block_agreement(target: T5Model, target_params: Any, draft: T5Model, draft_params: Any,
                    batches: Sequence[training.Batch], gamma: int, cuts: int = 8,
                    partitioner: Optional[Partitioner] = None) -> dict[str, Any]:
  """Teacher-forced greedy and Σ_x min(p, q) agreement of a block draft, by block position
  (given the target's tokens before it) and token-weighted."""
  g = o = c = 0.0
  for b in batches:
    b = training.place_batch(b, partitioner)
    sums = _block_agreement_sums(target, draft, target_params, draft_params, b["inputs"],
                                 b["targets"], gamma, cuts)
    sg, so, sc = (np.asarray(training.host_value(v), np.float64) for v in sums)
    g, o, c = g + sg, o + so, c + sc
  c = np.maximum(c, 1.0)
  return {"greedy_agreement": float(np.sum(g) / np.sum(c)),
          "t1_acceptance": float(np.sum(o) / np.sum(c)),
          "greedy_by_position": [round(float(x), 4) for x in g / c],
          "t1_by_position": [round(float(x), 4) for x in o / c]}


@functools.partial(jax.jit, static_argnums=(0, 1, 6))
def _agreement_sums(target: T5Model, draft: T5Model, tp, dp, inputs, targets,
                    bridged: bool = False):
  """Summed greedy matches, Σ min(p, q) and non-pad count over one batch."""
  dec_in = shift_right(targets, draft.config.decoder_start_id)
  # Staleness drawn from a fixed key: every evaluation sees the same mix.
  logits, hidden = _target_pass(target, tp, inputs, dec_in, bridged and "feature" in dp)
  lp = jax.nn.log_softmax(logits)
  lq = jax.nn.log_softmax(draft_forward(draft, target, bridged)(
      dp, tp, inputs, dec_in, hidden, jax.random.PRNGKey(0)))
  mask = (targets != draft.config.pad_id).astype(jnp.float32)
  greedy = (jnp.argmax(lp, -1) == jnp.argmax(lq, -1)).astype(jnp.float32)
  overlap = jnp.sum(jnp.minimum(jnp.exp(lp), jnp.exp(lq)), -1)
  return jnp.sum(greedy * mask), jnp.sum(overlap * mask), jnp.sum(mask)


def agreement(target: T5Model, target_params: Any, draft: T5Model, draft_params: Any,
              batches: Sequence[training.Batch], bridged: bool = False,
              partitioner: Optional[Partitioner] = None) -> dict[str, float]:
  """Teacher-forced greedy (α at T=0) and Σ_x min(p, q) (α at T=1) agreement."""
  g = o = n = 0.0
  for b in batches:
    b = training.place_batch(b, partitioner)
    sg, so, sn = _agreement_sums(target, draft, target_params, draft_params, b["inputs"],
                                 b["targets"], bridged)
    sg, so, sn = (float(training.host_value(v)) for v in (sg, so, sn))
    g, o, n = g + sg, o + so, n + sn
  n = max(n, 1.0)
  return {"greedy_agreement": g / n, "t1_acceptance": o / n}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillJob(PairSettings):
  """Everything a distillation run needs (``--help`` prints each entry's first sentence).
  The pair's settings are ``PairSettings``'s, those in ``FIXED_PAIR_SETTINGS`` fixed; the
  draft is replicated and trained in float32, data-parallel (docs/sharding.md).

  output_dir: where the distilled draft is written, in the project's format.
  workdir: the target outputs, optimizer checkpoints and loss log (a killed job resumes from it).
  source: the training inputs, a TSV/JSONL file or a seqio/TFDS task's split.
  split: the split of ``task`` read when ``source`` is not a file.
  task: the task name (its prefix is added to each input, as in the runner).
  prefix: the task's input prefix (None: ``data.PREFIXES[task]``).
  tfds_data_dir: the TFDS data directory for seqio tasks (None: TFDS's default).
  max_examples: training inputs to use (None: all).
  eval_source: held-out pairs for the agreement log (None: no agreement log).
  eval_split: the split of ``task`` the agreement log reads when ``eval_source`` is not a file.
  eval_max_examples: held-out pairs for the agreement log.
  max_input_len: input tokens kept per example.
  max_decode_len: most tokens the target generates per example.
  modes: the target outputs to learn from, greedy and/or sample.
  sample_temperature: the temperature of the target's sampled outputs.
  generate_batch_size: rows per target generation batch (split over 'data').
  divergence: the distillation loss, 'fkl', 'tv', 'rkl' or 'none' (``DistillConfig``).
  ce_weight: the weight of cross-entropy on the sequence's tokens.
  on_policy_fraction: the share of each batch replaced by the draft's own T = 1 samples.
  grow_encoder_layers: encoder layers added to the draft before training (``grow_layers``).
  grow_decoder_layers: decoder layers added to the draft before training (``grow_layers``).
  encoder_bridge: the draft also reads the target's encoder output (``specdec_jax.drafts.bridge``).
    A new bridge starts at zero and trains with Adam at ``bridge_learning_rate``.
  bridge_learning_rate: Adam's learning rate for the bridges and a block draft's mask embedding.
  feature_bridge: the draft also reads the target's decoder states of the committed prefix
    (``specdec_jax.drafts.feature_bridge``).
  feature_staleness: the feature bridge's staleness range (set it to the γ the draft runs at).
  block_size: 0 trains the autoregressive draft; γ >= 2 a block draft of block size γ.
    (``specdec_jax.drafts.t5_block``), warm-started from the draft checkpoint.
  block_cuts: block cut points per training sequence.
  optimizer: the draft's optimizer, 'adafactor' or 'adamw'.
  learning_rate: the draft's learning rate.
  steps: training steps.
  batch_tokens: the most tokens a training batch holds (``training.batch_rows``).
  max_minutes: wall-clock cap on the training phase (None: none).
  eval_every: steps between agreement-log evaluations.
  seed: the PRNG seed of sampling and training.
  resume: continue a run in an existing workdir/output_dir.
  export_quantization: record that the exported draft runs weight-only 'int8' or 'int4'.
    The runner quantizes it when it loads it (``quantization.RECORD_FILE``)."""

  output_dir: str
  workdir: str
  source: str = "data/bible/train.tsv"
  split: str = "train"
  task: str = "bible_modernize"
  prefix: Optional[str] = None
  tfds_data_dir: Optional[str] = None
  max_examples: Optional[int] = None
  eval_source: Optional[str] = None
  eval_split: str = "validation"
  eval_max_examples: Optional[int] = 500
  max_input_len: int = 128
  max_decode_len: int = 128
  modes: tuple[str, ...] = ("greedy", "sample")
  sample_temperature: float = 1.0
  generate_batch_size: int = 64
  divergence: str = "fkl"
  ce_weight: float = 1.0
  on_policy_fraction: float = 0.0
  grow_encoder_layers: int = 0
  grow_decoder_layers: int = 0
  encoder_bridge: bool = False
  bridge_learning_rate: float = 1e-3
  feature_bridge: bool = False
  feature_staleness: int = 4
  block_size: int = 0
  block_cuts: int = 4
  optimizer: str = "adafactor"
  learning_rate: float = 3e-3
  steps: int = 2000
  batch_tokens: int = 4096
  max_minutes: Optional[float] = None
  eval_every: int = 250
  seed: int = 0
  resume: bool = False
  export_quantization: Optional[str] = None

  @property
  def pair(self) -> ModelPair:
    """The target and the draft as one ``ModelPair``, the draft kept in float32."""
    return dataclasses.replace(self.model_pair(), draft_param_dtype="float32")

  def validate(self, check_paths: bool = True) -> None:
    """Checks that need no loading (``check_paths`` False: not whether paths exist)."""
    DistillConfig(self.divergence, self.ce_weight, 1.0, self.on_policy_fraction,
                  self.block_size, self.block_cuts)
    if (self.encoder_bridge or self.feature_bridge) and self.on_policy_fraction > 0:
      raise ValueError("encoder_bridge or feature_bridge with on_policy_fraction > 0 is not "
                       "supported (the on-policy sampler runs the draft without its bridges)")
    if self.feature_staleness < 1:
      raise ValueError(f"feature_staleness must be >= 1, got {self.feature_staleness}")
    if not self.bridge_learning_rate > 0:
      raise ValueError(f"bridge_learning_rate must be > 0, got {self.bridge_learning_rate}")
    for m in self.modes:
      if m not in OUTPUT_MODES:
        raise ValueError(f"modes: unknown output mode {m!r}; known: {OUTPUT_MODES}")
    for name in ("steps", "batch_tokens", "max_input_len", "max_decode_len", "generate_batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    for name in ("grow_encoder_layers", "grow_decoder_layers"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    for name, (allowed, why) in FIXED_PAIR_SETTINGS.items():
      if getattr(self, name) not in allowed:
        raise ValueError(f"{name}={getattr(self, name)!r}: {why}; leave it at {allowed[-1]!r}")
    pair = self.pair
    pair.check_values(PARAM_DTYPES)
    quantization.check(self.export_quantization, "export_quantization")
    if self.mesh_shape is not None and self.generate_batch_size % self.mesh_shape[0]:
      data_axis = self.mesh_shape[0]
      raise ValueError(f"generate_batch_size={self.generate_batch_size} is not divisible by "
                       f"the 'data' axis of mesh_shape={tuple(self.mesh_shape)} ({data_axis}): "
                       f"target outputs are generated in batches split over 'data'; use a "
                       f"multiple of {data_axis}")
    for name in pair.unset(draft_needed=True) + ([] if self.source else ["source"]):
      raise ValueError(f"{name} is not set")
    pair.check_paths(must_exist=check_paths)
    check_path("source", self.source, must_exist=check_paths)
    for name in ("output_dir", "workdir"):
      path = getattr(self, name)
      if not path:
        raise ValueError(f"{name} is not set")
      if storage.is_gcs(path):
        raise ValueError(f"{name} {path!r}: distillation writes (and appends to) local files; "
                         "give a local directory and copy the distilled draft to Cloud "
                         "Storage afterwards")
      if check_paths and not self.resume and os.path.isdir(path) and os.listdir(path):
        raise FileExistsError(f"{name} {path!r} exists and is not empty; pass --resume to "
                              "continue that run, or choose another directory")


def check_before_loading(job: DistillJob) -> tuple[Optional[Partitioner], Optional[Partitioner]]:
  """Every check that reads no weight -> the (target's, draft's) partitioners."""
  job.validate()
  return job.pair.check_before_loading()


def _encode_source(vocab, source: str, split: str, prefix: str, max_examples, data_dir,
                   max_len: int, with_refs: bool):
  try:
    examples = data.load_examples(source, split=split, max_examples=max_examples, data_dir=data_dir)
  except UnicodeDecodeError as e:
    raise ValueError(f"{source}: not UTF-8 text ({e})") from None
  if not examples:
    raise ValueError(f"{source}: no examples")
  eos = vocab.eos_id
  out = []
  for e in examples:
    x = vocab.encode(prefix + e.input)[:max_len - 1] + [eos]
    if with_refs:
      if not e.reference:
        continue
      y = vocab.encode(e.reference)[:max_len - 1] + [eos]
      out.append((x, y))
    else:
      out.append(x)
  return out


def run_job(job: DistillJob, log_fn: Callable[[str], None] = print) -> dict:
  """Generate the target's outputs, distill the draft, export it -> a summary."""
  target_part, draft_part = check_before_loading(job)
  spec = job.pair
  vocab = data.get_vocabulary(job.resolve(job.vocab_path), extra_ids=job.vocab_extra_ids)
  peeked = spec.peek_config("target")
  if peeked is not None:
    spec.check_vocab_size(vocab.vocab_size, peeked)
  target, target_params = spec.load("target", target_part)
  draft, draft_params, bridged = _load_draft(job, target, draft_part, log_fn)
  spec.check_vocabularies(target.config, draft.config)
  spec.check_vocab_size(vocab.vocab_size, target.config)
  inputs, eval_pairs = _encode_inputs(job, vocab)
  os.makedirs(job.workdir, exist_ok=True)
  log_fn(f"{len(inputs)} training inputs from {job.source}")
  buckets = training.buckets_upto(max(job.max_input_len, job.max_decode_len))
  rows = 1 if job.mesh_shape is None else job.mesh_shape[0]  # batch rows split over 'data'

  outputs = generate_target_outputs(
      target, target_params, inputs, os.path.join(job.workdir, "target_outputs.jsonl"),
      modes=job.modes, max_decode_len=job.max_decode_len,
      batch_size=job.generate_batch_size, temperature=job.sample_temperature, seed=job.seed,
      buckets=buckets, log_fn=log_fn, partitioner=target_part)
  pairs = [(inputs[i], toks) for (i, _), toks in sorted(outputs.items()) if toks]

  summary: dict[str, Any] = {"training_inputs": len(inputs), "training_pairs": len(pairs)}
  evaluate = None
  if eval_pairs:
    eval_batches = _eval_batches(job, target, target_params, eval_pairs, buckets, rows,
                                 target_part, log_fn)
    evaluate = lambda p: agreement(target, target_params, draft, p, eval_batches, bridged,
                                   draft_part)
    if job.block_size:
      evaluate = lambda p: block_agreement(target, target_params, draft, p, eval_batches,
                                           job.block_size, partitioner=draft_part)
    summary["before"] = evaluate(draft_params)
    log_fn(f"before distillation: {json.dumps(summary['before'])}")

  cfg = DistillConfig(job.divergence, job.ce_weight, 1.0, job.on_policy_fraction,
                      job.block_size, job.block_cuts)
  opt_cfg, optimizer = train_optimizer(job, bridged)
  result = training.fit(
      distill_loss(draft, target, cfg, bridged), draft_params,
      lambda start: training.batch_stream(pairs, job.batch_tokens, job.seed, start, buckets, rows),
      opt_cfg, os.path.join(job.workdir, "train"), evaluate=evaluate,
      eval_every=job.eval_every, max_minutes=job.max_minutes, name="distill", log_fn=log_fn,
      seed=job.seed, optimizer=optimizer, frozen=target_params, partitioner=draft_part)
  summary.update(steps=result.steps, wall_s=result.wall_s, log=result.log,
                 job=dataclasses.asdict(job))
  if evaluate is not None:
    summary["after"] = evaluate(result.params)
  if jax.process_index() == 0:
    _export(job, draft.config, jax.tree.map(training.host_value, result.params), bridged, summary)
  log_fn(f"distilled draft written to {job.output_dir}")
  return summary


def _load_draft(job: DistillJob, target: T5Model, draft_part: Optional[Partitioner],
                log_fn: Callable[[str], None]) -> tuple[T5Model, Any, bool]:
  """The draft to train in float32, grown, its bridges wrapped -> (draft, params, bridged)."""
  draft, params = job.pair.load("draft", draft_part, quantize=False)  # trained in float
  where = job.resolve(job.draft_checkpoint)
  has_dir = storage.is_gcs(where) or os.path.isdir(where)
  kernel = bridge.load(where) if has_dir else None
  if job.grow_encoder_layers or job.grow_decoder_layers:
    params, grown_cfg = grow_layers(
        params, draft.config, encoder_layers=job.grow_encoder_layers,
        decoder_layers=job.grow_decoder_layers, seed=job.seed)
    draft = T5Model(grown_cfg)
    log_fn(f"draft grown to {grown_cfg.num_encoder_layers} encoder / "
           f"{grown_cfg.num_decoder_layers} decoder layers (new layers start as the identity)")
  features = feature_bridge.load(where) if has_dir else None
  block = t5_block.load(where) if has_dir else None
  bridged = (job.encoder_bridge or kernel is not None or job.feature_bridge
             or features is not None or bool(job.block_size))
  if not bridged:
    return draft, params, False
  if job.on_policy_fraction > 0:
    raise ValueError(f"{job.draft_checkpoint} has a bridge; on_policy_fraction > 0 "
                     "is not supported with one")
  wrapped = {"draft": params}
  if job.encoder_bridge and kernel is None:
    kernel = bridge.zeros(target, draft)
    log_fn("encoder bridge added (zero: the draft starts unchanged)")
  if kernel is not None:
    bridge.check(kernel, target, draft, job.draft_checkpoint)
    wrapped["bridge"] = jnp.asarray(kernel)
  if job.feature_bridge and features is None:
    features = feature_bridge.zeros(target, draft, job.feature_staleness)
    log_fn("feature bridge added (zero: the draft starts unchanged)")
  if features is not None:
    feature_bridge.check(features, target, draft, job.draft_checkpoint)
    rows = features["staleness"].shape[0]
    if job.block_size > rows:
      extend = np.repeat(np.asarray(features["staleness"])[-1:], job.block_size - rows, 0)
      features = dict(features, staleness=np.concatenate([features["staleness"], extend]))
      log_fn(f"feature bridge staleness table extended from {rows} to {job.block_size} rows")
    wrapped["feature"] = jax.tree.map(jnp.asarray, features)
  if job.block_size:
    if block is None:
      block = t5_block.zeros(draft)
      log_fn("block draft: mask embedding added (zero: mask positions read the pad token)")
    t5_block.check(block, draft, job.draft_checkpoint)
    wrapped["block"] = jax.tree.map(jnp.asarray, block)
  return draft, wrapped, True


def _encode_inputs(job: DistillJob, vocab: Any) -> tuple[list, Optional[list]]:
  """(training inputs, held-out (input, reference) pairs or None) as EOS-terminated ids."""
  prefix = job.prefix if job.prefix is not None else data.PREFIXES.get(job.task, "")
  inputs = _encode_source(vocab, job.resolve(job.source), job.split, prefix, job.max_examples,
                          job.tfds_data_dir, job.max_input_len, with_refs=False)
  eval_pairs = None
  if job.eval_source:
    eval_pairs = _encode_source(vocab, job.resolve(job.eval_source), job.eval_split, prefix,
                                job.eval_max_examples, job.tfds_data_dir, job.max_input_len,
                                with_refs=True)
  return inputs, eval_pairs


def _eval_batches(job: DistillJob, target: T5Model, target_params: Any, eval_pairs: list,
                  buckets: Sequence[int], rows: int, target_part: Optional[Partitioner],
                  log_fn: Callable[[str], None]) -> list[training.Batch]:
  """Fixed batches of the target's greedy outputs on the held-out inputs."""
  eval_out = generate_target_outputs(
      target, target_params, [x for x, _ in eval_pairs],
      os.path.join(job.workdir, "eval_target_outputs.jsonl"), modes=("greedy",),
      max_decode_len=job.max_decode_len, batch_size=job.generate_batch_size,
      buckets=buckets, log_fn=log_fn, partitioner=target_part)
  return training.fixed_batches(
      [(eval_pairs[i][0], toks) for (i, _), toks in sorted(eval_out.items()) if toks],
      job.batch_tokens, buckets, rows)


def _export(job: DistillJob, config: T5Config, params: Any, bridged: bool, summary: dict) -> None:
  """The distilled draft into ``job.output_dir`` with its bridges, quantization record and log."""
  # An earlier export's files go first; config.json is written last (by save_checkpoint),
  # so a run killed midway leaves a directory that does not load.
  for name in ("distill_log.json", bridge.FILENAME, feature_bridge.FILENAME, t5_block.FILENAME,
               quantization.RECORD_FILE, "config.json"):
    path = os.path.join(job.output_dir, name)
    if os.path.exists(path):
      os.remove(path)
  if job.export_quantization is not None:
    os.makedirs(job.output_dir, exist_ok=True)
    with open(os.path.join(job.output_dir, quantization.RECORD_FILE), "w") as f:
      json.dump({"draft_quantization": job.export_quantization,
                 "scheme": quantization.SCHEME}, f, indent=1)
  if bridged and "bridge" in params:
    bridge.save(job.output_dir, params["bridge"])
  if bridged and "feature" in params:
    feature_bridge.save(job.output_dir, params["feature"])
  if bridged and "block" in params:
    t5_block.save(job.output_dir, params["block"])
  out_params = params["draft"] if bridged else params
  checkpoints.save_checkpoint(job.output_dir, out_params, config, dtype="bfloat16", overwrite=True)
  with open(os.path.join(job.output_dir, "distill_log.json"), "w") as f:
    json.dump(summary, f, indent=1)


def train_optimizer(job: DistillJob, bridged: bool) -> tuple[training.OptimizerConfig,
                                                             optax.GradientTransformation]:
  """(optimizer settings, transformation) for ``fit``; Adam on a bridged draft's bridges."""
  opt_cfg = training.OptimizerConfig(job.optimizer, job.learning_rate, job.steps)
  if bridged:
    return opt_cfg, _bridged_optimizer(opt_cfg, job.bridge_learning_rate)
  return opt_cfg, training.make_optimizer(opt_cfg)


def _bridged_optimizer(cfg: training.OptimizerConfig, bridge_lr: float):
  """Adam on the bridges: a zero tensor has no scale for Adafactor's relative steps."""
  adam_cfg = dataclasses.replace(cfg, name="adamw", peak_lr=bridge_lr, weight_decay=0.0)
  labels = lambda params: {k: jax.tree.map(lambda _: "draft" if k == "draft" else "bridge", v)
                           for k, v in params.items()}
  return optax.multi_transform({"draft": training.make_optimizer(cfg),
                                "bridge": training.make_optimizer(adam_cfg)}, labels)


def smoke_job(workdir: str, log_fn: Callable[[str], None] = print, encoder_bridge: bool = False,
              feature_bridge: bool = False, block_size: int = 0) -> dict:
  """Every stage of ``run_job`` on random micro models and the demo vocabulary, in seconds."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for name, d in (("target", 32), ("draft", 16)):
    cfg = T5Config(vocab_size=8000, d_model=d, num_heads=1, head_dim=16, num_encoder_layers=1,
                   num_decoder_layers=1, d_ff=2 * d)
    checkpoints.save_checkpoint(os.path.join(workdir, name),
                                T5Model(cfg).init(jax.random.PRNGKey(0)), cfg, overwrite=True)
  job = DistillJob(
      target_checkpoint=os.path.join(workdir, "target"),
      draft_checkpoint=os.path.join(workdir, "draft"),
      output_dir=os.path.join(workdir, "distilled"), workdir=os.path.join(workdir, "run"),
      source=os.path.join(repo, "data/bible/validation.tsv"), max_examples=48,
      eval_source=os.path.join(repo, "data/bible/test.tsv"), eval_max_examples=16,
      vocab_path=os.path.join(repo, "checkpoints/demo/spm.model"), max_input_len=32,
      max_decode_len=32, modes=("greedy",), generate_batch_size=16, steps=4,
      batch_tokens=256, eval_every=2, resume=True, encoder_bridge=encoder_bridge,
      feature_bridge=feature_bridge, block_size=block_size)
  return run_job(job, log_fn)
