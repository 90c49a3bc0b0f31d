"""Shared fixtures: tiny random T5 models (small shapes, so tests compile fast).

Session-scoped so that every test reuses the same params, and jitted functions
called with the same static arguments and shapes compile once per session.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# lab/ (the studies and benchmarks, not installed) is imported from the
# repository root, after the installed package.
REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:
  sys.path.append(REPO_ROOT)
# One persistent compilation cache for the session, shared with the runner and
# scripts that tests start as subprocesses (they inherit the environment): a
# program compiled once is loaded, not recompiled, by the next process. Fresh
# per session, so nothing outlives the run.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      tempfile.mkdtemp(prefix="specdec_jax_tests_jit_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Tiny models: compiling is most of the suite's time. Three settings halve the
# CPU time of XLA:CPU's compiles: LLVM without its optimization passes,
# fusions emitted straight to LLVM IR rather than through XLA's MLIR fusion
# emitters, and code generated in one piece (two workers already fill the
# two cores; splitting a module for parallel codegen only adds work). Every
# comparison in the suite is between programs compiled the same way
# (subprocesses inherit the settings), so what a test asserts (token for
# token, bit for bit between two paths, a distribution) is checked under one
# compiler, as before; only the bits of a single program's output differ from
# a default build's. SPECDEC_TEST_DEFAULT_XLA=1 runs the default compiler.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                "--xla_cpu_parallel_codegen_split_count=1")
if os.environ.get("SPECDEC_TEST_DEFAULT_XLA") != "1":
  os.environ["XLA_FLAGS"] = " ".join(
      [os.environ.get("XLA_FLAGS", "")]
      + [f for f in FAST_COMPILE if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from specdec_jax.models.t5 import T5Config, T5Model  # noqa: E402

TINY = T5Config(vocab_size=64, d_model=32, num_heads=4, head_dim=8, num_encoder_layers=2,
                num_decoder_layers=2, d_ff=48)


# XLA:CPU loads each compiled kernel into its own memory mappings, and freed
# executables give them back only when jax's caches drop them. The whole suite
# in one process compiles enough to pass Linux's default vm.max_map_count
# (65530), and the next compile then dies with SIGSEGV inside
# backend_compile. Above this many mappings the caches are cleared (shared
# jit compilations are rebuilt on next use, which is cheap at these sizes).
MAX_MAPPINGS = 30_000


def mapped_regions() -> int:
  """Memory mappings of this process (0 where /proc is not available)."""
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


# What specdec_jax.storage writes into os.environ when STORAGE_EMULATOR_HOST
# is set. A test's monkeypatch cannot undo values set after it ran, so they
# would outlive the test and point later tests' subprocesses at its emulator.
STORAGE_DERIVED = ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")


@pytest.fixture(autouse=True)
def _restore_storage_environment():
  before = {k: os.environ.get(k) for k in STORAGE_DERIVED}
  yield
  for k, v in before.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v


@pytest.fixture(autouse=True)
def _release_compiled_code():
  yield
  if mapped_regions() > MAX_MAPPINGS:
    jax.clear_caches()
    gc.collect()


def sharpen(params, scale: float = 8.0):
  """Scale the output layer so argmax has clear margins (no float near-ties)."""
  params = jax.tree_util.tree_map(lambda x: x, params)
  params["decoder"]["logits_dense"]["kernel"] = params["decoder"]["logits_dense"]["kernel"] * scale
  return params


@pytest.fixture(scope="session")
def tiny_target():
  model = T5Model(TINY)
  return model, sharpen(model.init(jax.random.PRNGKey(0)))


@pytest.fixture(scope="session")
def tiny_draft():
  model = T5Model(TINY.replace(num_encoder_layers=1, num_decoder_layers=1))
  return model, sharpen(model.init(jax.random.PRNGKey(7)))


@pytest.fixture(autouse=True)
def _no_gin_bindings_leak():
  """gin bindings are process-global: one test's (e.g. a runner config binding
  Experiment.adaptive) must not change the defaults another test's
  ``Experiment(...)`` is built with."""
  yield
  import gin  # pylint: disable=g-import-not-at-top
  gin.clear_config()


# The slow tier (python -m pytest -m "not slow" skips it): whole files that run
# the runner or a script end to end, execute notebooks, start subprocesses or
# several processes, compile for TPU topologies, train, or run research studies,
# and the adaptive rules' behaviour (their exactness is in the matrix).
# Everything else is the fast tier, which still checks every exactness property
# once (tests/test_exactness*.py, the kernels' own tests) and every validation
# at one layer. Single slow tests in fast files carry @pytest.mark.slow.
SLOW_FILES = frozenset({
    "test_accounting.py", "test_adaptive.py", "test_bench_accelerator.py", "test_bench_vs_hf.py",
    "test_distill.py", "test_distill_dry_run.py", "test_dry_run.py", "test_gcs.py",
    "test_loading.py", "test_multihost.py", "test_notebooks.py", "test_partitioning.py",
    "test_prepare_data.py", "test_profile.py", "test_readme.py", "test_run.py",
    "test_scripts.py", "test_sharded_checkpoints.py", "test_sharded_distill.py",
    "test_sweep.py", "test_t5_1_0.py", "test_train_smoke.py",
})


# The files that take longest on 2 cores, longest first. xdist hands out
# whole files in collection order (--no-loadscope-reorder), so these start
# first and the short files fill in around them; without this, the longest
# file could start last and run alone at the end.
LONGEST_FIRST = (
    "test_tpu_page.py", "test_bench_accelerator.py", "test_partitioning.py",
    "test_multihost.py", "test_run.py", "test_adaptive.py", "test_fixed_positions.py",
    "test_distill.py", "test_dry_run.py", "test_exactness_sampling.py",
    "test_research_replay.py", "test_kernels.py", "test_tree_dynamic.py",
    "test_block_draft.py", "test_sharded_distill.py", "test_workdir_lock.py",
    "test_run_table2.py", "test_research_probes.py", "test_scripts.py", "test_exactness.py",
)


def pytest_collection_modifyitems(config, items):
  for item in items:
    if item.path.name in SLOW_FILES or item.path.name.startswith("test_research_"):
      item.add_marker(pytest.mark.slow)
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
