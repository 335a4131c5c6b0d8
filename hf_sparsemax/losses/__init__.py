"""The loss swap point: a loss by its registered name, and the fused output-head loss.

:mod:`.names`: a name and its options -> the loss, the distribution it trains, the generic mapping loss;
:mod:`.fused`: the loss from the hidden states without the ``[tokens, vocab]`` logits; :mod:`.fused_heads`:
the per-family head transforms (a table) it applies; :mod:`.cosine_head`: AM-softmax's cosine head. The
loss functions themselves are maths and live with their mappings (:mod:`hf_sparsemax.mappings.loss_functions`,
``likelihood``, ``margin``), where the registry names them; they are re-exported here. Imports
:mod:`hf_sparsemax.mappings` and the root's ``_model`` only.
"""

from ..mappings.likelihood import perturb_max_loss, taylor_softmax_loss
from ..mappings.loss_functions import (
    Entmax15Loss,
    EntmaxBisectLoss,
    SparsemaxLoss,
    SparseSoftmaxLoss,
    entmax15_loss,
    entmax_bisect_loss,
    normmax_bisect_loss,
    sparse_softmax_loss,
    sparsemax_bisect_loss,
    sparsemax_loss,
)
from ..mappings.margin import am_softmax_loss
from .fused import FusedHeadLoss, fused_head_loss
from .names import loss_mapping, make_loss, mapping_loss

__all__ = ["Entmax15Loss", "EntmaxBisectLoss", "SparsemaxLoss", "SparseSoftmaxLoss", "FusedHeadLoss", "am_softmax_loss", "entmax15_loss", "entmax_bisect_loss", "fused_head_loss",
           "loss_mapping", "make_loss", "mapping_loss", "normmax_bisect_loss", "perturb_max_loss",
           "sparse_softmax_loss", "sparsemax_bisect_loss", "sparsemax_loss", "taylor_softmax_loss"]
