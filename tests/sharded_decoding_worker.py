"""Run in a subprocess with 8 CPU devices by tests/test_partitioning.py.

Decodes one batch with the baseline and the speculative loop on one device and
on meshes (1, 8), (2, 4), (8, 1), and records what the test asserts on:
tokens per (mesh, sampling), parameter shard shapes, and the per-device shapes
of the caches and any all-gathers in the compiled (SPMD-partitioned) loops.
Usage: python tests/sharded_decoding_worker.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specdec_jax import partitioning  # noqa: E402
from specdec_jax.decoding import (speculative_decode, temperature_sample,  # noqa: E402
                                  tree_speculative_decode)
from specdec_jax.tree import TreeShape  # noqa: E402
from specdec_jax.drafts import T5Draft  # noqa: E402
from specdec_jax.models.t5 import T5Config, T5Model  # noqa: E402
from specdec_jax.sampling import SamplingConfig  # noqa: E402

# 8 heads, vocab 64, d_ff 64: every sharded dimension divides 8.
TARGET = T5Config(vocab_size=64, d_model=32, num_heads=8, head_dim=4, num_encoder_layers=2,
                  num_decoder_layers=2, d_ff=64)
DRAFT = TARGET.replace(d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                       num_decoder_layers=1)
MESHES = [None, (1, 8), (2, 4), (8, 1)]
# T = 1 with top-p: the sampling path, its sort and its mask, under each layout.
SAMPLINGS = {"t0": SamplingConfig(0.0), "t1_topp": SamplingConfig(1.0, topp=0.9)}
BATCH, MAX_LEN, GAMMA = 8, 16, 3


def sharpen(params, scale):
  params = jax.tree_util.tree_map(lambda x: x, params)
  params["decoder"]["logits_dense"]["kernel"] = params["decoder"]["logits_dense"]["kernel"] * scale
  return params


def main(out_dir: str) -> None:
  target, draft_model = T5Model(TARGET), T5Model(DRAFT)
  # Mildly sharpened (T=0 margins stay clear of float reassociation noise).
  tparams = sharpen(target.init(jax.random.PRNGKey(0)), 4.0)
  dparams = sharpen(draft_model.init(jax.random.PRNGKey(1)), 4.0)
  inputs = np.random.default_rng(0).integers(2, TARGET.vocab_size, (BATCH, 12)).astype(np.int32)
  inputs[:, 9:] = 0  # some padding
  key = jax.random.PRNGKey(3)
  tokens, report = {}, {"devices": jax.device_count(), "meshes": {}}
  for mesh in MESHES:
    part = partitioning.from_settings(mesh)
    dpart = partitioning.from_settings(mesh, partitioning.DATA_PARALLEL_RULES,
                                       mesh=part.mesh if part else None)
    tp = jax.device_put(tparams, part.param_shardings(tparams)) if part else tparams
    dp = jax.device_put(dparams, dpart.param_shardings(dparams)) if dpart else dparams
    x = part.shard_batch(inputs) if part else jnp.asarray(inputs)
    draft = T5Draft(dp, draft_model, dpart)
    name = "single" if mesh is None else f"{mesh[0]}x{mesh[1]}"
    kw = dict(max_decode_len=MAX_LEN, eos_id=TARGET.eos_id, partitioner=part)
    for sname, sampling in SAMPLINGS.items():
      base = temperature_sample(target, tp, x, key, sampling=sampling, **kw)
      spec = speculative_decode(target, tp, draft, x, key, gamma=GAMMA, sampling=sampling,
                                **kw)
      tokens[f"{name}/{sname}/baseline"] = np.asarray(base.tokens)
      tokens[f"{name}/{sname}/speculative"] = np.asarray(spec.tokens)
    # A token tree on the mesh (T = 0): the tree pass, its cache moves and the
    # draft's tree expansion under the same layouts.
    tree = tree_speculative_decode(target, tp, draft, x, key, tree=TreeShape.parse("full:2,2"),
                                   sampling=SAMPLINGS["t0"], **kw)
    tokens[f"{name}/t0/tree"] = np.asarray(tree.tokens)
    if part is None:
      continue
    info = {}
    flat = partitioning.flatten_names(tp)
    info["params"] = {n: {"spec": [str(a) for a in a_.sharding.spec],
                          "shape": list(a_.shape),
                          "shard_shapes": sorted({tuple(s.data.shape)
                                                  for s in a_.addressable_shards})}
                      for n, a_ in flat.items()}
    # The compiled loops: per-device cache shapes and any all-gather outputs.
    for fn_name, lowered in (
        ("baseline", temperature_sample.lower(target, tp, x, key, sampling=SAMPLINGS["t0"],
                                              **kw)),
        ("speculative", speculative_decode.lower(target, tp, draft, x, key, gamma=GAMMA,
                                                 sampling=SAMPLINGS["t0"], **kw))):
      hlo = lowered.compile().as_text()
      info[fn_name] = {
          "f32_4d_shapes": sorted(set(re.findall(r"f32\[(\d+,\d+,\d+,\d+)\]", hlo))),
          "all_gather_shapes": sorted(set(re.findall(r"= (\w+\[[\d,]*\])\S* all-gather\(",
                                                     hlo)))}
    report["meshes"][name] = info
  np.savez(os.path.join(out_dir, "tokens.npz"), **tokens)
  with open(os.path.join(out_dir, "report.json"), "w") as f:
    json.dump(report, f)


if __name__ == "__main__":
  main(sys.argv[1])
