"""Decoding loops: the plain T5X-style baseline and speculative decoding.

Each loop is one ``lax.while_loop`` under ``jax.jit`` that runs until every row
has ended — no host round trip per step — over a fixed-shape state whose core
is the rows (``state``: seq, length, done), written as setup, a round (the
``while_loop`` body) and the shared condition and finish. One module a loop:

* ``baseline.temperature_sample``: one target call per token, the baseline;
* ``chain.speculative_decode``: Algorithm 1 (paper §2.3) in a loop, with a
  fixed γ (``chain.ChainLoop``) or an adaptive draft length
  (``adaptive.AdaptiveConfig``, ``adaptive.AdaptiveLoop``);
* ``tree.tree_speculative_decode``: Algorithm 1 over a token tree.

They reach the target model only through ``models.base.TargetModel`` (which
``models.t5.T5Model`` satisfies) and the draft only through the
approximation-model interface of ``drafts.base``.
"""

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
