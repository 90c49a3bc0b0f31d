"""T = 0 outputs of speculative decoding against the baseline on
configs/demo.gin's pair, by precision: float32 at JAX's default matmul
precision (TF32 products on NVIDIA GPUs), float32 at 'highest', and bfloat16
weights and activations; a mismatch is a verse whose outputs differ."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Optional

import jax
import numpy as np

from specdec_jax import checkpoints, data
from specdec_jax.decoding import speculative_decode, temperature_sample
from specdec_jax.models.t5 import T5Config, T5Model
from specdec_jax.run import Experiment, prepare
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting import script_args
from specdec_jax.timing import timed

from lab.bench.common import Sizes, record


def toy_checkpoints(root: Path, vocab_size: int) -> tuple[str, str]:
  """A random toy target and draft saved under ``root`` (smoke mode), with
  the demo vocabulary's size so that the demo's text inputs fit."""
  paths = []
  for name, cfg, seed in (("target", T5Config(vocab_size=vocab_size, d_model=32, num_heads=2,
                                              head_dim=16, num_encoder_layers=2,
                                              num_decoder_layers=2, d_ff=64), 0),
                          ("draft", T5Config(vocab_size=vocab_size, d_model=16, num_heads=2,
                                             head_dim=8, num_encoder_layers=1,
                                             num_decoder_layers=1, d_ff=32), 1)):
    path = root / f"toy_{name}"
    checkpoints.save_checkpoint(str(path), T5Model(cfg).init(jax.random.PRNGKey(seed)), cfg,
                                overwrite=True)
    paths.append(str(path))
  return paths[0], paths[1]


def demo_pair(smoke: bool, root: Path, feature_draft: bool) -> tuple[str, str, str]:
  """(target, draft, shortlist) paths: the demo's, or toy ones in smoke mode."""
  if smoke:
    target, draft = toy_checkpoints(root, data.SentencePieceVocab(
        script_args.resolve(script_args.VOCAB)).vocab_size)
    return target, draft, ""
  if feature_draft:
    return (script_args.resolve(script_args.TARGET), script_args.resolve(script_args.DRAFT),
            script_args.resolve(script_args.SHORTLIST))
  return script_args.resolve(script_args.TARGET), script_args.resolve(script_args.PLAIN_DRAFT), ""



EXACTNESS_SETTINGS = (("float32", "default"), ("float32", "highest"), ("bfloat16", "default"))


def section_exactness(sz: Sizes, out: Path, smoke: bool = False) -> None:
  gamma = 3
  rows, lines = [], [
      f"configs/demo.gin's pair ({'toy random stand-ins' if smoke else 'draft_tiny_feat with its shortlist'}), "
      f"γ {gamma}, T = 0, {sz.exact_examples} test verses after {sz.exact_warmup} warm-up, inputs "
      "padded to 128 tokens; a mismatch is a verse whose speculative output differs from the "
      "baseline's.", "",
      script_args.markdown_header(["activations and weights", "matmul precision", "verses",
                                   "mismatches", "first mismatching verses", "baseline tok/s",
                                   "speculative tok/s", "speedup"])]
  print("\n".join(lines), flush=True)
  with tempfile.TemporaryDirectory(prefix="bench_gpu_exact_") as tmp:
    target, draft, shortlist = demo_pair(smoke, Path(tmp), feature_draft=True)
    # Smoke mode runs float32 at 'highest' alone: the other settings take the
    # same path without a precision context (the variant sections' demo rows).
    for dtype, precision in EXACTNESS_SETTINGS[1:2] if smoke else EXACTNESS_SETTINGS:
      try:
        row = exactness_row(sz, target, draft, shortlist, gamma, dtype, precision)
      except Exception as e:  # noqa: BLE001 (one setting's failure is a row; the others run)
        print(f"# exactness {dtype}/{precision} failed: {type(e).__name__}: {e}", flush=True)
        row = dict(dtype=dtype, precision=precision, error=f"{type(e).__name__}: {e}")
        lines.append(script_args.markdown_row([dtype, precision, "failed", "-", "-", "-", "-",
                                               "-"]))
      else:
        lines.append(script_args.markdown_row(
            [dtype, precision, sz.exact_examples, f"**{row['mismatches']}**",
             ", ".join(map(str, row["mismatching"][:5])) or "-",
             f"{row['baseline_tok_s']:.1f}", f"{row['speculative_tok_s']:.1f}",
             f"{row['speedup']:.2f}x"]))
      rows.append(row)
      print(lines[-1], flush=True)
      record(out, "exactness", dict(rows=rows, gamma=gamma), None)  # each row as it exists
  record(out, "exactness", dict(rows=rows, gamma=gamma), "\n".join(lines))


@contextlib.contextmanager
def matmul_precision(precision: str):
  """JAX's default matmul precision set to ``precision`` inside the block
  (the context manager where this jax has it, else the config option)."""
  if hasattr(jax, "default_matmul_precision"):
    with jax.default_matmul_precision(precision):
      yield
    return
  before = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", precision)
  try:
    yield
  finally:
    jax.config.update("jax_default_matmul_precision", before)


def exactness_row(sz: Sizes, target: str, draft: str, shortlist: str, gamma: int, dtype: str,
                  precision: str, overrides: Optional[dict] = None) -> dict:
  """One setting of the exactness table: baseline and speculative decoding
  of the same verses, outputs compared, total tokens/s of each.
  ``overrides``: further ``Experiment`` fields (a kernel variant's)."""
  exp = Experiment(target_checkpoint=target, draft_checkpoint=draft,
                   draft_shortlist=shortlist, gamma=gamma, max_input_len=128,
                   input_buckets=(), max_decode_len=sz.max_decode_len, dtype=dtype,
                   param_dtype=dtype, num_warmup=sz.exact_warmup,
                   num_examples=sz.exact_examples, source=script_args.SOURCE,
                   vocab_path=script_args.VOCAB, **(overrides or {}))
  setup = prepare(exp)
  eos = setup.target.config.eos_id
  greedy = SamplingConfig(temperature=0.0)
  ctx = matmul_precision(precision) if precision != "default" else contextlib.nullcontext()
  bad, secs, toks = [], [0.0, 0.0], [0, 0]
  with ctx:
    for i in range(setup.inputs.shape[0]):
      x, key = setup.inputs[i:i + 1], jax.random.fold_in(jax.random.PRNGKey(0), i)
      b, tb = timed(lambda: temperature_sample(
          setup.target, setup.target_params, x, key, max_decode_len=sz.max_decode_len,
          sampling=greedy, eos_id=eos))
      p, tp = timed(lambda: speculative_decode(
          setup.target, setup.target_params, setup.draft, x, key, gamma=gamma,
          max_decode_len=sz.max_decode_len, sampling=greedy, eos_id=eos))
      if i < sz.exact_warmup:
        continue
      nb, npp = int(b.length[0]), int(p.length[0])
      if nb != npp or not np.array_equal(np.asarray(b.tokens[0, :nb]),
                                         np.asarray(p.tokens[0, :npp])):
        bad.append(setup.examples[i].id)
      secs[0] += tb
      secs[1] += tp
      toks[0] += nb
      toks[1] += npp
  tps = [t / s for t, s in zip(toks, secs)]
  return dict(dtype=dtype, precision=precision, verses=sz.exact_examples,
              mismatches=len(bad), mismatching=bad, baseline_tok_s=tps[0],
              speculative_tok_s=tps[1], speedup=secs[0] / secs[1])

