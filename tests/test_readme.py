"""The README's "Adding an approximation model" commands, run as written from a
temporary directory outside the repository (only the number of examples is
cut, by bindings appended to its last command)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _section_commands(heading: str) -> str:
  text = (REPO / "README.md").read_text()
  section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
  assert len(blocks) == 1, f"README '{heading}' should hold one bash block, has {len(blocks)}"
  return blocks[0]


def test_adding_an_approximation_model_works_as_written(tmp_path):
  script = _section_commands("Adding an approximation model")
  assert "REPO=/path/to/specdec_jax" in script and "--workdir=runs/my_draft" in script
  script = script.replace("REPO=/path/to/specdec_jax", f"REPO={REPO}")
  script = script.replace('cd "$(mktemp -d)"', f'cd "{tmp_path}"')
  script = script.replace("--workdir=runs/my_draft", "--workdir=runs/my_draft "
                          "--gin_bindings='Experiment.num_warmup = 1' "
                          "--gin_bindings='Experiment.num_examples = 2'")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
             PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
  res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  s = json.loads((tmp_path / "runs" / "my_draft" / "summary.json").read_text())
  assert s["draft"] == "repeat_last" and s["num_examples"] == 2
  assert s["mismatches_vs_baseline"] == 0  # the README's promise at T = 0
  assert "outputs identical to the baseline's on all 2" in res.stdout
  assert "runs/my_draft/ (examples.jsonl" in res.stdout
