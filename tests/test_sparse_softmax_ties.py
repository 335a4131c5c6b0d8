"""Sparse softmax on ties and NaN: its mapping, loss, logits processor and fused head.

- Ties: sparse_softmax(top_k=k) keeps every entry tied with the k-th largest (as transformers'
  TopKLogitsWarper); top_p keeps every entry tied with the last one of the nucleus. So the mapping is
  permutation-equivariant, which bf16 logits (full of ties) check.
- NaN or +inf anywhere in a slice makes that whole slice NaN; other slices are untouched.
"""

import pytest
import torch
from transformers import TopKLogitsWarper, TopPLogitsWarper

import hf_sparsemax as hs

MAPPINGS = {
    "softmax": lambda x: hs.sparse_softmax(x),
    "top_k": lambda x: hs.sparse_softmax(x, top_k=10),
    "top_p": lambda x: hs.sparse_softmax(x, top_p=0.9),
    "top_p_small": lambda x: hs.sparse_softmax(x, top_p=0.3),
    "top_k_top_p": lambda x: hs.sparse_softmax(x, top_k=10, top_p=0.5),
}
SPARSE_SOFTMAX = {"top_k": {"top_k": 10}, "top_p": {"top_p": 0.9}, "top_k_top_p": {"top_k": 10, "top_p": 0.5}}


def bf16_logits(rows=6, n=300, seed=0):
    """Logit-like rows rounded to bf16: about a third of neighbouring top values tie."""
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * 3
    return x.to(torch.bfloat16)


def kept(x, **options):
    return hs.sparse_softmax(x, **options) > 0


# ---------------------------------------------------------------- ties


@pytest.mark.parametrize("k", [1, 2, 10, 50])
def test_top_k_keeps_every_tie_like_transformers_warper(k):
    x = bf16_logits(32)
    x[0, -3:] = x[0].topk(k).values[-1]  # at least one row ties at the k-th value
    assert (x.float().topk(k + 1).values[:, -2:].diff() == 0).any()
    warped = TopKLogitsWarper(k)(None, x.float())
    torch.testing.assert_close(hs.sparse_softmax(x.float(), top_k=k), torch.softmax(warped, -1), rtol=0, atol=1e-6)
    assert torch.equal(kept(x, top_k=k), warped > float("-inf"))


def test_top_k_ties_small_example():
    x = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.5]])
    assert kept(x, top_k=2).tolist() == [[True, True, True, True, False]]


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.9])
def test_top_p_keeps_ties_with_the_last_kept_entry(top_p):
    x = bf16_logits(32).float()
    ours = kept(x, top_p=top_p)
    theirs = TopPLogitsWarper(top_p)(None, x) > float("-inf")
    assert (ours >= theirs).all()  # transformers' set, plus ties it cut by position
    floor = torch.where(ours, x, float("inf")).amin(-1, keepdim=True)
    assert torch.equal(ours, x >= floor)  # the kept set is {x >= floor}
    last = torch.where(theirs, x, float("inf")).amin(-1, keepdim=True)
    assert torch.equal(ours, x >= last)  # ... whose floor is the value of transformers' last kept entry


def test_top_p_tie_small_example():
    x = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]]).log_softmax(-1)
    # p = [0.69, 0.09, 0.09, 0.09, 0.03]: the first 1.0 (in any order) reaches the mass 0.75; its ties are kept too
    assert kept(x, top_p=0.75).tolist() == [[True, True, True, True, False]]
    assert (TopPLogitsWarper(0.75)(None, x) > float("-inf")).sum() == 2  # transformers cuts the tie by position


@pytest.mark.parametrize("name", list(MAPPINGS))
def test_sparse_softmax_is_permutation_equivariant_on_bf16_logits(name):
    x = bf16_logits(6, 300)
    f = MAPPINGS[name]
    perm = torch.randperm(x.shape[-1], generator=torch.Generator().manual_seed(1))
    out, permuted = f(x.float()), f(x.float()[:, perm])
    assert torch.equal(permuted > 0, out[:, perm] > 0)
    torch.testing.assert_close(permuted, out[:, perm], rtol=0, atol=1e-6)
    torch.testing.assert_close(f(x), out.to(torch.bfloat16), rtol=0, atol=0)  # bf16 input: computed in float32


@pytest.mark.parametrize("name", list(SPARSE_SOFTMAX))
def test_loss_processor_and_fused_head_share_the_support_on_tied_rows(name):
    options = SPARSE_SOFTMAX[name]
    torch.manual_seed(2)
    vocab, hidden = 200, 8
    weight = torch.randn(vocab // 4, hidden).repeat(4, 1)  # every logit appears four times: ties everywhere
    h = torch.randn(6, hidden)
    logits = h @ weight.T
    target = torch.randint(0, vocab, (6,))
    support = hs.sparse_softmax(logits, **options) > 0
    assert (support.sum(-1) > options.get("top_k", 0)).all() or "top_p" in options

    x = logits.clone().requires_grad_()
    hs.sparse_softmax_loss(x, target, reduction="sum", **options).backward()
    grad = x.grad.clone()
    grad[torch.arange(6), target] += 1  # the gradient is p - e_t
    assert torch.equal(grad != 0, support)

    processed = hs.SparseSoftmaxLogitsProcessor(**options)(None, logits)
    assert torch.equal(processed > float("-inf"), support)
    if "top_k" in options and "top_p" not in options:  # and transformers' own warper
        assert torch.equal(TopKLogitsWarper(options["top_k"])(None, logits) > float("-inf"), support)

    w = weight.clone().requires_grad_()
    for i in range(6):  # one token at a time: the rows of dW that get a gradient are the support (+ the target)
        w.grad = None
        hs.fused_head_loss(h[i : i + 1], w, target[i : i + 1], "sparse_softmax", reduction="sum", **options).backward()
        touched = w.grad.abs().sum(-1) != 0
        touched[target[i]] = support[i, target[i]]
        assert torch.equal(touched, support[i]), i
    torch.testing.assert_close(
        hs.fused_head_loss(h, weight, target, "sparse_softmax", **options), hs.sparse_softmax_loss(logits, target, **options)
    )


# ---------------------------------------------------------------- NaN and +inf


@pytest.mark.parametrize("name", list(MAPPINGS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_or_inf_makes_the_whole_slice_nan(name, bad, dtype):
    x = bf16_logits(6, 40).to(dtype)
    x[1, 7] = bad
    x[4, :] = float("-inf")  # a fully masked row stays zeros
    f = MAPPINGS[name]
    out = f(x)
    assert torch.isnan(out[1]).all()
    assert (out[4] == 0).all()
    good = [0, 2, 3, 5]
    assert not torch.isnan(out[good]).any()
    alone = f(x[good])
    torch.testing.assert_close(out[good], alone, rtol=0, atol=0)


@pytest.mark.parametrize(
    "loss",
    [
        lambda x, t: hs.sparse_softmax_loss(x, t, top_k=10, reduction="none"),
        lambda x, t: hs.sparse_softmax_loss(x, t, top_p=0.9, reduction="none"),
    ],
)
def test_losses_nan_only_in_the_affected_item(loss):
    x = bf16_logits(6, 40).float()
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    t = torch.arange(6)
    items = loss(x, t)
    assert torch.isnan(items[[1, 2]]).all() and torch.isfinite(items[[0, 3, 4, 5]]).all()
    torch.testing.assert_close(items[[0, 3, 4, 5]], loss(x[[0, 3, 4, 5]], t[[0, 3, 4, 5]]), rtol=0, atol=0)


@pytest.mark.parametrize(
    "processor", [hs.SparseSoftmaxLogitsProcessor(top_k=5), hs.SparseSoftmaxLogitsProcessor(top_p=0.9)]
)
def test_processors_nan_only_in_the_affected_row(processor):
    x = bf16_logits(3, 40).float()
    x[1, 0] = float("nan")
    out = processor(None, x)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()


def test_large_nucleus_sorts_only_where_needed_and_stays_exact():
    """Flat rows (nucleus beyond the first candidates) beside peaked ones: the same kept set as TopPLogitsWarper."""
    x = torch.randn(4, 500, generator=torch.Generator().manual_seed(3))
    x[1] *= 0.01  # nearly flat: the nucleus holds most of the row
    x[2] *= 10
    ours = hs.sparse_softmax(x, top_p=0.9)
    warped = TopPLogitsWarper(0.9)(None, x)  # no ties in these float32 rows
    torch.testing.assert_close(ours, torch.softmax(warped, -1), rtol=0, atol=1e-6)
    assert (ours[1] > 0).sum() > 64
