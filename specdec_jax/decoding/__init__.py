"""Decoding loops, each one jitted ``lax.while_loop`` over a fixed-shape state:
``baseline.temperature_sample`` (one target call per token),
``chain.speculative_decode`` (Algorithm 1, §2.3, fixed or adaptive γ) and
``tree.tree_speculative_decode`` (token trees). They reach the target only
through ``models.base.TargetModel`` and the draft through ``drafts.base``."""

from specdec_jax.decoding.adaptive import (ADAPTIVE_RULES, CONFIDENCE_RULES, CONFIDENCES,
                                           AdaptiveConfig)
from specdec_jax.decoding.baseline import BASELINE_STATIC, DecodeOutput, temperature_sample
from specdec_jax.decoding.chain import (CHAIN_STATIC, SpecOutput, SpecStats, alpha_estimates,
                                        speculative_decode)
from specdec_jax.decoding.state import cache_length
from specdec_jax.decoding.tree import (TREE_STATIC, TreeSpecOutput, TreeStats,
                                       tree_speculative_decode)

# Each loop's static arguments under jax.jit (for recompiling it with other
# compiler options, ``run.programs.with_command_buffers``).
STATIC_ARGNAMES = {temperature_sample: BASELINE_STATIC, speculative_decode: CHAIN_STATIC,
                   tree_speculative_decode: TREE_STATIC}

__all__ = ["ADAPTIVE_RULES", "CONFIDENCE_RULES", "CONFIDENCES", "STATIC_ARGNAMES",
           "AdaptiveConfig", "DecodeOutput", "SpecOutput", "SpecStats", "TreeSpecOutput",
           "TreeStats", "alpha_estimates", "cache_length", "speculative_decode",
           "temperature_sample", "tree_speculative_decode"]
