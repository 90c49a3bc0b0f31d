"""The experiment runner (paper §4): speculative decoding against the plain
baseline on the same examples, with the same keys.

  python -m specdec_jax.run --config=configs/demo.gin

Its modules, read top to bottom, are listed in docs/layout.md."""

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
