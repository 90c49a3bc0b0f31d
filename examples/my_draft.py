"""A complete approximation model defined outside specdec_jax (README, "Adding an
approximation model"). From the directory holding this file (or with it next
to your config):

  python -m specdec_jax.run --config=/path/to/specdec_jax/configs/demo.gin \
      --import=my_draft.py --workdir=runs/my_draft \
      --gin_bindings="Experiment.draft_name = 'repeat_last'" \
      --gin_bindings="Experiment.draft_checkpoint = ''" \
      --gin_bindings="Experiment.draft_shortlist = ''"

It proposes γ copies of the last committed token. The proposal is
deterministic, so q is the one-hot of each proposed token: that is exactly the
distribution it was "drawn" from, which keeps speculative sampling exact.
"""

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.drafts import gather_positions, register


@register("repeat_last")  # a class works as its own builder (or decorate a function)
@struct.dataclass
class RepeatLastDraft:
  vocab_size: int = struct.field(pytree_node=False)  # the runner passes the target's

  def init(self, inputs, cache_len):
    return ()  # no state

  def propose(self, state, seq, length, gamma, sampling, key):
    last = gather_positions(seq, length[:, None])            # [B, 1]: last committed
    tokens = jnp.repeat(last, gamma, axis=1).astype(jnp.int32)  # [B, γ]
    q = jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)  # [B, γ, V]
    return tokens, q, state

  def commit(self, state, seq, length):
    return state
