"""docs/tpu.md, steps 2 to 9, run as written on this CPU, in order, in one
bash session from a copy of this checkout; the README's "Reproducing Table 2"
holds the same commands (checked here, command for command). The test fails
when a documented command fails, or prints or writes something the page
contradicts.

What differs from a TPU VM is stated once, in SUBSTITUTIONS below, and nowhere
else: Cloud Storage is the local emulator (tests/gcs_emulator.py: TensorStore
reaches it directly, TensorFlow's own client through a local proxy), holding
the user's bucket and a `t5-data` bucket with tiny T5X checkpoints and a tiny
vocabulary at the public checkpoints' exact paths; TensorFlow Datasets'
downloads come from tiny local files (tests/tfds_downloads.py), built by
TFDS's real builders; bindings shrink the models (tiny presets), lengths and
example counts; JAX sees four CPU devices, as the v4-8 has four chips.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import gcs_emulator
import tfds_downloads
from checkpoint_fixtures import random_params, write_t5x_legacy

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "tpu.md"
README = REPO / "README.md"
ENV_DIR = Path(__file__).resolve().parent / "tpu_page_env"  # its sitecustomize.py

# ------------------------------------------------------------------ SUBSTITUTIONS
# Everything the test changes about the page, in one place.
BUCKET = "your-bucket"
TEXT = {"YOUR_BUCKET": BUCKET}  # replaced in every command (gs://your-bucket: the emulator)
# Lines not run: the VM and its tools (no gcloud, no tmux here), and the
# install lines, which are checked against pyproject.toml instead (the extras
# they name exist, and every requirement those extras declare is installed in
# the environment running this test, the one the commands then run in).
SKIPPED = ("gcloud ", "tmux ", "curl ", "uv venv ", "uv pip install ", "pip install ")
# `git clone YOUR_CLONE_URL specdec_jax`: a copy of this checkout's files
# (tracked and untracked, not ignored) into specdec_jax/ instead.
CLONE = "git clone YOUR_CLONE_URL specdec_jax"
# The models: tiny T5 1.0 stand-ins under new preset names, written as T5X
# checkpoints at the public paths in the `t5-data` bucket; the vocabulary a
# tiny SentencePiece model at the public vocabulary's path.
TINY_TARGET = dict(vocab_size=64, d_model=32, num_heads=4, head_dim=8, num_encoder_layers=2,
                   num_decoder_layers=2, d_ff=48, version="1.0")
TINY_DRAFT = {**TINY_TARGET, "num_encoder_layers": 1, "num_decoder_layers": 1}
PRESETS = {"tiny_t5_1_0_target": TINY_TARGET, "tiny_t5_1_0_draft": TINY_DRAFT}
T5X = "gs://t5-data/pretrained_models/t5x"
CHECKPOINTS = {f"{T5X}/t5_11B/checkpoint_1000000": "tiny_t5_1_0_target",
               f"{T5X}/t5_small/checkpoint_1000000": "tiny_t5_1_0_draft",
               f"{T5X}/t5_base/checkpoint_999900": "tiny_t5_1_0_draft",
               f"{T5X}/t5_large/checkpoint_1000700": "tiny_t5_1_0_draft"}
VOCAB = "gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model"
# Bindings appended to every `python -m specdec_jax.run` and
# `scripts/run_table2.py` command: tiny models, short inputs and outputs, one
# warm-up example, two timing repeats.
SHRINK = ("Experiment.target_preset = 'tiny_t5_1_0_target'",
          "Experiment.draft_preset = 'tiny_t5_1_0_draft'",
          "Experiment.max_input_len = 32", "Experiment.max_decode_len = 6",
          "Experiment.num_warmup = 1", "Experiment.cost_repeats = 2")
# The rows' 200 examples (configs/base.gin) become 6 in step 8: one more than
# step 7's five, so that step 8 continues step 7's row, as the page says.
ALL_ROWS_EXAMPLES = 6
# The environment: four CPU devices (a v4-8 has four chips, one JAX device
# each); HOME a fresh folder (the VM user's: prepare_data keeps raw downloads
# and the page's compilation cache there);
# the suite's compiler flags (tests/conftest.py); every compiled program kept
# in the page's compilation cache (JAX keeps only those compiled in over 1 s).
ENV = {"JAX_PLATFORMS": "cpu",
       "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
# -------------------------------------------------------------------------------

ROWS = sorted(p.stem for p in (REPO / "configs" / "table2_t5_1_0").glob("*.gin"))
MARK = "@@@ command "


def shell_commands(markdown: str) -> list[str]:
  """The commands of a markdown text's ```bash blocks, in order: continued
  lines joined, comments and blank lines dropped."""
  commands = []
  for block in re.findall(r"```bash\n(.*?)```", markdown, re.S):
    for command in block.replace("\\\n", " ").splitlines():
      command = re.sub(r"\s+#.*$", "", command).strip()
      command = re.sub(r"\s+", " ", command)
      if command and not command.startswith("#"):
        commands.append(command)
  return commands


def page_steps() -> dict[int, list[str]]:
  """{step: its commands} of docs/tpu.md's numbered sections 2 to 9."""
  text = PAGE.read_text()
  sections = re.split(r"^## (\d+)\. ", text, flags=re.M)
  steps = {int(n): shell_commands(body) for n, body in zip(sections[1::2], sections[2::2])}
  assert sorted(steps) == list(range(1, 10)), sorted(steps)
  return {n: c for n, c in steps.items() if 2 <= n <= 9}


def readme_commands() -> list[str]:
  section = README.read_text().split("## Reproducing Table 2\n", 1)[1].split("\n## ", 1)[0]
  return shell_commands(section)


def substitute(command: str) -> str | None:
  """The command as this test runs it (SUBSTITUTIONS), or None when skipped."""
  if command.startswith(SKIPPED):
    return None
  if command.startswith(CLONE):
    return command.replace(CLONE, "cp -r ../checkout specdec_jax", 1)
  for old, new in TEXT.items():
    command = command.replace(old, new)
  words = shlex.split(command)
  if words[:3] == ["python", "-m", "specdec_jax.run"] or words[:2] == [
      "python", "scripts/run_table2.py"]:
    extra = list(SHRINK)
    if "run_table2.py" in command:
      extra.append(f"Experiment.num_examples = {ALL_ROWS_EXAMPLES}")
    command += "".join(f" --gin_bindings={shlex.quote(b)}" for b in extra)
  return command


def requirement_name(requirement: str) -> str:
  return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def check_install_line(command: str) -> None:
  """`pip install -e ".[a,b]"`: the extras exist in pyproject.toml and what
  they declare is installed here."""
  import importlib.metadata
  extras = re.search(r'-e "?\.\[([\w,]+)\]"?', command)
  assert extras, f"install line without the package's extras: {command}"
  declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
      "optional-dependencies"]
  for extra in extras.group(1).split(","):
    assert extra in declared, f"{command}: pyproject.toml has no extra {extra!r}"
    for requirement in declared[extra]:
      name = requirement_name(requirement)
      try:
        importlib.metadata.version(name)
      except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{command}: {name} (extra {extra!r}) is not installed in this environment")


def _copy_checkout(dest: Path) -> None:
  listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          cwd=REPO, capture_output=True, check=True).stdout.decode()
  for rel in filter(None, listed.split("\0")):
    src = REPO / rel
    if src.is_file():
      (dest / rel).parent.mkdir(parents=True, exist_ok=True)
      (dest / rel).write_bytes(src.read_bytes())


def _tiny_vocab(folder: Path) -> Path:
  """A SentencePiece model over the tiny datasets' words and the task prefixes."""
  import sentencepiece as spm
  lines = [tfds_downloads.english(i) for i in range(60)]
  lines += [tfds_downloads.german(l) for l in lines]
  lines += [f"translate English to German: {l}" for l in lines[:30]]
  lines += [f"summarize: {l}." for l in lines[:30]]
  (folder / "corpus.txt").write_text("\n".join(lines) + "\n")
  spm.SentencePieceTrainer.train(input=str(folder / "corpus.txt"),
                                 model_prefix=str(folder / "spm"), vocab_size=60,
                                 hard_vocab_limit=False, model_type="unigram", pad_id=0,
                                 eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
  return folder / "spm.model"


@pytest.fixture(scope="module")
def page_run(tmp_path_factory):
  """The page's commands run in one bash session: (commands as run, the
  per-command output, the clone's path, the wall time)."""
  pytest.importorskip("gcp_storage_emulator")
  pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("seqio")
  pytest.importorskip("libtpu")  # the dry run and --calibrate compile for a v4 chip
  import jax.numpy as jnp  # noqa: F401  (the fixtures below need jax)
  from specdec_jax.models.t5 import T5Config

  home = tmp_path_factory.mktemp("tpu_page")
  _copy_checkout(home / "checkout")
  (home / "vm").mkdir()
  env_files = home / "env"
  env_files.mkdir()
  (env_files / "presets.json").write_text(json.dumps(PRESETS))
  downloads = tfds_downloads.write_sources(home / "sources")
  (env_files / "downloads.json").write_text(json.dumps({u: str(p) for u, p in downloads.items()}))

  steps = page_steps()
  script, ran = ["set -euo pipefail", "cd vm"], []
  for step, commands in steps.items():
    for command in commands:
      if command.startswith(("pip install ", "uv pip install ")):
        check_install_line(command)
      run = substitute(command)
      if run is None:
        continue
      ran.append((step, command, run))
      script.append(f"echo {shlex.quote(f'{MARK}{len(ran) - 1}')} $(date +%s.%N); "
                    f"echo {shlex.quote(f'{MARK}{len(ran) - 1}')} >&2")
      script.append(run)

  script.append(f"echo {shlex.quote(f'{MARK}{len(ran)}')} $(date +%s.%N)")  # the end

  with gcs_emulator.running(home / "emulator.log") as host:
    for bucket in (BUCKET, "t5-data"):
      gcs_emulator.create_bucket(host, bucket)
    for i, (url, preset) in enumerate(CHECKPOINTS.items()):
      local = home / "checkpoints" / str(i)
      write_t5x_legacy(str(local), random_params(T5Config(**PRESETS[preset]), seed=i))
      gcs_emulator.upload_tree(host, local, url)
    gcs_emulator.upload(host, VOCAB, _tiny_vocab(home).read_bytes())
    with gcs_emulator.google_endpoints(host, home) as gcs_env:
      (home / "home").mkdir()
      # Nothing inherited may point TensorStore at another test's emulator.
      env = {**{k: v for k, v in os.environ.items()
                if k not in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")},
             **{k: v.replace("$HOME", str(home / "home")) for k, v in ENV.items()},
             **gcs_env, "HOME": str(home / "home"),
             # The clone's package first, as its `pip install -e` would make it.
             "PYTHONPATH": os.pathsep.join([str(ENV_DIR), str(home / "vm" / "specdec_jax")]),
             "SPECDEC_TEST_PRESETS": str(env_files / "presets.json"),
             tfds_downloads.SERVE_ENV: str(env_files / "downloads.json"),
             "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
      start = time.monotonic()
      res = subprocess.run(["bash", "-c", "\n".join(script)], cwd=home, env=env,
                           capture_output=True, text=True, timeout=3600)
      wall = time.monotonic() - start
  outs = _split(res.stdout, len(ran))
  errs = _split(res.stderr, len(ran))
  seconds = _seconds(res.stdout)
  for i, (step, _, run) in enumerate(ran):
    if i in seconds:
      print(f"step {step}, {seconds[i]:5.1f} s: {run[:100]}")
    # Each command's output, to read after a failure: tpu_page*/outputs/ under --basetemp.
    (home / "outputs").mkdir(exist_ok=True)
    (home / "outputs" / f"{i:02d}.txt").write_text(
        f"$ {run}\n--- stdout\n{outs[i] or ''}\n--- stderr\n{errs[i] or ''}")
  if res.returncode != 0:
    last = max(i for i in range(len(ran)) if outs[i] is not None or errs[i] is not None)
    step, command, run = ran[last]
    pytest.fail(f"docs/tpu.md step {step}: `{command}` failed (exit {res.returncode}); run as "
                f"`{run}`:\n{(outs[last] or '')[-2000:]}\n{(errs[last] or '')[-4000:]}")
  return ran, outs, errs, home / "vm" / "specdec_jax", wall


def _split(text: str, n: int) -> list:
  """Output per command, by the markers echoed before each (None: not reached)."""
  parts: list = [None] * n
  chunks = re.split(rf"^{re.escape(MARK)}(\d+)(?: [\d.]+)?\n", text, flags=re.M)
  for index, body in zip(chunks[1::2], chunks[2::2]):
    if int(index) < n:
      parts[int(index)] = body
  return parts


def _seconds(stdout: str) -> dict[int, float]:
  """{command index: seconds it ran}, from the start times its marker holds."""
  starts = [(int(i), float(t)) for i, t in
            re.findall(rf"^{re.escape(MARK)}(\d+) ([\d.]+)$", stdout, flags=re.M)]
  return {i: t1 - t0 for (i, t0), (_, t1) in zip(starts, starts[1:])}


def _output(page_run, step: int, starts: str) -> tuple[str, str]:
  ran, outs, errs, _, _ = page_run
  i = next(i for i, (s, c, _) in enumerate(ran) if s == step and c.startswith(starts))
  return outs[i], errs[i]


@pytest.mark.slow
def test_readme_holds_the_pages_commands():
  """The README's "Reproducing Table 2" commands are the page's, in the same
  order ($BUCKET spelled out), so the page's run below runs them too."""
  page = [c.replace("$BUCKET", "gs://YOUR_BUCKET").replace("uv pip install", "pip install")
          for commands in page_steps().values() for c in commands]
  readme = readme_commands()
  assert readme, "README 'Reproducing Table 2' has no bash block"
  at = 0
  for command in readme:
    assert command in page[at:], f"README command not on docs/tpu.md (or out of order): {command}"
    at = page.index(command, at) + 1


@pytest.mark.slow
def test_every_step_runs_and_says_what_the_page_says(page_run):
  ran, outs, errs, clone, wall = page_run
  print(f"the page's {len(ran)} commands ran in {wall:.0f} s")
  runs = clone / "runs"

  # Step 2: the devices (four here, as the v4-8's four chips).
  out, _ = _output(page_run, 2, "python -c")
  assert out.count("CpuDevice") == 4, out

  # Step 3: each dataset built under the exact name and version the tasks read.
  for dataset, sub in (("wmt_ende", "wmt_t2t_translate/de-en/1.0.0"),
                       ("cnn_dailymail", "cnn_dailymail/3.4.0")):
    out, _ = _output(page_run, 3, f"python -m specdec_jax.prepare_data --dataset={dataset}")
    assert f"prepared in gs://{BUCKET}/tfds/{sub}" in out, out
    assert f"Experiment.tfds_data_dir = 'gs://{BUCKET}/tfds'" in out, out

  # Step 5: the dry run compiles for one v4 chip and prints memory against its 32 GiB.
  out, err = _output(page_run, 5, "python -m specdec_jax.run")
  assert "32 GiB" in out and "v4:1x1x1" in out, out[-3000:]

  # Step 6: calibrate.json written; nothing decoded.
  out, _ = _output(page_run, 6, "python -m specdec_jax.run")
  assert (runs / "calibrate" / "t5_1_0_ende_small_t0" / "calibrate.json").is_file()
  assert "nothing was decoded" in out, out[-3000:]

  # Step 7: five examples; the row and the three files; the mesh from the first device.
  out, err = _output(page_run, 7, "python -m specdec_jax.run")
  row = runs / "table2" / "t5_1_0_ende_small_t0"
  for name in ("examples.jsonl", "summary.json", "config.gin"):
    assert (row / name).is_file(), name
  assert "1 of the 4 cpu devices" in out + err, (out + err)[-3000:]

  # Step 8: twelve rows into runs/table2/<row>, step 7's continued; the table and figures.
  out, err = _output(page_run, 8, "python scripts/run_table2.py")
  for name in ROWS:
    summary = json.loads((runs / "table2" / name / "summary.json").read_text())
    assert summary["num_examples"] == ALL_ROWS_EXAMPLES, name
    if name.endswith("_t0"):  # greedy: every output the baseline's
      assert summary["mismatches_vs_baseline"] == 0, name
  assert "resuming after 5 of 6" in out + err, (out + err)[-3000:]
  printed = out[out.index("### Table 2"):]
  for name in ("speedup.png", "tokens_per_call.png", "acceptance.png"):
    assert (runs / "table2" / name).stat().st_size > 5000, name

  # Step 9: the table from the finished rows, with the paper's numbers and a family column.
  out, _ = _output(page_run, 9, "python scripts/make_tables.py")
  table = (runs / "table2" / "table2.md").read_text()
  assert "family" in table and table.count("T5 1.0") >= len(ROWS), table
  assert table == printed  # the rows' table as step 8 printed it
