"""The cost model's calibration (``specdec_jax.dryrun.calibration``): the
fixed cost per operation on TPU v4 from the paper's c for T5-small alone,
then the model's c for T5-base and T5-large on one v4 chip beside the
paper's (Table 4).

  python scripts/calibrate_costs.py              # from the stored op counts
  python scripts/calibrate_costs.py --recompile  # compile the pieces again
                                                 # (libtpu; minutes) and print
                                                 # the PIECES to store

No weight is read; the EnDe T = 0 rows of Table 2 give the settings.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from specdec_jax.dryrun import calibration, driver  # noqa: E402
from specdec_jax.dryrun.costs import Piece, extrapolate  # noqa: E402
from specdec_jax.run import dry_run_programs  # noqa: E402
from specdec_jax.scripting import script_args  # noqa: E402
from specdec_jax.run.cli import parse_config  # noqa: E402
from specdec_jax.run.settings import Experiment  # noqa: E402

REPO = script_args.REPO_ROOT
OVERLAY = "configs/tpu_v4_1.gin"


def as_stored(p: Piece) -> dict[str, float]:
  """A compiled piece in ``calibration.PIECES``' form."""
  return {"flops": p.flops, "bytes": p.bytes, "ops": p.ops}


def calibration_pieces(experiments: dict[str, Experiment], workers: Optional[int] = None
                       ) -> dict[str, dict[str, float]]:
  """The one-position pieces on one v4 chip in ``calibration.PIECES``' form;
  ``experiments``: draft size -> its row (the target's step from the first)."""
  topology = calibration.TOPOLOGY
  out: dict[str, dict[str, float]] = {}
  for i, (name, exp) in enumerate(experiments.items()):
    ctx = driver.check(dry_run_programs.RunnerPrograms(exp), topology)
    roles = ("target", "draft") if i == 0 else ("draft",)
    specs = dry_run_programs.piece_compiles(ctx, widths=(1,), roles=roles)
    compiled = driver.compile_all(topology, specs, workers)
    got = {s.key: p for s, p in zip(specs, compiled)}
    bad = [p for p in compiled if p.error]
    if bad:
      raise ValueError(f"{bad[0].name}: {bad[0].error}")
    if i == 0:
      out["target"] = as_stored(
          extrapolate(got, "target", 1, ctx.target_config.num_decoder_layers))
    out[name] = as_stored(
        extrapolate(got, "draft", 1, ctx.draft_config.num_decoder_layers))
  return out


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--recompile", action="store_true",
                 help="compile the one-position pieces on v4:1x1x1 again and print them")
  args = p.parse_args()
  stored = None
  if args.recompile:
    exps = {d: parse_config([str(REPO / f"configs/table2/ende_{d}_t0.gin"),
                             str(REPO / OVERLAY)], []) for d in calibration.DRAFTS}
    stored = calibration_pieces(exps)
    print("PIECES =", json.dumps(stored, indent=2))
  print(calibration.table(stored))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
