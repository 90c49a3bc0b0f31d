"""All rows of a Table 2 family (§4.1) in sequence (``scripts/run_table2.py``),
each in its own runner process with ``--workdir=ROOT/ROW --resume``: a
finished row is skipped, a failing one does not stop the others, and a
finished row of other settings stops the command before anything runs."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import signal
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence

from specdec_jax.run import cli
from specdec_jax.run.settings import REPO_ROOT, Experiment
from specdec_jax.run.workdir import WriterHold

FAMILIES: Dict[str, str] = {
    "t5_1_0": "configs/table2_t5_1_0",   # public T5 1.0 checkpoints (gs://t5-data)
    "t5_1_1": "configs/table2",          # the paper's models: fine-tune and bind them
}
DEFAULT_ROOT = "runs/table2"
INTERRUPTED = 130   # the runner's exit status after Ctrl-C


@dataclasses.dataclass(frozen=True)
class Row:
  """One Table 2 row: its config file and the workdir it writes."""

  name: str               # the config's stem, e.g. 't5_1_0_ende_small_t0'
  config: pathlib.Path
  workdir: pathlib.Path


def family_dir(family: str) -> pathlib.Path:
  """The folder of a family's row configs (``FAMILIES``)."""
  if family not in FAMILIES:
    raise ValueError(f"--family={family!r}: one of {', '.join(sorted(FAMILIES))}")
  return REPO_ROOT / FAMILIES[family]


def find_rows(config_dir: pathlib.Path, root: pathlib.Path, only: Sequence[str] = ()) -> List[Row]:
  """The rows ``config_dir/*.gin`` by name, each writing ``root/<stem>``;
  ``only``: the stems to keep (all when empty)."""
  if not config_dir.is_dir():
    raise FileNotFoundError(f"--config_dir {config_dir}: no such directory")
  files = sorted(config_dir.glob("*.gin"))
  if not files:
    raise FileNotFoundError(f"{config_dir}: no row configs (*.gin) in it")
  rows = [Row(f.stem, f, root / f.stem) for f in files]
  unknown = sorted(set(only) - {r.name for r in rows})
  if unknown:
    raise ValueError(f"--rows: {', '.join(unknown)} not in {config_dir} (its rows: "
                     f"{', '.join(r.name for r in rows)})")
  return [r for r in rows if not only or r.name in only]


def row_settings(configs: Sequence[str], bindings: Sequence[str]) -> Experiment:
  """A row's ``Experiment`` with its overlays and bindings, as the runner parses them."""
  return cli.parse_config(list(configs), list(bindings))


def requested_examples(configs: Sequence[str], bindings: Sequence[str]) -> int:
  """``Experiment.num_examples`` of a row with its overlays and bindings."""
  return row_settings(configs, bindings).num_examples


def _recorded(exp: Experiment) -> Dict[str, object]:
  """The recorded settings a finished row must share with this command's."""
  return {"mesh_shape": list(exp.mesh_shape) if exp.mesh_shape else None,
          "param_dtype": exp.param_dtype, "dtype": exp.dtype,
          "batch_size": exp.batch_size, "temperature": exp.sampling.temperature}


def check_same_settings(row: Row, summary: Dict[str, object], exp: Experiment) -> None:
  """Refuses a finished row recording other settings than this command's."""
  differ = [f"{k} {summary[k]!r} there, {v!r} here" for k, v in _recorded(exp).items()
            if k in summary and summary[k] != v]
  if differ:
    raise ValueError(f"{row.workdir} holds a run with other settings ({'; '.join(differ)}); "
                     "give this command another --root, or the overlay and bindings that "
                     "row was run with")


def read_summary(row: Row) -> Dict[str, object]:
  """The row's ``summary.json`` ({} without one; rewritten atomically, never torn)."""
  path = row.workdir / "summary.json"
  if not path.is_file():
    return {}
  try:
    summary = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e}); move the row's workdir aside") from None
  if summary.get("mode", "speculative") != "speculative":
    raise ValueError(f"{path}: an --alpha_only run, not a Table 2 row; use another --root")
  return summary


def examples_done(row: Row) -> int:
  """Examples counted by the row's ``summary.json`` (0 without one)."""
  return int(read_summary(row).get("num_examples") or 0)


def runner_command(row: Row, overlays: Sequence[str], bindings: Sequence[str]) -> List[str]:
  """The runner's command line for ``row`` (always ``--resume``)."""
  return ([sys.executable, "-m", "specdec_jax.run", f"--config={row.config}"]
          + [f"--config={o}" for o in overlays] + [f"--gin_bindings={b}" for b in bindings]
          + [f"--workdir={row.workdir}", "--resume"])


def run_process(command: Sequence[str]) -> int:
  """Runs ``command``; meanwhile Ctrl-C goes to it alone."""
  proc = subprocess.Popen(list(command))
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    return proc.wait()
  finally:
    signal.signal(signal.SIGINT, previous)


@dataclasses.dataclass
class Outcome:
  """What ``run_rows`` did with each row, by name."""

  skipped: List[str] = dataclasses.field(default_factory=list)   # already done
  ran: List[str] = dataclasses.field(default_factory=list)       # finished now
  failed: Dict[str, int] = dataclasses.field(default_factory=dict)  # exit status
  interrupted: Optional[str] = None                               # stopped here


def run_rows(rows: Sequence[Row], overlays: Sequence[str], bindings: Sequence[str],
             say: Callable[[str], None] = print,
             run: Callable[[Sequence[str]], int] = run_process) -> Outcome:
  """Runs each row not yet done, in order, holding the rows' root throughout
  (``WriterHold``); stops at an interrupted one."""
  holds = []
  try:
    for root in sorted({str(r.workdir.parent) for r in rows}):
      holds.append(WriterHold(root, "scripts/run_table2.py", flag="--root"))
    return _run_rows(rows, overlays, bindings, say, run)
  finally:
    for hold in holds:
      hold.release()


def _run_rows(rows: Sequence[Row], overlays: Sequence[str], bindings: Sequence[str],
              say: Callable[[str], None], run: Callable[[Sequence[str]], int]) -> Outcome:
  out = Outcome()
  settings = {r.name: row_settings([str(r.config), *overlays], bindings) for r in rows}
  for row in rows:  # every finished row checked before any runs
    summary = read_summary(row)
    if summary:
      check_same_settings(row, summary, settings[row.name])
  for k, row in enumerate(rows, start=1):
    done, n = examples_done(row), settings[row.name].num_examples
    where = f"[row {k}/{len(rows)}] {row.name}"
    if done >= n:
      say(f"{where}: done ({done} examples in {row.workdir}), skipped")
      out.skipped.append(row.name)
      continue
    say(f"{where}: " + (f"resuming after {done} of {n} examples" if done
                        else f"{n} examples") + f" into {row.workdir}")
    status = run(runner_command(row, overlays, bindings))
    if status == INTERRUPTED:
      out.interrupted = row.name
      return out
    if status:
      say(f"{where}: failed (exit status {status}); going on with the next row")
      out.failed[row.name] = status
    else:
      out.ran.append(row.name)
  return out
