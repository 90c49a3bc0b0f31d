"""Studies of the engine's cost and acceptance, one module per study; scripts
use them, nothing in the package imports them.

  rounds      where one round's time goes: its pieces, chained, and the round
  contention  a target pass slowed by the draft's data in the shared caches
  replay      adaptive rounds' machinery; a rule's rounds decided and replayed
  probes      which confidence predicts a draft's acceptance; acceptance heads
  stopping    draft-length rules replayed offline along the target's outputs
  revisions   the kernel and sampler against an older git revision
  accounting  where a finished run's speedup goes
  common      helpers the studies share
"""
