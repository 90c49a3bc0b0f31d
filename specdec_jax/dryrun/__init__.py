"""The TPU dry run: a job's programs compiled for a TPU topology on any machine
(``driver``; distillation's list in ``distill_programs``, the runner's in
``run.dry_run_programs``), with ``chips``, ``hlo`` and the ``costs`` model.
"""
