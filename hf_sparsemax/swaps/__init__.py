"""How the swap points are applied: one object per swap point, each with ``plan`` / ``apply`` / ``remove``.

Each follows the protocol of :mod:`.protocol`: ``plan`` (validate, change nothing), ``apply``, ``remove``.
``SWAPS`` are the library's own, in the order they are applied (``unpatch_model`` removes them in reverse):
the order matters where two swaps stack on one method (the matched ``generate`` reads the loss the loss swap
set). The swaps an engine needs (Trainer's guard, TRL's token outputs, peft's alphas, the model card) live
with their engine in :mod:`hf_sparsemax.integrations` and follow these. :mod:`.calibration` fits the per-head
temperatures of a swapped attention (``calibrate_attention``). Imports attention, losses, decoding,
mappings and the root's ``settings`` / ``_model``: never integrations or the app.
"""

from .attention_swap import AttentionSwap
from .cosine_head import CosineHeadSwap
from .fused_forward import FusedForwardSwap
from .generate_swap import MatchedGenerateSwap
from .loss_swap import LossSwap
from .protocol import PatchRequest, Swap

ATTENTION = AttentionSwap()
FUSED_FORWARD = FusedForwardSwap()
COSINE_HEAD = CosineHeadSwap()
LOSS = LossSwap()
MATCHED_GENERATE = MatchedGenerateSwap()

SWAPS: tuple[Swap, ...] = (ATTENTION, FUSED_FORWARD, COSINE_HEAD, LOSS, MATCHED_GENERATE)

__all__ = ["PatchRequest", "Swap", "SWAPS", "ATTENTION", "FUSED_FORWARD", "COSINE_HEAD", "LOSS", "MATCHED_GENERATE"]
