"""The TPU dry run (``specdec_jax.dryrun``, the runner's programs) on libtpu's compile-only
v5e:2x4 devices, on this CPU-only machine: a tiny target/draft pair on meshes
(1, 8) and (2, 4), at a fixed γ and adaptive. Compiled programs are shared
through module-scoped fixtures (and the dry run's own cache of compiles).

Tolerance: ``memory.plan``'s estimate (weights and caches) must be within
25% of the compiled program's total: the plan leaves out XLA's temporaries
(activations, layout copies of weights, collective and scratch buffers);
the weights themselves must match exactly.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("libtpu", reason="the dry run compiles with libtpu (requirements-test.txt)")

from specdec_jax import memory, paper, partitioning, theory  # noqa: E402
from specdec_jax.decoding import AdaptiveConfig  # noqa: E402
from specdec_jax.models.t5 import T5Config  # noqa: E402
from specdec_jax.dryrun import calibration, chips, costs, driver, hlo  # noqa: E402
from specdec_jax.run import dry_run_programs  # noqa: E402
from specdec_jax.run.settings import Experiment  # noqa: E402
from specdec_jax.measured import DEMO_RANK_PROFILE  # noqa: E402
from specdec_jax.tree import TreeShape, scaled_rank_rates  # noqa: E402

TOPOLOGY = "v5e:2x4"
# Small, but with weights (MiBs per device) well above XLA's fixed scratch.
TARGET = T5Config(vocab_size=8192, d_model=512, num_heads=8, head_dim=64, num_encoder_layers=1,
                  num_decoder_layers=2, d_ff=1024, dtype="bfloat16")
DRAFT = TARGET.replace(d_model=256, num_heads=4, d_ff=512, num_decoder_layers=1)
ADAPTIVE = AdaptiveConfig("threshold", threshold=0.5)
TOLERANCE = 0.25
GAMMA = 2


def _checkpoint(root, name: str, cfg: T5Config) -> str:
  """A checkpoint directory with a config.json and no weights (none are read)."""
  path = root / name
  (path / "params").mkdir(parents=True)
  (path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
  return str(path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
  root = tmp_path_factory.mktemp("dry_run")
  return {"target": _checkpoint(root, "target", TARGET),
          "draft": _checkpoint(root, "draft", DRAFT),
          "heads6": _checkpoint(root, "heads6", TARGET.replace(num_heads=6)),
          # float32 weights: a 1M x 4096 embedding and output layer alone are 31 GiB.
          "huge": _checkpoint(root, "huge", TARGET.replace(vocab_size=1 << 20, d_model=4096,
                                                           num_decoder_layers=1))}


def experiment(paths, mesh=(1, 8), adaptive=None, **kw) -> Experiment:
  fields = dict(target_checkpoint=paths["target"], draft_checkpoint=paths["draft"],
                vocab_path="not/read/spm.model", source="not/read/test.tsv",
                task="wmt_ende", draft_label="T5-small", mesh_shape=mesh,
                param_dtype="bfloat16", dtype="bfloat16", batch_size=2, max_input_len=32,
                max_decode_len=8, gamma=GAMMA, adaptive=adaptive)
  fields.update(kw)
  return Experiment(**fields)


CASES = [((1, 8), None), ((2, 4), None), ((1, 8), ADAPTIVE), ((2, 4), ADAPTIVE)]
IDS = ["1x8-fixed", "2x4-fixed", "1x8-adaptive", "2x4-adaptive"]


@pytest.fixture(scope="module")
def runs(paths):
  """One dry run per case; the (1, 8) fixed-γ one also compiles the baseline
  and the roofline pieces."""
  def run(case):
    mesh, adaptive = case
    full = mesh == (1, 8) and adaptive is None
    return dry_run_programs.dry_run(experiment(paths, mesh, adaptive), TOPOLOGY,
                          programs=("speculative", "baseline") if full else ("speculative",),
                          roofline=full, workers=1)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the compiler releases the GIL
    return dict(zip(CASES, pool.map(run, CASES)))


def _bytes(cfg: T5Config, mesh, rules) -> int:
  return memory.param_bytes(cfg, memory.planning_partitioner(mesh, rules), "bfloat16")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_compiles_and_moves_no_weight(runs, case):
  r = runs[case]
  assert r.chip is chips.CHIPS["v5e"] and r.num_devices == 8
  for p in r.programs:
    assert not p.error, p.error
    assert p.weight_moves == [], p.weight_moves
    # The target is split over 'model': each decoder layer all-reduces its
    # attention and MLP outputs (activations, [B/data, k, d] or smaller).
    assert p.collectives and all(c.kind == "all-reduce" for c in p.collectives)
    assert max(c.nbytes for c in p.collectives) <= 2 * (GAMMA + 1) * TARGET.d_model * 2


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_argument_bytes_are_the_sharded_parameters(runs, case):
  mesh, _ = case
  p = next(p for p in runs[case].programs if p.name == "speculative loop")
  # The weight arguments' shard shapes are the planned ones, byte for byte...
  assert p.weights == (_bytes(TARGET, mesh, None)
                       + _bytes(DRAFT, mesh, partitioning.DATA_PARALLEL_RULES))
  # ... and the executable's argument bytes are those arrays (weights,
  # inputs, key) as their compiled layouts pad them: nothing else is passed.
  assert p.arguments == p.padded_arguments
  assert p.arguments - p.weights < 16 * 1024  # inputs [B, 32] int32, the key, tile padding


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_memory_estimate_within_tolerance(runs, case):
  for p in runs[case].programs:
    assert abs(p.total - p.estimate) <= TOLERANCE * max(p.total, p.estimate), \
        (p.name, p.total, p.estimate)
    assert p.total <= chips.CHIPS["v5e"].hbm_bytes


def test_adaptive_compiles_every_width(runs):
  text = driver.format_report(runs[((1, 8), ADAPTIVE)])
  assert f"adaptive widths {ADAPTIVE.verify_widths(GAMMA)}" in text


def test_roofline_model(runs):
  r = runs[((1, 8), None)]
  rl = r.roofline
  assert sorted(rl.target) == list(range(1, GAMMA + 2)) and rl.draft is not None
  assert rl.v(1) == 1.0 and rl.c() > 0 and rl.floor > 0
  assert r.paper == paper.table2_row("ende", "small", 0)
  assert r.predicted() == pytest.approx(theory.walltime_improvement(0.75, GAMMA, rl.c()))
  assert r.predicted(True) == pytest.approx(
      theory.walltime_improvement(0.75, GAMMA, rl.c(), rl.v(GAMMA + 1)))
  text = driver.format_report(r)
  assert "MODEL, not a measurement" in text and "the paper measured 3.4x" in text
  assert "Collectives in one iteration of the speculative loop" in text
  # The short report: the same prediction in one sentence beside the paper's.
  short = driver.summary_report(r).splitlines()
  assert short[-2] == (
      f"Prediction (a cost model, not a measurement): the draft costs c = {rl.c():.3f} of a "
      f"target step; at the paper's α = 0.75, {r.speculative_ms_per_token():.3f} ms per token "
      f"against the baseline's {rl.baseline_ms_per_token():.3f}, {r.predicted(True):.2f}× (the "
      f"paper measured 3.4× with c = 0.02 on one {paper.CHIP}).")


def test_depth_extrapolation_is_exact(runs, paths):
  """The roofline's pieces are compiled at depths 1 and 2 and extrapolated:
  a direct compile at depth 3 agrees."""
  del runs  # its depth-1 and depth-2 pieces are cached
  exp = experiment(paths)
  part = partitioning.Partitioner(
      partitioning.make_mesh((1, 8), chips.topology_devices(TOPOLOGY)[1]))
  dev = part.mesh.devices.flat[0]
  got = {}
  for depth in (1, 2, 3):
    cfg = TARGET.replace(num_decoder_layers=depth, num_encoder_layers=1)
    got[("target", depth, 1)] = driver.compile_program(
        "piece", dry_run_programs.lower_pass(cfg, part, dev, exp, 1, 8 + GAMMA + 1), TOPOLOGY,
        options=costs.PIECE_OPTIONS)
  extrapolated = costs.extrapolate(got, "target", 1, 3)
  assert extrapolated.flops == pytest.approx(got[("target", 3, 1)].flops, rel=1e-6)
  assert extrapolated.bytes == pytest.approx(got[("target", 3, 1)].bytes, rel=0.02)


def test_the_roofline_prices_rounds_through_the_one_record():
  """``Roofline.round_cost`` is the round record (``theory.RoundCost``) at the
  pieces' prices: a chain round at γ is Theorem 3.8 with v at c = draft /
  step and v = pass(γ + 1) / step, and its milliseconds per token are the
  round's seconds over Eq. (1)'s tokens; a tree's round is depth draft calls
  and one pass over its N nodes; a draft proposing the block in one call is
  ``draft_calls=1``."""
  step, draft_s = 2e-3, 1e-4
  pass_s = lambda k: step * (1 + 0.02 * (k - 1))
  tree = TreeShape.from_acceptance(scaled_rank_rates(0.7, DEMO_RANK_PROFILE), 8, 3)
  piece = lambda s: costs.Piece(0.0, s * chips.CHIPS["v4"].hbm_bandwidth)
  rl = costs.Roofline(chips.CHIPS["v4"],
                      {k: piece(pass_s(k)) for k in (1, 4, 5, 8, tree.num_nodes)},
                      piece(draft_s), floor=0)
  for alpha, gamma in ((0.6, 3), (0.8, 7)):
    rc = rl.round_cost(gamma)
    assert (rc.gamma, rc.draft_calls, rc.positions) == (gamma, gamma, gamma + 1)
    want = float(theory.walltime_improvement(alpha, gamma, draft_s / step,
                                             pass_s(gamma + 1) / step))
    assert rc.predicted(alpha) == pytest.approx(want, rel=1e-12)
    tokens = float(theory.expected_tokens(alpha, gamma))
    assert rc.ms_per_token(tokens) == pytest.approx(
        1e3 * (gamma * draft_s + pass_s(gamma + 1)) / tokens, rel=1e-12)
  assert rl.round_cost(3, draft_calls=1).steps() == pytest.approx(
      (draft_s + pass_s(4)) / step, rel=1e-12)
  chain = rl.tree_round_cost(TreeShape.chain(4))
  assert (chain.gamma, chain.draft_calls) == (4, 4) and chain == rl.round_cost(4)
  rates = scaled_rank_rates(0.7, DEMO_RANK_PROFILE)
  assert rl.tree_round_cost(tree).speedup(tree.expected_tokens(rates)) == pytest.approx(
      tree.expected_tokens(rates) * step / (tree.max_depth * draft_s + pass_s(tree.num_nodes)),
      rel=1e-9)
  assert math.isnan(rl.round_cost(5).v)   # no pass over 6 positions compiled


def test_collective_and_fixed_cost_arithmetic():
  """The cost model's latency terms: a collective costs hops x the per-hop
  latency + its bytes over the ICI link, so it grows with the group (more
  hops, more bytes on the wire) and with the payload; a piece's fixed cost
  is its operation count x the chip's cost per operation; a piece costs the
  sum of its roofline, its collectives and its fixed cost."""
  chip = dataclasses.replace(chips.CHIPS["v5e"], op_seconds=2e-6)
  price = lambda kind, nbytes, group: costs.collective_seconds(kind, nbytes, group, chip)
  assert price("all-reduce", 1 << 16, 1) == 0.0
  assert price("all-reduce", 1 << 16, 2) < price("all-reduce", 1 << 16, 4) \
      < price("all-reduce", 1 << 16, 8)
  assert price("all-reduce", 1 << 10, 8) < price("all-reduce", 1 << 20, 8)
  assert price("all-gather", 1 << 16, 8) < price("all-reduce", 1 << 16, 8)
  # A tiny payload is all latency: hops x the per-hop latency.
  assert price("all-reduce", 2, 8) == pytest.approx(
      costs.ring_hops("all-reduce", 8) * chip.hop_latency, rel=1e-3)
  # A large one is all bandwidth: 2 (n - 1) / n of it over both directions of a link.
  big = 1 << 30
  assert price("all-reduce", big, 8) == pytest.approx(
      2 * 7 / 8 * big / (2 * chip.ici_link_bandwidth), rel=1e-3)
  piece = costs.Piece(flops=1e9, bytes=1e8, ops=40,
                      collectives=((("all-reduce", 1 << 16, 8), 3),))
  assert piece.fixed_seconds(chip) == pytest.approx(40 * 2e-6)
  assert piece.collective_seconds(chip) == pytest.approx(3 * price("all-reduce", 1 << 16, 8))
  assert piece.seconds(chip) == pytest.approx(
      max(1e9 / chip.peak_flops, 1e8 / chip.hbm_bandwidth) + piece.collective_seconds(chip)
      + piece.fixed_seconds(chip))
  more_ops = dataclasses.replace(piece, ops=80)
  assert more_ops.seconds(chip) - piece.seconds(chip) == pytest.approx(40 * 2e-6)


def test_pieces_carry_ops_and_collectives(runs):
  """On the (1, 8) mesh each target pass launches operations and all-reduces
  over the 8 devices (one replica group, read from the HLO); the draft is
  replicated and runs none; the calibrated fixed cost is part of a step."""
  rl = runs[((1, 8), None)].roofline
  one = rl.target[1]
  assert one.ops > 0 and rl.draft.ops > 0
  assert one.collectives and all(kind == "all-reduce" and group == 8
                                 for (kind, _, group), _ in one.collectives)
  assert rl.draft.collectives == ()
  assert one.collective_seconds(rl.chip) > 0
  assert one.seconds(rl.chip) == pytest.approx(
      one.roofline_seconds(rl.chip) + one.collective_seconds(rl.chip)
      + one.ops * rl.chip.op_seconds)
  assert rl.c() > 0


def test_calibration_is_reproducible():
  """The stored calibration parameter is what ``calibration.calibrate``
  recomputes from the stored T5-small and T5-XXL op counts, and at it the
  model's c for T5-small is the paper's 0.02 (by construction); base and
  large are predictions, not fitted."""
  t = calibration.calibrate()
  assert t == pytest.approx(chips.V4_OP_SECONDS, rel=1e-3)
  assert chips.CHIPS["v4"].op_seconds == chips.V4_OP_SECONDS > 0
  c = calibration.predicted_c(t)
  assert c["small"] == pytest.approx(paper.DRAFT_C["small"], rel=1e-6)
  assert c["small"] < c["base"] < c["large"]
  assert "calibrated on T5-small only" in calibration.table()


def test_a_gathered_weight_is_found():
  """The check the dry run relies on: a weight all-gathered at run time is
  reported, an activation's all-reduce is not."""
  _, devices = chips.topology_devices(TOPOLOGY)
  mesh = partitioning.make_mesh((1, 8), devices)
  shard = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  params = {"w": jax.ShapeDtypeStruct((128, 256), "bfloat16", sharding=shard(None, "model")),
            "v": jax.ShapeDtypeStruct((256, 128), "bfloat16", sharding=shard("model", None))}
  x = jax.ShapeDtypeStruct((2, 128), "bfloat16", sharding=shard())

  def f(params, x):
    h = x @ params["w"]                          # stays sharded: no collective
    y = h @ params["v"]                          # all-reduce of an activation
    w = jax.lax.with_sharding_constraint(params["w"], shard())  # all-gather of a weight
    return y, x @ w

  module = hlo.parse(jax.jit(f).lower(params, x).compile().as_text())
  moves = hlo.weight_collectives(module, driver.is_weight)
  assert [m.kind for m in moves] == ["all-gather"] and moves[0].shape == "bf16[128,256]"
  # Every collective's replica group is read from the HLO: the 8 devices of 'model'.
  assert {c.group for c in hlo.all_collectives(module)} == {8}
  assert hlo.op_count(module) > 0


# ---------------------------------------------------------------- bad input


@pytest.fixture
def no_compile(monkeypatch):
  """Bad input must be refused before any compile."""
  def refuse(*a, **k):
    raise AssertionError("compiled before refusing bad input")
  monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)


def _one_line(excinfo) -> str:
  text = str(excinfo.value)
  assert "\n" not in text
  return text


@pytest.mark.parametrize("topology,says", [
    ("v9x:2x4", "unknown TPU topology"), ("v5e", "unknown TPU topology"),
    ("v5e:3x3", "libtpu cannot build this topology: INVALID_ARGUMENT")])
def test_unknown_topology(paths, no_compile, topology, says):
  with pytest.raises(ValueError) as e:
    dry_run_programs.dry_run(experiment(paths), topology)
  assert says in _one_line(e)


def test_mesh_does_not_match_the_topology(paths, no_compile):
  with pytest.raises(ValueError) as e:
    dry_run_programs.dry_run(experiment(paths, mesh=(1, 4)), TOPOLOGY)
  text = _one_line(e)
  assert "mesh_shape (1, 4) has 4 devices but there are 8" in text and TOPOLOGY in text


def test_dimension_the_mesh_does_not_divide(paths, no_compile):
  with pytest.raises(ValueError) as e:
    dry_run_programs.dry_run(experiment(paths, target_checkpoint=paths["heads6"]), TOPOLOGY)
  text = _one_line(e)
  assert "cannot shard the target" in text and "not divisible by mesh axis 'model'" in text


def test_row_that_does_not_fit(paths, no_compile):
  exp = experiment(paths, target_checkpoint=paths["huge"], draft_name="prompt_lookup",
                   draft_checkpoint="", mesh_shape=None, param_dtype="float32")
  with pytest.raises(ValueError) as e:
    dry_run_programs.dry_run(exp, TOPOLOGY)
  text = _one_line(e)
  assert "does not fit" in text and "16 GiB of HBM" in text


def test_command_line_alpha_only(paths, runs, capsys, caplog):
  """``--dry_run`` through the runner's command line, with ``--alpha_only``:
  the target's generation and the α pass (§4.2), no roofline; it says what
  it compiles, then each program's name and compile time as it is done."""
  import logging as std_logging  # pylint: disable=import-outside-toplevel
  caplog.set_level(std_logging.INFO)
  del runs  # the baseline loop is compiled (and cached) there
  from specdec_jax.run.cli import run_args  # pylint: disable=import-outside-toplevel
  bindings = [f"Experiment.target_checkpoint = '{paths['target']}'",
              f"Experiment.draft_checkpoint = '{paths['draft']}'",
              "Experiment.vocab_path = 'not/read/spm.model'",
              "Experiment.source = 'not/read/test.tsv'", "Experiment.task = 'wmt_ende'",
              "Experiment.mesh_shape = (1, 8)", "Experiment.param_dtype = 'bfloat16'",
              "Experiment.dtype = 'bfloat16'", "Experiment.batch_size = 2",
              "Experiment.max_input_len = 32", "Experiment.max_decode_len = 8",
              f"Experiment.gamma = {GAMMA}"]
  code = run_args([f"--dry_run={TOPOLOGY}", "--alpha_only"]
                  + [f"--gin_bindings={b}" for b in bindings])
  out = capsys.readouterr().out
  assert code == 0
  # By default a short summary in words (the full account: --verbose).
  lines = out.strip().splitlines()
  assert len(lines) == 3, out
  assert "2 programs compiled in" in lines[0] and "no weight or data was read" in lines[0]
  assert lines[1].startswith("Memory: the largest program, the ") and lines[1].endswith(
      ": it fits.")
  assert lines[2].endswith("add --verbose.") and "Roofline" not in out
  said = [r.getMessage() for r in caplog.records]
  start = next(i for i, m in enumerate(said) if m.startswith(f"Compiling 2 programs for "
                                                              f"{TOPOLOGY}, "))
  done = [m for m in said[start + 1:] if m.startswith("  ")]
  assert len(done) == 2 and {m.split(":")[0].strip() for m in done} == {
      "baseline loop", "α pass (§4.2)"}, said
  assert all(re.search(r": \d+ s \([12]/2\)$", m) for m in done), done


def test_command_line_bad_topology(capsys):
  from specdec_jax.run.cli import run_args  # pylint: disable=import-outside-toplevel
  assert run_args(["--dry_run=tpu9:2x4"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: --dry_run='tpu9:2x4': unknown TPU topology")


def test_a_tree_run_compiles_its_own_loop(paths):
  """With Experiment.tree the dry run compiles the tree loop and the draft's
  tree proposal, prices the pass of N positions (γ = N - 1), moves no weight,
  and its memory estimate holds."""
  r = dry_run_programs.dry_run(experiment(paths, tree="full:2,1"), TOPOLOGY,
                     programs=("speculative", "draft"), roofline=False, workers=1)
  assert r.exp.gamma_max == 4  # 1 + 2 + 2 nodes
  for p in r.programs:
    assert not p.error, p.error
    assert p.weight_moves == [], p.weight_moves
    assert abs(p.total - p.estimate) <= TOLERANCE * max(p.total, p.estimate), \
        (p.name, p.total, p.estimate)


def test_one_chip_the_papers_setting(paths):
  """A single-chip topology compiles (libtpu told the host holds one chip):
  the tiny pair on one v5e chip, mesh (1, 1), as the paper measured on one
  chip; the report puts the model's ms per token, c and speedup beside the
  paper's measured speedup and Theorem 3.8 at the paper's own α, γ and c."""
  r = dry_run_programs.dry_run(experiment(paths, mesh=(1, 1)), "v5e:1x1",
                              programs=("speculative",), workers=1)
  assert r.num_devices == 1 and r.fits
  p = r.programs[0]
  assert not p.error and p.collectives == [] and p.weight_moves == []
  rl = r.roofline
  base, spec = rl.baseline_ms_per_token(), r.speculative_ms_per_token()
  assert 0 < spec and base / spec == pytest.approx(r.predicted(True), rel=1e-6)
  text = driver.format_report(r)
  assert f"ms/token: baseline {base:.3f}, speculative {spec:.3f}" in text
  paper_c = theory.walltime_improvement(0.75, 7, 0.02)
  assert f"Theorem 3.8 at the paper's α 0.75, γ 7, c 0.02: {paper_c:.2f}x" in text


def test_a_tree_run_prices_its_own_pass(paths):
  """With Experiment.tree the roofline compiles a one-position pass and the
  tree's own pass over its N nodes (``T5Model.decode_tree``, the tree's
  attention mask), not a chain of N positions."""
  r = dry_run_programs.dry_run(experiment(paths, tree="full:2,1"), TOPOLOGY,
                              programs=("draft",), workers=1)
  rl = r.roofline
  assert sorted(rl.target) == [1, 5] and rl.draft is not None
  assert rl.v(5) > 0 and rl.target[5].ops > 0
  text = driver.format_report(r)
  assert "target tree pass, N=5" in text
  # Its prediction is the tree's (tokens per round of depth draft calls and
  # one N-node pass), not the chain formula at γ = N - 1.
  tree, rates = r.exp.tree_shape, scaled_rank_rates(0.75, DEMO_RANK_PROFILE)
  round_s = tree.max_depth * rl.draft.seconds(r.chip) + rl.target[5].seconds(r.chip)
  want = tree.expected_tokens(rates) * rl.target[1].seconds(r.chip) / round_s
  assert r.predicted() == pytest.approx(want, rel=1e-9)
  assert r.predicted() != pytest.approx(rl.round_cost(4).predicted(0.75), rel=1e-3)
  assert f"predicted {want:.2f}x" in text and "tokens per round" in text


@pytest.mark.slow
def test_a_dynamic_tree_run_compiles_and_is_priced(paths):
  """Experiment.tree = 'dynamic:...': the draft's per-round proposal and the
  tree's pass with its parents as data compile; the prediction prices the
  static tree of the same node count and depth that accepts the most at the
  rates (``priced_tree``, an assumption the report names)."""
  r = dry_run_programs.dry_run(experiment(paths, tree="dynamic:2,2"), TOPOLOGY,
                               programs=("draft",), workers=1)
  for p in r.programs:
    assert not p.error, p.error
  rl, rates = r.roofline, scaled_rank_rates(0.75, DEMO_RANK_PROFILE)
  assert sorted(rl.target) == [1, 5]
  best = TreeShape.from_acceptance(rates, 5, 2)
  round_s = 2 * rl.draft.seconds(r.chip) + rl.target[5].seconds(r.chip)
  want = best.expected_tokens(rates) * rl.target[1].seconds(r.chip) / round_s
  assert r.predicted() == pytest.approx(want, rel=1e-9)
  text = driver.format_report(r)
  assert "target tree pass, N=5" in text and "chosen per round, priced as the best static" in text


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_draft_compiles_and_reads_fewer_bytes(paths, runs, mode):
  """Experiment.draft_quantization: the speculative loop and the draft compile
  with the draft's kernels as int8 / int4 plus scales; the draft step's floor
  is memory.step_weight_bytes of that layout, the compiled step reads fewer
  bytes than the bfloat16 draft's, and the report names the quantization
  (int4 compiles the draft alone: the loop around it is int8's)."""
  r = dry_run_programs.dry_run(experiment(paths, draft_quantization=mode), TOPOLOGY,
                              programs=("speculative", "draft") if mode == "int8" else ("draft",),
                              workers=1)
  assert not [p.error for p in r.programs if p.error]
  part = memory.planning_partitioner((1, 8), partitioning.DATA_PARALLEL_RULES)
  assert r.roofline.draft_floor == memory.step_weight_bytes(DRAFT, part, "bfloat16", mode)
  plain = runs[((1, 8), None)].roofline
  assert r.roofline.draft_floor < plain.draft_floor / (1.8 if mode == "int8" else 3.0)
  assert r.roofline.draft.bytes < plain.draft.bytes
  assert r.ctx.resident["draft weights"] == memory.param_bytes(DRAFT, part, "bfloat16", mode)
  assert f"kernels {mode}" in driver.format_report(r)


def test_compile_all_names_each_program_as_it_is_done(caplog):
  """Before compiling, the list; then, as each compile finishes, its name and
  compile time (two tiny programs for one v5e chip: no `runs` fixture)."""
  import logging as std_logging  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  caplog.set_level(std_logging.INFO)
  _, devices = chips.topology_devices("v5e:1x1")
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32,
                           sharding=jax.sharding.SingleDeviceSharding(devices[0]))
  specs = [driver.Compile(name, lambda f=f: jax.jit(f).lower(x))
           for name, f in (("double", lambda a: a * 2), ("total", lambda a: a.sum()))]
  programs = driver.compile_all("v5e:1x1", specs, workers=1)
  assert [p.name for p in programs] == ["double", "total"] and not any(p.error for p in programs)
  said = [r.getMessage() for r in caplog.records]
  assert "Compiling 2 programs for v5e:1x1, 1 at a time: double, total…" in said
  assert [m for m in said if m.startswith("  ")] == [
      f"  double: {programs[0].compile_s:.0f} s (1/2)",
      f"  total: {programs[1].compile_s:.0f} s (2/2)"]


@pytest.fixture
def cache_dir_setting():
  """jax_compilation_cache_dir set by the test, restored after it."""
  before = jax.config.jax_compilation_cache_dir
  yield lambda value: jax.config.update("jax_compilation_cache_dir", value)
  jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
def test_a_program_compiled_before_is_read_back_not_compiled(tmp_path, monkeypatch,
                                                             cache_dir_setting):
  """With a compilation cache set, a program's record outlives its process:
  the next process (here: an emptied in-memory cache) reads it back rather
  than compiling, with the same figures; a corrupt record is compiled again;
  without a cache, nothing is written."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  _, devices = chips.topology_devices("v5e:1x1")
  x = jax.ShapeDtypeStruct((16, 256), jnp.float32,
                           sharding=jax.sharding.SingleDeviceSharding(devices[0]))

  def compile_fresh():
    monkeypatch.setattr(driver, "_COMPILED", {})  # as in a new process
    return driver.compile_program("square", jax.jit(lambda a: (a @ a.T).sum(0)).lower(x),
                                  "v5e:1x1")
  cache_dir_setting(None)
  first = compile_fresh()
  assert not first.loaded and first.temporaries + first.outputs > 0 and first.flops > 0
  cache_dir_setting(str(tmp_path))
  compiled = compile_fresh()
  records = list((tmp_path / "specdec_jax_dry_run").glob("*.pkl"))
  assert len(records) == 1 and not compiled.loaded
  again = compile_fresh()
  assert again.loaded and again.compile_s == 0
  assert dataclasses.replace(again, loaded=False, compile_s=compiled.compile_s) == compiled
  records[0].write_bytes(b"not a record")
  assert not compile_fresh().loaded


def test_the_short_report_says_what_fits_in_words():
  """The runner's default dry-run report (no compile needed here): the
  largest program against the chip's memory, each program that does not fit
  or did not compile, and where the full account is."""
  from specdec_jax.dryrun import chips
  chip, _ = chips.parse_topology("v4:1x1x1")
  ctx = driver.Context("v4:1x1x1", chip, (None,), None, None, None, None, None, [])
  gib = 2 ** 30
  fits = driver.DryRun(ctx, [driver.Program("speculative loop", 0, arguments=20 * gib,
                                            temporaries=4 * gib),
                             driver.Program("baseline loop", 0, arguments=20 * gib)],
                       wall_s=12.0)
  text = driver.summary_report(fits)
  assert text.splitlines() == [
      "Dry run for v4:1x1x1 (1 TPU v4 chip, 32 GiB of memory each): 2 programs compiled in "
      "12 s; no weight or data was read.",
      "Memory: the largest program, the speculative loop, needs 24.00 GiB per chip, 75% of "
      "its 32 GiB: it fits.",
      "The full account (each program's memory, collectives, the cost model's pieces): add "
      "--verbose."]
  over = driver.DryRun(ctx, [driver.Program("speculative loop", 0, arguments=40 * gib),
                             driver.Program("draft", 0, error="RESOURCE_EXHAUSTED")])
  lines = driver.summary_report(over).splitlines()
  assert lines[1].endswith("125% of its 32 GiB.")
  assert lines[2] == ("Does NOT fit: the speculative loop needs 40.00 GiB per chip, more than "
                      "its 32 GiB.")
  assert lines[3] == "Did not compile: the draft (RESOURCE_EXHAUSTED)."
