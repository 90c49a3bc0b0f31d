"""Train the demo T5 target/draft pair on KJV -> WEB verse modernization.

Steps: (1) a SentencePiece unigram vocabulary on the train split (T5 ids: pad 0,
eos 1, unk 2, no bos), (2) each requested model trained with AdamW on
teacher-forced cross-entropy, logging train/validation loss and checkpointing
with orbax so a restarted run resumes, (3) export to ``<export_dir>/<name>/``
with ``specdec_jax.checkpoints.save_checkpoint`` (bfloat16).

  PYTHONPATH=. python scripts/train_demo_models.py \
      --models=draft_tiny,draft_small,target --workdir=runs/train_demo

``--smoke`` trains micro models on a few hundred pairs in well under a minute
and writes everything (vocabulary and exports included) under ``--workdir``.
``--benchmark`` only times one cached single-token decode step per model;
``--report`` evaluates the exports (first model named = target) on the test
split and writes ``<export_dir>/report.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import sentencepiece as spm

from specdec_jax.models.t5 import T5Config, T5Model, count_params, shift_right

PREFIX = "modernize: "
MAX_LEN = 128
# Sequence-length buckets: few distinct shapes keeps XLA compile time low on CPU.
BUCKETS = (24, 32, 48, 64, 96, 128)

# Architectures (T5 1.1). Drafts are sized so that one cached decode step is
# >= 10x cheaper than the target's (measured with --benchmark; see README).
MODELS: dict[str, dict[str, Any]] = {
    "target": dict(d_model=320, num_heads=5, head_dim=64, num_encoder_layers=4,
                   num_decoder_layers=4, d_ff=1024),
    # One head each: at batch 1 on CPU a decode step is mostly per-op overhead,
    # and extra heads cost more than width.
    "draft_small": dict(d_model=96, num_heads=1, head_dim=64, num_encoder_layers=2,
                        num_decoder_layers=1, d_ff=256),
    "draft_tiny": dict(d_model=64, num_heads=1, head_dim=64, num_encoder_layers=1,
                       num_decoder_layers=1, d_ff=192),
}
SMOKE_MODELS: dict[str, dict[str, Any]] = {
    "smoke_target": dict(d_model=32, num_heads=2, head_dim=16, num_encoder_layers=1,
                         num_decoder_layers=1, d_ff=64),
    "smoke_draft": dict(d_model=16, num_heads=1, head_dim=16, num_encoder_layers=1,
                        num_decoder_layers=1, d_ff=32),
}
# Peak learning rates: smaller models tolerate (and need) larger steps. With
# Adam and T5's unscaled attention logits the 8-layer target stalled at
# val CE ~4.9 for 1000 steps at 1.5e-3, so it gets 5e-4.
PEAK_LR = {"target": 5e-4, "draft_small": 2e-3, "draft_tiny": 3e-3}


# ---------------------------------------------------------------- data


def read_tsv(path: str, limit: Optional[int] = None) -> list[tuple[str, str, str]]:
  """Rows (id, input, reference) of a split file, header skipped."""
  rows = []
  with open(path, encoding="utf-8") as f:
    next(f)
    for line in f:
      vid, src, ref = line.rstrip("\n").split("\t")
      rows.append((vid, src, ref))
      if limit is not None and len(rows) >= limit:
        break
  return rows


def train_spm(train_tsv: str, model_prefix: str, vocab_size: int,
              limit: Optional[int] = None) -> None:
  """Unigram SentencePiece with T5's special ids; deterministic (single thread)."""
  rows = read_tsv(train_tsv, limit)
  text_path = model_prefix + ".train.txt"
  with open(text_path, "w", encoding="utf-8") as f:
    for _, src, ref in rows:
      f.write(PREFIX + src + "\n" + ref + "\n")
  spm.SentencePieceTrainer.train(
      input=text_path, model_prefix=model_prefix, vocab_size=vocab_size,
      model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
      character_coverage=1.0, num_threads=1, shuffle_input_sentence=False,
      seed_sentencepiece_size=200000, minloglevel=2)
  os.remove(text_path)


def encode_pairs(sp: spm.SentencePieceProcessor, rows: list[tuple[str, str, str]],
                 max_len: int = MAX_LEN) -> tuple[list[tuple[list[int], list[int]]], int]:
  """Token ids (+EOS) for inputs and targets; drops pairs longer than max_len."""
  srcs = sp.encode([PREFIX + r[1] for r in rows])
  refs = sp.encode([r[2] for r in rows])
  eos = sp.eos_id()
  pairs, dropped = [], 0
  for s, t in zip(srcs, refs):
    s, t = s + [eos], t + [eos]
    if len(s) > max_len or len(t) > max_len:
      dropped += 1
      continue
    pairs.append((s, t))
  return pairs, dropped


def bucket_len(n: int) -> int:
  return next(b for b in BUCKETS if n <= b)


def make_batches(pairs: list[tuple[list[int], list[int]]], batch_tokens: int,
                 rng: np.random.Generator) -> list[list[int]]:
  """Index batches of similar length, each padded size <= batch_tokens; shuffled."""
  by_bucket: dict[int, list[int]] = {}
  for i in rng.permutation(len(pairs)):
    s, t = pairs[i]
    by_bucket.setdefault(bucket_len(max(len(s), len(t))), []).append(int(i))
  batches = []
  for length, idx in sorted(by_bucket.items()):
    bs = max(1, batch_tokens // length)
    batches += [idx[j:j + bs] for j in range(0, len(idx), bs)]
  order = rng.permutation(len(batches))
  return [batches[k] for k in order]


def pad_batch(pairs: list[tuple[list[int], list[int]]], idx: list[int],
              batch_tokens: int) -> tuple[np.ndarray, np.ndarray]:
  """[B, L] inputs and targets, zero (pad) filled; B fixed per bucket length."""
  length = bucket_len(max(max(len(pairs[i][0]), len(pairs[i][1])) for i in idx))
  bs = max(1, batch_tokens // length)
  inputs = np.zeros((bs, length), np.int32)
  targets = np.zeros((bs, length), np.int32)
  for r, i in enumerate(idx):
    s, t = pairs[i]
    inputs[r, :len(s)] = s
    targets[r, :len(t)] = t
  return inputs, targets


def batch_stream(pairs, batch_tokens: int, seed: int, start_step: int
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Infinite deterministic stream; step n is the same batch whenever resumed."""
  step, epoch = 0, 0
  while True:
    batches = make_batches(pairs, batch_tokens, np.random.default_rng([seed, epoch]))
    for idx in batches:
      if step >= start_step:
        yield pad_batch(pairs, idx, batch_tokens)
      step += 1
    epoch += 1


# ---------------------------------------------------------------- training


def loss_sums(model: T5Model, params, inputs, targets) -> tuple[jax.Array, jax.Array]:
  """Summed token cross-entropy over non-pad targets, and the token count."""
  logits = model(params, inputs, shift_right(targets, model.config.decoder_start_id))
  mask = (targets != model.config.pad_id).astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(ce * mask), jnp.sum(mask)


def make_optimizer(peak_lr: float, total_steps: int,
                   schedule_start: int = 0) -> optax.GradientTransformation:
  """AdamW with warmup + cosine decay over [schedule_start, total_steps].

  schedule_start > 0 continues a finished run with a fresh schedule (a warm
  restart): the optimizer's restored step count is shifted by it.
  """
  span = total_steps - schedule_start
  warmup = max(1, min(500, span // 10))
  base = optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, span,
                                            end_value=peak_lr * 0.05)
  sched = lambda count: base(jnp.maximum(count - schedule_start, 0))
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=0.01))


def make_train_step(model: T5Model, opt: optax.GradientTransformation):
  def step(params, opt_state, inputs, targets):
    def mean_loss(p):
      total, n = loss_sums(model, p, inputs, targets)
      return total / jnp.maximum(n, 1.0)
    loss, grads = jax.value_and_grad(mean_loss)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return jax.jit(step, donate_argnums=(0, 1))


def evaluate(eval_fn, params, batches) -> float:
  """Token-weighted mean cross-entropy over fixed held-out batches."""
  total, count = 0.0, 0.0
  for inputs, targets in batches:
    s, n = eval_fn(params, inputs, targets)
    total += float(s)
    count += float(n)
  return total / max(count, 1.0)


def read_log(path: str, upto_step: int) -> list[dict]:
  """Log records up to the resumed step (later ones are redone after a restart)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    recs = [json.loads(line) for line in f if line.strip()]
  return [r for r in recs if r["step"] <= upto_step]


def train_model(name: str, cfg: T5Config, train_pairs, val_pairs, args) -> dict:
  """Train (or resume) one model; returns its params and loss curves."""
  model = T5Model(cfg)
  run_dir = os.path.abspath(os.path.join(args.workdir, name))
  os.makedirs(run_dir, exist_ok=True)
  total_steps = args.steps[name]
  opt = make_optimizer(args.lr.get(name, 1e-3), total_steps,
                       args.schedule_start.get(name, 0))
  params = model.init(jax.random.PRNGKey(args.seed))
  opt_state = opt.init(params)
  print(f"[{name}] params={count_params(params):,} steps={total_steps}", flush=True)

  mngr = ocp.CheckpointManager(os.path.join(run_dir, "ckpt"),
                               options=ocp.CheckpointManagerOptions(max_to_keep=2))
  step = 0
  elapsed_before = 0.0
  if mngr.latest_step() is not None:
    state = {"params": params, "opt_state": opt_state, "elapsed": np.zeros((), np.float64)}
    restored = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(state))
    params, opt_state = restored["params"], restored["opt_state"]
    step = int(mngr.latest_step())
    elapsed_before = float(restored["elapsed"])
    print(f"[{name}] resumed at step {step}", flush=True)

  log_path = os.path.join(run_dir, "log.jsonl")
  log = read_log(log_path, step)
  with open(log_path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in log)

  train_step = make_train_step(model, opt)
  eval_fn = jax.jit(functools.partial(loss_sums, model))
  val_batches = [pad_batch(val_pairs, idx, args.batch_tokens)
                 for idx in make_batches(val_pairs, args.batch_tokens,
                                         np.random.default_rng(0))]
  stream = batch_stream(train_pairs, args.batch_tokens, args.seed, step)
  t0 = time.time()
  last_save = t0
  window: list[float] = []

  def save(at_step: int) -> None:
    state = {"params": params, "opt_state": opt_state,
             "elapsed": np.asarray(elapsed_before + time.time() - t0, np.float64)}
    mngr.save(at_step, args=ocp.args.StandardSave(state), force=True)
    mngr.wait_until_finished()

  while step < total_steps:
    inputs, targets = next(stream)
    params, opt_state, loss = train_step(params, opt_state, inputs, targets)
    step += 1
    window.append(float(loss))
    done = step >= total_steps
    over_time = name in args.minutes and (time.time() - t0) > 60 * args.minutes[name]
    if step % args.eval_every == 0 or done or over_time:
      rec = {"step": step, "train_loss": float(np.mean(window)),
             "val_loss": evaluate(eval_fn, params, val_batches),
             "wall_s": round(elapsed_before + time.time() - t0, 1)}
      window = []
      log.append(rec)
      with open(log_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
      print(f"[{name}] {json.dumps(rec)}", flush=True)
    if time.time() - last_save > 60 * args.ckpt_minutes or done or over_time:
      save(step)
      last_save = time.time()
    if over_time:
      print(f"[{name}] stopping at step {step}: {args.minutes[name]} minutes reached", flush=True)
      break
  mngr.close()
  return {"params": params, "log": log, "steps": step,
          "wall_s": round(elapsed_before + time.time() - t0, 1)}


# ---------------------------------------------------------------- export / timing


def export(name: str, cfg: T5Config, result: dict, export_dir: str, meta: dict) -> str:
  """bfloat16 checkpoint via the project's format, plus the small loss log."""
  out = os.path.join(export_dir, name)
  try:
    from specdec_jax.checkpoints import save_checkpoint
  except ImportError:  # another module not landed yet: keep an orbax copy in the workdir
    save_checkpoint = None
  if save_checkpoint is not None:
    save_checkpoint(out, result["params"], cfg, dtype="bfloat16", overwrite=True)
  else:
    fallback = os.path.abspath(os.path.join(meta["workdir"], name, "final_params"))
    ocp.StandardCheckpointer().save(fallback, result["params"], force=True)
    print(f"[{name}] specdec_jax.checkpoints missing; params saved to {fallback}")
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "train_log.json"), "w") as f:
    json.dump({"name": name, "config": cfg.__dict__, "params": count_params(result["params"]),
               "steps": result["steps"], "wall_s": result["wall_s"], **meta,
               "log": result["log"]}, f, indent=1)
  return out


def time_decode_step(cfg: T5Config, batch: int = 1, src_len: int = 64,
                     cache_len: int = 128, reps: int = 200) -> float:
  """Median seconds of one jitted single-token cached decode step (random params)."""
  model = T5Model(cfg)
  params = model.init(jax.random.PRNGKey(0))
  inputs = jnp.ones((batch, src_len), jnp.int32)
  cache = model.init_cache(params, model.encode(params, inputs), inputs, cache_len)
  step = jax.jit(model.decode)
  tokens = jnp.ones((batch, 1), jnp.int32)
  pos = jnp.full((batch, 1), 40, jnp.int32)
  jax.block_until_ready(step(params, tokens, pos, cache))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(step(params, tokens, pos, cache))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


# ---------------------------------------------------------------- report


def greedy_decode(model: T5Model, params, inputs: np.ndarray, max_len: int = MAX_LEN
                  ) -> list[list[int]]:
  """Cached greedy decoding of a batch; each row stops at EOS (EOS excluded)."""
  cfg = model.config
  x = jnp.asarray(inputs)
  cache = model.init_cache(params, model.encode(params, x), x, max_len)
  step = jax.jit(model.decode)
  b = inputs.shape[0]
  tokens = jnp.full((b, 1), cfg.decoder_start_id, jnp.int32)
  out = np.zeros((b, max_len), np.int32)
  done = np.zeros(b, bool)
  for t in range(max_len):
    logits, cache = step(params, tokens, jnp.full((b, 1), t, jnp.int32), cache)
    nxt = np.asarray(jnp.argmax(logits[:, -1], -1))
    out[:, t] = np.where(done, cfg.pad_id, nxt)
    done |= nxt == cfg.eos_id
    if done.all():
      break
    tokens = jnp.asarray(nxt[:, None], jnp.int32)
  rows = []
  for r in out.tolist():
    rows.append(r[:r.index(cfg.eos_id)] if cfg.eos_id in r else [t for t in r if t])
  return rows


def teacher_forced_stats(models: dict, params: dict, batches, target: str) -> dict:
  """Per model on reference prefixes: token CE, and per draft its agreement with
  the target: greedy (argmax match) and sum_x min(p, q) (the expected
  acceptance of one drafted token at temperature 1)."""
  @functools.partial(jax.jit, static_argnums=(0,))
  def logits_fn(model, p, inputs, targets):
    return model(p, inputs, shift_right(targets, model.config.decoder_start_id))

  sums: dict[str, float] = {}
  n_tok = 0.0
  for inputs, targets in batches:
    mask = np.asarray(targets != 0, np.float32)
    n_tok += float(mask.sum())
    logp = {n: jax.nn.log_softmax(logits_fn(models[n], params[n], inputs, targets))
            for n in models}
    for n, lp in logp.items():
      ce = -jnp.take_along_axis(lp, jnp.asarray(targets)[..., None], -1)[..., 0]
      sums[f"{n}/ce"] = sums.get(f"{n}/ce", 0.0) + float((ce * mask).sum())
      if n == target:
        continue
      agree = jnp.argmax(lp, -1) == jnp.argmax(logp[target], -1)
      overlap = jnp.sum(jnp.minimum(jnp.exp(lp), jnp.exp(logp[target])), -1)
      sums[f"{n}/greedy_agreement"] = sums.get(f"{n}/greedy_agreement", 0.0) + float(
          (agree * mask).sum())
      sums[f"{n}/sampling_acceptance_t1"] = sums.get(
          f"{n}/sampling_acceptance_t1", 0.0) + float((overlap * mask).sum())
  return {k: v / n_tok for k, v in sums.items()}


def report(args, names: list[str], sp: spm.SentencePieceProcessor) -> dict:
  """Test-split stats, decode-step timings and greedy samples of the exports."""
  from specdec_jax.checkpoints import load_checkpoint
  params, models = {}, {}
  for n in names:
    params[n], cfg = load_checkpoint(os.path.join(args.export_dir, n))
    models[n] = T5Model(cfg)
  test_rows = read_tsv(os.path.join(args.data_dir, "test.tsv"))
  test_pairs, _ = encode_pairs(sp, test_rows)
  batches = [pad_batch(test_pairs, idx, args.batch_tokens)
             for idx in make_batches(test_pairs, args.batch_tokens, np.random.default_rng(0))]
  out: dict[str, Any] = {"test_pairs": len(test_pairs)}
  out["teacher_forced_test"] = teacher_forced_stats(models, params, batches, names[0])
  # Interleave repeats so load from other processes hits every model alike.
  times: dict[str, list[float]] = {n: [] for n in names}
  for _ in range(3):
    for n in names:
      times[n].append(time_decode_step(models[n].config))
  ms = {n: 1e3 * float(np.median(t)) for n, t in times.items()}
  out["decode_step_ms_b1"] = ms
  out["decode_step_ratio_vs_target"] = {n: ms[names[0]] / ms[n] for n in names}
  out["params"] = {n: count_params(params[n]) for n in names}
  samples = []
  picks = list(range(0, len(test_rows), max(1, len(test_rows) // args.num_samples)))
  picks = picks[:args.num_samples]
  inputs = np.zeros((len(picks), MAX_LEN), np.int32)
  for r, i in enumerate(picks):
    ids = sp.encode(PREFIX + test_rows[i][1]) + [sp.eos_id()]
    inputs[r, :len(ids)] = ids[:MAX_LEN]
  decoded = {n: greedy_decode(models[n], params[n], inputs) for n in names}
  for r, i in enumerate(picks):
    samples.append({"id": test_rows[i][0], "input": test_rows[i][1],
                    "reference": test_rows[i][2],
                    **{n: sp.decode(decoded[n][r]) for n in names}})
  out["greedy_samples"] = samples
  return out


# ---------------------------------------------------------------- main


def parse_per_model(spec: str, kind) -> dict:
  """'name=v,...' -> {name: v}; a bare 'v' applies to every model."""
  if "=" not in spec:
    return {m: kind(spec) for m in list(MODELS) + list(SMOKE_MODELS)}
  return {k: kind(v) for k, v in (kv.split("=") for kv in spec.split(","))}


def parse_args(argv: list[str]) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", default="draft_tiny,draft_small,target")
  ap.add_argument("--steps", default="target=3400,draft_small=3000,draft_tiny=3000",
                  help="name=steps,... (also sets the LR schedule length)")
  ap.add_argument("--minutes", default=None,
                  help="wall-clock cap per model, 'M' or 'name=M,...'; stops early and "
                       "exports (the LR schedule is not shortened)")
  ap.add_argument("--workdir", default="runs/train_demo")
  ap.add_argument("--export_dir", default="checkpoints/demo")
  ap.add_argument("--data_dir", default="data/bible")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--batch_tokens", type=int, default=1024,
                  help="padded tokens per batch on each side (B = batch_tokens // L)")
  ap.add_argument("--eval_every", type=int, default=250)
  ap.add_argument("--ckpt_minutes", type=float, default=3.0)
  ap.add_argument("--vocab_size", type=int, default=8000)
  ap.add_argument("--max_len", type=int, default=MAX_LEN,
                  help="drop pairs with more tokens than this on either side")
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--benchmark", action="store_true")
  ap.add_argument("--report", action="store_true",
                  help="evaluate the exports (first model = target) and write report.json")
  ap.add_argument("--num_samples", type=int, default=8)
  ap.add_argument("--lr", default=None, help="peak LR overrides, 'name=LR,...'")
  ap.add_argument("--schedule_start", default=None,
                  help="'name=STEP,...': restart the LR schedule at STEP (continue a run)")
  args = ap.parse_args(argv)
  if args.smoke:
    args.models = ",".join(SMOKE_MODELS)
    args.steps = ",".join(f"{m}=40" for m in SMOKE_MODELS)
    args.export_dir = os.path.join(args.workdir, "export")
    args.vocab_size = 400
    args.batch_tokens = 512
    args.eval_every = 10
    args.max_len = 32  # only the two shortest buckets: fewer XLA compiles
  args.steps = parse_per_model(args.steps, int)
  args.minutes = parse_per_model(args.minutes, float) if args.minutes else {}
  overrides = parse_per_model(args.lr, float) if args.lr else {}
  args.lr = dict(PEAK_LR, **{m: 3e-3 for m in SMOKE_MODELS}, **overrides)
  args.schedule_start = (parse_per_model(args.schedule_start, int)
                         if args.schedule_start else {})
  return args


def main(argv: list[str]) -> None:
  args = parse_args(argv)
  archs = SMOKE_MODELS if args.smoke else MODELS
  names = args.models.split(",")
  spm_dir = args.export_dir
  os.makedirs(spm_dir, exist_ok=True)
  spm_path = os.path.join(spm_dir, "spm.model")
  limit = 600 if args.smoke else None
  if not os.path.exists(spm_path):
    train_spm(os.path.join(args.data_dir, "train.tsv"), spm_path[:-len(".model")],
              args.vocab_size, limit)
  sp = spm.SentencePieceProcessor(model_file=spm_path)
  vocab = sp.get_piece_size()
  cfgs = {n: T5Config(vocab_size=vocab, version="1.1", **archs[n]) for n in names}

  if args.benchmark:
    times = {n: time_decode_step(cfgs[n]) for n in names}
    for n in names:
      print(json.dumps({"model": n, "params": count_params(
          T5Model(cfgs[n]).init(jax.random.PRNGKey(0))), "decode_step_ms": times[n] * 1e3,
          "ratio_vs_first": times[names[0]] / times[n]}))
    return
  if args.report:
    result = report(args, names, sp)
    with open(os.path.join(args.export_dir, "report.json"), "w") as f:
      json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "greedy_samples"}, indent=1))
    for s in result["greedy_samples"][:3]:
      print(json.dumps(s, indent=1))
    return

  train_rows = read_tsv(os.path.join(args.data_dir, "train.tsv"), limit)
  val_rows = read_tsv(os.path.join(args.data_dir, "validation.tsv"),
                      300 if args.smoke else None)
  train_pairs, dropped = encode_pairs(sp, train_rows, args.max_len)
  val_pairs, val_dropped = encode_pairs(sp, val_rows, args.max_len)
  print(f"vocab={vocab} train pairs={len(train_pairs)} (dropped {dropped} > {args.max_len} "
        f"tokens) validation pairs={len(val_pairs)} (dropped {val_dropped})", flush=True)
  meta = {"seed": args.seed, "batch_tokens": args.batch_tokens, "workdir": args.workdir,
          "train_pairs": len(train_pairs), "train_dropped_too_long": dropped,
          "command": " ".join(["scripts/train_demo_models.py"] + argv)}
  for n in names:
    result = train_model(n, cfgs[n], train_pairs, val_pairs, args)
    out = export(n, cfgs[n], result, args.export_dir, meta)
    print(f"[{n}] exported to {out} after {result['wall_s']} s", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
