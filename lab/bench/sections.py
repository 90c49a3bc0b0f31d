"""The accelerator benchmark's sections by name: ``DEFAULT`` in the order
``scripts/bench_accelerator.sh`` runs them (the order of value; about 8
minutes on one H100 or H200), ``MORE`` the earlier tables it runs on request
(``--sections``). ``run_section`` runs one and says how long it took."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Callable

from lab.bench import common, exactness, hf, loops, targets, variants

SECTIONS: dict[str, Callable[..., None]] = {
    "loops": functools.partial(loops.section_loops, "ende"),
    **{variants.section_name(v): functools.partial(variants.section_variant, v)
       for v in variants.VARIANTS},
    "hf": hf.section_hf,
    "demo": hf.section_demo,
    "loops_cnndm": functools.partial(loops.section_loops, "cnndm"),
    "bandwidth": common.section_bandwidth,
    "targets": targets.section_targets,
    "exactness": exactness.section_exactness,
    "profile": targets.section_profile,
}
DEFAULT = ("loops", *(variants.section_name(v) for v in variants.VARIANTS
                      if v not in variants.TIMED_BEFORE), "hf", "demo", "loops_cnndm")
MORE = tuple(s for s in SECTIONS if s not in DEFAULT)
# Sections that put torch beside JAX on the card: JAX must not preallocate.
TORCH_SECTIONS = ("hf", "demo")


def run_section(name: str, smoke: bool, out: Path) -> None:
  """Section ``name`` at the GPU run's sizes, or the smoke test's, with its
  tables printed and recorded under ``out``."""
  if name not in SECTIONS:
    raise ValueError(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
  if name in TORCH_SECTIONS and smoke:
    import torch
    # One thread: torch's thread pool beside JAX's on a small CPU spends its
    # time waiting (100x slower steps on 2 cores).
    torch.set_num_threads(1)
  t0 = time.perf_counter()
  SECTIONS[name](common.SMOKE if smoke else common.FULL, out, smoke)
  common.log(f"section {name}: {time.perf_counter() - t0:.1f} s; results in {out}")
