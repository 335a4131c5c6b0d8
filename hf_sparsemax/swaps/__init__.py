"""The swap points of ``patch_model``, in the order they are applied (``unpatch_model`` removes them in reverse).

Each follows the protocol of :mod:`.protocol`: ``plan`` (validate, change
nothing), ``apply``, ``remove``. The order matters where two swaps stack on
one method: the fused forward sits below TRL's token-outputs forward, and the
matched ``generate`` and TRL's outputs read the loss the loss swap set.
"""

from .attention_swap import AttentionSwap
from .cosine_head import CosineHeadSwap
from .fused_forward import FusedForwardSwap
from .generate_swap import MatchedGenerateSwap
from .loss_swap import LossSwap
from .model_card_swap import ModelCardSwap
from .protocol import PatchRequest, Swap
from .token_outputs import TokenOutputsSwap

ATTENTION = AttentionSwap()
FUSED_FORWARD = FusedForwardSwap()
COSINE_HEAD = CosineHeadSwap()
LOSS = LossSwap()
MATCHED_GENERATE = MatchedGenerateSwap()
TOKEN_OUTPUTS = TokenOutputsSwap()
MODEL_CARD = ModelCardSwap()

SWAPS: tuple[Swap, ...] = (ATTENTION, FUSED_FORWARD, COSINE_HEAD, LOSS, MATCHED_GENERATE, TOKEN_OUTPUTS, MODEL_CARD)

__all__ = ["PatchRequest", "Swap", "SWAPS", "ATTENTION", "FUSED_FORWARD", "COSINE_HEAD", "LOSS", "MATCHED_GENERATE",
           "TOKEN_OUTPUTS", "MODEL_CARD"]
