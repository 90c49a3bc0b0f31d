"""Sharding T5 over a ('data', 'model') mesh, T5X style: arrays carry T5X's logical axis
names (docs/sharding.md), rules map them to mesh axes, inputs are placed and caches
constrained, and jit (GSPMD) partitions the rest."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "model")

Rules = tuple[tuple[str, Optional[str]], ...]

# T5X's standard_logical_axis_rules (1-D model parallelism).
STANDARD_RULES: Rules = (
    ("batch", "data"), ("vocab", "model"), ("mlp", "model"), ("heads", "model"),
    ("joined_kv", "model"), ("embed", None), ("kv", None), ("length", None),
    ("relpos_buckets", None))

# For drafts: weights replicated, only the batch split (γ serial latency-bound steps
# would pay an all-reduce per layer per step).
DATA_PARALLEL_RULES: Rules = (("batch", "data"),)

FALLBACKS = ("error", "replicate")

CACHE_AXES = ("batch", "length", "heads", "kv")

# (pattern on the '/'-joined parameter name, logical axes); first match wins.
_PARAM_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"^token_embedder/embedding$", ("vocab", "embed")),
    (r"/(query|key|value)/kernel$", ("embed", "joined_kv")),
    (r"/out/kernel$", ("joined_kv", "embed")),
    (r"/mlp/wi(_\d)?/kernel$", ("embed", "mlp")),
    (r"/mlp/wo/kernel$", ("mlp", "embed")),
    (r"^decoder/logits_dense/kernel$", ("embed", "vocab")),
    (r"/relpos_bias/rel_embedding$", ("heads", "relpos_buckets")),
    (r"/scale$", ("embed",)),
)


class PartitioningError(ValueError):
  """A mesh or rule set that cannot shard the model as asked."""


def param_logical_axes(name: str) -> tuple[str, ...]:
  for pattern, axes in _PARAM_AXES:
    if re.search(pattern, name):
      return axes
  raise PartitioningError(f"no logical axis names known for parameter {name!r}")


def flatten_names(tree: Mapping, is_leaf: Callable[[Any], bool] = lambda x: False,
                  prefix: str = "") -> dict[str, Any]:
  """Nested dicts -> {'a/b/c': leaf} (``is_leaf`` stops at a mapping that is a leaf)."""
  flat = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping) and not is_leaf(value):
      flat.update(flatten_names(value, is_leaf, name + "/"))
    else:
      flat[name] = value
  return flat


def unflatten_names(flat: Mapping[str, Any]) -> dict:
  tree: dict = {}
  for name, value in flat.items():
    *parents, last = name.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = value
  return tree


def validate_rules(rules: Sequence[Sequence[Any]]) -> Rules:
  """Rules as a hashable tuple of (logical name, mesh axis or None) pairs."""
  out = []
  for i, rule in enumerate(rules):
    if len(rule) != 2 or not isinstance(rule[0], str):
      raise PartitioningError(f"logical axis rule #{i} {rule!r} is not a (logical name, mesh "
                              "axis or None) pair")
    logical, mesh_axis = rule
    if mesh_axis is not None and mesh_axis not in MESH_AXES:
      raise PartitioningError(f"logical axis rule ({logical!r}, {mesh_axis!r}): mesh axis must "
                              f"be one of {MESH_AXES} or None")
    out.append((logical, mesh_axis))
  return tuple(out)


def make_mesh(shape: Sequence[int], devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A ('data', 'model') mesh over ``devices`` or this machine's (on one process a smaller
  mesh takes the first devices; on several it must span them all)."""
  shape = _mesh_shape(shape)
  n = math.prod(shape)
  given = devices is not None
  devices = list(jax.devices() if devices is None else devices)
  if not given and n < len(devices) and jax.process_count() == 1:
    devices = devices[:n]
    if (shape, len(jax.devices())) not in _SUBSET_SAID:
      _SUBSET_SAID.add((shape, len(jax.devices())))
      logging.info("mesh_shape %s uses %d of the %d %s devices (the first %d)", shape, n,
                   len(jax.devices()), devices[0].platform, n)
  if n != len(devices):
    why = ""
    if not given and n < len(devices):
      why = (f" over {jax.process_count()} processes; a multi-host run uses every device, "
             "since each process takes part in every jitted loop")
    raise PartitioningError(
        f"mesh_shape {shape} has {n} devices but there are {len(devices)} "
        f"({devices[0].platform}){why}; choose (data, model) with data * model "
        f"{'=' if given or why else '<='} {len(devices)}")
  axis_types = (jax.sharding.AxisType.Auto,) * 2
  return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)


# (mesh shape, device count) already reported as a subset of the machine.
_SUBSET_SAID: set = set()


def _mesh_shape(shape: Sequence[int]) -> tuple[int, int]:
  shape = tuple(int(s) for s in shape)
  if len(shape) != 2 or any(s < 1 for s in shape):
    raise PartitioningError(f"mesh_shape must be two positive sizes (data, model), got {shape}")
  return shape


def abstract_mesh(shape: Sequence[int]) -> jax.sharding.AbstractMesh:
  """A mesh of the given shape with no devices, for planning (specs, shard shapes)."""
  return jax.sharding.AbstractMesh(_mesh_shape(shape), MESH_AXES,
                                   axis_types=(jax.sharding.AxisType.Auto,) * 2)


@dataclasses.dataclass(frozen=True)
class Partitioner:
  """A mesh (or ``abstract_mesh``) plus logical axis rules; hashable (a static jit arg)."""

  mesh: Any
  rules: Rules = STANDARD_RULES
  fallback: str = "error"

  def __post_init__(self):
    if self.fallback not in FALLBACKS:
      raise PartitioningError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
    object.__setattr__(self, "rules", validate_rules(self.rules))

  @property
  def shape(self) -> dict[str, int]:
    return dict(self.mesh.shape)

  def spec(self, axes: Sequence[Optional[str]], shape: Sequence[int], what: str) -> PartitionSpec:
    """The PartitionSpec for an array of ``shape`` with logical ``axes``. Rules apply in
    order, as in T5X: a dimension takes a rule's mesh axis if it has none yet and no
    other dimension holds it; None, a size-1 axis or no rule replicates; an axis that
    does not divide it raises (or replicates, per ``fallback``)."""
    if len(axes) != len(shape):
      raise PartitioningError(f"{what}: {len(axes)} logical axes {tuple(axes)} for an array "
                              f"of shape {tuple(shape)}")
    unset = object()
    out: list[Any] = [unset] * len(axes)
    used: set[str] = set()
    for logical, mesh_axis in self.rules:
      if logical not in axes:
        continue
      i = list(axes).index(logical)
      if out[i] is not unset or (mesh_axis is not None and mesh_axis in used):
        continue
      if mesh_axis is None or self.shape[mesh_axis] == 1:
        out[i] = None
        continue
      n = self.shape[mesh_axis]
      if shape[i] % n:
        msg = (f"{what}: dimension '{logical}' of size {shape[i]} (shape {tuple(shape)}) is "
               f"not divisible by mesh axis '{mesh_axis}' of size {n} (mesh {self.shape})")
        if self.fallback == "error":
          raise PartitioningError(msg + "; choose a mesh that divides it, map "
                                  f"'{logical}' to None in the logical axis rules, or set "
                                  "the partitioning fallback to 'replicate'")
        logging.log_first_n(logging.WARNING, "%s; replicating it (fallback='replicate')", 20, msg)
        out[i] = None
        continue
      used.add(mesh_axis)
      out[i] = mesh_axis
    return PartitionSpec(*(None if a is unset else a for a in out))

  def sharding(self, axes: Sequence[Optional[str]], shape: Sequence[int],
               what: str) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec(axes, shape, what))

  def param_sharding(self, name: str, shape: Sequence[int]) -> NamedSharding:
    return self.sharding(param_logical_axes(name), shape, f"parameter {name}")

  def param_shardings(self, shapes: Any) -> dict:
    """Shardings for a parameter tree (leaves: arrays or ShapeDtypeStructs)."""
    flat = flatten_names(shapes)
    return unflatten_names({n: self.param_sharding(n, np.shape(x)) for n, x in flat.items()})

  def batch_sharding(self, shape: Sequence[int], what: str = "inputs") -> NamedSharding:
    """Batch-major arrays ([B, ...]): batch over 'data', the rest replicated."""
    return self.sharding(("batch",) + (None,) * (len(shape) - 1), shape, what)

  def shard_batch(self, x: Any, what: str = "inputs") -> jax.Array:
    return jax.device_put(x, self.batch_sharding(np.shape(x), what))

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def constrain(self, x: jax.Array, axes: Sequence[Optional[str]], what: str) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape, what))


def constrain_cache(cache: Any, partitioner: Optional[Partitioner], what: str) -> Any:
  """Pin a ``DecoderCache``'s K/V to ``CACHE_AXES`` inside jit, as T5X does."""
  if partitioner is None:
    return cache
  kv = lambda xs, n: tuple(partitioner.constrain(x, CACHE_AXES, f"{what} {n}[{i}]")
                           for i, x in enumerate(xs))
  return cache.replace(
      self_k=kv(cache.self_k, "self_k"), self_v=kv(cache.self_v, "self_v"),
      cross_k=kv(cache.cross_k, "cross_k"), cross_v=kv(cache.cross_v, "cross_v"),
      encoder_mask=partitioner.constrain(cache.encoder_mask, ("batch", "length"),
                                         f"{what} encoder_mask"))


def constrain_batch(x: jax.Array, partitioner: Optional[Partitioner], what: str) -> jax.Array:
  if partitioner is None:
    return x
  return partitioner.constrain(x, ("batch",) + (None,) * (x.ndim - 1), what)


def from_settings(mesh_shape: Optional[Sequence[int]], rules: Optional[Sequence] = None,
                  fallback: str = "error", mesh: Optional[Mesh] = None) -> Optional[Partitioner]:
  """The partitioner for the settings; None (unsharded) when ``mesh_shape`` is None."""
  if mesh_shape is None:
    return None
  mesh = make_mesh(mesh_shape) if mesh is None else mesh
  return Partitioner(mesh, validate_rules(STANDARD_RULES if rules is None else rules), fallback)


def initialize_multihost(coordinator_address: Optional[str] = None,
                         num_processes: Optional[int] = None,
                         process_id: Optional[int] = None) -> None:
  """``jax.distributed.initialize``; without a coordinator JAX detects the cluster."""
  if coordinator_address is not None and (num_processes is None or process_id is None):
    raise PartitioningError(
        f"multihost with coordinator_address={coordinator_address!r} also needs "
        f"num_processes (got {num_processes}) and process_id (got {process_id})")
  kw = {} if coordinator_address is None else dict(
      coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id)
  # CPU devices need a collectives backend across processes; accelerators bring their own.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(**kw)
  except (ValueError, RuntimeError) as e:
    if coordinator_address is None:
      raise PartitioningError(
          f"multihost=True: JAX found no cluster to join here ({e}); bind "
          "Experiment.coordinator_address ('host:port' of process 0), "
          "Experiment.num_processes and Experiment.process_id") from None
    raise PartitioningError(f"multihost: joining the coordinator at {coordinator_address} "
                            f"failed: {e}") from None
  if num_processes is not None and jax.process_count() != num_processes:
    raise PartitioningError(f"multihost: the coordinator confirms {jax.process_count()} "
                            f"processes, not num_processes={num_processes}")
