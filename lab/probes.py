"""Which confidence predicts a draft's acceptance (paper Definition 3.1: β,
the chance that the target accepts x_i; §3.5, where a per-round γ would
stop on it).

``confidence_auc`` scores the confidences an adaptive rule can read after
x_i against the engine's verdicts; ``engine_records`` records, in the
engine's own fixed-γ rounds, everything the draft knows after x_i and the
verdict, and ``head_auc`` fits acceptance predictors on those records
(``fit_logistic``) and scores them (``auc``). ``along_outputs`` lays the
records along each output for ``stopping.simulate_stopping``. No timing."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from flax import struct

from specdec_jax.decoding import speculative_decode
from specdec_jax.drafts.base import (ApproximationModel, capabilities, drawn_probability,
                                     init_draft, top_probability)
from specdec_jax.models.t5 import T5Model
from specdec_jax.run import held_out_inputs
from specdec_jax.sampling import SamplingConfig
from specdec_jax.scripting.script_args import comma_list, markdown_header

from lab.common import prepare_pair

Array = jax.Array


def auc(score: np.ndarray, label: np.ndarray) -> float:
  """Area under the ROC curve of ``score`` for the boolean ``label``: the
  chance that a random positive scores above a random negative (ties count
  half; Mann-Whitney with mid-ranks). NaN if either class is empty."""
  score, label = np.asarray(score, float).ravel(), np.asarray(label, bool).ravel()
  pos, neg = int(label.sum()), int((~label).sum())
  if not pos or not neg:
    return float("nan")
  values, counts = np.unique(score, return_counts=True)
  mid = np.cumsum(counts) - (counts - 1) / 2  # 1-based mean rank of each distinct value
  ranks = mid[np.searchsorted(values, score)]
  return float((ranks[label].sum() - pos * (pos + 1) / 2) / (pos * neg))


class _ProposalSink:
  """Host-side store of each round's (length, top, drawn) for one example."""

  def __init__(self):
    self.rounds: list[tuple[int, np.ndarray, np.ndarray]] = []

  def put(self, length, top, drawn) -> None:
    self.rounds.append((int(length[0]), np.asarray(top[0]), np.asarray(drawn[0])))


class _Forwarding:
  """A draft wrapper's methods other than ``propose``: all go to ``self.inner``
  (its state is the inner draft's)."""

  @property
  def vocab_size(self) -> int:
    return self.inner.vocab_size

  def init(self, inputs: Array, cache_len: int) -> Any:
    return self.inner.init(inputs, cache_len)

  def init_with_target(self, inputs: Array, cache_len: int, target_encoded: Array) -> Any:
    return init_draft(self.inner, inputs, cache_len, target_encoded)

  def commit(self, state, seq, length):
    return self.inner.commit(state, seq, length)

  @property
  def wants_target_states(self) -> bool:
    return capabilities(self.inner).target_states

  def commit_with_target(self, state, seq, length, hidden, positions):
    return self.inner.commit_with_target(state, seq, length, hidden, positions)


@struct.dataclass
class _RecordConfidence(_Forwarding):
  """``inner`` unchanged in fixed-γ rounds; each round's max_x q_i(x) and
  q_i(x_i) (row 0) go to ``sink``."""

  inner: Any
  sink: _ProposalSink = struct.field(pytree_node=False)

  def propose(self, state, seq, length, gamma, sampling, key):
    tokens, q, state = self.inner.propose(state, seq, length, gamma, sampling, key)
    jax.debug.callback(self.sink.put, length, top_probability(q, None, sampling),
                       drawn_probability(q, None, tokens, sampling))
    return tokens, q, state


class ConfidenceAUC(NamedTuple):
  rounds: int                 # rounds used (each output's last one left out)
  acceptance: list[float]     # P(x_i accepted | x_i evaluated), i = 1..γ
  auc: dict[str, float]       # 'top' / 'drawn' -> AUC for x_i's acceptance


def confidence_auc(target: T5Model, params: Any, draft: ApproximationModel, inputs: Array,
                   key: Array, gamma: int, sampling: SamplingConfig, max_decode_len: int,
                   eos_id: int = 1) -> ConfidenceAUC:
  """How well each confidence an adaptive rule can read after x_i
  (``AdaptiveConfig.confidence``: 'top' = max_x q_i(x), 'drawn' = q_i(x_i))
  predicts whether the target accepts x_i, in the engine's own fixed-γ
  rounds at T > 0 (batch 1, one row of ``inputs`` at a time).

  A round's accepted count n comes from the next round's start: the round
  commits n + 1 tokens. Each output's last round is left out (its count is
  cut at EOS or max_decode_len). Position i (1-based) was evaluated when
  i <= n + 1 and accepted when i <= n. No timing: load does not matter.
  """
  if sampling.greedy:
    raise ValueError("confidence_auc compares confidences at T > 0; at T = 0 q is one-hot "
                     "and 'top' and 'drawn' are the same")
  sink = _ProposalSink()
  wrapped = _RecordConfidence(draft, sink)
  top, drawn, n = [], [], []
  for i in range(inputs.shape[0]):
    sink.rounds.clear()
    jax.block_until_ready(speculative_decode(
        target, params, wrapped, inputs[i:i + 1], jax.random.fold_in(key, i), gamma=gamma,
        max_decode_len=max_decode_len, sampling=sampling, eos_id=eos_id).tokens)
    for (start, t, d), (nxt, _, _) in zip(sink.rounds, sink.rounds[1:]):
      top.append(t)
      drawn.append(d)
      n.append(nxt - start - 1)
  if not n:
    raise ValueError("no output took two rounds: nothing to measure")
  top, drawn, n = np.stack(top), np.stack(drawn), np.asarray(n)
  i = np.arange(gamma)[None]
  evaluated, accepted = i <= n[:, None], i < n[:, None]
  return ConfidenceAUC(
      rounds=len(n),
      acceptance=[float(accepted[evaluated[:, j], j].mean()) for j in range(gamma)],
      auc={"top": auc(top[evaluated], accepted[evaluated]),
           "drawn": auc(drawn[evaluated], accepted[evaluated])})


class EngineRecords(NamedTuple):
  """The draft's view of every evaluated proposal in the engine's own
  fixed-γ rounds (``engine_records``): row r is x_i of one round, i =
  ``index[r]`` + 1, evaluated by the target (i <= accepted count + 1)."""
  example: np.ndarray     # [N] int: the row of ``inputs``
  round: np.ndarray       # [N] int: the round within the example
  index: np.ndarray       # [N] int: i - 1
  hidden: np.ndarray      # [N, d]: the draft's final hidden state that q_i comes from
  top: np.ndarray         # [N]: max of the draft's own softmax (its T = 0 confidence)
  second: np.ndarray      # [N]: the second largest probability of that softmax
  entropy: np.ndarray     # [N]: its entropy (nats)
  accepted: np.ndarray    # [N] bool
  gamma: int


class _StepSink:
  """Host-side store for ``engine_records``: round starts and draft steps, in order."""

  def __init__(self):
    self.events: list[tuple] = []

  def round(self, length) -> None:
    self.events.append(("round", int(length[0])))

  def step(self, hidden, logits) -> None:
    logits = np.asarray(logits[0], np.float64)
    z = np.exp(np.where(np.isfinite(logits), logits - logits.max(), -np.inf))
    prob = np.sort(z / z.sum())[::-1]
    nz = prob[prob > 0]
    self.events.append(("step", np.asarray(hidden[0], np.float32), prob[0], prob[1],
                        float(-(nz * np.log(nz)).sum())))


@struct.dataclass
class _MarkRounds(_Forwarding):
  """``inner`` (a ``T5Draft`` with ``observe`` set) unchanged; each fixed-γ
  round's start length (row 0) goes to ``sink`` before its draft steps."""

  inner: Any
  sink: _StepSink = struct.field(pytree_node=False)

  def propose(self, state, seq, length, gamma, sampling, key):
    jax.debug.callback(self.sink.round, length, ordered=True)
    return self.inner.propose(state, seq, length, gamma, sampling, key)


def engine_records(target: T5Model, params: Any, draft: Any, inputs: Array, key: Array,
                   gamma: int, sampling: SamplingConfig, max_decode_len: int,
                   eos_id: int = 1) -> EngineRecords:
  """What a stopping rule could read, and the verdicts, in the engine's own
  rounds: ``speculative_decode`` at fixed γ on each row of ``inputs`` (batch
  1) with a ``T5Draft`` that reports every draft step (``observe``), so a
  bridged or shortlisted draft is seen exactly as the engine runs it (its
  feature bridge at the staleness a γ-round gives). A round's accepted count
  n comes from the next round's start (it commits n + 1 tokens); each
  example's last round is left out (cut at EOS or max_decode_len). No timing.
  """
  if not hasattr(draft, "observe"):
    raise ValueError(f"engine_records needs a T5Draft (it reports its steps), got "
                     f"{type(draft).__name__}")
  sink = _StepSink()
  wrapped = _MarkRounds(draft.replace(observe=sink.step), sink)
  # speculative_decode is jitted: the parameters stay arguments (a closure
  # would bake them into the program as constants).
  run = lambda x, k: speculative_decode(target, params, wrapped, x, k, gamma=gamma,
                                        max_decode_len=max_decode_len, sampling=sampling,
                                        eos_id=eos_id).length
  cols: dict[str, list] = {f: [] for f in EngineRecords._fields if f != "gamma"}
  for e in range(inputs.shape[0]):
    sink.events.clear()
    jax.block_until_ready(run(inputs[e:e + 1], jax.random.fold_in(key, e)))
    rounds: list[tuple[int, list]] = []
    for ev in sink.events:
      if ev[0] == "round":
        rounds.append((ev[1], []))
      else:
        rounds[-1][1].append(ev[1:])
    for r, ((start, steps), (nxt, _)) in enumerate(zip(rounds, rounds[1:])):
      if len(steps) != gamma:
        raise AssertionError(f"example {e}, round {r}: {len(steps)} draft steps, not γ {gamma}")
      n = nxt - start - 1
      for i, (h, top, second, ent) in enumerate(steps[:n + 1]):
        for f, v in zip(cols, (e, r, i, h, top, second, ent, i < n)):
          cols[f].append(v)
  if not cols["example"]:
    raise ValueError("no output took two rounds: nothing to record")
  return EngineRecords(**{f: np.stack(v) if f == "hidden" else np.asarray(v)
                          for f, v in cols.items()}, gamma=gamma)


def along_outputs(rec: EngineRecords
                  ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
  """At T = 0: per example, the draft's confidence (``top``) and its verdict
  at each output position in order, for ``stopping.simulate_stopping``
  (every position is evaluated in exactly one round, as x_i with the
  committed prefix), and whether a draft step saw the position: a bonus
  position (after a round of γ acceptances) had no proposal; it gets
  confidence 1 and accepted."""
  conf, ok, seen = [], [], []
  for e in np.unique(rec.example):
    c, o, m = [], [], []
    mine = np.flatnonzero(rec.example == e)
    for r in np.unique(rec.round[mine]):
      rows = mine[rec.round[mine] == r]
      rows = rows[np.argsort(rec.index[rows])]
      c.extend(rec.top[rows])
      o.extend(rec.accepted[rows])
      m.extend([True] * len(rows))
      if len(rows) == rec.gamma and rec.accepted[rows].all():
        c.append(1.0)
        o.append(True)
        m.append(False)
    conf.append(np.asarray(c, float))
    ok.append(np.asarray(o, bool))
    seen.append(np.asarray(m, bool))
  return conf, ok, seen


def _head_features(rec: EngineRecords, hidden: bool) -> np.ndarray:
  eps = 1e-9
  cols = [rec.top, np.log(rec.top + eps), rec.top - rec.second, rec.entropy,
          np.log(rec.second + eps)]
  parts = [np.stack(cols, 1), np.eye(rec.gamma)[rec.index]]
  return np.concatenate(parts + ([rec.hidden] if hidden else []), 1).astype(np.float64)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3,
                 iterations: int = 50) -> Callable[[np.ndarray], np.ndarray]:
  """L2-regularized logistic regression by Newton's method on standardized
  features; returns x -> P(y = 1 | x)."""
  mu, sd = x.mean(0), x.std(0) + 1e-6
  z = np.concatenate([(x - mu) / sd, np.ones((len(x), 1))], 1)
  w = np.zeros(z.shape[1])
  reg = np.full(z.shape[1], l2 * len(x))
  reg[-1] = 0.0  # no penalty on the bias
  for _ in range(iterations):
    pr = 1.0 / (1.0 + np.exp(-z @ w))
    grad = z.T @ (pr - y) + reg * w
    hess = (z * (pr * (1 - pr))[:, None]).T @ z + np.diag(reg)
    step = np.linalg.solve(hess, grad)
    w -= step
    if np.abs(step).max() < 1e-8:
      break
  return lambda q: 1.0 / (1.0 + np.exp(-np.concatenate(
      [(q - mu) / sd, np.ones((len(q), 1))], 1) @ w))


def head_auc(train: EngineRecords, test: EngineRecords, l2: float = 1e-3) -> dict[str, float]:
  """How well an acceptance predictor trained on ``train``'s rounds predicts
  x_i's acceptance in ``test``'s (AUC on test): 'top' (the draft's top
  probability alone, untrained), 'scalars' (a logistic regression on the
  softmax's top, second, margin, entropy and i) and 'hidden' (the same plus
  the draft's hidden state: SpecDec++'s acceptance head, Huang et al. 2024,
  as a linear probe)."""
  out = {"top": auc(test.top, test.accepted)}
  for name, hidden in (("scalars", False), ("hidden", True)):
    predict = fit_logistic(_head_features(train, hidden), train.accepted.astype(float), l2)
    out[name] = auc(predict(_head_features(test, hidden)), test.accepted)
  return out


def confidence_report(args: Any) -> None:
  """``scripts/confidence_auc.py``: ``confidence_auc`` at each T of
  --temperatures and γ of --gammas, as a table."""
  _, setup = prepare_pair(args)
  print(markdown_header(["T", "γ", "rounds", "acceptance of x_i given evaluated, i = 1..γ",
                         "AUC max q_i ('top')", "AUC q_i(x_i) ('drawn')"]))
  for temp in comma_list(args.temperatures, float):
    for gamma in comma_list(args.gammas, int):
      r = confidence_auc(setup.target, setup.target_params, setup.draft,
                         jax.numpy.asarray(setup.inputs), jax.random.PRNGKey(0), gamma,
                         SamplingConfig(temperature=temp), args.max_decode_len)
      print(f"| {temp:g} | {gamma} | {r.rounds} | "
            f"{' / '.join(f'{a:.3f}' for a in r.acceptance)} | {r.auc['top']:.3f} | "
            f"{r.auc['drawn']:.3f} |", flush=True)


def head_report(args: Any) -> None:
  """``scripts/acceptance_head.py``: acceptance heads fitted on
  --head_source's rounds, scored on --source's (``head_auc``), per T of
  --temperatures at γ = max of --gammas, as a table."""
  exp, setup = prepare_pair(args)
  gamma = max(comma_list(args.gammas, int))
  train_inputs = held_out_inputs(exp, args.head_source, args.num_examples)
  print(f"Acceptance of x_i predicted from what the draft knows after x_i, in the engine's "
        f"own γ={gamma} rounds: fitted on {args.num_examples} inputs of {args.head_source}, "
        f"AUC on {len(setup.inputs)} of {args.source} (probes.head_auc)\n\n"
        + markdown_header(["T", "positions fitted / scored", "acceptance", "AUC top probability",
                           "AUC logistic on softmax statistics + i",
                           "AUC the same + hidden state"]))
  for temp in comma_list(args.temperatures, float):
    kw = dict(key=jax.random.PRNGKey(0), gamma=gamma, sampling=SamplingConfig(temperature=temp),
              max_decode_len=args.max_decode_len)
    train = engine_records(setup.target, setup.target_params, setup.draft,
                           jax.numpy.asarray(train_inputs), **kw)
    test = engine_records(setup.target, setup.target_params, setup.draft,
                          jax.numpy.asarray(setup.inputs), **kw)
    a = head_auc(train, test)
    print(f"| {temp:g} | {len(train.top)} / {len(test.top)} | {test.accepted.mean():.3f} | "
          f"{a['top']:.3f} | {a['scalars']:.3f} | {a['hidden']:.3f} |", flush=True)
