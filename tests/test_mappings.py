"""The five probability mappings against independent references, closed forms and their properties."""

import math

import entmax
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from transformers import TopKLogitsWarper, TopPLogitsWarper

import hf_sparsemax as hs
from hf_sparsemax.mappings import _core


@pytest.fixture(params=["whole-row Newton", "top candidates"], autouse=True)
def threshold_path(request, monkeypatch):
    """Every test runs on both threshold solvers: short rows take the first, long rows the second."""
    if request.param == "top candidates":
        monkeypatch.setattr(_core, "SHORT_ROWS", 0)
    return request.param

MASKED = [float("-inf"), torch.finfo(torch.float32).min]

# every mapping, as f(x, dim), with the reference it must equal (None: no oracle)
MAPPINGS = {
    "sparsemax": (lambda x, d: hs.sparsemax(x, d), lambda x, d: entmax.sparsemax(x, d)),
    "entmax15": (lambda x, d: hs.entmax15(x, d), lambda x, d: entmax.entmax15(x, d)),
    "bisect13": (
        lambda x, d: hs.entmax_bisect(x, 1.3, d),
        lambda x, d: entmax.entmax_bisect(x, 1.3, d, n_iter=200),
    ),
    "bisect17": (
        lambda x, d: hs.entmax_bisect(x, 1.7, d),
        lambda x, d: entmax.entmax_bisect(x, 1.7, d, n_iter=200),
    ),
    "bisect105": (  # alpha near 1: solved in float64, whole-row Newton on short rows
        lambda x, d: hs.entmax_bisect(x, 1.05, d),
        lambda x, d: entmax.entmax_bisect(x.double(), 1.05, d, n_iter=200).to(x.dtype),
    ),
    "bisect11": (
        lambda x, d: hs.entmax_bisect(x, 1.1, d),
        lambda x, d: entmax.entmax_bisect(x.double(), 1.1, d, n_iter=200).to(x.dtype),
    ),
    "bisect25": (
        lambda x, d: hs.entmax_bisect(x, 2.5, d),
        lambda x, d: entmax.entmax_bisect(x.double(), 2.5, d, n_iter=200).to(x.dtype),
    ),
    "sparse_softmax_k5": (lambda x, d: hs.sparse_softmax(x, d, top_k=5), None),
    "sparse_softmax_p": (lambda x, d: hs.sparse_softmax(x, d, top_p=0.8), None),
    "taylor2": (lambda x, d: hs.taylor_softmax(x, d), None),
    "taylor4": (lambda x, d: hs.taylor_softmax(x, d, order=4), None),
}
SHIFT_INVARIANT = [name for name in MAPPINGS if not name.startswith("taylor")]


def warped_softmax(x, top_k=None, top_p=None):
    """The reference for sparse_softmax: transformers' decoding warpers, then softmax."""
    if top_k is not None:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p is not None:
        x = TopPLogitsWarper(top_p)(None, x)
    return torch.softmax(x, -1)


# ---------------------------------------------------------------- references


@pytest.mark.parametrize("name", ["sparsemax", "entmax15", "bisect105", "bisect11", "bisect13", "bisect17", "bisect25"])
@pytest.mark.parametrize("shape", [(7, 5), (3, 4, 33), (2, 1000), (16, 4096)])
@pytest.mark.parametrize("scale", [0.01, 1.0, 5.0])
def test_matches_entmax_package_float32(name, shape, scale):
    f, ref = MAPPINGS[name]
    torch.manual_seed(sum(shape))
    x = torch.randn(shape) * scale
    assert (f(x, -1) - ref(x, -1)).abs().max() <= 1e-6


@pytest.mark.parametrize("name", ["sparsemax", "entmax15", "bisect105", "bisect11", "bisect13", "bisect17", "bisect25"])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e2, 1e4])
def test_matches_entmax_package_float64_any_dim(name, scale):
    f, ref = MAPPINGS[name]
    torch.manual_seed(1)
    x = torch.randn(3, 50, 4, dtype=torch.float64) * scale
    for dim in (0, 1, -1):
        assert (f(x, dim) - ref(x, dim)).abs().max() <= 1e-10


def test_per_row_alphas_near_one_match_entmax_package():
    """Learned alphas start near 1 (the default recipe: 1.05): per-row alphas in [1.01, 1.3] on attention-like rows."""
    torch.manual_seed(4)
    x = torch.randn(6, 40, 257) * 3
    alpha = torch.linspace(1.01, 1.3, 6).view(6, 1, 1)
    ref = torch.stack([entmax.entmax_bisect(x[i].double(), float(alpha[i]), -1, n_iter=200) for i in range(6)])
    assert (hs.entmax_bisect(x, alpha) - ref.float()).abs().max() <= 1e-6
    assert (hs.entmax_bisect(x.double(), alpha.double()) - ref).abs().max() <= 1e-10


def test_alpha_near_one_on_long_rows_takes_whole_row_newton(monkeypatch):
    """Alphas below 1.125 have wide supports: rows of any length skip the top candidates (which would retry
    up to a sort) and still match the package (attention rows of 5000 keys, a per-row alpha too)."""
    def no_candidates(*args):
        raise AssertionError("took the top-candidate path")

    monkeypatch.setattr(_core, "solve_on_top", no_candidates)
    torch.manual_seed(6)
    x = torch.randn(8, 5000) * 2
    for alpha in (1.05, 1.1, torch.tensor([1.02, 1.05, 1.1, 1.12] * 2).view(8, 1)):
        ref = torch.stack([entmax.entmax_bisect(x[i].double(), float(a), -1, n_iter=200)
                           for i, a in enumerate(torch.as_tensor(alpha).expand(8, 1).flatten())])
        assert (hs.entmax_bisect(x, alpha) - ref.float()).abs().max() <= 1e-6


@pytest.mark.parametrize("shape", [(4, 1000), (2, 3, 70), (2, 3000)])
def test_support_larger_than_first_candidates(shape):
    """Rows whose support exceeds the first top-K candidates are solved again, exactly."""
    torch.manual_seed(0)
    x = torch.randn(shape) * 0.01  # nearly flat: support is (almost) everything
    x[0] = torch.linspace(0, 0.3, shape[-1])  # a long tail inside the support
    for name in ("sparsemax", "entmax15", "bisect13"):
        f, ref = MAPPINGS[name]
        out = f(x, -1)
        assert (out > 0).sum(-1).max() > 64
        assert (out - ref(x, -1)).abs().max() <= 1e-6


@pytest.mark.parametrize(
    "top_k,top_p", [(1, None), (10, None), (None, 0.5), (None, 0.95), (50, 0.9), (3, 0.3), (5000, None), (7, 1.0)]
)
def test_sparse_softmax_matches_transformers_warpers(top_k, top_p):
    torch.manual_seed(2)
    x = torch.randn(64, 3000) * 3
    assert (hs.sparse_softmax(x, top_k=top_k, top_p=top_p) - warped_softmax(x, top_k, top_p)).abs().max() <= 1e-6


@pytest.mark.parametrize("scale,top_p", [(0.1, 0.5), (1.0, 0.9), (1.0, 0.99), (2.0, 0.99), (4.0, 0.99)])
def test_large_nucleus_matches_float64_warper(scale, top_p):
    """Nuclei beyond the top-256 candidates (bucketed masses, no sort) keep exactly what transformers'
    TopPLogitsWarper keeps in float64, masked entries included (a float32 cumulative sum misses some rows)."""
    torch.manual_seed(5)
    x = torch.randn(64, 20000) * scale
    x[0, :100] = float("-inf")
    x[2, ::3] = torch.finfo(torch.float32).min
    out = hs.sparse_softmax(x, top_p=top_p)
    assert ((out > 0).sum(-1) > 256).sum() > 32  # most rows past the candidates
    warped = TopPLogitsWarper(top_p)(None, x.double())
    assert torch.equal(out > 0, (warped > float("-inf")) & (x > torch.finfo(torch.float32).min))
    assert (out.double() - torch.softmax(warped, -1)).abs().max() <= 1e-6


def test_sparse_softmax_nucleus_larger_than_first_candidates():
    torch.manual_seed(3)
    x = torch.randn(8, 5000) * 0.1  # flat: the 0.9 nucleus holds thousands of tokens
    out = hs.sparse_softmax(x, top_p=0.9)
    assert (out > 0).sum(-1).min() > 1000
    assert (out - warped_softmax(x, None, 0.9)).abs().max() <= 1e-6


def test_sparse_softmax_keeps_topk_ties_as_transformers_warper():
    x = torch.tensor([[3.0, 1.0, 3.0, 3.0, 0.0]])
    kept = hs.sparse_softmax(x, top_k=2) > 0
    assert kept.tolist() == [[True, False, True, True, False]]
    assert torch.equal(kept, TopKLogitsWarper(2)(None, x) > float("-inf"))


def test_sparse_softmax_without_options_is_softmax():
    x = torch.randn(5, 9)
    assert torch.allclose(hs.sparse_softmax(x), torch.softmax(x, -1), atol=1e-7)
    assert torch.allclose(hs.sparse_softmax(x, top_k=100), torch.softmax(x, -1), atol=1e-7)


@pytest.mark.parametrize("order", [2, 4, 6])
def test_taylor_softmax_closed_form(order):
    torch.manual_seed(order)
    x = torch.randn(6, 11, dtype=torch.float64) * 3
    f = sum(x**m / math.factorial(m) for m in range(order + 1))
    assert torch.allclose(hs.taylor_softmax(x, order=order), f / f.sum(-1, keepdim=True), atol=1e-12)


def test_taylor_softmax_huge_inputs_stay_finite():
    x = torch.tensor([[1e30, -1e30, 0.0], [3e38, 1.0, 2.0]])
    out = hs.taylor_softmax(x, order=8)
    assert torch.isfinite(out).all() and torch.allclose(out.sum(-1), torch.ones(2))
    assert torch.allclose(out[0], torch.tensor([0.5, 0.5, 0.0]))


# ---------------------------------------------------------------- closed forms and limits


def test_sparsemax_two_classes_closed_form():
    t = torch.linspace(-3, 3, 61)
    out = hs.sparsemax(torch.stack([t, torch.zeros_like(t)], -1))
    assert torch.allclose(out[:, 0], ((t + 1) / 2).clamp(0, 1), atol=1e-7)


def test_alpha_two_is_sparsemax_and_one_and_a_half_is_entmax15():
    torch.manual_seed(4)
    x = torch.randn(20, 300) * 2
    assert (hs.entmax_bisect(x, 2.0) - hs.sparsemax(x)).abs().max() <= 1e-6
    assert (hs.entmax_bisect(x, 1.5) - hs.entmax15(x)).abs().max() <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_alpha_to_one_is_softmax(dtype):
    torch.manual_seed(5)
    x = torch.randn(10, 100, dtype=dtype) * 2
    assert (hs.entmax_bisect(x, 1 + 1e-7) - torch.softmax(x, -1)).abs().max() <= 1e-5


def test_per_slice_alpha_tensor():
    torch.manual_seed(6)
    x = torch.randn(2, 3, 40)
    alpha = torch.tensor([1.2, 1.5, 2.0]).view(3, 1)
    out = hs.entmax_bisect(x, alpha)
    for i, a in enumerate((1.2, 1.5, 2.0)):
        assert torch.allclose(out[:, i], hs.entmax_bisect(x[:, i], a), atol=1e-7)
    out0 = hs.entmax_bisect(x.transpose(0, 2), alpha.T.unsqueeze(-1), dim=0)
    assert torch.allclose(out0, out.transpose(0, 2), atol=1e-7)


def test_n_iter_reaches_the_solver():
    torch.manual_seed(7)
    x = torch.randn(4, 200)
    rough, exact = hs.entmax_bisect(x, 1.3, n_iter=1), hs.entmax_bisect(x, 1.3)
    assert (rough - exact).abs().max() > 1e-4
    assert (hs.entmax_bisect(x, 1.3, n_iter=30) - exact).abs().max() <= 1e-6


# ---------------------------------------------------------------- properties


def arrays(draw, n_max=40):
    n = draw(st.integers(1, n_max))
    rows = draw(st.integers(1, 4))
    scale = draw(st.sampled_from([1e-4, 1e-1, 1.0, 10.0, 1e3]))
    values = draw(st.lists(st.floats(-5, 5, width=32), min_size=n * rows, max_size=n * rows))
    x = torch.tensor(values, dtype=torch.float64).view(rows, n) * scale
    if draw(st.booleans()):  # ties
        x[:, : n // 2] = x[:, :1]
    return x


@given(st.data(), st.sampled_from(list(MAPPINGS)))
def test_on_the_simplex(data, name):
    x = arrays(data.draw)
    out = MAPPINGS[name][0](x, -1)
    assert (out >= 0).all() and torch.allclose(out.sum(-1), torch.ones(len(x), dtype=x.dtype), atol=1e-9)


@given(st.data(), st.sampled_from(SHIFT_INVARIANT), st.floats(-100, 100))
def test_invariant_to_a_constant(data, name, c):
    x = arrays(data.draw)
    f = MAPPINGS[name][0]
    shifted, out = f(x + c, -1), f(x, -1)
    # same support and values up to the rounding of x + c
    assert (shifted - out).abs().max() <= 1e-9 * (1 + abs(c)) * (1 + x.abs().max()) ** 2 or (
        name.startswith("sparse_softmax") and ((shifted > 0) != (out > 0)).any()
    )


@given(st.data(), st.sampled_from(SHIFT_INVARIANT))  # Taylor's f is not monotone below its minimum
def test_order_preserving(data, name):
    x = arrays(data.draw)
    out = MAPPINGS[name][0](x, -1)
    bigger = x.unsqueeze(-1) > x.unsqueeze(-2)
    # x_i > x_j gives p_i >= p_j, up to the rounding of p (values in [0, 1]: a few ulps of 1). Entries 1e-39 apart
    # may come out 1 ulp in either order.
    slack = 4 * torch.finfo(out.dtype).eps
    assert (out.unsqueeze(-1) - out.unsqueeze(-2) >= -slack)[bigger].all()


@given(st.data(), st.sampled_from(list(MAPPINGS)), st.sampled_from(MASKED))
def test_masked_entries_are_excluded(data, name, fill):
    x = arrays(data.draw).float()
    if name.startswith("sparse_softmax"):  # which of several tied entries is kept depends on the row length
        assume(all(len(row.unique()) == len(row) for row in x))
    f = MAPPINGS[name][0]
    extra = data.draw(st.integers(1, 5))
    padded = torch.cat([x, torch.full((len(x), extra), fill)], -1)
    out = f(padded, -1)
    assert (out[:, x.shape[1]:] == 0).all()
    assert (out[:, : x.shape[1]] - f(x, -1)).abs().max() <= 1e-6


@given(st.data())
def test_entmax_family_agrees(data):
    """Two algorithms, one answer: closed-form sort-free sparsemax/entmax15 vs the Newton solver."""
    x = arrays(data.draw)
    assert torch.allclose(hs.entmax_bisect(x, 2.0), hs.sparsemax(x), atol=1e-9)
    assert torch.allclose(hs.entmax_bisect(x, 1.5), hs.entmax15(x), atol=1e-9)


@given(st.data(), st.sampled_from(["sparsemax", "entmax15", "bisect13", "taylor2"]))
def test_equal_scores_get_equal_probability(data, name):
    x = arrays(data.draw)
    out = MAPPINGS[name][0](x, -1)
    same = x.unsqueeze(-1) == x.unsqueeze(-2)
    assert torch.allclose(out.unsqueeze(-1).expand_as(same)[same], out.unsqueeze(-2).expand_as(same)[same])


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("name", list(MAPPINGS))
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gradcheck(name, dim):
    torch.manual_seed(8)
    x = (torch.randn(5, 6, 7, dtype=torch.float64) * 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: MAPPINGS[name][0](t, dim), (x,))


@pytest.mark.parametrize("shape", [(4, 9), (2, 3, 8)])
def test_gradcheck_alpha(shape):
    torch.manual_seed(9)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    alpha = (1.1 + 0.8 * torch.rand(shape[:-1] + (1,), dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda t, a: hs.entmax_bisect(t, a), (x, alpha))
    shared = torch.tensor(1.4, dtype=torch.float64, requires_grad=True)  # one alpha for all slices
    assert torch.autograd.gradcheck(lambda t, a: hs.entmax_bisect(t, a), (x, shared))


def test_backward_is_closed_form_sparsemax():
    torch.manual_seed(10)
    x = torch.randn(3, 20, requires_grad=True)
    g = torch.randn(3, 20)
    p = hs.sparsemax(x)
    (dx,) = torch.autograd.grad(p, x, g)
    s = (p > 0).float()
    expected = s * (g - (g * s).sum(-1, keepdim=True) / s.sum(-1, keepdim=True))
    assert torch.allclose(dx, expected, atol=1e-6)


# ---------------------------------------------------------------- conventions and edge cases


@pytest.mark.parametrize("name", list(MAPPINGS))
@pytest.mark.parametrize("fill", MASKED)
def test_fully_masked_rows_give_zeros_and_zero_grad(name, fill):
    x = torch.randn(3, 6)
    x[1] = fill
    x.requires_grad_()
    out = MAPPINGS[name][0](x, -1)
    assert (out[1] == 0).all() and torch.allclose(out[[0, 2]].sum(-1), torch.ones(2))
    out.backward(torch.randn_like(out))
    assert torch.isfinite(x.grad).all() and (x.grad[1] == 0).all()


@pytest.mark.parametrize("name", list(MAPPINGS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_stays_in_its_row(name, bad):
    x = torch.randn(3, 6)
    x[1, 2] = bad
    out = MAPPINGS[name][0](x, -1)
    assert torch.isnan(out[1]).any()
    assert torch.isfinite(out[[0, 2]]).all() and torch.allclose(out[[0, 2]], MAPPINGS[name][0](x[[0, 2]], -1))


@pytest.mark.parametrize("name", list(MAPPINGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_computed_in_float32(name, dtype):
    torch.manual_seed(11)
    x = (torch.randn(4, 300) * 3).to(dtype)
    x[0, :10] = torch.finfo(dtype).min
    f = MAPPINGS[name][0]
    out = f(x, -1)
    assert out.dtype == dtype
    assert torch.equal(out[1:], f(x[1:].float(), -1).to(dtype))
    assert (out[0, :10] == 0).all()  # finfo(dtype).min is masked, though a plain number in float32
    assert torch.equal(out[0, 10:], f(x[0, 10:].float(), -1).to(dtype))
    x.requires_grad_()
    f(x, -1).sum().backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("name", list(MAPPINGS))
def test_empty_size_one_and_non_contiguous(name):
    f = MAPPINGS[name][0]
    assert f(torch.empty(0, 5), -1).shape == (0, 5)
    assert f(torch.empty(3, 0), -1).shape == (3, 0)
    assert torch.equal(f(torch.tensor([[2.0], [-1.0], [float("-inf")]]), -1), torch.tensor([[1.0], [1.0], [0.0]]))
    x = torch.randn(6, 9)
    assert torch.allclose(f(x.t(), 0), f(x, 1).t()) and torch.allclose(f(x[:, ::2], -1), f(x[:, ::2].clone(), -1))


def test_top_k_larger_than_size_keeps_everything():
    x = torch.randn(2, 4)
    assert torch.allclose(hs.sparse_softmax(x, top_k=10**6), torch.softmax(x, -1))


@pytest.mark.parametrize(
    "call",
    [
        lambda: hs.sparsemax(torch.arange(4)),
        lambda: hs.entmax15(torch.tensor([True, False])),
        lambda: hs.sparsemax(torch.tensor(1.0)),
        lambda: hs.sparsemax(torch.randn(3), dim=1),
        lambda: hs.sparse_softmax(torch.randn(3), top_k=0),
        lambda: hs.sparse_softmax(torch.randn(3), top_k=-2),
        lambda: hs.sparse_softmax(torch.randn(3), top_k=2.5),
        lambda: hs.sparse_softmax(torch.randn(3), top_k=True),
        lambda: hs.sparse_softmax(torch.randn(3), top_p=0.0),
        lambda: hs.sparse_softmax(torch.randn(3), top_p=1.5),
        lambda: hs.sparse_softmax(torch.randn(3), top_p=-0.1),
        lambda: hs.sparse_softmax(torch.randn(3), top_p=float("nan")),
        lambda: hs.entmax_bisect(torch.randn(3), alpha=1.0),
        lambda: hs.entmax_bisect(torch.randn(3), alpha=0.5),
        lambda: hs.entmax_bisect(torch.randn(3), alpha=float("nan")),
        lambda: hs.entmax_bisect(torch.randn(2, 3), alpha=torch.tensor([[1.5], [1.0]])),
        lambda: hs.entmax_bisect(torch.randn(2, 3), alpha=torch.full((2, 3), 1.5)),
        lambda: hs.entmax_bisect(torch.randn(3), n_iter=0),
        lambda: hs.entmax_bisect(torch.randn(3), alpha="1.5"),
        lambda: hs.taylor_softmax(torch.randn(3), order=3),
        lambda: hs.taylor_softmax(torch.randn(3), order=0),
    ],
)
def test_bad_input_raises_value_error(call):
    with pytest.raises(ValueError):
        call()
