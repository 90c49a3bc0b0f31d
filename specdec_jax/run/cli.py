r"""Experiment runner: speculative decoding vs the plain baseline (paper §4).

  python -m specdec_jax.run --config=configs/demo.gin [--config=more.gin] \
      [--gin_bindings='Experiment.gamma = 5'] [--workdir=runs/x] [--resume] \
      [--alpha_only] [--import=my_drafts] [--verbose] [--dry_run=v5e:2x4]
      [--calibrate=v4:1x1x1]

Everything an experiment varies is a binding of ``Experiment`` (listed below
with its default). Measurement protocol (``specdec_jax.run.loop``):

* the first ``num_warmup`` examples compile and warm both loops, untimed;
* each timed batch is decoded by the baseline and by speculative decoding with
  the same inputs, max length, sampling settings and key, each call ending in
  ``block_until_ready``;
* c and v are measured once, up front, with the same jitted pieces;
* per example, one line of ``examples.jsonl`` (appended and flushed as it
  completes); ``summary.json`` is recomputed from all lines, so every number
  it holds can be recomputed from ``examples.jsonl``.

``--calibrate=TOPOLOGY`` (or ``auto`` on a TPU) times c, v(k) and the loop's
collectives on this machine and prints them beside the dry run's cost model
for that topology, with the fixed cost per operation that would make the
model's c match (``specdec_jax.run.check_model``); nothing is decoded.

``--alpha_only`` (paper §4.2, Table 3) generates with the target alone and
averages sum_x min(p, q) along the generated tokens.

Output: on stderr, a line naming the run, then each long step before it
starts (with its size and, where something measured allows, about how long it
takes) and the progress of the timed examples; on stdout, the Table 2 row
(with Theorem 3.8's prediction at the measured c and v) and a closing
sentence. ``--verbose`` adds the cost account (also in ``summary.json``).

Workdir integrity: nothing is written before the first result; ``config.gin``
(the run's gin config) is written atomically with it, so a workdir's files
always describe its results. A workdir holds one mode (speculative or
``--alpha_only``); the other mode, a different config, or a corrupt line is
refused before any work, with nothing changed. ``--resume`` may raise
``Experiment.num_examples`` (the run is extended); on a finished run it prints
the table without loading any model.

Relative paths in configs (checkpoints, vocabulary, data) are looked up in the
working directory, then next to each ``--config`` file (last first), then in
the repository root.
"""


from __future__ import annotations

import dataclasses
import importlib
import inspect
import importlib.util
import math
import os
import re
import sys
import tokenize
import traceback
import typing
from pathlib import Path
from typing import Sequence

import gin
from absl import app, flags, logging

from specdec_jax import checkpoints
from specdec_jax.dryrun import driver
from specdec_jax.run import check_model, dry_run_programs, gin_errors, hosts, logs, settings
from specdec_jax.run.loop import pending, run_alpha_only, run_speculative
from specdec_jax.run.report import alpha_row, conclusion, summarize, summarize_alpha, table2_row
from specdec_jax.run.settings import REPO_ROOT, Experiment, resolve_path
from specdec_jax.run.setup import check_before_loading, estimate_bytes, load_data, load_models
from specdec_jax.run.workdir import Workdir, release_holds

# ---------------------------------------------------------------- main


FLAGS = flags.FLAGS
flags.DEFINE_multi_string("config", [], "Gin config file(s); later files override earlier.")
flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings, e.g. 'Experiment.gamma = 5'.")
flags.DEFINE_string("workdir", None, "Output directory (default: runs/ and the --config file "
                    "stems joined by '+', e.g. runs/ende_small_t0+tpu_v5e_8; '_alpha' "
                    "appended with --alpha_only).")
flags.DEFINE_bool("resume", False, "Continue after the last complete line of examples.jsonl "
                  "(Experiment.num_examples may be raised; a finished run just prints).")
flags.DEFINE_bool("alpha_only", False, "Only measure alpha along target generations (§4.2).")
flags.DEFINE_multi_string("import", [], "A Python module to import before the config is "
                          "parsed, by name (found in the working directory or sys.path) or "
                          "as path/to/file.py, e.g. one that registers an approximation "
                          "model; may repeat.")
flags.DEFINE_bool("verbose", False, "Also print the cost account under the row (EXP with c "
                  "alone, EXP in context, the whole-run factors; all of it is in summary.json "
                  "either way), each step's measurements, library INFO logs (Orbax, JAX) with "
                  "their logging prefix, and the traceback of user errors.")
flags.DEFINE_string("dry_run", None, "A TPU topology, e.g. v5e:2x4: compile the run's programs "
                    "for it on this machine (needs libtpu; reads no weight or data) and report "
                    "memory, collectives and a roofline model (specdec_jax.dryrun).")
flags.DEFINE_string("calibrate", None, "A TPU topology (as --dry_run), or 'auto' for the TPU "
                    "it runs on: time the row's c, v(k) and the loop's collectives on this "
                    "machine, print them beside the dry run's model for that topology and the "
                    "fixed cost that fits it, write calibrate.json into --workdir; decodes "
                    "nothing (specdec_jax.run.check_model).")

# Bad settings, missing or malformed files: one line on stderr, no traceback.
USER_ERRORS = (ValueError, OSError, LookupError, ImportError, checkpoints.CheckpointError)


def _load_file(path: Path) -> None:
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[path.stem] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[path.stem]
    raise


def import_modules(names: Sequence[str], config_dirs: Sequence[Path] = ()) -> None:
  """Imports each module (a name, or a path to a .py file) for its
  registrations; looked for in the working directory and on sys.path, then
  next to each ``--config`` file (``config_dirs``)."""
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())  # as `python -m` does; in-process callers need it too
  for name in names:
    is_file = name.endswith(".py") or os.sep in name
    beside = [Path(d) / (name if is_file else f"{name.replace('.', os.sep)}.py")
              for d in config_dirs]
    if is_file:
      found = [p for p in [Path(name)] + beside if p.is_file()]
      if not found:
        raise FileNotFoundError(f"--import={name}: no such file (looked for "
                                f"{', '.join(str(p.resolve()) for p in [Path(name)] + beside)})")
      _load_file(found[0].resolve())
      continue
    try:
      importlib.import_module(name)
    except ModuleNotFoundError as e:
      if e.name != name.split(".")[0] and e.name != name:
        raise  # the module exists but one of its own imports is missing
      found = [p for p in beside if p.is_file()]
      if not found:
        raise ValueError(f"--import={name}: no module named {name!r} in the working "
                         f"directory ({os.getcwd()}), on sys.path or next to the --config "
                         "files") from None
      _load_file(found[0].resolve())


def parse_config(configs: Sequence[str], bindings: Sequence[str]) -> Experiment:
  """Parses gin files and bindings into an Experiment (unknown bindings fail here)."""
  gin.clear_config()
  gin.add_config_file_search_path(str(REPO_ROOT))  # so `include 'configs/...'` works anywhere
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())  # so a config's `import my_module` line finds it
  files = [resolve_path(c) for c in configs]
  for f in files:
    if not Path(f).is_file():
      raise FileNotFoundError(f"--config={f}: no such file")
  try:
    gin.parse_config_files_and_bindings(files, bindings)
  except (SyntaxError, ValueError, KeyError, OSError, tokenize.TokenError) as e:
    explained = gin_errors.explain(e, files, bindings, _configurables())
    if explained is None:
      raise
    raise explained from None
  return Experiment(config_dirs=settings.config_dirs(files))


def _configurables() -> dict[str, list[str]]:
  """The runner's gin configurables and their parameters (for "did you mean")."""
  return {"Experiment": [f.name for f in _settings()],
          "SamplingConfig": list(inspect.signature(settings.sampling_config).parameters),
          "AdaptiveConfig": list(inspect.signature(settings.adaptive_config).parameters)}


def _print_result(s: dict, workdir: Workdir) -> None:
  if not hosts.is_writer():
    return
  print(alpha_row(s) if s.get("mode") == "alpha_only" else table2_row(s, FLAGS.verbose))
  print(conclusion(s, str(workdir.path)))
  sys.stdout.flush()


def main(argv: Sequence[str]) -> None:
  """The runner; raises user errors (see ``cli`` for how they are reported)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import_modules(FLAGS["import"].value,
                 [Path(resolve_path(c)).resolve().parent for c in FLAGS.config])
  exp = parse_config(FLAGS.config, FLAGS.gin_bindings)
  config_str = gin.config_str()
  alpha_only = FLAGS.alpha_only
  # Every config names the run: a hardware overlay (configs/tpu_v4_8.gin) must
  # not make two Table 2 rows share a workdir.
  stem = "+".join(Path(c).stem for c in FLAGS.config) if FLAGS.config else "default"
  if FLAGS.calibrate:
    check_model.main(exp, FLAGS.calibrate,
                     FLAGS.workdir or str(Path("runs") / f"{stem}_calibrate"),
                     FLAGS.dry_run, alpha_only)
    return
  if FLAGS.dry_run:
    logging.info("Dry run for %s: the run's programs compiled for it on this machine (no "
                 "weight or data is read)…", FLAGS.dry_run)
    driver.main(dry_run_programs.RunnerPrograms(exp, alpha_only, configs=FLAGS.config),
                FLAGS.dry_run)
    return
  mode = "alpha_only" if alpha_only else "speculative"
  workdir_path = FLAGS.workdir or str(Path("runs") / (stem + ("_alpha" if alpha_only else "")))
  # The first line at once; on several hosts only after jax.distributed starts
  # (in check_before_loading: no JAX call may come before it), from process 0.
  if not exp.multihost:
    logging.info("%s", intro(exp, alpha_only, workdir_path))
  check_before_loading(exp, alpha_only)  # before any data or weights are read
  if exp.multihost and hosts.is_writer():
    logging.info("%s", intro(exp, alpha_only, workdir_path))
  # Checks only, no writes; on several hosts process 0's results are everyone's.
  workdir = hosts.agreed(lambda: Workdir(workdir_path, config_str, FLAGS.resume, mode,
                                         num_indices=exp.num_warmup + exp.num_examples),
                         "opening the workdir")
  workdir.records = hosts.broadcast_json(workdir.records)
  d = load_data(exp)
  if workdir.records and not pending(exp, len(d.examples), workdir, alpha_only):
    logging.info("%s: the run is finished (%d examples); nothing to do", workdir.path,
                 len(workdir.records))
    _print_result(summarize_alpha(exp, workdir.records, len(d.examples) - exp.num_warmup)
                  if alpha_only else summarize(exp, workdir.records), workdir)
    return
  if workdir.records:
    logging.info("Resuming: %d examples already in %s", len(workdir.records), workdir.path)
  size = weights_words(exp)
  logging.info("Loading the target and %s%s…", "the draft" if exp.draft_checkpoint else
               f"building the draft {exp.draft_name!r}", f" ({size})" if size else "")
  setup = load_models(exp, d)  # all loading and checking before the workdir is touched
  for i in sorted(d.truncated):
    logging.warning("Example id=%r (index %d) was truncated to max_input_len=%d tokens",
                    d.examples[i].id, i, exp.max_input_len)
  logging.info("Workdir %s (%d examples already done)", workdir.path, len(workdir.records),
               extra=logs.DETAIL)
  s = run_alpha_only(setup, workdir) if alpha_only else run_speculative(setup, workdir)
  _print_result(s, workdir)


def intro(exp: Experiment, alpha_only: bool, workdir: str) -> str:
  """The run's first line: what it compares, on what, and where the results go."""
  target, draft = exp.labels
  if alpha_only:
    return (f"Measuring α (§4.2): target {target}, draft {draft}, T "
            f"{exp.sampling.temperature:g}, up to {exp.alpha_only_tokens} target tokens of "
            f"{exp.task} → {workdir}")
  if exp.tree:
    how = f"tree {exp.tree}"
  else:
    how = "γ chosen by measurement" if exp.gamma == "auto" else f"γ {exp.gamma}"
  return (f"Speculative decoding vs the baseline: target {target}, draft {draft}, {how}, T "
          f"{exp.sampling.temperature:g}, {exp.num_examples} examples of {exp.task} → "
          f"{workdir}")


def weights_words(exp: Experiment) -> str:
  """The weights about to be read, in words ("12 MiB of weights"); '' where
  a checkpoint does not say its architecture."""
  try:
    parts = estimate_bytes(exp)
  except (ValueError, OSError):
    parts = {}
  n = sum(v for k, v in parts.items() if k.endswith("weights"))
  if not n:
    return ""
  per = " per device" if exp.mesh_shape and math.prod(exp.mesh_shape) > 1 else ""
  return (f"{n / 2**30:.1f} GiB" if n >= 2**30 else
          f"{n / 2**20:.{0 if n >= 10 * 2**20 else 1}f} MiB") + \
      f" of weights{per}"


def _message(e: BaseException) -> str:
  text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
  # gin appends "In call to configurable ..." lines; the first line says it all.
  text = "\n".join(l for l in str(text).splitlines() if "In call to configurable" not in l)
  return f"{type(e).__name__}: {text}" if not isinstance(e, (ValueError, OSError)) else text


def cli(argv: Sequence[str]) -> int:
  """Runs ``main``; a user error ends in one line on stderr and exit status 2."""
  logs.quiet_libraries(not FLAGS.verbose)
  # The progress lines are INFO records: shown under absl.app (the command
  # line) and, in process (tests, notebooks), wherever a handler takes them.
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.INFO)
  try:
    # Before JAX starts a backend: an installed libtpu stays quiet off a TPU.
    logs.quiet_libtpu(FLAGS.dry_run or FLAGS.calibrate)
    main(argv)
    return 0
  except KeyboardInterrupt:
    print("interrupted (the workdir holds only complete results)", file=sys.stderr)
    return 130
  except USER_ERRORS as e:
    if FLAGS.verbose:
      traceback.print_exc()
    print(f"error: {_message(e)}", file=sys.stderr)
    return 2
  finally:
    release_holds()  # the workdir's writer hold, at any end


def run_args(args: Sequence[str]) -> int:
  """In-process entry for tests and notebooks: parses ``args`` as flags, runs ``cli``."""
  FLAGS.unparse_flags()
  rest = FLAGS(["specdec_jax.run", *args])
  return cli(rest)


def _settings() -> list[dataclasses.Field]:
  """The ``Experiment`` fields a user binds (``config_dirs`` is set by parsing)."""
  return [f for f in dataclasses.fields(Experiment) if f.name != "config_dirs"]


def _settings_help() -> str:
  hints = typing.get_type_hints(Experiment)
  short = lambda t: re.sub(r"[\w.]+\.(\w+)", r"\1",
                           str(t).replace("<class '", "").replace("'>", ""))
  lines = ["", "Experiment settings (--gin_bindings='Experiment.<name> = <value>'; defaults):"]
  for f in _settings():
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    lines.append(f"  {f.name}: {short(hints[f.name])} = {default!r}")
  lines += ["", "Sampling (§2.2): SamplingConfig.temperature (0: argmax), .topk, .topp.",
            "Adaptive draft length: Experiment.adaptive = @AdaptiveConfig() with",
            "  AdaptiveConfig.rule ('threshold', 'cumulative', 'schedule'), .threshold,",
            "  .skip_below, .confidence ('top', 'drawn'), .initial_gamma, .widths."]
  return "\n".join(lines) + "\n"


__doc__ += _settings_help()


HELP_FLAGS = ("-h", "--help", "--helpshort", "-?")


def wants_help(args: Sequence[str]) -> bool:
  """Whether the command line asks for help (before any other flag is parsed)."""
  return any(a in HELP_FLAGS for a in args)


def help_text() -> str:
  """The usage text: this module's docstring (protocol and every ``Experiment``
  setting with its default), then every runner flag with its help."""
  flags_text = FLAGS.module_help(__name__)
  return f"{__doc__.rstrip()}\n\nFlags (library flags: --helpfull):\n{flags_text}\n"


def app_main(argv: Sequence[str]) -> None:
  code = cli(argv)
  sys.stdout.flush()
  sys.stderr.flush()
  if code:
    os._exit(code)  # skip interpreter teardown, where Orbax's threads print noise

