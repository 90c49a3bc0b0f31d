r"""Experiment runner: speculative decoding vs the plain baseline (paper §4).

  python -m specdec_jax.run --config=configs/demo.gin [--config=more.gin] \
      [--gin_bindings='Experiment.gamma = 5'] [--workdir=runs/x] [--resume] \
      [--alpha_only] [--import=my_drafts] [--verbose] [--dry_run=v5e:2x4]
      [--calibrate=v4:1x1x1]

Everything an experiment varies is a gin binding of ``Experiment``,
``SamplingConfig`` or ``AdaptiveConfig`` (below, with defaults). The first
``num_warmup`` examples compile and warm both loops, untimed; c and v are
measured once; each timed batch runs through the baseline and speculative
decoding with the same inputs and key, one line of ``examples.jsonl`` each
(``summary.json`` is recomputed from them). ``--alpha_only`` (§4.2) averages
sum_x min(p, q) along the target's generations; ``--calibrate`` measures c,
v(k) and the collectives beside the dry run's model, decoding nothing.
Progress goes to stderr; the Table 2 row and a closing sentence to stdout.

Nothing is written before the first result, and ``config.gin`` with it, so
a workdir's files always describe its results. Another mode, config or a
corrupt line is refused with nothing changed; ``--resume`` may raise
``num_examples`` (on a finished run it prints the table, loading no model);
without ``--workdir`` a repeated command starts a new run; Ctrl-C says what is
on disk and prints the command that continues the run. Relative paths are
looked up in the working directory, next to each ``--config`` (last first),
then in the repository root.
"""


from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import itertools
import math
import os
import shlex
import sys
import tokenize
import traceback
from pathlib import Path
from typing import Optional, Sequence

import gin
from absl import app, flags, logging
from gin import resource_reader

from specdec_jax import checkpoints
from specdec_jax.decoding import AdaptiveConfig
from specdec_jax.dryrun import driver
from specdec_jax.run import (beam_run, check_model, dry_run_programs, gin_errors, hosts, logs,
                             settings)
from specdec_jax.run.loop import pending, run_alpha_only, run_speculative
from specdec_jax.run.report import alpha_row, conclusion, summarize, summarize_alpha, table2_row
from specdec_jax.run.settings import REPO_ROOT, Experiment, resolve_path
from specdec_jax.run.setup import check_before_loading, estimate_bytes, load_data, load_models
from specdec_jax.run.workdir import Workdir, release_holds
from specdec_jax.sampling import SamplingConfig


FLAGS = flags.FLAGS
flags.DEFINE_multi_string("config", [], "Gin config file(s); later files override earlier.")
flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings, e.g. 'Experiment.gamma = 5'.")
flags.DEFINE_string("workdir", None, "Output directory (default: runs/ and the --config file "
                    "stems joined by '+', e.g. runs/ende_small_t0+tpu_v5e_8; '_alpha' "
                    "appended with --alpha_only; where that holds results, the first of its "
                    "-2, -3, ... that does not, so a command can be repeated; with --resume, "
                    "the last that does).")
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
                    "for it on this machine (needs libtpu; reads no weight or data) and say "
                    "whether they fit the chips' memory and what a cost model predicts; with "
                    "--verbose, each program's memory, its collectives and the model's pieces "
                    "(specdec_jax.dryrun).")
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
  """Imports each module (a name or a .py path) for its registrations, from the
  working directory, sys.path, then beside each ``--config`` file."""
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


def _in_python_package(path: str) -> bool:
  """gin's package-include check, False (not TypeError) for a namespace
  package such as ``configs/``, so the search goes on."""
  try:
    return resource_reader.system_path_file_exists(path)
  except TypeError:
    return False


# gin has no public way to replace a registered reader's existence check.
gin.config._FILE_READERS[:] = [
    (read, _in_python_package if exists is resource_reader.system_path_file_exists else exists)
    for read, exists in gin.config._FILE_READERS]


def parse_config(configs: Sequence[str], bindings: Sequence[str]) -> Experiment:
  """Parses gin files and bindings into an Experiment (unknown bindings fail here)."""
  gin.clear_config()
  gin.add_config_file_search_path(str(REPO_ROOT))  # so `include 'configs/...'` works anywhere
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())  # so a config's `import my_module` line finds it
  files = [resolve_path(c) for c in configs]
  for c, f in zip(configs, files):
    if not Path(f).is_file():
      near = gin_errors.nearest_path(c, _config_files(c))
      raise FileNotFoundError(f"--config={c}: no such file"
                              + (f"; did you mean --config={near}?" if near else
                                 f" (looked for {f})"))
  try:
    gin.parse_config_files_and_bindings(files, bindings)
  except (SyntaxError, ValueError, KeyError, OSError, tokenize.TokenError) as e:
    explained = gin_errors.explain(e, files, bindings, _configurables())
    if explained is None:
      raise
    raise explained from None
  return Experiment(config_dirs=settings.config_dirs(files))


def _config_files(given: str) -> list[str]:
  """The gin files a mistyped ``--config`` may have meant, as the user would type them."""
  found: list[str] = []
  folder = Path(given).parent
  for base in (Path.cwd(), REPO_ROOT):
    beside = folder if folder.is_absolute() else base / folder
    for p in [*base.glob("*.gin"), *base.glob("configs/**/*.gin"), *beside.glob("*.gin")]:
      found.append(str(p) if folder.is_absolute() else os.path.relpath(p, base))
  return sorted(set(found))


def _configurables() -> dict[str, list[str]]:
  """The runner's gin configurables and their parameters (for "did you mean")."""
  return {"Experiment": [f.name for f in _settings()],
          **{c.__name__: [f.name for f in dataclasses.fields(c)]
             for c in (SamplingConfig, AdaptiveConfig)}}


def _print_result(s: dict, workdir: Workdir) -> None:
  if not hosts.is_writer():
    return
  if s.get("mode") == "beam":
    print(beam_run.row(s))
  else:
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
  # Every config names the run, so an overlay cannot make two rows share a workdir.
  stem = "+".join(Path(c).stem for c in FLAGS.config) if FLAGS.config else "default"
  if exp.decode_method == "beam" and (FLAGS.calibrate or FLAGS.dry_run):
    raise ValueError("--calibrate and --dry_run do not cover Experiment.decode_method='beam'; "
                     "run it without them")
  if FLAGS.calibrate:
    check_model.main(exp, FLAGS.calibrate, FLAGS.workdir or str(Path("runs") / f"{stem}_calibrate"),
                     FLAGS.dry_run, alpha_only)
    return
  if FLAGS.dry_run:
    logging.info("Dry run for %s: the run's programs compiled for it on this machine (no "
                 "weight or data is read)…", FLAGS.dry_run)
    driver.main(dry_run_programs.RunnerPrograms(exp, alpha_only, configs=FLAGS.config),
                FLAGS.dry_run, full=FLAGS.verbose)
    return
  mode = "alpha_only" if alpha_only else "beam" if exp.decode_method == "beam" else "speculative"
  name = stem + ("_alpha" if alpha_only else "")
  # The first line at once; on several hosts after jax.distributed starts, from process 0.
  if not exp.multihost:
    _state.workdir = FLAGS.workdir or default_workdir(name, FLAGS.resume)
    logging.info("%s", intro(exp, alpha_only, _state.workdir))
  check_before_loading(exp, alpha_only)  # before any data or weights are read
  if exp.multihost:
    _state.workdir = FLAGS.workdir or hosts.broadcast_json(default_workdir(name, FLAGS.resume))
    if hosts.is_writer():
      logging.info("%s", intro(exp, alpha_only, _state.workdir))
  workdir_path = _state.workdir
  _state.num_examples = 0 if alpha_only else exp.num_examples
  # Checks only, no writes; on several hosts process 0's results are everyone's.
  workdir = hosts.agreed(lambda: Workdir(workdir_path, config_str, FLAGS.resume, mode,
                                         num_indices=exp.num_warmup + exp.num_examples),
                         "opening the workdir")
  _state.opened = workdir
  workdir.records = hosts.broadcast_json(workdir.records)
  d = load_data(exp)
  if workdir.records and not pending(exp, len(d.examples), workdir, alpha_only):
    logging.info("%s: the run is finished (%d examples); nothing to do", workdir.path,
                 len(workdir.records))
    recs = workdir.records
    _print_result(beam_run.summarize(exp, recs) if mode == "beam" else
                  summarize_alpha(exp, recs, len(d.examples) - exp.num_warmup) if alpha_only
                  else summarize(exp, recs), workdir)
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
  _state.quiet.close()  # the timed loop's progress line redraws on a terminal
  run = {"beam": beam_run.run_beam, "alpha_only": run_alpha_only,
         "speculative": run_speculative}[mode]
  _print_result(run(setup, workdir), workdir)


def default_workdir(name: str, resume: bool, root: str = "runs") -> str:
  """Without ``--workdir``: the first of ``runs/<name>``, ``-2``, ``-3``, ...
  that holds nothing; with ``--resume`` the last that holds results."""
  paths = [Path(root) / name] + [Path(root) / f"{name}-{i}" for i in range(2, 10_000)]
  used = lambda p: p.is_dir() and any(p.iterdir())
  if resume:
    held = list(itertools.takewhile(used, paths))
    return str(held[-1] if held else paths[0])
  return str(next(p for p in paths if not used(p)))


@dataclasses.dataclass
class _Run:
  """What an interrupted run reports (``interrupted_words``); ``quiet``: the
  native-noise filter, closed before the timed loop."""

  workdir: Optional[str] = None
  opened: Optional[Workdir] = None
  num_examples: int = 0
  quiet: contextlib.ExitStack = dataclasses.field(default_factory=contextlib.ExitStack)


_state = _Run()


def continue_command(workdir: str) -> str:
  """The command line that continues this run in ``workdir`` (``--resume``)."""
  args = [f"--config={c}" for c in FLAGS.config]
  args += [f"--gin_bindings={b}" for b in FLAGS.gin_bindings]
  args += [f"--import={m}" for m in FLAGS["import"].value]
  args += ["--alpha_only"] * FLAGS.alpha_only + ["--verbose"] * FLAGS.verbose
  args += [f"--workdir={workdir}", "--resume"]
  return " ".join(["python -m specdec_jax.run", *map(shlex.quote, args)])


def interrupted_words(state: _Run) -> str:
  """What Ctrl-C left on disk, in words, and the command that continues it."""
  done = len(state.opened.records) if state.opened is not None else 0
  if state.workdir is None or not done:
    where = f" in {state.workdir}" if state.workdir else ""
    return (f"interrupted before the first result: nothing was written{where}; the same "
            "command starts the run again")
  of = f" of {state.num_examples}" if state.num_examples else ""
  return (f"interrupted: {state.opened.examples_path} holds {done}{of} examples, each "
          f"complete (summary.json is recomputed from them); to continue:\n"
          f"  {continue_command(state.workdir)}")


def intro(exp: Experiment, alpha_only: bool, workdir: str) -> str:
  """The run's first line: what it compares, on what, and where the results go."""
  target, draft = exp.labels
  if alpha_only:
    return (f"Measuring α (§4.2): target {target}, draft {draft}, T "
            f"{exp.sampling.temperature:g}, up to {exp.alpha_only_tokens} target tokens of "
            f"{exp.task} → {workdir}")
  if exp.decode_method == "beam":
    return (f"Beam search vs speculative beam search: target {target}, draft {draft}, width "
            f"{exp.beam_size}, draft width {exp.draft_beam_width}, γ {exp.gamma}, alpha "
            f"{exp.beam_alpha:g}, {exp.num_examples} examples of {exp.task} → {workdir}")
  if exp.tree:
    how = f"tree {exp.tree}"
  else:
    how = "γ chosen by measurement" if exp.gamma == "auto" else f"γ {exp.gamma}"
  return (f"Speculative decoding vs the baseline: target {target}, draft {draft}, {how}, T "
          f"{exp.sampling.temperature:g}, {exp.num_examples} examples of {exp.task} → "
          f"{workdir}")


def weights_words(exp: Experiment) -> str:
  """The weights about to be read, e.g. "12 MiB of weights" ('' if unknown)."""
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
  global _state
  _state = _Run()
  logs.quiet_libraries(not FLAGS.verbose)
  # The progress lines are INFO records.
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.INFO)
  try:
    # Before JAX starts a backend: an installed libtpu stays quiet off a TPU.
    logs.quiet_libtpu(FLAGS.dry_run or FLAGS.calibrate)
    with _state.quiet:  # until the timed loop: no native noise before a one-line error
      _state.quiet.enter_context(logs.quiet_native_noise(not FLAGS.verbose))
      main(argv)
    return 0
  except KeyboardInterrupt:
    print(interrupted_words(_state), file=sys.stderr)
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


__doc__ += settings.settings_help()


HELP_FLAGS = ("-h", "--help", "--helpshort", "-?")


def wants_help(args: Sequence[str]) -> bool:
  """Whether the command line asks for help (before any other flag is parsed)."""
  return any(a in HELP_FLAGS for a in args)


def help_text() -> str:
  """The usage text: this module's docstring and settings, then the runner's flags."""
  flags_text = FLAGS.module_help(__name__)
  return f"{__doc__.rstrip()}\n\nFlags (library flags: --helpfull):\n{flags_text}\n"


def app_main(argv: Sequence[str]) -> None:
  code = cli(argv)
  sys.stdout.flush()
  sys.stderr.flush()
  if code:
    os._exit(code)  # skip interpreter teardown, where Orbax's threads print noise
