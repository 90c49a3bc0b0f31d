"""The experiment runner (paper §4): speculative decoding against the plain
baseline on the same examples, with the same keys.

  python -m specdec_jax.run --config=configs/demo.gin

Read top to bottom: ``settings`` (the ``Experiment`` gin settings and their
validation), ``setup`` (data, held-out inputs and models, loaded after every
cheap check), ``workdir`` (results on disk and ``--resume``), ``programs``
(the batches and the two jitted programs a run times), ``calibrate`` (γ,
warm-up, c and v, prefill: everything measured before the timed loop),
``autogamma`` (γ = 'auto', §3.5, plain decoding where no γ pays), ``loop``
(the timed loop and ``--alpha_only``), ``counts`` (one statistics record for
chain, tree and plain runs), ``report`` (``summary.json``, the printed tables
and the closing sentence), ``account`` (where the speedup goes, step by step
from Theorem 3.8), ``hosts`` (what the processes of a multi-host run agree on),
``cli`` (flags and errors) and ``logs`` (one logging setup for every entry
point; ``--dry_run`` compiles the run's programs for a TPU topology with
``specdec_jax.dryrun``).
α measurement lives in ``specdec_jax.alpha``; what the scripts share (their
flags, Table 2's rows, tables and figures) in ``specdec_jax.scripting``.
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
