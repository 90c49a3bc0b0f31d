"""TPU chips the dry run compiles for (``specdec_jax.dryrun``): their
published figures and the abstract devices libtpu gives for a topology.

The figures are Google Cloud's, per chip, from each version's "System
architecture" page (the sources below): peak bfloat16 FLOP/s, HBM capacity
and HBM bandwidth. The pages write the v5e, v5p and v6e capacities as "GB";
the parts are 16, 95 and 32 GiB stacks and the runtimes report limits in GiB,
so they are kept in GiB here (as ``docs/memory.md`` and
``scripts/plan_memory.py`` do).

Single chips and sub-host slices (``v4:1x1x1``, the paper's setting, or
``v5e:1x1``): libtpu assumes a whole host's chips unless told otherwise, so
``topology_devices`` passes the grid as its chips per host where the grid is
smaller than a host (``host_bounds``).

Megacore: a v4 or v5p chip has two TensorCores that JAX drives as ONE device
(a v4-8 VM shows 4 devices of 32 GiB). libtpu's ``v4:2x2x1`` topology lists
the 8 TensorCores unless asked for the 'megacore' chip configuration, which
``topology_devices`` does for v4 (v5p topologies are megacore already), so a
dry run compiles for the devices a user's VM shows: one per chip, with the
chip's HBM and peak.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.util
import math
import os
import re
import threading
from typing import Any

GiB = 2 ** 30


# Seconds per ring step (hop) of a collective: NOT a published figure. Google
# publishes ICI bandwidths, not latencies; a microsecond per hop is the order
# of magnitude public analyses of TPU collectives use. An assumption, used
# for every chip.
HOP_LATENCY = 1e-6

# Seconds per launched operation on a TPU v4 chip, calibrated once from the
# paper: ``calibration.calibrate()`` recomputes it from the stored op counts
# of the compiled T5-small and T5-XXL pieces so that the model's c for a
# T5-small draft on one v4 chip is the paper's 0.02 (Table 4). Only T5-small
# is used; T5-base and T5-large are predictions (docs/cost_model.md).
V4_OP_SECONDS = 2.9561e-07


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation's published per-chip figures (a JAX device is a chip)."""

  name: str                 # topology prefix: 'v5e' in 'v5e:2x4'
  device_kind: str          # what libtpu's compile-only devices call it
  peak_flops: float         # bfloat16 FLOP/s per chip
  hbm_bytes: int            # HBM per chip
  hbm_bandwidth: float      # HBM bytes/s per chip
  tensorcores: int          # per chip (2: megacore, one JAX device per chip)
  accelerator_type: str     # Cloud's name prefix, as in 'v5litepod-8'
  chip_config: str          # libtpu chip configuration giving one device per chip
  host_bounds: tuple        # chips per host (TPU VM), as libtpu's 3-d bounds
  source: str
  # Inter-chip interconnect (ICI), for pricing collectives (``costs``):
  ici_ports: int = 4              # ICI links per chip
  ici_link_bandwidth: float = 0.0  # bytes/s one way over one link
  ici_source: str = ""            # where the ICI figures come from ('ASSUMED' where no page says)
  hop_latency: float = HOP_LATENCY  # seconds per ring step of a collective (an assumption)
  # The fixed cost of one launched operation (``costs``), the model's one
  # calibrated parameter per chip family (``calibration``).
  op_seconds: float = 0.0
  op_source: str = ""

  @property
  def label(self) -> str:
    return f"TPU {self.name}"


# The per-op fixed cost is calibrated on v4 only (the paper's chip); the
# other families have no published measurement to calibrate against, so they
# take v4's value: an ASSUMPTION, printed as such.
_V4_OP = "calibrated: the paper's c = 0.02 for T5-small on one TPU-v4 (Table 4)"
_OTHER_OP = "ASSUMED: TPU v4's calibrated value (no published measurement for this chip)"



def _published_ici(bidirectional: float, ports: int, name: str) -> dict:
  """The ICI fields from Cloud's page for chip ``name``: ``bidirectional``
  bytes/s per chip over ``ports`` links, so bidirectional / 2 / ports one way
  per link."""
  return dict(ici_ports=ports, ici_link_bandwidth=bidirectional / 2 / ports,
              ici_source=f"{bidirectional / 1e9:.0f} GB/s bidirectional per chip, {ports} ports "
              f"(Cloud's {name} page)")


CHIPS: dict[str, Chip] = {
    # Cloud's v4 page gives no per-chip ICI figure. Six links per chip (the
    # 3-D torus) is the v4 paper's (Jouppi et al., ISCA 2023); 45 GB/s one
    # way per link is an ASSUMPTION (the order of v5e's published per-link
    # figure).
    "v4": Chip("v4", "TPU v4", 275e12, 32 * GiB, 1200e9, 2, "v4", "megacore", (2, 2, 1),
               "https://cloud.google.com/tpu/docs/v4", ici_ports=6, ici_link_bandwidth=45e9,
               ici_source="6 links: Jouppi et al. 2023; 45 GB/s per link one way: ASSUMED",
               op_seconds=V4_OP_SECONDS, op_source=_V4_OP),
    "v5e": Chip("v5e", "TPU v5 lite", 197e12, 16 * GiB, 819e9, 1, "v5litepod", "default",
                (2, 4, 1), "https://cloud.google.com/tpu/docs/v5e",
                **_published_ici(400e9, 4, "v5e"),
                op_seconds=V4_OP_SECONDS, op_source=_OTHER_OP),
    # v5p: 6 links (its 3-D torus).
    "v5p": Chip("v5p", "TPU v5", 459e12, 95 * GiB, 2765e9, 2, "v5p", "default", (2, 2, 1),
                "https://cloud.google.com/tpu/docs/v5p", **_published_ici(1200e9, 6, "v5p"),
                op_seconds=V4_OP_SECONDS, op_source=_OTHER_OP),
    "v6e": Chip("v6e", "TPU v6 lite", 918e12, 32 * GiB, 1640e9, 1, "v6e", "default",
                (2, 4, 1), "https://cloud.google.com/tpu/docs/v6e",
                **_published_ici(800e9, 4, "v6e"),
                op_seconds=V4_OP_SECONDS, op_source=_OTHER_OP),
}

# libtpu registers itself on the first topology a process asks for: two
# threads doing that at once make the second fail ('PJRT_Api already exists').
_LOCK = threading.Lock()

EXAMPLES = ("v4:1x1x1 (one v4 chip, the paper's), v4:2x2x1 (v4-8), v5e:1x1, v5e:2x4 (v5e-8), "
            "v5p:1x1x1, v5p:2x2x1 (v5p-8), v6e:1x1, v6e:2x4 (v6e-8)")


def parse_topology(topology: str) -> tuple[Chip, tuple[int, ...]]:
  """'v5e:2x4' -> (the v5e ``Chip``, chip grid (2, 4)); a one-line
  ``ValueError`` for anything else, before libtpu is loaded."""
  name, _, grid = str(topology).partition(":")
  if name not in CHIPS or not re.fullmatch(r"\d+(x\d+)*", grid):
    raise ValueError(f"--dry_run={topology!r}: unknown TPU topology; expected CHIP:GRID with "
                     f"CHIP one of {', '.join(CHIPS)}, e.g. {EXAMPLES}")
  return CHIPS[name], tuple(int(n) for n in grid.split("x"))


def host_bounds(chip: Chip, grid: tuple[int, ...]) -> tuple[int, ...]:
  """libtpu's chips per host for a topology: the chip's host, or the grid
  itself where the grid is smaller than one host (one chip, as the paper
  measured, or any sub-host slice such as v5e:2x2)."""
  full = tuple(grid) + (1,) * (len(chip.host_bounds) - len(grid))
  if len(full) == len(chip.host_bounds) and math.prod(full) < math.prod(chip.host_bounds) \
      and all(g <= h for g, h in zip(full, chip.host_bounds)):
    return full
  return chip.host_bounds


# The device nodes a TPU VM's chips appear as (v4: /dev/accel*; v5e, v5p,
# v6e: /dev/vfio/<n>); what ``on_tpu_vm`` reads.
TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")

# What libtpu is told off a TPU VM when no dry run names a topology.
DEFAULT_TOPOLOGY = "v4:2x2x1"


def on_tpu_vm() -> bool:
  """Whether this machine has a TPU chip (one of ``TPU_DEVICE_GLOBS`` exists)."""
  return any(glob.glob(g) for g in TPU_DEVICE_GLOBS)


def quiet_libtpu(topology: str = DEFAULT_TOPOLOGY) -> bool:
  """Off a TPU VM, sets (unless already set) what libtpu would otherwise
  probe the cloud metadata server and the host for, and print warnings
  about when it finds neither: the accelerator type (``topology``'s),
  the worker hostnames, no metadata query; and lets several processes load
  it (its one-process lock only guards a chip). Call it before JAX starts a
  backend or loads libtpu. On a TPU VM it changes nothing. Returns whether
  it set the defaults."""
  if on_tpu_vm():
    return False
  chip, grid = parse_topology(topology)
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE",
                        f"{chip.accelerator_type}-{math.prod(grid) * chip.tensorcores}")
  return True


def topology_devices(topology: str) -> tuple[Chip, tuple[Any, ...]]:
  """The chip and libtpu's compile-only devices for ``topology`` (one per
  chip: megacore where the chip has it). Needs libtpu (``pip install -e
  '.[tpu]'``); no TPU and no JAX TPU backend: ``JAX_PLATFORMS=cpu`` is fine.
  Every failure is one line (``ValueError``)."""
  parse_topology(topology)  # a bad name fails before the lock and libtpu
  with _LOCK:
    return _topology_devices(topology)


@functools.lru_cache(maxsize=None)
def _topology_devices(topology: str) -> tuple[Chip, tuple[Any, ...]]:
  chip, grid = parse_topology(topology)
  if importlib.util.find_spec("libtpu") is None:
    raise ValueError(f"--dry_run={topology}: the TPU compiler is not installed; "
                     "pip install -e '.[tpu]' (or jax[tpu] at this jax's version)")
  # Off a TPU VM libtpu would probe the cloud metadata server for the host's
  # TPU and print warnings; say what it is instead.
  quiet_libtpu(topology)
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    devices = topologies.get_topology_desc(
        platform="tpu", topology_name=topology, chip_config_name=chip.chip_config,
        chips_per_host_bounds=host_bounds(chip, grid)).devices
  except Exception as e:  # libtpu's own message says what is wrong with the shape
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ValueError(f"--dry_run={topology}: libtpu cannot build this topology: {first}") \
        from None
  return chip, tuple(devices)
