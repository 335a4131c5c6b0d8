"""The mapping functions on attention-sized float32 rows: one compiled kernel forward and one backward.

``sparsemax``, ``entmax15`` and ``entmax_bisect`` (a float alpha in [1.125, 2] or one per slice) route such rows
through :mod:`hf_sparsemax.mappings.compiled`; everything else keeps the eager solvers. Checked against the eager
path (itself checked against closed forms and the ``entmax`` package in test_mappings.py): values, gradients of the
input and of alpha, the masking / NaN conventions, and which path ran. Traced with ``aot_eager`` (conftest.py's
``compiled_kernels`` fixture).
"""

import contextlib

import pytest
import torch

import hf_sparsemax as hs
from hf_sparsemax.mappings import compiled

MIN = torch.finfo(torch.float32).min


@contextlib.contextmanager
def eager():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(compiled.ENVIRONMENT, "0")
        yield


def scores() -> torch.Tensor:
    """Causal scores with ties, a fully masked row, a row of -inf and a NaN row."""
    x = torch.randn(2, 3, 24, 40, generator=torch.Generator().manual_seed(0)) * 2
    x = x.masked_fill(torch.ones(24, 40, dtype=torch.bool).triu(17), MIN)
    x[0, 0, 3, :6] = 1.25  # ties at the top
    x[0, 1, 5] = MIN
    x[1, 0, 7] = float("-inf")
    x[1, 2, 9, 4] = float("nan")
    return x


MAPPINGS = {
    "sparsemax": lambda x, a: hs.sparsemax(x),
    "entmax15": lambda x, a: hs.entmax15(x),
    "entmax_bisect(1.3)": lambda x, a: hs.entmax_bisect(x, 1.3),
    "entmax_bisect(per head)": lambda x, a: hs.entmax_bisect(x, a),
}


def run(name, x, alpha, grad):
    x = x.clone().requires_grad_()
    a = alpha.clone().requires_grad_()
    out = MAPPINGS[name](x, a)
    inputs = [x, a] if "per head" in name else [x]
    return out, torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize("name", list(MAPPINGS))
def test_compiled_rows_equal_the_eager_solver(name, compiled_kernels):
    x, grad = scores(), torch.randn(2, 3, 24, 40, generator=torch.Generator().manual_seed(1))
    alpha = torch.tensor([1.2, 1.5, 1.9]).view(1, 3, 1, 1)
    with eager():
        expected, expected_grads = run(name, x, alpha, grad)
    assert not compiled_kernels
    out, grads = run(name, x, alpha, grad)
    assert compiled_kernels == ["solve_and_map", "output_vjp"] and not compiled._failed
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, equal_nan=True)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert out[0, 1, 5].eq(0).all() and out[1, 0, 7].eq(0).all()  # nothing to attend to: zeros
    assert out[1, 2, 9].isnan().all()  # NaN in, NaN out (the eager convention)


def test_other_layouts_dtypes_and_double_backward_keep_the_eager_path(compiled_kernels):
    x = scores().nan_to_num(nan=0.0)
    hs.sparsemax(x, dim=-2)  # not the last dim
    hs.entmax15(x.double())  # float64
    hs.entmax_bisect(x, 1.05)  # alpha below float32's precise range
    hs.entmax_bisect(x, 1.5, n_iter=3)  # a fixed number of steps, as documented
    hs.sparsemax(torch.randn(4, 3000))  # wider rows than attention's (a vocabulary): top candidates, eagerly
    assert not compiled_kernels
    leaf = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(hs.entmax15(leaf).square().sum(), leaf, create_graph=True)
    assert compiled_kernels == ["solve_and_map"]  # the forward; the backward with a graph stays differentiable
    (gg,) = torch.autograd.grad(g.sum(), leaf)
    with eager():
        leaf2 = x.clone().requires_grad_()
        (g2,) = torch.autograd.grad(hs.entmax15(leaf2).square().sum(), leaf2, create_graph=True)
        (gg2,) = torch.autograd.grad(g2.sum(), leaf2)
    torch.testing.assert_close(gg, gg2, rtol=1e-4, atol=1e-5)


def test_the_input_is_not_written_over(compiled_kernels):
    x = scores().nan_to_num(nan=0.0)
    kept = x.clone()
    for fn in (hs.sparsemax, hs.entmax15, lambda t: hs.entmax_bisect(t, 1.3)):
        fn(x)
    assert torch.equal(x, kept)


def test_a_new_alpha_in_the_same_process_gets_its_own_exact_weights(compiled_kernels, monkeypatch):
    """Inductor (the default backend), several alphas one after the other in one process. A Python float alpha that
    changes between calls would turn symbolic on its second value, which torch 2.13's inductor miscompiled (the
    weights of 1.2 after 1.3 were off by 0.17): every alpha but 2 and 1.5 reaches the kernel as a tensor, one graph
    for all of them, and each call's weights and gradients are the eager solver's."""
    monkeypatch.setattr(compiled, "BACKEND", "inductor")
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(3)) * 3
    grad = torch.randn(64, 96, generator=torch.Generator().manual_seed(4))
    torch._dynamo.utils.counters.clear()
    for alpha in (1.3, 1.2, 1.5, 1.7, 1.3):
        source = x.clone().requires_grad_()
        out = hs.entmax_bisect(source, alpha)
        got = torch.autograd.grad(out, source, grad)[0]
        with eager():
            reference = x.clone().requires_grad_()
            expected = hs.entmax_bisect(reference, alpha)
            expected_grad = torch.autograd.grad(expected, reference, grad)[0]
        with torch.no_grad():
            inference = hs.entmax_bisect(x, alpha)
        torch.testing.assert_close(inference, expected, rtol=1e-5, atol=1e-6, msg=f"alpha {alpha}, no grad")
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=f"alpha {alpha}")
        torch.testing.assert_close(got, expected_grad, rtol=1e-4, atol=1e-5, msg=f"alpha {alpha}")
    assert not compiled._failed, compiled._failed  # inductor built the kernels (a C++ compiler is present)
    assert compiled_kernels.count("solve_and_map") == 10
    # forward and backward graphs: one each for alpha 1.5 (a constant); for all the other alphas one backward and
    # one forward per pass count (4 passes for 1.2 and 1.3, 7 for 1.7: _sync_free.newton_steps)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 5
