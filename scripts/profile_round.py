r"""Per-round overhead of speculative decoding: draft, target pass, standardize,
kernel and the rest of a round, in ms per round (``lab.rounds``).

  python scripts/profile_round.py                  # the demo pair
  python scripts/profile_round.py --gammas=1,3,5 --temperatures=0,1 \
      --num_examples=8 --repeats=5

``--compare_rev REV`` prints instead, for the sampling.py / speculative.py of
git revision REV against the current ones (interleaved, one process, same
inputs): µs per standardize p + kernel at each (T, γ) and per softmax +
sample_any draw, and whether the kernel's outputs are identical.

``--contention MB,...`` prints instead how much the target's k-token pass
slows down when that much other data (a stand-in for the draft's weights) is
read before each pass: the models' contention for the last-level cache that
Theorem 3.8's additive cost model leaves out.

  python scripts/profile_round.py --contention=4,8,12,16 --repeats=15

``--adaptive_pieces K,...`` prints instead, per k, the draft's k proposals and
the target's (k+1)-token pass as the fixed-γ loop runs them and as an
adaptive round with γ_max = max(--gammas) runs them (``replay.adaptive_pieces``).

  python scripts/profile_round.py --adaptive_pieces=1,2,3,4 --gammas=7

``--confidence_auc`` prints instead, in the engine's fixed-γ rounds at T > 0,
how well each confidence an adaptive rule can read after x_i (max q_i, or
q_i(x_i) of the token drawn: ``AdaptiveConfig.confidence``) predicts x_i's
acceptance (``probes.confidence_auc``; no timing).

  python scripts/profile_round.py --confidence_auc --temperatures=1 --gammas=5 \
      --source=data/bible/validation.tsv --num_examples=150

``--acceptance_head`` prints instead how well an acceptance predictor
(SpecDec++'s head as a linear probe: a logistic regression on the draft's
softmax statistics, and on those plus its hidden state) fitted on a held-out
split's rounds predicts x_i's acceptance in --source's (``probes.head_auc``;
no timing).

  python scripts/profile_round.py --acceptance_head --gammas=7 \
      --num_examples=500 --temperatures=0,1

``--adaptive_replay RULE`` (a bench_speculative setting, e.g. cumulative:0.5)
prints instead what the rule's rounds cost as the rule decides them and
replayed as a fixed schedule of the same widths (same rounds, checked),
shuffled, and at each constant width 1..γ_max (``replay.adaptive_replay``);
at T=0 also what fixed γ, threshold and cumulative rules and a perfect
acceptance predictor would cost at those widths' measured ms per round
(``stopping.simulate_stopping`` along the target's greedy outputs, with the draft's
confidences and verdicts from the engine's own rounds, ``probes.engine_records``).

  python scripts/profile_round.py --adaptive_replay=cumulative:0.5 --gammas=7 \
      --temperatures=0 --num_examples=24 --repeats=4

``--whole_run WORKDIR`` prints instead, for a finished fixed-γ batch-1 runner
workdir, how its SPEED falls short of EXP (with v) step by step: the round's
interplay, the measured tokens per target call, and each example's prefill
(timed here per input width), then what is left (``specdec_jax.run.account``).

  python -m specdec_jax.run --config=configs/demo.gin --workdir=runs/demo
  python scripts/profile_round.py --whole_run=runs/demo
"""

from __future__ import annotations

import sys
from pathlib import Path
import os

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.decoding import cache_length
from specdec_jax.run import Experiment, held_out_inputs, prepare
from specdec_jax.run import account as accounting
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting import script_args
from specdec_jax.scripting.script_args import comma_list, load_average, markdown_header

sys.path.append(str(Path(__file__).resolve().parents[1]))  # lab/, beside scripts/ (not installed)
from lab import accounting as research_accounting  # noqa: E402
from lab import probes, replay, stopping  # noqa: E402
from lab.contention import (cache_contention, contention_markdown,
                                             decode_working_set_mb)  # noqa: E402
from lab.revisions import compare_acceptance  # noqa: E402
from lab.rounds import markdown, profile_round  # noqa: E402
from lab.sweep import parse_setting  # noqa: E402


def compare(args, gammas: list[int], temperatures: list[float]) -> None:
  print(f"# {args.compare_rev} vs working tree: V={args.vocab_size}, batch 1, 64 calls per "
        f"timed jit call, 30 interleaved repeats (medians); load average {load_average()}\n")
  print(markdown_header(["piece", "T", "γ", f"{args.compare_rev} µs", "now µs", "change",
                         "kernel outputs identical (n, next, accepted, min_pq)"]))
  for r in compare_acceptance(args.compare_rev, args.vocab_size, gammas, temperatures):
    t = "" if r["temperature"] is None else f"{r['temperature']:g}"
    g = "" if r["gamma"] is None else r["gamma"]
    same = "" if r["identical"] is None else ", ".join(map(str, r["identical"]))
    print(f"| {r['what']} | {t} | {g} | {r['rev_us']:.1f} | {r['now_us']:.1f} "
          f"| {100 * (r['now_us'] / r['rev_us'] - 1):+.0f}% | {same} |")
  print(f"\nload average at end {load_average()}")


def contention(args, setup) -> None:
  target_cfg = setup.target.config
  draft_cfg = getattr(getattr(setup.draft, "model", None), "config", None)
  print(f"# cache contention: target={args.target} (decode working set "
        f"{decode_working_set_mb(target_cfg):.1f} MB)"
        + (f", draft={args.draft} ({decode_working_set_mb(draft_cfg):.1f} MB)" if draft_cfg
           else "")
        + f"; batch 1, inner {args.inner}, repeats {args.repeats}; load average "
        f"{load_average()}\n", flush=True)
  ks = comma_list(args.contention_ks, int)
  rows = cache_contention(setup.target, setup.target_params, jnp.asarray(setup.inputs[:1]),
                          ks, comma_list(args.contention, float),
                          # the runner's cache length at γ = k - 1, as the other pieces
                          cache_len=args.max_decode_len + max(ks), position=args.position,
                          inner=args.inner, repeats=args.repeats)
  print(f"{contention_markdown(rows)}\n\nload average at end {load_average()}")


def stopping_table(setup, result, gamma_max: int, args, skip_below=None) -> None:
  """Offline T=0 replay of stopping rules (``stopping.simulate_stopping``) with
  the constant-width ms per round just measured."""
  round_ms = {int(r.setting.split()[1]): r.ms_per_round for r in result.rows
              if r.setting.startswith("width ")}
  # Fixed γ is priced by the fixed-γ loop's own rounds, the rules by the
  # adaptive loop's constant widths: the comparison the benchmark makes.
  fixed_ms = {int(r.setting.split()[1]): r.ms_per_round for r in result.rows
              if r.setting.startswith("fixed ")}
  # The engine's own fixed-γ_max rounds at T=0: the draft's confidences as
  # the rules read them (with its bridges and shortlist) and the verdicts.
  rec = probes.engine_records(setup.target, setup.target_params, setup.draft,
                              jnp.asarray(setup.inputs[1:]), jax.random.PRNGKey(0), gamma_max,
                              SamplingConfig(), args.max_decode_len)
  conf, ok, seen = probes.along_outputs(rec)
  bonus = sum(int((~m).sum()) for m in seen)
  fixed = {g: stopping.simulate_stopping(conf, ok, fixed_ms, "fixed", g) for g in fixed_ms}
  best = min(fixed, key=lambda g: fixed[g].ms_per_token)
  acc = np.concatenate(ok)
  print(f"Stopping rules replayed offline along the target's greedy outputs (T=0, "
        f"{len(acc)} positions, draft accepts {acc.mean():.3f}; the draft's confidences and "
        f"verdicts from the engine's own γ={gamma_max} rounds; {bonus} bonus positions, which "
        f"no draft step saw, count as accepted with confidence 1), with the ms per round of "
        f"the adaptive loop's constant widths above (fixed γ: the fixed loop's); relative to "
        f"the best fixed γ ({best}):\n\n"
        + markdown_header(["rule", "ms per token", "tokens per round", "mean width",
                           "vs best fixed"]))
  rows = [(f"fixed {g}", r) for g, r in fixed.items()]
  # With a measured width-0 round (the rule has skip_below), also the
  # threshold rules with that skip_below.
  skips = [None] + ([skip_below] if skip_below is not None and 0 in round_ms else [])
  for rule in ("threshold", "cumulative"):
    for skip in skips:
      for t in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
        rows.append((f"{rule} {t:g}" + ("" if skip is None else f" skip {skip:g}"),
                     stopping.simulate_stopping(conf, ok, round_ms, rule, gamma_max, t, skip)))
  rows.append(("oracle (perfect acceptance predictor)",
               stopping.simulate_stopping(conf, ok, round_ms, "oracle", gamma_max)))
  for name, r in rows:
    print(f"| {name} | {r.ms_per_token:.3f} | {r.tokens_per_round:.2f} | {r.mean_width:.2f} "
          f"| {fixed[best].ms_per_token / r.ms_per_token:.3f}x |")
  print(flush=True)


def acceptance_head(args, exp, setup, gamma: int, temperatures) -> None:
  """``--acceptance_head``: fit on the held-out split's rounds, score on --source's."""
  train_inputs = held_out_inputs(exp, args.head_source, args.num_examples)
  print(f"Acceptance of x_i predicted from what the draft knows after x_i, in the engine's "
        f"own γ={gamma} rounds: fitted on {args.num_examples} inputs of {args.head_source}, "
        f"AUC on {len(setup.inputs)} of {args.source} (probes.head_auc)\n\n"
        + markdown_header(["T", "positions fitted / scored", "acceptance", "AUC top probability",
                           "AUC logistic on softmax statistics + i",
                           "AUC the same + hidden state"]))
  for temp in temperatures:
    kw = dict(key=jax.random.PRNGKey(0), gamma=gamma, sampling=SamplingConfig(temperature=temp),
              max_decode_len=args.max_decode_len)
    train = probes.engine_records(setup.target, setup.target_params, setup.draft,
                                  jnp.asarray(train_inputs), **kw)
    test = probes.engine_records(setup.target, setup.target_params, setup.draft,
                                 jnp.asarray(setup.inputs), **kw)
    a = probes.head_auc(train, test)
    print(f"| {temp:g} | {len(train.top)} / {len(test.top)} | {test.accepted.mean():.3f} | "
          f"{a['top']:.3f} | {a['scalars']:.3f} | {a['hidden']:.3f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
  p = script_args.new_parser(__doc__)
  script_args.add_pair_arguments(p)
  script_args.add_shortlist_argument(p)
  script_args.add_decoding_arguments(p, gammas="1,3,5", input_buckets=False, seed=False)
  p.add_argument("--num_examples", type=int, default=8, help="examples for the full round")
  p.add_argument("--repeats", type=int, default=5, help="interleaved passes (medians)")
  p.add_argument("--inner", type=int, default=8, help="runs of a piece per timed call")
  p.add_argument("--position", type=int, default=32, help="decoder position of the pieces")
  p.add_argument("--compare_rev", default="", help="git revision to compare the kernel with")
  p.add_argument("--vocab_size", type=int, default=8000, help="V for --compare_rev")
  p.add_argument("--contention", default="",
                 help="MB list: print instead the target pass's slowdown when that much other "
                      "data is read before each pass (the draft's footprint in a round)")
  p.add_argument("--contention_ks", default="1,3", help="target pass widths for --contention")
  p.add_argument("--adaptive_pieces", default="",
                 help="k list: print instead the draft's k proposals and the target's k+1-token "
                      "pass as the fixed-γ loop and as an adaptive round (γ_max = max of "
                      "--gammas) run them")
  p.add_argument("--adaptive_replay", default="",
                 help="an adaptive setting (threshold:t, cumulative:t, schedule): print instead "
                      "its rounds' ms as decided, replayed, shuffled and at constant widths "
                      "(γ_max = max of --gammas; --repeats passes over --num_examples - 1)")
  p.add_argument("--confidence_auc", action="store_true",
                 help="print instead, in fixed-γ rounds at each T > 0 of --temperatures, how "
                      "well max q_i and q_i(x_i) predict x_i's acceptance (AUC; no timing)")
  p.add_argument("--acceptance_head", action="store_true",
                 help="print instead, per T of --temperatures at γ = max of --gammas, how well "
                      "acceptance predictors fitted on --head_source's rounds predict x_i's "
                      "acceptance in --source's (AUC; no timing)")
  p.add_argument("--head_source", default=script_args.ALPHA_SOURCE,
                 help="held-out inputs the --acceptance_head predictors are fitted on")
  p.add_argument("--whole_run", default="",
                 help="a finished runner workdir: print instead how its SPEED falls short of "
                      "EXP (with v), step by step (--repeats passes for the prefill times)")
  args = script_args.parse(p, argv, paths=("head_source",))
  if args.whole_run:
    a = research_accounting.attribute_run(args.whole_run, repeats=max(args.repeats, 9))
    print(f"# {args.whole_run}: load average {load_average()}\n{accounting.markdown(a)}",
          flush=True)
    return
  gammas = comma_list(args.gammas, int)
  temperatures = comma_list(args.temperatures, float)
  if args.compare_rev:
    compare(args, gammas, temperatures)
    return
  exp = Experiment(task=args.task, source=args.source, vocab_path=args.vocab,
                   target_checkpoint=args.target, draft_name="t5", draft_checkpoint=args.draft,
                   draft_shortlist=args.draft_shortlist, max_input_len=args.max_input_len,
                   max_decode_len=args.max_decode_len,
                   num_warmup=1, num_examples=args.num_examples, gamma=max(gammas))
  setup = prepare(exp)
  if args.contention:
    contention(args, setup)
    return
  if args.adaptive_pieces:
    ks = comma_list(args.adaptive_pieces, int)
    for temp in temperatures:
      rows = replay.adaptive_pieces(
          setup.target, setup.target_params, setup.draft, jnp.asarray(setup.inputs[:1]), ks,
          max(gammas), SamplingConfig(temperature=temp),
          cache_length(args.max_decode_len, max(gammas)), inner=args.inner,
          repeats=args.repeats)
      print(f"T={temp:g}, γ_max {max(gammas)}, load average {load_average()}\n"
            f"{replay.adaptive_pieces_markdown(rows)}\n", flush=True)
    return
  if args.confidence_auc:
    print(markdown_header(["T", "γ", "rounds", "acceptance of x_i given evaluated, i = 1..γ",
                           "AUC max q_i ('top')", "AUC q_i(x_i) ('drawn')"]))
    for temp in temperatures:
      for gamma in gammas:
        r = probes.confidence_auc(setup.target, setup.target_params, setup.draft,
                                  jnp.asarray(setup.inputs), jax.random.PRNGKey(0), gamma,
                                  SamplingConfig(temperature=temp), args.max_decode_len)
        print(f"| {temp:g} | {gamma} | {r.rounds} | "
              f"{' / '.join(f'{a:.3f}' for a in r.acceptance)} | {r.auc['top']:.3f} | "
              f"{r.auc['drawn']:.3f} |", flush=True)
    return
  if args.acceptance_head:
    acceptance_head(args, exp, setup, max(gammas), temperatures)
    return
  if args.adaptive_replay:
    _, gamma_max, adaptive = parse_setting(args.adaptive_replay, max(gammas))
    if adaptive is None:
      raise SystemExit(f"--adaptive_replay needs an adaptive setting, got {args.adaptive_replay!r}")
    for temp in temperatures:
      load = os.getloadavg()
      result = replay.adaptive_replay(
          setup.target, setup.target_params, setup.draft, jnp.asarray(setup.inputs[1:]),
          jax.random.PRNGKey(0), adaptive, gamma_max, SamplingConfig(temperature=temp),
          args.max_decode_len, repeats=args.repeats)
      end = os.getloadavg()
      print(f"{args.adaptive_replay}, T={temp:g}, γ_max {gamma_max}, "
            f"{len(setup.inputs) - 1} examples × {args.repeats} passes; load average "
            f"{load[0]:.2f} → {end[0]:.2f}\n{replay.adaptive_replay_markdown(result)}\n",
            flush=True)
      if temp == 0 and hasattr(setup.draft, "model"):
        stopping_table(setup, result, gamma_max, args, adaptive.skip_below)
    return
  # The warm-up example is skipped, as the runner does.
  examples = [jnp.asarray(setup.inputs[i:i + 1]) for i in range(1, len(setup.inputs))]
  print(f"# profile_round: target={args.target} draft={args.draft} "
        f"shortlist={exp.draft_shortlist or 'none'} examples={len(examples)} "
        f"batch 1, max_decode_len {args.max_decode_len}, inner {args.inner}, repeats "
        f"{args.repeats}; backend={jax.default_backend()} cpus={os.cpu_count()}; load average "
        f"{load_average()}", flush=True)
  rows = []
  for temp in temperatures:
    for gamma in gammas:
      rows.append(profile_round(setup.target, setup.target_params, setup.draft, examples, gamma,
                                SamplingConfig(temperature=temp), args.max_decode_len,
                                position=args.position, inner=args.inner,
                                repeats=args.repeats))
      print(markdown(rows[-1:]).split("\n")[-1], flush=True)
  print(f"\n{markdown(rows)}\n\nload average at end {load_average()}")


if __name__ == "__main__":
  script_args.run_main(main)
