"""Second derivatives: every mapping and every loss is twice differentiable in its input where the function is.

Checked by float64 ``gradgradcheck`` (double backward against finite
differences of the closed-form gradient) on inputs whose outputs hold exact
zeros well away from the threshold (the support is locally constant there),
by finite Hessian-vector products on such rows in float32, and for a tensor
``alpha`` in ``alpha`` too. The fused head loss has no second derivative and
says so at the double-backward call.
"""

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import hf_sparsemax as hs
from hf_sparsemax.losses.names import make_loss
from hf_sparsemax.mappings import _core, registry


@pytest.fixture(params=["whole-row Newton", "top candidates"])
def threshold_path(request, monkeypatch):
    """Threshold mappings are checked on both solvers (short rows: Newton over the row; else top candidates)."""
    if request.param == "top candidates":
        monkeypatch.setattr(_core, "SHORT_ROWS", 0)
    return request.param


# rows with a clear support and exact zeros far below the threshold (no entry near a kink; no integer
# maximum or range either, where perturb_max's quadrature grid moves)
ROWS = torch.tensor([
    [2.1, 1.4, 0.9, -3.1, -4.55, 0.3],
    [0.2, -0.35, 0.55, -0.1, 0.9, -5.05],
    [-1.1, 3.2, -2.05, 2.25, -4.1, -6.3],
], dtype=torch.float64)
TARGET = torch.tensor([1, 3, 0])  # one target outside the support: the loss and its curvature there too

# every registered mapping with each kind of option (the registry meta-test below keeps this complete)
MAPPINGS = {
    "sparsemax": [{}],
    "entmax15": [{}],
    "entmax_bisect": [{"alpha": 1.3}, {"alpha": 1.5}, {"alpha": 2.0}, {"alpha": 2.5}],
    "normmax_bisect": [{"alpha": 1.2}, {"alpha": 2.0}, {"alpha": 4.0}],
    "budget_bisect": [{"budget": 1.2}, {"budget": 2.3}],  # no entry at a kink (x - tau = 0 or 1)
    "sparse_softmax": [{}, {"top_k": 3}, {"top_p": 0.7}, {"top_k": 4, "top_p": 0.9}],
    "taylor_softmax": [{"order": 2}, {"order": 4}],
    "perturb_max": [{"noise": "gaussian", "points": 48}, {"noise": "gumbel", "points": 48}],
    "am_softmax": [{"margin": 0.2, "scale": 4.0}],
}
CASES = [(name, options) for name, sets in MAPPINGS.items() for options in sets]


def case_id(case):
    name, options = case
    return name + "".join(f"-{k}={v}" for k, v in options.items())


def test_every_registered_mapping_is_checked():
    assert set(MAPPINGS) == set(registry.names())


def cosines(x):
    return torch.tanh(x / 4)  # AM-softmax takes cosines in [-1, 1]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_mapping_double_backward_agrees_with_finite_differences(case, threshold_path):
    name, options = case
    entry = registry.get(name)
    values = registry.option_values(entry.parse(options))
    prepare = cosines if name == "am_softmax" else (lambda x: x)
    x = ROWS.clone().requires_grad_()
    assert gradcheck(lambda x: entry.function(prepare(x), dim=-1, **values), (x,))
    assert gradgradcheck(lambda x: entry.function(prepare(x), dim=-1, **values), (x,))
    xt = ROWS.T.clone().requires_grad_()  # another dim
    assert gradgradcheck(lambda x: entry.function(prepare(x), dim=0, **values), (xt,))


LOSS_CASES = [(name, options) for name, sets in MAPPINGS.items() for options in sets if registry.get(name).loss]


def test_every_registered_loss_is_checked():
    assert set(registry.names("loss")) <= set(MAPPINGS)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("case", LOSS_CASES, ids=case_id)
def test_loss_double_backward_agrees_with_finite_differences(case, reduction, threshold_path):
    name, options = case
    loss = make_loss(name, **options)
    target = TARGET.clone()
    target[2] = -100  # an ignored item: no loss, no gradient, no curvature
    prepare = cosines if name == "am_softmax" else (lambda x: x)
    x = ROWS.clone().requires_grad_()
    fn = lambda x: loss(prepare(x), target, reduction=reduction)  # noqa: E731
    assert gradgradcheck(fn, (x,))
    (g,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x)
    assert h[2].abs().max() == 0


@pytest.mark.parametrize("name", ["sparsemax", "entmax15", "taylor_softmax"])
def test_mapping_loss_second_derivative_is_the_mappings_jacobian(name):
    """``(stop_gradient(p) - e_t) . x``: its gradient is ``p - e_t``, so its Hessian is ``dp/dx``."""
    x = ROWS.clone().requires_grad_()
    fn = lambda x: hs.mapping_loss(x, TARGET, name, reduction="sum")  # noqa: E731
    assert gradgradcheck(fn, (x,))
    (g,) = torch.autograd.grad(fn(x), x, create_graph=True)
    v = torch.randn_like(x)
    (hv,) = torch.autograd.grad(g, x, v)
    (jv,) = torch.autograd.grad(registry.get(name).function(x), x, v)
    torch.testing.assert_close(hv, jv)


def test_tensor_alpha_second_derivatives_in_x_and_alpha():
    x = ROWS.clone().requires_grad_()
    alpha = torch.tensor([[1.3], [1.6], [1.9]], dtype=torch.float64, requires_grad=True)
    assert gradgradcheck(lambda x, a: hs.entmax_bisect(x, a), (x, alpha))
    per_item = alpha.detach().squeeze(-1).clone().requires_grad_()
    assert gradgradcheck(lambda x, a: hs.entmax_bisect_loss(x, TARGET, a, reduction="none"), (x, per_item))
    shared = torch.tensor(1.4, dtype=torch.float64, requires_grad=True)
    assert gradgradcheck(lambda x, a: hs.entmax_bisect_loss(x, TARGET, a), (x, shared))
    batched = torch.tensor([[1.3], [1.7]], dtype=torch.float64, requires_grad=True)  # alpha broadcast over items
    x3 = torch.stack([ROWS[:2], ROWS[1:]]).requires_grad_()
    assert gradgradcheck(lambda x, a: hs.entmax_bisect_loss(x, TARGET[:2].expand(2, 2), a, reduction="sum"),
                         (x3, batched))


HVP_FUNCTIONS = {
    "entmax15": lambda x: hs.entmax15(x),
    "entmax_bisect(1.3)": lambda x: hs.entmax_bisect(x, 1.3),
    "entmax_bisect(1.7, n_iter=30)": lambda x: hs.entmax_bisect(x, 1.7, n_iter=30),
    "entmax_bisect(tensor alpha)": lambda x: hs.entmax_bisect(x, torch.full((x.shape[0], 1), 1.25, dtype=x.dtype)),
    "sparsemax": lambda x: hs.sparsemax(x),
    "entmax15_loss": lambda x: hs.entmax15_loss(x, TARGET, reduction="none"),
    "entmax_bisect_loss(1.3)": lambda x: hs.entmax_bisect_loss(x, TARGET, 1.3, reduction="none"),
    "sparsemax_loss": lambda x: hs.sparsemax_loss(x, TARGET, reduction="none"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(HVP_FUNCTIONS))
def test_hessian_vector_products_are_finite_on_rows_with_exact_zeros(name, dtype, threshold_path):
    """The derivative of ``p ** (2 - alpha)`` at ``p = 0`` is ``inf``; times ``dp/dx = 0`` it must give 0, not NaN."""
    fn = HVP_FUNCTIONS[name]
    x = ROWS.to(dtype)
    assert bool((hs.entmax15(x) == 0).any(-1).all())  # every row has exact zeros
    weights = torch.linspace(-1, 1, x.shape[-1], dtype=dtype)
    scalar = lambda z: (fn(z) * (weights if fn(z).dim() > 1 else 1)).sum()  # noqa: E731
    _, hv = torch.autograd.functional.hvp(scalar, x, torch.randn_like(x))
    assert bool(torch.isfinite(hv).all()), hv
    if dtype == torch.float64:  # and equal to the finite difference of the (closed-form) gradient
        eps, v = 1e-6, torch.randn_like(x)
        grad = lambda z: torch.autograd.functional.vjp(scalar, z)[1]  # noqa: E731
        _, hv = torch.autograd.functional.hvp(scalar, x, v)
        torch.testing.assert_close(hv, (grad(x + eps * v) - grad(x - eps * v)) / (2 * eps), rtol=1e-5, atol=1e-6)


def test_entmax_hessian_on_the_support_is_the_closed_form():
    """1.5-entmax's Hessian on its support equals autograd through the closed form ``relu(z - tau)**2`` with
    ``tau = mean - sqrt(1/k - var)`` on that support (``z = x/2``), and is 0 off the support."""
    x = ROWS[:1].clone()
    v = torch.randn_like(x)
    _, hv = torch.autograd.functional.hvp(lambda z: hs.entmax15(z)[0, 1], x, v)
    support = hs.entmax15(x)[0] > 0
    # p = relu(x/2 - tau)**2 on a fixed support: p_1 as a function of the support entries only, by autograd
    idx = support.nonzero().squeeze(1)

    def restricted(z_support):
        z = z_support / 2
        k = z.numel()
        mean = z.mean()
        tau = mean - torch.sqrt(1 / k - ((z - mean) ** 2).mean())
        return (z - tau).clamp_min(0).pow(2)[(idx == 1).nonzero().item()]

    _, hv_ref = torch.autograd.functional.hvp(restricted, x[0, idx], v[0, idx])
    torch.testing.assert_close(hv[0, idx], hv_ref)
    assert hv[0, ~support].abs().max() == 0


@pytest.mark.parametrize("loss, options", [("sparsemax", {}), ("entmax_bisect", {"alpha": 1.3}),
                                           ("sparse_softmax", {"top_k": 3}), ("sparse_softmax", {})])
def test_fused_head_loss_refuses_double_backward_by_name(loss, options):
    torch.manual_seed(0)
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(12, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 12, (5,))
    fused = hs.fused_head_loss(hidden, weight, labels, loss, **options)
    dh, dw = torch.autograd.grad(fused, (hidden, weight), create_graph=True)  # first order with a graph still works
    plain = make_loss(loss, **options)(hidden @ weight.T, labels)
    ref = torch.autograd.grad(plain, (hidden, weight))
    torch.testing.assert_close((dh, dw), ref)
    for gradient, wrt in ((dh, hidden), (dw, weight), (dh, weight)):
        with pytest.raises(RuntimeError, match=r"fused_head_loss .* has no second derivative.*unfused loss"):
            torch.autograd.grad(gradient.square().sum(), wrt, retain_graph=True)
    # the unfused loss on the same logits has the exact second derivative
    assert gradgradcheck(lambda h: make_loss(loss, **options)(h @ weight.detach().T, labels), (hidden,))


def test_first_order_gradients_take_no_graph_path():
    """Without ``create_graph`` the backward builds no graph: the fast first-order path is the one that runs."""
    x = ROWS.float().requires_grad_()
    for fn in (hs.entmax15, lambda z: hs.entmax_bisect(z, 1.3), hs.taylor_softmax):
        (g,) = torch.autograd.grad((fn(x) * torch.arange(6.0)).sum(), x)
        assert not g.requires_grad
    (g,) = torch.autograd.grad(hs.entmax15_loss(x, TARGET), x)
    assert not g.requires_grad
