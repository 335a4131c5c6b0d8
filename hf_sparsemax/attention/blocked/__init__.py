"""The torch path: :mod:`.blocks` the memory-bounded blocked attention (threshold kept per row, probabilities
recomputed in backward, keys no query weighs skipped), :mod:`.decode` decoding steps without autograd, :mod:`.pages`
the page summaries that skip cached keys, :mod:`.keycodes` the int8 key certificate's codes, :mod:`.growing_cache`
a transformers cache that appends without copying, :mod:`.step_memo` what a decoding step works out once for all
layers. Imports :mod:`hf_sparsemax.mappings` and the CPU kernel
(:mod:`..cpu`) only.
"""
