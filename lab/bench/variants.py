"""Each kernel variant against the default path, one section per variant
(``variant_NAME``), so that a variant that fails to compile on the card
costs only its own section.

A variant is a set of overrides of the default path (``VARIANTS``). Its
section times, interleaved in one process with the same weights, the
one-token step and the γ + 1 = 8-position pass of the XXL- and XL-sized
targets and the one-token steps of the small/base/large-sized drafts, with
and without the variant, each also as a percentage of its weight-bytes floor
(``common.bandwidth_for``); then, for the variants in ``COUNTED``, counts T = 0 mismatches (speculative output
against the baseline's) in bfloat16 with and without it: on configs/demo.gin's
pair (``exactness.exactness_row``, γ 3) and on ``Sizes.mismatch_inputs``
random inputs of the XXL-sized target with a small-sized draft steered to
α 0.75 (``steered.SteeredDraft``, γ 7: so that positions deep in the pass
are committed too). The default path's counts are the same in every variant
section: the first section records them (``default_path`` in
bench_gpu.json), later ones read them (smoke mode counts the variant's only).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from specdec_jax import memory
from specdec_jax.decoding import speculative_decode, temperature_sample
from specdec_jax.drafts import T5Draft
from specdec_jax.models.t5 import T5Config, T5Model, fuse_projections
from specdec_jax.run import Experiment
from specdec_jax.run.programs import command_buffer_options
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting import script_args
from specdec_jax.timing import interleaved_medians_ms

from lab.bench.common import (PAPER_GAMMA, Model, Sizes, bandwidth_for,
                              decode_loop, draft_seed, earlier, emit, log,
                              pass_name, random_inputs, random_params, record)
from lab.bench.exactness import demo_pair, exactness_row
from lab.bench.steered import SteeredDraft

# A variant's overrides of the default path, by kind (any may be left out):
#   config            T5Config fields of both models: the timed pieces and the
#                     XXL-sized loops (``fused_projections`` fuses the same weights);
#   target_config     T5Config fields of the targets alone (on top of config);
#   experiment        Experiment fields: the demo pair's run (run.prepare);
#   compiler_options  XLA options for the timed pieces' compile
#                     (``jax.stages.Lowered.compile(compiler_options=...)``).
VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    # The Pallas decoder layer (specdec_jax.kernels), both models.
    "pallas": dict(config=dict(decode_kernel="pallas"),
                   experiment=dict(decode_kernel="pallas")),
    # Every target call scores 8 positions: step and pass logits bit-equal.
    "fixed_positions": dict(target_config=dict(fixed_positions=8),
                            experiment=dict(fixed_positions=8)),
    # Query/key/value and wi_0/wi_1 as one product each (same weights, fused).
    "fused_projections": dict(config=dict(fused_projections=True),
                              experiment=dict(fused_projections=True)),
    # XLA command buffers (CUDA graphs), timed by the clock.
    "command_buffers": dict(compiler_options=command_buffer_options(1),
                            experiment=dict(command_buffers=1)),
    # One-row weight products padded to two rows (T5Config.min_rows).
    "min_rows": dict(config=dict(min_rows=2), experiment=dict(min_rows=2)),
}
# Variants already timed on a card: among the earlier tables ('more').
TIMED_BEFORE = ("min_rows",)
# The variants whose T = 0 mismatches are counted (the paths that claim or
# may change T = 0 identity); the others are timed only.
COUNTED = ("fixed_positions", "pallas")

GREEDY = SamplingConfig(temperature=0.0)
DEMO_GAMMA = 3            # configs/demo.gin's
MISMATCH_ALPHA = 0.75     # Table 2's EnDe small row
KINDS = ("config", "target_config", "experiment", "compiler_options")


def section_name(variant: str) -> str:
  return f"variant_{variant}"


def check_variant(name: str) -> dict[str, dict[str, Any]]:
  """The variant's overrides, each key checked against what it overrides."""
  if name not in VARIANTS:
    raise ValueError(f"unknown variant {name!r}; VARIANTS holds {sorted(VARIANTS)}")
  v = VARIANTS[name]
  bad = [k for k in v if k not in KINDS]
  if bad:
    raise ValueError(f"variant {name!r}: unknown kind(s) {bad}; a variant overrides {KINDS}")
  for kind, cls in (("config", T5Config), ("target_config", T5Config),
                    ("experiment", Experiment)):
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(v.get(kind, {})) - fields)
    if unknown:
      raise ValueError(f"variant {name!r}: {cls.__name__} has no field(s) {unknown}")
  return v


def variant_config(cfg: T5Config, v: dict, role: str) -> T5Config:
  """``cfg`` (of a 'target' or 'draft') with the variant's config overrides."""
  over = dict(v.get("config", {}))
  if role == "target":
    over.update(v.get("target_config", {}))
  return cfg.replace(**over)


def variant_params(cfg: T5Config, params: Any) -> Any:
  """The default path's ``params`` as the variant's model ``cfg`` reads them."""
  return fuse_projections(params) if cfg.fused_projections else params


def variant_piece(m: Model, k: int, sz: Sizes, options: dict | None
                  ) -> tuple[Callable[[], Any], float]:
  """``Model.piece`` compiled with the variant's XLA ``options``, if any."""
  if not options:
    return m.piece(k, sz)
  t0 = time.perf_counter()
  fn = jax.jit(decode_loop(T5Model(m.config), k, sz.position, sz.inner))
  exe = fn.lower(m.params, m.cache).compile(dict(options))
  secs = time.perf_counter() - t0
  log(f"{m.name} k={k}: compiled in {secs:.1f} s")
  return (lambda: exe(m.params, m.cache)), secs


def section_variant(name: str, sz: Sizes, out: Path, smoke: bool = False) -> None:
  v = check_variant(name)
  options = v.get("compiler_options")
  gbps, source = bandwidth_for(sz, out)
  models = []
  for i, (tname, cfg) in enumerate(sz.targets.items()):
    if smoke and i:  # smoke: one target shows the path
      continue
    models.append((f"target {tname}", cfg, i, (1, PAPER_GAMMA + 1), "target"))
  for dname, cfg in sz.drafts.items():
    models.append((f"draft {dname}", cfg, draft_seed(dname), (1,), "draft"))
  pieces, compile_s, configs = {}, {}, {}
  for label, cfg, seed, ks, role in models:
    base = Model.random(label, cfg, sz, seed)
    vcfg = variant_config(cfg, v, role)
    var = Model.random(f"{label} ({name})", vcfg, sz, seed,
                       params=variant_params(vcfg, base.params))
    configs[label] = cfg
    for k in ks:
      pieces[(label, k, "default")], compile_s[(label, k, "default")] = base.piece(k, sz)
      pieces[(label, k, name)], compile_s[(label, k, name)] = variant_piece(var, k, sz, options)
  ms = interleaved_medians_ms(pieces, sz.repeats, sz.inner)
  head = ["model", "pass", "default ms", f"{name} ms", f"{name} / default",
          "default % of floor", f"{name} % of floor", "compile s (default / variant)"]
  lines = [f"Variant **{name}**: {VARIANTS[name]}. Random bfloat16 weights (the same with and "
           f"without it), batch 1, cache {sz.cache_len}, {sz.inner} passes per timed call, "
           f"medians of {sz.repeats} interleaved calls; floors at {gbps:.0f} GB/s ({source}).",
           "", script_args.markdown_header(head)]
  rows = []
  for label, _, _, ks, _ in models:
    floor = 1e3 * memory.step_weight_bytes(configs[label], None, "bfloat16") / (gbps * 1e9)
    for k in ks:
      d, w = ms[(label, k, "default")], ms[(label, k, name)]
      lines.append(script_args.markdown_row(
          [label, pass_name(k), f"{d:.3f}", f"{w:.3f}", f"**{w / d:.2f}**",
           f"{100 * floor / d:.0f}%", f"{100 * floor / w:.0f}%",
           f"{compile_s[(label, k, 'default')]:.1f} / {compile_s[(label, k, name)]:.1f}"]))
      rows.append(dict(model=label, k=k, default_ms=d, variant_ms=w, floor_ms=floor))
  print("\n".join(lines), flush=True)
  payload: dict[str, Any] = dict(variant=name, overrides=VARIANTS[name], gbps=gbps, passes=rows)
  record(out, section_name(name), payload, None)
  del pieces

  if name not in COUNTED:
    record(out, section_name(name), payload, "\n".join(lines))
    return
  # T = 0 mismatches in bfloat16, the default path's from an earlier variant
  # section of this run where there is one.
  default = earlier(out, "default_path") or {}
  if smoke:  # the same code as the variant's counts: the smoke test runs it once
    default = dict(mismatches=None)
  elif "mismatches" not in default:
    default = dict(mismatches=mismatch_counts(sz, {}, smoke))
    record(out, "default_path", default, None)
  counts = mismatch_counts(sz, v, smoke)
  mhead = ["path", f"demo verses mismatching (of {sz.exact_examples})",
           f"XXL-sized random inputs mismatching (of {sz.mismatch_inputs})",
           "first mismatching (demo; random)"]
  mlines = ["", f"T = 0 mismatches in bfloat16 (speculative output vs the baseline's): "
            f"configs/demo.gin's pair, γ {DEMO_GAMMA}; the XXL-sized target with a "
            f"small-sized draft steered to α {MISMATCH_ALPHA}, γ {PAPER_GAMMA}, "
            f"{sz.mismatch_tokens} new tokens each, batch 1.", "",
            script_args.markdown_header(mhead)]
  for path, c in (("default", default["mismatches"]), (name, counts)):
    if c is None:
      mlines.append(script_args.markdown_row([path, "-", "-", "not counted in smoke mode"]))
      continue
    mlines.append(script_args.markdown_row(
        [path, _count(c["demo"]), _count(c["random"]),
         f"{_first(c['demo'])}; {_first(c['random'])}"]))
  payload.update(mismatches=counts, default_mismatches=default["mismatches"])
  record(out, section_name(name), payload, "\n".join(lines + mlines))
  emit(mlines)


def _count(c: dict) -> str:
  return f"failed ({c['error']})" if "error" in c else f"**{c['mismatches']}**"


def _first(c: dict) -> str:
  return ", ".join(map(str, c.get("mismatching", [])[:3])) or "-"


def mismatch_counts(sz: Sizes, v: dict, smoke: bool) -> dict:
  """T = 0 mismatches of the path ``v`` overrides (``{}``: the default path)
  on the demo pair and on random XXL-sized inputs; a part that fails is
  reported as its error (the other still runs)."""
  out = {}
  try:
    with tempfile.TemporaryDirectory(prefix="bench_variant_") as tmp:
      target, draft, shortlist = demo_pair(smoke, Path(tmp), feature_draft=True)
      row = exactness_row(sz, target, draft, shortlist, DEMO_GAMMA, "bfloat16", "default",
                          overrides=v.get("experiment", {}))
    out["demo"] = dict(mismatches=row["mismatches"], mismatching=row["mismatching"],
                       verses=row["verses"])
  except Exception as e:  # noqa: BLE001 (a row of the table, not the end of the section)
    out["demo"] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
  try:
    out["random"] = random_mismatches(sz, v)
  except Exception as e:  # noqa: BLE001
    out["random"] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
  for part, c in out.items():
    log(f"mismatches ({'default' if not v else 'variant'}) {part}: {c}")
  return out


def random_mismatches(sz: Sizes, v: dict) -> dict:
  """Inputs (of ``sz.mismatch_inputs`` random ones) whose speculative output
  differs from the baseline's: the XXL-sized target and a small-sized draft
  steered to ``MISMATCH_ALPHA``, batch 1, on the path ``v`` overrides (the
  same weights on every path)."""
  base = sz.targets["xxl"]
  tcfg = variant_config(base, v, "target")
  target = T5Model(tcfg)
  params = variant_params(tcfg, random_params(T5Model(base), jax.random.PRNGKey(0), "bfloat16"))
  dbase = sz.drafts["small"]
  dmodel = T5Model(variant_config(dbase, v, "draft"))
  draft = T5Draft(params=variant_params(dmodel.config, random_params(
      T5Model(dbase), jax.random.PRNGKey(draft_seed("small")), "bfloat16")), model=dmodel)
  n, key = sz.mismatch_tokens, jax.random.PRNGKey(2)
  bad = []
  t0 = time.perf_counter()
  for i in range(sz.mismatch_inputs):
    x = random_inputs(tcfg, 1, sz.input_len, seed=1000 + i)
    ref = temperature_sample(target, params, x, key, max_decode_len=n, sampling=GREEDY,
                             eos_id=-1).tokens
    steered = SteeredDraft.build(draft, ref, [MISMATCH_ALPHA], seed=i)
    got = speculative_decode(target, params, steered, x, key, gamma=PAPER_GAMMA,
                             max_decode_len=n, sampling=GREEDY, eos_id=-1).tokens
    if not np.array_equal(np.asarray(ref), np.asarray(got)):
      bad.append(i)
  log(f"random mismatches: {sz.mismatch_inputs} inputs in {time.perf_counter() - t0:.1f} s "
      "(compilation included)")
  return dict(mismatches=len(bad), mismatching=bad, inputs=sz.mismatch_inputs, tokens=n)
