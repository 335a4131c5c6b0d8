"""The attention swap point: sparse attention functions that transformers' ``AttentionInterface`` calls.

Above the backends: :mod:`.interface` the function registered under each attention name, its options and the
learned per-head alpha; :mod:`.families` which model families it serves (decided at patch time); :mod:`.routing` the
``kernel`` option; :mod:`.query_scale` learned temperatures and length scales. One folder per backend below them,
each importing only downward: :mod:`.cpu` (the fused C kernel and its build), :mod:`.blocked` (the torch path:
blocks, decoding steps, cache pages, key codes, the growing cache; calls the C kernel), :mod:`.gpu` (Triton
kernels and launchers). Imports :mod:`hf_sparsemax.mappings` (and the root's ``_model``) only: never losses,
decoding, swaps, integrations or the app.
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
