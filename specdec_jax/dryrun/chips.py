"""TPU chips the dry run compiles for: Google Cloud's published per-chip
figures (peak bf16 FLOP/s, HBM in GiB, HBM bandwidth) and libtpu's
compile-only devices for a topology, one per chip (megacore for v4), with
sub-host slices such as ``v4:1x1x1`` (the paper's) as their own host.
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


# Seconds per ring step of a collective: an ASSUMPTION (the order public
# analyses use; no latency is published), for every chip.
HOP_LATENCY = 1e-6

# Seconds per launched operation on TPU v4 (``calibration.calibrate()``: the
# paper's c = 0.02 for T5-small, Table 4; docs/cost_model.md).
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
  ici_ports: int = 4              # ICI links per chip
  ici_link_bandwidth: float = 0.0  # bytes/s one way over one link
  ici_source: str = ""            # where the ICI figures come from ('ASSUMED' where no page says)
  hop_latency: float = HOP_LATENCY  # seconds per ring step of a collective (an assumption)
  op_seconds: float = 0.0
  op_source: str = ""

  @property
  def label(self) -> str:
    return f"TPU {self.name}"


# Only v4 (the paper's chip) is calibrated; the others take its value.
_V4_OP = "calibrated: the paper's c = 0.02 for T5-small on one TPU-v4 (Table 4)"
_OTHER_OP = "ASSUMED: TPU v4's calibrated value (no published measurement for this chip)"


def _published_ici(bidirectional: float, ports: int, name: str) -> dict:
  """The ICI fields from Cloud's page: ``bidirectional`` bytes/s per chip over ``ports``."""
  return dict(ici_ports=ports, ici_link_bandwidth=bidirectional / 2 / ports,
              ici_source=f"{bidirectional / 1e9:.0f} GB/s bidirectional per chip, {ports} ports "
              f"(Cloud's {name} page)")


CHIPS: dict[str, Chip] = {
    # No published v4 ICI figure: 6 links (Jouppi et al. 2023), 45 GB/s ASSUMED.
    "v4": Chip("v4", "TPU v4", 275e12, 32 * GiB, 1200e9, 2, "v4", "megacore", (2, 2, 1),
               "https://cloud.google.com/tpu/docs/v4", ici_ports=6, ici_link_bandwidth=45e9,
               ici_source="6 links: Jouppi et al. 2023; 45 GB/s per link one way: ASSUMED",
               op_seconds=V4_OP_SECONDS, op_source=_V4_OP),
    "v5e": Chip("v5e", "TPU v5 lite", 197e12, 16 * GiB, 819e9, 1, "v5litepod", "default",
                (2, 4, 1), "https://cloud.google.com/tpu/docs/v5e",
                **_published_ici(400e9, 4, "v5e"), op_seconds=V4_OP_SECONDS, op_source=_OTHER_OP),
    "v5p": Chip("v5p", "TPU v5", 459e12, 95 * GiB, 2765e9, 2, "v5p", "default", (2, 2, 1),
                "https://cloud.google.com/tpu/docs/v5p", **_published_ici(1200e9, 6, "v5p"),
                op_seconds=V4_OP_SECONDS, op_source=_OTHER_OP),
    "v6e": Chip("v6e", "TPU v6 lite", 918e12, 32 * GiB, 1640e9, 1, "v6e", "default",
                (2, 4, 1), "https://cloud.google.com/tpu/docs/v6e",
                **_published_ici(800e9, 4, "v6e"), op_seconds=V4_OP_SECONDS, op_source=_OTHER_OP),
}

# libtpu registers itself on the first topology a process asks for: two
# threads doing that at once make the second fail ('PJRT_Api already exists').
_LOCK = threading.Lock()

EXAMPLES = ("v4:1x1x1 (one v4 chip, the paper's), v4:2x2x1 (v4-8), v5e:1x1, v5e:2x4 (v5e-8), "
            "v5p:1x1x1, v5p:2x2x1 (v5p-8), v6e:1x1, v6e:2x4 (v6e-8)")


def parse_topology(topology: str) -> tuple[Chip, tuple[int, ...]]:
  """'v5e:2x4' -> (the v5e ``Chip``, chip grid (2, 4)), before libtpu loads."""
  name, _, grid = str(topology).partition(":")
  if name not in CHIPS or not re.fullmatch(r"\d+(x\d+)*", grid):
    raise ValueError(f"--dry_run={topology!r}: unknown TPU topology; expected CHIP:GRID with "
                     f"CHIP one of {', '.join(CHIPS)}, e.g. {EXAMPLES}")
  return CHIPS[name], tuple(int(n) for n in grid.split("x"))


def host_bounds(chip: Chip, grid: tuple[int, ...]) -> tuple[int, ...]:
  """libtpu's chips per host: the chip's host, or a sub-host grid itself."""
  full = tuple(grid) + (1,) * (len(chip.host_bounds) - len(grid))
  if len(full) == len(chip.host_bounds) and math.prod(full) < math.prod(chip.host_bounds) \
      and all(g <= h for g, h in zip(full, chip.host_bounds)):
    return full
  return chip.host_bounds


# The device nodes a TPU VM's chips appear as.
TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")

# What libtpu is told off a TPU VM when no dry run names a topology.
DEFAULT_TOPOLOGY = "v4:2x2x1"


def on_tpu_vm() -> bool:
  """Whether this machine has a TPU chip (one of ``TPU_DEVICE_GLOBS`` exists)."""
  return any(glob.glob(g) for g in TPU_DEVICE_GLOBS)


def quiet_libtpu(topology: str = DEFAULT_TOPOLOGY) -> bool:
  """Off a TPU VM, before libtpu loads: sets the environment libtpu would
  otherwise probe for (and warn about); -> whether it set it."""
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
  """The chip and libtpu's compile-only devices for ``topology``, one per chip
  (needs libtpu, not a TPU)."""
  parse_topology(topology)  # a bad name fails before the lock and libtpu
  with _LOCK:
    return _topology_devices(topology)


@functools.lru_cache(maxsize=None)
def _topology_devices(topology: str) -> tuple[Chip, tuple[Any, ...]]:
  chip, grid = parse_topology(topology)
  if importlib.util.find_spec("libtpu") is None:
    raise ValueError(f"--dry_run={topology}: the TPU compiler is not installed; "
                     "pip install -e '.[tpu]' (or jax[tpu] at this jax's version)")
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
