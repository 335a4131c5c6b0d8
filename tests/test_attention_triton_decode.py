"""The Triton decoding kernel (hf_sparsemax/attention/gpu/triton_decode.py): exact thresholds against a cache.

Without a GPU the kernels run under Triton's interpreter (set before triton is imported), so the shapes are small.
Checked against the materialised mapping in float64 on the same inputs, with the value rows the identity where
the weights themselves are compared (the same exact zeros, the weights to float32 rounding), and against the torch
decoding path (:func:`hf_sparsemax.attention.blocked.decode.decode_attention`) on the same inputs: sparsemax, 1.5-entmax,
alpha 1.1 to 1.9 and per-head alphas, one and several query rows, grouped heads, every mask a decoding step meets
(boolean and additive), half-precision caches and strided cache views, ties and flat rows, a single candidate,
rows that see nothing, NaN, many candidates, several splits of the keys; and the refusals.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (the kernels import it on first use)
pytest.importorskip("triton")

import hf_sparsemax as hs  # noqa: E402
from hf_sparsemax.attention.gpu import triton_decode as module  # noqa: E402
from hf_sparsemax.attention.blocked.decode import decode_attention  # noqa: E402
from hf_sparsemax.attention.gpu.triton_decode import triton_decode  # noqa: E402
from hf_sparsemax.mappings import registry  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
# the interpreter computes -inf - -inf on masked lanes (NumPy warns)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
B, H, H_KV, N, D = 3, 4, 2, 96, 16
SCALING = 0.5
MIN = torch.finfo(torch.float32).min
ALPHAS = {"sparsemax": 2.0, "entmax15": 1.5, "alpha 1.3": 1.3, "per head": torch.tensor([1.1, 1.5, 1.9, 2.0])}


def inputs(rows: int, keys: int = N, seed: int = 0, dtype=torch.float32, identity: bool = True, batch: int = B):
    """Queries, keys and values (``V = I``: each output row is that row's weights, unless not ``identity``)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, H, rows, D, generator=g) * 1.2
    k = torch.randn(batch, H_KV, keys, D, generator=g) * 1.2
    v = torch.eye(keys).expand(batch, H_KV, keys, keys) if identity else torch.randn(batch, H_KV, keys, D, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype).contiguous()


def seen_of(mask, shape):
    if mask is None:
        return torch.ones(shape, dtype=torch.bool)
    if mask.dtype == torch.bool:
        return mask.expand(shape)
    return (mask > torch.finfo(mask.dtype).min).expand(shape)


def reference(q, k, v, mask, alpha):
    """``[B, H, q, Dv]`` of the materialised mapping in float64 (the eager exact solvers); zeros where a row sees
    nothing."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = q.double() @ k.transpose(-1, -2) * SCALING
    seen = seen_of(mask, scores.shape)
    if mask is not None and mask.dtype != torch.bool:
        scores = scores + mask.double().masked_fill(mask <= torch.finfo(mask.dtype).min, 0.0)
    scores = scores.masked_fill(~seen, torch.finfo(torch.float64).min)
    if isinstance(alpha, torch.Tensor):
        p = hs.entmax_bisect(scores, alpha.double().view(1, -1, 1, 1))
    else:
        p = hs.sparsemax(scores) if alpha == 2.0 else hs.entmax15(scores) if alpha == 1.5 else hs.entmax_bisect(
            scores, alpha)
    p = p * seen.any(-1, keepdim=True)
    return p @ v


def torch_path(q, k, v, mask, alpha):
    """``[B, H, q, Dv]`` of the torch decoding path on the same inputs (a boolean mask made additive, as the
    attention interface does)."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, torch.finfo(q.dtype).min)
    learned = isinstance(alpha, torch.Tensor)
    name = "entmax_bisect" if learned else {2.0: "sparsemax", 1.5: "entmax15"}.get(alpha, "entmax_bisect")
    with torch.no_grad():
        out = decode_attention(q, k, v, mask, scaling=SCALING, alpha=alpha.view(1, -1, 1, 1) if learned else None,
                               fixed_alpha=None if learned else alpha, threshold=registry.get(name).threshold)
    return out.transpose(1, 2)


def run(q, k, v, mask, alpha, **options):
    on = lambda t: t if t is None or not isinstance(t, torch.Tensor) else t.to(DEVICE)  # noqa: E731
    with torch.no_grad():
        return triton_decode(on(q), on(k), on(v), on(mask), alpha=on(alpha), scaling=SCALING, **options).cpu()


def check(out, q, k, v, mask, alpha, rtol=2e-5, atol=1e-6, msg=None):
    """The same exact zeros as the float64 formula, the values to rounding, and the torch path's output (in the
    values' dtype: rounded to half where the cache is)."""
    expected = reference(q, k, v, mask, alpha)
    assert out.shape == expected.shape and out.dtype == q.dtype, msg
    assert ((out == 0) == (expected == 0)).all(), msg
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol, msg=msg)
    by_torch = torch_path(q, k, v, mask, alpha)
    assert ((out == 0) == (by_torch == 0)).all(), msg
    if by_torch.dtype != out.dtype:
        out, rtol, atol = out.to(by_torch.dtype), 1e-2, 4e-3
    torch.testing.assert_close(out.double(), by_torch.double(), rtol=rtol, atol=atol, msg=msg)


def mixed_mask(rows: int, keys: int = N) -> torch.Tensor:
    """Additive ``[B, 1, rows, keys]``: sequence 0 sees every key, 1 is left-padded, 2 has a sliding window."""
    seen = torch.ones(B, 1, rows, keys, dtype=torch.bool)
    seen[1, ..., :9] = False
    seen[2, ..., : keys - 20] = False
    return torch.zeros(seen.shape).masked_fill(~seen, MIN)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("setup", list(ALPHAS))
def test_the_weights_are_exact(setup, rows):
    q, k, v = inputs(rows)
    mask = mixed_mask(rows)
    check(run(q, k, v, mask, ALPHAS[setup]), q, k, v, mask, ALPHAS[setup], msg=setup)


def decode_masks(rows: int, keys: int = N) -> dict:
    seen = torch.ones(B, 1, rows, keys, dtype=torch.bool)
    padded = seen.clone()
    padded[1, ..., :5], padded[2, ..., :11] = False, False
    window = seen.clone()
    window[..., : keys - 16] = False
    unfilled = seen.clone()
    unfilled[..., keys - 30:] = False  # a static cache's slots not written yet
    nothing = padded.clone()
    nothing[2, ..., 0, :] = False  # a row that sees no key: zeros
    per_head = torch.rand(B, H, rows, keys, generator=torch.Generator().manual_seed(3)) > 0.3
    additive = lambda keep, dtype=torch.float32: torch.zeros(keep.shape, dtype=dtype).masked_fill(  # noqa: E731
        ~keep, torch.finfo(dtype).min)
    return {"bool left padding": padded, "additive left padding": additive(padded), "sliding window": window,
            "unfilled slots": additive(unfilled), "per head": per_head, "a row that sees nothing": additive(nothing),
            "bfloat16 additive": additive(window & padded, torch.bfloat16),
            "additive values": additive(padded) + torch.linspace(-1.0, 0.5, keys)}


def test_every_mask_family():
    q, k, v = inputs(2)
    for name, mask in decode_masks(2).items():
        alpha = 1.3 if "additive" in name else 2.0
        out = run(q, k, v, mask, alpha)
        check(out, q, k, v, mask, alpha, msg=name)
        if name == "a row that sees nothing":
            assert (out[2, :, 0] == 0).all() and (out[2, :, 1] != 0).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(dtype):
    """Half queries and caches: scores, threshold and ``P V`` in float32 (as the torch path), output in half."""
    q, k, v = inputs(1, dtype=dtype, identity=False)
    mask = mixed_mask(1).to(dtype).masked_fill(mixed_mask(1) == MIN, torch.finfo(dtype).min)
    out = run(q, k, v, mask, 1.5)
    expected = reference(q, k, v, mask, 1.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, torch_path(q, k, v, mask, 1.5).to(dtype), rtol=1e-2, atol=1e-2)
    weights = run(*inputs(1, dtype=dtype)[:2], torch.eye(N).expand(B, H_KV, N, N).to(dtype), None, 2.0)
    exact = reference(*inputs(1, dtype=dtype)[:2], torch.eye(N).expand(B, H_KV, N, N), None, 2.0)
    assert ((weights == 0) == (exact == 0)).all()  # the same exact zeros: the scores are float32 products


def test_a_float32_query_against_a_bfloat16_cache():
    q, k, v = inputs(3)
    k, v = k.bfloat16(), v.bfloat16()
    check(run(q, k, v, None, torch.tensor([1.2, 1.5, 1.7, 2.0])), q, k, v, None, torch.tensor([1.2, 1.5, 1.7, 2.0]))


def test_strided_cache_views_and_queries():
    """A static cache's filled part, a cache stored ``[B, n, H_kv, D]``, and queries transposed from ``[B, q, H, D]``:
    all read through their strides."""
    q, k, v = inputs(2, identity=False)
    static_k, static_v = torch.zeros(B, H_KV, N + 13, D), torch.zeros(B, H_KV, N + 13, D)
    static_k[:, :, :N], static_v[:, :, :N] = k, v
    token_major = k.transpose(1, 2).contiguous().transpose(1, 2)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    for name, (qq, kk, vv) in {"static": (q, static_k[:, :, :N], static_v[:, :, :N]),
                               "token major": (q_view, token_major, v.transpose(1, 2).contiguous().transpose(1, 2))
                               }.items():
        assert not kk.is_contiguous()
        check(run(qq, kk, vv, None, 1.5), q, k, v, None, 1.5, msg=name)


def test_head_sizes_that_are_no_power_of_two():
    """``D = 20`` for queries and keys, ``Dv = 12`` for values (tiles padded and masked)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, H, 2, 20, generator=g), torch.randn(1, H_KV, 70, 20, generator=g), torch.randn(
        1, H_KV, 70, 12, generator=g)
    check(run(q, k, v, None, 1.5), q, k, v, None, 1.5)


def test_ties_flat_rows_and_a_single_candidate():
    """Batch row 0: every key alike (a flat row: uniform weights, every key a candidate); 1: two keys tied at the
    maximum far above the rest (weight 1/2 each); 2: one key far above the rest (the only candidate: weight 1)."""
    q, k, v = inputs(1, keys=40)
    k[0] = k[0, :, :1]
    k[1, :, 3] = k[1, :, 17] = q[1, 0, 0] * 4
    k[2, :, 5] = q[2, 0, 0] * 4
    q[1:, :] = q[1:, :1]
    for alpha in (2.0, 1.5, 1.1):
        out = run(q, k, v, None, alpha)
        check(out, q, k, v, None, alpha, msg=str(alpha))
        torch.testing.assert_close(out[0], torch.full_like(out[0], 1 / 40))
        assert (out[1, :, :, [3, 17]] - 0.5).abs().max() < 1e-6 and (out[2, :, :, 5] == 1).all()


def test_nan_gives_nan_rows_as_the_torch_path():
    q, k, v = inputs(1, identity=False)
    q[0, 1, 0, 0] = float("nan")  # query head 1 of sequence 0: a row of NaN scores
    k[1, 0, 7] = 0.0
    k[1, 0, 7, 0], q[1, :2, 0, 0] = float("inf"), 1.0  # +inf scores: kv head 0's queries of sequence 1
    for alpha in (2.0, 1.3):
        out, by_torch = run(q, k, v, None, alpha), torch_path(q, k, v, None, alpha)
        assert out[0, 1].isnan().all() and out[1, :2].isnan().all() and not out[2].isnan().any()
        assert (out.isnan() == by_torch.isnan()).all()
        torch.testing.assert_close(out.nan_to_num(), by_torch.nan_to_num(), rtol=1e-5, atol=1e-6)


def test_many_candidates_several_splits_and_many_rows(monkeypatch):
    """Candidates beyond one solver block (``SOLVE_BLOCK`` made small), the keys split over several programs, and
    16 query rows a head (64 rows a kv head: four row blocks)."""
    monkeypatch.setattr(module, "SOLVE_BLOCK", 16)
    q, k, v = inputs(1, keys=130, batch=1)
    q = q * 0.2  # flat rows: many candidates
    for alpha, splits in ((2.0, 3), (1.5, 1), (1.2, 2)):
        check(run(q, k, v, None, alpha, splits=splits), q, k, v, None, alpha, msg=f"{alpha} {splits}")
    q, k, v = inputs(16, keys=24, identity=False, batch=1)
    mask = decode_masks(16, 24)["per head"][:1]
    check(run(q, k, v, mask, 2.0, splits=1), q, k, v, mask, 2.0)


def test_refusals():
    q, k, v = (t.to(DEVICE) for t in inputs(1, identity=False))
    with pytest.raises(ValueError, match="grad"):
        triton_decode(q.requires_grad_(), k, v, None, alpha=2.0, scaling=1.0)
    q = q.detach()
    with pytest.raises(ValueError, match="alpha"):
        triton_decode(q, k, v, None, alpha=1.0, scaling=1.0)
    with pytest.raises(ValueError, match="one value a query head"):
        triton_decode(q, k, v, None, alpha=torch.ones(3, device=DEVICE) * 1.5, scaling=1.0)
    with pytest.raises(ValueError, match="at most 16"):
        triton_decode(q.expand(B, H, 17, D), k, v, None, alpha=2.0, scaling=1.0)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        triton_decode(q.double(), k, v, None, alpha=2.0, scaling=1.0)
    with pytest.raises(ValueError, match="broadcast"):
        triton_decode(q, k, v, torch.ones(B, 1, 1, N - 1, dtype=torch.bool, device=DEVICE), alpha=2.0, scaling=1.0)
    with pytest.raises(ValueError, match="kv heads"):
        triton_decode(q[:, :3], k, v, None, alpha=2.0, scaling=1.0)


def test_the_routing_and_the_kernel_check_one_predicate():
    """``kernel="auto"`` raised on a decoding call whose mask is float64 or longer than the keys (a static
    cache's slots): the routing's reasons accepted both, the kernel's own check refused them. Now both read one
    predicate (:func:`triton_decode.reasons`): what the routing sends is served (the exact weights), what the
    kernel refuses the routing leaves to the torch path ("auto": None) and ``triton_decode`` raises with the same
    reasons."""
    from hf_sparsemax.attention import routing
    from hf_sparsemax.attention.gpu.triton_attention import not_supported_reasons

    q, k, v = (t.to(DEVICE) for t in inputs(1, identity=False))
    additive = mixed_mask(1)
    wide = additive.double().masked_fill(additive == MIN, torch.finfo(torch.float64).min)
    longer = torch.cat([additive, torch.full((B, 1, 1, 8), MIN)], -1)  # unwritten slots past the keys
    served = {"float64 mask": (wide, wide), "longer additive mask": (longer, additive),
              "longer float64 mask": (torch.cat([wide, wide[..., :5]], -1), wide),
              "longer boolean mask": (torch.cat([additive == 0, torch.ones(B, 1, 1, 3, dtype=torch.bool)], -1),
                                      additive == 0)}
    for name, (mask, seen) in served.items():
        mask = mask.to(DEVICE)
        assert not_supported_reasons(q, k, v, mask, alpha=2.0, mapping="sparsemax", decoding=True) == [], name
        with torch.no_grad():
            out = routing.triton_route(None, q, k, v, mask, kernel="auto", mapping="sparsemax", scaling=SCALING,
                                       dropout=0.0, softcap=None, position_bias=None, sinks=None, causal=False,
                                       weights=False, options=None, learned=None)
        check(out.cpu(), q.cpu(), k.cpu(), v.cpu(), seen, 2.0, msg=name)
    refused = {"shorter mask": dict(mask=additive[..., :-1]), "integer mask": dict(mask=additive.long()),
               "mask on the batch of 2": dict(mask=additive[:2]), "alpha 2.5": dict(alpha=2.5),
               "alphas out of range": dict(alpha=torch.tensor([1.5, 2.5, 1.5, 1.5])),
               "alpha a head short": dict(alpha=torch.full((H - 1,), 1.5)), "17 rows": dict(q=q.expand(B, H, 17, D)),
               "float64 query": dict(q=q.double()), "head sizes": dict(k=k[..., :8], v=v[..., :8])}
    for name, change in refused.items():
        call = dict(q=q, k=k, v=v, mask=None, alpha=2.0) | change
        call = {key: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for key, t in call.items()}
        reasons = not_supported_reasons(call["q"], call["k"], call["v"], call["mask"], alpha=call["alpha"],
                                        decoding=True)
        assert reasons, name
        with torch.no_grad():
            with pytest.raises(ValueError) as error:
                triton_decode(call["q"], call["k"], call["v"], call["mask"], alpha=call["alpha"], scaling=SCALING)
            assert all(reason in str(error.value) for reason in reasons), (name, reasons, error.value)
            if name not in ("17 rows", "alpha 2.5"):  # routed to the prefill kernel; the mapping's alpha
                learned = (lambda a=call["alpha"]: a) if isinstance(call["alpha"], torch.Tensor) else None
                assert routing.triton_route(
                    None, call["q"], call["k"], call["v"], call["mask"], kernel="auto", mapping="entmax_bisect",
                    scaling=SCALING, dropout=0.0, softcap=None, position_bias=None, sinks=None, causal=False,
                    weights=False, options=None, learned=learned) is None, name


def test_offsets_past_two_to_the_31_are_where_64_bit_arithmetic_puts_them(monkeypatch):
    """The kernels computed offsets as int32 products (a row's scores at ``row * keys``), which wrap once
    ``B H q n`` passes 2^31 (8 GiB of scores). Without 8 GiB: each launch of a call with 2^14 query rows and
    139264 keys runs under the interpreter as its last program only (program ids int32, as a GPU gives them),
    its loads, stores and atomics recorded instead of made (the scratch buffers a float each); the scores the
    scoring launch writes, the candidates the solver writes and the scores the values launch reads must lie at the
    offsets the int64 formula gives (row r, key n: ``r keys + n``)."""
    if CUDA:
        pytest.skip("the interpreter's program ids and memory operations are patched (a machine without a GPU)")
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder, handle = interpreter.interpreter_builder, interpreter.TensorHandle
    heads, keys, splits = 1 << 14, 128 * 17 * 64, 128  # 2^14 x 139264 scores: 2.28e9, past 2^31
    launch = {"ids": (0, 0), "name": None}
    seen = []  # (kernel, op, dtype, shape, addresses where the mask is set)

    def record(op, ptrs, mask):
        addresses = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)] if mask is not None else ptrs.data
        seen.append((launch["name"], op, ptrs.get_element_ty(), ptrs.data.shape, addresses.astype(np.int64)))

    fills = {}  # base address -> the value its loads give (the others 0)

    def load(ptrs, mask, other, cache_policy, is_volatile):
        record("load", ptrs, mask)
        dtype = interpreter._get_np_dtype(ptrs.get_element_ty())
        value = np.zeros(ptrs.data.shape, dtype=dtype)
        for base, fill in fills.items():
            value[ptrs.data == base] = fill
        if other is not None:
            value = np.where(mask.data, value, other.data).astype(dtype)
        return handle(value, ptrs.get_element_ty())

    monkeypatch.setattr(builder, "create_get_program_id",
                        lambda axis: handle(np.array([launch["ids"][axis]], dtype=np.int32), tl.int32))
    monkeypatch.setattr(builder, "create_masked_load", load)
    monkeypatch.setattr(builder, "create_masked_store", lambda ptrs, value, mask, policy: record("store", ptrs, mask))
    monkeypatch.setattr(builder, "create_atomic_rmw", lambda op, ptr, val, mask, sem, scope: handle(
        np.full(ptr.data.shape, launch["ids"][1], dtype=np.int32), tl.int32))  # the last split finishes last

    class LastProgram:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launch.update(ids=tuple(size - 1 for size in grid) + (0,) * (2 - len(grid)),
                              name=self.kernel.fn.__name__)
                return self.kernel[(1,) * len(grid)](*args, **kwargs)
            return run

    kernels = module._kernels()
    monkeypatch.setattr(module, "_kernels", lambda: type("Kernels", (), {
        name: LastProgram(getattr(kernels, name)) for name in ("scores_kernel", "solve_kernel", "values_kernel")}))
    scratch = {}

    def workspace(device, dtype, sizes, zeros=False):
        parts = scratch[dtype] = tuple(torch.zeros(1, dtype=dtype) for _ in sizes)
        if dtype == torch.float64:
            fills[parts[1].data_ptr()] = -1.0  # tau = -1: every weight live (the values launch reads them all)
        return parts

    monkeypatch.setattr(module, "_workspace", workspace)
    q = torch.randn(1, heads, 1, D)
    k, v = torch.randn(1, 1, keys, D), torch.randn(1, 1, keys, D)
    with torch.no_grad():
        triton_decode(q, k, v, None, alpha=2.0, scaling=SCALING, splits=splits)
    assert launch["name"] == "values_kernel" and launch["ids"] == (heads // 16 - 1, splits - 1)
    scores, candidates = scratch[torch.float32][0].data_ptr(), scratch[torch.float64][0].data_ptr()
    split_len = keys // splits
    rows = np.arange(heads - 16, heads, dtype=np.int64)  # the last row block's rows (the last row of the solver)
    split_keys = np.arange((splits - 1) * split_len, keys, dtype=np.int64)

    def offsets(kernel, op, dtype, base, size):  # of the [rows, keys] tiles
        found = [a for name, o, t, shape, a in seen
                 if name == kernel and o == op and t == dtype and shape == (module.BLOCK_ROWS, module.BLOCK_KEYS)]
        got = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        return np.unique((got - base) // size)

    expected = np.unique(rows[:, None] * keys + split_keys[None, :])
    assert expected.max() >= 1 << 31  # past int32
    np.testing.assert_array_equal(offsets("scores_kernel", "store", tl.float32, scores, 4), expected)
    np.testing.assert_array_equal(offsets("values_kernel", "load", tl.float32, scores, 4), expected)
    solved = [a for name, o, t, shape, a in seen if name == "solve_kernel" and o == "store" and t == tl.float64
              and shape == (module.SOLVE_BLOCK,)]
    got = np.unique((np.concatenate(solved) - candidates) // 8)
    np.testing.assert_array_equal(got, (heads - 1) * keys + np.arange(keys, dtype=np.int64))


def test_calls_in_flight_together_share_no_split_counts(monkeypatch):
    """The values launch's counts of finished splits were one buffer per device, kept at zero between
    calls, so two calls in flight on two streams counted into each other's (a row block summed early, or never:
    its output left unwritten). Now each call has its own counts, zeroed: a second call made while the first one's
    values launch is about to run gets other counts, and both answer exactly."""
    kernels = module._kernels()
    counts, outputs = [], []
    q, k, v = inputs(1, identity=False)
    q2 = q.flip(0).contiguous()

    class Interleaved:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                counts.append(args[8])  # count_ptr
                assert not args[8].any()
                if len(counts) == 1:  # the first call: a second one runs before its values launch
                    outputs.append(run_splits(q2))
                return kernels.values_kernel[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(module, "_kernels", lambda: type("Kernels", (), {
        "scores_kernel": kernels.scores_kernel, "solve_kernel": kernels.solve_kernel, "values_kernel": Interleaved()}))
    run_splits = lambda query: run(query, k, v, None, 1.5, splits=3)  # noqa: E731
    first = run_splits(q)
    assert len(counts) == 2 and counts[0].data_ptr() != counts[1].data_ptr()
    check(first, q, k, v, None, 1.5)
    check(outputs[0], q2, k, v, None, 1.5)


def test_the_kernels_compile_for_an_h100():
    """The interpreter accepts tiles and operations a GPU rejects: every kernel variant is compiled ahead of time for
    sm_90 (PTX, no GPU needed) by ``tests/triton_compile_check.py`` in a process without the interpreter."""
    import subprocess
    import sys

    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no NVIDIA backend here")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_compile_check.py")
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 9
