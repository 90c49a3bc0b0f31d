r"""Experiment runner: speculative decoding vs the plain baseline (paper §4).

  python -m specdec_jax.run --config=configs/demo.gin [--config=more.gin] \
      [--gin_bindings='Experiment.gamma = 5'] [--workdir=runs/x] [--resume] \
      [--alpha_only]

Everything an experiment varies is a binding of ``Experiment`` (see its
docstring). Measurement protocol (README "Measurement protocol"):

* the first ``num_warmup`` examples compile and warm both loops, untimed;
* each timed batch is decoded by the baseline and by speculative decoding with
  the same inputs, max length, sampling settings and key, each call ending in
  ``block_until_ready``;
* c and v are measured once, up front, with the same jitted pieces;
* per example, one line of ``examples.jsonl`` (appended and flushed as it
  completes); ``summary.json`` is recomputed from all lines, so every number
  it holds can be recomputed from ``examples.jsonl``.

``--alpha_only`` (paper §4.2, Table 3) generates with the target alone and
averages sum_x min(p, q) along the generated tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from specdec_jax import checkpoints, data, drafts, theory
from specdec_jax.decoding import alpha_estimates, speculative_decode, temperature_sample
from specdec_jax.models.t5 import T5Model, get_config, shift_right
from specdec_jax.sampling import SamplingConfig, standardize
from specdec_jax.timing import block, measure_costs, timed

REPO_ROOT = Path(__file__).resolve().parent.parent


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Experiment:
  """One experiment. Every field is a gin binding (``Experiment.<field>``).

  Models: a checkpoint path + format ('auto', 'specdec', 't5x', 't5x_orbax',
  'hf') + preset (required for T5X formats, e.g. 't5_1_1_xxl'); the draft is an
  approximation model by name ('t5', 'unigram', 'bigram', 'prompt_lookup').
  unigram/bigram are estimated from ``ngram_corpus`` (a source like
  ``source``; its references are the corpus).
  """

  task: str = "bible_modernize"
  source: str = "data/bible/test.tsv"         # local .tsv/.jsonl or 'seqio:<task>'
  split: str = "test"                        # for seqio sources
  tfds_data_dir: Optional[str] = None
  prefix: Optional[str] = None               # default: data.PREFIXES[task]
  vocab_path: str = "checkpoints/demo/spm.model"
  vocab_extra_ids: int = 0
  target_checkpoint: str = ""
  target_format: str = "auto"
  target_preset: Optional[str] = None
  target_label: Optional[str] = None         # name in tables; default: path basename
  draft_name: str = "t5"
  draft_checkpoint: str = ""
  draft_format: str = "auto"
  draft_preset: Optional[str] = None
  draft_label: Optional[str] = None
  ngram_corpus: Optional[str] = None
  ngram_corpus_split: str = "train"
  ngram_corpus_max_examples: Optional[int] = None
  prompt_lookup_max_ngram: int = 3
  temperature: float = 0.0
  topk: int = 0
  topp: float = 0.0
  gamma: int = 5
  lenience: float = 1.0
  batch_size: int = 1
  max_input_len: int = 128
  max_decode_len: int = 128
  on_too_long: str = "truncate"              # or 'error'
  dtype: str = "float32"                     # activation dtype
  num_warmup: int = 2
  num_examples: int = 100
  seed: int = 0
  alpha_only_tokens: int = 10_000

  def sampling(self) -> SamplingConfig:
    return SamplingConfig(self.temperature, self.topk, self.topp)

  def validate(self) -> None:
    """Cheap checks that fail before any long work starts."""
    self.sampling()  # temperature / topk / topp errors
    if self.gamma < 1:
      raise ValueError(f"Experiment.gamma must be >= 1, got {self.gamma}")
    if not 0 < self.lenience <= 1:
      raise ValueError(f"Experiment.lenience must be in (0, 1] (1 is exact), got {self.lenience}")
    if self.draft_name not in drafts.REGISTRY:
      raise ValueError(f"unknown approximation model Experiment.draft_name="
                       f"{self.draft_name!r}; known: {sorted(drafts.REGISTRY)}")
    for name in ("batch_size", "max_input_len", "max_decode_len", "num_examples"):
      if getattr(self, name) < 1:
        raise ValueError(f"Experiment.{name} must be >= 1, got {getattr(self, name)}")
    if self.num_warmup < 0:
      raise ValueError(f"Experiment.num_warmup must be >= 0, got {self.num_warmup}")
    if self.on_too_long not in ("truncate", "error"):
      raise ValueError(f"Experiment.on_too_long must be 'truncate' or 'error', "
                       f"got {self.on_too_long!r}")
    if not self.target_checkpoint:
      raise ValueError("Experiment.target_checkpoint is not set")
    if self.draft_name == "t5" and not self.draft_checkpoint:
      raise ValueError("Experiment.draft_checkpoint is not set (draft_name='t5')")
    if self.draft_name in ("unigram", "bigram") and not self.ngram_corpus:
      raise ValueError(f"Experiment.ngram_corpus is not set (draft_name={self.draft_name!r} "
                       "is estimated from a corpus)")
    for name in ("vocab_path", "target_checkpoint", "draft_checkpoint", "source",
                 "ngram_corpus"):
      value = getattr(self, name)
      if value and not _is_remote(value) and not Path(_resolve(value)).exists():
        raise FileNotFoundError(f"Experiment.{name}: {value!r} does not exist "
                                f"(looked at {_resolve(value)})")

  @property
  def labels(self) -> tuple[str, str]:
    target = self.target_label or Path(self.target_checkpoint.rstrip("/")).name
    if self.draft_name == "t5":
      draft = self.draft_label or Path(self.draft_checkpoint.rstrip("/")).name
    else:
      draft = self.draft_label or self.draft_name
    return target, draft


def _is_remote(path: str) -> bool:
  return path.startswith("gs://") or path.startswith("seqio:")


def _resolve(path: str) -> str:
  """Relative paths are taken from the working directory, else the repo root."""
  if _is_remote(path) or os.path.isabs(path) or os.path.exists(path):
    return path
  return str(REPO_ROOT / path)


# ------------------------------------------------------------------ loading


@dataclasses.dataclass
class Setup:
  exp: Experiment
  vocab: Any
  examples: list            # data.Example, warm-up first
  inputs: np.ndarray        # [N, max_input_len] int32
  target: T5Model
  target_params: Any
  draft: Any


def _load_model(path: str, fmt: str, preset: Optional[str], dtype: str, role: str):
  config = get_config(preset, dtype=dtype) if preset else None
  params, config = checkpoints.load_checkpoint(_resolve(path), fmt=fmt, config=config)
  return T5Model(config.replace(dtype=dtype)), params


def _corpus(exp: Experiment, vocab) -> list[list[int]]:
  exs = data.load_examples(_resolve(exp.ngram_corpus), split=exp.ngram_corpus_split,
                           max_examples=exp.ngram_corpus_max_examples,
                           data_dir=exp.tfds_data_dir)
  seqs = [vocab.encode(e.reference) + [vocab.eos_id] for e in exs if e.reference]
  if not seqs:
    raise ValueError(f"Experiment.ngram_corpus={exp.ngram_corpus!r} has no references")
  return seqs


def prepare(exp: Experiment) -> Setup:
  """Loads and checks everything; raises a clear error before any decoding."""
  exp.validate()
  vocab = data.get_vocabulary(_resolve(exp.vocab_path), extra_ids=exp.vocab_extra_ids)
  need = exp.num_warmup + exp.num_examples
  examples = data.load_examples(_resolve(exp.source), split=exp.split, max_examples=need,
                                data_dir=exp.tfds_data_dir)
  if not examples:
    raise ValueError(f"Experiment.source={exp.source!r} has no examples")
  if len(examples) <= exp.num_warmup:
    raise ValueError(f"Experiment.source={exp.source!r} has {len(examples)} examples, not "
                     f"more than num_warmup={exp.num_warmup}")
  prefix = exp.prefix if exp.prefix is not None else data.PREFIXES.get(exp.task, "")
  for e in examples:
    if not e.input or not e.input.strip():
      raise ValueError(f"Experiment.source={exp.source!r}: example id={e.id!r} has an "
                       "empty input")
  inputs, _ = data.encode_batch(vocab, [e.input for e in examples], exp.max_input_len,
                                prefix=prefix, on_too_long=exp.on_too_long)
  target, target_params = _load_model(exp.target_checkpoint, exp.target_format,
                                      exp.target_preset, exp.dtype, "target")
  if vocab.vocab_size > target.config.vocab_size:
    raise ValueError(f"vocabulary {exp.vocab_path} has {vocab.vocab_size} ids but the target "
                     f"model's vocab_size is {target.config.vocab_size}")
  # Every builder gets the same keyword arguments and takes what it needs, so a
  # newly registered approximation model is selectable with no change here.
  build_kw: dict[str, Any] = dict(vocab_size=target.config.vocab_size,
                                  max_ngram=exp.prompt_lookup_max_ngram)
  if exp.draft_checkpoint:
    dmodel, dparams = _load_model(exp.draft_checkpoint, exp.draft_format, exp.draft_preset,
                                  exp.dtype, "draft")
    data.check_vocab_compatible(target.config.vocab_size, dmodel.config.vocab_size,
                                target_eos_id=target.config.eos_id,
                                draft_eos_id=dmodel.config.eos_id,
                                target_pad_id=target.config.pad_id,
                                draft_pad_id=dmodel.config.pad_id)
    build_kw.update(model=dmodel, params=dparams)
  if exp.ngram_corpus:
    build_kw["corpus"] = _corpus(exp, vocab)
  draft = drafts.build(exp.draft_name, **build_kw)
  return Setup(exp, vocab, examples, inputs, target, target_params, draft)


# ---------------------------------------------------------------- workdir


class Workdir:
  """examples.jsonl (append-only), summary.json (atomic rewrite), config.gin."""

  def __init__(self, path: str, config_str: str, resume: bool):
    self.path = Path(path)
    self.examples_path = self.path / "examples.jsonl"
    self.config_path = self.path / "config.gin"
    existing = self.examples_path.exists() and self.examples_path.stat().st_size > 0
    if existing and not resume:
      raise FileExistsError(f"{self.examples_path} already has results; pass --resume to "
                            "continue that run or choose another --workdir (nothing was "
                            "changed)")
    if resume and self.config_path.exists():
      old = self.config_path.read_text()
      if old != config_str:
        raise ValueError(f"--resume: the gin config differs from {self.config_path}; "
                         "resume with the same --config/--gin_bindings (nothing was changed)")
    self.resume = resume
    self.config_str = config_str
    self.records: list[dict] = []

  def open(self) -> "Workdir":
    """Creates the directory and config.gin; on resume reads finished lines."""
    self.path.mkdir(parents=True, exist_ok=True)
    self.records = self._read_complete_lines() if self.resume else []
    if not self.config_path.exists():
      _atomic_write(self.config_path, self.config_str)
    return self

  def _read_complete_lines(self) -> list[dict]:
    if not self.examples_path.exists():
      return []
    raw = self.examples_path.read_bytes()
    end = raw.rfind(b"\n") + 1
    if end < len(raw):  # an interrupted write: drop the partial last line
      logging.warning("Dropping a partial last line of %s (%d bytes)", self.examples_path,
                      len(raw) - end)
      with open(self.examples_path, "r+b") as f:
        f.truncate(end)
    return [json.loads(line) for line in raw[:end].decode().splitlines() if line.strip()]

  def append(self, record: dict) -> None:
    with open(self.examples_path, "a") as f:
      f.write(json.dumps(record) + "\n")
      f.flush()
      os.fsync(f.fileno())
    self.records.append(record)

  def write_summary(self, summary: dict) -> None:
    _atomic_write(self.path / "summary.json", json.dumps(summary, indent=2) + "\n")


def _atomic_write(path: Path, text: str) -> None:
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


# ---------------------------------------------------------------- measuring


def _batches(n: int, start: int, batch: int):
  for i in range(start, n, batch):
    yield list(range(i, min(i + batch, n)))


def _pad_batch(inputs: np.ndarray, idx: list[int], batch: int) -> jnp.ndarray:
  rows = idx + [idx[-1]] * (batch - len(idx))  # repeat the last row; ignored
  return jnp.asarray(inputs[rows])



def _text(vocab, tokens: np.ndarray) -> str:
  return vocab.decode([int(t) for t in tokens])


COST_KEYS = ("c", "v", "target_step_ms", "verify_ms", "draft_token_ms")


def summarize(exp: Experiment, records: list[dict]) -> dict:
  """Aggregates examples.jsonl lines into summary.json.

  Each line carries the cost measurement of its process (c, v, step times), so
  a resumed run's summary uses the median over all lines: every number here
  can be recomputed from examples.jsonl alone.
  """
  tot = lambda k: float(sum(r[k] for r in records))
  costs = {k: float(np.median([r[k] for r in records])) if records else float("nan")
           for k in COST_KEYS}
  evaluated = tot("accepted") + tot("rejected")
  alpha = tot("accepted") / evaluated if evaluated else float("nan")
  alpha_min_pq = tot("min_pq_sum") / evaluated if evaluated else float("nan")
  target_label, draft_label = exp.labels
  base_s = tot("baseline_s")
  spec_s = tot("speculative_s")
  summary = {
      "task": exp.task, "target": target_label, "draft": draft_label,
      "temperature": exp.temperature, "topk": exp.topk, "topp": exp.topp,
      "gamma": exp.gamma, "lenience": exp.lenience, "batch_size": exp.batch_size,
      "alpha": alpha, "alpha_min_pq": alpha_min_pq,
      "tokens_per_target_call": tot("tokens") / max(tot("target_calls"), 1),
      "c": costs["c"], "v": costs["v"],
      "target_step_ms": costs["target_step_ms"], "verify_ms": costs["verify_ms"],
      "draft_token_ms": costs["draft_token_ms"],
      "baseline_ms_per_token": 1e3 * base_s / max(tot("baseline_tokens"), 1),
      "speculative_ms_per_token": 1e3 * spec_s / max(tot("tokens"), 1),
      "baseline_s": base_s, "speculative_s": spec_s,
      "speedup": base_s / spec_s if spec_s else float("nan"),
      "num_examples": len(records),
      "mismatches_vs_baseline": (int(sum(not r["matches_baseline"] for r in records))
                                 if exp.temperature == 0 else None),
  }
  ok = records and not math.isnan(alpha)
  summary["expected_speedup"] = (float(theory.walltime_improvement(min(alpha, 1.0), exp.gamma,
                                                                   costs["c"]))
                                 if ok else None)
  summary["expected_speedup_v"] = (float(theory.walltime_improvement(
      min(alpha, 1.0), exp.gamma, costs["c"], costs["v"])) if ok else None)
  return summary


def table2_row(s: dict) -> str:
  """The paper's Table 2 layout (TASK, M_q, TEMP, γ, α, SPEED), plus EXP."""
  head = "| TASK | M_q | TEMP | γ | α | SPEED | EXP (Thm 3.8) | EXP (with v) | mismatches |"
  sep = "|---|---|---|---|---|---|---|---|---|"
  fmt = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"
  row = (f"| {s['task']} | {s['draft']} | {s['temperature']:g} | {s['gamma']} | "
         f"{fmt(s['alpha'])} | {fmt(s['speedup'])}X | {fmt(s['expected_speedup'])}X | "
         f"{fmt(s['expected_speedup_v'])}X | "
         f"{'-' if s['mismatches_vs_baseline'] is None else s['mismatches_vs_baseline']} |")
  return "\n".join([head, sep, row])


def run_speculative(setup: Setup, workdir: Workdir) -> dict:
  exp = setup.exp
  sampling = exp.sampling()
  target, tparams, draft = setup.target, setup.target_params, setup.draft
  kw = dict(max_decode_len=exp.max_decode_len, sampling=sampling, eos_id=target.config.eos_id)
  base_fn = lambda x, k: temperature_sample(target, tparams, x, k, **kw)
  spec_fn = lambda x, k: speculative_decode(target, tparams, draft, x, k, gamma=exp.gamma,
                                            lenience=exp.lenience, **kw)
  root = jax.random.PRNGKey(exp.seed)
  n_total = len(setup.examples)
  # Warm-up: compile both loops on the warm-up examples (or the first batch).
  t0 = time.perf_counter()
  for idx in (list(_batches(exp.num_warmup, 0, exp.batch_size)) or [[0]]):
    x = _pad_batch(setup.inputs, idx, exp.batch_size)
    block(base_fn(x, root))
    block(spec_fn(x, root))
  logging.info("Warm-up (compilation included) took %.1f s", time.perf_counter() - t0)
  c = measure_costs(target, tparams, draft, _pad_batch(setup.inputs, [0], exp.batch_size),
                    exp.gamma, sampling, cache_len=exp.max_decode_len + exp.gamma + 1)
  costs = {"c": c.c, "v": c.v, "target_step_ms": 1e3 * c.target_step_s,
           "verify_ms": 1e3 * c.verify_s, "draft_token_ms": 1e3 * c.draft_token_s}
  logging.info("Costs: %s", costs)

  done_ids = {r["index"] for r in workdir.records}
  start = exp.num_warmup
  todo = [i for i in range(start, n_total) if i not in done_ids]
  t_start = time.perf_counter()
  processed = 0
  for idx in _batches(len(todo), 0, exp.batch_size):
    rows = [todo[i] for i in idx]
    x = _pad_batch(setup.inputs, rows, exp.batch_size)
    key = jax.random.fold_in(root, rows[0])
    base, base_s = timed(lambda: base_fn(x, key))
    spec, spec_s = timed(lambda: spec_fn(x, key))
    alphas = alpha_estimates(spec.stats)
    st = jax.tree_util.tree_map(np.asarray, spec.stats)
    base_tok, spec_tok = np.asarray(base.tokens), np.asarray(spec.tokens)
    for j, i in enumerate(rows):
      ex = setup.examples[i]
      workdir.append({
          "index": i, "id": ex.id,
          "baseline_s": base_s / len(rows), "speculative_s": spec_s / len(rows),
          "batch_baseline_s": base_s, "batch_speculative_s": spec_s, "batch_size": len(rows),
          "baseline_tokens": int(base.length[j]), "tokens": int(spec.length[j]),
          "target_calls": int(st.target_calls[j]), "draft_calls": int(st.draft_calls[j]),
          "accepted": int(st.accepted[j]), "rejected": int(st.rejected[j]),
          "min_pq_sum": float(st.min_pq_sum[j]),
          "accepted_at": st.accepted_at[j].tolist(), "evaluated_at": st.evaluated_at[j].tolist(),
          "alpha": float(alphas["alpha"][j]), "alpha_min_pq": float(alphas["alpha_min_pq"][j]),
          "tokens_per_target_call": int(spec.length[j]) / max(int(st.target_calls[j]), 1),
          "matches_baseline": bool(np.array_equal(base_tok[j], spec_tok[j])),
          "output": _text(setup.vocab, spec_tok[j]),
          "baseline_output": _text(setup.vocab, base_tok[j]),
          "reference": ex.reference,
          **costs,
      })
    processed += len(rows)
    s = summarize(exp, workdir.records)
    eta = (time.perf_counter() - t_start) / processed * (len(todo) - processed)
    logging.info("[%d/%d] alpha %.3f  speedup %.2fx  ETA %.0f s", len(workdir.records),
                 n_total - exp.num_warmup, s["alpha"], s["speedup"], eta)
    workdir.write_summary(s)
  summary = summarize(exp, workdir.records)
  workdir.write_summary(summary)
  return summary


# ---------------------------------------------------------------- alpha only


@jax.jit
def _min_pq(p: jnp.ndarray, q: jnp.ndarray) -> jnp.ndarray:
  return jnp.sum(jnp.minimum(p, q), axis=-1)


def _draft_q_along(draft, inputs, tokens, sampling: SamplingConfig):
  """q_t for every position t of fixed outputs [B, T] (γ = 1 proposals)."""
  b, t = tokens.shape
  seq = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), tokens, jnp.zeros((b, 1), jnp.int32)], 1)
  state = draft.init(inputs, t + 2)

  def step(state, i):
    _, q, state = draft.propose(state, seq, jnp.full((b,), i, jnp.int32), 1, sampling,
                                jax.random.PRNGKey(0))
    return state, q[:, 0]

  _, qs = jax.lax.scan(step, state, jnp.arange(t, dtype=jnp.int32))
  return jnp.moveaxis(qs, 0, 1)


@functools.partial(jax.jit, static_argnames=("target", "sampling"))
def _alpha_along(target: T5Model, params, draft, inputs, tokens, lengths, sampling):
  p = standardize(target(params, inputs, shift_right(tokens)), sampling)
  q = _draft_q_along(draft, inputs, tokens, sampling)
  mask = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
  return jnp.sum(jnp.where(mask, _min_pq(p, q), 0.0), 1)



def run_alpha_only(setup: Setup, workdir: Workdir) -> dict:
  """Paper §4.2: E[sum_x min(p, q)] along tokens generated by the target."""
  exp = setup.exp
  sampling = exp.sampling()
  target, tparams = setup.target, setup.target_params
  root = jax.random.PRNGKey(exp.seed)
  done_ids = {r["index"] for r in workdir.records}
  for idx in _batches(len(setup.examples), 0, exp.batch_size):
    if sum(r["tokens"] for r in workdir.records) >= exp.alpha_only_tokens:
      break
    rows = [i for i in idx if i not in done_ids]
    if not rows:
      continue
    x = _pad_batch(setup.inputs, rows, exp.batch_size)
    key = jax.random.fold_in(root, rows[0])
    out = temperature_sample(target, tparams, x, key, max_decode_len=exp.max_decode_len,
                             sampling=sampling, eos_id=target.config.eos_id)
    sums = np.asarray(_alpha_along(target, tparams, setup.draft, x, out.tokens, out.length,
                                   sampling))
    for j, i in enumerate(rows):
      n = int(out.length[j])
      workdir.append({"index": i, "id": setup.examples[i].id, "tokens": n,
                      "min_pq_sum": float(sums[j]),
                      "alpha_min_pq": float(sums[j]) / max(n, 1)})
    tokens = sum(r["tokens"] for r in workdir.records)
    logging.info("[alpha-only] %d / %d tokens, alpha %.3f", tokens, exp.alpha_only_tokens,
                 sum(r["min_pq_sum"] for r in workdir.records) / max(tokens, 1))
  tokens = sum(r["tokens"] for r in workdir.records)
  target_label, draft_label = exp.labels
  summary = {"mode": "alpha_only", "task": exp.task, "target": target_label,
             "draft": draft_label, "temperature": exp.temperature, "topk": exp.topk,
             "topp": exp.topp, "num_tokens": tokens, "num_examples": len(workdir.records),
             "alpha_min_pq": sum(r["min_pq_sum"] for r in workdir.records) / max(tokens, 1)}
  workdir.write_summary(summary)
  return summary


# ---------------------------------------------------------------- main


FLAGS = flags.FLAGS
flags.DEFINE_multi_string("config", [], "Gin config file(s); later files override earlier.")
flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings, e.g. 'Experiment.gamma = 5'.")
flags.DEFINE_string("workdir", None, "Output directory (default runs/<config file stem>).")
flags.DEFINE_bool("resume", False, "Continue after the last complete line of examples.jsonl.")
flags.DEFINE_bool("alpha_only", False, "Only measure alpha along target generations (§4.2).")


def parse_config(configs: Sequence[str], bindings: Sequence[str]) -> Experiment:
  gin.clear_config()
  gin.add_config_file_search_path(str(REPO_ROOT))  # so `include 'configs/...'` works anywhere
  gin.parse_config_files_and_bindings([_resolve(c) for c in configs], bindings)
  return Experiment()


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  exp = parse_config(FLAGS.config, FLAGS.gin_bindings)
  config_str = gin.config_str()
  exp.validate()
  stem = Path(FLAGS.config[-1]).stem if FLAGS.config else "default"
  workdir_path = FLAGS.workdir or str(Path("runs") / (stem + ("_alpha" if FLAGS.alpha_only
                                                              else "")))
  workdir = Workdir(workdir_path, config_str, FLAGS.resume)  # checks only, no writes
  setup = prepare(exp)  # all loading and checking before the workdir is touched
  workdir.open()
  logging.info("Workdir %s (%d examples already done)", workdir.path, len(workdir.records))
  if FLAGS.alpha_only:
    s = run_alpha_only(setup, workdir)
    print(f"| {s['task']} | {s['target']} | {s['draft']} | T={s['temperature']:g} | "
          f"alpha {s['alpha_min_pq']:.3f} | {s['num_tokens']} tokens |")
  else:
    s = run_speculative(setup, workdir)
    print(table2_row(s))
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
