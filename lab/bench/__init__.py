"""The accelerator benchmark (``scripts/bench_gpu.py``, run section by section
by ``scripts/bench_accelerator.sh``): one module per kind of section, shared by
the scripts that time decoding (``bench_decode.py``, ``bench_vk.py``,
``bench_vs_hf.py``).

  common     sizes, random weights, timed pieces, the bandwidth, the output files
  decode     the decode step against the bandwidth bound; v(k) against bare matmuls
  steered    an approximation model whose acceptance is steered to a given α
  loops      the paper's T = 0 rows timed with the real compiled loops
  variants   each kernel variant against the default path
  targets    the targets' and drafts' passes, v(k), c, kernel profiles
  hf         Hugging Face transformers on the same card and weights
  vs_hf      our decoding against Hugging Face's, example by example
  exactness  T = 0 mismatches of speculative decoding by precision
  sections   the sections by name, in the default order
"""
