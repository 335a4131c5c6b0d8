"""Which kernel runs an attention call: the attention option ``kernel`` ("auto", "triton", "torch").

- ``"torch"``: the torch-operations path (:mod:`.blocks`, :mod:`.decode`), on every device.
- ``"triton"``: the Triton kernels (:mod:`.triton_attention`; a decoding call: :func:`decode_kernel`); on a
  machine without a GPU only under ``TRITON_INTERPRET=1``. A call they cannot serve raises one ``ValueError``
  listing every reason (:func:`.triton_attention.not_supported_reasons`): never a silent fallback.
- ``"auto"`` (default): the Triton kernels for a call on CUDA that they serve, else the torch path.
"""

from __future__ import annotations

import torch

from ..mappings import registry

KERNELS = ("auto", "triton", "torch")
DECODE_ROWS = 16  # a call with at most this many query rows and no gradient wanted is a decoding call


def decode_kernel():
    """The kernel of decoding calls: ``triton_decode`` (split over the keys) where its module is present, else
    :func:`.triton_attention.triton_attention` (exact too, one program a block of query rows)."""
    try:
        from .gpu.triton_decode import triton_decode
    except ImportError:
        return None
    return triton_decode


def wanted(kernel: str, query: torch.Tensor) -> bool:
    """Whether this call should try the Triton kernels (cheap: no reasons computed)."""
    return kernel == "triton" or (kernel == "auto" and query.is_cuda)


def triton_route(module, query, key, value, mask, *, kernel: str, mapping: str, scaling: float, dropout: float,
                 softcap, position_bias, sinks, causal: bool, weights: bool, options, learned):
    """The output ``[B, H, q, Dv]`` from the Triton kernels, or None where ``kernel="auto"`` finds the call not
    served (the caller then takes the torch path). ``options``: the module's mapping options (None: defaults);
    ``learned``: its ``LearnedAlpha`` or None."""
    from .gpu.triton_attention import not_supported_reasons, triton_attention

    entry = registry.REGISTRY[mapping]
    alpha = 1.5
    if entry.threshold is not None:
        own = options if options is not None else entry.options()
        alpha = learned().to(query.device).reshape(-1) if learned is not None else entry.fenchel_young_alpha(own)
    no_grad = not (torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value) + ((alpha,) if isinstance(alpha, torch.Tensor) else ())))
    decode = decode_kernel() if no_grad and not causal and query.shape[-2] <= DECODE_ROWS else None
    reasons = not_supported_reasons(query, key, value, mask, alpha=alpha, mapping=mapping, dropout=dropout,
                                    softcap=softcap, position_bias=position_bias, sinks=sinks, weights=weights,
                                    decoding=decode is not None)
    if reasons:
        if kernel == "triton":
            raise ValueError(f"attention kernel 'triton' cannot serve this {mapping} attention call: "
                             + "; ".join(reasons) + " (kernel='auto' takes the torch path for such calls)")
        return None
    if decode is not None:
        return decode(query, key, value, mask, alpha=alpha, scaling=scaling)
    return triton_attention(query, key, value, mask, causal=causal, alpha=alpha, scaling=scaling)
