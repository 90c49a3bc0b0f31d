"""Our decoding against Hugging Face's on the same weights, example by
example (``scripts/bench_vs_hf.py`` and the accelerator benchmark's demo
section): the methods (``METHODS``), each run at batch 1 on the same inputs,
interleaved, outputs compared at T = 0, tokens/s and tokens per target call.

HF's side: our checkpoints exported with ``checkpoints.export_hf`` and loaded
with ``T5ForConditionalGeneration``; its assisted generation with a constant
γ (``configure_assistant``) gets a ``decoder_attention_mask`` so that the
assistant's cache is cropped correctly (``hf_generate``; the script's
docstring says why).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any, Optional, Sequence

import jax
import numpy as np

from specdec_jax import checkpoints, data
from specdec_jax.decoding import speculative_decode, temperature_sample
from specdec_jax.drafts import T5Draft
from specdec_jax.drafts import shortlist as shortlist_lib
from specdec_jax.models.t5 import T5Config, T5Model
from specdec_jax.sampling import SamplingConfig
from specdec_jax.timing import block, timed

from lab import common

METHODS = ("hf_greedy", "hf_assisted", "hf_default", "hf_asis", "ours_base", "ours_spec")
LABELS = {
    "hf_greedy": "HF generate",
    "hf_assisted": "HF assisted (constant γ)",
    "hf_default": "HF assisted (HF defaults)",
    "hf_asis": "HF assisted (constant γ, no workaround)",
    "ours_base": "ours temperature_sample",
    "ours_spec": "ours speculative_decode",
}
# Which plain decoder each method's speedup is measured against.
PLAIN = {"hf_greedy": "hf_greedy", "hf_assisted": "hf_greedy", "hf_default": "hf_greedy",
         "hf_asis": "hf_greedy",
         "ours_base": "ours_base", "ours_spec": "ours_base"}


# ------------------------------------------------------------------ HF side


def export_for_hf(params: Any, config: T5Config, directory: str) -> str:
  """Writes a HF T5 directory for our params (config.json + model.safetensors)."""
  checkpoints.export_hf(params, config, directory, overwrite=True)
  return directory


def load_hf(directory: str, num_threads: Optional[int] = None, device: str = "cpu"):
  """A float32 ``T5ForConditionalGeneration`` in eval mode, on ``device``
  (``hf_generate`` feeds it there)."""
  import torch
  import transformers

  if num_threads:
    torch.set_num_threads(num_threads)
  transformers.logging.set_verbosity_error()  # the untied-lm_head notice for T5 1.1
  transformers.logging.disable_progress_bar()
  model = transformers.T5ForConditionalGeneration.from_pretrained(directory,
                                                                  dtype=torch.float32)
  model.to(device)
  model.eval()
  return model


def configure_assistant(assistant, num_assistant_tokens: Optional[int]) -> None:
  """Sets the draft schedule HF's AssistedCandidateGenerator reads.

  ``int``: exactly that many draft tokens per round, every round
  (num_assistant_tokens_schedule='constant', assistant_confidence_threshold=0,
  which disables the ConfidenceCriteria early stop: transformers only adds it
  when the threshold is > 0). ``None``: HF's defaults (unset fields are filled
  from GenerationConfig._get_default_generation_params: 20 tokens, 'constant',
  threshold 0.4).
  """
  gc = assistant.generation_config
  if num_assistant_tokens is None:
    gc.num_assistant_tokens = None
    gc.num_assistant_tokens_schedule = None
    gc.assistant_confidence_threshold = None
  else:
    gc.num_assistant_tokens = int(num_assistant_tokens)
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0


class CallCounter:
  """Counts top-level forward calls of a HF model (decoder steps: generate runs
  the encoder through ``get_encoder()``, not through the top-level forward)."""

  def __init__(self, model):
    self.n = 0
    self._handle = model.register_forward_pre_hook(self._hook)

  def _hook(self, module, args):
    self.n += 1

  def reset(self) -> None:
    self.n = 0

  def remove(self) -> None:
    self._handle.remove()


def hf_generate(model, input_ids: np.ndarray, *, max_new_tokens: int, temperature: float,
                decoder_start_id: int, eos_id: int, pad_id: int, assistant=None,
                assistant_cache_fix: bool = True, seed: int = 0) -> np.ndarray:
  """HF generate at batch 1 -> generated ids [n] (decoder start token dropped).

  input_ids: [S] or [1, S] without padding. Greedy at temperature 0, else pure
  temperature sampling (top_k=0, top_p=1.0: no truncation).
  assistant_cache_fix: with an assistant, pass a decoder_attention_mask (the
  workaround in the module docstring).
  """
  import torch

  ids = torch.as_tensor(np.asarray(input_ids, np.int64).reshape(1, -1), device=model.device)
  kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, num_beams=1,
                            decoder_start_token_id=decoder_start_id, eos_token_id=eos_id,
                            pad_token_id=pad_id, attention_mask=torch.ones_like(ids))
  if temperature == 0:
    kw.update(do_sample=False)
  else:
    kw.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
    torch.manual_seed(seed)
  # transformers 5.23 sizes its default generation cache by num_layers (the
  # encoder's depth): a T5 whose decoder is deeper fails with an IndexError.
  # A fresh cache that grows per layer avoids it (no effect on the outputs).
  from transformers.cache_utils import DynamicCache, EncoderDecoderCache
  kw["past_key_values"] = EncoderDecoderCache(DynamicCache(), DynamicCache())
  if assistant is not None:
    kw["assistant_model"] = assistant
    if assistant_cache_fix:
      kw["decoder_attention_mask"] = torch.ones((1, 1), dtype=torch.long, device=ids.device)
  with torch.inference_mode():
    out = model.generate(ids, **kw)
  return out[0, 1:].cpu().numpy().astype(np.int32)


# ----------------------------------------------------------------- our side


@dataclasses.dataclass
class Ours:
  target: T5Model
  target_params: Any
  draft: T5Draft

  @property
  def config(self) -> T5Config:
    return self.target.config


def load_ours(target_path: str, draft_path: str, shortlist_path: str = ""
              ) -> tuple[Ours, Any, T5Config, Any, T5Config]:
  """Our pair; with ``shortlist_path``, our draft's q over that vocabulary
  shortlist (``specdec_jax.drafts.shortlist``; the same weights: Hugging Face's
  assisted generation has no such option and keeps the full vocabulary)."""
  tp, tcfg = checkpoints.load_checkpoint(target_path)
  dp, dcfg = checkpoints.load_checkpoint(draft_path)
  if tcfg.vocab_size != dcfg.vocab_size:
    raise ValueError(f"target vocab {tcfg.vocab_size} != draft vocab {dcfg.vocab_size}")
  found = common.bridges_in(draft_path) if os.path.isdir(draft_path) else []
  if found:
    raise ValueError(f"{draft_path} has a bridge to the target ({', '.join(found)}), which "
                     "Hugging Face's assisted generation cannot use; compare on the same "
                     "weights with a plain draft")
  dmodel = T5Model(dcfg)
  short = None
  if shortlist_path:
    short = shortlist_lib.Shortlist.for_draft(
        dmodel, dp, shortlist_lib.load(shortlist_path, tcfg.vocab_size))
  ours = Ours(T5Model(tcfg), tp, T5Draft(params=dp, model=dmodel, shortlist=short))
  return ours, tp, tcfg, dp, dcfg


def ours_baseline(ours: Ours, inputs: np.ndarray, key, *, max_decode_len: int,
                  temperature: float):
  return temperature_sample(ours.target, ours.target_params, inputs, key,
                            max_decode_len=max_decode_len,
                            sampling=SamplingConfig(temperature=temperature),
                            eos_id=ours.config.eos_id)


def ours_speculative(ours: Ours, inputs: np.ndarray, key, *, gamma: int, max_decode_len: int,
                     temperature: float):
  return speculative_decode(ours.target, ours.target_params, ours.draft, inputs, key,
                            gamma=gamma, max_decode_len=max_decode_len,
                            sampling=SamplingConfig(temperature=temperature),
                            eos_id=ours.config.eos_id)


# ------------------------------------------------------------------ helpers


def upto_eos(tokens: Sequence[int], eos_id: int) -> list[int]:
  """The tokens up to and including the first EOS (all of them if none)."""
  out = []
  for t in np.asarray(tokens).tolist():
    out.append(int(t))
    if t == eos_id:
      break
  return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def unpad(row: np.ndarray, pad_id: int = 0) -> np.ndarray:
  """An encoded row without its right padding."""
  n = int(np.max(np.nonzero(row != pad_id)[0], initial=-1)) + 1
  return row[:n]



@dataclasses.dataclass
class Acc:
  seconds: list = dataclasses.field(default_factory=list)
  tokens: list = dataclasses.field(default_factory=list)
  target_calls: int = 0
  accepted: int = 0
  rejected: int = 0
  min_pq: float = 0.0

  def add(self, tokens: int, seconds: float) -> None:
    self.tokens.append(tokens)
    self.seconds.append(seconds)

  @property
  def tps(self) -> float:
    return sum(self.tokens) / sum(self.seconds)

  @property
  def median_tps(self) -> float:
    return statistics.median(t / s for t, s in zip(self.tokens, self.seconds))


def make_runners(ours: Ours, hf_target, hf_draft, *, gamma: int, max_decode_len: int,
                 temperature: float, seed: int, methods: Sequence[str]):
  """{method: fn(i, ids_unpadded, inputs_padded) -> (raw output, tokens fn, info fn)}."""
  cfg = ours.config
  hf_kw = dict(max_new_tokens=max_decode_len, temperature=temperature,
               decoder_start_id=cfg.decoder_start_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id)
  counter = CallCounter(hf_target) if hf_target is not None else None
  fns = {}

  def hf(assistant, n_assist, fix=True):
    def run(i, ids, padded):
      if assistant is not None:
        configure_assistant(assistant, n_assist)
      return hf_generate(hf_target, ids, assistant=assistant, assistant_cache_fix=fix,
                         seed=seed * 100003 + i, **hf_kw)
    return run

  def key_for(i):
    return jax.random.fold_in(jax.random.PRNGKey(seed), i)

  if "hf_greedy" in methods:
    fns["hf_greedy"] = hf(None, None)
  if "hf_assisted" in methods:
    fns["hf_assisted"] = hf(hf_draft, gamma)
  if "hf_default" in methods:
    fns["hf_default"] = hf(hf_draft, None)
  if "hf_asis" in methods:
    fns["hf_asis"] = hf(hf_draft, gamma, fix=False)
  if "ours_base" in methods:
    fns["ours_base"] = lambda i, ids, padded: ours_baseline(
        ours, padded, key_for(i), max_decode_len=max_decode_len, temperature=temperature)
  if "ours_spec" in methods:
    fns["ours_spec"] = lambda i, ids, padded: ours_speculative(
        ours, padded, key_for(i), gamma=gamma, max_decode_len=max_decode_len,
        temperature=temperature)
  return fns, counter


def output_tokens(method: str, out: Any, eos_id: int) -> list[int]:
  if method.startswith("hf"):
    return upto_eos(out, eos_id)
  n = int(out.length[0])
  return np.asarray(out.tokens[0, :n]).tolist()


# -------------------------------------------------------------------- bench


@dataclasses.dataclass
class Setting:
  temperature: float
  accs: dict
  mismatches: list  # (example id, method, first differing index, ref tokens, tokens)
  compared: int
  failed: dict = dataclasses.field(default_factory=dict)  # method -> its error, left out


def bench_setting(ours: Ours, hf_target, hf_draft, inputs: np.ndarray, ids: list,
                  *, temperature: float, gamma: int, max_decode_len: int, num_warmup: int,
                  seed: int, methods: Sequence[str], log=print,
                  input_buckets: Sequence[int] = ()) -> Setting:
  eos = ours.config.eos_id
  fns, counter = make_runners(ours, hf_target, hf_draft, gamma=gamma,
                              max_decode_len=max_decode_len, temperature=temperature,
                              seed=seed, methods=methods)
  accs = {m: Acc() for m in fns}
  mismatches, compared = [], 0
  # Ours: each input padded to its bucket (data.fit_to_bucket), one program
  # per width, each compiled and run once here, untimed.
  padded_all = [data.fit_to_bucket(inputs[i:i + 1], input_buckets) for i in range(len(inputs))]
  for i in (group[0] for group in data.by_width(padded_all).values()):
    for m, fn in fns.items():
      if m.startswith("ours"):
        block(fn(i, unpad(inputs[i], ours.config.pad_id), padded_all[i]))
  # Each HF method once on the first input: one that fails in this
  # transformers version is left out (and named), not the whole setting.
  failed = {}
  for m in [m for m in fns if m.startswith("hf")]:
    try:
      fns[m](0, unpad(inputs[0], ours.config.pad_id), padded_all[0])
    except Exception as e:  # noqa: BLE001 (reported in the Setting and the log)
      failed[m] = f"{type(e).__name__}: {str(e)[:200]}"
      log(f"# {LABELS[m]} failed and is left out: {failed[m]}")
      del fns[m], accs[m]
  try:
    for i in range(inputs.shape[0]):
      padded = padded_all[i]
      row = unpad(inputs[i], ours.config.pad_id)
      warm = i < num_warmup
      toks = {}
      for m, fn in fns.items():
        if counter is not None:
          counter.reset()
        out, t = timed(lambda: fn(i, row, padded))
        toks[m] = output_tokens(m, out, eos)
        if warm:
          continue
        a = accs[m]
        a.add(len(toks[m]), t)
        if m.startswith("hf"):
          a.target_calls += counter.n
        else:
          a.target_calls += (len(toks[m]) if m == "ours_base"
                             else int(out.stats.target_calls[0]))
        if m == "ours_spec":
          a.accepted += int(out.stats.accepted[0])
          a.rejected += int(out.stats.rejected[0])
          a.min_pq += float(out.stats.min_pq_sum[0])
      if temperature == 0 and not warm:
        ref_m = "hf_greedy" if "hf_greedy" in toks else next(iter(toks))
        for m, tk in toks.items():
          if m == ref_m:
            continue
          compared += 1
          d = first_difference(toks[ref_m], tk)
          if d is not None:
            mismatches.append((ids[i], m, d, toks[ref_m], tk))
            log(f"MISMATCH temp=0 example={ids[i]} {m} vs {ref_m}: first difference at "
                f"index {d}: {ref_m}={toks[ref_m][max(0, d - 3):d + 4]} "
                f"{m}={tk[max(0, d - 3):d + 4]} (lengths {len(toks[ref_m])}, {len(tk)})")
      if not warm:
        log(f"  temp={temperature:g} example {ids[i]}: " + ", ".join(
            f"{m}={accs[m].tokens[-1]}tok/{accs[m].seconds[-1] * 1e3:.0f}ms" for m in fns))
  finally:
    if counter is not None:
      counter.remove()
  return Setting(temperature, accs, mismatches, compared, failed)


def alpha_of(acc: Acc) -> tuple[float, float]:
  ev = max(acc.accepted + acc.rejected, 1)
  return acc.accepted / ev, acc.min_pq / ev


def setting_table(s: Setting) -> list[str]:
  """Markdown rows: one per method."""
  rows = []
  accs = s.accs
  for m in METHODS:
    if m not in accs:
      continue
    a = accs[m]
    plain = accs.get(PLAIN[m])
    speed = f"{a.tps / plain.tps:.2f}x" if plain is not None else "-"
    med = "-"
    if plain is not None:
      ratios = ((t / s_) / (pt / ps)
                for t, s_, pt, ps in zip(a.tokens, a.seconds, plain.tokens, plain.seconds))
      med = f"{statistics.median(ratios):.2f}x"
    alpha = f"{alpha_of(a)[0]:.3f}" if m == "ours_spec" else "-"
    rows.append(f"| {s.temperature:g} | {LABELS[m]} | {sum(a.tokens)} | {sum(a.seconds):.2f} | "
                f"{a.tps:.1f} | {a.median_tps:.1f} | {speed} | {med} | "
                f"{sum(a.tokens) / max(a.target_calls, 1):.2f} | {alpha} |")
  return rows


TABLE_HEAD = ["temp", "method", "tokens", "seconds", "tok/s (total)",
              "tok/s (median per example)", "speedup vs own plain",
              "median per-example speedup", "tokens / target call", "α (ours)"]


def summary_lines(settings: Sequence[Setting]) -> list[str]:
  out = []
  for s in settings:
    a = s.accs
    if not {"hf_greedy", "hf_assisted", "ours_base", "ours_spec"} <= set(a):
      continue
    ratio = a["ours_spec"].tps / a["hf_assisted"].tps
    ours_sp = a["ours_spec"].tps / a["ours_base"].tps
    hf_sp = a["hf_assisted"].tps / a["hf_greedy"].tps
    alpha, alpha_pq = alpha_of(a["ours_spec"])
    line = (f"- temp {s.temperature:g}: ours speculative / HF assisted (constant γ) tokens/s = "
            f"**{ratio:.2f}x** (goal >= 5x: {'met' if ratio >= 5 else 'NOT met'}); "
            f"speedup over own plain decoding: ours {ours_sp:.2f}x vs HF {hf_sp:.2f}x "
            f"(goal ours > HF: {'met' if ours_sp > hf_sp else 'NOT met'})")
    if "hf_default" in a:
      line += (f"; vs HF assisted with its defaults: "
               f"{a['ours_spec'].tps / a['hf_default'].tps:.2f}x"
               f" (HF default speedup {a['hf_default'].tps / a['hf_greedy'].tps:.2f}x)")
    if "hf_asis" in a:
      line += (f"; vs HF assisted without the workaround: "
               f"{a['ours_spec'].tps / a['hf_asis'].tps:.2f}x (its speedup "
               f"{a['hf_asis'].tps / a['hf_greedy'].tps:.2f}x)")
    line += f"; our α = {alpha:.3f} (Σmin(p,q) estimate {alpha_pq:.3f})"
    if s.temperature == 0:
      line += (f"; identical outputs: {s.compared - len(s.mismatches)}/{s.compared} "
               f"comparisons with HF generate ({len(s.mismatches)} mismatches)")
    out.append(line)
  return out


def machine_line() -> str:
  """The machine (``common.machine_description``), its load, and the
  versions of torch and transformers."""
  import torch
  import transformers
  from transformers.utils import is_sklearn_available
  return (f"{common.machine_description()}; load average {common.load_average()}; "
          f"torch {torch.__version__} (threads={torch.get_num_threads()}), transformers "
          f"{transformers.__version__} (scikit-learn "
          f"{'present' if is_sklearn_available() else 'absent'}: the assistant confidence "
          f"threshold is {'tuned online' if is_sklearn_available() else 'fixed'})")


