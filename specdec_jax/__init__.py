"""specdec_jax: speculative decoding (Leviathan et al., ICML 2023) for T5 in JAX.

Importing this package never imports TensorFlow; only the seqio data path does,
lazily, when a seqio task is asked for.
"""

__version__ = "0.1.0"
