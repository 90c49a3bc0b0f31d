"""The chain: Algorithm 1 (paper §2.3) in a loop (``speculative_decode``), fixed γ
(``ChainLoop``) or adaptive (``adaptive.AdaptiveLoop``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import struct

from specdec_jax.decoding.adaptive import AdaptiveConfig, AdaptiveLoop
from specdec_jax.decoding.state import (Loop, Proposal, SpecState, Verdict, cache_length, cut,
                                        finish, judge, pad_states, pin_state, round_keys, running,
                                        start, target_pass, validate)
from specdec_jax.drafts.base import (ApproximationModel, capabilities, commit_draft,
                                     gather_positions, proposal_steps)
from specdec_jax.models.base import TargetModel
from specdec_jax.partitioning import Partitioner
from specdec_jax.sampling import SamplingConfig
from specdec_jax.speculative import KernelOutput

Array = jax.Array


@struct.dataclass
class SpecStats:
  """Per-example statistics of one speculative generation ([B] unless noted; with
  adaptive γ, γ is γ_max and draft_calls the steps the batch ran in live rounds).

  target_calls, draft_calls: serial forward passes of M_p / M_q.
  accepted_at, evaluated_at [B, γ]: times position i was accepted / evaluated.
  accepted, rejected: totals over evaluated positions.
  min_pq_sum: sum over evaluated positions of sum_x min(p(x), q(x)).
  gamma_hist [B, γ + 1]: rounds in which the row proposed j tokens, at column j.
  target_positions: positions the target scored, Σ over rounds of k + 1 (Theorem 3.11)."""

  target_calls: Array
  draft_calls: Array
  accepted_at: Array
  evaluated_at: Array
  accepted: Array
  rejected: Array
  min_pq_sum: Array
  gamma_hist: Array
  target_positions: Array

  @classmethod
  def zeros(cls, batch: int, gamma: int) -> "SpecStats":
    z = jnp.zeros((batch,), jnp.int32)
    zg = jnp.zeros((batch, gamma), jnp.int32)
    return cls(z, z, zg, zg, z, z, jnp.zeros((batch,), jnp.float32),
               jnp.zeros((batch, gamma + 1), jnp.int32), z)


class SpecOutput(NamedTuple):
  tokens: Array   # [B, max_decode_len], 0 after EOS
  length: Array   # [B]
  stats: SpecStats


def alpha_estimates(stats: SpecStats) -> dict[str, Array]:
  """α per row two ways (§3.1-3.2): accepted / evaluated, and the mean of
  sum_x min(p, q) (Corollary 3.6); plus tokens per target call."""
  evaluated = stats.accepted + stats.rejected
  denom = jnp.maximum(evaluated, 1)
  return {"alpha": stats.accepted / denom, "alpha_min_pq": stats.min_pq_sum / denom}


@dataclasses.dataclass(frozen=True)
class ChainLoop(Loop):
  """The fixed-γ loop's static record (``state.Loop``'s fields and):

  states_wanted: the draft reads the target's decoder states (``commit_with_target``).
  gamma: γ, the draft tokens every round proposes.
  lenience: A.5's l (1: exact)."""

  states_wanted: bool
  gamma: int
  lenience: float

  def propose(self, draft: ApproximationModel, s: SpecState, key: Array) -> Proposal:
    """Algorithm 1's first loop: x_1..x_γ ~ q_1..q_γ, every row γ of them."""
    xs, q, draft_state = draft.propose(s.draft_state, s.seq, s.length, self.gamma, self.sampling,
                                       key)
    return Proposal(xs, q, jnp.full((s.seq.shape[0],), self.gamma, jnp.int32),
                    proposal_steps(draft, self.gamma), draft_state)

  def verify(self, params: Any, seq: Array, n: Array, p: Proposal, cache: Any,
             key: Array) -> Verdict:
    """ONE target pass at positions n..n+γ -> p_1..p_{γ+1}; Algorithm 1 on x_1..x_γ."""
    logits, cache, hidden, pos = target_pass(self.target, params, seq, n, self.gamma, cache,
                                             hidden=self.states_wanted)
    out = judge(self.sampling, self.lenience, logits, p.xs, p.q, key, None, self.gamma)
    return Verdict(out, cache, pad_states(hidden, pos, self.gamma), self.gamma)

  def next_gamma_row(self, gamma_row: Any, a: Array, proposed: Array, live: Array) -> None:
    """A fixed γ keeps no per-row γ."""
    return None


def _chain_stats(st: SpecStats, out: KernelOutput, live: Array, proposed: Array, steps: Any,
                 width: Any, count: Array) -> SpecStats:
  """``SpecStats`` after one round; count [B]: tokens the row kept (``cut``)."""
  a = out.num_accepted
  gamma = st.accepted_at.shape[1]
  idx = jnp.arange(1, gamma + 1, dtype=jnp.int32)[None]                # 1..γ
  reached = jnp.minimum(jnp.minimum(a + 1, count), proposed)
  evaluated = live[:, None] & (idx <= reached[:, None])                # --> [B, γ]
  accepted = evaluated & out.accepted
  rejected = live & (a < proposed) & (a + 1 <= count)
  return SpecStats(
      target_calls=st.target_calls + live, draft_calls=st.draft_calls + live * steps,
      accepted_at=st.accepted_at + accepted, evaluated_at=st.evaluated_at + evaluated,
      accepted=st.accepted + jnp.sum(accepted, 1), rejected=st.rejected + rejected,
      min_pq_sum=st.min_pq_sum + jnp.sum(jnp.where(evaluated, out.min_pq, 0.0), 1),
      gamma_hist=st.gamma_hist + (live[:, None] & (jnp.arange(gamma + 1)[None]
                                                   == proposed[:, None])),
      target_positions=st.target_positions + live * (width + 1))


def _chain_round(loop: ChainLoop | AdaptiveLoop, target_params: Any, draft: ApproximationModel,
                 s: SpecState) -> SpecState:
  """One round for every live row: propose, ONE target pass, the kernel, commit, cut."""
  b = s.seq.shape[0]
  key, k_draft, k_kernel = round_keys(s.key, loop.sampling.greedy, 3)
  n, live = s.length, ~s.done
  p = loop.propose(draft, s, k_draft)
  offsets = jnp.arange(p.xs.shape[1] + 1, dtype=jnp.int32)[None]      # 0..W
  # Candidates go to seq[n+1 .. n+W]; for live rows those slots are past the
  # committed prefix, and done rows are never read again.
  seq = s.seq.at[jnp.arange(b)[:, None], n[:, None] + offsets[:, 1:]].set(p.xs)
  v = loop.verify(target_params, seq, n, p, s.target_cache, k_kernel)
  a = v.out.num_accepted
  seq = seq.at[jnp.arange(b), n + a + 1].set(v.out.next_token)
  # Committed this round: seq[n+1 .. n+a+1].
  new_tok = gather_positions(seq, n[:, None] + offsets + 1)            # --> [B, W+1]
  length, done, count = cut(new_tok, a, n, s.done, loop.eos_id, loop.max_decode_len)
  draft_state = commit_draft(draft, p.draft_state, seq, length, v.target_states)
  stats = _chain_stats(s.stats, v.out, live, p.proposed, p.steps, v.width, count)
  gamma_row = loop.next_gamma_row(s.gamma_row, a, p.proposed, live)
  return pin_state(SpecState(seq, length, done, v.target_cache, draft_state, key, stats,
                             gamma_row), loop.partitioner)


CHAIN_STATIC = ("target", "gamma", "max_decode_len", "sampling", "lenience", "eos_id",
                "partitioner", "adaptive")


@functools.partial(jax.jit, static_argnames=CHAIN_STATIC)
def speculative_decode(target: TargetModel, target_params: Any, draft: ApproximationModel,
                       inputs: Array, key: Array, *, gamma: int, max_decode_len: int,
                       sampling: SamplingConfig = SamplingConfig(), lenience: float = 1.0,
                       eos_id: int = 1, partitioner: Partitioner | None = None,
                       adaptive: Optional[AdaptiveConfig] = None) -> SpecOutput:
  """Speculative decoding (Algorithm 1 in a loop), batched with per-row acceptance.

  Each round the draft proposes γ tokens, the target scores γ + 1 positions in
  ONE pass, and each row keeps its accepted prefix plus one token; rollback is
  the per-row length. ``draft``: any approximation model over the target's
  vocabulary; ``partitioner``: the mesh; ``adaptive`` (``AdaptiveConfig``):
  ``gamma`` is γ_max and each row proposes c_b <= γ_max. -> ``SpecOutput``
  (tokens [B, max_decode_len], 0 after EOS; length; ``SpecStats``). Lenience 1
  is exact for any draft (docs/exactness.md, sections 3-5)."""
  validate(max_decode_len, gamma, lenience)
  b = inputs.shape[0]
  common = (target, sampling, eos_id, max_decode_len, partitioner,
            capabilities(draft).target_states)
  if adaptive is None:
    loop, gamma_row = ChainLoop(*common, gamma=gamma, lenience=lenience), None
  else:
    loop = AdaptiveLoop.build(*common, adaptive=adaptive, gamma_max=gamma, lenience=lenience)
    gamma_row = loop.first_gamma_row(b)
  # Rows finish at most at max_decode_len; a round writes γ+1 past the length.
  state = start(target, target_params, draft, inputs, key, buf_len=max_decode_len + gamma + 2,
                cache_len=cache_length(max_decode_len, gamma), stats=SpecStats.zeros(b, gamma),
                partitioner=partitioner, gamma_row=gamma_row)
  state = jax.lax.while_loop(running, functools.partial(_chain_round, loop, target_params, draft),
                             state)
  return SpecOutput(*finish(state, max_decode_len), state.stats)
