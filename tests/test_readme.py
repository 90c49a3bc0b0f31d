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
  assert "Outputs identical to the baseline's on all 2" in res.stdout
  assert "runs/my_draft/ (examples.jsonl" in res.stdout


def _copy_checkout(dest: Path) -> None:
  """The repository's files (tracked and untracked, not ignored) copied to ``dest``,
  as a fresh clone would hold them."""
  listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          cwd=REPO, capture_output=True, check=True).stdout.decode()
  for rel in filter(None, listed.split("\0")):
    src = REPO / rel
    if src.is_file():
      (dest / rel).parent.mkdir(parents=True, exist_ok=True)
      (dest / rel).write_bytes(src.read_bytes())


def test_quickstart_demo_from_a_clone_named_specdec_jax_prints_no_library_log(tmp_path):
  """The README's quickstart demo, run from a clone in a directory named
  ``specdec_jax`` whose virtualenv sits inside it (libraries imported from
  ``specdec_jax/.venv/...``): stderr holds only the run's own plain lines
  (no logging prefix, no library's line), stdout the row, the closing
  sentence and the results line."""
  quick = (REPO / "README.md").read_text().split("## Quickstart\n", 1)[1].split("\n## ", 1)[0]
  demo = next(l.split("#")[0].strip() for l in quick.splitlines()
              if l.startswith("python -m specdec_jax.run --config=configs/demo.gin"))
  clone = tmp_path / "specdec_jax"
  _copy_checkout(clone)
  site = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "jax").is_dir())
  (clone / ".venv").mkdir()
  (clone / ".venv" / "site-packages").symlink_to(site)  # libraries under the clone's path
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=f"{clone}{os.pathsep}{clone / '.venv' / 'site-packages'}")
  cmd = demo.split()[1:] + ["--gin_bindings=Experiment.num_warmup = 1",
                            "--gin_bindings=Experiment.num_examples = 2"]
  probe = subprocess.run([sys.executable, "-c", "import jax, orbax; print(jax.__file__)"],
                         cwd=clone, env=env, capture_output=True, text=True, check=True)
  assert probe.stdout.startswith(str(clone / ".venv")), probe.stdout  # the layout under test
  res = subprocess.run([sys.executable, *cmd], cwd=clone, env=env, capture_output=True,
                       text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  err = res.stderr.splitlines()
  assert err[0].startswith("Speculative decoding vs the baseline: target demo-target"), err
  assert not [l for l in err if re.match(r"[IWEF]\d{4} ", l)], res.stderr  # no prefix
  # Every line is the run's own: a step ("…"), a width's time, or progress.
  own = re.compile(r"^(Speculative decoding vs|.*…$|  width \d+: |\[\d+/\d+\] )")
  assert all(own.match(l) for l in err), [l for l in err if not own.match(l)]
  assert "Unable to initialize backend" not in res.stderr and "orbax" not in res.stderr.lower()
  last = res.stdout.strip().splitlines()
  assert len(last) == 5, res.stdout  # the row (3 lines), the closing sentence, the results
  assert re.match(r"Speculative decoding (was [\d.]+× (faster|slower) than|ran at the same "
                  r"speed as) the baseline on 2 held-out examples", last[-2]), last[-2:]
  assert last[-1].startswith("Results: runs/demo/"), last[-1]
  # The same command again (the README: it can be repeated) is a new run, in runs/demo-2.
  again = subprocess.run([sys.executable, *cmd], cwd=clone, env=env, capture_output=True,
                         text=True, timeout=900)
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.strip().splitlines()[-1].startswith("Results: runs/demo-2/")
  assert (clone / "runs" / "demo" / "summary.json").is_file()
