"""The attention swap point: sparse attention functions that transformers' ``AttentionInterface`` calls.

:mod:`.interface`: the function registered under each attention name, its options, the learned per-head
alpha and the family check; :mod:`.blocks`: the memory-bounded blocked path (threshold kept per row,
probabilities recomputed in backward, keys no query weighs skipped); :mod:`.decode`: decoding steps without
autograd (a few query rows against a KV cache); :mod:`.triton_attention` (kernels in ``_triton_kernels``, triton
imported on first use): the same attention in Triton kernels for GPUs; :mod:`.routing`: the ``kernel`` option. Imports :mod:`hf_sparsemax.mappings`
(and the root's ``_model``) only: never losses, decoding, swaps, integrations or the app.
"""

from .interface import (
    ALPHA_ATTR,
    ATTENTION_MAPPINGS,
    ATTENTION_OPTIONS,
    OPTIONS_ATTR,
    AttentionOptions,
    LearnedAlpha,
    register_attention,
    sparse_attention_forward,
)
from .families import supported_families

__all__ = ["ALPHA_ATTR", "ATTENTION_MAPPINGS", "ATTENTION_OPTIONS", "OPTIONS_ATTR", "AttentionOptions", "LearnedAlpha",
           "register_attention", "sparse_attention_forward", "supported_families"]
