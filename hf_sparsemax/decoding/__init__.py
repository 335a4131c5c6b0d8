"""The decoding swap point: sampling exactly the distribution the loss trained.

:mod:`.generation`: transformers' logits processors, ``logits_processors(model)`` and the matched
``generate``; :mod:`.engine`: what a serving engine samples per request and the batched logits step
(torch only; the vLLM plugin adapts it); :mod:`.decoders`: the comparison of decoders on held-out text.
Imports :mod:`hf_sparsemax.mappings`, :mod:`hf_sparsemax.losses`, :mod:`hf_sparsemax.metrics` and the
root's ``settings`` / ``_model``: never swaps, integrations or the app.
"""

from .generation import (
    EntmaxLogitsProcessor,
    MappingLogitsProcessor,
    SparsemaxLogitsProcessor,
    SparseSoftmaxLogitsProcessor,
    decoding_report,
    logits_processors,
)

__all__ = ["EntmaxLogitsProcessor", "MappingLogitsProcessor", "SparsemaxLogitsProcessor",
           "SparseSoftmaxLogitsProcessor", "decoding_report", "logits_processors"]
