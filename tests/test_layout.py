"""The package's layout: imports point down the layers, never in a cycle, never
at another module's private names, and only scripts and studies reach the
research wing. Read from the source (AST), function-level imports included."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "specdec_jax"

# Lower layers never import higher ones (same layer is fine).
LAYERS = [
    ("engine", ("models", "kernels", "sampling", "speculative", "tree", "decoding", "beam",
                "theory", "measured", "partitioning", "drafts.base", "paper", "quantization")),
    ("io", ("checkpoints", "memory", "data", "prepare_data", "storage", "pair")),
    ("drafts", ("drafts", "timing", "alpha")),
    ("training", ("training", "distill", "evaluate")),
    ("dryrun", ("dryrun",)),   # compiles what its callers list; imports neither caller
    ("run", ("run",)),         # the runner, with its own list for the dry run
    ("scripting", ("scripting",)),   # what only scripts/ and notebooks/ share
    ("research", ("research",)),
]


def _modules() -> dict[str, Path]:
  out = {}
  for path in PKG.rglob("*.py"):
    parts = path.relative_to(PKG).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path  # '' is the package itself
  return out


def _layer(module: str) -> int:
  best, rank = -1, None
  for i, (_, prefixes) in enumerate(LAYERS):
    for p in prefixes:
      if (module == p or module.startswith(p + ".")) and len(p) > best:
        best, rank = len(p), i
  assert rank is not None, f"specdec_jax.{module} is in no layer of LAYERS"
  return rank


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
  """module -> the package modules it imports; 'from pkg import sub' counts as sub."""
  graph = {}
  for name, path in modules.items():
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}".removeprefix(
            "specdec_jax.") in modules else node.module for a in node.names]
      for t in targets:
        if t == "specdec_jax" or t.startswith("specdec_jax."):
          dep = t.removeprefix("specdec_jax").removeprefix(".")
          if dep != name:
            deps.add(dep)
    graph[name] = deps
  return graph


def test_imports_point_down_the_layers():
  modules = _modules()
  graph = _imports(modules)
  assert len(graph) > 30 and graph["run.loop"] >= {"decoding", "run.report"}  # the graph is read
  assert "dryrun.driver" in graph["run.dry_run_programs"]  # both layers are read
  up = [(m, d) for m, deps in graph.items() if m for d in deps
        if d and _layer(d) > _layer(m)]
  assert not up, f"imports that point up a layer: {up}"
  research = [(m, d) for m, deps in graph.items() for d in deps
              if d.startswith("research") and not m.startswith("research")]
  assert not research, f"only scripts and studies may import specdec_jax.research: {research}"


def test_no_import_cycles():
  graph = _imports(_modules())
  state: dict[str, int] = {}

  def visit(m: str, stack: list[str]) -> None:
    state[m] = 1
    for d in sorted(graph.get(m, ())):
      if state.get(d) == 1:
        cycle = stack[stack.index(d):] + [d]
        raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
      if d not in state:
        visit(d, stack + [d])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])


def test_no_module_uses_another_modules_private_names():
  modules = _modules()
  bad = []
  for name, path in modules.items():
    tree = ast.parse(path.read_text())
    aliases = {}
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
          "specdec_jax"):
        for a in node.names:
          if a.name.startswith("_") and not a.name.startswith("__"):
            bad.append(f"{name}: from {node.module} import {a.name}")
          aliases[a.asname or a.name] = f"{node.module}.{a.name}"
      elif isinstance(node, ast.Import):
        for a in node.names:
          if a.name.startswith("specdec_jax"):
            aliases[a.asname or a.name.split(".")[0]] = a.name
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in aliases and node.attr.startswith("_")
          and not node.attr.startswith("__")):
        if aliases[node.value.id].removeprefix("specdec_jax.") in modules:
          bad.append(f"{name}: {node.value.id}.{node.attr}")
  assert not bad, f"private names used across modules: {bad}"
