r"""Speculative decoding vs the baseline at several γ, side by side in one run.

  python scripts/bench_speculative.py                       # the demo pair
  python scripts/bench_speculative.py --target=... --draft=... --source=... \
      --gammas=1,2,3,5,7,auto --temperatures=0,1 --num_examples=20
  python scripts/bench_speculative.py --gammas=1,2,3,4,5,6,7,auto --adaptive --gamma_max=7
  python scripts/bench_speculative.py --gammas=3,5 --gamma_max=7 \
      --adaptive_rule=threshold,cumulative --adaptive_threshold=0.6,0.5 --adaptive_skip_below=0.3
  python scripts/bench_speculative.py --gammas=3,4 \
      --drafts=t5:checkpoints/demo/draft_small,t5:checkpoints/demo/draft_tiny,prompt_lookup
  python scripts/bench_speculative.py --gammas=3 --drafts=full=t5:checkpoints/demo/draft_tiny_feat,\
sl=t5:checkpoints/demo/draft_tiny_feat@checkpoints/demo/draft_shortlist.json

For every example the baseline and each γ are timed back to back (interleaved,
so drift on a noisy machine hits all columns alike); compile time is excluded
(one warm-up example); every call ends in ``block_until_ready``; the table
reports totals (tokens / total seconds) and the median per-example speedup.
``--drafts`` compares several approximation models the same way: all of
them, every γ, interleaved per example beside one baseline. Adaptive settings
(``AdaptiveConfig``, γ_max = ``--gamma_max``) are its fields as flags,
``--adaptive_<field>``, each with one value per setting or one for all.
The measuring loop lives in ``lab.sweep``.

Columns: tokens/s of each; speedup; measured α (both estimators); tokens per
target call; c (draft time per token / target step); v (target pass over γ+1
tokens / target step); the prediction of Theorem 3.8 generalized by v,
(1 - α^(γ+1)) / ((1 - α)(γc + v)); and measured / predicted (the engine's
overhead: 1.0 means none).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

from specdec_jax import drafts
from specdec_jax.data import parse_input_buckets
from specdec_jax.decoding import AdaptiveConfig
from specdec_jax.run import (Experiment, check_before_loading, held_out_inputs, load_data,
                             load_draft, load_models)
from specdec_jax.run.setup import partitioners
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting import script_args

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab.sweep import gamma_sweep, markdown_table, parse_widths  # noqa: E402


# --adaptive: six settings, as if given by their flags.
ADAPTIVE_PRESET = dict(rule="threshold,threshold,threshold,cumulative,cumulative,schedule",
                       threshold="0.4,0.7,0.4,0.3,0.3,none",
                       skip_below="none,none,0.4,none,0.4,none")


def adaptive_settings(args) -> list[AdaptiveConfig]:
  """The adaptive settings of the --adaptive_<field> flags (or --adaptive's),
  each verifying at --adaptive_widths."""
  if args.adaptive:
    for name, values in ADAPTIVE_PRESET.items():
      setattr(args, f"adaptive_{name}", values)
  return script_args.dataclasses_from_flags(
      AdaptiveConfig, args, prefix="adaptive_",
      widths=parse_widths(args.adaptive_widths, args.gamma_max))


def bench(args) -> str:
  gammas = script_args.comma_list(args.gammas)
  adaptive = adaptive_settings(args)
  numeric = [int(g) for g in gammas if g.isdigit()]
  specs = (parse_drafts(args.drafts) if args.drafts
           else {None: (args.draft_name, args.draft, args.draft_shortlist)})
  exps = {label: Experiment(
      task=args.task, source=args.source, vocab_path=args.vocab,
      target_checkpoint=args.target, draft_name=name,
      draft_checkpoint=ckpt if ckpt and drafts.takes(name, "model") else "",
      draft_shortlist=shortlist,
      max_input_len=args.max_input_len, max_decode_len=args.max_decode_len,
      num_warmup=1, num_examples=args.num_examples, dtype=args.dtype,
      gamma=max(numeric + [args.gamma_max]), ngram_corpus=args.ngram_corpus)
      for label, (name, ckpt, shortlist) in specs.items()}
  for e in exps.values():   # every draft checked before anything is loaded
    check_before_loading(e)
  exp = next(iter(exps.values()))
  data = load_data(exp)
  setup = load_models(exp, data)   # the target once; each further draft beside it
  _, draft_part = partitioners(exp)
  named = {label: setup.draft if e is exp
           else load_draft(e, data, setup.target, draft_part, setup.target_params)
           for label, e in exps.items()}
  draft = setup.draft if args.drafts is None else named
  alpha_inputs = None
  if "auto" in gammas and args.auto_alpha_examples > 0:
    alpha_inputs = held_out_inputs(exp, args.auto_alpha_source, args.auto_alpha_examples)
  buckets = parse_input_buckets(args.input_buckets, args.max_input_len)
  rows = []
  for temp in script_args.comma_list(args.temperatures, float):
    rows += gamma_sweep(setup.target, setup.target_params, draft, setup.inputs, gammas,
                        SamplingConfig(temperature=temp), exp.max_decode_len, args.seed,
                        gamma_max=args.gamma_max, alpha_inputs=alpha_inputs,
                        adaptive=adaptive, input_buckets=buckets)
    # A temperature's programs are not run again: dropping them keeps the
    # compiled code (one program per draft x setting x bucket) within the
    # process's memory maps (--drafts help).
    jax.clear_caches()
  lines = [markdown_table(rows)]
  for r in rows:
    if "auto" in r:  # what 'auto' saw and why it chose its γ (autogamma.GammaChoice)
      a = r["auto"]
      curve = ", ".join(f"{g}: {x:.2f}x ± {a['gap_se'][g]:.2f}"
                        for g, x in a["predicted"].items())
      who = f" {r['draft']}" if "draft" in r else ""
      lines.append(f"\nT={r['temperature']:g}{who} auto: α {a['alpha_warmup']:.3f} ± "
                   f"{a['alpha_se']:.3f} on {a['alpha_tokens']} tokens; predicted (± s.e. of "
                   f"the gap to the best) "
                   f"{curve}; argmax {a['argmax']}, chosen {a['gamma']}"
                   + (" (plain decoding: no γ is predicted to pay)" if a["gamma"] == 0 else ""))
  return "\n".join(lines)


def parse_drafts(text: str) -> dict[str, tuple[str, str, str]]:
  """'t5:ckpt_a,t5:ckpt_b,prompt_lookup' -> {row label: (draft name,
  checkpoint, shortlist)}; 't5:ckpt@list.json' gives the draft a vocabulary
  shortlist (Experiment.draft_shortlist).

  A label is the checkpoint's directory name for 't5' ('+shortlist' added
  with one), 'name:dir' for other drafts that take a checkpoint (lookup_t5),
  the bare name otherwise; or given: 'old=t5:ckpt_a' (two checkpoints in
  directories of one name).
  """
  out: dict[str, tuple[str, str, str]] = {}
  for item in (t.strip() for t in text.split(",")):
    if not item:
      continue
    given, eq, rest = item.partition("=")
    if not eq:
      given, rest = "", item
    name, _, ckpt = rest.partition(":")
    ckpt, _, shortlist = ckpt.partition("@")
    if name not in drafts.REGISTRY:
      raise ValueError(f"--drafts: unknown draft {name!r} in {item!r}; registered: "
                       f"{', '.join(sorted(drafts.REGISTRY))}")
    if "model" in drafts.requires(name) and not ckpt:
      raise ValueError(f"--drafts: {name!r} needs a checkpoint: write {name}:<path>")
    base = Path(ckpt.rstrip("/")).name if ckpt else ""
    label = given or ((base if name == "t5" else f"{name}:{base}" if base else name)
                      + ("+shortlist" if shortlist else ""))
    if label in out:
      raise ValueError(f"--drafts: two drafts would both be labelled {label!r}; name them: "
                       f"label=name:checkpoint")
    out[label] = (name, ckpt, shortlist)
  if not out:
    raise ValueError(f"--drafts: no draft in {text!r}")
  return out


def parser() -> argparse.ArgumentParser:
  """The script's flags."""
  p = script_args.new_parser(__doc__)
  script_args.add_pair_arguments(p)
  p.add_argument("--draft_name", default="t5",
                 help=f"the approximation model (registered: {', '.join(sorted(drafts.REGISTRY))})")
  script_args.add_shortlist_argument(p)
  p.add_argument("--drafts", default=None,
                 help="compare several drafts in one run, interleaved per example beside one "
                      "baseline: comma-separated 'name[:checkpoint]', e.g. "
                      "t5:checkpoints/demo/draft_small,t5:checkpoints/demo/draft_tiny,"
                      "prompt_lookup; 'label=name:checkpoint' names a row "
                      "(replaces --draft/--draft_name). Every draft x setting x input "
                      "bucket is its own compiled loop, and compiled code is dropped only "
                      "after each temperature: many drafts x settings (adaptive ones compile "
                      "one loop per width) x buckets can exhaust the process's memory maps "
                      "(vm.max_map_count); compare drafts on a few settings, or with "
                      "--input_buckets=none")
  p.add_argument("--ngram_corpus", default=None,
                 help="training data of the n-gram drafts (Experiment.ngram_corpus)")
  script_args.add_decoding_arguments(
      p, gammas="1,2,3,5,7,auto",
      gammas_help="'auto' adds the row of the γ chosen by specdec_jax.run.autogamma (§3.5 "
                  "with measured c and v); adaptive settings: the --adaptive_<field> flags")
  p.add_argument("--gamma_max", type=int, default=8,
                 help="largest γ 'auto' considers; γ_max of the adaptive settings")
  p.add_argument("--auto_alpha_source", default=script_args.ALPHA_SOURCE,
                 help="examples 'auto' estimates α on (held out from --source: the demo's "
                      "validation chapters)")
  p.add_argument("--auto_alpha_examples", type=int, default=32,
                 help="how many of them; 0: the warm-up example alone")
  p.add_argument("--adaptive", action="store_true",
                 help="six adaptive settings, as if given by their flags: "
                      + "; ".join(f"--adaptive_{k}={v}" for k, v in ADAPTIVE_PRESET.items()))
  script_args.dataclass_flags(p, AdaptiveConfig, prefix="adaptive_", many=True,
                              skip=("widths",))
  p.add_argument("--adaptive_widths", default="all",
                 help="verification widths the adaptive settings compile: 'all' (1..γ_max: "
                      "a round verifies exactly its longest proposal, what batch 1 wants "
                      "where v(k) grows with k, as on a CPU), 'default' (powers of two and "
                      "γ_max: fewer compilations), or a list such as 1,2,4,7 "
                      "(AdaptiveConfig.widths)")
  p.add_argument("--num_examples", type=int, default=20, help="timed examples")
  p.add_argument("--dtype", default="float32", help="activation dtype")
  return p


def main(argv: list[str] | None = None) -> None:
  args = script_args.parse(parser(), argv, paths=("auto_alpha_source", "ngram_corpus"))
  who = f"drafts={args.drafts}" if args.drafts else f"draft={args.draft_name}:{args.draft}"
  print(f"# bench_speculative: target={args.target} {who} "
        f"examples={args.num_examples} device={jax.devices()[0].device_kind} "
        f"backend={jax.default_backend()}")
  print(bench(args))


if __name__ == "__main__":
  script_args.run_main(main)
