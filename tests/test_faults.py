"""Faults and edge cases, as a new user would try them: a right answer or a loud one, never a silent wrong one.

One NaN / ``+inf`` convention for every mapping, loss and processor: NaN or
``+inf`` anywhere in a slice makes that slice (its probabilities, its loss
item, its gradient) NaN and leaves the other slices exactly as they are alone.
Entries at ``-inf`` or at most ``finfo(dtype).min`` get probability 0, a fully
masked slice maps to zeros with zero gradient, and a loss whose target is such
an entry is ``+inf``. Also: half precision, empty tensors, bad options,
permutation equivariance (bf16 logits tie often). The CLI under a full disk and
SIGINT: ``test_faults_cli.py``; the lock and SIGKILL: ``test_cli_faults.py``.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hf_sparsemax as hs
from hf_sparsemax.decoding.generation import processor_for
from hf_sparsemax.losses.names import make_loss
from hf_sparsemax.mappings import _core, registry

NAN, INF = float("nan"), float("inf")

# every registered mapping with its kinds of options (sparse_softmax: plain, top_k, top_p and both)
OPTIONS = {
    "sparsemax": [{}],
    "entmax15": [{}],
    "entmax_bisect": [{"alpha": 1.3}, {"alpha": 2.5}],
    "normmax_bisect": [{"alpha": 1.5}, {"alpha": 3.0}],
    "budget_bisect": [{"budget": 1.0}, {"budget": 2.5}],  # slices sum to the budget
    "sparse_softmax": [{}, {"top_k": 3}, {"top_p": 0.8}, {"top_k": 3, "top_p": 0.8}],
    "taylor_softmax": [{"order": 2}],
    "perturb_max": [{"points": 32}, {"noise": "gumbel", "points": 32}],
    "am_softmax": [{}],
}
CASES = [(name, options) for name, sets in OPTIONS.items() for options in sets]
EXTRA = {  # options that do not go through the registry: fixed iterations, a tensor alpha
    "entmax_bisect(n_iter=3)": lambda x, dim=-1: hs.entmax_bisect(x, 1.3, dim, n_iter=3),
    "entmax_bisect(tensor alpha)": lambda x, dim=-1: hs.entmax_bisect(
        x, torch.full([*x.shape[:dim % x.dim()], 1, *x.shape[dim % x.dim() + 1:]], 1.4), dim),
    "normmax_bisect(tensor alpha)": lambda x, dim=-1: hs.normmax_bisect(
        x, torch.full([*x.shape[:dim % x.dim()], 1, *x.shape[dim % x.dim() + 1:]], 1.6), dim),
    "budget_bisect(tensor budget, n_iter=30)": lambda x, dim=-1: hs.budget_bisect(
        x, torch.full([*x.shape[:dim % x.dim()], 1, *x.shape[dim % x.dim() + 1:]], 1.5), dim, n_iter=30),
}


def case_id(case):
    name, options = case
    return name + "".join(f"-{k}={v}" for k, v in options.items())


def mapping(name, options):
    if name in EXTRA:
        return EXTRA[name]
    entry = registry.get(name)
    values = registry.option_values(entry.parse(options))
    return lambda x, dim=-1: entry.function(x, dim=dim, **values)


ALL = [*CASES, *((name, {}) for name in EXTRA)]


def test_every_registered_mapping_is_tried():
    assert set(OPTIONS) == set(registry.names())


@pytest.fixture(params=["short rows", "long rows"])
def length(request, monkeypatch):
    """Short rows take the whole-row Newton solver; long ones (here: every row) the top candidates."""
    if request.param == "long rows":
        monkeypatch.setattr(_core, "SHORT_ROWS", 0)
    return request.param


# ---------------------------------------------------------------- NaN / +inf and masks, mappings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [NAN, INF, "nan and -inf"])
@pytest.mark.parametrize("case", ALL, ids=case_id)
def test_nan_or_inf_makes_its_slice_nan_and_nothing_else(case, bad, dtype, length):
    f = mapping(*case)
    torch.manual_seed(0)
    x = (torch.randn(4, 7, 9) * 0.5).to(dtype)  # normalised along dim=1: slices x[i, :, j]
    clean = f(x, 1)
    x[1, 3, 2] = NAN if bad == "nan and -inf" else bad
    if bad == "nan and -inf":
        x[1, 5, 2] = -INF
    out = f(x, 1)
    assert out.dtype == dtype
    assert bool(torch.isnan(out[1, :, 2]).all())
    others = torch.ones_like(out, dtype=torch.bool)
    others[1, :, 2] = False
    ulp = torch.finfo(dtype).eps  # Newton stops when every row is done: a bit may move in another row
    torch.testing.assert_close(out[others], clean[others], rtol=ulp, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ALL, ids=case_id)
def test_masked_entries_and_fully_masked_slices(case, dtype, length):
    f = mapping(*case)
    lowest = torch.finfo(dtype).min
    x = (torch.randn(5, 8) * 0.5).to(dtype)
    x[0] = -INF  # fully masked: zeros, no NaN
    x[1] = lowest
    x[2, :3] = -INF
    x[3] = x[2]
    x[3, :3] = lowest
    x = x.requires_grad_()
    p = f(x)
    assert p.dtype == dtype and bool(torch.isfinite(p).all())
    assert p[:2].abs().max() == 0 and p[2:4, :3].abs().max() == 0
    total = case[1].get("budget", 1.5 if case[0].startswith("budget") else 1.0)
    torch.testing.assert_close(p[2:].float().sum(-1), torch.full((3,), total),
                               atol=1e-2 * total if dtype != torch.float32 else 1e-5, rtol=0)
    torch.testing.assert_close(p[2, 3:], p[3, 3:])  # -inf and finfo.min exclude alike
    (g,) = torch.autograd.grad((p.float() * torch.arange(8.0)).sum(), x)
    assert bool(torch.isfinite(g).all()) and g[:2].abs().max() == 0 and g[2:4, :3].abs().max() == 0


@pytest.mark.parametrize("case", ALL, ids=case_id)
def test_half_precision_is_computed_in_float32(case):
    f = mapping(*case)
    x = torch.randn(3, 40) * 2
    for dtype in (torch.float16, torch.bfloat16):
        low = x.to(dtype)
        torch.testing.assert_close(f(low), f(low.float()).to(dtype), atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("case", ALL, ids=case_id)
def test_empty_tensors_and_size_one_slices(case):
    f = mapping(*case)
    for shape in ((0, 5), (3, 0), (2, 0, 4)):
        x = torch.randn(shape, requires_grad=True)
        p = f(x)
        assert p.shape == x.shape
        p.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
    assert torch.equal(f(torch.randn(4, 1)), torch.ones(4, 1))


# ---------------------------------------------------------------- permutation equivariance (ties)


def logits(dtype):
    """Rows on the bf16 grid (many exact ties) or plain float32 rows, with a few masked entries."""
    values = st.floats(-4, 4, allow_nan=False, width=16).map(lambda v: v if dtype == torch.float32 else round(v, 1))
    row = st.lists(st.one_of(values, st.just(-math.inf)), min_size=2, max_size=40)
    return row.filter(lambda r: any(v > -math.inf for v in r))


# sparse_softmax's top_k / top_p keep every entry tied with the last kept one, so they are equivariant too
EQUIVARIANT = ALL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", EQUIVARIANT, ids=case_id)
def test_every_mapping_is_permutation_equivariant(case, dtype, length):
    f = mapping(*case)

    @given(row=logits(dtype), seed=st.integers(0, 2**16))
    def check(row, seed):
        x = torch.tensor([row], dtype=torch.float32).to(dtype)
        perm = torch.randperm(x.shape[-1], generator=torch.Generator().manual_seed(seed))
        a, b = f(x)[:, perm].float(), f(x[:, perm]).float()
        ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-23  # float summation order may move the last bit
        torch.testing.assert_close(a, b, rtol=2 * ulp, atol=1e-6)
        clear = torch.maximum(a, b) > 1e-5  # entries at the threshold itself may round either way
        assert torch.equal((a > 0)[clear], (b > 0)[clear])

    check()


def test_tied_entries_get_equal_probabilities():
    x = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.5, -1.0]]).to(torch.bfloat16)
    for case in ALL:
        p = mapping(*case)(x).float()
        assert p[0, 1] == p[0, 2] == p[0, 3], case


# ---------------------------------------------------------------- losses


LOSSES = {f"{name}_loss" + "".join(f"-{k}={v}" for k, v in o.items()): (name, o)
          for name, sets in OPTIONS.items() for o in sets if registry.get(name).loss}


def loss_fn(key):
    name, options = LOSSES[key]
    loss = make_loss(name, **options)
    if name == "am_softmax":  # cosines in [-1, 1]; NaN and inf kept as they are
        return lambda x, t, **kw: loss(torch.where(torch.isfinite(x), torch.tanh(x), x), t, **kw)
    return loss


LOSS_KEYS = [*LOSSES, "mapping_loss(entmax15)", "entmax_bisect_loss(tensor alpha)"]


def any_loss(key):
    if key == "mapping_loss(entmax15)":
        return lambda x, t, **kw: hs.mapping_loss(x, t, "entmax15", **kw)
    if key == "entmax_bisect_loss(tensor alpha)":
        return lambda x, t, **kw: hs.entmax_bisect_loss(x, t, torch.full(t.shape, 1.4), **kw)
    return loss_fn(key)


@pytest.mark.parametrize("bad", [NAN, INF])
@pytest.mark.parametrize("key", LOSS_KEYS)
def test_loss_item_with_nan_or_inf_is_nan_and_the_others_are_untouched(key, bad):
    fn = any_loss(key)
    torch.manual_seed(0)
    x = torch.randn(4, 6) * 0.3
    target = torch.tensor([1, 3, 0, 5])
    clean = fn(x, target, reduction="none")
    x[1, 2] = bad
    if key.startswith("am_softmax") and bad == INF:  # cosines outside [-1, 1]: refused, with the fix
        with pytest.raises(ValueError, match="cosine head"):
            fn(x, target, reduction="none")
        return
    x = x.requires_grad_()
    items = fn(x, target, reduction="none")
    assert bool(torch.isnan(items[1])) and torch.equal(items[[0, 2, 3]], clean[[0, 2, 3]].detach())
    (g,) = torch.autograd.grad(items.sum(), x)
    assert bool(torch.isnan(g[1]).all()) and bool(torch.isfinite(g[[0, 2, 3]]).all())
    assert bool(torch.isnan(fn(x, target)))  # mean: NaN, loudly


@pytest.mark.parametrize("key", [k for k in LOSS_KEYS if not k.startswith("am_softmax")])
def test_loss_of_a_target_at_an_excluded_entry_is_inf(key):
    """``-inf`` / ``finfo.min`` at the target, or a fully masked row: the target has probability 0."""
    fn = any_loss(key)
    x = torch.randn(5, 6) * 0.3
    target = torch.tensor([1, 3, 0, 5, 2])
    x[0, 1] = -INF
    x[1, 3] = torch.finfo(torch.float32).min
    x[2] = -INF
    x[3] = torch.finfo(torch.float32).min
    x = x.requires_grad_()
    items = fn(x, target, reduction="none")
    assert bool((items[:4] == INF).all()) and bool(torch.isfinite(items[4]))
    (g,) = torch.autograd.grad(items[4], x)
    assert bool(torch.isfinite(g).all())


def test_fused_head_loss_follows_the_convention():
    torch.manual_seed(0)
    hidden, weight = torch.randn(4, 8), torch.randn(20, 8)
    labels = torch.tensor([1, 2, 3, 4])
    for loss, options in (("sparsemax", {}), ("entmax15", {}), ("sparse_softmax", {"top_p": 0.9})):
        bad = hidden.clone()
        bad[2, 0] = NAN
        assert bool(torch.isnan(hs.fused_head_loss(bad, weight, labels, loss, **options)))
        bad[2, 0] = INF
        assert bool(torch.isnan(hs.fused_head_loss(bad, weight, labels, loss, **options)))
        ignored = labels.clone()
        ignored[2] = -100  # the bad token does not count: a finite loss, equal to the unfused one
        fused = hs.fused_head_loss(bad, weight, ignored, loss, **options)
        torch.testing.assert_close(fused, make_loss(loss, **options)(hidden @ weight.T, ignored))


@pytest.mark.parametrize("loss", ["cross_entropy", *registry.names("processor")])
def test_processors_follow_the_convention(loss):
    options = {"entmax_bisect": {"alpha": 1.3}, "sparse_softmax": {"top_p": 0.9},
               "perturb_max": {"points": 32}}.get(loss, {})
    processor = processor_for(loss, options)
    if processor is None:
        return  # cross-entropy decodes with transformers' own softmax
    scores = torch.randn(4, 30)
    clean = processor(None, scores.clone())
    scores[1, 4] = NAN
    scores[2] = -INF
    scores[3, 5] = INF
    out = processor(None, scores)
    assert bool(torch.isnan(out[1]).all()) and bool(torch.isnan(out[3]).all())
    assert bool((out[2] == -INF).all())  # nothing can be sampled: transformers' multinomial then refuses loudly
    torch.testing.assert_close(out[0], clean[0], rtol=1e-6, atol=1e-6)  # Newton stops when every row is done


# ---------------------------------------------------------------- bad options


BAD_OPTIONS = [
    ("sparse_softmax", {"top_k": 0}, "top_k must be a positive integer"),
    ("sparse_softmax", {"top_k": -3}, "top_k must be a positive integer"),
    ("sparse_softmax", {"top_k": 2.5}, "top_k must be a positive integer"),
    ("sparse_softmax", {"top_p": 0.0}, r"top_p must be a float in \(0, 1\]"),
    ("sparse_softmax", {"top_p": 1.5}, r"top_p must be a float in \(0, 1\]"),
    ("sparse_softmax", {"top_p": NAN}, r"top_p must be a float in \(0, 1\]"),
    ("entmax_bisect", {"alpha": 1.0}, "alpha must be a finite float > 1"),
    ("entmax_bisect", {"alpha": 0.5}, "alpha must be a finite float > 1"),
    ("entmax_bisect", {"alpha": INF}, "alpha must be a finite float > 1"),
    ("entmax_bisect", {"alpha": NAN}, "alpha must be a finite float > 1"),
    ("taylor_softmax", {"order": 3}, "positive even order"),
    ("taylor_softmax", {"order": 0}, "positive even order"),
    ("perturb_max", {"noise": "cauchy"}, "noise must be one of"),
    ("perturb_max", {"points": 1}, "points .* must be an integer >= 2"),
    ("am_softmax", {"margin": -0.1}, r"margin must be a float in \[0, 2\)"),
    ("am_softmax", {"scale": 0}, "scale must be a finite float > 0"),
]


@pytest.mark.parametrize("name, options, message", BAD_OPTIONS)
def test_bad_options_are_refused_with_a_sentence_everywhere(name, options, message):
    x, t = torch.randn(2, 5), torch.tensor([0, 1])
    entry = registry.get(name)
    with pytest.raises(ValueError, match=message):
        entry.function(x, **options)
    with pytest.raises(ValueError, match=message):
        entry.loss(x, t, **options)
    with pytest.raises(ValueError, match=message):
        make_loss(name, **options)
    with pytest.raises(ValueError, match=message):
        hs.MappingLogitsProcessor(name, **options)


def test_bad_tensor_alpha_and_inputs_are_refused():
    with pytest.raises(ValueError, match="alpha must be > 1 everywhere"):
        hs.entmax_bisect(torch.randn(2, 5), torch.tensor([[1.5], [1.0]]))
    with pytest.raises(ValueError, match="must broadcast"):
        hs.entmax_bisect(torch.randn(2, 5), torch.full((3, 1), 1.5))
    with pytest.raises(ValueError, match="floating-point"):
        hs.sparsemax(torch.arange(5))
    with pytest.raises(ValueError, match="out of range"):
        hs.entmax15(torch.randn(2, 5), dim=2)
    with pytest.raises(ValueError, match="outside \\[0, 5\\)"):
        hs.sparsemax_loss(torch.randn(2, 5), torch.tensor([0, 5]))
