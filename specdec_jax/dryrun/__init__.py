"""The TPU dry run: a job's programs compiled for a TPU topology on any
machine, with libtpu's compile-only devices and no TPU.

``driver`` checks a job, compiles its list of programs and reports;
``distill_programs`` builds distillation's list (``scripts/distill_draft.py
--dry_run``) and the runner builds its own (``specdec_jax.run.dry_run_programs``, its
``--dry_run``): the dry run imports neither caller's settings; ``chips``
holds the TPU generations' published figures and their topologies, ``hlo``
reads a compiled program's HLO text, and ``costs`` is the roofline model of a
decoding step.
"""
