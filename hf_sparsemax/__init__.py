"""hf_sparsemax: sparse attention, sparse training losses and matching decoding for transformers."""

try:
    import torch  # noqa: F401  (a declared dependency; checked first so its absence reads as what it is)
except ModuleNotFoundError as error:  # pragma: no cover - exercised in a bare interpreter only
    raise ModuleNotFoundError(
        "hf_sparsemax needs PyTorch, which is not installed in this Python: install it first (CPU: "
        "`pip install torch==2.13.0`, or the build for your accelerator from pytorch.org), then hf_sparsemax",
        name="torch",
    ) from error

from .attention import LearnedAlpha, register_attention, supported_families
from .conversion import AlphaScheduleCallback, SelfDistillation, distillation_trainer, transfer_attention
from .losses import (
    Entmax15Loss,
    EntmaxBisectLoss,
    FusedHeadLoss,
    SparsemaxLoss,
    SparseSoftmaxLoss,
    am_softmax_loss,
    entmax15_loss,
    entmax_bisect_loss,
    fused_head_loss,
    mapping_loss,
    normmax_bisect_loss,
    perturb_max_loss,
    sparse_softmax_loss,
    sparsemax_bisect_loss,
    sparsemax_loss,
    taylor_softmax_loss,
)
from .decoding import (
    EntmaxLogitsProcessor,
    MappingLogitsProcessor,
    SparsemaxLogitsProcessor,
    SparseSoftmaxLogitsProcessor,
    decoding_report,
    logits_processors,
)
from .patch import compute_loss_func, patch_model, unpatch_model
from .swaps.calibration import calibrate_attention
from .attention.query_scale import HeadTemperature, LengthScale, query_scale_parameters
from .attention.blocked.growing_cache import GrowingCache
from .integrations.reload import install_load_hook
from .integrations.vllm import vllm_generation_kwargs
from .mappings import budget_bisect, entmax15, entmax_bisect, normmax_bisect, perturb_max, sparse_softmax, sparsemax
from .mappings import sparsemax_bisect, taylor_softmax
from .mappings.modules import (  # generated from the registry of mappings: one module per mapping and per loss
    AMSoftmax,
    AMSoftmaxLoss,
    BudgetBisect,
    Entmax15,
    EntmaxBisect,
    NormmaxBisect,
    NormmaxBisectLoss,
    PerturbMax,
    PerturbMaxLoss,
    SparseSoftmax,
    Sparsemax,
    SparsemaxBisect,
    SparsemaxBisectLoss,
    TaylorSoftmax,
    TaylorSoftmaxLoss,
)

__version__ = "0.1.0"

register_attention()  # every attention of the registry ("sparsemax", "entmax15", ...) becomes an attn_implementation name
install_load_hook(patch_model)  # from_pretrained restores a saved sparse model (hf_sparsemax.integrations.reload)

__all__ = [
    "LearnedAlpha",
    "AlphaScheduleCallback",
    "SelfDistillation",
    "distillation_trainer",
    "HeadTemperature",
    "LengthScale",
    "calibrate_attention",
    "transfer_attention",
    "query_scale_parameters",
    "supported_families",
    "Entmax15Loss",
    "EntmaxLogitsProcessor",
    "MappingLogitsProcessor",
    "SparsemaxLogitsProcessor",
    "SparseSoftmaxLogitsProcessor",
    "decoding_report",
    "logits_processors",
    "compute_loss_func",
    "patch_model",
    "unpatch_model",
    "EntmaxBisectLoss",
    "FusedHeadLoss",
    "fused_head_loss",
    "SparseSoftmaxLoss",
    "SparsemaxLoss",
    "entmax15",
    "entmax15_loss",
    "entmax_bisect",
    "entmax_bisect_loss",
    "mapping_loss",
    "am_softmax_loss",
    "perturb_max",
    "perturb_max_loss",
    "taylor_softmax_loss",
    "sparse_softmax",
    "sparse_softmax_loss",
    "sparsemax",
    "sparsemax_loss",
    "taylor_softmax",
    "budget_bisect",
    "normmax_bisect",
    "normmax_bisect_loss",
    "sparsemax_bisect",
    "sparsemax_bisect_loss",
    "AMSoftmax",
    "AMSoftmaxLoss",
    "BudgetBisect",
    "Entmax15",
    "EntmaxBisect",
    "NormmaxBisect",
    "NormmaxBisectLoss",
    "PerturbMax",
    "PerturbMaxLoss",
    "SparseSoftmax",
    "Sparsemax",
    "SparsemaxBisect",
    "SparsemaxBisectLoss",
    "TaylorSoftmax",
    "TaylorSoftmaxLoss",
    "vllm_generation_kwargs",
    "GrowingCache",
]
