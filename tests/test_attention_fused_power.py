"""The fused kernel's row solver without libm's ``pow``: its own power function and the thresholds it gives.

``power`` in ``fused.c`` computes ``u ** e`` as ``2^(e log2 u)`` in double arithmetic (so that a loop of them
vectorises), with a proven relative error below ``(8 |y| + 4) 2^-53``, ``y = e log2 u``, and results below
``2^-1022`` flushed to 0. Checked here against libm's ``pow`` (torch, float64) over a million arguments, then through
the solver: Halley's steps on the candidates give the Python solvers' thresholds (float64, to 1e-14) and the
materialised mappings' weights for alphas near 1 (exponents near 100), exponents that are integers or halves
(alpha 1.25, 4/3, 1.5, 2 through the general solver), ties, masked and ``-inf`` keys, NaN / ``+inf`` rows, chunk
edges of the candidate test, and a learned alpha mixing closed-form and general heads.
"""

import pytest
import torch

import hf_sparsemax as hs
from hf_sparsemax.attention.cpu import fused as kernel
from test_attention_fused_alpha import MIN, assert_same_weights, float64_weights
from test_attention_kernel_safety import c_tau, hard_rows, python_tau

U = 2.0**-53  # double's unit roundoff
ALPHAS = [1.01, 1.05, 1.25, 4 / 3, 1.3, 1.5, 2.0]  # 1 / (alpha - 1): 100, 20, 4, 3, 10/3, 2, 1


def arguments() -> torch.Tensor:
    """Log-uniform u in [2^-70, 1], uniform in (0, 2), and the edges of the reduction (powers of 2, sqrt(2))."""
    g = torch.Generator().manual_seed(0)
    edges = [1.0, 0.5, 2.0**-1022, 2.0**0.5, 2.0**0.5 * (1 + 2.0**-52), 2.0**0.5 * (1 - 2.0**-52), 1 - 2.0**-53]
    return torch.cat([torch.exp2(-70 * torch.rand(1_000_000, generator=g, dtype=torch.float64)),
                      2 * torch.rand(100_000, generator=g, dtype=torch.float64).clamp_min(1e-300),
                      torch.tensor(edges, dtype=torch.float64)])


@pytest.mark.parametrize("e", [0.0, 0.5, 1.0, 2.0, 3.0, 7 / 3, 1 / 0.3 - 1, 19.0, 98.0, 99.0, 0.1234567, 1e-3,
                               -0.5, -1 / 3, -0.9])
def test_the_kernel_s_power_is_within_its_proven_bound_of_libm_s(e):
    """Every exponent the solver uses (``1 / (alpha - 1) - 1`` and ``- 2``, alpha in (1, 2]): the relative error
    stays within the bound proven in fused.c (plus libm's own half ulp); results below 2^-1020 are flushed or
    tiny; arguments whose power would pass 2^1000 are outside the domain (left out)."""
    u = arguments()
    got = kernel.kernel_power(u, e)
    if got is None:
        pytest.skip("no C compiler: the kernel is not built")
    reference = torch.pow(u, e)
    inside = reference <= 2.0**1000
    y = (e * torch.log2(u)).abs()
    normal = inside & (reference > 2.0**-1020)
    error = (got - reference).abs()
    assert (error[normal] <= ((8 * y + 4) * U + 2 * U)[normal] * reference[normal]).all()
    assert (error[inside & ~normal] <= 2.0**-1019).all()
    assert torch.isfinite(got[inside]).all() and (got[inside] >= 0).all()


def test_integer_exponents_are_exact_to_a_few_roundings():
    """Exponents 1 and 2 (alpha 1.5 and 2 through the general formula) against the exact products."""
    u = arguments()[:100_000]
    for e, exact in ((1.0, u), (2.0, u * u), (3.0, u * u * u)):
        got = kernel.kernel_power(u, e)
        if got is None:
            pytest.skip("no C compiler: the kernel is not built")
        ok = exact > 2.0**-1000
        assert ((got - exact).abs()[ok] <= 600 * U * exact[ok]).all()  # |y| <= 70 e: (8 |y| + 6) u


def awkward_rows(n: int = 48) -> torch.Tensor:
    """hard_rows (typical, ties, flat, one candidate, a tie at the top) with masked and -inf keys among them."""
    rows = hard_rows(n)
    rows[0, 3] = float("-inf")
    rows[1, :10] = float("-inf")
    rows[6, 5:20] = MIN
    rows[7, :-1] = MIN  # one key seen
    return rows


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("sort_below", [0, kernel.SORT_BELOW])  # alpha 1.5 and 2: Halley's solver, closed forms
def test_the_solver_gives_the_python_thresholds_for_special_and_general_exponents(alpha, sort_below):
    """Thresholds to 1e-14 of the Python solvers', the same support key for key, the weights of the float64
    mapping (alpha 1.01: weights ``u ** 100``, most of them far below float32's range)."""
    rows = awkward_rows()
    tau, p = c_tau(rows, alpha, sort_below)
    expected = python_tau(rows, alpha)
    torch.testing.assert_close(tau, expected, rtol=0, atol=1e-14)
    z = (rows.double() - rows.double().amax(-1, keepdim=True)) * (alpha - 1)
    assert ((p == 0) == (z <= expected[:, None])).all()
    reference = hs.entmax_bisect(rows.double(), alpha) if alpha != 2.0 else hs.sparsemax(rows.double())
    torch.testing.assert_close(p.double(), reference, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("alpha", [1.05, 1.3, 2.0])
def test_rows_with_nan_or_inf_give_nan_and_rows_that_see_nothing_give_zero(alpha):
    rows = awkward_rows()[:4].clone()
    rows[0, 7] = float("nan")
    rows[1, 2] = float("inf")
    rows[2] = MIN
    rows[3, :] = float("-inf")
    tau, p = c_tau(rows, alpha, 0)
    assert tau.isnan().all()
    assert p[:2].isnan().all() and (p[2:] == 0).all()


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33])
def test_the_candidate_test_s_chunks_miss_no_candidate(n):
    """A row whose only candidates sit at one position, for every position across the 16-score chunks (and
    rows of one key): the chunk test passes over the others and finds them."""
    for alpha in (1.3, 2.0):
        rows = torch.full((n, n), -50.0)
        rows[torch.arange(n), torch.arange(n)] = 0.0
        rows[torch.arange(n), (torch.arange(n) + 1) % n] = -0.5 / (alpha - 1) if n > 1 else 0.0
        tau, p = c_tau(rows, alpha, 0)
        torch.testing.assert_close(tau, python_tau(rows, alpha), rtol=0, atol=1e-14)
        assert_same_weights(p, float64_weights(rows, alpha))


def test_a_learned_alpha_mixing_closed_form_and_general_heads():
    """One alpha per query head (2 and 1.5: closed forms below SORT_BELOW candidates; 1.01, 1.05, 1.25, 4/3,
    1.3, 1.7: Halley's solver), grouped two heads a kv head: each row's threshold is its head's."""
    alphas = torch.tensor([2.0, 1.01, 1.5, 1.05, 1.25, 4 / 3, 1.3, 1.7]).view(1, 4, 2, 1, 1)
    rows = awkward_rows(40)[:12]
    scores = rows.repeat(8, 1).view(1, 4, 2, 12, 40)
    taus = torch.empty(4 * 2 * 12, dtype=torch.float64)
    out = kernel.block_rows(scores.view(1, 4, 24, 40).contiguous(), torch.eye(40).expand(1, 4, 40, 40),
                            slice(0, 40), alphas, taus=taus)
    assert out is not None
    assert_same_weights(out.view(scores.shape), float64_weights(scores, alphas))
    for head, alpha in enumerate(alphas.flatten().tolist()):
        expected = python_tau(rows, alpha)
        got = taus.view(8, 12)[head]
        torch.testing.assert_close(got, expected.to(got.dtype), rtol=0, atol=1e-14, msg=f"alpha {alpha}")
