"""A sparse loss straight from the hidden states: the output head and the loss, chunk by chunk.

For hidden states ``h`` (``[N, H]``), the head weight ``W`` (``[V, H]``), an
optional bias ``b``, an optional logit scale ``s`` (Cohere, Granite, Falcon-H1)
and optional final soft-capping (Gemma),

    x = h W^T + b,   z = c tanh(s x / c)  (z = s x without capping),   L = sum_n loss(z_n, t_n),

with ``dL/dz_n = p_n - e_{t_n} =: g_n`` for every sparse loss (``p`` the loss's
mapping of ``z``). The chain rule multiplies by ``dz/dx = s (1 - (z/c)**2)``,
which keeps ``g`` exactly as sparse (which scale and cap a model family uses
is data: :mod:`hf_sparsemax.losses.fused_heads`). So with ``S`` the support of ``p``
plus the target,

    dh_n = sum_{i in S_n} g_ni W_i,   dW_i = sum_n g_ni h_n,   db_i = sum_n g_ni:

sparse-times-dense products costing ``N |S| H``, not the dense ``N V H``.

The logits exist one chunk of tokens at a time (``[chunk, V]``; never all
``[N, V]``). For each chunk the mapping's own support routine
(:mod:`hf_sparsemax.mappings`) gives each token's support as ``(index, p)`` of
shape ``[chunk, K]``, and the loss value comes from those. Design choice, by
measurement (``hf-sparsemax bench losses``' fused-head rows and a split of its fused
sparse_softmax(top_k=64) row on this CPU): the chunk matmuls are about 80% of
the fused forward, and the sparse backward costs about a third of the
forward. Recomputing the chunk logits in backward would add one more dense
``N V H`` matmul, more than doubling the backward and roughly 1.6x the whole;
so forward keeps the compact support instead (index, row and value: about
``20 (K + 1)`` bytes per token, 1.3 MB per 1024 tokens at ``K = 64``), and
backward runs two sparse CSR products over all tokens at once. Chunks whose support is large (plain
softmax, ``top_p`` over flat logits: more than ``V / 32`` entries per token)
fall back to a dense gradient for that chunk, computed in forward right away
(keeping ``[chunk, V]`` until backward would defeat the chunking) and scaled
by the incoming gradient in backward.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Callable

import torch
from torch import nn

from .names import make_loss
from ..mappings.loss_functions import fenchel_young_items, module_reduction
from ..mappings import registry
from ..mappings._core import masked_below, work_dtype
from ..mappings.entmax import precise_in_float32

CHUNK_TOKENS = 1024  # tokens per chunk of logits: [1024, 49152] float32 is 192 MiB
DENSE_FRACTION = 32  # a chunk whose largest support exceeds V / DENSE_FRACTION gets a dense gradient

# support_fn(rows, target, masked) -> (index [C, K] or None for dense p, p, per-token loss [C])
SupportFn = Callable[[torch.Tensor, torch.Tensor, float], tuple]


def sparse_softmax_items(p: torch.Tensor, index: torch.Tensor | None, rows: torch.Tensor, t: torch.Tensor):
    """``logsumexp(x[Omega]) - x_t = x_j - log p_j - x_t`` for any kept ``j`` (the most probable)."""
    p_j, j = p.max(-1, keepdim=True)
    if index is not None:
        j = index.gather(-1, j)
    return (rows.gather(-1, j) - rows.gather(-1, t.unsqueeze(-1)) - p_j.log()).squeeze(-1)


def support_function(name: str, options: dict) -> SupportFn:
    """The per-chunk ``support_fn`` of a loss, from its registry entry's support routine and loss rule."""
    entry, opts, _ = registry.loss_options(name, options)
    if not entry.fused:
        raise entry.refuse("fused")
    if entry.loss_rule == "kept_logsumexp":  # sparse softmax: log-partition over the kept set

        def kept_fn(rows, t, masked):
            if opts.top_k is not None and opts.top_k < rows.shape[-1]:
                index, p = entry.support(rows, masked, opts)
            else:  # top_p alone or plain softmax: the kept set has no size bound
                index, p = None, entry.rows(rows, masked, opts)
            return index, p, sparse_softmax_items(p, index, rows, t)

        return kept_fn
    alpha = entry.fenchel_young_alpha(opts)
    if isinstance(alpha, torch.Tensor):
        raise ValueError("the fused head loss takes a float alpha, not a tensor (a learned alpha needs the "
                         f"unfused {name}_loss)")

    def threshold_fn(rows, t, masked):  # Fenchel-Young: threshold, support and loss from one solve
        work = rows if rows.dtype == torch.float64 or precise_in_float32(alpha) else rows.double()
        index, p, tau = entry.support(work, masked, opts)
        return index, p.to(rows.dtype), fenchel_young_items(p, tau, alpha, work, t, masked).to(rows.dtype)

    return threshold_fn


def compact(p: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(index, p)`` of the non-zeros of dense rows ``p`` as ``[C, K]``, or None when ``K > limit``."""
    k = int((p > 0).sum(-1).max())
    if k > limit:
        return None
    values, index = p.topk(max(k, 1), dim=-1)
    return index, values


class SparseHeadLossFunction(torch.autograd.Function):
    """Summed loss of ``support_fn`` over the tokens of ``hidden`` (all counted); see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, support_fn, softcap, chunk_size, scale):
        n, vocab = hidden.shape[0], weight.shape[0]
        ctx.bias_dtype = None if bias is None else bias.dtype
        dtype = work_dtype(hidden.dtype)
        masked = masked_below(hidden.dtype)
        needs_grad = any(ctx.needs_input_grad[:3])
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        entry_rows, cols, vals = [], [], []
        dense = None  # (dh, dW, db) of the chunks with a dense gradient
        for start in range(0, n, chunk_size):
            h, t = hidden[start : start + chunk_size], target[start : start + chunk_size]
            logits = h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)
            z = logits.to(dtype)
            if scale is not None:
                z = z.mul_(scale)
            if softcap is not None:
                z = z.div_(softcap).tanh_().mul_(softcap)
            index, p, items = support_fn(z, t, masked)
            total += items.sum()
            if not needs_grad:
                continue
            if index is None:
                found = compact(p, vocab // DENSE_FRACTION)
                if found is None:
                    dense = dense_gradient(p, z, h, t, weight, softcap, scale, start, n, dense)
                    continue
                index, p = found
            index = torch.cat([index, t.unsqueeze(-1)], -1)
            g = torch.cat([p, p.new_full((len(t), 1), -1.0)], -1)
            if softcap is not None:  # dz/dx = 1 - (z / c)**2 on the support and the target
                g = g * (1 - (z.gather(-1, index) / softcap).square())
            if scale is not None:  # dz/dx = s
                g = g * scale
            entry_rows.append(torch.arange(start, start + len(t), device=h.device).repeat_interleave(index.shape[1]))
            cols.append(index.reshape(-1))
            vals.append(g.reshape(-1))
        empty = hidden.new_zeros(0, dtype=torch.long)
        coo = (torch.cat(entry_rows), torch.cat(cols), torch.cat(vals)) if entry_rows else (empty, empty, empty.to(dtype))
        ctx.save_for_backward(hidden, weight, *coo, *(dense or ()))
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, rows, cols, vals, *dense = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, vocab, dtype = hidden.shape[0], weight.shape[0], vals.dtype
        grad_total = grad_total.to(dtype)
        dh = dw = db = None
        if need_h:
            dh = sparse_rows(rows, cols, vals, (n, vocab)) @ weight.to(dtype)
            dh = ((dh + dense[0]) if dense else dh).mul_(grad_total).to(hidden.dtype)
        if need_w:  # a frozen head (LoRA) skips the [V, H] product
            dw = sparse_rows(cols, rows, vals, (vocab, n)) @ hidden.to(dtype)
            dw = ((dw + dense[1]) if dense else dw).mul_(grad_total).to(weight.dtype)
        if need_b:
            db = torch.zeros(vocab, dtype=dtype, device=vals.device).index_add_(0, cols, vals)
            db = ((db + dense[2]) if dense else db).mul_(grad_total).to(ctx.bias_dtype)
        if torch.is_grad_enabled():  # create_graph=True: these gradients have no derivative of their own
            dh, dw, db = (None if d is None else NoSecondDerivative.apply(d, hidden, weight) for d in (dh, dw, db))
        return dh, dw, db, None, None, None, None, None


class NoSecondDerivative(torch.autograd.Function):
    """Identity on a gradient of the fused head loss; differentiating it raises an error saying what to do.

    The fused backward is a product with a compact support stored in forward,
    not a function of the inputs autograd could differentiate, so a second
    derivative through it would be silently wrong (the support's dependence
    on ``hidden`` and ``weight`` is lost). First derivatives with
    ``create_graph=True`` (e.g. a penalty on other parameters) still work.
    """

    @staticmethod
    def forward(ctx, gradient: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        return gradient.view_as(gradient)  # ``inputs``: what the gradient depends on, so the error is reached

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        raise RuntimeError(
            "fused_head_loss (the fused sparse head loss, loss_options={'fused': True}) has no second derivative: "
            "its backward is a sparse product over the support kept from forward. For double backward "
            "(gradient penalties, Hessian-vector products, meta-learning) compute the logits and use the unfused "
            "loss, e.g. hf_sparsemax.sparsemax_loss(hidden @ weight.T, labels), or patch_model without "
            "loss_options fused=True"
        )


def sparse_rows(rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor, shape) -> torch.Tensor:
    """CSR matrix of the entries ``(rows, cols, vals)`` (duplicates add up)."""
    if rows.numel() and not bool((rows[1:] >= rows[:-1]).all()):
        order = torch.argsort(rows, stable=True)
        rows, cols, vals = rows[order], cols[order], vals[order]
    crow = torch.zeros(shape[0] + 1, dtype=torch.long, device=rows.device)
    crow[1:] = torch.bincount(rows, minlength=shape[0]).cumsum(0)
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the products used here are long stable
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, cols, vals, shape, check_invariants=False)


def dense_gradient(p, z, h, t, weight, softcap, scale, start, n, dense):
    """Add one chunk's dense ``g = (p - e_t) * dz/dx`` to ``(dh, dW, db)`` (created on first use)."""
    g = p.scatter_add(-1, t.unsqueeze(-1), p.new_full((len(t), 1), -1.0))
    if softcap is not None:
        g.mul_(1 - (z / softcap).square())
    if scale is not None:
        g.mul_(scale)
    if dense is None:
        dense = (g.new_zeros(n, h.shape[1]), g.new_zeros(weight.shape), g.new_zeros(weight.shape[0]))
    dh, dw, db = dense
    dh[start : start + len(t)] = g @ weight.to(g.dtype)
    dw.addmm_(g.T, h.to(g.dtype))
    db += g.sum(0)
    return dense


def check_head_args(hidden, weight, labels, bias, softcap, reduction, num_items_in_batch, chunk_size,
                    logit_scale=None) -> None:
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise ValueError("hidden must be a floating-point tensor of shape [..., hidden_size]")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must have shape [vocab_size, {hidden.shape[-1]}] (hidden_size last), got "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
        raise ValueError("labels must be an integer tensor of class indices")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden shape without its last dim, "
                         f"{tuple(hidden.shape[:-1])} (shift causal-LM labels first)")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"bias must be None or have shape [{weight.shape[0]}]")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not softcap > 0):
        raise ValueError(f"softcap must be None or a positive float, got {softcap!r}")
    if logit_scale is not None and (isinstance(logit_scale, bool) or not isinstance(logit_scale, numbers.Real)
                                    or not 0 < logit_scale < float("inf")):
        raise ValueError(f"logit_scale must be None or a positive finite float, got {logit_scale!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' for the fused head loss, got {reduction!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")
    if num_items_in_batch is not None and not (torch.is_tensor(num_items_in_batch) or isinstance(num_items_in_batch, numbers.Real)):
        raise ValueError(f"num_items_in_batch must be None, a number or a tensor, got {num_items_in_batch!r}")


def fused_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss: str = "sparse_softmax",
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int | None = None,
    logit_scale: float | None = None,
    **loss_options,
) -> torch.Tensor:
    """``loss(softcap(logit_scale * (hidden @ weight.T + bias)), labels)`` without the ``[tokens, vocab]`` logits.

    ``hidden`` is ``[..., H]``, ``weight`` ``[V, H]`` (tied or not), ``labels``
    ``[...]`` aligned with ``hidden`` (a causal LM shifts them first). ``loss``
    is ``"sparse_softmax"`` (``top_k``, ``top_p``), ``"sparsemax"``,
    ``"entmax15"`` or ``"entmax_bisect"`` (a float ``alpha``); ``softcap`` is
    Gemma's final ``c * tanh(x / c)``, applied after the multiplier
    ``logit_scale`` (Cohere's ``logit_scale``, ``1 / logits_scaling`` for
    Granite; see :mod:`hf_sparsemax.losses.fused_heads`). Tokens labelled
    ``ignore_index`` are skipped. Returns the sum over counted tokens divided by
    ``num_items_in_batch`` when given (Trainer's exact gradient accumulation),
    else the mean (``reduction="mean"``, 0 when none counts) or the sum.
    ``chunk_size`` tokens of logits are live at a time (default 1024).
    Equals the unfused loss and gradients up to float rounding.
    """
    if "fused" in loss_options:
        raise ValueError("fused is an option of patch_model's loss_options, not of fused_head_loss")
    make_loss(loss, **loss_options)  # validates the name and options
    check_head_args(hidden, weight, labels, bias, softcap, reduction, num_items_in_batch, chunk_size, logit_scale)
    support_fn = support_function(loss, loss_options)
    flat_labels = labels.reshape(-1).to(hidden.device)
    kept = (flat_labels != ignore_index).nonzero().squeeze(1)
    target = flat_labels.index_select(0, kept).long()
    if target.device.type == "cpu" and bool(((target < 0) | (target >= weight.shape[0])).any()):
        raise ValueError(f"labels hold class indices outside [0, {weight.shape[0]}) that are not "
                         f"ignore_index={ignore_index}")
    tokens = hidden.reshape(-1, hidden.shape[-1]).index_select(0, kept)
    total = SparseHeadLossFunction.apply(tokens, weight, bias, target, support_fn,
                                         None if softcap is None else float(softcap), chunk_size or CHUNK_TOKENS,
                                         None if logit_scale is None else float(logit_scale))
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total if reduction == "sum" else total / max(len(kept), 1)


class FusedHeadLoss(nn.Module):
    """Module form of :func:`fused_head_loss`: ``forward(hidden, weight, labels, bias=None, num_items_in_batch=None)``."""

    def __init__(self, loss: str = "sparse_softmax", softcap: float | None = None, ignore_index: int = -100,
                 reduction: str = "mean", chunk_size: int | None = None, logit_scale: float | None = None,
                 **loss_options):
        super().__init__()
        make_loss(loss, **loss_options)
        support_function(loss, loss_options)
        self.loss, self.softcap, self.ignore_index = loss, softcap, ignore_index
        self.reduction = module_reduction(reduction, ("mean", "sum"))  # entmax's "elementwise_mean" too
        self.chunk_size, self.loss_options = chunk_size, loss_options
        self.logit_scale = logit_scale

    def forward(self, hidden, weight, labels, bias=None, num_items_in_batch=None) -> torch.Tensor:
        return fused_head_loss(hidden, weight, labels, self.loss, bias, self.softcap, self.ignore_index,
                               self.reduction, num_items_in_batch, self.chunk_size, self.logit_scale,
                               **self.loss_options)

    def extra_repr(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.loss_options.items())
        scale = "" if self.logit_scale is None else f", logit_scale={self.logit_scale}"
        return f"loss={self.loss!r}, softcap={self.softcap}{scale}, chunk_size={self.chunk_size}{options}"
