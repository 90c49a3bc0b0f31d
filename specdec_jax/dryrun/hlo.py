"""Reading a compiled HLO module's text (``Compiled.as_text()``, per device:
shard shapes, layout tiles) for the dry run: parameters and their padded
bytes, the main loop, its collectives and whether any moves a weight.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Iterator, Optional

ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
            "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all", "collective-broadcast")
# Ops whose result is still (part of) their first operand.
_MOVES = {"bitcast", "copy", "reshape", "transpose", "convert", "bitcast-convert", "copy-start",
          "copy-done", "slice-start", "slice-done", "slice", "dynamic-slice", "all-gather",
          "all-gather-start", "all-gather-done", "collective-permute",
          "collective-permute-start", "collective-permute-done", "all-to-all"}
_COMPUTES = {"dot", "convolution", "reduce", "reduce-window", "scatter", "sort", "gather"}
_ARRAY = re.compile(r"\b(" + "|".join(ITEMSIZE) + r")\[([0-9,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_NAME = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass
class Instr:
  name: str
  shape: str        # the result shape text, layouts included
  opcode: str
  operands: list    # operand instruction names
  attrs: str        # everything after the operand list
  args: str = ""    # the operand list as written (a parameter's number)

  def attr(self, key: str) -> Optional[str]:
    m = re.search(rf"\b{key}=%([\w.\-]+)", self.attrs)
    return m.group(1) if m else None

  @property
  def op_name(self) -> str:
    m = re.search(r'op_name="([^"]*)"', self.attrs)
    return m.group(1) if m else ""

  @property
  def called(self) -> list[str]:
    """The computations this instruction runs (bodies, branches, fusions)."""
    out = [c for c in (self.attr(k) for k in ("body", "condition", "calls", "to_apply",
                                              "true_computation", "false_computation")) if c]
    m = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
    return out + (_NAME.findall(m.group(1)) if m else [])


@dataclasses.dataclass
class Module:
  computations: dict   # name -> {instruction name: Instr}, in program order
  entry: str

  def instrs(self, computation: str) -> Iterator[Instr]:
    return iter(self.computations[computation].values())


def _split_instr(line: str) -> Optional[Instr]:
  m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)$", line)
  if not m:
    return None
  name, rest = m.groups()
  depth, i = 0, 0
  while i < len(rest):  # the opcode: the first 'word(' outside the shape's brackets
    ch = rest[i]
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif depth == 0 and ch == " ":
      op = re.match(r" ([a-z][a-z0-9\-]*)\(", rest[i:])
      if op:
        start = i + len(op.group(0))
        d, j = 1, start
        while j < len(rest) and d:
          d += {"(": 1, ")": -1}.get(rest[j], 0)
          j += 1
        return Instr(name, rest[:i], op.group(1), _NAME.findall(rest[start:j - 1]),
                     rest[j:], rest[start:j - 1])
    i += 1
  return None


def parse(text: str) -> Module:
  """The module's computations and their instructions."""
  comps: dict = {}
  entry, cur = "", None
  for line in text.splitlines():
    m = _HEADER.match(line)
    if m:
      cur = m.group(2)
      comps[cur] = {}
      entry = cur if m.group(1) else entry
      continue
    if line.startswith("}"):
      cur = None
      continue
    if cur is not None:
      ins = _split_instr(line)
      if ins is not None:
        comps[cur][ins.name] = ins
  if not entry:
    raise ValueError("no ENTRY computation in the HLO text")
  return Module(comps, entry)


def array_bytes(shape: str, padded: bool = False) -> int:
  """Bytes of every array in a shape text; ``padded``: rounded up to the layout's tile."""
  total = 0
  for dtype, dims, layout in _ARRAY.findall(shape):
    sizes = [int(d) for d in dims.split(",") if d]
    if padded and layout:
      body = layout[1:-1]
      order = [int(x) for x in body.split(":")[0].split(",") if x]
      tiles = re.findall(r"T\(([0-9,]+)\)", body)
      sizes = [sizes[i] for i in reversed(order)] if order else sizes
      if tiles:
        tile = [int(t) for t in tiles[0].split(",")]
        sizes = [1] * max(0, len(tile) - len(sizes)) + sizes
        for j in range(1, len(tile) + 1):
          sizes[-j] = -(-sizes[-j] // tile[-j]) * tile[-j]
    total += math.prod(sizes) * ITEMSIZE[dtype]
  return total


def parameters(module: Module) -> list[Instr]:
  """The entry computation's parameters (one per argument array)."""
  return [i for i in module.instrs(module.entry) if i.opcode == "parameter"]


def main_loop(module: Module) -> Optional[tuple[str, Instr]]:
  """(computation, instruction) of the entry's largest ``while``: the decoding loop."""
  def size(comp: str, seen: set) -> int:
    if comp in seen or comp not in module.computations:
      return 0
    seen.add(comp)
    return sum(1 + sum(size(c, seen) for c in i.called) for i in module.instrs(comp))
  loops = [i for i in module.instrs(module.entry) if i.opcode == "while"]
  if not loops:
    return None
  return module.entry, max(loops, key=lambda i: size(i.attr("body"), set()))


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str        # 'all-reduce', ...
  shape: str       # result shape, layout dropped
  nbytes: int      # result bytes per device
  where: str       # '' (the loop body), 'nested loop', 'branch <j>'
  op_name: str
  group: int = 0   # devices in each replica group (0: not stated, every device)


def _kind(opcode: str) -> Optional[str]:
  base = opcode.removesuffix("-start")
  return base if base in COLLECTIVES else None


def group_size(ins: Instr) -> int:
  """Devices in each of a collective's replica groups (listed, iota or mesh
  form); 2 for a collective-permute; 0 where none is named (every device)."""
  if _kind(ins.opcode) == "collective-permute":
    return 2
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", ins.attrs)
  if m:
    return int(m.group(2))
  # replica_groups=mesh['x'=2,'y'=4] {'y'}: a group spans the named axes.
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", ins.attrs)
  if m:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
    return math.prod(sizes.get(a, 1) for a in re.findall(r"'([^']+)'", m.group(2)))
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", ins.attrs)
  return len([x for x in m.group(1).split(",") if x]) if m else 0


def _collective(ins: Instr, where: str) -> Collective:
  return Collective(_kind(ins.opcode) or ins.opcode, re.sub(r"\{[^}]*\}", "", ins.shape),
                    array_bytes(ins.shape), where, ins.op_name, group_size(ins))


# Instructions that launch no work of their own on the device.
_NO_LAUNCH = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                        "after-all", "partition-id", "replica-id", "opt-barrier"})


def op_count(module: Module) -> int:
  """Operations one call launches (the fixed cost model's count): loops times
  their known trip count, a conditional's largest branch, a fusion once;
  collectives and instructions that launch nothing not counted."""
  def count(comp: str, seen: tuple) -> int:
    if comp in seen or comp not in module.computations:
      return 0
    n = 0
    for ins in module.instrs(comp):
      op = ins.opcode
      if op in _NO_LAUNCH or op.endswith("-done") or _kind(op) or (
          op.endswith("-update") and _kind(op.removesuffix("-update"))):
        continue
      if op == "while":
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
        n += (int(m.group(1)) if m else 1) * sum(count(c, seen + (comp,)) for c in ins.called)
      elif op == "conditional":
        n += 1 + max((count(c, seen + (comp,)) for c in ins.called), default=0)
      elif op == "call":
        n += sum(count(c, seen + (comp,)) for c in ins.called)
      else:
        n += 1
    return n
  return count(module.entry, ())


def all_collectives(module: Module) -> list[Collective]:
  """Every collective of a program without a decoding loop, each once."""
  return [_collective(ins, "") for comp in module.computations for ins in module.instrs(comp)
          if _kind(ins.opcode)]


def loop_collectives(module: Module) -> list[Collective]:
  """The collectives one main-loop iteration runs (nested loops' once, and
  ``lax.switch`` branches' marked with their branch)."""
  found = main_loop(module)
  if found is None:
    return []
  out: list[Collective] = []

  def walk(comp: str, where: str, seen: set) -> None:
    if comp in seen or comp not in module.computations:
      return
    seen.add(comp)
    for ins in module.instrs(comp):
      if _kind(ins.opcode):
        out.append(_collective(ins, where))
      if ins.opcode == "while":
        for c in ins.called:
          walk(c, where or "nested loop", seen)
      elif ins.opcode == "conditional":
        for j, c in enumerate(ins.called):
          walk(c, f"branch {j}", seen)
      else:
        for c in ins.called:
          walk(c, where, seen)

  walk(found[1].attr("body"), "", set())
  walk(found[1].attr("condition"), "", set())
  return out


class WeightFlow:
  """Which values are weights or pieces of them: ``is_weight`` parameters
  followed through moves, conversions, loop state, tuples and elementwise
  fusions. ``moves_only`` (backward passes) follows only fusions without
  arithmetic: a gradient's norm-scale product is a new value, not a weight."""

  MOVE_OPS = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "copy",
                        "reshape", "transpose", "convert", "bitcast-convert", "slice",
                        "dynamic-slice"})

  def __init__(self, module: Module, is_weight: Callable[[Instr], bool], moves_only: bool = False):
    self.module, self.is_weight, self.moves_only = module, is_weight, moves_only
    self.callers: dict[str, list[tuple[str, Instr]]] = {}
    for comp in module.computations:
      for ins in module.instrs(comp):
        for c in ins.called:
          self.callers.setdefault(c, []).append((comp, ins))
    self.memo: dict = {}

  def _fused_only_moves(self, comp: str) -> bool:
    if comp not in self.module.computations:
      return False
    ops = [i.opcode for i in self.module.instrs(comp)]
    if self.moves_only:
      return all(op in self.MOVE_OPS for op in ops)
    return not any(op in _COMPUTES or op in ("fusion", "custom-call") for op in ops)

  def derived(self, comp: str, name: str, index: Optional[int] = None) -> bool:
    """Whether ``name`` of ``comp`` (its element ``index``) is (part of) a weight."""
    key = (comp, name, index)
    if key in self.memo:
      return self.memo[key]
    self.memo[key] = False  # cycles (loop state) resolve to False unless shown otherwise
    module, callers, derived = self.module, self.callers, self.derived
    ins = module.computations[comp].get(name)
    result = False
    if ins is None:
      pass
    elif index is not None:  # element `index` of a tuple-valued instruction
      if ins.opcode == "tuple" and index < len(ins.operands):
        result = derived(comp, ins.operands[index])
      elif ins.opcode == "while" and ins.operands:
        result = derived(comp, ins.operands[0], index)  # loop-invariant state
      elif ins.opcode == "parameter" and comp != module.entry:
        result = any(c.opcode == "while" and c.operands and derived(cc, c.operands[0], index)
                     for cc, c in callers.get(comp, ()))
    elif ins.opcode == "parameter":
      if comp == module.entry:
        result = self.is_weight(ins)
      else:
        num = int(ins.args) if ins.args.isdigit() else -1
        result = any(c.opcode in ("fusion", "call") and num < len(c.operands)
                     and derived(cc, c.operands[num]) for cc, c in callers.get(comp, ()))
    elif ins.opcode == "get-tuple-element":
      m = re.search(r"index=(\d+)", ins.attrs)
      result = bool(m) and derived(comp, ins.operands[0], int(m.group(1)))
    elif ins.opcode in _MOVES or (ins.opcode == "custom-call" and "ConcatBitcast" in ins.attrs):
      result = any(derived(comp, o) for o in ins.operands[:1 if ins.opcode in _MOVES else None])
    elif ins.opcode == "fusion":
      size = array_bytes(ins.shape)
      result = self._fused_only_moves(ins.attr("calls") or "") and any(
          derived(comp, o) and size >= array_bytes(module.computations[comp][o].shape)
          for o in ins.operands if o in module.computations[comp])
    self.memo[key] = result
    return result


def weight_collectives(module: Module, is_weight: Callable[[Instr], bool],
                       moves_only: bool = False) -> list[Collective]:
  """Every collective whose operand is (derived from) a weight (``WeightFlow``):
  decoding and training should move activations and gradients only."""
  flow = WeightFlow(module, is_weight, moves_only)
  return [_collective(ins, comp) for comp in module.computations
          for ins in module.instrs(comp)
          if _kind(ins.opcode) and any(flow.derived(comp, o) for o in ins.operands)]


@dataclasses.dataclass(frozen=True)
class WeightCopy:
  shape: str       # result shape, layout included
  nbytes: int
  in_loop: bool    # inside the main loop (every iteration) or once per call
  op_name: str


def weight_copies(module: Module, is_weight: Callable[[Instr], bool]) -> list[WeightCopy]:
  """Whole weights rewritten into HBM (layout copies, conversions; not 'S(n)'
  on-chip): each iteration inside the main loop, else once per call."""
  flow = WeightFlow(module, is_weight)
  found = main_loop(module)
  loop: set = set()

  def reach(comp: str) -> None:
    if comp in loop or comp not in module.computations:
      return
    loop.add(comp)
    for i in module.instrs(comp):
      for c in i.called:
        reach(c)
  if found is not None:
    reach(found[1].attr("body"))
  fused = {i.attr("calls") for c in module.computations for i in module.instrs(c)
           if i.opcode == "fusion"}
  out = []
  for comp in module.computations:
    if comp in fused:  # a fusion's inside is never materialized
      continue
    for ins in module.instrs(comp):
      if ins.opcode not in ("copy", "transpose", "convert", "fusion") or "S(" in ins.shape \
          or not flow.derived(comp, ins.name):
        continue
      src = module.computations[comp].get(ins.operands[0]) if ins.operands else None
      if src is not None and array_bytes(ins.shape) >= array_bytes(src.shape) > 0:
        out.append(WeightCopy(ins.shape, array_bytes(ins.shape), comp in loop, ins.op_name))
  return out
