"""Exact threshold solvers without a host sync, for the compiled path.

Used only while ``torch.compiler.is_compiling()``: the eager solvers in
:mod:`._core` stay as they are (they grow candidate sets with ``nonzero`` and
stop on ``bool(converged)``, one host sync per call, which is the fastest
choice eagerly). Under ``torch.compile`` a sync is a graph break and a
data-dependent shape a recompilation, so here every shape is fixed by the
input's shape and the data only chooses values:

1. A fixed amount of work: ``NEWTON_STEPS`` whole-row Newton passes on short
   rows (:func:`newton_certified`), or the exact solve on the top ``K``
   candidates on long ones (:func:`on_top`).
2. A per-row certificate that the answer is exact (see each function).
3. The rows without a certificate (rare) are solved again on the whole sorted
   row by an opaque custom op (:func:`exact_threshold`), so the answer is
   always exact and the common case never sorts.

A tensor ``alpha`` (learned per head) is solved in float64 here: the eager
path picks float32 when every alpha lies in [1.125, 2] (``precise_in_float32``, a host test).

Bisection (:func:`bisect_solve`) runs a fixed number of steps: its float64
bracket has width 1 and halves at least once a step, so ``MAX_STEPS = 50``
steps reach ``2**-50``, far below float32 resolution, with no test.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

SHORT_ROWS = 2048  # same split as the eager path: whole-row Newton up to here, top candidates beyond
NEWTON_STEPS = 7  # whole-row Newton passes before the certificate (entmax; quadratic convergence)
MICHELOT_STEPS = 6  # the same for sparsemax (Michelot's algorithm), from the start of :func:`level_bound`
LEVELS = 4  # sparsemax's start: the best closed form over the level sets {z > -2 ** -k}, k < LEVELS
MAX_STEPS = 50  # bisection: a bracket of width 1 halves to 2**-50 < 1e-13
DENSE_TOLERANCE_ULPS = 4  # the certificate of a Newton row: its last step at most this many ulp of 1 (as eagerly)
SOLVERS: dict[str, Callable] = {}  # the eager exact row solvers by name, filled in by sparsemax.py and entmax.py


def special_rows(top1: torch.Tensor, masked: float) -> torch.Tensor:
    """Rows that need no solve: fully masked, or holding NaN / ``+inf`` (their maximum says so)."""
    return (top1 <= masked) | torch.isnan(top1) | (top1 == float("inf"))


def row_shift(rows: torch.Tensor, masked: float) -> torch.Tensor:
    """``[rows, 1]``: what the solvers subtract from a row, its maximum (0 for a fully masked row; a row holding NaN
    or ``+inf`` has a NaN threshold, so its shift does not matter). The same bits as every solver's shift, so a
    saved threshold and the rows give back the weights without a saved shift."""
    top1 = rows.amax(-1, keepdim=True)
    return top1.masked_fill(special_rows(top1, masked), 0.0)


def mark_special_rows(tau: torch.Tensor, top1: torch.Tensor, masked: float) -> torch.Tensor:
    """``tau = +inf`` for fully masked rows (output 0) and NaN for rows whose maximum is NaN or ``+inf``."""
    tau = tau.masked_fill(top1 <= masked, float("inf"))
    return tau.masked_fill(torch.isnan(top1) | (top1 == float("inf")), float("nan"))


class Certified(NamedTuple):
    """What :func:`newton_certified` found, each ``[rows, 1]`` but ``weights``."""

    shift: torch.Tensor
    tau: torch.Tensor
    size: torch.Tensor
    done: torch.Tensor
    weights: torch.Tensor | None  # general alpha: the mapping's output from the last pass (None: closed forms)


def newton_steps(highest_alpha: float, dtype: torch.dtype = torch.float32) -> int:
    """Passes that certify attention-like rows for every alpha up to ``highest_alpha`` (alpha < 2) in ``dtype``
    (float64's certificate, 4 ulp of its own, takes one pass more).

    From the start of :func:`level_bound`, Halley's step (alpha <= 1.5) certified every row of a real model's
    scores (SmolLM2, 30 layers, 1024 tokens) and of random causal rows of 512-8192 keys in 3 passes at
    alpha <= 1.35 (8192 keys at 1.4: 99.3%) and in 4 at 1.5; Newton's step took 5 at 1.7. The rare row left
    uncertified is solved again by the exact fallback, so this chooses speed, never the answer."""
    steps = 3 if highest_alpha <= 1.35 else 4 if highest_alpha <= 1.5 else 5 if highest_alpha <= 1.75 else NEWTON_STEPS
    return steps + (dtype == torch.float64)


def newton_certified(rows: torch.Tensor, alpha: float | torch.Tensor, masked: float, steps: int | None = None):
    """:class:`Certified` ``(shift, tau, size, done, weights)`` by a fixed number of passes over whole rows.

    Newton on ``h(tau) = ||relu(z - tau)||_beta - 1`` with ``z = (alpha - 1)(x - max)``,
    ``beta = 1/(alpha - 1)``, from a lower bound (:func:`level_bound`, at least
    ``-1``), rises monotonically to the root
    (``h`` is convex for ``alpha <= 2``; alpha = 2 is Michelot's algorithm); where
    ``beta >= 2`` (alpha <= 1.5) Halley's step, from the second derivative
    ``sum u ** (beta - 2)`` of the same pass, replaces Newton's; a
    bracket ``[lo, hi]`` replaces a step that leaves it by a bisection step.
    ``steps`` passes (default ``MICHELOT_STEPS`` for sparsemax, ``NEWTON_STEPS``
    otherwise; :func:`newton_steps` by alpha). A row is ``done`` (certified exact) when

    - alpha = 2: the last pass kept the support of the one before, so ``tau``
      is the closed form ``(sum_S z - 1) / |S|`` on its own support ``S``;
    - alpha = 1.5: the closed form ``mean_S - sqrt(1/|S| - var_S)`` on the last
      support ``S`` exists and leaves exactly ``S`` above it;
    - other alphas: the last step moved ``tau`` (in ``[-1, 0]``) by at
      most 4 ulp of 1 in the work dtype, the noise floor of the sums (the
      eager solver's stopping rule). Their ``weights`` come from the last pass,
      ``u ** beta`` moved to the final ``tau`` to first order
      (``u ** beta - beta u ** (beta - 1) dtau``, off by ``O(dtau ** 2)``),
      instead of one more pass of transcendentals.
    """
    float_alpha = not isinstance(alpha, torch.Tensor)
    sparsemax, entmax15 = float_alpha and alpha == 2, float_alpha and alpha == 1.5
    am1 = alpha - 1
    wide = torch.float64
    top1 = rows.amax(-1, keepdim=True)
    special = special_rows(top1, masked)
    shift = top1.masked_fill(special, 0.0)
    z = rows - shift
    if not float_alpha or am1 != 1:
        z = z * am1
    a = am1.to(z.dtype) if isinstance(am1, torch.Tensor) else am1  # alpha - 1 in the work dtype
    a_wide = am1.to(wide) if isinstance(am1, torch.Tensor) else am1
    lo, hi = torch.full_like(shift, -1.0, dtype=wide), torch.zeros_like(shift, dtype=wide)
    tau = torch.where(special, lo, level_bound(z, a_wide, wide))
    count = previous = total = first = step = u = power = None
    if steps is None:
        steps = MICHELOT_STEPS if sparsemax else NEWTON_STEPS
    for pass_ in range(steps):
        at = tau  # the point this pass evaluates
        u = (z - at.to(z.dtype)).clamp_min(0)
        previous, count = count, torch.sign(u).sum(-1, keepdim=True).to(wide)  # u >= 0: the support size
        if sparsemax:  # h = sum(u) - 1, h' = -|S|
            total = u.sum(-1, keepdim=True).to(wide)
            above, step = total > 1, (total - 1) / count
        elif entmax15:  # beta = 2: the sums of u ** (beta - 1) and u ** (beta - 2) are sum(u) and |S|
            first = u.sum(-1, keepdim=True).to(wide)
            total = (u * u).sum(-1, keepdim=True).to(wide)
            norm = total.pow(a_wide)
            above, step = norm > 1, halley_or_newton(norm - 1, total, first, count, a_wide)
        else:
            # the derivative's u ** (1 / a - 1) from one log and one exp, and u ** (1 / a) = u * that: no pow,
            # no division, two transcendentals an entry (the cost of a pass; the certificate below decides)
            power = support_log_power(u, 1 / a - 1)[0]
            total = (u * power).sum(-1, keepdim=True).to(wide)
            slope = power.sum(-1, keepdim=True).to(wide)
            norm = total.pow(a_wide)
            curve = None  # Halley needs sum u ** (beta - 2); the last step only certifies: Newton's will do
            if pass_ < steps - 1:
                curve = torch.where(u > 0, power / u, 0).sum(-1, keepdim=True).to(wide)
            above, step = norm > 1, halley_or_newton(norm - 1, total, slope, curve, a_wide)
        lo, hi = torch.where(above, at, lo), torch.where(above, hi, at)
        proposal = at + step
        proposal = torch.where((proposal >= lo) & (proposal <= hi), proposal, (lo + hi) / 2)
        tau = torch.where(special | ~torch.isfinite(proposal), at, proposal)
    weights = None
    if sparsemax:
        tau, done = at, count == previous
    elif entmax15:  # closed form on the last support S, from u = z - at on S
        k = count.clamp_min(1)
        spread = 1 / k - (total / k - (first / k).square())  # 1/|S| - var_S
        closed = at + first / k - spread.clamp_min(0).sqrt()
        size = torch.sign((z - closed.to(z.dtype)).clamp_min(0)).sum(-1, keepdim=True).to(wide)
        done = (size == count) & (spread >= 0)
        tau, count = torch.where(done, closed, tau), torch.where(done, size, count)
    else:
        eps = torch.finfo(torch.float64 if rows.dtype == torch.float64 else torch.float32).eps
        done = (step.abs() <= DENSE_TOLERANCE_ULPS * eps) & torch.isfinite(step)
    if power is not None:  # u ** beta at the last pass's point, moved to the final tau; NaN rows stay NaN
        weights = (power * (u - (tau - at).to(z.dtype) / a)).clamp_min(0)
    tau = mark_special_rows(tau, top1, masked)
    if weights is not None:
        weights = torch.where(torch.isnan(tau), tau.to(z.dtype), weights)
    return Certified(shift, tau, count.long(), done | special, weights)


def level_bound(z: torch.Tensor, am1, wide: torch.dtype) -> torch.Tensor:
    """A start close below the threshold, from one pass of sums over ``z = (alpha - 1)(x - max)``, no power.

    For any subset ``S`` of a row, the power mean gives ``sum_S (z - t)_+ ** beta >= |S| ** (1 - beta)
    (sum_S z - |S| t) ** beta``, which is 1 at ``t_S = mean_S z - |S| ** -(alpha - 1)``: so ``t_S <= tau``
    (for sparsemax, ``(sum_S z - 1) / |S|``, equal to ``tau`` on the support). The best ``t_S`` over the level
    sets ``{z > -2 ** -k}``, ``k < LEVELS``, lands near ``tau``: sparsemax then needed 6 Michelot passes where
    rows took 10 from ``tau = -1`` (flat rows of 2048-8192 keys), alpha 1.3 three Halley passes where it took
    four or five. A start that rounding puts above ``tau`` only costs a pass (its step goes back below).
    """
    best = torch.full_like(z[:, :1], -1.0, dtype=wide)
    for k in range(LEVELS):
        inside = z > -(2.0 ** -k)
        size = inside.sum(-1, keepdim=True).to(wide).clamp_min(1)
        mean = torch.where(inside, z, 0).sum(-1, keepdim=True).to(wide) / size
        best = torch.maximum(best, mean - size.pow(-am1))
    return best


def halley_or_newton(h, total, slope, curve, a):
    """The step on ``N(tau) = S ** a - 1`` (``a = alpha - 1``, ``S = sum u ** beta``, ``h = N``) from the pass's
    sums ``slope = sum u ** (beta - 1)`` and ``curve = sum u ** (beta - 2)``: Halley's
    ``-2 N N' / (2 N'^2 - N N'')`` where ``beta >= 2`` (and ``curve`` is given), else Newton's ``-N / N'``, with
    ``N' = -S ** (a - 1) slope`` and ``N'' = (1 - 1/a) S ** (a - 2) slope^2 + (1/a - 1) S ** (a - 1) curve``."""
    at_power = total.pow(a - 1)  # S ** (a - 1)
    d1 = -at_power * slope
    if curve is None:
        return -h / d1
    d2 = (1 - 1 / a) * at_power / total * slope.square() + (1 / a - 1) * at_power * curve
    newton = -h / d1
    halley = -2 * h * d1 / (2 * d1.square() - h * d2)
    if not isinstance(a, torch.Tensor):
        return halley if a <= 0.5 else newton
    return torch.where(a <= 0.5, halley, newton)


def on_top(rows: torch.Tensor, solve: Callable, k0: int, masked: float, *row_args: torch.Tensor):
    """``(shift, tau, size, done)`` from the exact ``solve`` on the top ``k0`` entries of each row.

    ``solve(top, valid, *row_args) -> (tau - top_1, size)`` is exact for a row
    whose support is smaller than the number of candidates (or when they are
    the whole row): those rows are ``done``.
    """
    n = rows.shape[-1]
    k = min(k0, n)
    top = rows.topk(k, dim=-1).values.double()
    tau, size = solve(top, top > masked, *row_args)
    first = top[:, :1]
    shift = first.masked_fill(first <= masked, 0.0).to(rows.dtype)
    done = (size < k) | special_rows(first, masked) if k < n else torch.ones_like(size, dtype=torch.bool)
    return shift, mark_special_rows(tau, first, masked), size, done


def solver_name(solve: Callable) -> tuple[str, float, int]:
    """``(kind, alpha, n_iter)`` naming one of the exact row solvers (a custom op takes no callable)."""
    inner = getattr(solve, "func", solve)
    keywords = getattr(solve, "keywords", {})
    alpha = keywords.get("alpha")
    n_iter = keywords.get("n_iter")
    return inner.__name__, -1.0 if alpha is None else float(alpha), 0 if n_iter is None else int(n_iter)


@torch.library.custom_op("hf_sparsemax::exact_threshold", mutates_args=())
def exact_threshold(
    rows: torch.Tensor, tau: torch.Tensor, size: torch.Tensor, done: torch.Tensor, alpha_rows: torch.Tensor | None,
    kind: str, alpha: float, n_iter: int, masked: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tau, size)`` with the rows not ``done`` solved again exactly on their whole sorted row.

    An opaque op in the compiled graph: it runs eagerly inside it, sorts only
    the rows that need it (none in the common case), and its output shapes
    are its inputs' shapes. (``torch.cond`` would do the same, but dynamo then
    loses attributes that transformers' KV cache sets later in the same graph.)
    """
    tau, size = tau.clone(), size.clone()
    todo = (~done).squeeze(1).nonzero().squeeze(1)
    if todo.numel():
        top = rows.index_select(0, todo).sort(dim=-1, descending=True).values.double()
        if kind in ("sparsemax_solve", "entmax15_solve"):
            t, s = SOLVERS[kind](top, top > masked)
        else:
            a = alpha_rows.index_select(0, todo) if alpha_rows is not None else alpha
            t, s = SOLVERS["bisect_solve"](top, top > masked, a, None if n_iter == 0 else n_iter)
        tau[todo], size[todo] = mark_special_rows(t, top[:, :1], masked).to(tau.dtype), s.to(size.dtype)
    return tau, size


@exact_threshold.register_fake
def _(rows, tau, size, done, alpha_rows, kind, alpha, n_iter, masked):
    return torch.empty_like(tau), torch.empty_like(size)


def exact_fallback(rows, masked, solve: Callable, tau, size, done, *row_args):
    """``(tau, size)`` with the rows not ``done`` solved again by ``solve`` on the whole sorted row."""
    kind, alpha, n_iter = solver_name(solve)
    alpha_rows = row_args[0] if row_args else None
    return exact_threshold(rows, tau, size, done, alpha_rows, kind, alpha, n_iter, masked)


def find_threshold(rows, masked, alpha, solve: Callable, k0: int, *row_args):
    """Sync-free :func:`._core.find_threshold`: ``(shift, tau, size)``, exact, each ``[rows, 1]``."""
    n = rows.shape[-1]
    wide = not isinstance(alpha, torch.Tensor) and near_one(alpha)  # wide supports: whole rows at any length
    if (n <= SHORT_ROWS or wide) and (isinstance(alpha, torch.Tensor) or 1 < alpha <= 2):
        shift, tau, size, done, _ = newton_certified(rows, alpha, masked)
    else:
        shift, tau, size, done = on_top(rows, solve, k0, masked, *row_args)
    tau, size = exact_fallback(rows, masked, solve, tau, size, done, *row_args)
    return shift, tau, size


def near_one(low: float) -> bool:
    """Whether an alpha of ``low`` is below 1.125: supports are then wide (the whole row as alpha -> 1), so top
    candidates would retry up to a sort; whole-row Newton runs on rows of any length instead (eager and compiled).
    A literal, not a module-level float: ``torch.compile(dynamic=True)`` would read that as a symbolic input."""
    return low < 1.125


def solve_on_top(rows, solve: Callable, k0: int, masked: float, *row_args):
    """Sync-free :func:`._core.solve_on_top`: the top ``k0`` candidates, whole rows where they do not suffice."""
    shift, tau, size, done = on_top(rows, solve, k0, masked, *row_args)
    tau, size = exact_fallback(rows, masked, solve, tau, size, done, *row_args)
    return shift, tau, size


def bisect_solve(top: torch.Tensor, valid: torch.Tensor, alpha: float | torch.Tensor, n_iter: int | None):
    """Sync-free :func:`.entmax.bisect_solve`: ``n_iter`` (or ``MAX_STEPS``) safeguarded Newton steps, no test.

    Newton where ``beta >= 1`` and the step stays in the bracket, bisection
    otherwise; every step at least halves the bracket ``[lo, hi]`` of width 1.
    ``top`` need not be sorted.
    """
    am1 = alpha.double() - 1 if isinstance(alpha, torch.Tensor) else alpha - 1
    beta = 1 / am1
    newton_rows = beta >= 1
    z = ((top - top.amax(-1, keepdim=True)) * am1).masked_fill(~valid, float("-inf"))
    tau = lo = torch.full_like(top[:, :1], -1.0)
    hi = torch.zeros_like(lo)
    for _ in range(MAX_STEPS if n_iter is None else n_iter):
        u = (z - tau).clamp_min(0)
        powered = torch.where(u > 0, u.pow(beta), 0)
        total = powered.sum(-1, keepdim=True)
        norm = total.pow(am1)
        above = norm > 1
        lo, hi = torch.where(above, tau, lo), torch.where(above, hi, tau)
        slope = torch.where(u > 0, powered / u.clamp_min(torch.finfo(u.dtype).tiny), 0).sum(-1, keepdim=True)
        newton = tau + (norm - 1) * (total / norm) / slope
        tau = torch.where((newton >= lo) & (newton <= hi) & newton_rows, newton, (lo + hi) / 2)
    return tau, (z > tau).sum(-1, keepdim=True)


def support_log_power(u: torch.Tensor, exponent) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u ** exponent on u > 0, 0 elsewhere, NaN kept; log u)`` from one log and one exp (no ``pow``, which
    costs about as much as both together on CPU)."""
    log_u = torch.log(u)  # -inf off the support
    return torch.where(u > 0, torch.exp(log_u * exponent), u * 0), log_u  # u * 0: 0, or NaN for a NaN entry


def power_map(rows, shift, tau, am1: torch.Tensor):
    """``(p, s, log u)`` of a tensor ``alpha = 1 + am1``: ``u = relu(am1 (rows - shift) - tau)``,
    ``s = u ** (1 / am1 - 1)`` (``= p ** (2 - alpha)``, the Jacobian's weights) from one log and one exp, and
    ``p = u s`` (``= u ** (1 / am1)``): two transcendentals an entry where ``pow`` twice costs about three times
    as much. 0 off the support, NaN kept."""
    am1 = am1.to(rows.dtype)
    u = ((rows - shift) * am1 - tau.to(rows.dtype)).clamp_min(0)
    s, log_u = support_log_power(u, 1 / am1 - 1)
    return u * s, s, log_u


def threshold_map(rows, shift, tau, scale=1.0, power=1.0) -> torch.Tensor:
    """:func:`._core.threshold_map` in one piece (the compiler fuses it; no blocks whose count depends on the shape)."""
    o = (rows - shift)
    if isinstance(scale, torch.Tensor) or scale != 1:
        o = o * scale
    o = (o - tau.to(rows.dtype)).clamp_min(0)
    if isinstance(power, torch.Tensor) or power not in (1, 2):
        return o.pow(power)
    return o * o if power == 2 else o
