"""The fused CPU kernel answers right or not at all: what crosses from Python to C is checked.

A model's decoding step and prefill under every default dtype and a foreign default device give what they give
under float32 (the kernel's output used to follow the default dtype: NaN logits under float64, a heap overflow
under bfloat16); a tensor of the wrong device, shape or extent is a ValueError naming it before any pointer
leaves Python; the kernel's one argument is a struct whose C declaration is generated from the Python fields;
and the C solver gives the Python solvers' thresholds and zeros on the same rows.
"""

import contextlib
import ctypes
import re

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_sparsemax as hs
from hf_sparsemax.attention.blocked import blocks as attention_blocks
from hf_sparsemax.attention.blocked import decode
from hf_sparsemax.attention.cpu import fused as kernel
from hf_sparsemax.attention.cpu import kernel_build
from hf_sparsemax.attention.blocked.blocks import grouped
from hf_sparsemax.mappings import compiled, entmax
from hf_sparsemax.mappings.entmax import bisect_solve, entmax15_solve
from hf_sparsemax.mappings.sparsemax import sparsemax_solve

pytestmark = pytest.mark.skipif(kernel.library() is None, reason="no C compiler: the kernel is not built here")


@contextlib.contextmanager
def default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def tiny_llama(attn: str):
    """A tiny float32 Llama (grouped heads) patched with ``attn``."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return hs.patch_model(model, attn=attn)


def prefill_and_step(model, dtype=torch.float32):
    """Logits of a 300-token prefill and one cached decoding step under the default dtype ``dtype``."""
    config = model.config
    ids = torch.randint(1, 64, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), default_dtype(dtype):
        cache = DynamicCache(config=config)
        prefill = model(input_ids=ids, past_key_values=cache).logits
        step = model(input_ids=prefill[:, -1:].argmax(-1), past_key_values=cache).logits
    return prefill, step


@pytest.fixture
def kernel_calls(monkeypatch):
    """What the kernel returned to each call (decoding steps and prefill blocks)."""
    calls = []
    for module, name in ((decode, "fused_decode"), (attention_blocks, "block_rows")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, **k: calls.append(_f(*a, **k)) or calls[-1])
    return calls


@pytest.mark.parametrize("attn", ["sparsemax", "entmax15"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_a_model_under_another_default_dtype_gives_the_float32_answer(attn, dtype, kernel_calls):
    model = tiny_llama(attn)
    prefill, step = prefill_and_step(model)
    served = len(kernel_calls)
    assert served and all(found is not None for found in kernel_calls)
    other_prefill, other_step = prefill_and_step(model, dtype)
    assert len(kernel_calls) == 2 * served and all(found is not None for found in kernel_calls)
    assert all(found.dtype == torch.float32 for found in kernel_calls)
    assert torch.isfinite(other_step).all()
    torch.testing.assert_close(other_prefill, prefill, rtol=0, atol=0)
    torch.testing.assert_close(other_step, step, rtol=0, atol=0)


def grouped_problem(keys=40, rows=2, dtype=torch.float32, alpha=1.5):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, rows, 8, generator=g)
    k = torch.randn(2, 2, keys, 8, generator=g).to(dtype)
    v = torch.randn(2, 2, keys, 8, generator=g).to(dtype)
    return grouped(q, k, v, None, False, alpha, 0.5, None)


def test_the_kernel_writes_float32_on_the_cpu_under_a_foreign_default_device():
    problem = grouped_problem()
    expected = kernel.decode(problem, problem.alpha)
    with torch.device("meta"), default_dtype(torch.float64):  # a default device no pointer can be taken from
        out = kernel.decode(problem, problem.alpha)
        scores = torch.randn(2, 2, 5, 40, generator=torch.Generator().manual_seed(0), device="cpu", dtype=torch.float32)
        rows = kernel.block_rows(scores, problem.value, slice(0, 40), 1.5)
    assert out.device.type == "cpu" and out.dtype == torch.float32 and rows.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_mismatched_operands_are_refused_before_reaching_c():
    problem = grouped_problem()
    short_values = problem._replace(value=problem.value[:, :, :-1])
    with pytest.raises(ValueError, match=r"value has shape \(2, 2, 39, 8\), expected \[2, 2, 40, \*\]"):
        kernel.decode(short_values, problem.alpha)
    with pytest.raises(ValueError, match="key has shape"):
        kernel.decode(problem._replace(key=problem.key[..., :4]), problem.alpha)
    with pytest.raises(ValueError, match="key is on meta, the query on cpu"):
        kernel.decode(problem._replace(key=problem.key.to("meta")), problem.alpha)
    with pytest.raises(ValueError, match="mask's shape .* does not broadcast"):
        kernel.decode(problem._replace(mask=torch.zeros(1, 1, 1, 1, 7)), problem.alpha)
    with pytest.raises(ValueError, match="alpha has shape"):
        kernel.decode(problem, torch.full((1, 2, 3, 1, 1), 1.5))
    scores = torch.randn(2, 2, 5, 40)
    with pytest.raises(ValueError, match="value rows has shape"):
        kernel.block_rows(scores, problem.value[:, :, :30], slice(0, 40), 1.5)


def test_a_tensor_whose_strides_leave_its_storage_is_refused():
    problem = grouped_problem()
    key = problem.key.clone()
    key.untyped_storage().resize_(key.untyped_storage().nbytes() // 2)  # the tensor now claims more than it holds
    assert not kernel.within_storage(key)
    with pytest.raises(ValueError, match="key's strides .* reach outside its storage"):
        kernel.decode(problem._replace(key=key), problem.alpha)


def test_what_the_kernel_does_not_read_is_still_left_to_the_general_path():
    problem = grouped_problem()
    assert kernel.decode(problem._replace(key=problem.key.half(), value=problem.value.half()), 1.5) is None
    assert kernel.decode(problem._replace(query=problem.query.double()), 1.5) is None
    assert kernel.decode(problem._replace(key=problem.key[:, :, :0], value=problem.value[:, :, :0]), 1.5) is None


def test_the_struct_is_the_one_declaration_of_both_sides():
    lib = kernel.library()
    assert lib.hf_sparsemax_params_size() == ctypes.sizeof(kernel.Params)
    declared = re.findall(r"^\s+[^;]*?(\w+);$", kernel.header(), flags=re.M)
    assert declared == [name for name, *_ in kernel.FIELDS] == [name for name, _ in kernel.Params._fields_]
    with open(kernel_build.SOURCE, encoding="utf-8") as handle:
        source = handle.read()
    assert "#include HF_SPARSEMAX_PARAMS" in source and "typedef struct {\n    int64_t batch" not in source
    code = re.sub(r"/\*.*?\*/", "", source, flags=re.S)  # the solver's constants are not restated in C
    assert not re.search(r"1e-1[0-9]|\b200\b|\b100\b|1\.01|-1\.0\)", code)


def test_a_library_built_for_another_layout_is_not_called(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_SPARSEMAX_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel, "_failed", [])
    monkeypatch.setattr(kernel_build, "_said", set())
    fields = kernel.FIELDS
    monkeypatch.setattr(kernel, "FIELDS", fields + (("added_in_c", ctypes.c_int64),))  # C built with a field more
    kernel.library.cache_clear()
    try:
        header = kernel.header()
        monkeypatch.setattr(kernel, "header", lambda: header)
        monkeypatch.setattr(kernel, "FIELDS", fields)
        with pytest.warns(RuntimeWarning, match="built for another argument layout"):
            assert kernel.library() is None
    finally:
        kernel.library.cache_clear()


# -- the C solver against the Python solvers, row by row ---------------------------------------------------------

def python_tau(rows: torch.Tensor, alpha: float) -> torch.Tensor:
    """Each float32 row's threshold on ``z = (alpha - 1)(s - max s)`` by the library's Python solvers (float64)."""
    top = rows.double().sort(-1, descending=True).values
    valid = torch.ones_like(top, dtype=torch.bool)
    if alpha == 2.0:
        return sparsemax_solve(top, valid)[0].squeeze(-1)
    if alpha == 1.5:
        return entmax15_solve(top, valid)[0].squeeze(-1)
    return bisect_solve(top, valid, alpha, None)[0].squeeze(-1)


def c_tau(rows: torch.Tensor, alpha: float, sort_below: int = kernel.SORT_BELOW):
    """``(tau, p)`` of the same rows by the kernel (``V = I``: the output rows are the weights)."""
    n = rows.shape[-1]
    taus = torch.empty(rows.shape[0], dtype=torch.float64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel, "SORT_BELOW", sort_below)
        p = kernel.block_rows(rows.contiguous().view(1, 1, -1, n), torch.eye(n).view(1, 1, n, n), slice(0, n),
                              alpha, taus=taus)
    return taus, p.view(rows.shape)


def hard_rows(n: int = 48) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.cat([
        torch.randn(6, n, generator=g) * 3,                                   # typical rows
        (torch.randn(6, n, generator=g) * 2).round(),                         # ties
        torch.zeros(2, n),                                                    # flat rows: every key a candidate
        torch.full((2, n), 0.5) + 1e-3 * torch.randn(2, n, generator=g),      # nearly flat
        torch.cat([torch.full((2, 1), 30.0), torch.randn(2, n - 1, generator=g)], -1),  # one candidate
        torch.cat([torch.full((2, 2), 30.0), torch.randn(2, n - 2, generator=g)], -1),  # a tie at the top alone
    ])


@pytest.mark.parametrize("alpha", [2.0, 1.5, 1.1, 1.25, 1.3, 1.6, 1.75, 1.9])
@pytest.mark.parametrize("sort_below", [0, kernel.SORT_BELOW])  # Newton on every row, or the closed forms
def test_the_c_solver_gives_the_python_solvers_thresholds_and_zeros(alpha, sort_below):
    rows = hard_rows()
    tau, p = c_tau(rows, alpha, sort_below)
    expected = python_tau(rows, alpha)
    torch.testing.assert_close(tau, expected, rtol=0, atol=1e-12)
    z = (rows.double() - rows.double().amax(-1, keepdim=True)) * (alpha - 1)
    assert ((p == 0) == (z <= expected[:, None])).all()  # the same support, key for key
    reference = hs.entmax_bisect(rows.double(), alpha) if alpha != 2.0 else hs.sparsemax(rows.double())
    torch.testing.assert_close(p.double(), reference, rtol=2e-6, atol=1e-7)


def test_the_solver_constants_are_the_python_modules():
    params = kernel.solver_params()
    assert params.tolerance == entmax.TOLERANCE and params.max_iter == entmax.MAX_ITER
    assert params.candidate_margin == compiled.CANDIDATE_MARGIN and params.sort_below == kernel.SORT_BELOW


def paged(problem):
    """The problem's keys and values as a paged cache (``[slots, Hkv, D]`` rows, batch row b's keys at slots
    ``b * keys + j``) and its slot table."""
    batch, kv_heads, keys, dim = problem.key.shape
    rows = lambda t: t.permute(0, 2, 1, 3).reshape(batch * keys, kv_heads, t.shape[-1]).contiguous()  # noqa: E731
    return rows(problem.key), rows(problem.value), torch.arange(batch * keys).view(batch, keys)


def test_every_entry_reads_one_alpha_per_query_head_and_only_in_its_range():
    """``paged_decode`` took an alpha per kv head ``[1, Hkv, 1, 1, 1]`` with 2 query heads a group and C
    read past it; ``decode`` had no alpha range check (alpha 3 answered 0.25 off). Now one helper checks alphas for
    every entry: an alpha per kv head is broadcast to its query heads, an alpha outside (1, 2] is left to the
    general path (None), any other shape is a ValueError."""
    problem = grouped_problem()
    key_rows, value_rows, slots = paged(problem)
    per_kv_head = torch.tensor([1.3, 1.7]).view(1, 2, 1, 1, 1)
    per_query_head = per_kv_head.expand(1, 2, 2, 1, 1)
    for call in (lambda a: kernel.decode(problem, a),
                 lambda a: kernel.paged_decode(problem.query, key_rows, value_rows, slots, None, a, 0.5)):
        want = call(per_query_head.contiguous())
        assert want is not None and torch.equal(call(per_kv_head), want)
        for alpha in (3.0, 6.0, 1.0, torch.full((1, 2, 2, 1, 1), 3.0)):
            assert call(alpha) is None  # not served: the general path bisects
        with pytest.raises(ValueError, match="alpha has shape"):
            call(torch.full((1, 2, 3, 1, 1), 1.5))
    paged_out = kernel.paged_decode(problem.query, key_rows, value_rows, slots, None, per_kv_head, 0.5)
    torch.testing.assert_close(paged_out, kernel.decode(problem, per_query_head.contiguous()), rtol=0, atol=0)


def test_a_stray_header_beside_the_source_does_not_win(tmp_path, monkeypatch):
    """fused.c included its generated header by a quoted name, which the compiler looks for beside the
    source first: a stray ``hf_sparsemax_params.h`` there won over the generated one. Now the build passes its
    absolute path."""
    source = tmp_path / "src" / "fused.c"
    source.parent.mkdir()
    source.write_text(open(kernel_build.SOURCE, encoding="utf-8").read(), encoding="utf-8")
    (source.parent / kernel_build.HEADER).write_text("#error a stray header was included\n", encoding="utf-8")
    monkeypatch.setattr(kernel_build, "SOURCE", str(source))
    out = tmp_path / "out"
    out.mkdir()
    path = kernel_build.compile_into(str(out), "fused-test.so", kernel_build.compiler(), kernel_build.FLAGS,
                                     kernel.header())
    assert ctypes.CDLL(path).hf_sparsemax_params_size() == ctypes.sizeof(kernel.Params)
    assert sorted(p.name for p in out.iterdir()) == ["fused-test.so"]  # no partial build left behind


def test_the_certificates_codes_are_checked_before_the_kernel_reads_or_writes_them():
    """``decode``'s key codes (:class:`.keycodes.KeyCodes`) were checked for shape and device only: codes
    of another dtype or layout were read as int8 blocks, and certified counts of int32 written as int64 (past the
    tensor). Now every tensor of a certificate (``decode``'s, ``code_slots``' and ``paged_decode``'s) must have its
    dtype, be contiguous and lie on the query's (the keys') device: else a ValueError naming it."""
    import copy

    from hf_sparsemax.attention.blocked import keycodes

    problem = grouped_problem()
    codes = keycodes.KeyCodes(problem.key)
    codes.reserve(40, 40)
    slots = codes.codes.shape[2]
    good = kernel.decode(problem, 1.5, codes=codes, length=40, certify=True)
    assert good is not None and codes.checked_as is not None  # checked once: each copy below carries that mark,
    # and a tensor replaced (another object) is checked again
    wrong = {"key codes are torch.int16": dict(codes=codes.codes.to(torch.int16)),
             "key codes must be contiguous": dict(codes=torch.zeros(2, 2, 8, slots, dtype=torch.int8).transpose(2, 3)),
             "key codes is on meta": dict(codes=codes.codes.to("meta")),
             "key scales are torch.float64": dict(scales=codes.scales.double()),
             "key scales must be contiguous": dict(scales=torch.zeros(2, slots, 2).transpose(1, 2)),
             "key code bounds are torch.float32": dict(bounds=codes.bounds.float()),
             "certified counts are torch.int32": dict(certified=codes.certified.int()),
             "cannot code 40 keys": dict(codes=torch.zeros(2, 2, 40, 8, dtype=torch.int8),
                                         scales=torch.zeros(2, 2, 40))}
    for message, fields in wrong.items():
        bad = copy.copy(codes)
        bad.__dict__.update(fields)
        with pytest.raises(ValueError, match=message):
            kernel.decode(problem, 1.5, codes=bad, length=40, certify=True)
    key_rows, value_rows, slot_table = paged(problem)
    slot_codes = keycodes.SlotCodes(key_rows)
    assert slot_codes.written
    for message, fields in {"slot codes are torch.uint8": dict(codes=slot_codes.codes.view(torch.uint8)),
                            "slot scales must be contiguous": dict(scales=torch.zeros(80, 2).t()),
                            "slot residuals is on meta": dict(residuals=slot_codes.residuals.to("meta")),
                            "cannot code a cache of 80 slots": dict(codes=slot_codes.codes[:, :64])}.items():
        bad = copy.copy(slot_codes)
        bad.__dict__.update(fields)
        with pytest.raises(ValueError, match=message):
            kernel.code_slots(key_rows, torch.arange(4), bad)
        with pytest.raises(ValueError, match=message):
            kernel.paged_decode(problem.query, key_rows, value_rows, slot_table, None, 1.5, 0.5, codes=bad)
