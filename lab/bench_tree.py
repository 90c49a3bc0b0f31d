r"""Token trees against chains on one pair, side by side in one run.

  python scripts/bench_tree.py                  # the demo pair (configs/demo.gin's draft)
  python scripts/bench_tree.py --chains=1,2,3 --trees=full:3,2,spine:4,2,2 \
      --acceptance_trees=16/3 --temperatures=0,1 --num_examples=40

Every chain γ (``speculative_decode``) and every tree (``tree_speculative_decode``)
decodes the same held-out inputs as one batch (each row keeps its own counts);
compilation is excluded (a first call compiles, the second is timed). Columns:
positions the target scores per call (pass width), depth, tokens per target call
(hardware-independent) and its gain over the chain of the same depth, draft calls
per target call, accepted nodes that were a sibling rather than the draft's first
choice, CPU walltime over the batch beside the baseline's, and, for a T5 1.1 XXL
target and T5 1.1 small draft on one TPU v5e-8 (``--chip``), the speedup a
round with this acceptance would give under a roofline model of the passes
(``lab.trees``; a model, not a measurement).
"""

from __future__ import annotations

import jax

from specdec_jax.models.t5 import get_config
from specdec_jax.run import (Experiment, check_before_loading, held_out_inputs, load_data,
                             load_models)
from specdec_jax.dryrun.chips import CHIPS
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting import script_args
from specdec_jax.tree import TreeShape

from lab import common, trees


def parse_trees(text: str) -> dict[str, TreeShape]:
  """'full:3,2,spine:4,2,2' -> {label: shape}: a new shape starts at each 'kind:'."""
  groups: list[list[str]] = []
  for item in (t.strip() for t in text.split(",")):
    if ":" in item:
      groups.append([item])
    elif groups and item:
      groups[-1].append(item)
    elif item:
      raise ValueError(f"--trees: {item!r} does not follow a 'kind:' (e.g. full:3,2)")
  return {",".join(g): TreeShape.parse(",".join(g)) for g in groups}


def bench(args) -> str:
  exp = Experiment(task=args.task, source=args.source, vocab_path=args.vocab,
                   target_checkpoint=args.target, draft_name="t5", draft_checkpoint=args.draft,
                   draft_shortlist=args.draft_shortlist, max_input_len=args.max_input_len,
                   max_decode_len=args.max_decode_len, num_warmup=0,
                   num_examples=args.num_examples, gamma=1)
  check_before_loading(exp)
  setup = load_models(exp, load_data(exp))
  inputs = trees.trim_padding(setup.inputs[:args.num_examples])
  chains = {f"chain:{g}": g for g in script_args.comma_list(args.chains, int)}
  shapes = {**chains, **parse_trees(args.trees)}
  if args.acceptance_trees:
    # Trees built for this pair from its rank statistics on held-out inputs.
    held = trees.trim_padding(held_out_inputs(exp, args.rates_source, args.rates_examples))
    rates = sorted((r for r in trees.rank_rates(setup.target, setup.target_params, setup.draft,
                                                held, exp.max_decode_len) if r > 0), reverse=True)
    print(f"# rank rates on {len(held)} held-out inputs: "
          + ", ".join(f"{r:.3f}" for r in rates))
    for spec in args.acceptance_trees.split(","):
      n, _, depth = spec.partition("/")
      text = f"acceptance:{n}:" + ",".join(f"{r:.3f}" for r in rates) + (
          f":{depth}" if depth else "")
      shape = TreeShape.parse(text)
      shapes[f"best {n}" + (f" depth {depth}" if depth else "") + f" {shape.parents}"] = shape
  chip = CHIPS[args.chip]
  big, small = get_config("t5_1_1_xxl"), get_config("t5_1_1_small")
  headers = ["T", "shape", "width", "depth", "tokens/call", "vs chain", "draft calls/call",
             "sibling wins", "CPU s (baseline s)", f"{chip.label}-{args.devices} model"]
  lines = []
  for temp in script_args.comma_list(args.temperatures, float):
    rows, base_s = trees.compare(setup.target, setup.target_params, setup.draft, inputs, shapes,
                                 SamplingConfig(temperature=temp), exp.max_decode_len,
                                 seed=args.seed)
    same_depth = {r.depth: r.label for r in rows if r.label in chains}
    for s in trees.summary(rows, same_depth):
      r = s["row"]
      model = trees.roofline_speedup(r, big, small, chip, args.devices)
      gain = "-" if r.label in chains or s["gain_vs_chain"] != s["gain_vs_chain"] \
          else f"{s['gain_vs_chain']:+.0%}"
      lines.append([f"{temp:g}", r.label, r.width, r.depth, f"{r.tokens_per_call:.2f}", gain,
                    f"{r.draft_per_call:.2f}", r.sibling_wins,
                    f"{r.seconds:.2f} ({base_s:.2f})", f"{model['speedup']:.2f}x"])
    jax.clear_caches()
  return script_args.markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> None:
  p = script_args.new_parser(__doc__)
  script_args.add_pair_arguments(p)
  script_args.add_shortlist_argument(p)
  common.add_decoding_arguments(p, input_buckets=False)
  p.add_argument("--chains", default="1,2,3,4,5", help="comma-separated chain γ")
  p.add_argument("--trees", default="full:3,2,1,spine:5,3,2,2,1",
                 help="token trees ('chain:G', 'spine:W1,...', 'full:B1,...', "
                      "'parents:-1,0,...'; see specdec_jax.tree.TreeShape.parse)")
  p.add_argument("--num_examples", type=int, default=40, help="held-out inputs, one batch")
  p.add_argument("--acceptance_trees", default="4,6,16/2,16/3,16/4,16",
                 help="also the trees TreeShape.from_acceptance builds from the pair's rank "
                      "rates on --rates_source: comma-separated node counts N, each with an "
                      "optional depth cap as N/D; '' for none")
  p.add_argument("--rates_source", default=script_args.ALPHA_SOURCE,
                 help="held-out inputs the rank rates are measured on (never the timed ones)")
  p.add_argument("--rates_examples", type=int, default=40, help="how many of them")
  p.add_argument("--chip", default="v5e", choices=sorted(CHIPS), help="TPU of the model column")
  p.add_argument("--devices", type=int, default=8, help="chips the model column splits over")
  args = script_args.parse(p, argv, paths=("rates_source",))
  print(f"# bench_tree: target={args.target} draft={args.draft}"
        f"{' + ' + args.draft_shortlist if args.draft_shortlist else ''} "
        f"examples={args.num_examples} "
        f"{common.machine_description()}")
  print(bench(args))
