"""The TPU dry run: a job's programs compiled for a TPU topology on any
machine, with libtpu's compile-only devices and no TPU.

``driver`` checks a job, compiles its list of programs and reports;
``runner_programs`` and ``distill_programs`` build the two lists (the
runner's ``--dry_run`` and ``scripts/distill_draft.py --dry_run``); ``chips``
holds the TPU generations' published figures and their topologies, ``hlo``
reads a compiled program's HLO text, and ``costs`` is the roofline model of a
decoding step.
"""
