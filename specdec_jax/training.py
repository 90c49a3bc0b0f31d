"""One training loop (``fit``) for teacher-forced training and draft distillation:
length-bucketed batches to a token budget, T5X's Adafactor or AdamW with warmup +
cosine decay, jitted steps of any ``loss_fn``, orbax checkpoints (same data order
after a restart), a wall-clock cap, a JSONL loss log, data-parallel on a mesh."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from specdec_jax.partitioning import Partitioner

Pair = tuple[list[int], list[int]]
Batch = dict[str, np.ndarray]
# Sequence-length buckets (tokens); a batch is padded to the smallest that fits.
BUCKETS = (24, 32, 48, 64, 96, 128)


def buckets_upto(max_len: int) -> tuple[int, ...]:
  """Buckets for sequences of up to max_len tokens (the defaults, extended)."""
  ladder = BUCKETS + (192, 256, 384, 512, 768, 1024, 1536, 2048)
  return tuple(b for b in ladder if b < max_len) + (max_len,)


def bucket_len(n: int, buckets: Sequence[int] = BUCKETS) -> int:
  for b in buckets:
    if n <= b:
      return b
  raise ValueError(f"sequence of {n} tokens is longer than the largest bucket {buckets[-1]}")


def batch_rows(length: int, batch_tokens: int, rows_multiple: int = 1) -> int:
  """Rows of a batch padded to ``length``: a multiple of ``rows_multiple`` ('data')."""
  if rows_multiple < 1:
    raise ValueError(f"rows_multiple must be >= 1, got {rows_multiple}")
  return max(rows_multiple, batch_tokens // length // rows_multiple * rows_multiple)


def make_batches(pairs: Sequence[Pair], batch_tokens: int, rng: np.random.Generator,
                 buckets: Sequence[int] = BUCKETS, rows_multiple: int = 1) -> list[list[int]]:
  """Shuffled index batches of similar length (rows per ``batch_rows``)."""
  by_bucket: dict[int, list[int]] = {}
  for i in rng.permutation(len(pairs)):
    s, t = pairs[i]
    by_bucket.setdefault(bucket_len(max(len(s), len(t)), buckets), []).append(int(i))
  batches = []
  for length, idx in sorted(by_bucket.items()):
    bs = batch_rows(length, batch_tokens, rows_multiple)
    batches += [idx[j:j + bs] for j in range(0, len(idx), bs)]
  order = rng.permutation(len(batches))
  return [batches[k] for k in order]


def pad_batch(pairs: Sequence[Pair], idx: Sequence[int], batch_tokens: int,
              buckets: Sequence[int] = BUCKETS, rows_multiple: int = 1) -> Batch:
  """{'inputs', 'targets'}: [B, L] int32, zero (pad) filled; B fixed per bucket L."""
  length = bucket_len(max(max(len(pairs[i][0]), len(pairs[i][1])) for i in idx), buckets)
  bs = batch_rows(length, batch_tokens, rows_multiple)
  inputs = np.zeros((bs, length), np.int32)
  targets = np.zeros((bs, length), np.int32)
  for r, i in enumerate(idx):
    s, t = pairs[i]
    inputs[r, :len(s)] = s
    targets[r, :len(t)] = t
  return {"inputs": inputs, "targets": targets}


def batch_stream(pairs: Sequence[Pair], batch_tokens: int, seed: int, start_step: int = 0,
                 buckets: Sequence[int] = BUCKETS, rows_multiple: int = 1) -> Iterator[Batch]:
  """Infinite deterministic stream; step n is the same batch whenever resumed."""
  step, epoch = 0, 0
  while True:
    batches = make_batches(pairs, batch_tokens, np.random.default_rng([seed, epoch]), buckets,
                           rows_multiple)
    for idx in batches:
      if step >= start_step:
        yield pad_batch(pairs, idx, batch_tokens, buckets, rows_multiple)
      step += 1
    epoch += 1


def fixed_batches(pairs: Sequence[Pair], batch_tokens: int,
                  buckets: Sequence[int] = BUCKETS, rows_multiple: int = 1) -> list[Batch]:
  """Every pair once, in a fixed order (evaluation)."""
  return [pad_batch(pairs, idx, batch_tokens, buckets, rows_multiple)
          for idx in make_batches(pairs, batch_tokens, np.random.default_rng(0), buckets,
                                  rows_multiple)]


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """``name``: 'adafactor' (T5X's recipe) or 'adamw'. LR: linear warmup over
  ``warmup_steps`` (default min(500, span/10)), then cosine decay to ``end_fraction``
  of the peak over [schedule_start, total_steps]."""

  name: str = "adafactor"
  peak_lr: float = 1e-3
  total_steps: int = 1000
  warmup_steps: Optional[int] = None
  end_fraction: float = 0.05
  schedule_start: int = 0
  weight_decay: float = 0.01  # adamw only
  clip_norm: float = 1.0


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  """The optimizer of ``cfg``. Adafactor as T5X configures it: factored, no momentum,
  update clipping at 1, steps relative to each parameter's RMS scale."""
  if cfg.name not in ("adafactor", "adamw"):
    raise ValueError(f"optimizer must be 'adafactor' or 'adamw', got {cfg.name!r}")
  span = max(1, cfg.total_steps - cfg.schedule_start)
  warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, min(500, span // 10))
  base = optax.warmup_cosine_decay_schedule(0.0, cfg.peak_lr, warmup, span,
                                            end_value=cfg.peak_lr * cfg.end_fraction)
  sched = lambda count: base(jnp.maximum(count - cfg.schedule_start, 0))
  if cfg.name == "adafactor":
    opt = optax.adafactor(sched, factored=True, multiply_by_parameter_scale=True,
                          clipping_threshold=1.0, momentum=None, decay_rate=0.8)
  else:
    opt = optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=cfg.weight_decay)
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt)


@dataclasses.dataclass
class FitResult:
  params: Any
  log: list[dict]
  steps: int
  wall_s: float


def host_value(x: Any) -> np.ndarray:
  """A replicated (or one-device) array's value on this host."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(x.addressable_data(0))
  return np.asarray(jax.device_get(x))


def _restart_log(path: str, upto_step: int, primary: bool) -> list[dict]:
  """Log records up to the resumed step, written back by the ``primary`` process."""
  recs = []
  if os.path.exists(path):
    with open(path) as f:
      recs = [json.loads(line) for line in f if line.strip()]
  log = [r for r in recs if r["step"] <= upto_step]
  if primary:
    with open(path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in log)
  return log


def make_train_step(loss_fn: Callable, opt: optax.GradientTransformation,
                    partitioner: Optional[Partitioner] = None) -> Callable:
  """The jitted step(params, opt_state, batch, frozen) -> (params, opt_state, loss, aux):
  ``frozen`` (e.g. a distillation target) is an argument, never a baked constant;
  params and opt_state are donated; with a ``partitioner``, data-parallel."""
  def step(params, opt_state, batch, frozen):
    fn = loss_fn if frozen is None else lambda p, b: loss_fn(p, b, frozen)
    (loss, aux), grads = jax.value_and_grad(fn, has_aux=True)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, aux

  out = None if partitioner is None else partitioner.replicated()
  return jax.jit(step, donate_argnums=(0, 1), out_shardings=out)


def place_batch(batch: Batch, partitioner: Optional[Partitioner]) -> dict:
  if partitioner is None:
    return dict(batch)
  return {k: partitioner.shard_batch(v, f"batch {k!r}") for k, v in batch.items()}


def _train_copy(params: Any, opt: optax.GradientTransformation,
                partitioner: Optional[Partitioner]) -> tuple[Any, Any]:
  """A copy of ``params`` (the step donates them) and the optimizer's state, placed."""
  if partitioner is None:
    device = jax.local_devices()[0]
    params = jax.device_put(jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), params),
                            device)
    return params, jax.device_put(opt.init(params), device)
  repl = partitioner.replicated()
  copy = jax.jit(lambda t: jax.tree_util.tree_map(jnp.copy, t), out_shardings=repl)
  params = copy(jax.device_put(params, repl))
  return params, jax.device_put(opt.init(params), repl)


def _resume(mngr: ocp.CheckpointManager, params: Any, opt_state: Any
            ) -> tuple[Any, Any, int, float]:
  """(params, opt_state, step, seconds trained) from the newest checkpoint, or step 0."""
  if mngr.latest_step() is None:
    return params, opt_state, 0, 0.0
  state = {"params": params, "opt_state": opt_state, "elapsed": np.zeros((), np.float64)}
  restored = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(state))
  return (restored["params"], restored["opt_state"], int(mngr.latest_step()),
          float(restored["elapsed"]))


def _record(step: int, window: dict[str, list], evaluate: Optional[Callable[[Any], dict]],
            params: Any, wall_s: float) -> dict:
  """One loss-log line: the metrics' means since the last line, the evaluation, wall time."""
  rec = {"step": step, **{k: float(np.mean([host_value(x) for x in v])) for k, v in window.items()}}
  if evaluate is not None:
    rec.update(evaluate(params))
  rec["wall_s"] = round(wall_s, 1)
  return rec


def _clock(t0: float, last_save: float, max_minutes: Optional[float],
           ckpt_minutes: float) -> tuple[bool, bool]:
  """(over the time limit, a checkpoint due); process 0 decides for all."""
  over_time = max_minutes is not None and time.time() - t0 > 60 * max_minutes
  due = time.time() - last_save > 60 * ckpt_minutes
  if jax.process_count() > 1:
    over_time, due = (bool(x) for x in multihost_utils.broadcast_one_to_all(
        np.array([over_time, due])))
  return over_time, due


def fit(loss_fn: Callable, params: Any, make_stream: Callable[[int], Iterator[Batch]],
        opt_cfg: OptimizerConfig, run_dir: str, *,
        evaluate: Optional[Callable[[Any], dict]] = None, eval_every: int = 250,
        seed: int = 0, ckpt_minutes: float = 3.0, max_minutes: Optional[float] = None,
        name: str = "model", log_fn: Callable[[str], None] = print,
        optimizer: Optional[optax.GradientTransformation] = None,
        frozen: Any = None, partitioner: Optional[Partitioner] = None) -> FitResult:
  """Train ``params`` for ``opt_cfg.total_steps`` steps of ``loss_fn(params, batch[,
  frozen]) -> (loss, metrics)``. ``batch['step_key']`` and ``make_stream(start)`` depend
  on the step only, so a run resumed from ``run_dir/ckpt`` sees the same data;
  ``max_minutes`` stops early (and saves); ``evaluate`` runs every ``eval_every`` steps."""
  run_dir = os.path.abspath(run_dir)
  primary = jax.process_index() == 0
  os.makedirs(run_dir, exist_ok=True)
  opt = optimizer if optimizer is not None else make_optimizer(opt_cfg)
  params, opt_state = _train_copy(params, opt, partitioner)
  mngr = ocp.CheckpointManager(os.path.join(run_dir, "ckpt"),
                               options=ocp.CheckpointManagerOptions(max_to_keep=2))
  params, opt_state, step, elapsed_before = _resume(mngr, params, opt_state)
  if step:
    log_fn(f"[{name}] resumed at step {step}")
  log_path = os.path.join(run_dir, "log.jsonl")
  log = _restart_log(log_path, step, primary)
  train_step = make_train_step(loss_fn, opt, partitioner)
  stream = make_stream(step)
  t0 = last_save = time.time()
  window: dict[str, list[float]] = {}

  def save(at_step: int) -> None:
    state = {"params": params, "opt_state": opt_state,
             "elapsed": np.asarray(elapsed_before + time.time() - t0, np.float64)}
    mngr.save(at_step, args=ocp.args.StandardSave(state), force=True)
    mngr.wait_until_finished()

  while step < opt_cfg.total_steps:
    batch = place_batch(next(stream), partitioner)
    batch["step_key"] = jax.random.fold_in(jax.random.PRNGKey(seed), step)
    params, opt_state, loss, aux = train_step(params, opt_state, batch, frozen)
    step += 1
    # Device scalars, read back only when logged (no host round trip per step).
    for k, v in {"train_loss": loss, **aux}.items():
      window.setdefault(k, []).append(v)
    done = step >= opt_cfg.total_steps
    over_time, due = _clock(t0, last_save, max_minutes, ckpt_minutes)
    if step % eval_every == 0 or done or over_time:
      rec = _record(step, window, evaluate, params, elapsed_before + time.time() - t0)
      window = {}
      log.append(rec)
      if primary:
        with open(log_path, "a") as f:
          f.write(json.dumps(rec) + "\n")
      log_fn(f"[{name}] {json.dumps(rec)}")
    if due or done or over_time:
      save(step)
      last_save = time.time()
    if over_time:
      log_fn(f"[{name}] stopping at step {step}: {max_minutes} minutes reached")
      break
  mngr.close()
  return FitResult(params, log, step, round(elapsed_before + time.time() - t0, 1))
