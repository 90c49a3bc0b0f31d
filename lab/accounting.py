"""Where a finished run's speedup goes (paper §3.4, Theorem 3.8): the
runner's account (``specdec_jax.run.account``) recomputed for a workdir,
timing the prefill again where the run's lines do not carry it."""

from __future__ import annotations

import json
from pathlib import Path

from specdec_jax.run import account, cli, programs
from specdec_jax.run import setup as setup_lib

from lab.common import load_average


def attribute_run(workdir: str, repeats: int = 15) -> account.Attribution:
  """``account.attribute`` for a finished runner workdir (its config.gin and
  examples.jsonl), with the prefill times its lines carry; for lines written
  before the runner timed them, loads the run's models and data again and
  times the prefill of each input width the run used."""
  root = Path(workdir)
  for name in ("config.gin", "examples.jsonl"):
    if not (root / name).is_file():
      raise FileNotFoundError(f"{root / name} not found: --whole_run needs a finished "
                              "runner workdir")
  exp = cli.parse_config([str(root / "config.gin")], [])
  if exp.adaptive is not None or exp.batch_size != 1:
    raise ValueError(f"{root}: attribute models fixed-γ batch-1 runs (adaptive "
                     f"{exp.adaptive!r}, batch_size {exp.batch_size})")
  records = [json.loads(line) for line in (root / "examples.jsonl").read_text().splitlines()
             if line.strip()]
  records = [r for r in records if r.get("mode") == "speculative"]
  if not records:
    raise ValueError(f"{root / 'examples.jsonl'} has no speculative run's examples")
  if all("prefill_speculative_ms" in r for r in records):  # timed by the run itself
    return account.attribute(records, account.prefill_of(records), [r["input_width"] for r in records])
  setup = setup_lib.prepare(exp)
  batches = {r["index"]: programs.pad_batch(setup.inputs, [r["index"]], 1, exp.input_buckets)
             for r in records}
  widths = [int(batches[r["index"]].shape[1]) for r in records]
  first = {}
  for r, w in zip(records, widths):
    first.setdefault(w, batches[r["index"]])
  prefill = account.prefill_ms(setup.target, setup.target_params, setup.draft, first,
                       exp.max_decode_len, int(records[0]["gamma"]), repeats)
  return account.attribute(records, prefill, widths)


def markdown(a: account.Attribution) -> str:
  """The account as a table: each row's prediction and its factor on the row above."""
  rows = [
      ("EXP (with v): Eq. (1) over γ c + v, c and v timed apart", a.expected_v, None),
      ("× the round timed whole (interplay): EXP in context", a.expected_in_context,
       a.expected_in_context / a.expected_v),
      (f"× measured tokens per target call ({a.tokens_per_call:.2f} against Eq. (1)'s "
       f"{a.tokens_per_call_theory:.2f} at α {a.alpha:.3f}, γ {a.gamma})",
       a.expected_measured_tau, a.expected_measured_tau / a.expected_in_context),
      (f"+ prefill per example (baseline {a.prefill_baseline_ms:.2f} ms, speculative "
       f"{a.prefill_speculative_ms:.2f} ms): whole examples", a.expected_whole_run,
       a.expected_whole_run / a.expected_measured_tau),
      ("SPEED, measured", a.speed, a.unexplained),
  ]
  lines = ["| step | speedup | factor |", "|---|---|---|"]
  for name, value, factor in rows:
    lines.append(f"| {name} | {value:.3f}x | {'' if factor is None else f'{factor:.3f}'} |")
  lines.append("")
  lines.append(f"Measured walltime over its model: baseline {a.baseline_vs_model:.3f}, "
               f"speculative {a.speculative_vs_model:.3f} (1 = every ms accounted for).")
  return "\n".join(lines)


def report(workdir: str, repeats: int) -> None:
  """``scripts/account_run.py``: prints ``attribute_run``'s account."""
  a = attribute_run(workdir, repeats=repeats)
  print(f"# {workdir}: load average {load_average()}\n{markdown(a)}", flush=True)
