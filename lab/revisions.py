"""The kernel against an older revision: Algorithm 1 (``speculative_sampling``)
and standardized sampling (paper §2.2, §2.3) as they were at a git revision,
loaded through ``git show`` and timed beside the current code in one process
on the same inputs, with a check that the kernel's outputs are identical."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from specdec_jax import sampling as sampling_lib
from specdec_jax import speculative as speculative_lib
from specdec_jax.sampling import SamplingConfig, standardize
from specdec_jax.scripting.script_args import markdown_header
from specdec_jax.timing import interleaved_medians_ms, repeat

from lab.common import load_average, pick

REPO = Path(__file__).resolve().parents[1]   # the checkout this lab/ is in


def modules_at(rev: str) -> tuple[ModuleType, ModuleType]:
  """``sampling.py`` and ``speculative.py`` as they were at git revision
  ``rev``, loaded as private modules; the old kernel calls the old sampler."""
  mods = []
  for name in ("sampling", "speculative"):
    src = subprocess.run(["git", "show", f"{rev}:specdec_jax/{name}.py"], check=True,
                         capture_output=True, text=True, cwd=REPO).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
      f.write(src)
    mod_name = f"_{name}_at_{rev.replace('-', '_').replace('~', '_')}"
    spec = importlib.util.spec_from_file_location(mod_name, f.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    os.remove(f.name)  # the module is loaded; the source file is not needed again
    mods.append(mod)
  old_sampling, old_speculative = mods
  for fn in ("argmax", "sample_any", "sample", "standardize"):  # rebind to that revision's
    if hasattr(old_speculative, fn) and hasattr(old_sampling, fn):
      setattr(old_speculative, fn, getattr(old_sampling, fn))
  return old_sampling, old_speculative


@functools.partial(jax.jit, static_argnames=("mods", "temperature", "n"))
def _acceptance_loop(key, xs, q, logits, mods: tuple, temperature: float, n: int):
  """n runs of standardize(logits) + speculative_sampling, as a round makes them."""
  samp, spec = mods
  config = samp.SamplingConfig(temperature=temperature)

  def body(i, carry):
    p = samp.standardize(pick(logits, i), config)
    return carry, spec.speculative_sampling(jax.random.fold_in(key, i), pick(xs, i), pick(q, i),
                                            p, 1.0, config.greedy)
  return repeat(body, (), n)[1]


@functools.partial(jax.jit, static_argnames=("samp", "n"))
def _draw_loop(key, logits, samp: ModuleType, n: int):
  """n runs of softmax + sample_any on one row, as a draft step at T > 0."""
  def body(i, carry):
    probs = jax.nn.softmax(pick(logits, i), axis=-1)
    return carry, (samp.sample_any(jax.random.fold_in(key, i), probs), probs[0, 0])
  return repeat(body, (), n)[1]


def compare_acceptance(rev: str, vocab_size: int, gammas: Sequence[int],
                       temperatures: Sequence[float], inner: int = 64,
                       repeats: int = 30) -> list[dict]:
  """µs per call of standardize p + kernel, and of softmax + sample_any, for
  the code at ``rev`` and the current code, timed interleaved in one process
  on the same random inputs (batch 1, γ+1 logits rows of ``vocab_size``);
  also whether the kernel's four outputs are identical for the same key."""
  mods = {"rev": modules_at(rev), "now": (sampling_lib, speculative_lib)}
  fns: dict[tuple, Callable[[], Any]] = {}
  same: dict[tuple, list[bool]] = {}
  for temperature in temperatures:
    config = SamplingConfig(temperature=temperature)
    for gamma in gammas:
      key = jax.random.PRNGKey(gamma)
      logits = 4 * jax.random.normal(jax.random.PRNGKey(1), (2, 1, gamma + 1, vocab_size))
      q_logits = logits[:, :, :gamma] + jax.random.normal(jax.random.PRNGKey(2),
                                                          (2, 1, gamma, vocab_size))
      q = jax.vmap(lambda x: standardize(x, config))(q_logits)
      xs = jnp.stack([jax.vmap(lambda row, k: sampling_lib.sample(k, row, config))(
          q[j, 0], jax.random.split(jax.random.fold_in(key, j), gamma))[None] for j in range(2)])
      outs = {}
      for name, (samp, spec) in mods.items():
        fns[(temperature, gamma, name)] = functools.partial(
            _acceptance_loop, key, xs, q, logits, (samp, spec), temperature, inner)
        p = samp.standardize(logits[0], samp.SamplingConfig(temperature=temperature))
        outs[name] = spec.speculative_sampling(key, xs[0], q[0], p, 1.0, config.greedy)
      same[(temperature, gamma)] = [bool(jnp.array_equal(a, b))
                                    for a, b in zip(outs["rev"], outs["now"])]
  rows = jax.random.normal(jax.random.PRNGKey(3), (2, 1, vocab_size))
  for name, (samp, _) in mods.items():
    fns[("draw", name)] = functools.partial(_draw_loop, jax.random.PRNGKey(4), rows, samp, inner)
  us = {k: 1e3 * ms for k, ms in interleaved_medians_ms(fns, repeats, inner).items()}
  result = [dict(what="standardize p + kernel", temperature=t, gamma=g, rev_us=us[(t, g, "rev")],
                 now_us=us[(t, g, "now")], identical=same[(t, g)])
            for t in temperatures for g in gammas]
  result.append(dict(what="softmax + sample_any (one row)", temperature=None, gamma=None,
                     rev_us=us[("draw", "rev")], now_us=us[("draw", "now")], identical=None))
  return result


def report(rev: str, vocab_size: int, gammas: Sequence[int],
           temperatures: Sequence[float]) -> None:
  """``scripts/compare_revision.py``: prints ``compare_acceptance`` as a table."""
  print(f"# {rev} vs working tree: V={vocab_size}, batch 1, 64 calls per timed jit call, 30 "
        f"interleaved repeats (medians); load average {load_average()}\n")
  print(markdown_header(["piece", "T", "γ", f"{rev} µs", "now µs", "change",
                         "kernel outputs identical (n, next, accepted, min_pq)"]))
  for r in compare_acceptance(rev, vocab_size, gammas, temperatures):
    t = "" if r["temperature"] is None else f"{r['temperature']:g}"
    g = "" if r["gamma"] is None else r["gamma"]
    same = "" if r["identical"] is None else ", ".join(map(str, r["identical"]))
    print(f"| {r['what']} | {t} | {g} | {r['rev_us']:.1f} | {r['now_us']:.1f} "
          f"| {100 * (r['now_us'] / r['rev_us'] - 1):+.0f}% | {same} |")
  print(f"\nload average at end {load_average()}")
