"""The lab: studies of the engine, the accelerator and Hugging Face benchmarks,
γ sweeps and quality reports. It sits beside ``scripts/`` and is not
installed: it imports ``specdec_jax``, which never imports it. Scripts that
use it put the repository root on ``sys.path`` (after the installed package);
tests find it from the repository root.

  rounds      where one round's time goes: its pieces, chained, and the round
  contention  a target pass slowed by the draft's data in the shared caches
  replay      adaptive rounds' machinery; a rule's rounds decided and replayed
  probes      which confidence predicts a draft's acceptance; acceptance heads
  stopping    draft-length rules replayed offline along the target's outputs
  revisions   the kernel and sampler against an older git revision
  accounting  where a finished run's speedup goes
  trees       token trees priced with a roofline model; the best tree per chip
  sweep       γ sweeps: the baseline and speculative decoding side by side
  evaluate    BLEU/chrF and agreement reports of trained models
  plan_memory, dry_run_table, bench_tree, bench_vs_hf, train_demo_models,
  prepare_bible   the logic of the scripts of those names (memory plans, the
              dry-run tables, tree pricing, the Hugging Face comparison, the
              demo models and their data)
  bench/      the accelerator benchmark's sections and the Hugging Face comparisons
  common      helpers the studies share
"""
