"""Run summaries as markdown tables laid out like the paper's Tables 2 and 4
(speculative runs) and 3 (``--alpha_only`` runs), each beside the paper's
row of the same task, draft size and temperature ('-' where it has none).
"""

from __future__ import annotations

import glob
import json
import pathlib
import re
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from specdec_jax import paper
from specdec_jax.scripting.script_args import markdown_table

# The paper's Tables 2, 3 and 4 in row form (Table 2/4 targets: T5-XXL).
PAPER_TABLES: Dict[str, List[Dict[str, Any]]] = {
  # Table 2: empirical speedups over T5-XXL.
  "table2": [dict(task=r.task, draft=f"t5-{r.draft}", temp=r.temperature, gamma=r.gamma,
                  alpha=r.alpha, speed=r.speedup) for r in paper.TABLE2],
  # Table 3: empirical alpha values (its T5-XXL rows with T5 drafts are Table 2's).
  "table3": [dict(target=t, task=task, draft=d, temp=temp, alpha=a)
             for t, task, d, temp, a in paper.TABLE3_OTHER]
            + [dict(target="T5-XXL", task=r.task, draft=f"t5-{r.draft}", temp=r.temperature,
                    alpha=r.alpha) for r in paper.TABLE2],
  # Table 4 (Appendix A.3): Theorem 3.8 prediction (EXP) vs. measured (EMP).
  "table4": [dict(task=r.task, draft=f"t5-{r.draft}", temp=r.temperature, gamma=r.gamma,
                  alpha=r.alpha, c=r.c, exp=r.expected, emp=r.speedup) for r in paper.TABLE2],
}

PaperKey = Tuple[str, str, int]
MISSING = "-"

# (substring, canonical name) pairs, first hit wins; no hit: no paper row.
_TASK_ALIASES = [("cnn", "cnndm"), ("ende", "ende"), ("en_de", "ende"), ("en-de", "ende"),
         ("lm1b", "lm1b"), ("dialog", "dialog"), ("lamda", "dialog")]
_DRAFT_ALIASES = [("unigram", "unigram"), ("bigram", "bigram"), ("gpt", "gpt-like-6m"),
         ("small", "t5-small"), ("base", "t5-base"), ("large", "t5-large")]
_DRAFT_ORDER = {"unigram": 0, "bigram": 1, "t5-small": 2, "t5-base": 3, "t5-large": 4}

# The paper's models are T5 1.1; T5 1.0 rows are other models ('family' column).
_T5_1_0 = re.compile(r"t5[\s_.-]*v?1[._]0(?![.\d])|(^|[^a-z0-9])t5[-_](3b|11b)\b", re.I)
_T5_1_1 = re.compile(r"t5[\s_.-]*v?1[._]1(?![.\d])|(^|[^a-z0-9])xx?l\b", re.I)


def model_family(summary: Dict[str, Any]) -> str:
  """'T5 1.0' or 'T5 1.1' when the target's or draft's label names it (or a
  size only it has), else '-'."""
  labels = [str(summary.get(k) or "") for k in ("target", "draft")]
  if any(_T5_1_0.search(l) for l in labels):
    return "T5 1.0"
  return "T5 1.1" if any(_T5_1_1.search(l) for l in labels) else MISSING


def _canonical(name: Any, aliases: Sequence[Tuple[str, str]]) -> Optional[str]:
  """First alias whose substring occurs in the lowercased name, else None."""
  lowered = str(name or "").lower()
  return next((canon for sub, canon in aliases if sub in lowered), None)


def canonical_task(task: Any) -> Optional[str]:
  """Map a run's task name (e.g. 'wmt_ende', 'cnn_dailymail') to the paper's key."""
  return _canonical(task, _TASK_ALIASES)


def canonical_draft(draft: Any) -> Optional[str]:
  """Map a draft model name (e.g. 't5_1_1_small') to the paper's M_q key."""
  return _canonical(draft, _DRAFT_ALIASES)


def canonical_temp(temperature: Any) -> Optional[int]:
  """The paper only reports temperature 0 (argmax) and 1 (standard sampling)."""
  try:
    t = float(temperature)
  except (TypeError, ValueError):
    return None
  return int(t) if t in (0.0, 1.0) else None


def paper_key(summary: Dict[str, Any]) -> Optional[PaperKey]:
  """(task, draft, temperature) in the paper's vocabulary, or None if any is unknown."""
  key = (canonical_task(summary.get("task")), canonical_draft(summary.get("draft")),
      canonical_temp(summary.get("temperature")))
  return None if None in key else key  # type: ignore[return-value]


def paper_row(table: str, summary: Dict[str, Any]) -> Dict[str, Any]:
  """The paper's row of ``table`` matching ``summary``, or {} when there is none."""
  key = paper_key(summary)
  for row in PAPER_TABLES[table]:
    if key == (row["task"], row["draft"], row["temp"]):
      return row
  return {}


def _fmt(value: Any, digits: int) -> str:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return MISSING if value is None else str(value)
  return f"{value:.{digits}f}"


def _fmt_plain(value: Any) -> str:
  if value is None:
    return MISSING
  return f"{value:g}" if isinstance(value, float) else str(value)


def sort_key(s: Dict[str, Any]) -> Tuple:
  """The tables' row order: task, temperature, draft size, γ."""
  draft = canonical_draft(s.get("draft"))
  return (str(s.get("task")), float(s.get("temperature") or 0.0),
      _DRAFT_ORDER.get(draft or "", 99), str(s.get("draft")),
      s.get("gamma") or 0, str(s.get("gamma_label") or ""), str(s.get("target")))


Column = Tuple[str, Callable[[Dict[str, Any], Dict[str, Any]], str]]

# Columns: (header, fn(summary, paper_row) -> cell). Those both tables show:
_TASK = ("TASK", lambda s, p: _fmt_plain(s.get("task")))
_FAMILY = ("family", lambda s, p: model_family(s))
_M_P = ("M_p", lambda s, p: _fmt_plain(s.get("target")))
_M_Q = ("M_q", lambda s, p: _fmt_plain(s.get("draft")))
_TEMP = ("TEMP", lambda s, p: _fmt_plain(s.get("temperature")))
_PAPER_ALPHA = ("alpha (paper)", lambda s, p: _fmt(p.get("alpha"), 2))

_GAMMA = ("gamma", lambda s, p: _fmt_plain(s.get("gamma_label") or s.get("gamma")))
_ALPHA = ("alpha", lambda s, p: _fmt(s.get("alpha"), 2))

TABLE2_COLUMNS: List[Column] = [_TASK, _FAMILY, _M_P, _M_Q, _TEMP, _GAMMA, _ALPHA] + [
  ("SPEED", lambda s, p: _fmt(s.get("speedup"), 2)),
  ("gamma (paper)", lambda s, p: _fmt_plain(p.get("gamma"))),
  _PAPER_ALPHA,
  ("speed (paper)", lambda s, p: _fmt(p.get("speed"), 1)),
  ("examples", lambda s, p: _fmt_plain(s.get("num_examples"))),
  ("mismatches vs baseline", lambda s, p: _fmt_plain(s.get("mismatches_vs_baseline"))),
]

TABLE3_COLUMNS: List[Column] = [_M_P, _FAMILY, _TASK, _M_Q, _TEMP] + [
  ("alpha", lambda s, p: _fmt(s.get("alpha_min_pq"), 2)),
  ("tokens", lambda s, p: _fmt_plain(s.get("num_tokens"))),
  ("M_p (paper)", lambda s, p: _fmt_plain(p.get("target"))),
  _PAPER_ALPHA,
]

TABLE4_COLUMNS: List[Column] = [_TASK, _FAMILY, _M_Q, _TEMP, _GAMMA] + [
  ("mean gamma", lambda s, p: _fmt(s.get("mean_gamma"), 2)),
  _ALPHA,
  ("c", lambda s, p: _fmt(s.get("c"), 3)),
  ("v", lambda s, p: _fmt(s.get("v"), 2)),
  ("EXP", lambda s, p: _fmt(s.get("expected_speedup"), 2)),
  ("EXP (v)", lambda s, p: _fmt(s.get("expected_speedup_v"), 2)),
  ("interplay", lambda s, p: _fmt(s.get("interplay"), 2)),
  ("EXP (in context)", lambda s, p: _fmt(s.get("expected_speedup_in_context"), 2)),
  ("EXP (whole run)", lambda s, p: _fmt(s.get("expected_speedup_whole_run"), 2)),
  ("EMP", lambda s, p: _fmt(s.get("speedup"), 2)),
  _PAPER_ALPHA,
  ("c (paper)", lambda s, p: _fmt(p.get("c"), 2)),
  ("EXP (paper)", lambda s, p: _fmt(p.get("exp"), 1)),
  ("EMP (paper)", lambda s, p: _fmt(p.get("emp"), 1)),
]


def render_table(summaries: Sequence[Dict[str, Any]], paper_table: str,
         columns: Sequence[Column]) -> str:
  """Rows sorted by task, temperature, draft size and gamma, paper row alongside."""
  rows = []
  for s in sorted(summaries, key=sort_key):
    p = paper_row(paper_table, s)
    rows.append([fn(s, p) for _, fn in columns])
  return markdown_table([h for h, _ in columns], rows)


def is_alpha_only(summary: Dict[str, Any]) -> bool:
  return summary.get("mode") == "alpha_only"


FAMILY_NOTE = ("family: the T5 version of a row's models. The paper's are T5 1.1; a "
               "'T5 1.0' row ran the public T5 1.0 checkpoints (configs/table2_t5_1_0/), "
               "other models than the paper's: its paper columns are a reference, not "
               "the same models.\n\n")


def build_markdown(summaries: Sequence[Dict[str, Any]]) -> str:
  """All tables that the given summaries can fill, as one markdown document."""
  runs = [s for s in summaries if not is_alpha_only(s)]
  alpha_runs = [s for s in summaries if is_alpha_only(s)]
  sections = []
  if runs:
    sections.append(
      "### Table 2: walltime improvement of speculative decoding\n\n"
      "Paper columns: M_p = T5-XXL (11B) on TPU-v4, matched by task, draft size and "
      "temperature.\n\n" + FAMILY_NOTE + render_table(runs, "table2", TABLE2_COLUMNS))
    sections.append(
      "### Table 4: expected (Theorem 3.8) vs. empirical improvement\n\n"
      "EXP uses v = 1 as in the paper; EXP (v) uses the measured cost v of the "
      "(gamma+1)-token target pass; EXP (in context) scales c and v by the interplay "
      "(the two models timed alternating as in a round over their cost timed apart).\n\n"
      + render_table(runs, "table4", TABLE4_COLUMNS))
  if alpha_runs:
    sections.append(
      "### Table 3: alpha = E[sum min(p, q)] (Corollary 3.6)\n\n" + FAMILY_NOTE
      + render_table(alpha_runs, "table3", TABLE3_COLUMNS))
  return "\n\n".join(sections) + "\n"


def find_summary_files(patterns: Sequence[str]) -> List[pathlib.Path]:
  """summary.json files named by, or found under, each path or glob (a glob
  match only if named summary.json)."""
  found = set()
  for pattern in patterns:
    explicit = pathlib.Path(pattern)
    if explicit.is_file():
      found.add(explicit)
      continue
    for match in map(pathlib.Path, glob.glob(pattern, recursive=True) or [pattern]):
      if match.is_dir():
        found.update(match.rglob("summary.json"))
      elif match.is_file() and match.name == "summary.json":
        found.add(match)
  return sorted(p.resolve() for p in found)


def load_summaries(paths: Iterable[pathlib.Path]) -> List[Dict[str, Any]]:
  """Each file's summary, with its directory as ``"workdir"``."""
  summaries = []
  for path in paths:
    with open(path) as f:
      try:
        summary = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(summary, dict):
      raise ValueError(f"{path}: not a run summary (a JSON object)")
    summaries.append({**summary, "workdir": str(pathlib.Path(path).parent)})
  return summaries


def acceptance_by_position(workdir: str) -> Optional[List[float]]:
  """P(the draft's i-th token accepted | evaluated), i = 1..γ, over the run's
  examples.jsonl; None for a run without the counts."""
  path = pathlib.Path(workdir) / "examples.jsonl"
  if not path.is_file():
    return None
  accepted: List[float] = []
  evaluated: List[float] = []
  for line in path.read_text().splitlines():
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue  # a torn last line: the runner repairs it on --resume
    if "accepted_at" not in record or "evaluated_at" not in record:
      return None
    for total, counts in ((accepted, record["accepted_at"]), (evaluated, record["evaluated_at"])):
      total.extend([0.0] * (len(counts) - len(total)))
      for i, n in enumerate(counts):
        total[i] += n
  if not evaluated:
    return None
  return [a / e if e else float("nan") for a, e in zip(accepted, evaluated)]
