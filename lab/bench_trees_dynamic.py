r"""Trees chosen per round against static trees of the same node count, on one pair.

  python scripts/bench_trees_dynamic.py                    # the demo pair
  python scripts/bench_trees_dynamic.py --dynamic="5,5,5;3,4,4,4" --temperatures=0,1

For every per-depth width list W (``tree.DynamicTree``: N = 1 + ΣW nodes,
depth len(W)) the same held-out inputs are decoded, as one batch, by the
baseline, by the dynamic tree, by the best static tree of N nodes and that
depth for the pair's rank rates (``TreeShape.from_acceptance``, rates
measured on other held-out inputs, as scripts/bench_tree.py builds them) and
by the static tree of the dynamic tree's layout (``TreeShape.spine(W)``).
Compilation is excluded (a first call compiles, the second is timed).
Columns: tokens per target call (hardware-independent), the dynamic tree's gain
over each static one, acceptance by depth (of the rounds that reached depth
d - 1, the share that accepted a node at depth d; from ``TreeStats.depth_hist``),
accepted nodes that were not a first child, and walltime speedup over the
baseline on this machine (the first key's). At T > 0 each tree runs ``--keys``
sampling keys (seeds seed .. seed + keys - 1): tokens per call is their mean
± standard error (one key's run moves by a few percent), the other columns
pool them. ``--dynamic`` may name ``best:N/D``, the per-depth widths of the
best static tree of N nodes and depth D. At temperature 0 every output is
checked against the baseline's (a mismatch raises).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.decoding import temperature_sample, tree_speculative_decode
from specdec_jax.run import (Experiment, check_before_loading, held_out_inputs, load_data,
                             load_models)
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting import script_args
from specdec_jax.tree import DynamicTree, TreeShape

from lab import common


def trim_padding(inputs: np.ndarray) -> np.ndarray:
  """Drops the columns that are padding in every row."""
  used = np.nonzero(np.any(np.asarray(inputs) != 0, axis=0))[0]
  return np.asarray(inputs)[:, :int(used.max()) + 1 if used.size else 1]


def rank_rates(target, params, draft, inputs: np.ndarray, max_decode_len: int,
               ranks: int = 8) -> list[float]:
  """At T = 0, how often the target's token is the draft's k-th choice: the
  one-level tree of ``ranks`` children tests the draft's top tokens each round."""
  out = tree_speculative_decode(target, params, draft, jnp.asarray(inputs), jax.random.PRNGKey(0),
                                tree=TreeShape.spine((ranks,)), max_decode_len=max_decode_len)
  wins = np.asarray(out.stats.rank_hist).sum(0)
  calls = max(int(np.asarray(out.stats.target_calls).sum()), 1)
  return sorted((float(w) / calls for w in wins if w > 0), reverse=True)


def acceptance_by_depth(depth_hist: np.ndarray) -> list[float]:
  """depth_hist [B, D + 1] (rounds by accepted depth) -> P(depth >= d | depth
  >= d - 1) for d = 1..D."""
  h = np.asarray(depth_hist).sum(0)
  reached = h[::-1].cumsum()[::-1]                                     # rounds with depth >= d
  return [float(reached[d] / max(reached[d - 1], 1)) for d in range(1, len(h))]


def widths_of(shape: TreeShape) -> tuple[int, ...]:
  """Nodes per depth 1..D of a static tree."""
  d = np.asarray(shape.depths)
  return tuple(int((d == k).sum()) for k in range(1, shape.max_depth + 1))


def timed(call) -> tuple[Any, float]:
  jax.block_until_ready(call())  # compiles
  start = time.perf_counter()
  out = jax.block_until_ready(call())
  return out, time.perf_counter() - start


def bench(args) -> str:
  exp = Experiment(task=args.task, source=args.source, vocab_path=args.vocab,
                   target_checkpoint=args.target, draft_name="t5", draft_checkpoint=args.draft,
                   draft_shortlist=args.draft_shortlist, max_input_len=args.max_input_len,
                   max_decode_len=args.max_decode_len, num_warmup=0,
                   num_examples=args.num_examples, gamma=1)
  check_before_loading(exp)
  setup = load_models(exp, load_data(exp))
  target, params, draft = setup.target, setup.target_params, setup.draft
  inputs = jnp.asarray(trim_padding(setup.inputs[:args.num_examples]))
  held = trim_padding(held_out_inputs(exp, args.rates_source, args.rates_examples))
  rates = rank_rates(target, params, draft, held, exp.max_decode_len)
  print(f"# rank rates on {len(held)} held-out inputs: " + ", ".join(f"{r:.3f}" for r in rates))
  shapes: list[tuple[str, str, Any]] = []
  for text in args.dynamic.split(";"):
    text = text.strip()
    if text.startswith("best"):  # 'best:N/D': the widths of the best static tree of N and D
      n, d = (int(v) for v in text.partition(":")[2].split("/"))
      text = ",".join(str(w) for w in widths_of(TreeShape.from_acceptance(rates, n, d)))
    dyn = DynamicTree.parse("dynamic:" + text)
    best = TreeShape.from_acceptance(rates, dyn.num_nodes, dyn.max_depth)
    shapes += [(f"dynamic:{text.strip()}", "dynamic", dyn),
               (f"best {dyn.num_nodes}/{dyn.max_depth}", "static", best),
               (f"spine:{text.strip()}", "static", dyn.skeleton)]
  headers = ["T", "tree", "kind", "nodes per depth", "tokens / target call", "dynamic vs this",
             "acceptance by depth", "sibling wins", "s (baseline s)", "speedup"]
  lines = []
  key = jax.random.PRNGKey(args.seed)
  for temp in script_args.comma_list(args.temperatures, float):
    sampling = SamplingConfig(temperature=temp)
    base, base_s = timed(lambda: temperature_sample(target, params, inputs, key,
                                                    max_decode_len=exp.max_decode_len,
                                                    sampling=sampling))
    keys = 1 if sampling.greedy else args.keys
    for label, kind, shape in shapes:
      run = lambda k: tree_speculative_decode(  # noqa: E731
          target, params, draft, inputs, jax.random.PRNGKey(args.seed + k), tree=shape,
          max_decode_len=exp.max_decode_len, sampling=sampling)
      out, secs = timed(lambda: run(0))
      if sampling.greedy and not np.array_equal(np.asarray(out.tokens), np.asarray(base.tokens)):
        raise AssertionError(f"{label}: output differs from the baseline's at temperature 0")
      outs = [out] + [run(k) for k in range(1, keys)]
      sts = [jax.tree.map(np.asarray, o.stats) for o in outs]
      per = np.array([float(np.asarray(o.length).sum()) / max(int(st.target_calls.sum()), 1)
                      for o, st in zip(outs, sts)])
      per_call = float(per.mean())
      if kind == "dynamic":
        dyn_per_call = per_call  # the static trees after it are its comparison
      gain = f"{dyn_per_call / per_call - 1:+.1%} (dynamic)" if kind == "static" else ""
      widths = shape.widths if kind == "dynamic" else widths_of(shape)
      se = f" ± {per.std(ddof=1) / np.sqrt(keys):.3f}" if keys > 1 else ""
      lines.append([f"{temp:g}", label, kind, ",".join(map(str, widths)),
                    f"{per_call:.3f}{se}", gain,
                    ", ".join(f"{a:.2f}" for a in acceptance_by_depth(
                        sum(st.depth_hist for st in sts))),
                    int(sum(st.rank_hist[:, 1:].sum() for st in sts)),
                    f"{secs:.2f} ({base_s:.2f})", f"{base_s / secs:.2f}x"])
      print("# row: " + " | ".join(str(x) for x in lines[-1]), flush=True)  # progress
    jax.clear_caches()
  return script_args.markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> None:
  p = script_args.new_parser(__doc__)
  script_args.add_pair_arguments(p)
  script_args.add_shortlist_argument(p)
  common.add_decoding_arguments(p, input_buckets=False)
  p.add_argument("--dynamic", default="5,5,5;3,4,4,4",
                 help="';'-separated per-depth widths of the dynamic trees (tree.DynamicTree)")
  p.add_argument("--num_examples", type=int, default=40, help="held-out inputs, one batch")
  p.add_argument("--keys", type=int, default=6,
                 help="sampling keys per tree at T > 0 (mean ± standard error; walltime: the "
                 "first)")
  p.add_argument("--rates_source", default=script_args.ALPHA_SOURCE,
                 help="held-out inputs the rank rates are measured on (never the timed ones)")
  p.add_argument("--rates_examples", type=int, default=40, help="how many of them")
  args = script_args.parse(p, argv, paths=("rates_source",))
  print(f"# bench_trees_dynamic: target={args.target} draft={args.draft}"
        f"{' + ' + args.draft_shortlist if args.draft_shortlist else ''} "
        f"examples={args.num_examples} {common.machine_description()}")
  print(bench(args))


if __name__ == "__main__":
  script_args.run_main(main)
