"""Sparse attention for transformers models, through transformers' own attention interface.

Every model family that calls ``ALL_ATTENTION_FUNCTIONS.get_interface(...)``
hands its attention to the function registered under
``config._attn_implementation``. This module registers one such function per
mapping (``sparsemax``, ``entmax15``, ``entmax_bisect``, ``sparse_softmax``),
and, under the same name, its mask function (:func:`mask_function`): without
one the model would build no causal and no padding mask at all. As for sdpa,
a plain causal mask (no padding, no window reached) is not built: the model
passes ``None`` and the attention masks the future itself, block by block, as
sdpa's ``is_causal`` does; other masks are transformers' eager masks.

For each head the attention weights are

    p = mapping(softcap(q k^T * scaling) + position_bias + mask)   (+ a sink column, dropped after)

and the output is ``dropout(p) v``. Where a sparse indexer passes the keys each query may see (DeepSeek-V3.2's
``indices``), the others are masked too (:func:`selected_keys`). ``mapping`` is the library's one
implementation of the probability mapping (:mod:`hf_sparsemax.mappings`), so
attention, losses and decoders share it. Masked keys (``-inf`` or
``finfo.min`` in the additive mask) get exactly 0; a query row with every
key masked (a padded position) gets all zeros, never NaN.

Options live on each attention module (set by :func:`hf_sparsemax.patch_model`):
``alpha`` (entmax_bisect), a learned per-head alpha (``LearnedAlpha``,
"Adaptively Sparse Transformers", Correia, Niculae & Martins, 2019),
``top_k`` (sparse_softmax), ``chunk_size`` and ``kernel``. A module without options uses
the defaults: alpha 1.5, no top-k cut, ``kernel="auto"``: a call on CUDA that the Triton kernels serve runs
there (:mod:`.routing`, :mod:`.triton_attention`); everything below is the torch path.

Memory is bounded by default, as sdpa's kernels bound it: queries run in
blocks whose weights ``[B, H, block, kv]`` hold at most
``attention_blocks.ATTENTION_BUDGET`` entries (one block when the whole
``[B, H, q, kv]`` fits; never fewer than ``attention_blocks.MIN_BLOCK_QUERIES``
queries a block, so past ~1800 keys a block holds ``B H 64 kv``), and ``chunk_size`` overrides the block size. The
threshold mappings (sparsemax, entmax15, entmax_bisect) keep one threshold per
query row for backward and recompute the weights from it
(:mod:`hf_sparsemax.attention.blocked.blocks`); the others, and calls with softcapping,
a position bias, sinks or dropout, recompute each block of queries in backward
(activation checkpointing). A decoding step (a few query rows, no gradient wanted) of a threshold mapping takes
:mod:`hf_sparsemax.attention.blocked.decode` instead: one block, nothing kept. Weights are returned only where asked for
(``output_attentions``); under ``torch.compile`` the weights are materialised
unless ``chunk_size`` is set.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import os
import typing
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .blocked.blocks import block_queries, causal_mask, threshold_attention, work_operands
from .blocked.pages import WEIGHTS_ATTR, filled_part, page_summary, take_layer
from .blocked.decode import decode_attention, decoding_step
from .blocked.step_memo import Memo
from .query_scale import check_temperatures, scale_queries, submodule
from .routing import KERNELS, triton_route, wanted
from ..mappings import registry
from ..mappings.entmax import precise_in_float32

ATTENTION_MAPPINGS = registry.names("attention")
QUERY_SCALE_OPTIONS = ("temperature", "learn_temperature", "length_scale")  # .query_scale: every attention takes them
ATTENTION_OPTIONS = {  # options each attention takes (chunk_size: memory-bounded path; learn_alpha: per-head alpha;
    # kernel: which kernels run it, .routing; the query scales)
    name: (*registry.REGISTRY[name].attention_options,
           *(("learn_alpha",) if "alpha" in registry.REGISTRY[name].attention_options else ()), "chunk_size", "kernel",
           *QUERY_SCALE_OPTIONS)
    for name in ATTENTION_MAPPINGS
}
OWN_OPTIONS = ("learn_alpha", "chunk_size", "kernel", *QUERY_SCALE_OPTIONS)  # options of the attention, not its mapping
OPTIONS_ATTR = "hf_sparsemax_attention"  # plain attribute of an attention module: its AttentionOptions
ALPHA_ATTR = "hf_sparsemax_alpha"  # submodule of an attention module: its LearnedAlpha (saved with the weights)
INTERFACE_NAME = "ALL_ATTENTION_FUNCTIONS"

# Keyword arguments the models pass that do not change the math here: masks hold sliding windows and packed
# sequences, is_causal is read where no mask is passed (is_causal()); the rest is bookkeeping for other
# implementations or for the model.
HARMLESS_KWARGS = frozenset(
    {
        "is_causal", "sliding_window", "position_ids", "output_attentions", "deterministic", "use_cache",
        "cache_position", "past_key_values", "past_key_value", "output_hidden_states", "return_dict", "layer_idx",
        "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "query_length", "key_length",
        "use_top_left_mask", "num_items_in_batch", "cross_attention_states",
        "cache", "token_type_ids", "encoder_hidden_states", "encoder_attention_mask", "logits_to_keep",
    }
)

# Keyword arguments the attention applies: sinks by Inkling-2's name (attention_sinks); DeepSeek-V3.2's indexer
# selection (indices: the keys each query may see, selected_keys).
READ_KWARGS = frozenset({"sinks", "indices"})


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Validated options of one sparse attention: the mapping's own options plus the attention's.

    ``options`` is the mapping's options object (see :mod:`hf_sparsemax.mappings.registry`),
    holding only what attention accepts (``ATTENTION_OPTIONS``); ``learn_alpha``
    (mappings with an ``alpha``), ``chunk_size``, ``kernel`` (:mod:`.routing`: "auto", "triton" or "torch")
    and the query scales (:mod:`.query_scale`) belong to attention: ``temperature`` (None / False: none;
    True: 1 for every head; per-layer lists of per-head temperatures, kept as tuples), ``learn_temperature``
    (trainable; implies ``temperature=True`` where none is given) and ``length_scale`` (ASEntmax's learned
    per-position scale).
    """

    mapping: str
    options: typing.Any = None
    learn_alpha: bool = False
    chunk_size: int | None = None
    kernel: str = "auto"
    temperature: typing.Any = None
    learn_temperature: bool = False
    length_scale: bool = False

    def __post_init__(self) -> None:
        entry = registry.attention_entry(self.mapping)
        if self.options is None:
            object.__setattr__(self, "options", entry.options())
        alpha = getattr(self.options, "alpha", None)
        if alpha is not None and (isinstance(alpha, torch.Tensor) or not 1 < alpha <= 2):
            raise ValueError(f"attention alpha must be a float in (1, 2], got {alpha!r}")
        if not isinstance(self.learn_alpha, bool):
            raise ValueError(f"learn_alpha must be True or False, got {self.learn_alpha!r}")
        if self.learn_alpha and alpha is None:
            raise ValueError(f"learn_alpha needs a mapping with an alpha (entmax_bisect), not {self.mapping!r}")
        if self.learn_alpha and alpha == 2:
            raise ValueError("learn_alpha starts from an alpha in (1, 2): alpha = 1 + sigmoid(a) cannot start at 2")
        if self.chunk_size is not None and (
            isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be a positive integer (queries per chunk), got {self.chunk_size!r}")
        if not isinstance(self.kernel, str) or self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {list(KERNELS)}, got {self.kernel!r}")
        for name in ("learn_temperature", "length_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        object.__setattr__(self, "temperature", temperature_option(self.temperature, self.learn_temperature))

    @property
    def scales_queries(self) -> bool:
        """Whether the attention scales its queries (a temperature or a length scale)."""
        return self.temperature is not None or self.length_scale

    @property
    def alpha(self) -> float:
        """The starting / fixed alpha of an entmax attention (1.5 for mappings without one)."""
        return getattr(self.options, "alpha", 1.5)

    @property
    def top_k(self) -> int | None:
        return getattr(self.options, "top_k", None)

    @classmethod
    def from_settings(cls, mapping: str, options: dict[str, typing.Any]) -> "AttentionOptions":
        entry = registry.attention_entry(mapping)
        options = dict(options)
        unknown = sorted(set(options) - set(ATTENTION_OPTIONS[mapping]))
        if unknown:
            raise ValueError(
                f"attn_options {unknown} are not options of attn={mapping!r}; it takes {list(ATTENTION_OPTIONS[mapping])}"
            )
        own = {k: options.pop(k) for k in list(options) if k not in OWN_OPTIONS}
        return cls(mapping=mapping, options=entry.options(**own), **options)


def temperature_option(value: typing.Any, learn: bool) -> bool | tuple[tuple[float, ...], ...] | None:
    """The ``temperature`` option validated: None (none), True (1 per head) or a tuple per layer of per-head
    temperatures (each a finite number > 0); ``learn_temperature`` without one gives True."""
    if value is None or value is False:
        return True if learn else None
    if value is True:
        return True
    if isinstance(value, (str, bytes)) or not isinstance(value, typing.Sequence) or not value:
        raise ValueError("temperature must be True, False / None or a list of per-layer lists of per-head "
                         f"temperatures, got {value!r}")
    return tuple(check_temperatures(layer, f"temperature[{i}]") for i, layer in enumerate(value))


class LearnedAlpha(nn.Module):
    """One trainable alpha per head, ``alpha = 1 + sigmoid(a)`` in (1, 2) (Correia et al., 2019)."""

    def __init__(self, num_heads: int, alpha: float = 1.5) -> None:
        super().__init__()
        start = math.log((alpha - 1) / (2 - alpha))  # sigmoid^-1(alpha - 1)
        self.pre_alpha = nn.Parameter(torch.full((num_heads,), start, dtype=torch.float32))

    def forward(self) -> torch.Tensor:
        """``[1, H, 1, 1]`` alphas, broadcastable to attention scores ``[B, H, q, kv]``."""
        return (1 + torch.sigmoid(self.pre_alpha.float())).view(1, -1, 1, 1)

    def without_grad(self, device: torch.device) -> tuple[torch.Tensor, bool]:
        """``(forward() on device, precise_in_float32 of it)`` for a call that wants no gradient (a decoding step):
        computed again only where ``pre_alpha`` holds other values than when they were computed (compared
        exactly, so a write that no version counter sees, ``pre_alpha.data.copy_``, counts too) or another device
        asks; otherwise the same tensors, so a decoding step's layers skip the ~10 operations of the sigmoid, the
        device move and the range checks (each layer has its own alphas: one held value per module)."""
        held = LEARNED_HELD.get(self)
        pre_alpha = self.pre_alpha.detach()
        if (held is None or held[1] != device or held[0].device != pre_alpha.device
                or held[0].dtype != pre_alpha.dtype or not torch.equal(held[0], pre_alpha)):
            alpha = self().to(device)
            held = (pre_alpha.clone(), device, alpha, precise_in_float32(alpha))
            LEARNED_HELD[self] = held
        return held[2], held[3]


LEARNED_HELD: "weakref.WeakKeyDictionary[LearnedAlpha, tuple]" = weakref.WeakKeyDictionary()  # without_grad's values


def attention_probabilities(module: nn.Module, scores: torch.Tensor, mapping: str) -> torch.Tensor:
    """``mapping(scores)`` along the keys, with the module's options (defaults when it has none)."""
    options = getattr(module, OPTIONS_ATTR, None)
    values = registry.option_values(options.options) if options is not None and options.mapping == mapping else {}
    learned = submodule(module, ALPHA_ATTR)
    if learned is not None:
        values["alpha"] = learned().to(scores.device)
    return registry.REGISTRY[mapping].function(scores, dim=-1, **values)


def check_kwargs(kwargs: dict[str, typing.Any], mapping: str) -> None:
    """Refuse a keyword the model passes that would change the attention and that this path does not apply."""
    for name, value in kwargs.items():
        if name in HARMLESS_KWARGS or name in READ_KWARGS or value is None or value is False:
            continue
        raise ValueError(
            f"{mapping} attention does not know the argument {name!r} this model passes to its attention "
            "function, so it cannot reproduce the model's attention; use attn_implementation='eager' or 'sdpa'"
        )


def attend(module, query, *, key, value, mask, scaling, dropout, softcap, position_bias, sinks, mapping, causal=None):
    """Weights ``[B, H, q, kv]`` and output ``[B, H, q, D]`` for one block of queries (``causal``: the position of
    its first query when ``mask`` is a plain causal mask left to the attention)."""
    if causal is not None:
        mask = causal_mask(causal, causal + query.shape[-2], slice(0, key.shape[-2]), query.dtype, query.device)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        scores = scores + position_bias
    if mask is not None:
        scores = scores + mask
    if sinks is not None:  # one extra logit per head (or per query) that takes part in the mapping, dropped after
        column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        weights = attention_probabilities(module, torch.cat([scores, column], dim=-1), mapping)[..., :-1]
    else:
        weights = attention_probabilities(module, scores, mapping)
    weights = weights.to(value.dtype)
    dropped = nn.functional.dropout(weights, p=dropout, training=module.training) if dropout else weights
    return weights, torch.matmul(dropped, value)


def query_rows(tensor: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """The rows of a per-query operand (mask or bias ``[., ., q, kv]``), broadcast ones left as they are."""
    if tensor is None or tensor.shape[-2] == 1:
        return tensor
    return tensor[..., rows, :]


def sparse_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    *,
    mapping: str,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function contract: ``query [B, H, q, D]``, ``key``/``value [B, H_kv, kv, D]``.

    Returns ``(out [B, q, H, D], weights [B, H, q, kv])``; weights are ``None`` unless asked for
    (:func:`weights_requested`) or materialised anyway (a single block off the threshold path). The module's
    query scales (temperature, length scale: :mod:`.query_scale`) multiply the queries first, before any kernel.
    """
    check_kwargs(kwargs, mapping)
    query = scale_queries(module, query, key, kwargs)
    return scaled_attention_forward(module, query, key, value, attention_mask, scaling, dropout, softcap,
                                    position_bias, s_aux, mapping=mapping, **kwargs)


def scaled_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                             position_bias=None, s_aux=None, *, mapping: str, **kwargs):
    """:func:`sparse_attention_forward` of queries already scaled (the module's query scales not applied again)."""
    s_aux = attention_sinks(s_aux, kwargs.pop("sinks", None), query)
    attention_mask = selected_keys(kwargs.pop("indices", None), attention_mask, module, query, key, kwargs)
    layer = take_layer(module)  # the cache layer of this call (its module's pre-hook found it), or None
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    options = getattr(module, OPTIONS_ATTR, None)
    if wanted(options.kernel if options else "auto", query):
        own = options.options if options is not None and options.mapping == mapping else None
        out = triton_route(module, query, key, value, attention_mask, kernel=options.kernel if options else "auto",
                           mapping=mapping, scaling=scaling, dropout=dropout if module.training else 0.0,
                           softcap=softcap, position_bias=position_bias, sinks=s_aux,
                           causal=is_causal(module, query.shape[-2], attention_mask, kwargs),
                           weights=weights_requested(kwargs, module), options=own,
                           learned=submodule(module, ALPHA_ATTR))
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min
        )
    if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
        attention_mask = attention_mask[..., : key.shape[-2]]  # (the model's own object where it fits: .step_memo)
    chunk = options.chunk_size if options else None
    q_len = query.shape[-2]
    causal = is_causal(module, q_len, attention_mask, kwargs)
    if chunk is None and not torch.compiler.is_compiling():  # memory-bounded by default (eager)
        chunk = block_queries(query.shape[0], query.shape[1], q_len, key.shape[-2], device=query.device)
    blocked = None if weights_requested(kwargs, module) else threshold_path(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, softcap=softcap, position_bias=position_bias,
        sinks=s_aux, mapping=mapping)
    step = blocked is not None and (chunk is None or q_len <= chunk)
    if step and decoding_step(query, key, blocked["alpha"], causal):
        summary = page_summary(layer, key, value, attention_mask)  # tracks the layer's own keys: before the cut
        key, value, attention_mask = filled_part(layer, key, value, attention_mask)  # a static cache's unwritten slots
        out = decode_attention(query, key, value, attention_mask, scaling=scaling, alpha=blocked["alpha"],
                               fixed_alpha=blocked["fixed_alpha"], threshold=blocked["threshold"], pages=summary)
        return out, None
    if blocked is not None:
        out = threshold_attention(query, key, value, attention_mask, causal=causal, scaling=scaling,
                                  block=chunk or q_len, **blocked)
        return out.transpose(1, 2).contiguous(), None
    if key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    extras = dict(scaling=scaling, dropout=dropout, softcap=softcap, mapping=mapping)
    if chunk is None or q_len <= chunk or weights_requested(kwargs, module):
        weights, out = attend(module, query, key=key, value=value, mask=attention_mask, position_bias=position_bias,
                              sinks=s_aux, causal=0 if causal else None, **extras)
        return out.transpose(1, 2).contiguous(), weights
    block = functools.partial(attend, module, key=key, value=value, **extras)

    def run(q_rows, mask_rows, bias_rows, sink_rows, first):
        return block(q_rows, mask=mask_rows, position_bias=bias_rows, sinks=sink_rows, causal=first)[1]

    outputs = []
    for start in range(0, q_len, chunk):
        rows = slice(start, start + chunk)
        operands = (query[..., rows, :], query_rows(attention_mask, rows), query_rows(position_bias, rows),
                    query_rows(s_aux, rows), start if causal else None)
        grad = torch.is_grad_enabled()
        outputs.append(checkpoint(run, *operands, use_reentrant=False) if grad else run(*operands))
    return torch.cat(outputs, dim=-2).transpose(1, 2).contiguous(), None


def attention_sinks(s_aux: torch.Tensor | None, sinks: torch.Tensor | None,
                    query: torch.Tensor) -> torch.Tensor | None:
    """The attention sinks a model passes, by either name transformers' families use (GPT-OSS: ``s_aux``, one
    logit per head ``[H]``; Inkling-2: ``sinks``, one per query ``[B, H, q, 1]``), as one ``[B|1, H, q|1, 1]``
    logit column (None: no sinks); both names at once is refused."""
    if s_aux is not None and sinks is not None:
        raise ValueError("the model passes attention sinks twice (s_aux and sinks): the attention takes one set")
    sinks = s_aux if s_aux is not None else sinks
    if sinks is None:
        return None
    if sinks.dim() == 1:
        sinks = sinks.reshape(1, -1, 1, 1)
    if sinks.dim() != 4 or sinks.shape[-1] != 1 or sinks.shape[1] not in (1, query.shape[1]):
        raise ValueError(f"attention sinks of shape {tuple(sinks.shape)} fit neither [heads] nor [batch, heads, "
                         f"queries, 1] for queries {tuple(query.shape)}")
    return sinks


def selected_keys(indices: torch.Tensor | None, mask: torch.Tensor | None, module: nn.Module, query: torch.Tensor,
                  key: torch.Tensor, kwargs: dict[str, typing.Any]) -> torch.Tensor | None:
    """The attention mask with the keys a sparse indexer did not select masked too (DeepSeek-V3.2's lightning
    indexer: ``indices [B, q, top_k]``, the positions of the keys each query sees; a negative index selects
    nothing, FlashMLA's padding). Exactly what the model's eager attention does with them (its ``index_mask``):
    a key is seen where the mask lets it through and the indexer selected it, so the mapping runs over the
    selected keys only and the others get exactly 0. Without a mask, the causal mask the attention would have
    applied (:func:`is_causal`) is built first. ``indices`` None: the mask as it was."""
    if indices is None:
        return mask
    batch, q_len, kv = query.shape[0], query.shape[-2], key.shape[-2]
    if (indices.dim() != 3 or indices.shape[0] not in (1, batch) or indices.shape[1] != q_len
            or indices.dtype.is_floating_point or indices.dtype == torch.bool):
        raise ValueError(f"indexer indices of shape {tuple(indices.shape)} ({indices.dtype}) are not integer "
                         f"[batch, queries, top_k] for queries {tuple(query.shape)}")
    if indices.numel() and not torch.compiler.is_compiling() and int(indices.max()) >= kv:
        raise ValueError(f"indexer indices select key {int(indices.max())} of {kv} keys")
    slots = torch.where(indices < 0, kv, indices.long())  # padding goes to a spare slot, cut off after
    selected = torch.zeros(*indices.shape[:2], kv + 1, dtype=torch.bool, device=query.device)
    selected = selected.scatter(-1, slots, True)[..., :kv].unsqueeze(1)  # [B, 1, q, kv]
    if mask is None and not is_causal(module, q_len, None, kwargs):
        return selected  # a single query or a non-causal call sees every key: the selection alone
    if mask is None:
        mask = causal_mask(0, q_len, slice(0, kv), query.dtype, query.device)
    mask = mask[..., :kv]
    if mask.dtype == torch.bool:
        return mask & selected
    return mask.masked_fill(~selected, torch.finfo(mask.dtype).min)


def is_causal(module: nn.Module, q_len: int, mask: torch.Tensor | None, kwargs: dict[str, typing.Any]) -> bool:
    """Whether queries see only keys up to their own position without a mask to say so: sdpa's rule (its
    ``is_causal``), as the mask function returns None for a plain causal mask (:func:`mask_function`). The
    ``is_causal`` keyword where the model passes one, else the module's ``is_causal`` (default True); never for a
    single query (decoding sees every cached key)."""
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    return mask is None and q_len > 1 and bool(causal)


def mask_function(*args, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor | None:
    """The mask function registered with every sparse attention: None where sdpa's would be None (a plain causal
    mask, which the attention applies per block; full attention), else transformers' eager mask, additive:
    0 where a key is seen, ``finfo(dtype).min`` where not (arguments as ``transformers.masking_utils.sdpa_mask``)."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if mask is None:
        return None
    return torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min)


def weights_requested(kwargs: dict[str, typing.Any], module: nn.Module | None = None) -> bool:
    """Whether the caller wants the attention weights: ``output_attentions`` passed, given to the attention module
    itself (one that takes it by name and keeps it from its attention function: its pre-hook noted it,
    :data:`.blocked.pages.WEIGHTS_ATTR`), or transformers' output capture (``output_attentions`` on a model whose
    attention modules do not pass it on) recording attentions."""
    if kwargs.get("output_attentions"):
        return True
    if torch.compiler.is_compiling():
        return False
    if getattr(module, WEIGHTS_ATTR, False):
        return True
    collector = output_collector()
    collected = collector.get() if collector is not None else None
    return bool(collected) and any(key.endswith("attentions") for key in collected)


@functools.lru_cache(maxsize=1)
def output_collector():
    """transformers' output-capture context variable, imported once (every layer's call reads it), or None for a
    transformers without output capture (it passes ``output_attentions`` on)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


def threshold_path(module, query, key, value, mask, *, scaling, dropout, softcap, position_bias, sinks, mapping):
    """The arguments of :func:`.attention_blocks.threshold_attention` for this call, or None where it does not apply.

    It applies to the threshold mappings (registry entries with a ``threshold``: sparsemax, entmax15,
    entmax_bisect with every alpha in [1.125, 2], fixed or learned) in float32 / float64, and in bfloat16 /
    float16 computed in float32 (:func:`.attention_blocks.work_operands`), in eager mode, without
    dropout in training, softcapping, a position bias or attention sinks; the other calls take
    :func:`attend` (query chunks recomputed in backward when the weights exceed the budget).
    """
    if (torch.compiler.is_compiling() or softcap is not None or position_bias is not None or sinks is not None
            or (dropout and module.training) or (mask is not None and mask.requires_grad)):
        return None
    learned = submodule(module, ALPHA_ATTR)
    options = getattr(module, OPTIONS_ATTR, None)
    fixed = FIXED_THRESHOLD((options,), (mapping, query.dtype, key.dtype, value.dtype, learned is None))
    if fixed is None:
        return None
    entry, values, fixed_alpha = fixed
    precise = None
    if learned is not None and not torch.is_grad_enabled():  # a decoding step: the layer's alphas held
        alpha, precise = learned.without_grad(query.device)
    else:
        alpha = learned().to(query.device) if learned is not None else None
    if alpha is not None and alpha.shape != (1, query.shape[1], 1, 1):
        return None
    if alpha is not None and query.dtype != torch.float64 and not (
            precise if precise is not None else precise_in_float32(alpha)):
        return None  # the mapping computes such alphas in float64: the materialised path does so

    def reference(query, key, value, mask, alpha):  # the differentiable path, for a double backward
        dtype = query.dtype
        query, key, value, mask = work_operands(query, key, value, mask)  # half precision: in float32, as the kernels
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
        scores = scores if mask is None else scores + mask
        options = dict(values, **({"alpha": alpha} if alpha is not None else {}))
        return torch.matmul(entry.function(scores, dim=-1, **options).to(value.dtype), value).to(dtype)

    return dict(alpha=alpha, fixed_alpha=fixed_alpha, threshold=entry.threshold, reference=reference)


def fixed_threshold(options: AttentionOptions | None, mapping: str, query_dtype: torch.dtype, key_dtype: torch.dtype,
                    value_dtype: torch.dtype, fixed: bool):
    """``(registry entry, option values, fixed alpha)`` of a call of :func:`threshold_path` with these options and
    dtypes (``fixed``: no learned alpha, so the fixed one must be computed exactly in float32), or None where the
    path does not serve them. A function of its arguments only: :data:`FIXED_THRESHOLD` computes it once for all
    the layers sharing one options object (:mod:`.blocked.step_memo`)."""
    entry = registry.REGISTRY[mapping]
    if (entry.threshold is None or query_dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
            or not (query_dtype == key_dtype == value_dtype)):
        return None
    own = options.options if options is not None and options.mapping == mapping else entry.options()
    values, fixed_alpha = registry.option_values(own), entry.fenchel_young_alpha(own)
    if fixed and query_dtype != torch.float64 and not precise_in_float32(fixed_alpha):
        return None  # the mapping computes such alphas in float64: the materialised path does so
    return entry, values, fixed_alpha


FIXED_THRESHOLD = Memo(fixed_threshold)


def attention_function(mapping: str):
    """The function registered with transformers for one mapping."""

    def forward(module, query, key, value, attention_mask, **kwargs):
        return sparse_attention_forward(module, query, key, value, attention_mask, mapping=mapping, **kwargs)

    forward.__name__ = f"{mapping}_attention_forward"
    forward.__qualname__ = forward.__name__
    forward.__doc__ = f"{mapping} attention (see :func:`hf_sparsemax.attention.sparse_attention_forward`)."
    return forward


def register_attention() -> None:
    """Register every sparse attention, and :func:`mask_function` for its masks, under its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for mapping in ATTENTION_MAPPINGS:
        AttentionInterface.register(mapping, attention_function(mapping))
        AttentionMaskInterface.register(mapping, mask_function)


def routes_attention(module_type: type) -> bool:
    """Whether a module class's forward calls transformers' attention interface (read through every decorator:
    transformers 5.25 wraps the attention forwards twice, a kernel hook around ``deprecate_kwarg``)."""
    forward = getattr(module_type, "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if callable(forward) else None
    return code is not None and INTERFACE_NAME in code.co_names


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that compute attention through transformers' interface."""
    return [module for module in model.modules() if routes_attention(type(module))]


def num_heads(module: nn.Module) -> int:
    """Number of query heads of an attention module (for a learned alpha per head)."""
    for owner in (module, getattr(module, "config", None)):
        for name in ("num_heads", "num_attention_heads", "n_heads", "n_head"):
            value = getattr(owner, name, None)
            if isinstance(value, int) and value > 0:
                return value
    raise ValueError(f"cannot tell the number of heads of {type(module).__name__}: learn_alpha is not available here")
