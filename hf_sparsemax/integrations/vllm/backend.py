"""vLLM's CPU attention backend, computing a folder's saved sparse attention (imported by vLLM, needs vLLM).

:func:`hf_sparsemax.integrations.vllm.plugin.register` points vLLM's ``CPU_ATTN`` backend at
:class:`SparseCPUAttentionBackend` (vLLM's CPU platform always picks ``CPU_ATTN``; the name stays). Its
implementation is vLLM's own for every layer of a folder without hf_sparsemax attention settings (and for
encoder layers): those engines run exactly as before. For the decoder layers of a folder saved with a sparse
attention (``config.json``'s ``hf_sparsemax``: ``attn``, ``attn_options``) it writes the step's keys and
values into the layer's paged cache and attends over them in torch
(:mod:`hf_sparsemax.integrations.vllm.paged_attention`, the registry's row solver of the saved mapping).

Learned alphas. The folder's quantization config (``quant_method: hf_sparsemax``,
:class:`~hf_sparsemax.integrations.vllm.plugin.SparseFolderConfig`) gives each ``Attention`` layer of such a
folder a :class:`SparseAttentionMethod`: it checks that the layer runs this backend, and for ``learn_alpha`` it
adds the layer's ``pre_alpha`` parameter (the checkpoint's ``<attention>.hf_sparsemax_alpha.pre_alpha``,
renamed to ``<attention>.attn.hf_sparsemax_pre_alpha`` by the config's weight mapper; each tensor-parallel
rank takes the slice of its own heads). A layer whose alphas did not load stops the engine with a
``ValueError`` after loading (vLLM itself checks no parameter of a quantized model).

Query scales (``temperature``, ``learn_temperature``, ``length_scale``: :mod:`hf_sparsemax.attention.query_scale`)
multiply the queries before the attention, as transformers does: fixed temperatures from the config (by the
layer's number), learned temperatures and length scales loaded as the learned alphas are (:data:`SCALE_PARAMS`),
each token's length scale at its position in its request.

Weights loaded into a running engine (TRL's colocate weight sync: ``model.load_weights``). The layer computes with
copies of its learned values (alphas as ``1 + sigmoid(pre_alpha)`` in float32, temperatures, length scales), built
by :meth:`SparseCPUAttentionImpl.refresh` from the layer's parameters as they are at the first forward after any of
them loaded (each one's weight loader marks the copies out of date). Not when they load: vLLM's in-place reload
(:mod:`.reload`) processes an attention layer's new values in temporary parameters before it copies them into the
layer's own, in the model's dtype.
"""

from __future__ import annotations

import re

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from ...settings import SparseSettings
from .paged_attention import PagedBatch, QueryScales, SparseAttention, StepPlan, paged_attention, step_plan
from .paged_attention import write_cache

ALPHA_PARAM = "hf_sparsemax_pre_alpha"  # on vLLM's Attention layer: the learned pre-alphas of this rank's heads
CHECKPOINT_ALPHA = re.compile(r"\.hf_sparsemax_alpha\.pre_alpha$")  # the name transformers saves them under
SCALE_PARAMS = {  # on vLLM's Attention layer: learned query scales of this rank's heads <- their checkpoint names
    "hf_sparsemax_log_temperature": re.compile(r"\.hf_sparsemax_temperature\.log_temperature$"),
    **{f"hf_sparsemax_length_{name}": re.compile(rf"\.hf_sparsemax_length_scale\.{name}$")
       for name in ("delta", "beta", "gamma")},
}
PLAN = "hf_sparsemax_plan"  # on a step's attention metadata (one object, built once a step, handed to every layer)


def attention_settings(hf_config) -> SparseSettings | None:
    """A folder's hf_sparsemax settings when they have a sparse attention, else None."""
    settings = SparseSettings.from_config(hf_config)
    return settings if settings is not None and settings.attention_options is not None else None


def current_attention_settings() -> SparseSettings | None:
    """:func:`attention_settings` of the model vLLM is building."""
    model_config = get_current_vllm_config().model_config
    return None if model_config is None else attention_settings(model_config.hf_config)


class SparseCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, or, on the decoder layers of a sparse-attention folder, that attention in torch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings = current_attention_settings() if self.attn_type == AttentionType.DECODER else None
        self.attention: SparseAttention | None = None  # set once the layer's learned alphas loaded (learn_alpha)
        self.query_scales: QueryScales | None = None  # set once the layer's weights loaded (temperature, length)
        self.outdated = True  # the layer's parameters changed since refresh built the two above (see the docstring)
        if self.settings is None:
            return
        unsupported = [name for name, used in (
            ("logits soft-capping", self.logits_soft_cap), ("a sliding window", self.sliding_window != -1),
            ("ALiBi", self.alibi_slopes is not None), ("attention sinks", self.sinks is not None),
            ("an fp8 KV cache", self.is_fp8_kv_cache)) if used]
        if unsupported:
            raise ValueError(f"hf_sparsemax serves {self.settings.attn} attention without {' or '.join(unsupported)}, "
                             "which this model's attention uses: serve it with transformers")

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.settings is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # written by forward, with the step's plan (vLLM calls both with the same keys and values)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if self.settings is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported with hf_sparsemax attention")
        if attn_metadata is None:  # vLLM's warm-up call
            return output
        if self.outdated:
            self.refresh(layer)
        if not attn_metadata.causal or attn_metadata.dynamic_causal is not None:
            raise ValueError(f"{layer.layer_name}: hf_sparsemax serves causal decoder attention only")
        count = attn_metadata.num_actual_tokens
        plan = step_of(attn_metadata, kv_cache, query[:count])
        written = self.kv_sharing_target_layer_name is None and key is not None  # vLLM's condition for an update
        if written:
            write_cache(kv_cache, key, value, plan.batch.slot_mapping, plan)
        rows = query[:count] if self.query_scales is None else self.query_scales.apply(query[:count], plan.batch)
        paged_attention(rows, kv_cache, plan.batch, self.scale, self.attention, output[:count], plan,
                        *((key, value) if written else (None, None)))  # a whole new prompt: its own keys
        return output

    def refresh(self, layer: torch.nn.Module) -> None:
        """Build :attr:`attention` and :attr:`query_scales` from ``layer``'s parameters as they are now (a
        ``ValueError`` naming the layer where a learned one did not load)."""
        alpha = None
        if self.settings.attention_options.learn_alpha:
            pre_alpha = getattr(layer, ALPHA_PARAM)
            if bool(torch.isnan(pre_alpha).any()):
                raise ValueError(f"{layer.layer_name}: this folder's attention learned one alpha per head, and "
                                 "they did not load (no <attention>.hf_sparsemax_alpha.pre_alpha tensor in the "
                                 "checkpoint for this layer)")
            alpha = 1 + torch.sigmoid(pre_alpha.detach().float())
        self.attention = SparseAttention.from_settings(self.settings, alpha)
        self.query_scales = layer_query_scales(layer, self.settings)
        self.outdated = False


def step_of(attn_metadata, kv_cache: torch.Tensor, query: torch.Tensor) -> StepPlan:
    """The step's :class:`StepPlan`, built by its first layer and kept on its attention metadata for the others."""
    batch = PagedBatch(attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.block_table,
                       attn_metadata.slot_mapping)
    plan = getattr(attn_metadata, PLAN, None)
    if plan is None or not plan.serves(batch, kv_cache, query):
        plan = step_plan(batch, kv_cache, query)
        setattr(attn_metadata, PLAN, plan)
    return plan


class SparseCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's ``CPU_ATTN`` backend with :class:`SparseCPUAttentionImpl` (same name, metadata and cache shape)."""

    @staticmethod
    def get_impl_cls() -> type[SparseCPUAttentionImpl]:
        return SparseCPUAttentionImpl


class SparseAttentionMethod(BaseKVCacheMethod):
    """The folder's method for each ``Attention`` layer of a sparse-attention folder: the layer must run
    :class:`SparseCPUAttentionImpl`; a learned alpha becomes a parameter of the layer, checked after loading."""

    def create_weights(self, layer: torch.nn.Module) -> None:
        super().create_weights(layer)  # vLLM's (unused) KV-cache scales, as every such method has
        impl = layer.impl
        if not isinstance(impl, SparseCPUAttentionImpl) or impl.settings is None:
            raise ValueError(f"{layer.layer_name} runs vLLM's {type(impl).__name__}, which computes softmax, not this "
                             "folder's sparse attention: hf_sparsemax serves it on vLLM's CPU backend only")
        options = impl.settings.attention_options
        learned = [ALPHA_PARAM] if options.learn_alpha else []
        learned += ["hf_sparsemax_log_temperature"] if options.learn_temperature else []
        learned += [name for name in SCALE_PARAMS if "length" in name] if options.length_scale else []
        for name in learned:
            param = torch.nn.Parameter(torch.full((layer.num_heads,), float("nan")), requires_grad=False)
            param.weight_loader = own_heads_loader(impl)
            setattr(layer, name, param)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Refuse a layer whose learned values did not load, here rather than at its first request."""
        super().process_weights_after_loading(layer)
        layer.impl.refresh(layer)
        layer.impl.outdated = True  # vLLM's reload calls this on temporary parameters: built again at the forward


def layer_query_scales(layer: torch.nn.Module, settings: SparseSettings) -> QueryScales | None:
    """The query scales of one layer (this rank's heads), from its loaded parameters (learned) or the folder's
    config (fixed temperatures, indexed by the layer's number); None where it scales nothing."""
    options = settings.attention_options
    loaded = {name: getattr(layer, name).detach().float() for name in SCALE_PARAMS if hasattr(layer, name)}
    missing = [name for name, value in loaded.items() if bool(torch.isnan(value).any())]
    if missing:
        raise ValueError(f"{layer.layer_name}: this folder's attention learned query scales ({missing[0]}) that did "
                         "not load (no such tensor in the checkpoint for this layer)")
    temperature = None
    if options.learn_temperature:
        temperature = loaded["hf_sparsemax_log_temperature"].exp()
    elif isinstance(options.temperature, tuple):
        from vllm.distributed import get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        heads, rank = layer.num_heads, get_tensor_model_parallel_rank()
        values = options.temperature[extract_layer_index(layer.layer_name)]
        temperature = torch.tensor(values[rank * heads:(rank + 1) * heads], dtype=torch.float32)
    length = None
    if options.length_scale:
        length = tuple(loaded[f"hf_sparsemax_length_{name}"] for name in ("delta", "beta", "gamma"))
    if temperature is None and length is None:
        return None
    return QueryScales(temperature, length)


def own_heads_loader(impl: SparseCPUAttentionImpl):
    """The weight loader of a layer's learned parameters: :func:`load_own_heads`, then the layer's copies of
    them are out of date (rebuilt at its next forward)."""

    def load_learned(param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
        load_own_heads(param, loaded)
        impl.outdated = True

    return load_learned


def load_own_heads(param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy this tensor-parallel rank's heads of a layer's saved per-head tensor (``pre_alpha``, a learned
    temperature or length scale; all heads) into ``param``."""
    from vllm.distributed import get_tensor_model_parallel_rank

    heads = param.shape[0]
    rank = get_tensor_model_parallel_rank()
    own = loaded.reshape(-1)[rank * heads:(rank + 1) * heads]
    if own.shape != param.shape:
        raise ValueError(f"learned alphas of {loaded.numel()} heads do not hold rank {rank}'s {heads} heads")
    param.data.copy_(own)
