"""The entmax package's whole public API has an equivalent here, checked against the package as the oracle.

- every public function, ``nn.Module`` and module of ``entmax`` has a named equivalent (a shim below maps each
  name onto hf_sparsemax; a name a future entmax release adds fails the coverage test until it is mapped), and
  docs/from-entmax.md lists each one;
- values and gradients of the mappings and losses against entmax's own (several shapes, dims, alphas, budgets);
- normmax_bisect and budget_bisect follow the shared conventions (masking, fully masked slices, half precision,
  NaN, any dim, empty tensors) and their closed-form Jacobians pass float64 gradcheck, alpha / budget too;
- the ``nn.Module`` forms of every registered mapping and loss pass each argument on.
"""

import inspect
import pathlib
import re

import entmax
import entmax.activations
import entmax.losses
import entmax.root_finding
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.autograd import gradcheck

import hf_sparsemax as hs
import hf_sparsemax.losses
import hf_sparsemax.mappings
from hf_sparsemax.mappings import modules
from hf_sparsemax.mappings import registry

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "from-entmax.md"
F64 = torch.float64
ENTMAX_REDUCTIONS = ("elementwise_mean", "sum", "none")  # the names entmax's loss classes accept


# ---------------------------------------------------------------- the shim: entmax's names on hf_sparsemax
# Each callable takes entmax's arguments and answers with hf_sparsemax. ``n_iter`` / ``ensure_sum_one`` are
# dropped: the threshold is solved exactly here. entmax's losses return one loss per item (reduction "none").

def _loss_module(cls):
    def make(*args, ignore_index=-100, reduction="elementwise_mean", **options):
        options.pop("n_iter", None)
        return cls(*args, ignore_index=ignore_index, reduction=reduction, **options)

    return make


SHIM = {
    "sparsemax": lambda X, dim=-1, k=None: hs.sparsemax(X, dim, k=k),
    "entmax15": lambda X, dim=-1, k=None: hs.entmax15(X, dim, k=k),
    "sparsemax_bisect": lambda X, dim=-1, n_iter=50, ensure_sum_one=True: hs.sparsemax_bisect(X, dim),
    "entmax_bisect": lambda X, alpha=1.5, dim=-1, n_iter=50, ensure_sum_one=True: hs.entmax_bisect(X, alpha, dim),
    "normmax_bisect": lambda X, alpha=2, dim=-1, n_iter=50: hs.normmax_bisect(X, alpha, dim),
    "budget_bisect": lambda X, budget=2, dim=-1, n_iter=50: hs.budget_bisect(X, budget, dim),
    "sparsemax_loss": lambda X, target, k=None: hs.sparsemax_loss(X, target, reduction="none", k=k),
    "entmax15_loss": lambda X, target, k=None: hs.entmax15_loss(X, target, reduction="none", k=k),
    "sparsemax_bisect_loss": lambda X, target, n_iter=50: hs.sparsemax_bisect_loss(X, target, reduction="none"),
    "entmax_bisect_loss": lambda X, target, alpha=1.5, n_iter=50: hs.entmax_bisect_loss(
        X, target, alpha, reduction="none"),
    "normmax_bisect_loss": lambda X, target, alpha=2, n_iter=50: hs.normmax_bisect_loss(
        X, target, alpha, reduction="none"),
    "Sparsemax": lambda dim=-1, k=None: hs.Sparsemax(dim, k),
    "Entmax15": lambda dim=-1, k=None: hs.Entmax15(dim, k),
    "SparsemaxBisect": lambda dim=-1, n_iter=None: hs.SparsemaxBisect(dim),
    "EntmaxBisect": lambda alpha=1.5, dim=-1, n_iter=50: hs.EntmaxBisect(alpha, dim),
    "NormmaxBisect": lambda alpha=2, dim=-1, n_iter=50: hs.NormmaxBisect(alpha, dim),
    "BudgetBisect": lambda budget=2, dim=-1, n_iter=50: hs.BudgetBisect(budget, dim),
    "SparsemaxLoss": _loss_module(hs.SparsemaxLoss),
    "SparsemaxBisectLoss": _loss_module(hs.SparsemaxBisectLoss),
    "Entmax15Loss": _loss_module(hs.Entmax15Loss),
    "EntmaxBisectLoss": _loss_module(hs.EntmaxBisectLoss),
    "NormmaxBisectLoss": _loss_module(hs.NormmaxBisectLoss),
}
# entmax's autograd Functions: implementation of a public function, whose equivalent is that function's
FUNCTIONS = {
    "SparsemaxFunction": "sparsemax", "Entmax15Function": "entmax15", "EntmaxBisectFunction": "entmax_bisect",
    "SparsemaxBisectFunction": "sparsemax_bisect", "NormmaxBisectFunction": "normmax_bisect",
    "BudgetBisectFunction": "budget_bisect", "SparsemaxLossFunction": "sparsemax_loss",
    "SparsemaxBisectLossFunction": "sparsemax_bisect_loss", "Entmax15LossFunction": "entmax15_loss",
    "EntmaxBisectLossFunction": "entmax_bisect_loss", "NormmaxBisectLossFunction": "normmax_bisect_loss",
}
MODULES = {"activations": hf_sparsemax.mappings, "root_finding": hf_sparsemax.mappings,
           "losses": hf_sparsemax.losses}


def entmax_public_names():
    """``{module name: public names}`` of the entmax package and its modules (defined in entmax, no ``_``)."""
    found = {}
    submodules = [m for m in vars(entmax).values() if inspect.ismodule(m) and m.__name__.startswith("entmax.")]
    for module in (entmax, *submodules):
        found[module.__name__] = {
            name for name, obj in vars(module).items() if not name.startswith("_")
            and str(getattr(obj, "__name__" if inspect.ismodule(obj) else "__module__", "")).startswith("entmax")}
    return found


def test_every_public_name_of_entmax_has_an_equivalent():
    found = entmax_public_names()
    assert set(found) == {"entmax", *(f"entmax.{m}" for m in MODULES)}
    names = set().union(*found.values()) - set(MODULES)
    assert names == set(SHIM) | set(FUNCTIONS), "map the new entmax names in SHIM (and docs/from-entmax.md)"
    for name in SHIM:  # the equivalent keeps the name, at the top level and in the matching module
        assert name in hs.__all__ and getattr(hs, name) is not None
        for module_name, module in MODULES.items():
            defined_there = getattr(getattr(entmax, module_name), name, None)
            if name[0].islower() and getattr(defined_there, "__module__", "") == f"entmax.{module_name}":
                assert getattr(module, name) is getattr(hs, name)
    assert set(FUNCTIONS.values()) <= set(SHIM)


def test_the_docs_page_maps_every_name():
    text = DOCS.read_text()
    for name in [*SHIM, *FUNCTIONS, *(f"entmax.{m}" for m in MODULES)]:  # `name(...)` or `name` in a table row
        assert re.search(rf"^\|.*`{re.escape(name)}[(`]", text, re.M), name


def test_the_readme_table_names_every_function_and_module():
    """README.md's short "Coming from entmax" table: every public function / class of entmax in some row, and
    each row's hf_sparsemax side names real attributes of the package (the tests above check their values)."""
    text = (DOCS.parents[1] / "README.md").read_text()
    section = text[text.index("## Coming from entmax"):text.index("## Read next")]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    entmax_side = {name for row in rows for name in re.findall(r"`(\w+)`", row[0])}
    assert entmax_side == set(SHIM)
    for row in rows:
        assert all(hasattr(hs, name) for name in re.findall(r"`hs\.(\w+)", row[1]))


X = torch.randn(4, 7, generator=torch.Generator().manual_seed(0), dtype=F64) * 2
TARGET = torch.tensor([0, 6, 3, 2])
SHIM_CALLS = [
    ("sparsemax", {}), ("sparsemax", {"k": 2}), ("entmax15", {"dim": 0}), ("entmax15", {"k": 3}),
    ("sparsemax_bisect", {}), ("entmax_bisect", {"alpha": 1.3}), ("entmax_bisect", {"alpha": 2.0, "dim": 0}),
    ("normmax_bisect", {}), ("normmax_bisect", {"alpha": 1.5}), ("normmax_bisect", {"alpha": 4.0, "dim": 0}),
    ("budget_bisect", {}), ("budget_bisect", {"budget": 3.5}), ("budget_bisect", {"budget": 1.5, "dim": 0}),
    ("sparsemax_loss", {}), ("sparsemax_loss", {"k": 2}), ("entmax15_loss", {"k": 3}),
    ("sparsemax_bisect_loss", {}), ("entmax_bisect_loss", {"alpha": 1.7}), ("normmax_bisect_loss", {}),
    ("normmax_bisect_loss", {"alpha": 1.4}),
    ("Sparsemax", {"dim": 0}), ("Entmax15", {"k": 2}), ("SparsemaxBisect", {}), ("EntmaxBisect", {"alpha": 1.2}),
    ("NormmaxBisect", {"alpha": 3.0}), ("BudgetBisect", {"budget": 2.5}),
    ("SparsemaxLoss", {}), ("SparsemaxLoss", {"reduction": "sum"}), ("SparsemaxBisectLoss", {"reduction": "none"}),
    ("Entmax15Loss", {"k": 5}), ("EntmaxBisectLoss", {"alpha": 1.3}),
    ("NormmaxBisectLoss", {"alpha": 2.5, "reduction": "sum"}),
]


def test_shim_calls_cover_every_name():
    assert {name for name, _ in SHIM_CALLS} == set(SHIM)


@pytest.mark.parametrize("name,kwargs", SHIM_CALLS, ids=[f"{n}-{k}" for n, k in SHIM_CALLS])
def test_the_shim_answers_as_entmax_does(name, kwargs):
    """entmax's call, as written for entmax, gives the same values and gradients through the shim."""
    ours, theirs = SHIM[name], getattr(entmax, name)
    if name[0].isupper():  # a module: construct, then call
        ours, theirs = ours(**kwargs), theirs(**kwargs)
        kwargs = {}
    is_loss = name.endswith(("_loss", "Loss"))
    x_ours, x_theirs = X.clone().requires_grad_(), X.clone().requires_grad_()
    out_ours = ours(x_ours, TARGET, **kwargs) if is_loss else ours(x_ours, **kwargs)
    out_theirs = theirs(x_theirs, TARGET, **kwargs) if is_loss else theirs(x_theirs, **kwargs)
    torch.testing.assert_close(out_ours, out_theirs, rtol=1e-9, atol=1e-9)
    weights = torch.linspace(-1, 2, out_ours.numel(), dtype=F64).reshape(out_ours.shape)
    (out_ours * weights).sum().backward()
    (out_theirs * weights).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-8, atol=1e-9)


# ---------------------------------------------------------------- the mappings against entmax, more widely


def oracle(fn):
    """entmax's function along any ``dim``, computed on the last dim of a contiguous view (float64)."""
    return lambda x, dim: fn(x.movedim(dim, -1).contiguous()).movedim(-1, dim)


MAPPINGS = {
    "sparsemax(k=3)": (lambda x, d: hs.sparsemax(x, d, k=3), oracle(lambda x: entmax.sparsemax(x, -1, k=3))),
    "entmax15(k=3)": (lambda x, d: hs.entmax15(x, d, k=3), oracle(lambda x: entmax.entmax15(x, -1, k=3))),
    "sparsemax_bisect": (lambda x, d: hs.sparsemax_bisect(x, d), oracle(lambda x: entmax.sparsemax_bisect(x))),
    **{f"normmax({a})": (lambda x, d, a=a: hs.normmax_bisect(x, a, d),
                         oracle(lambda x, a=a: entmax.normmax_bisect(x, a, -1, n_iter=120)))
       for a in (1.1, 1.3, 1.5, 2.0, 3.0, 6.0)},
    **{f"budget({b})": (lambda x, d, b=b: hs.budget_bisect(x, b, d),
                        oracle(lambda x, b=b: entmax.budget_bisect(x, b, -1, n_iter=120)))
       for b in (0.5, 1.0, 2.0, 2.5, 7.0)},
}


@pytest.mark.parametrize("name", sorted(MAPPINGS))
@pytest.mark.parametrize("shape,dim", [((7, 5), -1), ((3, 40, 4), 1), ((2, 3000), -1), ((6, 9), 0)])
def test_values_and_gradients_match_entmax(name, shape, dim):
    ours, theirs = MAPPINGS[name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=F64) * 2
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    p, ref = ours(xo, dim), theirs(xt, dim)
    torch.testing.assert_close(p, ref, rtol=0, atol=1e-10)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    p.backward(g)
    ref.backward(g)
    torch.testing.assert_close(xo.grad, xt.grad, rtol=1e-7, atol=1e-9)
    x32 = x.float()  # float32: within float32 resolution of the float64 answer on the same (rounded) input
    p32 = ours(x32, dim)
    assert p32.dtype == torch.float32 and (p32.double() - theirs(x32.double(), dim)).abs().max() <= 1e-6


@pytest.mark.parametrize("alpha", [1.2, 1.5, 2.0, 3.0])
def test_normmax_loss_matches_entmax_with_its_gradient(alpha):
    x = torch.randn(32, 50, generator=torch.Generator().manual_seed(2), dtype=F64) * 3
    target = torch.randint(0, 50, (32,), generator=torch.Generator().manual_seed(3))
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = hs.normmax_bisect_loss(xo, target, alpha, reduction="none")
    theirs = entmax.normmax_bisect_loss(xt, target, alpha, n_iter=120)
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-10)
    ours.sum().backward()
    theirs.sum().backward()
    torch.testing.assert_close(xo.grad, xt.grad, rtol=1e-9, atol=1e-10)
    assert bool((ours >= 0).all())
    separated = torch.zeros(1, 5, dtype=F64)
    separated[0, 2] = 1.0 + 1e-9  # ahead of the rest by more than 1: p = e_t, loss 0
    assert hs.normmax_bisect_loss(separated, torch.tensor([2]), alpha) == 0
    float32 = hs.normmax_bisect_loss(x.float(), target, alpha, reduction="none")
    assert float32.dtype == torch.float32 and (float32.double() - theirs).abs().max() <= 1e-5


def test_losses_take_ignore_index_and_mean_as_the_other_losses_here():
    """entmax's losses ignore ``ignore_index=-100`` and spell the mean ``"elementwise_mean"``; here they are as
    every other loss of the library."""
    x = X.clone().requires_grad_()
    target = torch.tensor([0, -100, 3, 2])
    for loss in (hs.normmax_bisect_loss, hs.sparsemax_bisect_loss, hs.NormmaxBisectLoss(), hs.SparsemaxBisectLoss()):
        items = loss(x, target, reduction="none") if not isinstance(loss, nn.Module) else None
        value = loss(x, target)
        if items is not None:
            assert items[1] == 0
            torch.testing.assert_close(value, items.sum() / 3)
        (grad,) = torch.autograd.grad(value, x)
        assert bool((grad[1] == 0).all())
    with pytest.raises(ValueError, match="float alpha"):
        hs.normmax_bisect_loss(X, TARGET, torch.tensor(1.5))


def test_k_only_says_where_the_search_starts():
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(4)) * 0.05  # wide supports: several retries
    for k in (1, 7, 100, 10_000):
        exact = dict(rtol=0, atol=1e-8)  # the same threshold, up to the rounding of another search order
        torch.testing.assert_close(hs.sparsemax(x, k=k), hs.sparsemax(x), **exact)
        torch.testing.assert_close(hs.entmax15(x, k=k), hs.entmax15(x), **exact)
        torch.testing.assert_close(hs.sparsemax_loss(x, TARGET[:3], k=k), hs.sparsemax_loss(x, TARGET[:3]), **exact)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="k must be"):
            hs.sparsemax(x, k=bad)
        with pytest.raises(ValueError, match="k must be"):
            hs.entmax15_loss(x, TARGET[:3], k=bad)


def test_sparsemax_bisect_with_a_fixed_number_of_steps_is_entmax_bisect_at_two():
    x = X.float()
    torch.testing.assert_close(hs.sparsemax_bisect(x, n_iter=3), hs.entmax_bisect(x, 2.0, n_iter=3))
    torch.testing.assert_close(hs.sparsemax_bisect(x, n_iter=60), hs.sparsemax(x))


# ---------------------------------------------------------------- gradients and conventions of the new mappings


def test_closed_form_jacobians_in_x_alpha_and_budget_pass_gradcheck():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(5), dtype=F64, requires_grad=True)
    alpha = torch.tensor([[1.3], [1.7], [2.0], [3.5]], dtype=F64, requires_grad=True)
    budget = torch.tensor([[1.3], [1.7], [2.6], [3.5]], dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, a: hs.normmax_bisect(x, a), (x, alpha))
    assert gradcheck(lambda x, a: hs.normmax_bisect(x.T, a.T, dim=0), (x, alpha))
    assert gradcheck(lambda x, b: hs.budget_bisect(x, b), (x, budget))
    shared = torch.tensor(1.6, dtype=F64, requires_grad=True)
    assert gradcheck(lambda x, a: hs.normmax_bisect(x, a), (x, shared))
    assert gradcheck(lambda x: hs.normmax_bisect_loss(x, TARGET[:4].clamp_max(5), 1.8), (x,))


NEW = {"normmax": lambda x, dim=-1: hs.normmax_bisect(x, 1.5, dim), "normmax2": hs.normmax_bisect,
       "budget": lambda x, dim=-1: hs.budget_bisect(x, 2.5, dim)}


@pytest.mark.parametrize("name", sorted(NEW))
@pytest.mark.parametrize("masked", [float("-inf"), torch.finfo(torch.float32).min])
def test_masked_entries_are_excluded_and_fully_masked_slices_are_zeros(name, masked):
    f = NEW[name]
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(6), requires_grad=True)
    padded = torch.cat([x, torch.full((3, 4), masked)], -1)
    padded = torch.cat([padded, torch.full((1, 12), masked)])  # a fully masked row
    p = f(padded)
    assert torch.equal(p[:3, 8:], torch.zeros(3, 4)) and torch.equal(p[3], torch.zeros(12))
    torch.testing.assert_close(p[:3, :8], f(x))
    (grad,) = torch.autograd.grad((p * torch.arange(12.0)).sum(), x)
    assert bool(torch.isfinite(grad).all())


@pytest.mark.parametrize("name", sorted(NEW))
def test_half_precision_nan_dims_and_shapes(name):
    f = NEW[name]
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(7))
    for dtype in (torch.float16, torch.bfloat16):
        low = f(x.to(dtype))
        assert low.dtype == dtype
        torch.testing.assert_close(low.float(), f(x.to(dtype).float()), rtol=0, atol=1e-2)
    bad = x.clone()
    bad[1, 3], bad[2, 0] = float("nan"), float("inf")
    out = f(bad)
    assert bool(torch.isnan(out[1:3]).all()) and torch.equal(out[[0, 3]], f(x)[[0, 3]])
    torch.testing.assert_close(f(x.T, dim=0), f(x).T)  # another dim, non-contiguous
    y = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(f(y, dim=1), f(y.transpose(1, 2)).transpose(1, 2))
    assert f(torch.empty(0, 5)).shape == (0, 5) and f(torch.empty(3, 0)).shape == (3, 0)
    one = f(torch.randn(3, 1))  # a size-1 dim: normmax gives 1, budget 2.5 > 1 entry: that entry 1
    assert torch.equal(one, torch.ones(3, 1))


def test_budget_semantics():
    x = torch.randn(5, 20, generator=torch.Generator().manual_seed(9), dtype=F64)
    for budget in (0.3, 1.0, 4.0, 19.5):
        p = hs.budget_bisect(x, budget)
        assert bool(((p >= 0) & (p <= 1)).all())
        torch.testing.assert_close(p.sum(-1), torch.full((5,), budget, dtype=F64))
    torch.testing.assert_close(hs.budget_bisect(x, 1.0), hs.sparsemax(x))
    gap = torch.tensor([[5.0, 3.0, 0.5, 0.2, -1.0]])
    assert torch.equal(hs.budget_bisect(gap, 2.0), torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(hs.budget_bisect(gap, 9.0), torch.ones(1, 5))  # infeasible: every entry, as entmax
    per_row = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]], dtype=F64)
    torch.testing.assert_close(hs.budget_bisect(x, per_row).sum(-1), per_row.squeeze(-1))
    for bad in (0.0, -1.0, float("inf"), float("nan"), "2", torch.tensor([1.0, 0.0])):
        with pytest.raises(ValueError, match="budget"):
            hs.budget_bisect(x, bad)
    with pytest.raises(ValueError, match="broadcast"):
        hs.budget_bisect(x, torch.ones(3, 1))


def test_normmax_semantics():
    x = torch.randn(5, 20, generator=torch.Generator().manual_seed(10), dtype=F64) * 2
    for alpha in (1.05, 1.5, 2.0, 10.0):
        p = hs.normmax_bisect(x, alpha)
        torch.testing.assert_close(p.sum(-1), torch.ones(5, dtype=F64))
        assert bool((p >= 0).all())
        # optimality: <p, x> - ||p||_alpha is at least that of nearby points of the simplex
        value = lambda q, a=alpha: (q * x).sum(-1) - torch.linalg.vector_norm(q, a, -1)  # noqa: E731
        for seed in range(3):
            q = p + 1e-3 * torch.rand(p.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
            assert bool((value(p) >= value(q / q.sum(-1, keepdim=True)) - 1e-12).all())
    assert torch.equal(hs.normmax_bisect(torch.tensor([[3.0, 1.0, 0.5]])), torch.tensor([[1.0, 0.0, 0.0]]))
    for bad in (1.0, 0.5, float("inf"), "2"):
        with pytest.raises(ValueError, match="alpha"):
            hs.normmax_bisect(x, bad)
    with pytest.raises(ValueError, match="n_iter"):
        hs.normmax_bisect(x, 2.0, n_iter=0)


# ---------------------------------------------------------------- nn.Module forms

MODULE_ARGS = {  # a non-default value of every argument, so each is seen to reach the function
    "sparsemax": {"dim": 0, "k": 2}, "entmax15": {"dim": 0, "k": 2}, "entmax_bisect": {"alpha": 1.3, "dim": 0,
    "n_iter": 4}, "normmax_bisect": {"alpha": 3.0, "dim": 0, "n_iter": 4}, "budget_bisect": {"budget": 1.5,
    "dim": 0, "n_iter": 4}, "sparse_softmax": {"top_k": 2, "top_p": 0.8, "dim": 0}, "taylor_softmax": {"order": 4,
    "dim": 0}, "perturb_max": {"noise": "gumbel", "points": 32, "dim": 0}, "am_softmax": {"margin": 0.2,
    "scale": 5.0, "dim": 0}, "sparsemax_bisect": {"dim": 0, "n_iter": 3},
}
LOSS_ARGS = {
    "sparsemax": {"k": 2, "reduction": "sum"}, "entmax15": {"k": 2, "reduction": "none"},
    "entmax_bisect": {"alpha": 1.3, "ignore_index": 1}, "normmax_bisect": {"alpha": 3.0, "reduction": "sum"},
    "sparse_softmax": {"top_k": 2, "top_p": 0.8, "ignore_index": 3}, "taylor_softmax": {"order": 4,
    "reduction": "none"}, "perturb_max": {"noise": "gumbel", "points": 32}, "am_softmax": {"margin": 0.2,
    "scale": 5.0, "reduction": "sum"}, "sparsemax_bisect": {"reduction": "none", "ignore_index": 0},
}


def test_every_mapping_and_loss_has_a_module_form_at_the_top_level():
    assert set(modules.MAPPING_MODULES) == set(registry.REGISTRY) | {"sparsemax_bisect"} == set(MODULE_ARGS)
    assert set(modules.LOSS_MODULES) == set(registry.names("loss")) | {"sparsemax_bisect"} == set(LOSS_ARGS)
    for cls in (*modules.MAPPING_MODULES.values(), *modules.LOSS_MODULES.values()):
        home = modules if cls.__module__ == modules.__name__ else hf_sparsemax.losses  # the API's loss classes
        assert cls.__name__ in hs.__all__ and getattr(hs, cls.__name__) is getattr(home, cls.__name__) is cls
        assert issubclass(cls, nn.Module)
    for name in ("SparsemaxLoss", "Entmax15Loss", "EntmaxBisectLoss", "SparseSoftmaxLoss"):  # the API's classes
        assert getattr(hs, name) is getattr(hf_sparsemax.losses, name)


@pytest.mark.parametrize("name", sorted(MODULE_ARGS))
def test_mapping_modules_pass_every_argument_on(name):
    cls = modules.MAPPING_MODULES[name]
    args = MODULE_ARGS[name]
    assert set(args) == set(inspect.signature(cls).parameters)
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(11)).tanh()
    module = cls(**args)
    torch.testing.assert_close(module(x), cls.function(x, **args), rtol=0, atol=0)
    assert all(f"{k}={v!r}" in repr(module) for k, v in args.items())
    positional = cls(*args.values())  # entmax's order: options, then dim, then the rest
    torch.testing.assert_close(positional(x), module(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(LOSS_ARGS))
def test_loss_modules_pass_every_argument_on(name):
    cls = modules.LOSS_MODULES[name]
    args = LOSS_ARGS[name]
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(12)).tanh()
    target = torch.tensor([0, 1, 2, 3, 4, 1])
    function = cls.function if hasattr(cls, "function") else cls.loss_fn
    torch.testing.assert_close(cls(**args)(x, target), function(x, target, **args), rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ENTMAX_REDUCTIONS)
@pytest.mark.parametrize("name", sorted(LOSS_ARGS))
def test_every_loss_class_takes_entmax_reduction_names(name, reduction):
    """Each loss class is built with each name entmax's loss classes take; where entmax has the class, values
    and gradients equal entmax's (``ignore_index=1``: entmax honours only an index >= 0), elsewhere the class
    equals its function with ``"elementwise_mean"`` read as ``"mean"``."""
    cls = modules.LOSS_MODULES[name]
    options = {k: v for k, v in LOSS_ARGS[name].items() if k not in ("reduction", "ignore_index")}
    target = torch.tensor([0, 1, 3, 1])
    x = X.tanh()  # within [-1, 1]: AM-softmax takes cosines
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = cls(**options, ignore_index=1, reduction=reduction)(x_ours, target)
    theirs_cls = getattr(entmax, cls.__name__, None)
    if theirs_cls is not None:
        theirs = theirs_cls(**options, ignore_index=1, reduction=reduction)(x_theirs, target)
    else:
        function = cls.function if hasattr(cls, "function") else cls.loss_fn
        ours_name = "mean" if reduction == "elementwise_mean" else reduction
        theirs = function(x_theirs, target, **options, ignore_index=1, reduction=ours_name)
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
    weights = torch.linspace(-1, 2, ours.numel(), dtype=F64).reshape(ours.shape)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-8, atol=1e-9)
    with pytest.raises(ValueError, match="reduction must be one of"):
        cls(**options, reduction="elementwise_sum")


def test_the_fused_head_loss_takes_entmax_mean_name_too():
    hidden = torch.randn(6, 4, generator=torch.Generator().manual_seed(14))
    weight = torch.randn(5, 4, generator=torch.Generator().manual_seed(15))
    labels = torch.tensor([0, 1, -100, 3, 4, 1])
    legacy = hs.FusedHeadLoss("sparsemax", reduction="elementwise_mean")
    assert legacy.reduction == "mean"
    torch.testing.assert_close(legacy(hidden, weight, labels), hs.FusedHeadLoss("sparsemax")(hidden, weight, labels))
    with pytest.raises(ValueError, match="reduction must be one of"):
        hs.FusedHeadLoss("sparsemax", reduction="none")  # the fused loss never holds one loss per item


def test_a_learned_alpha_or_budget_is_a_parameter_of_the_module():
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(13))
    for cls, value in ((hs.EntmaxBisect, 1.4), (hs.NormmaxBisect, 1.8), (hs.BudgetBisect, 2.5)):
        module = cls(nn.Parameter(torch.tensor(value)))
        (parameter,) = module.parameters()
        (module(x) * torch.arange(6.0)).sum().backward()
        assert parameter.grad is not None and parameter.grad != 0
        fixed = cls(torch.tensor(value))  # a plain tensor: a buffer that follows .to()
        assert not list(fixed.parameters()) and fixed.to(F64)(x.double()).dtype == F64
    for cls, bad in ((hs.EntmaxBisect, 1.0), (hs.NormmaxBisect, 0.9), (hs.BudgetBisect, 0.0),
                     (hs.SparseSoftmax, 0), (hs.NormmaxBisectLoss, 1.0)):
        with pytest.raises(ValueError):
            cls(bad)


def test_n_iter_and_per_slice_options_reach_the_solver():
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(14)) * 2
    for f in (lambda x, **k: hs.normmax_bisect(x, 1.5, **k), lambda x, **k: hs.budget_bisect(x, 3.5, **k)):
        rough, exact = f(x, n_iter=1), f(x)
        assert (rough - exact).abs().max() > 1e-4
        assert (f(x, n_iter=60) - exact).abs().max() <= 1e-6
    y = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(15))
    values = torch.tensor([1.2, 1.5, 3.0]).view(3, 1)
    for f in (hs.normmax_bisect, hs.budget_bisect):
        out = f(y, values)
        for i, v in enumerate(values.flatten().tolist()):
            torch.testing.assert_close(out[:, i], f(y[:, i], v), rtol=0, atol=1e-7)
        torch.testing.assert_close(f(y.transpose(0, 2), values.T.unsqueeze(-1), dim=0), out.transpose(0, 2))


@st.composite
def rows(draw):
    n, count = draw(st.integers(1, 30)), draw(st.integers(1, 3))
    scale = draw(st.sampled_from([1e-3, 1.0, 10.0, 1e3]))
    values = draw(st.lists(st.floats(-5, 5, width=32), min_size=n * count, max_size=n * count))
    x = torch.tensor(values, dtype=F64).view(count, n) * scale
    if draw(st.booleans()):  # ties
        x[:, : n // 2] = x[:, :1]
    return x


@given(rows(), st.sampled_from([1.05, 1.5, 2.0, 4.0]), st.floats(-100, 100))
def test_normmax_properties(x, alpha, shift):
    p = hs.normmax_bisect(x, alpha)
    assert bool((p >= 0).all()) and torch.allclose(p.sum(-1), torch.ones(len(x), dtype=F64), atol=1e-9)
    moved = hs.normmax_bisect(x + shift, alpha)  # invariant to a constant, up to the rounding of x + shift
    assert (moved - p).abs().max() <= 1e-9 * (1 + abs(shift)) * (1 + x.abs().max()) ** 2 or (
        alpha > 2 and ((moved > 0) != (p > 0)).any())  # a power below 1 magnifies an entry at the threshold
    bigger = x.unsqueeze(-1) > x.unsqueeze(-2)  # order preserving, to the ulp
    assert (p.unsqueeze(-1) >= p.unsqueeze(-2) - 4 * torch.finfo(F64).eps)[bigger].all()


@given(rows(), st.floats(0.1, 40))
def test_budget_properties(x, budget):
    p = hs.budget_bisect(x, budget)
    n = x.shape[-1]
    assert bool(((p >= 0) & (p <= 1)).all())
    torch.testing.assert_close(p.sum(-1), torch.full((len(x),), min(budget, n), dtype=F64), rtol=1e-9, atol=1e-9)
    bigger = x.unsqueeze(-1) > x.unsqueeze(-2)
    assert (p.unsqueeze(-1) >= p.unsqueeze(-2) - 4 * torch.finfo(F64).eps)[bigger].all()
    torch.testing.assert_close(hs.budget_bisect(x, 1.0), hs.sparsemax(x), rtol=0, atol=1e-9)



def test_budget_stops_at_the_root_of_its_piece():
    """A total that rounds just above the budget at the root must not send the search halving towards it."""
    x = torch.tensor([[0.2, -0.35, 0.55, -0.1, 0.9, -5.05]], dtype=F64)  # at the root the sum is 1.2 + 1 ulp
    expected = torch.tensor([[0.05, 0.0, 0.4, 0.0, 0.75, 0.0]], dtype=F64)
    torch.testing.assert_close(hs.budget_bisect(x, 1.2, n_iter=12), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(hs.budget_bisect(x, 1.2), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape,budget", [((6, 5000), 300.0), ((3, 3000), 2999.5), ((4, 20000), 0.5)])
def test_budget_supports_beyond_the_first_candidates(shape, budget):
    """Flat rows: the support reaches past the top candidates (and past a retry or two) and is still exact."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(16), dtype=F64) * 0.01
    ref = entmax.budget_bisect(x, budget, -1, n_iter=120)
    torch.testing.assert_close(hs.budget_bisect(x, budget), ref, rtol=0, atol=1e-10)
    x32 = x.float()
    assert (hs.budget_bisect(x32, budget).double() - entmax.budget_bisect(x32.double(), budget, -1, n_iter=120)
            ).abs().max() <= 1e-6


def test_normmax_attention_learns_its_alpha():
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0))
    hs.patch_model(model, attn="normmax_bisect", attn_options={"alpha": 1.5, "learn_alpha": True},
                   loss="normmax_bisect")
    ids = torch.randint(1, 24, (2, 6), generator=torch.Generator().manual_seed(17))
    out = model(input_ids=ids, labels=ids, output_attentions=True)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(2, 2, 6))
    out.loss.backward()
    alphas = [p for name, p in model.named_parameters() if "alpha" in name]
    assert alphas and all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in alphas)
