"""The approximation-model (M_q) interface the speculative engine talks to.

An approximation model is a pytree (a ``flax.struct`` dataclass: arrays as
leaves, configuration as static fields) with three pure methods:

* ``init(inputs, cache_len) -> state``: once per example, given the encoder
  input tokens [B, S] (0 = pad). ``state`` is any pytree.
* ``propose(state, seq, length, gamma, sampling, key) -> (tokens, q, state)``:
  γ tokens [B, γ] and the distributions q [B, γ, V] they were drawn from —
  exactly those, since Algorithm 1 tests r·q(x) <= p(x) (one-hot for a
  deterministic proposal). Standardizing q as the target's p (§2.2) matters
  for α, not for exactness (§3.6). ``seq`` [B, T] holds the decoder inputs so far:
  seq[:, 0] is the start token and seq[:, i + 1] the i-th committed output
  token; ``length`` [B] is the number of committed output tokens, so the next
  token is predicted from decoder inputs seq[:, :length + 1]. Entries past
  length + 1 are stale and must be ignored.
* ``commit(state, seq, length) -> state``: after the target's verdict, the
  new committed length. Rolling back anything computed for rejected tokens is
  the model's business (the T5 draft needs nothing: its cache is indexed by
  position and a query only reads positions before it).

Optional methods, each with a default (so a model needs none of them), are
declared once, with their contracts, in ``Capabilities``; ``capabilities``
is the one place that asks a model which it has. The engine, α and the
runner read that record, and reach the optional methods only through the
functions here that fall back to the defaults (``init_draft``,
``commit_draft``, ``adaptive_proposal``, ``tree_proposal``, ``commit_tree``,
``check_tree``, ``proposal_steps``).

Nothing in the engine depends on which model it is, so a new approximation
model needs no engine change: implement the three required methods and
register it with ``specdec_jax.drafts.register`` (README, "Adding an
approximation model"). The runner calls ``check_interface`` once before
compiling anything.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.sampling import SamplingConfig
from specdec_jax.tree import TreeOutput, TreeShape

Array = jax.Array


class ApproximationModel(Protocol):
  """Structural type of an approximation model M_q (see module docstring)."""

  vocab_size: int

  def init(self, inputs: Array, cache_len: int) -> Any:
    ...

  def propose(self, state: Any, seq: Array, length: Array, gamma: int,
              sampling: SamplingConfig, key: Array) -> tuple[Array, Array, Any]:
    ...

  def commit(self, state: Any, seq: Array, length: Array) -> Any:
    ...


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """An approximation model's optional methods, one flag each (True: the model
  has it), with their contracts and the default the engine uses without.

  init_with_target: ``init_with_target(inputs, cache_len, target_encoded) ->
    state``, ``init`` given the target's encoder output [B, S, d_target],
    which the engine computes anyway; a draft that conditions on it (the
    encoder bridge, ``drafts.bridge``) need not encode twice. Default ``init``.
  target_states: ``wants_target_states`` (a bool attribute or property) is
    true: the engine calls ``commit_with_target(state, seq, length, hidden,
    positions) -> state`` in place of ``commit``, with the target's final
    decoder states hidden [B, γ+1, d_target] of the round's pass at decoder
    positions [B, γ+1] (-1: padding; for a tree, the root and the path).
    States at positions >= ``length`` are of rejected proposals; reading only
    positions < length keeps the draft off the target's verdict on anything
    not yet committed (exactness; docs/exactness.md, section 7)
    (``drafts.feature_bridge``). Default ``commit``.
  propose_adaptive: ``propose_adaptive(state, seq, length, gamma, sampling,
    key, limit, threshold, skip_below=None, cumulative=False, drawn=False) ->
    (tokens, q, count, steps, state)`` for adaptive draft lengths
    (``decoding.AdaptiveConfig``): like ``propose`` with γ = γ_max, but row b
    proposes only ``count[b]`` tokens: x_1 (if ``limit[b] >= 1``, and, when
    ``skip_below`` is a float, the top probability of q_1 is >
    ``skip_below``), then x_{i+1} while i < ``limit[b]`` and the confidence
    at x_i (``top_probability`` of q_i, or with ``drawn``
    ``drawn_probability``) is > ``threshold`` — with ``cumulative``, the
    product of the confidences of x_1..x_i (``stop_count`` is the rule; a
    draft may define its confidence otherwise, from its own computation, as
    prompt lookup does). ``limit`` [B] int32 in 0..γ (0: the row is done);
    ``threshold`` a Python float in [0, 1]. tokens [B, γ] and q [B, γ, V] as
    in ``propose``, entries past ``count`` arbitrary; ``count`` [B] int32;
    ``steps`` a scalar int32, the draft steps actually run. The point is
    early exit (``T5Draft`` stops computing once every row has stopped).
    Every decision may use only the draft's own computation for the current
    prefix — never the target — and never the token it governs, which keeps
    decoding exact (docs/exactness.md, section 5). ``skip_below``,
    ``cumulative`` and ``drawn`` are passed only when set. Default
    (``adaptive_proposal``): ``propose(γ)`` and the count derived from q,
    exact but saving no draft compute.
  propose_tree: ``propose_tree(state, seq, length, tree, sampling, key) ->
    (tokens, q, valid, steps, state)`` for token trees
    (``decoding.tree_speculative_decode``): a token for every node of the
    static ``tree.TreeShape`` (tokens [B, N]; node 0 is the root, the last
    committed token, filled in by the engine), q [B, N, V] with q[:, c] the
    distribution node c's token was drawn from (row 0 unused), valid [B, N]
    bool (nodes not proposed, decided before their token was drawn) and
    ``steps`` the draft calls it ran. Default (``tree_proposal``), spine
    trees only (``TreeShape.spine``): ``propose`` of depth D, and next-best
    siblings of each position's q (exact: each sibling's q is its one-hot).
  commit_tree: ``commit_tree(state, seq, length, start, path, num_accepted)
    -> state``, ``commit`` told which nodes were accepted
    (``tree.TreeOutput``) in the round that started at ``start``, for a
    draft that decoded the tree into its own cache. Default ``commit``.
  tree_unsupported: ``tree_unsupported(tree) -> str | None``, the reason the
    draft cannot fill ``tree`` (None: it can), asked before any work
    (``check_tree``). Default: every tree it can fill.
  proposal_steps: ``proposal_steps(gamma) -> int``, the draft calls a chain
    ``propose`` of γ tokens runs (a block draft, ``drafts.t5_block``: 1); the
    engine counts it in ``draft_calls`` and the cost model prices a round
    with it (``theory.RoundCost.draft_calls``). Default γ, one call a token.
  """

  init_with_target: bool = False
  target_states: bool = False
  propose_adaptive: bool = False
  propose_tree: bool = False
  commit_tree: bool = False
  tree_unsupported: bool = False
  proposal_steps: bool = False


def capabilities(draft: Any) -> Capabilities:
  """The one place that asks a model which optional methods it has."""
  has = lambda name: callable(getattr(draft, name, None))
  return Capabilities(
      init_with_target=has("init_with_target"),
      target_states=bool(getattr(draft, "wants_target_states", False)),
      propose_adaptive=has("propose_adaptive"), propose_tree=has("propose_tree"),
      commit_tree=has("commit_tree"), tree_unsupported=has("tree_unsupported"),
      proposal_steps=has("proposal_steps"))


def init_draft(draft: Any, inputs: Array, cache_len: int, target_encoded: Array) -> Any:
  """``draft.init_with_target`` if the draft has it, else ``draft.init``."""
  if capabilities(draft).init_with_target:
    return draft.init_with_target(inputs, cache_len, target_encoded)
  return draft.init(inputs, cache_len)


def proposal_steps(draft: Any, gamma: int) -> int:
  """Draft calls one ``propose`` of γ tokens costs: ``draft.proposal_steps(γ)``
  if the draft declares it (a block draft: 1), else γ (one call a token)."""
  if capabilities(draft).proposal_steps:
    return int(draft.proposal_steps(gamma))
  return gamma


def commit_draft(draft: Any, state: Any, seq: Array, length: Array,
                 target_states: tuple[Array, Array] | None = None) -> Any:
  """The round's commit: ``commit_with_target`` given the target's states
  (hidden [B, W, d], positions [B, W], -1: padding), which the engine passes
  to a draft whose capabilities include ``target_states``; else ``commit``."""
  if target_states is not None:
    return draft.commit_with_target(state, seq, length, *target_states)
  return draft.commit(state, seq, length)


def gather_positions(seq: Array, positions: Array) -> Array:
  """seq [B, T], positions [B, k] -> seq[b, positions[b]] with clipping."""
  return jax.numpy.take_along_axis(seq, jax.numpy.clip(positions, 0, seq.shape[1] - 1),
                                   axis=1)


def top_probability(q: Array, logits: Array | None, sampling: SamplingConfig) -> Array:
  """A draft's confidence in a position, q [..., V] -> [...]: max_x q(x).

  At temperature 0 q is one-hot and its maximum always 1, so with ``logits``
  the draft's own softmax is used instead (the probability its model gives
  the argmax it proposes; Hugging Face's assistant confidence at T = 0).
  """
  if sampling.greedy and logits is not None:
    return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
  return jnp.max(q, axis=-1)


def drawn_probability(q: Array, logits: Array | None, tokens: Array,
                      sampling: SamplingConfig) -> Array:
  """The probability the draft gave the token it drew, q [..., V], tokens
  [...] -> q(x) [...] (``AdaptiveConfig.confidence='drawn'``).

  At T > 0 this sees what max q cannot: a confident draft that drew one of
  its tail tokens is often rejected (the acceptance probability of x is
  min(1, p(x)/q(x)), §2.3). At temperature 0 the drawn token is the argmax, so
  this is ``top_probability``.
  """
  if sampling.greedy:
    return top_probability(q, logits, sampling)
  return jnp.take_along_axis(q, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def stop_count(confidence: Array, limit: Array, threshold: float,
               skip_below: float | None = None, cumulative: bool = False,
               first_top: Array | None = None) -> Array:
  """How many tokens a row proposes under the adaptive rule (``propose_adaptive``).

  confidence [B, γ]: each position's confidence (``top_probability`` of its
  q, or ``drawn_probability``); limit [B] in 0..γ. x_1 is proposed when
  limit >= 1 (and, with ``skip_below``, q_1's top probability ``first_top``
  [B], default confidence_1, is > skip_below); x_{i+1} when x_i was, i <
  limit and confidence_i > threshold (``cumulative``: confidence_1 · ... ·
  confidence_i > threshold). So threshold 0 never stops early (a
  distribution's maximum is >= 1/V > 0, a drawn token's probability > 0)
  and threshold 1 always stops after x_1.
  """
  going = keeps_going(confidence[:, :-1], threshold, cumulative)
  going = jnp.cumprod(going.astype(jnp.int32), axis=-1)
  count = jnp.minimum(limit, 1 + jnp.sum(going, axis=-1))
  return skip_unsure(count, confidence[:, 0] if first_top is None else first_top, skip_below)


def keeps_going(confidence: Array, threshold: float, cumulative: bool) -> Array:
  """Whether a row may propose the token after each position, from the
  confidences so far ([..., i] -> [..., i] bool, along the last axis): the
  position's own confidence > threshold ('threshold' rule), or the running
  product of them > threshold ('cumulative' rule, SpecDec++'s stopping test
  with the draft's confidence as the acceptance estimate)."""
  if cumulative:
    confidence = jnp.cumprod(confidence, axis=-1)
  return confidence > threshold


def skip_unsure(count: Array, first_confidence: Array, skip_below: float | None) -> Array:
  """``AdaptiveConfig.skip_below``: rows whose q_1 has confidence <= skip_below
  propose nothing this round (count 0); None leaves ``count`` as it is.

  The confidence must be a property of q_1 alone (its top probability), never
  of the drawn x_1: skipping by x_1's own probability would make x_1, given
  that it is proposed, no longer ~ q_1 (docs/exactness.md, section 5)."""
  if skip_below is not None:
    count = jnp.where(first_confidence > skip_below, count, 0)
  return count.astype(jnp.int32)


def adaptive_proposal(draft: Any, state: Any, seq: Array, length: Array, gamma: int,
                      sampling: SamplingConfig, key: Array, limit: Array, threshold: float,
                      skip_below: float | None = None, cumulative: bool = False,
                      drawn: bool = False) -> tuple[Array, Array, Array, Array, Any]:
  """``draft.propose_adaptive`` if the draft has it, else the generic fallback.

  The fallback runs ``propose(γ)`` (all γ steps: ``steps`` = γ) and derives
  each row's count from max q, or with ``drawn`` from q(x) of the drawn
  tokens (``stop_count``), exact but with no early exit; at temperature 0 a
  one-hot q has confidence 1, so such a draft then stops early only at
  threshold 1. Optional arguments reach ``propose_adaptive`` only when set,
  and one its signature lacks is an interface error.
  """
  if capabilities(draft).propose_adaptive:
    method = draft.propose_adaptive
    extra = {name: value for name, value, unset in
             (("skip_below", skip_below, None), ("cumulative", cumulative, False),
              ("drawn", drawn, False))
             if value is not unset}
    params = inspect.signature(method).parameters
    missing = [name for name in extra if name not in params]
    if missing:
      raise DraftInterfaceError(
          f"{type(draft).__qualname__}.propose_adaptive takes no {', '.join(missing)} "
          f"argument, so it cannot run with AdaptiveConfig's {', '.join(missing)} "
          "(see drafts/base.py)")
    return method(state, seq, length, gamma, sampling, key, limit, threshold, **extra)
  tokens, q, state = draft.propose(state, seq, length, gamma, sampling, key)
  top = top_probability(q, None, sampling)
  conf = drawn_probability(q, None, tokens, sampling) if drawn else top
  count = stop_count(conf, limit, threshold, skip_below, cumulative, first_top=top[:, 0])
  return tokens, q, count, jnp.asarray(gamma, jnp.int32), state


class DraftInterfaceError(ValueError):
  """An approximation model that does not keep the interface above."""


def next_best(scores: Array, exclude: Array, count: int) -> Array:
  """The ``count`` highest-scoring tokens other than ``exclude``, best first.

  scores [..., V] (logits or probabilities), exclude [..., m] int32 ->
  [..., count] int32 (ties: lowest index first, as ``lax.top_k``).
  """
  v = scores.shape[-1]
  hit = jnp.any(jnp.arange(v, dtype=jnp.int32) == exclude[..., None], axis=-2)
  _, idx = jax.lax.top_k(jnp.where(hit, -jnp.inf, scores.astype(jnp.float32)), count)
  return idx.astype(jnp.int32)


def fill_children(tree: TreeShape, parents: tuple[int, ...], first: Array, first_q: Array,
                  scores: Array, floor: float, tokens: Array, q: Array, valid: Array
                  ) -> tuple[Array, Array, Array]:
  """Writes the children of ``parents`` (static node indices, m of them).

  Child 0 of each parent carries ``first`` [B, m], drawn from ``first_q`` [B,
  m, V]; the later children carry the next-best tokens of ``scores`` [B, m,
  V] (the parent's logits, or its q) other than ``first``, each with its
  one-hot as q — a deterministic proposal, so exact under
  ``tree.tree_speculative_sampling`` — and are valid iff their score is >
  ``floor`` (-inf for logits, 0 for probabilities). tokens [B, N], q [B, N,
  V], valid [B, N] are updated and returned.
  """
  kids = tree.children_table[list(parents)]                           # [m, K] static
  v = q.shape[-1]
  for j, row in enumerate(kids):
    row = [int(c) for c in row if c >= 0]
    if not row:
      continue
    tokens = tokens.at[:, row[0]].set(first[:, j])
    q = q.at[:, row[0]].set(first_q[:, j].astype(q.dtype))
    if len(row) > 1:
      alt = next_best(scores[:, j], first[:, j:j + 1], len(row) - 1)   # [B, k-1]
      score = jnp.take_along_axis(scores[:, j].astype(jnp.float32), alt, axis=-1)
      tokens = tokens.at[:, row[1:]].set(alt)
      q = q.at[:, row[1:]].set(jax.nn.one_hot(alt, v, dtype=q.dtype))
      valid = valid.at[:, row[1:]].set(score > floor)
  return tokens, q, valid


def spine_proposal(tree: TreeShape, chain: Array, chain_q: Array,
                   logits: Array | None = None) -> tuple[Array, Array, Array]:
  """A spine tree (``TreeShape.spine``) from a chain proposal.

  The chain's x_d [B, D], drawn from q_d (``chain_q`` [B, D, V]), sits at the
  spine node of depth d; its siblings carry the next-best tokens of the
  draft's ``logits`` [B, D, V] at that position or, without them, of q_d,
  valid only where q_d gives them mass (at T = 0 a one-hot q has no
  alternatives, and the tree is then the chain). -> (tokens [B, N], q [B,
  N, V], valid [B, N]); node 0 (the root) is left to the engine.
  """
  if not tree.is_spine:
    raise ValueError(f"tree with parents {tree.parents} is not a spine tree (every node off "
                     "the first-child chain a leaf); a chain proposal cannot fill it")
  b, depth, v = chain_q.shape
  if depth != tree.max_depth:
    raise ValueError(f"a chain of {depth} proposals cannot fill a tree of depth {tree.max_depth}")
  tokens = jnp.zeros((b, tree.num_nodes), jnp.int32)
  q = jnp.zeros((b, tree.num_nodes, v), jnp.float32)
  valid = jnp.ones((b, tree.num_nodes), bool)
  scores, floor = (chain_q, 0.0) if logits is None else (logits, -jnp.inf)
  for d, parent in enumerate((0,) + tree.spine_nodes[:-1]):
    tokens, q, valid = fill_children(tree, (parent,), chain[:, d:d + 1], chain_q[:, d:d + 1],
                                     scores[:, d:d + 1], floor, tokens, q, valid)
  return tokens, q, valid


def tree_proposal(draft: Any, state: Any, seq: Array, length: Array, tree: TreeShape,
                  sampling: SamplingConfig, key: Array
                  ) -> tuple[Array, Array, Array, Array, Any]:
  """``draft.propose_tree`` if the draft has it, else ``spine_proposal`` of its
  ``propose`` of depth D (spine trees only; ``check_tree`` says so before
  any work). -> (tokens [B, N], q [B, N, V], valid [B, N], steps, state)."""
  if capabilities(draft).propose_tree:
    return draft.propose_tree(state, seq, length, tree, sampling, key)
  chain, chain_q, state = draft.propose(state, seq, length, tree.max_depth, sampling, key)
  tokens, q, valid = spine_proposal(tree, chain, chain_q)
  return tokens, q, valid, jnp.asarray(tree.max_depth, jnp.int32), state


def commit_tree(draft: Any, state: Any, seq: Array, length: Array, start: Array,
                out: TreeOutput) -> Any:
  """``draft.commit_tree`` if the draft has it, else ``draft.commit``."""
  if capabilities(draft).commit_tree:
    return draft.commit_tree(state, seq, length, start, out.path, out.num_accepted)
  return draft.commit(state, seq, length)


def check_tree(name: str, draft: Any, tree: TreeShape) -> None:
  """Raises ``DraftInterfaceError`` (before any work) when ``draft`` cannot
  propose ``tree``: a draft without ``propose_tree`` fills spine trees only,
  and a draft may refuse a tree (its ``tree_unsupported(tree)`` returning the
  reason as a string)."""
  where = f"approximation model {name!r} ({type(draft).__qualname__})"
  caps = capabilities(draft)
  why = draft.tree_unsupported(tree) if caps.tree_unsupported else None
  if why:
    raise DraftInterfaceError(f"{where} cannot propose the token tree {tree.parents}: {why}")
  if not caps.propose_tree and not tree.is_spine:
    raise DraftInterfaceError(
        f"{where} proposes chains only, so it can fill spine trees (a chain with sibling "
        f"leaves, e.g. 'spine:4,2,2,1') but not {tree.parents}")


def _commit(draft: Any, state: Any, seq: Array, length: Array, gamma: int,
            target_width: int) -> Any:
  """The round's commit as the engine makes it (``commit_draft``; zeros stand
  in for the target's states)."""
  if not capabilities(draft).target_states:
    return draft.commit(state, seq, length)
  b = length.shape[0]
  positions = length[:, None] - 1 + jnp.arange(gamma + 1, dtype=jnp.int32)[None]
  hidden = jnp.zeros((b, gamma + 1, target_width), jnp.float32)
  return commit_draft(draft, state, seq, length, (hidden, positions))


def check_interface(name: str, draft: Any, inputs: Array, vocab_size: int, gamma: int,
                    cache_len: int, sampling: SamplingConfig, concrete: bool = True,
                    target_width: int = 1) -> None:
  """Checks ``draft`` once, before the decoding loops are compiled.

  Traces init -> propose -> commit abstractly (no compilation) to check the
  shapes; with ``concrete``, also runs them once on ``inputs`` to check that
  q is a distribution that gives each proposed token positive probability.
  ``target_width``: the target's d_model (the states ``commit_with_target``
  receives). Errors name the draft, the method and the shapes.
  """
  where = f"approximation model {name!r} ({type(draft).__module__}.{type(draft).__qualname__})"
  for method in ("init", "propose", "commit"):
    if not callable(getattr(draft, method, None)):
      raise DraftInterfaceError(f"{where} has no method {method}(); see "
                                "specdec_jax/drafts/base.py for the interface")
  if getattr(draft, "vocab_size", None) != vocab_size:
    raise DraftInterfaceError(f"{where}.vocab_size is {getattr(draft, 'vocab_size', None)!r}; "
                              f"it must equal the target's vocab_size {vocab_size}")
  b = inputs.shape[0]
  seq = jnp.zeros((b, cache_len + 1), jnp.int32)
  length = jnp.zeros((b,), jnp.int32)

  def call(inputs, seq, length, key):
    state = draft.init(inputs, cache_len)
    tokens, q, state = draft.propose(state, seq, length, gamma, sampling, key)
    _commit(draft, state, seq, length + 1, gamma, target_width)
    return tokens, q

  key = jax.random.PRNGKey(0)
  try:
    tokens, q = jax.eval_shape(call, inputs, seq, length, key)
  except Exception as e:  # report which draft failed, whatever the cause
    raise DraftInterfaceError(
        f"{where}: init(inputs {tuple(inputs.shape)}, cache_len={cache_len}) -> "
        f"propose(state, seq {tuple(seq.shape)}, length {tuple(length.shape)}, gamma={gamma}, "
        f"sampling, key) -> commit failed when traced: {type(e).__name__}: {e}") from e
  want_tokens, want_q = (b, gamma), (b, gamma, vocab_size)
  if (tuple(tokens.shape) != want_tokens or not jnp.issubdtype(tokens.dtype, jnp.integer)
      or tuple(q.shape) != want_q or not jnp.issubdtype(q.dtype, jnp.floating)):
    raise DraftInterfaceError(
        f"{where}.propose returned tokens {tuple(tokens.shape)} {tokens.dtype} and q "
        f"{tuple(q.shape)} {q.dtype}; expected tokens [B, gamma] = {want_tokens} (integers) "
        f"and q [B, gamma, V] = {want_q} (floats; V = the target's vocab_size)")
  if capabilities(draft).propose_adaptive:
    _check_adaptive(where, draft, inputs, seq, length, key, gamma, cache_len, sampling,
                    want_tokens, want_q, target_width)
  if not concrete:
    return
  tokens, q = jax.jit(call)(inputs, seq, length, key)
  q = np.asarray(q, np.float64)
  sums = q.sum(-1)
  picked = np.take_along_axis(q, np.asarray(tokens)[..., None].clip(0, vocab_size - 1), -1)
  if not np.all(np.isfinite(q)) or q.min() < -1e-6 or np.abs(sums - 1).max() > 1e-3:
    raise DraftInterfaceError(
        f"{where}.propose returned a q {q.shape} that is not a distribution over its last "
        f"axis: sums in [{sums.min():.4g}, {sums.max():.4g}], min entry {q.min():.4g}; q must "
        "be the (standardized) probabilities the tokens were drawn from (one-hot for "
        "deterministic proposals)")
  if (picked <= 0).any():
    raise DraftInterfaceError(
        f"{where}.propose returned tokens that have probability 0 under its own q; q must be "
        "the distribution each token was drawn from (one-hot of the token if deterministic)")


def _check_adaptive(where: str, draft: Any, inputs: Array, seq: Array, length: Array,
                    key: Array, gamma: int, cache_len: int, sampling: SamplingConfig,
                    want_tokens: tuple, want_q: tuple, target_width: int = 1) -> None:
  """The optional ``propose_adaptive``'s shapes, traced abstractly: once with
  the required arguments, and once more with every optional one it declares
  (``skip_below``, ``cumulative``) set."""
  limit = jnp.full(length.shape, gamma, jnp.int32)
  declared = inspect.signature(draft.propose_adaptive).parameters
  optional = {k: v for k, v in (("skip_below", 0.3), ("cumulative", True)) if k in declared}
  for extra in ({}, optional) if optional else ({},):
    _check_adaptive_call(where, draft, inputs, seq, length, key, limit, gamma, cache_len,
                         sampling, want_tokens, want_q, extra, target_width)


def _check_adaptive_call(where: str, draft: Any, inputs: Array, seq: Array, length: Array,
                         key: Array, limit: Array, gamma: int, cache_len: int,
                         sampling: SamplingConfig, want_tokens: tuple, want_q: tuple,
                         extra: dict, target_width: int = 1) -> None:
  def call(inputs, seq, length, key, limit):
    state = draft.init(inputs, cache_len)
    tokens, q, count, steps, state = draft.propose_adaptive(state, seq, length, gamma,
                                                            sampling, key, limit, 0.5, **extra)
    _commit(draft, state, seq, length + 1, gamma, target_width)
    return tokens, q, count, steps

  extras = "".join(f", {k}={v}" for k, v in extra.items())
  try:
    tokens, q, count, steps = jax.eval_shape(call, inputs, seq, length, key, limit)
  except Exception as e:  # report which draft failed, whatever the cause
    raise DraftInterfaceError(
        f"{where}.propose_adaptive(state, seq {tuple(seq.shape)}, length "
        f"{tuple(length.shape)}, gamma={gamma}, sampling, key, limit {tuple(limit.shape)}, "
        f"threshold=0.5{extras}) failed when traced: {type(e).__name__}: {e}") from e
  got = [(tuple(x.shape), x.dtype) for x in (tokens, q, count, steps)]
  want = [want_tokens, want_q, want_tokens[:1], ()]
  kinds = [jnp.integer, jnp.floating, jnp.integer, jnp.integer]
  if any(g[0] != w or not jnp.issubdtype(g[1], k) for g, w, k in zip(got, want, kinds)):
    raise DraftInterfaceError(
        f"{where}.propose_adaptive{f' (with{extras[1:]})' if extras else ''} returned "
        "(tokens, q, count, steps) with shapes/dtypes "
        f"{[(g[0], str(g[1])) for g in got]}; expected tokens {want_tokens} int, q {want_q} "
        f"float, count {want_tokens[:1]} int and steps () int")
