"""The experiment runner (paper §4): speculative decoding against the plain
baseline on the same examples, with the same keys.

  python -m specdec_jax.run --config=configs/demo.gin

Modules: ``settings`` (the ``Experiment`` gin settings and their validation),
``setup`` (data and models, loaded after every cheap check), ``workdir``
(results on disk and ``--resume``), ``hosts`` (what the processes of a
multi-host run agree on), ``loop`` (the measured loops), ``report``
(``summary.json`` and the printed tables), ``account`` (where the speedup goes,
step by step from Theorem 3.8), ``autogamma`` (γ = 'auto', §3.5), ``sweep`` (γ
sweeps for benchmarks), ``cli`` (flags and errors; ``--dry_run`` compiles the
run's programs for a TPU topology with ``specdec_jax.dryrun``),
``logs`` (one logging setup for every entry point) and ``script_args`` (what the
scripts in scripts/ share).
"""

from specdec_jax.run.cli import main, parse_config, run_args
from specdec_jax.run.loop import pending, run_alpha_only, run_speculative
from specdec_jax.run.report import alpha_row, summarize, summarize_alpha, table2_row
from specdec_jax.run.settings import Experiment
from specdec_jax.run.setup import (Data, Setup, check_before_loading, held_out_inputs, load_data,
                                   load_draft, load_models, prepare)
from specdec_jax.run.workdir import Workdir

__all__ = ["Data", "Experiment", "Setup", "Workdir", "alpha_row", "check_before_loading",
           "held_out_inputs", "load_data", "load_draft", "load_models", "main", "parse_config",
           "pending", "prepare", "run_alpha_only", "run_args", "run_speculative", "summarize",
           "summarize_alpha", "table2_row"]
