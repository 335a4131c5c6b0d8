"""Sparse softmax (Su Jianlin, 2020; "Sparse-softmax", arXiv 2112.12433).

``p_i = exp(x_i) / sum_{j in Omega} exp(x_j)`` for ``i`` in the kept set
``Omega``, exactly 0 elsewhere. ``Omega`` is what transformers' decoding keeps
with ``TopKLogitsWarper`` then ``TopPLogitsWarper``: the ``top_k`` largest
entries (ties as ``torch.topk``), then the shortest prefix of those, by
descending probability, whose softmax mass reaches ``top_p`` (at least one).

Jacobian: ``diag(p) - p p^T`` on ``Omega``, i.e. the shared support backward
with weights ``s = p``.
"""

from __future__ import annotations

import numbers

import torch

from ._core import SupportMapping, check_input

NUCLEUS_CANDIDATES = 64  # top entries examined first for top_p alone; more when the nucleus is larger


def check_top(top_k, top_p) -> tuple[int | None, float | None]:
    """Validate ``top_k`` / ``top_p``; ``top_p == 1`` means no nucleus cut."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be a float in (0, 1] or None, got {top_p!r}")
        top_p = None if top_p == 1 else float(top_p)
    return (None if top_k is None else int(top_k)), top_p


def masked_softmax(values: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """Softmax of each row over the entries not in ``drop``; all dropped gives zeros."""
    values = values.masked_fill(drop, float("-inf"))
    top = values.amax(-1, keepdim=True)
    e = (values - top.masked_fill(top == float("-inf"), 0.0)).exp_()
    total = e.sum(-1, keepdim=True)
    return e.div_(total.masked_fill(total == 0, 1.0))


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Entries (sorted descending) outside the nucleus: the mass from there on is ``<= 1 - top_p``."""
    before = probs.cumsum(-1) - probs
    drop = (1 - before) <= 1 - top_p
    drop[:, 0] = False
    return drop


def sparse_softmax_rows(rows: torch.Tensor, top_k: int | None, top_p: float | None, masked: float) -> torch.Tensor:
    """Sparse softmax of each row of a ``[rows, n]`` tensor (options already validated)."""
    n = rows.shape[-1]
    k = n if top_k is None else min(top_k, n)
    if k == n and top_p is None:
        out = torch.softmax(rows, -1)
        dead = rows.amax(-1, keepdim=True) <= masked
        return out.masked_fill_(dead, 0.0) if bool(dead.any()) else out
    out = torch.zeros_like(rows)
    if k < n or top_p is None:
        return out.scatter_(-1, *sparse_softmax_support(rows, k, top_p, masked))
    # top_p alone: the nucleus is found among the top c entries, c growing until it fits.
    log_total = rows.logsumexp(-1, keepdim=True)
    todo = torch.arange(rows.shape[0], device=rows.device)
    c = min(NUCLEUS_CANDIDATES, n)
    while todo.numel():
        values, index = rows.index_select(0, todo).topk(c, dim=-1)
        drop = (values <= masked) | nucleus((values - log_total.index_select(0, todo)).exp(), top_p)
        fits = drop.any(-1) if c < n else torch.ones_like(todo, dtype=torch.bool)
        done = todo[fits]
        out.index_put_((done.unsqueeze(1), index[fits]), masked_softmax(values[fits], drop[fits]))
        todo, c = todo[~fits], min(4 * c, n)
    return out


def sparse_softmax_support(
    rows: torch.Tensor, top_k: int, top_p: float | None, masked: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, p)`` of shape ``[rows, top_k]``: the kept set of :func:`sparse_softmax_rows` when ``top_k`` is given.

    Entries of the top ``top_k`` cut by the ``top_p`` nucleus get ``p = 0``.
    """
    values, index = rows.topk(min(top_k, rows.shape[-1]), dim=-1)
    drop = values <= masked
    if top_p is not None:
        drop |= nucleus(masked_softmax(values, drop), top_p)
    return index, masked_softmax(values, drop)


def sparse_softmax(
    x: torch.Tensor, dim: int = -1, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Softmax over the kept set ``Omega`` (top ``top_k``, then the ``top_p`` nucleus), 0 elsewhere.

    ``top_k`` larger than the size of ``dim`` keeps everything; neither option
    given is plain softmax. Same masking and dtype conventions as the other
    mappings. Backward: ``dx = p * (g - sum(p * g))``.
    """
    dim = check_input(x, dim)
    top_k, top_p = check_top(top_k, top_p)
    return SupportMapping.apply(x, dim, lambda rows, masked: sparse_softmax_rows(rows, top_k, top_p, masked), lambda p: p)
