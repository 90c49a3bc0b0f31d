"""Hugging Face transformers on the same card and the same weights as ours:
a ``T5ForConditionalGeneration`` built in memory from our params
(``hf_from_params``), its eager passes, its ``generate`` (dynamic cache;
static cache, which transformers compiles on a GPU) and its assisted
generation, beside our baseline and speculative loops; and the demo pair
end to end (``vs_hf``).

Sections:

  hf    An XXL-sized target (random bfloat16 weights, batch 1, EOS ignored):
        our ``temperature_sample`` against HF ``generate`` with its dynamic
        cache and with the static cache compiled (``torch.compile``, mode
        'reduce-overhead': CUDA graphs; the uncompiled static cache, with a
        note, where that fails); our ``speculative_decode`` with a
        small-sized draft against HF assisted generation with the same
        weights as assistant and the same constant γ (random weights: the
        draft is rarely right, so both pay γ draft steps and one target pass
        for about one token); HF's eager one-token step and γ + 1 pass.
  demo  The demo pair end to end (``vs_hf.bench_setting``): our baseline
        and speculative decoding against HF generate and HF assisted
        generation with the same draft, T = 0, outputs compared.
"""

from __future__ import annotations

import inspect
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import checkpoints, data
from specdec_jax.decoding import speculative_decode, temperature_sample
from specdec_jax.drafts import T5Draft
from specdec_jax.models.t5 import T5Config, T5Model
from specdec_jax.partitioning import flatten_names
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting import script_args
from specdec_jax.timing import interleaved_medians_ms, median, timed

from lab.bench import vs_hf
from lab.common import time_call
from lab.bench.common import (PAPER_GAMMA, Sizes, describe, draft_seed, earlier,
                              emit, log, random_inputs, random_params, record)
from lab.bench.exactness import demo_pair
from lab.hf_export import t5_to_hf_config

GREEDY = SamplingConfig(temperature=0.0)


def hf_from_params(params: Any, config: T5Config, dtype: str):
  """A transformers ``T5ForConditionalGeneration`` holding ``params``, built
  where they are (GPU or host memory) through ``lab.hf_export``'s own
  mapping (``hf_name_map``, ``t5_to_hf_config``): no file is written (an
  XXL-sized export is 22 GB). Tensors that need no transpose or cast are
  shared with JAX through DLPack; transposes are new arrays on the device."""
  import torch
  import transformers

  transformers.logging.set_verbosity_error()
  tdtype = getattr(torch, dtype)
  flat = flatten_names(params)
  state = {}
  for ours, (key, transpose) in checkpoints.hf_name_map(config).items():
    x = jax.block_until_ready(jnp.transpose(flat[ours]) if transpose else flat[ours])
    t = torch.from_dlpack(x)
    state[key] = t if t.dtype == tdtype else t.to(tdtype)
  hf_cfg = transformers.T5Config(**t5_to_hf_config(config))
  with torch.device("meta"):
    model = transformers.T5ForConditionalGeneration(hf_cfg)
  _, unexpected = model.load_state_dict(state, strict=False, assign=True)
  # The encoder's and decoder's token embeddings are the shared one (and so is
  # T5 1.0's output layer); T5 1.1's lm_head stays its own (tie_weights would
  # tie it too).
  model.set_input_embeddings(model.shared)
  if config.logits_via_embedding:
    model.lm_head.weight = model.shared.weight
  empty = [n for n, p in model.named_parameters() if p.is_meta]
  if unexpected or empty:
    raise RuntimeError(f"HF model from params: unexpected {unexpected[:3]}, unset {empty[:3]}")
  return model.eval()


def torch_device(model) -> str:
  return str(next(model.parameters()).device)


def hf_sync(model) -> None:
  import torch
  if torch_device(model).startswith("cuda"):
    torch.cuda.synchronize()


def cache_kwarg(model) -> str:
  """The name ``forward`` takes the cache by: 'cache' in newer transformers
  (which still accept the deprecated 'past_key_values'), else 'past_key_values'."""
  return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_pass_ms(model, input_ids, prefix_len: int, k: int, repeats: int) -> float:
  """Median ms of one eager decoder pass over k new positions after a
  ``prefix_len``-token dynamic cache (cropped back after each call)."""
  import torch
  from transformers.cache_utils import DynamicCache, EncoderDecoderCache

  dev = input_ids.device
  mask = torch.ones_like(input_ids)
  with torch.inference_mode():
    enc = model.get_encoder()(input_ids=input_ids, attention_mask=mask)
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    kw = {cache_kwarg(model): cache, "use_cache": True}
    prefix = torch.full((1, prefix_len), 5, dtype=torch.long, device=dev)
    model(encoder_outputs=enc, attention_mask=mask, decoder_input_ids=prefix, **kw)
    new = 3 + torch.arange(k, dtype=torch.long, device=dev)[None]
    times = []
    for i in range(repeats + 2):
      hf_sync(model)
      t0 = time.perf_counter()
      model(encoder_outputs=enc, attention_mask=mask, decoder_input_ids=new, **kw)
      hf_sync(model)
      if i >= 2:
        times.append(time.perf_counter() - t0)
      cache.crop(-k)
  return 1e3 * median(times)


def hf_generate_timed(model, input_ids, new_tokens: int, repeats: int, warmup: int,
                      **kw) -> tuple[np.ndarray, float]:
  """(greedy tokens, median seconds) of ``new_tokens`` tokens from HF generate
  (EOS suppressed by min_new_tokens, so every call makes all of them)."""
  import torch

  mask = torch.ones_like(input_ids)
  cfg = model.config
  args = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, num_beams=1, decoder_start_token_id=cfg.decoder_start_token_id,
              eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, **kw)
  outs = []

  def call():
    outs.append(model.generate(input_ids, **args))
    hf_sync(model)  # the clock stops when the card is done
  with torch.inference_mode():
    times = time_call(call, repeats, warmup)
  return outs[-1][0, 1:].cpu().numpy(), median(times)


def hf_setup(sz: Sizes):
  """The XXL-sized target's random weights (the loops section's: same seed)
  and a random input; JAX must not preallocate the card (torch shares it)."""
  config = sz.targets["xxl"]
  model = T5Model(config)
  params = random_params(model, jax.random.PRNGKey(0), "bfloat16")
  return config, model, params, random_inputs(config, 1, sz.input_len, seed=1)


def versions() -> str:
  import torch
  import transformers
  return f"torch {torch.__version__}, transformers {transformers.__version__}"


def hf_generate_or_error(model, ids, n: int, repeats: int, warmup: int, **kw):
  """``hf_generate_timed``, or (None, None, the error in one line) where
  this transformers version fails at it."""
  try:
    return (*hf_generate_timed(model, ids, n, repeats, warmup, **kw), None)
  except Exception as e:  # noqa: BLE001 (the failure is a row of the table)
    return None, None, f"{type(e).__name__}: {str(e)[:200]}"


def hf_compiled_generate(hf, ids, n: int, repeats: int) -> tuple[float, bool, str, str]:
  """HF generate with the static cache, compiled where transformers compiles
  it (on a GPU) -> (median seconds, compiled?, how, note); the uncompiled
  static cache, with a note, where compilation fails."""
  note = ""
  try:
    _, secs = hf_generate_timed(hf, ids, n, repeats, 2, cache_implementation="static")
    compiled_ = getattr(hf, "_compiled_call", None) is not None
    how = ("static cache, torch.compile (transformers' default CompileConfig: inductor, "
           "mode 'reduce-overhead')" if compiled_ else
           f"static cache, not compiled (transformers compiles only on a GPU; device "
           f"{torch_device(hf)})")
  except Exception as e:  # noqa: BLE001 (the fallback is reported, not hidden)
    note = f"static cache with compilation failed ({type(e).__name__}: {str(e)[:200]}); "
    print(f"# {note}falling back to the static cache uncompiled", flush=True)
    _, secs = hf_generate_timed(hf, ids, n, repeats, 1, cache_implementation="static",
                                disable_compile=True)
    compiled_, how = False, "static cache, not compiled (fallback)"
  return secs, compiled_, how, note


def section_hf(sz: Sizes, out: Path, smoke: bool = False) -> None:
  """The hf section (module docstring)."""
  import torch

  del smoke
  config, model, params, inputs = hf_setup(sz)
  dcfg = sz.drafts["small"]
  dmodel = T5Model(dcfg)
  draft = T5Draft(params=random_params(dmodel, jax.random.PRNGKey(draft_seed("small")),
                                       "bfloat16"), model=dmodel)
  key, n, gamma = jax.random.PRNGKey(2), sz.new_tokens, sz.hf_gamma

  def ours_base():
    return temperature_sample(model, params, inputs, key, max_decode_len=n, sampling=GREEDY,
                              eos_id=-1)

  def ours_spec():
    return speculative_decode(model, params, draft, inputs, key, gamma=gamma, max_decode_len=n,
                              sampling=GREEDY, eos_id=-1)
  first, cb = timed(ours_base)
  spec_out, cs = timed(ours_spec)
  log(f"hf: ours compiled and run once in {cb:.1f} s (baseline), {cs:.1f} s (speculative)")
  ours_ms = interleaved_medians_ms({"base": ours_base, "spec": ours_spec}, sz.hf_repeats // 4 + 1)
  ours_tokens = np.asarray(first.tokens[0])
  spec_calls = int(spec_out.stats.target_calls[0])

  hf = hf_from_params(params, config, "bfloat16")
  hf_draft = hf_from_params(draft.params, dcfg, "bfloat16")
  dev = torch_device(hf)
  ids = torch.as_tensor(np.array(inputs), dtype=torch.long, device=dev)
  step = hf_pass_ms(hf, ids, sz.position, 1, sz.hf_repeats)
  verify = hf_pass_ms(hf, ids, sz.position, PAPER_GAMMA + 1, sz.hf_repeats)
  reps = max(sz.hf_repeats // 10, 1)
  hf_tokens, hf_s = hf_generate_timed(hf, ids, n, reps, 1)
  t0 = time.perf_counter()
  static_s, compiled_, how, note = hf_compiled_generate(hf, ids, n, reps + 1)
  static_warm = time.perf_counter() - t0
  vs_hf.configure_assistant(hf_draft, gamma)
  counter = vs_hf.CallCounter(hf)
  assisted, assisted_s, assisted_err = hf_generate_or_error(
      hf, ids, n, reps, 1, assistant_model=hf_draft,
      decoder_attention_mask=torch.ones((1, 1), dtype=torch.long, device=dev))
  assisted_calls = counter.n / (reps + 1)
  counter.remove()

  base_s, spec_s = ours_ms["base"] / 1e3, ours_ms["spec"] / 1e3
  ours_step = (earlier(out, "loops") or {}).get("step_ms")

  def row(impl, what, secs, ref=None, bold=False):
    ratio = "-" if ref is None or secs is None else f"{secs / ref:.2f}x"
    if bold and ratio != "-":
      ratio = f"**{ratio}**"
    if secs is None:
      return script_args.markdown_row([impl, what, "failed", "-", "-"])
    return script_args.markdown_row([impl, what, f"{1e3 * secs / n:.3f}", f"{n / secs:.1f}",
                                     ratio])
  lines = [f"T5 1.1 XXL-sized target ({describe(config)}) and a small-sized draft "
           f"({describe(dcfg)}), random bfloat16 weights, the same on both sides; batch 1, "
           f"{sz.input_len} input tokens, {n} greedy tokens per call (EOS never ends it), "
           f"γ {gamma} for both speculative methods; {versions()}, HF attention "
           f"'{hf.config._attn_implementation}', on {dev}; HF static cache: {note}warm-up "
           f"and timed calls took {static_warm:.1f} s.", "",
           script_args.markdown_header(["implementation", "what", "ms per token (or pass)",
                                        "tokens/s", "ours over it"])]
  if ours_step is not None:
    lines.append(script_args.markdown_row(["ours", "one-token step (loops section's piece)",
                                           f"{ours_step:.3f}", "-", "-"]))
  lines += [
      script_args.markdown_row(["HF eager", "one-token step (dynamic cache)", f"{step:.3f}",
                                "-", "-"]),
      script_args.markdown_row(["HF eager", f"{PAPER_GAMMA + 1}-position pass", f"{verify:.3f}",
                                "-", "-"]),
      row("ours", "temperature_sample (encoder included)", base_s),
      row("HF", "generate, dynamic cache (its default)", hf_s, base_s),
      row("HF", f"generate, {how}", static_s, base_s, bold=True),
      row("ours", f"speculative_decode, small-sized draft, γ {gamma}", spec_s),
      row("HF", f"assisted generation, small-sized assistant, constant γ {gamma}", assisted_s,
          spec_s, bold=True)]
  d_hf = vs_hf.first_difference(ours_tokens.tolist(), hf_tokens.tolist())
  d_assisted = (None if assisted is None
                else vs_hf.first_difference(hf_tokens.tolist(), assisted.tolist()))
  goal = base_s * 2 <= static_s
  lines += ["", f"- Our baseline over HF's {'compiled ' if compiled_ else ''}static-cache "
            f"generate: **{static_s / base_s:.2f}x** (goal >= 2x: {'met' if goal else 'NOT met'}).",
            f"- Target calls per token: ours speculative {spec_calls / n:.2f}, HF assisted "
            + ("-" if assisted is None else f"{assisted_calls / n:.2f}")
            + " (random weights: the draft is rarely right).",
            f"- Greedy tokens, ours vs HF: "
            f"{'identical' if d_hf is None else f'first differ at index {d_hf}'}; HF assisted vs "
            f"HF generate: " + (f"failed ({assisted_err})" if assisted is None else
                                'identical' if d_assisted is None
                                else f'first differ at index {d_assisted}')
            + " (random bfloat16 weights: near-ties are common, a difference is expected)."]
  record(out, "hf", dict(
      ours_tok_s=n / base_s, ours_spec_tok_s=n / spec_s, hf_tok_s=n / hf_s,
      hf_static_tok_s=n / static_s, static_compiled=compiled_, static_options=how, note=note,
      hf_assisted_tok_s=None if assisted_s is None else n / assisted_s,
      hf_assisted_error=assisted_err, ours_over_static=static_s / base_s,
      hf_step_ms=step, hf_verify_ms=verify, verify_k=PAPER_GAMMA + 1, gamma=gamma,
      ours_compile_s=cb, new_tokens=n, versions=versions(), device=dev,
      first_difference=d_hf, assisted_first_difference=d_assisted), emit(lines))

def section_demo(sz: Sizes, out: Path, smoke: bool = False) -> None:
  gamma = 4
  with tempfile.TemporaryDirectory(prefix="bench_gpu_demo_") as tmp:
    target, draft, _ = demo_pair(smoke, Path(tmp), feature_draft=False)
    ours, tp, tcfg, dp, dcfg = vs_hf.load_ours(target, draft)
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    hf_target = vs_hf.load_hf(vs_hf.export_for_hf(tp, tcfg, f"{tmp}/hf_target"), device=device)
    hf_draft = vs_hf.load_hf(vs_hf.export_for_hf(dp, dcfg, f"{tmp}/hf_draft"), device=device)
  vocab = data.SentencePieceVocab(script_args.resolve(script_args.VOCAB))
  examples = data.load_local(script_args.resolve(script_args.SOURCE))
  examples = examples[:sz.demo_warmup + sz.demo_examples]
  inputs, _ = data.encode_batch(vocab, [e.input for e in examples], 128,
                                prefix=data.PREFIXES[script_args.TASK])
  s = vs_hf.bench_setting(ours, hf_target, hf_draft, inputs, [e.id for e in examples],
                        temperature=0.0, gamma=gamma, max_decode_len=sz.max_decode_len,
                        num_warmup=sz.demo_warmup, seed=0, methods=vs_hf.METHODS,
                        log=lambda m: print(m, file=sys.stderr, flush=True),
                        input_buckets=())
  for m in s.mismatches:
    print(f"MISMATCH example {m[0]}: {m[1]} first differs from HF generate at index {m[2]}")
  lines = [f"The demo target and draft_tiny ({'toy random stand-ins, ' if smoke else ''}the "
           f"same weights on both sides, float32, no shortlist), {sz.demo_examples} test "
           f"verses after {sz.demo_warmup} warm-up, γ {gamma}, inputs padded to 128 tokens "
           f"(one compiled program each); HF on {device} ({versions()}), eager, its default "
           "dynamic cache.", "", script_args.markdown_header(vs_hf.TABLE_HEAD),
           *vs_hf.setting_table(s), "", *vs_hf.summary_lines([s]),
           *(f"- {vs_hf.LABELS[m]}: failed in this transformers version and left out ({err})."
             for m, err in s.failed.items())]
  acc = {m: dict(tokens=sum(a.tokens), seconds=sum(a.seconds), tok_s=a.tps)
         for m, a in s.accs.items()}
  record(out, "demo", dict(methods=acc, mismatches=len(s.mismatches), compared=s.compared,
                           gamma=gamma, examples=sz.demo_examples, failed=s.failed), emit(lines))

