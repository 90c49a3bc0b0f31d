"""specdec_jax.memory against hand counts, and scripts/plan_memory.py end to end."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from specdec_jax import memory
from specdec_jax.models.t5 import T5Config
from specdec_jax.partitioning import DATA_PARALLEL_RULES, PartitioningError

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "plan_memory.py"

# d=32, 8 heads of 8 (joined_kv 64), d_ff 64, vocab 64: every wide dimension
# divides 8, so on a (1, 8) mesh each sharded array is exactly 1/8 per device.
D, V, H, DH, FF = 32, 64, 8, 8, 64
TARGET = T5Config(vocab_size=V, d_model=D, num_heads=H, head_dim=DH, num_encoder_layers=1,
                  num_decoder_layers=2, d_ff=FF)
DRAFT = T5Config(vocab_size=V, d_model=16, num_heads=2, head_dim=8, num_encoder_layers=1,
                 num_decoder_layers=1, d_ff=32)


def _hand_params(kernel_bytes: int, model: int) -> int:
  """TARGET's weights per device: wide dims split ``model`` ways, norms whole."""
  inner = H * DH
  enc = 4 * D * inner + 3 * D * FF              # q, k, v, out; wi_0, wi_1, wo
  dec = 8 * D * inner + 3 * D * FF              # self and cross attention; MLP
  kernels = 2 * V * D + enc * 1 + dec * 2       # embedding + logits_dense + layers
  relpos = 2 * H * 32                           # ('heads', 'relpos_buckets'), f32
  norms = (2 * 1 + 1) * D + (3 * 2 + 1) * D     # per-layer norms + final norms, f32
  return kernels * kernel_bytes // model + relpos * 4 // model + norms * 4


def test_one_kernel_sharded_eight_ways():
  part = memory.planning_partitioner((1, 8))
  assert memory._shard_bytes(part, ("embed", "joined_kv"), (32, 64), "float32", "q") == \
      32 * 64 * 4 // 8


@pytest.mark.parametrize("param_dtype,kernel_bytes", [("float32", 4), ("bfloat16", 2)])
def test_plan_matches_hand_count(param_dtype, kernel_bytes):
  b, s, t, g = 2, 16, 10, 3
  got = memory.plan(TARGET, None, (1, 8), param_dtype=param_dtype, dtype="float32", batch=b,
                    max_input_len=s, max_decode_len=t, gamma=g)
  cache_len = t + g + 1
  # Per decoder layer: self K, V [b, cache_len, H, DH] and cross K, V [b, s, H, DH],
  # heads split 8 ways; the encoder mask [b, s] bool is replicated (data = 1).
  caches = 2 * (2 * b * cache_len * H * DH + 2 * b * s * H * DH) * 4 // 8 + b * s
  assert got == dict(target_params=_hand_params(kernel_bytes, 8), draft_params=0,
                     target_caches=caches, draft_caches=0,
                     total=_hand_params(kernel_bytes, 8) + caches)


def test_unsharded_equals_full_size():
  one = memory.plan(TARGET, None, None, batch=2, max_input_len=16, max_decode_len=10, gamma=3)
  assert one["target_params"] == _hand_params(4, 1)


def test_draft_is_replicated_and_batch_split_by_default():
  kw = dict(batch=4, max_input_len=16, max_decode_len=10, gamma=3)
  alone = memory.plan(TARGET, DRAFT, None, **kw)
  sharded = memory.plan(TARGET, DRAFT, (2, 4), **kw)
  # DATA_PARALLEL_RULES: every draft weight whole on every device (heads = 2
  # would not even divide model = 4), its caches split over data = 2 only.
  assert sharded["draft_params"] == alone["draft_params"]
  assert sharded["draft_caches"] * 2 == alone["draft_caches"]
  # The target's K/V split 8 ways (batch on data, heads on model); its encoder
  # mask [4, 16] bool has no heads, so only 2 ways.
  mask = 4 * 16
  assert sharded["target_caches"] == (alone["target_caches"] - mask) // 8 + mask // 2
  explicit = memory.plan(TARGET, DRAFT, (2, 4), draft_rules=DATA_PARALLEL_RULES, **kw)
  assert explicit == sharded
  assert sharded["total"] == sum(v for k, v in sharded.items() if k != "total")


def test_indivisible_dimension_errors_with_its_name():
  odd = TARGET.replace(vocab_size=66)  # 66 % 4 != 0
  kw = dict(batch=1, max_input_len=16, max_decode_len=10, gamma=3)
  with pytest.raises(PartitioningError,
                     match=r"parameter (token_embedder/embedding|decoder/logits_dense/kernel): "
                           r"dimension 'vocab' of size 66 .* mesh axis 'model' of size 4"):
    memory.plan(odd, None, (1, 4), **kw)
  # The draft under the standard rules: its 2 heads do not divide model = 4.
  with pytest.raises(PartitioningError, match=r"'heads' of size 2"):
    memory.plan(TARGET, DRAFT, (1, 4), draft_rules=memory.STANDARD_RULES, **kw)
  # A batch of 1 cannot be split over data = 2.
  with pytest.raises(PartitioningError, match=r"target cache self_k\[0\]: dimension 'batch'"):
    memory.plan(TARGET, None, (2, 4), **kw)


def test_replicate_fallback_counts_the_whole_dimension():
  odd = TARGET.replace(vocab_size=66)
  kw = dict(batch=1, max_input_len=16, max_decode_len=10, gamma=3)
  got = memory.plan(odd, None, (1, 4), fallback="replicate", **kw)
  even = memory.plan(TARGET, None, (1, 4), **kw)
  # Embedding and logits_dense ([66, D] and [D, 66]) whole instead of [64, D] / 4.
  assert got["target_params"] - even["target_params"] == 2 * 66 * D * 4 - 2 * V * D * 4 // 4


def _load_script():
  from lab import plan_memory
  return plan_memory


def test_table2_settings_read_from_the_configs():
  tasks = _load_script().table2_settings(REPO / "configs" / "table2")
  assert tasks["wmt_ende"]["max_input_len"] == 512
  assert tasks["wmt_ende"]["max_decode_len"] == 128
  assert tasks["cnn_dailymail"]["max_decode_len"] == 256
  assert tasks["wmt_ende"]["gamma"] == {"t5_1_1_small": 7, "t5_1_1_base": 7, "t5_1_1_large": 7}
  assert tasks["cnn_dailymail"]["gamma"]["t5_1_1_large"] == 3
  assert tasks["wmt_ende"]["target"] == "t5_1_1_xxl"


@pytest.mark.slow
def test_script_prints_the_xxl_rows():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, str(SCRIPT), "--targets=t5_1_1_xxl",
                        "--drafts=t5_1_1_small", "--batch_sizes=1"],
                       capture_output=True, text=True, env=env, timeout=300, check=True).stdout
  # T5 1.1 XXL bf16 weights on a (1, 4) mesh: 20.74 GiB / 4.
  assert re.search(r"target XXL\s+\|\s+20\.74\s+41\.48 \|\s+5\.19\s+10\.37", out), out
  rows = [l for l in out.splitlines() if l.startswith("XXL    small  bf16        1 |")]
  assert len(rows) == 2, out  # one per task
  assert all(l.count(" ok") == 5 for l in rows), rows


_REAL_PLACEMENT = r"""
import json, sys
import jax, jax.numpy as jnp
from specdec_jax import memory, partitioning
from lab.common import cast_params
from specdec_jax.models.t5 import T5Config, T5Model

cfg = T5Config(**json.loads(sys.argv[1]))
part = partitioning.from_settings((2, 4))
model = T5Model(cfg)
params = cast_params(model.init(jax.random.PRNGKey(0)), "bfloat16")
params = jax.device_put(params, part.param_shardings(params))
inputs = part.shard_batch(jnp.ones((4, 16), jnp.int32))

@jax.jit
def caches(params, inputs):
  cache = model.init_cache(params, model.encode(params, inputs), inputs, 14)
  return partitioning.constrain_cache(cache, part, "target cache")

def on_device0(tree):
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree_util.tree_leaves(tree)
             for s in x.addressable_shards if s.device == dev)

print(json.dumps([on_device0(params), on_device0(caches(params, inputs)),
                  memory.plan(cfg, None, (2, 4), "bfloat16", cfg.dtype, 4, 16, 10, 3)]))
"""


@pytest.mark.slow
def test_plan_equals_bytes_placed_on_a_real_mesh():
  """On 8 host devices, the runner's own placement holds what the plan says."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                        + " --xla_force_host_platform_device_count=8"))
  cfg = json.dumps(dataclasses.asdict(TARGET.replace(dtype="bfloat16")))
  out = subprocess.run([sys.executable, "-c", _REAL_PLACEMENT, cfg], capture_output=True,
                       text=True, env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  params, caches, plan = json.loads(out.stdout.strip().splitlines()[-1])
  assert (params, caches) == (plan["target_params"], plan["target_caches"])
