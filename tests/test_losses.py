"""Sparse losses: values against the entmax package and closed forms, gradients, reductions, ignore_index."""

import entmax
import pytest
import torch

import hf_sparsemax as hs

LOSSES = {
    "sparse_softmax_k5": (lambda x, t, **k: hs.sparse_softmax_loss(x, t, top_k=5, **k),
                          lambda x: hs.sparse_softmax(x, top_k=5)),
    "sparse_softmax_p": (lambda x, t, **k: hs.sparse_softmax_loss(x, t, top_p=0.7, **k),
                         lambda x: hs.sparse_softmax(x, top_p=0.7)),
    "sparsemax": (hs.sparsemax_loss, hs.sparsemax),
    "entmax15": (hs.entmax15_loss, hs.entmax15),
    "bisect13": (lambda x, t, **k: hs.entmax_bisect_loss(x, t, 1.3, **k), lambda x: hs.entmax_bisect(x, 1.3)),
    "bisect25": (lambda x, t, **k: hs.entmax_bisect_loss(x, t, 2.5, **k), lambda x: hs.entmax_bisect(x, 2.5)),
    "mapping_taylor": (lambda x, t, **k: hs.mapping_loss(x, t, hs.taylor_softmax, **k), hs.taylor_softmax),
}


def data(shape=(6, 40), dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(*shape, dtype=dtype) * 2
    t = torch.randint(0, shape[-1], shape[:-1])
    return x, t


@pytest.mark.parametrize(
    "ours,reference",
    [
        (hs.sparsemax_loss, entmax.SparsemaxLoss(reduction="none")),
        (hs.entmax15_loss, entmax.Entmax15Loss(reduction="none")),
        (lambda x, t, **k: hs.entmax_bisect_loss(x, t, 1.3, **k), entmax.EntmaxBisectLoss(1.3, n_iter=100, reduction="none")),
        (lambda x, t, **k: hs.entmax_bisect_loss(x, t, 1.5, **k), entmax.Entmax15Loss(reduction="none")),
    ],
)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_matches_entmax_package(ours, reference, dtype, tol):
    x, t = data((64, 500), dtype)
    assert (ours(x, t, reduction="none") - reference(x, t)).abs().max() <= tol


def test_sparsemax_loss_closed_form():
    x, t = data()
    p = hs.sparsemax(x)
    tau = (x - p)[p > 0].reshape(-1)  # on the support x_i - p_i = tau
    support = p > 0
    taus = torch.stack([(x[i] - p[i])[support[i]][0] for i in range(len(x))])
    expected = 0.5 - x.gather(1, t[:, None]).squeeze(1) + 0.5 * ((x**2 - taus[:, None] ** 2) * support).sum(-1)
    assert tau.numel() and torch.allclose(hs.sparsemax_loss(x, t, reduction="none"), expected, atol=1e-12)


@pytest.mark.parametrize("top_k,top_p", [(None, None), (5, None), (None, 0.7), (10, 0.5)])
def test_sparse_softmax_loss_closed_form(top_k, top_p):
    x, t = data()
    p = hs.sparse_softmax(x, top_k=top_k, top_p=top_p)
    kept = p > 0
    lse = torch.where(kept, x, float("-inf")).logsumexp(-1)
    expected = lse - x.gather(1, t[:, None]).squeeze(1)
    assert torch.allclose(hs.sparse_softmax_loss(x, t, top_k=top_k, top_p=top_p, reduction="none"), expected)
    if top_k is None and top_p is None:
        assert torch.allclose(expected, torch.nn.functional.cross_entropy(x, t, reduction="none"))


@pytest.mark.parametrize("name", list(LOSSES))
def test_gradient_is_p_minus_onehot_and_gradcheck(name):
    loss, mapping = LOSSES[name]
    x, t = data()
    x.requires_grad_()
    (dx,) = torch.autograd.grad(loss(x, t, reduction="sum"), x)
    expected = mapping(x.detach()) - torch.nn.functional.one_hot(t, x.shape[-1])
    assert torch.allclose(dx, expected, atol=1e-12)
    if name != "mapping_taylor":  # by design its gradient is p - e_t, not the derivative of its value
        assert torch.autograd.gradcheck(lambda v: loss(v, t), (x,))


@pytest.mark.parametrize("shape", [(5, 9), (2, 3, 9)])
def test_alpha_gradient(shape):
    x, t = data(shape)
    alpha = (1.1 + 0.8 * torch.rand(shape[:-1], dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda v, a: hs.entmax_bisect_loss(v, t, a), (x.requires_grad_(), alpha))
    shared = torch.tensor(1.7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, a: hs.entmax_bisect_loss(v, t, a, reduction="sum"), (x, shared))


@pytest.mark.parametrize("name", list(LOSSES))
def test_ignore_index_and_reductions(name):
    loss, _ = LOSSES[name]
    x, t = data((3, 4, 30))
    t[0, 1] = t[2, :] = -100
    kept = t != -100
    none = loss(x, t, reduction="none")
    assert none.shape == t.shape and (none[~kept] == 0).all()
    assert torch.allclose(loss(x, t, reduction="sum"), none.sum())
    assert torch.allclose(loss(x, t), none.sum() / kept.sum())
    other = torch.where(kept, t, 7)
    assert (loss(x, other, ignore_index=7, reduction="none")[other == 7] == 0).all()
    x.requires_grad_()
    loss(x, t).backward()
    assert (x.grad[~kept] == 0).all()


@pytest.mark.parametrize("name", list(LOSSES))
def test_all_ignored_gives_zero_loss_and_zero_grad(name):
    loss, _ = LOSSES[name]
    x, t = data()
    x.requires_grad_()
    value = loss(x, torch.full_like(t, -100))
    value.backward()
    assert value.item() == 0 and (x.grad == 0).all() and not torch.isnan(x.grad).any()


@pytest.mark.parametrize("name", ["sparse_softmax_k5", "sparsemax", "entmax15", "bisect13"])
def test_fenchel_young_and_sparse_losses_are_nonnegative_and_zero_at_onehot(name):
    loss, _ = LOSSES[name]
    x, t = data((50, 20))
    assert (loss(x, t, reduction="none") >= 0).all()
    confident = torch.nn.functional.one_hot(t, 20).double() * 100
    assert loss(confident, t).abs() < 1e-9


@pytest.mark.parametrize("name", list(LOSSES))
def test_bf16_and_autocast(name):
    loss, _ = LOSSES[name]
    x, t = data((8, 64), torch.float32)
    xb = x.bfloat16().requires_grad_()
    value = loss(xb, t)
    value.backward()
    assert value.dtype == torch.float32 and xb.grad.dtype == torch.bfloat16
    assert torch.allclose(value, loss(xb.detach().float(), t), atol=1e-5)
    lin = torch.nn.Linear(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss(lin(torch.randn(8, 16)), t)
    out.backward()
    assert torch.isfinite(lin.weight.grad).all()


def test_masked_logits_and_target():
    x, t = data((4, 10), torch.float32)
    x[:, :3] = float("-inf")
    t[:] = 5
    for name, (loss, _) in LOSSES.items():
        if name != "mapping_taylor":
            assert torch.isfinite(loss(x, t, reduction="none")).all(), name


def test_module_forms_pass_their_options():
    x, t = data()
    assert torch.equal(hs.SparseSoftmaxLoss(top_k=3, reduction="sum")(x, t), hs.sparse_softmax_loss(x, t, top_k=3, reduction="sum"))
    assert torch.equal(hs.SparsemaxLoss(ignore_index=2)(x, t), hs.sparsemax_loss(x, t, ignore_index=2))
    assert torch.equal(hs.Entmax15Loss(reduction="none")(x, t), hs.entmax15_loss(x, t, reduction="none"))
    assert torch.equal(hs.EntmaxBisectLoss(1.2)(x, t), hs.entmax_bisect_loss(x, t, 1.2))
    alpha = torch.nn.Parameter(torch.tensor(1.6, dtype=torch.float64))
    hs.EntmaxBisectLoss(alpha)(x, t).backward()
    assert alpha.grad is not None and alpha.grad != 0


@pytest.mark.parametrize(
    "call",
    [
        lambda x, t: hs.sparsemax_loss(x, t, reduction="elementwise_mean"),
        lambda x, t: hs.sparsemax_loss(x, t.float()),
        lambda x, t: hs.sparsemax_loss(x, t[:-1]),
        lambda x, t: hs.sparsemax_loss(x.long(), t),
        lambda x, t: hs.sparsemax_loss(x, torch.full_like(t, 40)),
        lambda x, t: hs.entmax15_loss(x, torch.full_like(t, -1)),
        lambda x, t: hs.sparse_softmax_loss(x, t, top_k=0),
        lambda x, t: hs.sparse_softmax_loss(x, t, top_p=2.0),
        lambda x, t: hs.entmax_bisect_loss(x, t, alpha=1.0),
        lambda x, t: hs.entmax_bisect_loss(x, t, alpha=torch.tensor([1.5, 0.9])),
        lambda x, t: hs.SparseSoftmaxLoss(top_k=-1),
        lambda x, t: hs.SparsemaxLoss(reduction="avg"),
    ],
)
def test_bad_input_raises_value_error(call):
    x, t = data()
    with pytest.raises(ValueError):
        call(x, t)
