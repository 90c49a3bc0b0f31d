"""Train the demo T5 target/draft pair on KJV -> WEB verse modernization.

Steps: (1) a SentencePiece unigram vocabulary on the train split (T5 ids: pad 0,
eos 1, unk 2, no bos), written if missing, (2) each requested model trained by
``specdec_jax.training.fit`` (Adafactor, T5X's recipe, by default; dropout 0.1
for the target) on teacher-forced cross-entropy, logging train/validation loss
and checkpointing with orbax so a restarted run resumes, (3) export to
``<export_dir>/<name>/`` with ``specdec_jax.checkpoints.save_checkpoint``
(bfloat16). The demo's drafts are then distilled from the target with
``scripts/distill_draft.py`` (see checkpoints/demo/README.md).

  python scripts/train_demo_models.py --models=target \
      --minutes=target=50 --workdir=runs/target --export_dir=runs/exp_target

--data_dir (and --spm) are looked for in the working directory, then in the
repository root, as the runner does; --workdir and --export_dir are relative to
the working directory (from the repository root, the default --export_dir is the
shipped checkpoints/demo).

``--smoke`` trains micro models on a few hundred pairs in well under a minute
and writes everything (vocabulary and exports included) under ``--workdir``.
``--benchmark`` only times one cached single-token decode step per model;
``--report`` evaluates the exports (first model named = target) on the test
split and writes ``<export_dir>/report.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any, Optional

import jax
import sentencepiece as spm

from lab.common import bridges_in, count_params
from specdec_jax import training
from specdec_jax.checkpoints import save_checkpoint
from specdec_jax.models.t5 import T5Config, T5Model
from specdec_jax.scripting import script_args

PREFIX = "modernize: "
MAX_LEN = 128

# Architectures (T5 1.1). Drafts are sized so that one cached decode step is
# >= 10x cheaper than the target's (measured with --benchmark; see README).
MODELS: dict[str, dict[str, Any]] = {
    # Deeper decoder than encoder: decode-step cost (what c compares) is set by
    # the decoder, training cost by both.
    "target": dict(d_model=256, num_heads=4, head_dim=64, num_encoder_layers=3,
                   num_decoder_layers=5, d_ff=1024),
    # One head each: at batch 1 on CPU a decode step is mostly per-op overhead,
    # and extra heads cost more than width. The shipped drafts were trained at
    # one encoder (and, for draft_small, one decoder) layer fewer and then
    # deepened by distill_draft.py --grow_*_layers; these are their final shapes.
    "draft_small": dict(d_model=96, num_heads=1, head_dim=64, num_encoder_layers=3,
                        num_decoder_layers=2, d_ff=256),
    "draft_tiny": dict(d_model=64, num_heads=1, head_dim=64, num_encoder_layers=2,
                       num_decoder_layers=1, d_ff=192),
}
SMOKE_MODELS: dict[str, dict[str, Any]] = {
    "smoke_target": dict(d_model=32, num_heads=2, head_dim=16, num_encoder_layers=1,
                         num_decoder_layers=1, d_ff=64),
    "smoke_draft": dict(d_model=16, num_heads=1, head_dim=16, num_encoder_layers=1,
                        num_decoder_layers=1, d_ff=32),
}
# Peak learning rates for Adafactor (T5X's recipe: steps relative to each
# parameter's scale, so one rate suits all sizes). The drafts shipped before
# distillation were trained with --optimizer=adamw at 2e-3 / 3e-3.
PEAK_LR = {"target": 1e-2, "draft_small": 1e-2, "draft_tiny": 1e-2}
# Dropout while training (T5 fine-tuning uses 0.1).
DROPOUT = {"target": 0.1}


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


def train_model(name: str, cfg: T5Config, train_pairs, val_pairs, args) -> training.FitResult:
  """Train (or resume) one model with the library loop; returns params and curves."""
  from lab.evaluate import mean_ce
  model = T5Model(cfg)
  params = model.init(jax.random.PRNGKey(args.seed))
  if name in args.init_from:  # warm start (e.g. continue an exported model)
    from specdec_jax.checkpoints import load_checkpoint
    params, _ = load_checkpoint(args.init_from[name], config=cfg.replace(dropout_rate=0.0))
  print(f"[{name}] params={count_params(params):,} steps={args.steps[name]} "
        f"optimizer={args.optimizer}", flush=True)
  opt_cfg = training.OptimizerConfig(
      name=args.optimizer, peak_lr=args.lr[name], total_steps=args.steps[name],
      schedule_start=args.schedule_start.get(name, 0))
  val_ce = mean_ce(model, training.fixed_batches(val_pairs, args.batch_tokens))
  return training.fit(
      training.ce_loss(model), params,
      lambda start: training.batch_stream(train_pairs, args.batch_tokens, args.seed, start),
      opt_cfg, os.path.join(args.workdir, name),
      evaluate=lambda p: {"val_loss": val_ce(p)}, eval_every=args.eval_every,
      ckpt_minutes=args.ckpt_minutes, max_minutes=args.minutes.get(name), name=name,
      seed=args.seed,
      log_fn=lambda m: print(m, flush=True))


# ---------------------------------------------------------------- export / timing


def export(name: str, cfg: T5Config, result: dict, export_dir: str, meta: dict) -> str:
  """bfloat16 checkpoint via the project's format, plus the small loss log."""
  out = os.path.join(export_dir, name)
  cfg = cfg.replace(dropout_rate=0.0)  # the exported model is for inference
  save_checkpoint(out, result.params, cfg, dtype="bfloat16", overwrite=True)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "train_log.json"), "w") as f:
    json.dump({"name": name, "config": cfg.__dict__, "params": count_params(result.params),
               "steps": result.steps, "wall_s": result.wall_s, **meta,
               "log": result.log}, f, indent=1)
  return out


# ---------------------------------------------------------------- report


def report(args, names: list[str], sp: spm.SentencePieceProcessor) -> dict:
  """Test-split quality, draft agreement, step costs and greedy samples of the
  exports (first name = target); see ``lab.evaluate``."""
  from specdec_jax.checkpoints import load_checkpoint
  from lab.evaluate import evaluate_models
  models = {}
  for n in names:
    if bridges_in(os.path.join(args.export_dir, n)):
      raise ValueError(f"{os.path.join(args.export_dir, n)} has a bridge to the target, which "
                       "the report does not run; measure its α with scripts/demo_alpha_table.sh")
    params, cfg = load_checkpoint(os.path.join(args.export_dir, n))
    models[n] = (T5Model(cfg), params)
  rows = read_tsv(os.path.join(args.data_dir, "test.tsv"))
  pairs, dropped = encode_pairs(sp, rows)
  assert not dropped, "test pairs longer than MAX_LEN"
  out = evaluate_models(models, names[0], pairs, sp.decode, [r[2] for r in rows],
                        max_decode_len=MAX_LEN, batch_tokens=args.batch_tokens)
  picks = list(range(0, len(rows), max(1, len(rows) // args.num_samples)))[:args.num_samples]
  out["greedy_samples"] = [
      {"id": rows[i][0], "input": rows[i][1], "reference": rows[i][2],
       **{n: out[n]["_texts"][i] for n in names}} for i in picks]
  for n in names:
    del out[n]["_texts"]
  return out


# ---------------------------------------------------------------- main


def _copy_vocabulary(src: str, export_dir: str) -> None:
  """Copy ``src`` (and its .vocab, if present) to ``export_dir``/spm.*."""
  if not os.path.exists(src):
    raise FileNotFoundError(f"--spm {src}: no such SentencePiece model")
  dst = os.path.join(export_dir, "spm.model")
  if os.path.abspath(src) != os.path.abspath(dst):
    shutil.copyfile(src, dst)
    vocab = src[:-len(".model")] + ".vocab" if src.endswith(".model") else None
    if vocab and os.path.exists(vocab):
      shutil.copyfile(vocab, os.path.join(export_dir, "spm.vocab"))


def _refuse_new_vocabulary(args: argparse.Namespace, names: list[str], spm_path: str) -> None:
  """A model that resumes or warm-starts was trained with some vocabulary: a
  fresh one would silently re-map every token id, so that is an error."""
  if args.report:
    raise FileNotFoundError(f"{spm_path} is missing: --report needs the "
                            "vocabulary the exports were trained with")
  for n in names:
    ckpt = os.path.join(args.workdir, n, "ckpt")
    if n in args.init_from or (os.path.isdir(ckpt) and os.listdir(ckpt)):
      raise FileNotFoundError(
          f"{spm_path} is missing, but model {n!r} continues earlier training "
          f"({args.init_from.get(n) or ckpt}): pass --spm=<the spm.model it was trained "
          "with> instead of training a new vocabulary")


def parse_per_model(spec: str, kind) -> dict:
  """'name=v,...' -> {name: v}; a bare 'v' applies to every model."""
  if "=" not in spec:
    return {m: kind(spec) for m in list(MODELS) + list(SMOKE_MODELS)}
  return {k: kind(v) for k, v in (kv.split("=") for kv in spec.split(","))}


def parse_args(argv: list[str]) -> argparse.Namespace:
  ap = script_args.new_parser(__doc__)
  ap.add_argument("--models", default="draft_tiny,draft_small,target")
  ap.add_argument("--steps", default="target=1100,draft_small=3000,draft_tiny=3000",
                  help="name=steps,... (also sets the LR schedule length)")
  ap.add_argument("--minutes", default=None,
                  help="wall-clock cap per model, 'M' or 'name=M,...'; stops early and "
                       "exports (the LR schedule is not shortened)")
  ap.add_argument("--workdir", default="runs/train_demo")
  ap.add_argument("--export_dir", default="checkpoints/demo")
  ap.add_argument("--data_dir", default="data/bible",
                  help="train.tsv, validation.tsv and test.tsv (scripts/prepare_bible.py)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--optimizer", default="adafactor", choices=("adafactor", "adamw"),
                  help="adafactor: T5X's recipe (factored, parameter-scale-relative steps)")
  ap.add_argument("--batch_tokens", type=int, default=3072,
                  help="padded tokens per batch on each side (B = batch_tokens // L)")
  ap.add_argument("--eval_every", type=int, default=250)
  ap.add_argument("--ckpt_minutes", type=float, default=3.0)
  ap.add_argument("--vocab_size", type=int, default=8000)
  ap.add_argument("--spm", default=None,
                  help="an existing SentencePiece model to use (copied into --export_dir); "
                       "default: <export_dir>/spm.model, trained there if missing")
  ap.add_argument("--max_len", type=int, default=MAX_LEN,
                  help="drop pairs with more tokens than this on either side")
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--benchmark", action="store_true")
  ap.add_argument("--report", action="store_true",
                  help="evaluate the exports (first model = target) and write report.json")
  ap.add_argument("--num_samples", type=int, default=8)
  ap.add_argument("--lr", default=None, help="peak LR overrides, 'name=LR,...'")
  ap.add_argument("--dropout", default=None,
                  help="'name=RATE,...' or 'RATE': dropout while training (T5 uses 0.1)")
  ap.add_argument("--init_from", default=None,
                  help="'name=CHECKPOINT,...': start from these weights instead of random")
  ap.add_argument("--schedule_start", default=None,
                  help="'name=STEP,...': restart the LR schedule at STEP (continue a run)")
  ap.add_argument("--oversample_long", default=None,
                  help="'MIN_TOKENS:TIMES': repeat training pairs whose longer side has "
                       ">= MIN_TOKENS tokens TIMES times in all (training.oversample_long)")
  args = script_args.parse(ap, argv, paths=("data_dir", "spm"))
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
  args.dropout = dict(DROPOUT, **(parse_per_model(args.dropout, float) if args.dropout else {}))
  args.init_from = (dict(kv.split("=", 1) for kv in args.init_from.split(","))
                    if args.init_from else {})
  args.schedule_start = (parse_per_model(args.schedule_start, int)
                         if args.schedule_start else {})
  if args.oversample_long:  # checked here, before any file is read or written
    raw = args.oversample_long
    try:
      args.oversample_long = tuple(int(v) for v in raw.split(":"))
      if len(args.oversample_long) != 2 or min(args.oversample_long) < 1:
        raise ValueError
    except ValueError:
      ap.error(f"--oversample_long={raw!r}: expected MIN_TOKENS:TIMES, two integers >= 1, "
               "e.g. 60:8")
  return args


def main(argv: list[str]) -> None:
  args = parse_args(argv)
  archs = SMOKE_MODELS if args.smoke else MODELS
  names = args.models.split(",")
  spm_dir = args.export_dir
  os.makedirs(spm_dir, exist_ok=True)
  spm_path = os.path.join(spm_dir, "spm.model")
  limit = 600 if args.smoke else None
  if args.spm:
    _copy_vocabulary(args.spm, spm_dir)
  elif not os.path.exists(spm_path):
    _refuse_new_vocabulary(args, names, spm_path)
    train_spm(os.path.join(args.data_dir, "train.tsv"), spm_path[:-len(".model")],
              args.vocab_size, limit)
  sp = spm.SentencePieceProcessor(model_file=spm_path)
  vocab = sp.get_piece_size()
  cfgs = {n: T5Config(vocab_size=vocab, version="1.1", dropout_rate=args.dropout.get(n, 0.0),
                      **archs[n]) for n in names}

  if args.benchmark:
    from lab.evaluate import decode_step_ms
    models = {n: (T5Model(cfgs[n]), T5Model(cfgs[n]).init(jax.random.PRNGKey(0)))
              for n in names}
    ms = decode_step_ms(models)
    for n in names:
      print(json.dumps({"model": n, "params": count_params(models[n][1]),
                        "decode_step_ms": ms[n], "ratio_vs_first": ms[names[0]] / ms[n]}))
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
  if args.oversample_long:
    min_tokens, times = args.oversample_long
    n = len(train_pairs)
    train_pairs = training.oversample_long(train_pairs, min_tokens, times)
    print(f"oversampled pairs of >= {min_tokens} tokens x{times}: {n} -> {len(train_pairs)}",
          flush=True)
  print(f"vocab={vocab} train pairs={len(train_pairs)} (dropped {dropped} > {args.max_len} "
        f"tokens) validation pairs={len(val_pairs)} (dropped {val_dropped})", flush=True)
  meta = {"seed": args.seed, "batch_tokens": args.batch_tokens, "workdir": args.workdir,
          "train_pairs": len(train_pairs), "train_dropped_too_long": dropped,
          "command": " ".join(["scripts/train_demo_models.py"] + argv)}
  for n in names:
    result = train_model(n, cfgs[n], train_pairs, val_pairs, args)
    out = export(n, cfgs[n], result, args.export_dir, meta)
    print(f"[{n}] exported to {out} after {result.wall_s} s", flush=True)
