"""Table 2's runs as PNG figures (``scripts/make_tables.py --figures``): the
speedup beside the paper's, tokens per call beside Eq. (1), and acceptance
per draft position (flat at α under §3.1's i.i.d. assumption)."""

from __future__ import annotations

import math
import pathlib
from typing import Any, Dict, List, Optional, Sequence

from specdec_jax.scripting import tables

FILES = ("speedup.png", "tokens_per_call.png", "acceptance.png")


def pyplot() -> Any:
  """matplotlib's pyplot on the Agg backend, or an ImportError naming the extra."""
  try:
    import matplotlib
  except ImportError:
    raise ImportError('--figures needs matplotlib: pip install -e ".[figures]"') from None
  matplotlib.use("Agg")  # files only: no display needed on a TPU VM
  import matplotlib.pyplot as plt
  return plt


def row_labels(runs: Sequence[Dict[str, Any]]) -> List[str]:
  """Each run's name on a figure: draft and temperature, with the task or γ
  where needed to tell runs apart."""
  tasks = {str(s.get("task")) for s in runs}
  labels = []
  for s in runs:
    label = f"{s.get('draft')}, T = {_number(s.get('temperature')) or 0:g}"
    labels.append(f"{s.get('task')}: {label}" if len(tasks) > 1 else label)
  for extra in (lambda s: f"γ {s.get('gamma_label') or s.get('gamma')}",
                lambda s: pathlib.Path(str(s.get("workdir"))).name):
    if len(set(labels)) == len(labels):
      break
    labels = [f"{l}, {extra(s)}" if labels.count(l) > 1 else l for l, s in zip(labels, runs)]
  return labels


def _number(value: Any) -> Optional[float]:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
    return None
  return float(value)


def _runs(summaries: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """Speculative runs (not α-only), in the tables' row order."""
  runs = [s for s in summaries if not tables.is_alpha_only(s)]
  return sorted(runs, key=tables.sort_key)


def _legend_outside(ax: Any, **kw: Any) -> None:
  """The legend to the right of the axes, where it covers nothing."""
  ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kw)


def _bars(ax: Any, labels: Sequence[str], series: Sequence[tuple[str, List[Optional[float]]]]
          ) -> None:
  """Horizontal grouped bars per label; None leaves a gap, an empty series is left out."""
  series = [(name, values) for name, values in series if any(v is not None for v in values)]
  height = 0.8 / max(len(series), 1)
  for k, (name, values) in enumerate(series):
    ys = [i + (k - (len(series) - 1) / 2) * height for i in range(len(labels))]
    kept = [(y, v) for y, v in zip(ys, values) if v is not None]
    ax.barh([y for y, _ in kept], [v for _, v in kept], height=height, label=name, zorder=2)
  ax.set_yticks(range(len(labels)), labels=labels)
  ax.invert_yaxis()
  if series:
    _legend_outside(ax)
  ax.grid(axis="x", alpha=0.3, zorder=0)


def _size(runs: Sequence[Dict[str, Any]]) -> tuple[float, float]:
  return (9, 1.2 + 0.45 * len(runs))


def speedup_figure(plt: Any, runs: Sequence[Dict[str, Any]]) -> Any:
  measured = [_number(s.get("speedup")) for s in runs]
  papers = [_number(tables.paper_row("table2", s).get("speed")) for s in runs]
  fig, ax = plt.subplots(figsize=_size(runs))
  _bars(ax, row_labels(runs), [("measured", measured), ("the paper (Table 2, one TPU-v4)", papers)])
  ax.axvline(1.0, color="k", lw=0.8, zorder=1)
  with_paper = any(p is not None for p in papers)
  ax.set(xlabel="walltime improvement over the baseline (X)",
         title="Speedup: this run against the paper's" if with_paper
         else "Speedup over the baseline (the paper has no row for these runs)")
  return fig


def tokens_figure(plt: Any, runs: Sequence[Dict[str, Any]]) -> Any:
  measured = [_number(s.get("tokens_per_target_call")) for s in runs]
  eq1 = [_number(s.get("tokens_per_target_call_eq1")) for s in runs]
  fig, ax = plt.subplots(figsize=_size(runs))
  _bars(ax, row_labels(runs), [("measured", measured), ("Eq. (1) at the run's α and γ", eq1)])
  ax.set(xlabel="tokens per target call", title="Tokens per call of the target")
  return fig


def acceptance_figure(plt: Any, runs: Sequence[Dict[str, Any]]) -> Any:
  from matplotlib.ticker import MaxNLocator
  fig, ax = plt.subplots(figsize=(9, 4.5))
  drawn = 0
  for s, label in zip(runs, row_labels(runs)):
    rates = tables.acceptance_by_position(s["workdir"]) if s.get("workdir") else None
    if not rates:
      continue
    sampled = bool(s.get("temperature"))  # T > 0 dashed: more than 10 rows reuse colours
    ax.plot(range(1, len(rates) + 1), rates, "o--" if sampled else "o-", label=label)
    drawn += 1
  if not drawn:
    ax.text(0.5, 0.5, "no run with per-position counts (examples.jsonl)", ha="center",
            transform=ax.transAxes)
  else:
    _legend_outside(ax, fontsize="small")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # draft positions are whole numbers
  ax.set(xlabel="draft position i", ylabel="P(accepted | evaluated)", ylim=(0, 1.02),
         title="Acceptance per draft position")
  ax.grid(alpha=0.3)
  return fig


def write_figures(summaries: Sequence[Dict[str, Any]], out_dir: pathlib.Path) -> List[pathlib.Path]:
  """Writes ``FILES`` into ``out_dir`` for the speculative runs; -> their paths."""
  runs = _runs(summaries)
  if not runs:
    raise ValueError("--figures: no speculative-decoding run among the summaries (α-only "
                     "runs have no speedup to draw)")
  plt = pyplot()
  out_dir.mkdir(parents=True, exist_ok=True)
  paths = []
  for name, draw in zip(FILES, (speedup_figure, tokens_figure, acceptance_figure)):
    fig = draw(plt, runs)
    path = out_dir / name
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the legend beside the axes included
    plt.close(fig)
    paths.append(path)
  return paths
