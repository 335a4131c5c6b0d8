"""The engines hf_sparsemax plugs into: Trainer, TRL, peft, saving and reloading, vLLM.

:mod:`.trainer`: the guard against trainer settings that would train another loss; :mod:`.trl`: TRL's
token outputs under the patched loss; :mod:`.load_marks` / :mod:`.reload`: what a saved folder carries and
the ``from_pretrained`` hook that restores it (peft's learned alphas included); :mod:`.model_card`: the
README written beside a saved folder; :mod:`.vllm`: vLLM's plugins and TRL's vLLM rollouts. ``SWAPS``: the
swaps these engines need, applied after :data:`hf_sparsemax.swaps.SWAPS`. Imports everything below it
(swaps, attention, losses, decoding, mappings, the root's ``settings`` / ``_model``): never ``patch`` (the
reload hook is handed ``patch_model``) or the app.
"""

from .load_marks import AdapterAlphaSwap
from .model_card import ModelCardSwap
from .trainer import TrainerGuardSwap
from .trl import TokenOutputsSwap

TRAINER_GUARD = TrainerGuardSwap()
ADAPTER_ALPHA = AdapterAlphaSwap()
TOKEN_OUTPUTS = TokenOutputsSwap()
MODEL_CARD = ModelCardSwap()

SWAPS = (TRAINER_GUARD, ADAPTER_ALPHA, TOKEN_OUTPUTS, MODEL_CARD)

__all__ = ["SWAPS", "TRAINER_GUARD", "ADAPTER_ALPHA", "TOKEN_OUTPUTS", "MODEL_CARD"]
