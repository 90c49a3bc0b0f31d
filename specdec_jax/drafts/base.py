"""The approximation-model (M_q) interface: a pytree (``flax.struct``) with

* ``init(inputs [B, S], cache_len) -> state``, once per example;
* ``propose(state, seq, length, gamma, sampling, key) -> (tokens [B, γ], q
  [B, γ, V], state)``: q exactly what the tokens were drawn from (one-hot if
  deterministic); the next token follows seq[:, :length + 1] (seq [B, T]:
  start token, then the outputs; later entries stale);
* ``commit(state, seq, length) -> state`` after the verdict.

Optional methods: ``Capabilities``. New models: ``drafts.register`` (README)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.sampling import SamplingConfig
from specdec_jax.tree import DynamicTree, TreeOutput, TreeShape

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
  """An approximation model's optional methods (True: it has it), their
  contracts and the default used without.

  init_with_target: ``(inputs, cache_len, target_encoded [B, S, d]) -> state``.
    Default ``init``.
  target_states: ``wants_target_states`` is true: ``commit_with_target(state,
    seq, length, hidden [B, γ+1, d], positions [B, γ+1]) -> state`` replaces
    ``commit``; reading only positions < length keeps it exact
    (docs/exactness.md, section 7).
  propose_adaptive: ``(state, seq, length, gamma, sampling, key, limit,
    threshold, skip_below=None, cumulative=False, drawn=False) -> (tokens, q,
    count, steps, state)``: ``propose`` at γ_max with ``count[b]`` <= limit[b]
    tokens by ``stop_count``'s rule, decided from the draft's own computation,
    never the token decided (docs/exactness.md, section 5). Default
    ``adaptive_proposal``.
  propose_tree: ``(state, seq, length, tree, sampling, key) -> (tokens [B, N],
    q [B, N, V], valid [B, N], steps, state)``. Default: spine trees only.
  commit_tree: ``(state, seq, length, start, path, num_accepted) -> state``.
  propose_dynamic_tree: as ``propose_tree`` plus parents [B, N], for a
    ``DynamicTree`` (docs/exactness_trees.md). Default: its ``skeleton``.
  tree_unsupported: ``(tree) -> str | None``, why the draft cannot fill it.
  proposal_steps: ``(gamma) -> int``, draft calls per ``propose`` (default γ)."""

  init_with_target: bool = False
  target_states: bool = False
  propose_adaptive: bool = False
  propose_tree: bool = False
  propose_dynamic_tree: bool = False
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
      propose_dynamic_tree=has("propose_dynamic_tree"), commit_tree=has("commit_tree"),
      tree_unsupported=has("tree_unsupported"), proposal_steps=has("proposal_steps"))


def init_draft(draft: Any, inputs: Array, cache_len: int, target_encoded: Array) -> Any:
  """``draft.init_with_target`` if the draft has it, else ``draft.init``."""
  if capabilities(draft).init_with_target:
    return draft.init_with_target(inputs, cache_len, target_encoded)
  return draft.init(inputs, cache_len)


def proposal_steps(draft: Any, gamma: int) -> int:
  """Draft calls one ``propose`` of γ tokens costs (default γ)."""
  if capabilities(draft).proposal_steps:
    return int(draft.proposal_steps(gamma))
  return gamma


def commit_draft(draft: Any, state: Any, seq: Array, length: Array,
                 target_states: tuple[Array, Array] | None = None) -> Any:
  """``commit_with_target`` given the target's states (hidden, positions), else ``commit``."""
  if target_states is not None:
    return draft.commit_with_target(state, seq, length, *target_states)
  return draft.commit(state, seq, length)


def gather_positions(seq: Array, positions: Array) -> Array:
  """seq [B, T], positions [B, k] -> seq[b, positions[b]] with clipping."""
  return jax.numpy.take_along_axis(seq, jax.numpy.clip(positions, 0, seq.shape[1] - 1), axis=1)


def top_probability(q: Array, logits: Array | None, sampling: SamplingConfig) -> Array:
  """A draft's confidence max_x q(x) [...]; at T = 0 its softmax of ``logits`` if given."""
  if sampling.greedy and logits is not None:
    return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
  return jnp.max(q, axis=-1)


def drawn_probability(q: Array, logits: Array | None, tokens: Array,
                      sampling: SamplingConfig) -> Array:
  """q(x) of the drawn tokens (``confidence='drawn'``); at T = 0 ``top_probability``."""
  if sampling.greedy:
    return top_probability(q, logits, sampling)
  return jnp.take_along_axis(q, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def stop_count(confidence: Array, limit: Array, threshold: float, skip_below: float | None = None,
               cumulative: bool = False, first_top: Array | None = None) -> Array:
  """How many tokens each row proposes under the adaptive rule.

  confidence [B, γ], limit [B] in 0..γ. x_1 is proposed when limit >= 1 (and
  ``first_top`` [B] > skip_below when set); x_{i+1} when x_i was, i < limit and
  confidence_i (``cumulative``: the product up to i) > threshold. Threshold 0
  never stops early, threshold 1 always after x_1."""
  conf = confidence[:, :-1]
  if cumulative:  # SpecDec++'s running product
    conf = jnp.cumprod(conf, axis=-1)
  going = jnp.cumprod((conf > threshold).astype(jnp.int32), axis=-1)
  count = jnp.minimum(limit, 1 + jnp.sum(going, axis=-1))
  return skip_unsure(count, confidence[:, 0] if first_top is None else first_top, skip_below)


def skip_unsure(count: Array, first_confidence: Array, skip_below: float | None) -> Array:
  """Rows whose q_1 top probability is <= skip_below propose nothing (count 0).

  A property of q_1 alone, never of the drawn x_1, or x_1 would no longer be
  ~ q_1 (docs/exactness.md, section 5)."""
  if skip_below is not None:
    count = jnp.where(first_confidence > skip_below, count, 0)
  return count.astype(jnp.int32)


def adaptive_proposal(draft: Any, state: Any, seq: Array, length: Array, gamma: int,
                      sampling: SamplingConfig, key: Array, limit: Array, threshold: float,
                      skip_below: float | None = None, cumulative: bool = False,
                      drawn: bool = False) -> tuple[Array, Array, Array, Array, Any]:
  """``draft.propose_adaptive`` if the draft has it, else ``propose(γ)`` with
  counts from ``stop_count`` (exact, no early exit). Optional arguments are
  passed only when set; one the method lacks is an interface error."""
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
  """The ``count`` best of scores [..., V] other than exclude [..., m] -> [..., count]."""
  v = scores.shape[-1]
  hit = jnp.any(jnp.arange(v, dtype=jnp.int32) == exclude[..., None], axis=-2)
  _, idx = jax.lax.top_k(jnp.where(hit, -jnp.inf, scores.astype(jnp.float32)), count)
  return idx.astype(jnp.int32)


def fill_children(tree: TreeShape, parents: tuple[int, ...], first: Array, first_q: Array,
                  scores: Array, floor: float, tokens: Array, q: Array, valid: Array
                  ) -> tuple[Array, Array, Array]:
  """Writes the children of ``parents`` (m static node indices).

  Child 0 carries ``first`` [B, m] drawn from first_q [B, m, V]; later children
  the next-best tokens of scores [B, m, V] with one-hot q (deterministic, so
  exact), valid iff their score > ``floor``. Updates tokens/q/valid [B, N(, V)]."""
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
  """A spine tree (``TreeShape.spine``) from a chain proposal chain [B, D],
  chain_q [B, D, V]: siblings carry next-best tokens of ``logits`` (or q_d, valid
  only where q_d has mass). -> (tokens, q, valid), node 0 left to the engine."""
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
                  sampling: SamplingConfig, key: Array) -> tuple[Array, Array, Array, Array, Any]:
  """``draft.propose_tree``, else ``spine_proposal`` of ``propose`` of depth D."""
  if capabilities(draft).propose_tree:
    return draft.propose_tree(state, seq, length, tree, sampling, key)
  chain, chain_q, state = draft.propose(state, seq, length, tree.max_depth, sampling, key)
  tokens, q, valid = spine_proposal(tree, chain, chain_q)
  return tokens, q, valid, jnp.asarray(tree.max_depth, jnp.int32), state


class Level(NamedTuple):
  """A dynamic tree under construction (``expand_level``), [B, N] each
  (q [B, N, V]); value is the path's cumulative draft probability, rank the
  place among siblings."""

  tokens: Array
  q: Array
  valid: Array
  parents: Array
  value: Array
  rank: Array

  @classmethod
  def empty(cls, batch: int, num_nodes: int, vocab: int) -> "Level":
    z = jnp.zeros((batch, num_nodes), jnp.int32)
    return cls(z, jnp.zeros((batch, num_nodes, vocab), jnp.float32),
               jnp.ones((batch, num_nodes), bool), z, jnp.ones((batch, num_nodes), jnp.float32), z)


def first_child_score(probs: Array, first: Array) -> Array:
  """A first child's rank score: the top of probs at its parent, never the drawn
  token's probability (not exact, docs/exactness_trees.md)."""
  del first
  return jnp.max(probs, axis=-1)


def expand_level(tree: DynamicTree, depth: int, level: Level, probs: Array, first: Array,
                 first_q: Array, first_score: Array, first_value: Array) -> Level:
  """Fills depth ``depth``'s W_d nodes (EAGLE-2's reranking under a fixed budget).

  probs [B, m, V] ranks the frontier's candidates: the first child ``first``
  [B, m] (from first_q) and the W_d - 1 next-best tokens (one-hot q), scored by
  value(parent) times first_score (known before the draw) or their probability.
  The top W_d are kept by parent then rank; score 0 marks a node invalid."""
  b, m, _ = probs.shape
  (f0, _), (c0, c1) = tree.level(depth - 1), tree.level(depth)
  w = c1 - c0
  rows = jnp.arange(b)[:, None]
  par_value = jnp.where(level.valid[:, f0:f0 + m], level.value[:, f0:f0 + m], 0.0)  # [B, m]
  tok, score, val = first[..., None], first_score[..., None], first_value[..., None]
  if w > 1:
    alt = next_best(probs, first[..., None], w - 1)                           # [B, m, w-1]
    alt_p = jnp.take_along_axis(probs.astype(jnp.float32), alt, axis=-1)
    tok = jnp.concatenate([tok, alt], -1)
    score, val = jnp.concatenate([score, alt_p], -1), jnp.concatenate([val, alt_p], -1)
  score = (par_value[..., None] * score).reshape(b, m * w)
  _, sel = jax.lax.top_k(score, w)
  sel = jnp.sort(sel, axis=-1)                                                 # [B, w]
  a, rank = sel // w, (sel % w).astype(jnp.int32)
  token = tok.reshape(b, m * w)[rows, sel]
  qa = jnp.where((rank == 0)[..., None], first_q[rows, a].astype(jnp.float32),
                 jax.nn.one_hot(token, probs.shape[-1], dtype=jnp.float32))
  return Level(level.tokens.at[:, c0:c1].set(token), level.q.at[:, c0:c1].set(qa),
               level.valid.at[:, c0:c1].set(score[rows, sel] > 0),
               level.parents.at[:, c0:c1].set((f0 + a).astype(jnp.int32)),
               level.value.at[:, c0:c1].set(par_value[rows, a] * val.reshape(b, m * w)[rows, sel]),
               level.rank.at[:, c0:c1].set(rank))


def dynamic_tree_proposal(draft: Any, state: Any, seq: Array, length: Array, tree: DynamicTree,
                          sampling: SamplingConfig, key: Array
                          ) -> tuple[Array, Array, Array, Array, Array, Any]:
  """``draft.propose_dynamic_tree``, else ``tree_proposal`` of the skeleton."""
  if capabilities(draft).propose_dynamic_tree:
    return draft.propose_dynamic_tree(state, seq, length, tree, sampling, key)
  tokens, q, valid, steps, state = tree_proposal(draft, state, seq, length, tree.skeleton,
                                                 sampling, key)
  parents = jnp.broadcast_to(jnp.asarray(tree.skeleton.parents, jnp.int32), tokens.shape)
  return tokens, q, valid, parents, steps, state


def commit_tree(draft: Any, state: Any, seq: Array, length: Array, start: Array,
                out: TreeOutput) -> Any:
  """``draft.commit_tree`` if the draft has it, else ``draft.commit``."""
  if capabilities(draft).commit_tree:
    return draft.commit_tree(state, seq, length, start, out.path, out.num_accepted)
  return draft.commit(state, seq, length)


def check_tree(name: str, draft: Any, tree: TreeShape | DynamicTree) -> None:
  """Raises ``DraftInterfaceError`` when ``draft`` cannot propose ``tree``."""
  where = f"approximation model {name!r} ({type(draft).__qualname__})"
  caps = capabilities(draft)
  dynamic = isinstance(tree, DynamicTree) and caps.propose_dynamic_tree
  if isinstance(tree, DynamicTree):
    tree = tree.skeleton  # the layout; a draft without per-round trees fills it as it is
  why = draft.tree_unsupported(tree) if caps.tree_unsupported else None
  if why:
    raise DraftInterfaceError(f"{where} cannot propose the token tree {tree.parents}: {why}")
  if not caps.propose_tree and not dynamic and not tree.is_spine:
    raise DraftInterfaceError(
        f"{where} proposes chains only, so it can fill spine trees (a chain with sibling "
        f"leaves, e.g. 'spine:4,2,2,1') but not {tree.parents}")


def _commit(draft: Any, state: Any, seq: Array, length: Array, gamma: int,
            target_width: int) -> Any:
  """The engine's commit, zeros standing in for the target's states."""
  if not capabilities(draft).target_states:
    return draft.commit(state, seq, length)
  b = length.shape[0]
  positions = length[:, None] - 1 + jnp.arange(gamma + 1, dtype=jnp.int32)[None]
  hidden = jnp.zeros((b, gamma + 1, target_width), jnp.float32)
  return commit_draft(draft, state, seq, length, (hidden, positions))


def check_interface(name: str, draft: Any, inputs: Array, vocab_size: int, gamma: int,
                    cache_len: int, sampling: SamplingConfig, concrete: bool = True,
                    target_width: int = 1) -> None:
  """Checks ``draft`` once, before the loops are compiled: traces init ->
  propose -> commit for shapes and, with ``concrete``, runs it to check that q
  is a distribution giving each token positive mass. ``target_width``: the
  target's d_model."""
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
  """``propose_adaptive``'s shapes, traced without and with its optional arguments."""
  limit = jnp.full(length.shape, gamma, jnp.int32)
  declared = inspect.signature(draft.propose_adaptive).parameters
  optional = {k: v for k, v in (("skip_below", 0.3), ("cumulative", True)) if k in declared}
  for extra in ({}, optional) if optional else ({},):
    def call(inputs, seq, length, key, limit):
      state = draft.init(inputs, cache_len)
      tokens, q, count, steps, state = draft.propose_adaptive(
          state, seq, length, gamma, sampling, key, limit, 0.5, **extra)
      _commit(draft, state, seq, length + 1, gamma, target_width)
      return tokens, q, count, steps

    extras = "".join(f", {k}={v}" for k, v in extra.items())
    try:
      got = jax.eval_shape(call, inputs, seq, length, key, limit)
    except Exception as e:  # report which draft failed, whatever the cause
      raise DraftInterfaceError(
          f"{where}.propose_adaptive(state, seq {tuple(seq.shape)}, length "
          f"{tuple(length.shape)}, gamma={gamma}, sampling, key, limit {tuple(limit.shape)}, "
          f"threshold=0.5{extras}) failed when traced: {type(e).__name__}: {e}") from e
    got = [(tuple(x.shape), x.dtype) for x in got]
    want = [want_tokens, want_q, want_tokens[:1], ()]
    kinds = [jnp.integer, jnp.floating, jnp.integer, jnp.integer]
    if any(g[0] != w or not jnp.issubdtype(g[1], k) for g, w, k in zip(got, want, kinds)):
      raise DraftInterfaceError(
          f"{where}.propose_adaptive{f' (with{extras[1:]})' if extras else ''} returned "
          "(tokens, q, count, steps) with shapes/dtypes "
          f"{[(g[0], str(g[1])) for g in got]}; expected tokens {want_tokens} int, q {want_q} "
          f"float, count {want_tokens[:1]} int and steps () int")
