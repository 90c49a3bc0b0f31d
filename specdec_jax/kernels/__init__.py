"""Fused Pallas kernels for the T5 decoder at decode time (``decode_layer``),
selected by ``T5Config.decode_kernel = 'pallas'``; the XLA path of
``specdec_jax.models.t5`` is the reference they are tested against."""

from specdec_jax.kernels.decode_layer import (MAX_BATCH, QUERY_BLOCK, attention,  # noqa: F401
                                              covers, decode, layer, rows_product)
