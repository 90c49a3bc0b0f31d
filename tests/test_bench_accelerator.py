"""scripts/bench_accelerator.sh: the GPU benchmark (scripts/bench_gpu.py) and
the earlier runner set, each at toy sizes on the CPU (--smoke), each section
printing its table; its sections each run even when an earlier one fails;
the steered approximation model the loops section times (exact at T = 0,
acceptance at the steer's α)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from lab.bench import common as bench
from lab.bench import sections, variants

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "bench_accelerator.sh"
GPU_SECTIONS = ("loops", "variant_pallas", "variant_fixed_positions", "variant_fused_projections",
                "variant_command_buffers", "hf", "demo", "loops_cnndm")
MORE_SECTIONS = ("variant_min_rows", "bandwidth", "targets", "exactness", "profile")
RUNNER_SECTIONS = ("runner demo", "runner demo_t1", "v(k)", "γ sweep T=0", "γ sweep T=1")


def _env(tmp_path: Path) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", OUT=str(tmp_path), PYTHONPATH=str(REPO),
             PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
  env.pop("BENCH_WORKDIR", None)
  env.pop("BENCH_BUDGET_S", None)
  return env


@pytest.mark.slow
def test_bench_accelerator_gpu_smoke_prints_every_table(tmp_path):
  """Every section of the GPU benchmark, the default ones and the earlier
  tables, at toy sizes: its table printed, its rows in bench_gpu.json and
  its table in bench_gpu.md."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  # loops_cnndm is loops for the other task (test_loops_sections_split_table_2_by_task).
  names = [s for s in GPU_SECTIONS + MORE_SECTIONS if s != "loops_cnndm"]
  res = subprocess.run(["bash", str(SCRIPT), "--smoke", f"--sections={','.join(names)}"],
                       cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=1200)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  out = res.stdout
  assert "failed" not in out and "skipped" not in out, out
  assert "# accelerator: cpu" in out and "transformers " in out
  work = tmp_path / "bench_accelerator"
  doc = json.loads((work / "bench_gpu.json").read_text())
  assert set(doc["sections"]) == set(names)
  assert doc["machine"]["platform"] == "cpu"
  # loops: the chain and the tree token for token as the baseline, α measured.
  assert "| row | paper α | γ | measured α | c | v(γ+1) |" in out
  (row,) = doc["sections"]["loops"]["rows"]
  assert (row["task"], row["draft"], row["gamma"]) == ("ende", "small", 7)
  assert row["chain_identical"] and row["tree_identical"], row
  assert row["chain_speedup"] > 0 and row["tree_speedup"] > 0 and 0 <= row["alpha"] <= 1
  assert "| ende small | 0.75 | 7 |" in out and "chain identical, tree identical" in out
  # Each variant: every pass with and without it; mismatches where counted.
  for name in variants.VARIANTS:
    var = doc["sections"][variants.section_name(name)]
    assert [(p["model"], p["k"]) for p in var["passes"]] == [
        ("target xxl", 1), ("target xxl", 8), ("draft small", 1)], name
    assert all(p["default_ms"] > 0 and p["variant_ms"] > 0 for p in var["passes"]), name
    assert f"| {name} ms |" in out, name
    if name in variants.COUNTED:  # the variant's (smoke mode does not count the default's)
      counts = var["mismatches"]
      assert counts["demo"]["mismatches"] == 0 and counts["random"]["mismatches"] == 0, counts
    else:
      assert "mismatches" not in var, name
  assert "| target xxl | one-token step |" in out
  assert "| default | - | - | not counted in smoke mode |" in out
  # hf: our baseline against HF's static cache, ours against HF assisted.
  hf = doc["sections"]["hf"]
  assert hf["hf_assisted_error"] is None and hf["hf_assisted_tok_s"] > 0, hf
  assert "| HF | generate, static cache, not compiled" in out
  assert "| HF | assisted generation, small-sized assistant, constant γ 2 |" in out
  assert "Our baseline over HF's static-cache generate: **" in out
  # demo
  assert "| 0 | HF assisted (constant γ) |" in out and "| 0 | ours speculative_decode |" in out
  assert "identical outputs: 5/5 comparisons with HF generate" in out
  # The earlier tables.
  assert "| device-to-device copy | 8 |" in out                                   # bandwidth
  assert out.count("| model | pass | k | ms | v(k) / c | weight GB read | floor ms |") == 2
  assert out.count("| target | draft | α | γ | c | v(8) | EXP (Thm 3.8) |") == 2    # Thm 3.8
  assert "| float32 | highest | 1 | **0** |" in out                                  # exactness
  xxl = doc["sections"]["targets"]["targets"]["xxl"]
  assert [p["k"] for p in xxl["passes"] if p["kind"] == "target"] == [1, 8]
  assert all(0 < p["pct_of_floor"] for p in xxl["passes"])
  from specdec_jax import memory                              # the floor's bytes: memory's count
  assert xxl["passes"][0]["weight_bytes"] == memory.step_weight_bytes(
      bench.SMOKE.targets["xxl"], None, "bfloat16")
  # The kernel profiles: the first target's step and γ + 1 pass, then the
  # profile section's steps with and without min_rows 2 (same weights).
  assert [r["label"] for r in xxl["profile"]] == ["one-token step", "8-position pass"]
  labels = [r["label"] for r in doc["sections"]["profile"]["rows"]]
  assert "target xl (min_rows 2) one-token step" in labels and "target xl 2-position pass" in labels
  assert all(r["kernels_per_pass"] > 0 and r["wall_ms"] > 0
             for r in xxl["profile"] + doc["sections"]["profile"]["rows"])
  assert out.count("Per-kernel profile of") == 2
  md = (work / "bench_gpu.md").read_text()
  assert all(f"### {name}" in md for name in names)
  assert "| device-to-device copy |" in (work / "bench_accelerator.log").read_text()


def test_bench_accelerator_runner_smoke_prints_every_table(tmp_path):
  res = subprocess.run(["bash", str(SCRIPT), "--runner", "--smoke"], cwd=tmp_path,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
  out = res.stdout
  assert "failed" not in out and "skipped" not in out, out
  assert "# accelerator: cpu" in out
  assert "| model | what | k | ms per call | ratio to k=1 |" in out          # v(k)
  # Smoke mode runs configs/demo.gin alone (demo_t1 is the same path at T = 1).
  assert out.count("| TASK | M_q | TEMP | γ | α | SPEED |") == 1
  assert "Outputs identical to the baseline's on all 1" in out
  assert out.count("# summary: 1 examples, T = 0") == 1                     # tok/s, α, c
  assert "| temp | γ | baseline tok/s | speculative tok/s | speedup |" in out  # the sweep
  assert (tmp_path / "bench_accelerator" / "demo" / "summary.json").is_file()


@pytest.mark.parametrize("flags, names", [([], ("devices",) + GPU_SECTIONS),
                                          (["--runner"], ("devices",) + RUNNER_SECTIONS),
                                          (["--block"], ("devices", "block"))])
def test_bench_accelerator_runs_every_section_after_failures(tmp_path, flags, names):
  """A `python` that fails at once: every section is tried and reported,
  the script goes on to the end and exits 1; output goes to BENCH_WORKDIR."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  fake = bin_dir / "python"
  fake.write_text("#!/bin/sh\nexit 3\n")
  fake.chmod(0o755)
  env = dict(os.environ, OUT=str(tmp_path / "out"), BENCH_WORKDIR=str(tmp_path / "work"),
             PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
  env.pop("BENCH_BUDGET_S", None)
  res = subprocess.run(["bash", str(SCRIPT), *flags], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 1, res.stdout + res.stderr
  out = res.stdout
  for name in names:
    assert f"# section {name} failed (exit 3)" in out, out
  assert f"# failed or skipped: {','.join(names)}" in out
  assert (tmp_path / "work" / "bench_accelerator" / "bench_accelerator.log").is_file()
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, n", [([], 1 + len(GPU_SECTIONS)),
                                      (["--runner"], 1 + len(RUNNER_SECTIONS))])
def test_bench_accelerator_time_budget_skips_what_does_not_fit(tmp_path, flags, n):
  """With no budget left, sections are skipped (not started), reported, exit 1."""
  env = dict(os.environ, BENCH_WORKDIR=str(tmp_path), BENCH_BUDGET_S="10")
  res = subprocess.run(["bash", str(SCRIPT), *flags], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
  assert res.returncode == 1, res.stdout + res.stderr
  assert res.stdout.count("skipped: the time budget (10 s) is spent") == n, res.stdout


def test_bench_accelerator_rejects_unknown_flags(tmp_path):
  res = subprocess.run(["bash", str(SCRIPT), "--nope"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
  assert res.returncode == 2 and "usage:" in res.stderr


def test_default_order_is_the_scripts():
  """bench_accelerator.sh's default sections are bench_gpu.py's, in order,
  and the shell's section table names every section bench_gpu.py has."""
  text = SCRIPT.read_text()
  default = text.split('default_sections="')[1].split('"')[0].split()
  more = text.split('more_sections="')[1].split('"')[0].split()
  assert tuple(default) == sections.DEFAULT == GPU_SECTIONS
  assert tuple(more) == sections.MORE == MORE_SECTIONS
  table = text.split("<<'SECTIONS'\n")[1].split("\nSECTIONS")[0].splitlines()
  assert [line.split()[0] for line in table] == default + more
  assert set(sections.SECTIONS) == set(default + more)


def test_paper_rows_are_table_2_at_t0():
  assert bench.PAPER_GAMMA == 7
  assert {k: v["alpha"] for k, v in bench.PAPER_ENDE_T0.items()} == {
      "small": 0.75, "base": 0.80, "large": 0.82}
  assert bench.T0_ROWS == (("ende", "small"), ("ende", "base"), ("ende", "large"),
                           ("cnndm", "small"), ("cnndm", "base"), ("cnndm", "large"))
  assert bench.FULL.loop_rows == bench.T0_ROWS and bench.FULL.new_tokens == 64
  assert bench.FULL.mismatch_inputs == 100
  assert 1 in bench.FULL.ks and bench.PAPER_GAMMA + 1 in bench.FULL.ks
  assert bench.FULL.ks == (1, 2, 4, 8, 16)
  assert set(bench.FULL.targets) == {"xxl", "xl"}
  assert bench.FULL.targets["xxl"].d_model == 4096
  assert set(bench.FULL.drafts) == {"small", "base", "large"}


def test_loops_sections_split_table_2_by_task(tmp_path):
  """loops times the EnDe rows, loops_cnndm the CNN/DM ones (the same code)."""
  from specdec_jax import paper
  from lab.bench import loops
  assert [loops.section_name(t) for t in ("ende", "cnndm")] == ["loops", "loops_cnndm"]
  gammas = {t: [paper.table2_row(t, d, 0).gamma for tt, d in bench.FULL.loop_rows if tt == t]
            for t in ("ende", "cnndm")}
  assert gammas == {"ende": [7, 7, 7], "cnndm": [5, 5, 3]}
  with pytest.raises(ValueError, match="no T = 0 rows of task 'wmt'"):
    loops.section_loops("wmt", bench.SMOKE, tmp_path)


def test_variants_are_checked():
  assert variants.check_variant("min_rows")["config"] == {"min_rows": 2}
  with pytest.raises(ValueError, match="unknown variant 'nope'"):
    variants.check_variant("nope")
  variants.VARIANTS["bad"] = dict(config=dict(no_such_field=1))
  try:
    with pytest.raises(ValueError, match=r"T5Config has no field\(s\) \['no_such_field'\]"):
      variants.check_variant("bad")
  finally:
    del variants.VARIANTS["bad"]


# ------------------------------------------ the loops section's steered draft

STEER_LEN = 48  # new tokens per row


@pytest.fixture(scope="module")
def steered(tiny_target, tiny_draft):
  """The tiny pair, 8 random inputs and the baseline's tokens for them."""
  from specdec_jax.decoding import temperature_sample
  from specdec_jax.drafts import T5Draft
  from specdec_jax.sampling import SamplingConfig
  (tmodel, tparams), (dmodel, dparams) = tiny_target, tiny_draft
  inputs = jax.random.randint(jax.random.PRNGKey(2), (8, 10), 2, tmodel.config.vocab_size)
  greedy = SamplingConfig(temperature=0.0)
  ref = temperature_sample(tmodel, tparams, inputs, jax.random.PRNGKey(0),
                           max_decode_len=STEER_LEN, sampling=greedy, eos_id=-1).tokens
  return tmodel, tparams, T5Draft(params=dparams, model=dmodel), inputs, ref, greedy


@pytest.mark.slow
def test_steered_chain_is_exact_and_accepts_at_its_alpha(steered):
  """speculative_decode with the steered draft reproduces the baseline
  token for token at α 0.75, 0 and 1, and its measured α is the steer's:
  within 4 binomial standard errors (sqrt(α(1 - α)/n), n the evaluated
  positions, about 350 here: |error| < 0.09; a fixed seed), exactly 0 and 1
  at the ends."""
  from specdec_jax.decoding import speculative_decode
  from lab.bench.steered import SteeredDraft
  tmodel, tparams, draft, inputs, ref, greedy = steered
  for rates in ([0.75, 0.1, 0.05, 0.0], [0.0] * 4, [1.0, 0.0, 0.0, 0.0]):
    d = SteeredDraft.build(draft, ref, rates, seed=3)
    out = speculative_decode(tmodel, tparams, d, inputs, jax.random.PRNGKey(0), gamma=5,
                             max_decode_len=STEER_LEN, sampling=greedy, eos_id=-1)
    np.testing.assert_array_equal(out.tokens, ref)
    acc, rej = int(out.stats.accepted.sum()), int(out.stats.rejected.sum())
    alpha, n = rates[0], acc + rej
    assert n > 0
    if alpha in (0.0, 1.0):
      assert (acc, rej) == ((0, n) if alpha == 0 else (n, 0))
    else:
      assert n > 200 and abs(acc / n - alpha) < 4 * (alpha * (1 - alpha) / n) ** 0.5, (acc, n)


@pytest.mark.slow
def test_steered_tree_is_exact_and_wins_by_rank(steered):
  """tree_speculative_decode with the steered draft over the best tree for
  α 0.75 reproduces the baseline token for token, and accepted nodes are
  first children far more often than second ones (rates 0.75 vs 0.094)."""
  from specdec_jax.decoding import tree_speculative_decode
  from lab import trees
  from lab.bench.steered import SteeredDraft
  from specdec_jax.tree import TreeShape
  tmodel, tparams, draft, inputs, ref, greedy = steered
  rates = trees.scaled_rates(0.75)
  tree = TreeShape.from_acceptance(rates, 12, 4)
  out = tree_speculative_decode(tmodel, tparams, SteeredDraft.build(draft, ref, rates, seed=3),
                                inputs, jax.random.PRNGKey(0), tree=tree,
                                max_decode_len=STEER_LEN, sampling=greedy, eos_id=-1)
  np.testing.assert_array_equal(out.tokens, ref)
  ranks = np.asarray(out.stats.rank_hist).sum(0)
  assert ranks[0] > 4 * ranks[1] > 0, ranks


def test_winning_rank_follows_the_rates():
  """One coin per depth picks the rank whose child holds the target's token
  with probability rates[k] (none past their sum): frequencies over 10000
  coins within 4 standard errors (a fixed seed)."""
  from lab.bench.steered import steer_coins, winning_rank
  rates = np.array([0.6, 0.2, 0.1])
  coins = steer_coins(jax.random.PRNGKey(0), np.arange(10000, dtype=np.int32)[None])
  got = np.bincount(np.asarray(winning_rank(coins, rates))[0], minlength=4) / 10000
  want = np.append(rates, 1 - rates.sum())
  assert np.all(np.abs(got - want) < 4 * np.sqrt(want * (1 - want) / 10000)), (got, want)
  # The same (seed, row, position), the same coin.
  again = steer_coins(jax.random.PRNGKey(0), np.array([[5, 7]], np.int32))
  np.testing.assert_array_equal(again[0], coins[0, [5, 7]])


def test_steered_draft_refuses_sampling_and_bad_rates(tiny_draft):
  from specdec_jax.drafts import T5Draft
  from lab.bench.steered import SteeredDraft
  from specdec_jax.sampling import SamplingConfig
  dmodel, dparams = tiny_draft
  draft, ref = T5Draft(params=dparams, model=dmodel), np.zeros((1, 8), np.int32)
  with pytest.raises(ValueError, match="sum <= 1"):
    SteeredDraft.build(draft, ref, [0.8, 0.3])
  d = SteeredDraft.build(draft, ref, [0.5])
  assert d.vocab_size == dmodel.config.vocab_size
  for propose in (d.propose, lambda *a: d.propose_tree(*a[:3], None, *a[4:])):
    with pytest.raises(ValueError, match="temperature 0 only"):
      propose(None, None, None, 3, SamplingConfig(temperature=1.0), None)
