"""The int8 key certificate in the fused decoding kernel (:mod:`hf_sparsemax.attention.blocked.keycodes`, ``fused.c``).

A decoding step with the certificate reads only the keys whose int8 bound cannot exclude them, and hands the
solver the full step's candidates with the full step's scores: its output must equal the full step's (the
certificate off, ``HF_SPARSEMAX_KV_SKIP=0``) bit for bit, and the materialised formula in float64 to float32
rounding. Checked across the threshold mappings (a learned alpha per head included), one and three query rows,
grouped heads, batches, every decoding mask (left padding, a sliding window, per-head masks, a row that sees
nothing, a static cache's unwritten slots), keys appended step by step with a crop and a beam reorder, bfloat16
caches, NaN keys, the back-off; that most keys are certified on such inputs; that the certificate is wrong
without its error term (adversarial keys), so the bound is what makes it exact; the codes' memory; and greedy
``generate`` on the pretrained SmolLM2.
"""

import pytest
import torch
from transformers import DynamicCache

from hf_sparsemax.attention.cpu import fused
from hf_sparsemax.attention.blocked import keycodes, pages
from hf_sparsemax.attention.interface import sparse_attention_forward
from test_attention_blocks import SETUPS, materialised, module_for
from test_attention_skipping import greedy_with_and_without_skipping

B, H, H_KV, D, KV = 2, 4, 2, 16, 150
MIN = torch.finfo(torch.float32).min
SCALING = 0.5

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C compiler: the fused kernel is not built")


@pytest.fixture(autouse=True)
def certify_from_the_first_key(monkeypatch):
    """Certified steps from 64 cached keys (one page), every step tried; counts from zero."""
    monkeypatch.setattr(pages, "MIN_KEYS", 64)
    monkeypatch.delenv(pages.ENVIRONMENT, raising=False)
    keycodes.reset_counts()


def inputs(batch: int, rows: int, keys: int, seed: int):
    """``q [batch, H, rows, D]``, ``k``, ``v [batch, H_KV, keys, D]`` (float32): spread scores, few near the max."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, H, rows, D, generator=g) * 2, torch.randn(batch, H_KV, keys, D, generator=g),
            torch.randn(batch, H_KV, keys, D, generator=g))


def masks(batch: int, rows: int, keys: int) -> dict:
    seen = torch.ones(batch, 1, rows, keys, dtype=torch.bool)
    padded = seen.clone()
    padded[-1, ..., :37] = False  # left padding
    window = seen.clone()
    window[..., : keys - 70] = False  # a sliding window
    nothing = padded.clone()
    nothing[0, ..., 0, :] = False  # a query that sees no key: zeros
    per_head = torch.rand(batch, H, rows, keys, generator=torch.Generator().manual_seed(3)) > 0.3
    per_head[..., -1] = True
    additive = lambda keep: torch.zeros(keep.shape).masked_fill(~keep, MIN)  # noqa: E731
    return {"none": None, "left padding": additive(padded), "sliding window": additive(window),
            "per head": additive(per_head), "a query that sees nothing": additive(nothing)}


def cached(k, v):
    cache = DynamicCache()
    keys, values = cache.update(k, v, 0)
    return cache, keys, values


def step(module, attn, q, cache, keys, values, mask):
    """One decoding call as a model makes it: the pre-hook hands the cache layer over, then the attention."""
    module.layer_idx = 0
    pages.remember_cache(module, (), {"cache": cache})
    with torch.no_grad():
        return sparse_attention_forward(module, q, keys, values, mask, scaling=SCALING, mapping=attn)[0]


def full_step(module, attn, q, keys, values, mask, monkeypatch):
    """The same call with the certificate off (every key scored by the fused kernel)."""
    with monkeypatch.context() as patch:
        patch.setenv(pages.ENVIRONMENT, "0")
        with torch.no_grad():
            return sparse_attention_forward(module, q, keys, values, mask, scaling=SCALING, mapping=attn)[0]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_certified_step_equals_the_full_step_and_the_formula(setup, rows, monkeypatch):
    q, k, v = inputs(B, rows, KV, seed=rows)
    for name, mask in masks(B, rows, KV).items():
        module, attn = module_for(setup, torch.float32)
        module.eval()
        keycodes.reset_counts()
        cache, keys, values = cached(k, v)
        out = step(module, attn, q, cache, keys, values, mask)
        assert keycodes.COUNTS["calls"] == 1, name
        assert torch.equal(out, full_step(module, attn, q, keys, values, mask, monkeypatch)), name
        wide = None if mask is None else mask.double().masked_fill(mask == MIN, torch.finfo(torch.float64).min)
        reference = materialised(module, setup, q.double(), k.double(), v.double(), wide, SCALING)
        torch.testing.assert_close(out.double(), reference, rtol=1e-4, atol=1e-5, msg=name)
        if rows == 1 and name != "a query that sees nothing":
            assert keycodes.certified_share() > 0.5, (name, keycodes.certified_share())


@pytest.mark.parametrize("setup", ["entmax15", "learned"])
def test_value_heads_of_another_size_are_certified_exactly(setup, monkeypatch):
    """Values of 10 channels beside keys of 16 (an MLA attention): the certified step equals the full step bit for
    bit and the formula to float32 rounding."""
    q, k, v = inputs(B, 1, KV, seed=7)
    v = v[..., :10].contiguous()
    mask = masks(B, 1, KV)["left padding"]
    module, attn = module_for(setup, torch.float32)
    module.eval()
    cache, keys, values = cached(k, v)
    out = step(module, attn, q, cache, keys, values, mask)
    assert out.shape == (B, 1, H, 10) and keycodes.COUNTS["calls"] == 1 and keycodes.certified_share() > 0.5
    assert torch.equal(out, full_step(module, attn, q, keys, values, mask, monkeypatch))
    wide = mask.double().masked_fill(mask == MIN, torch.finfo(torch.float64).min)
    reference = materialised(module, setup, q.double(), k.double(), v.double(), wide, SCALING)
    torch.testing.assert_close(out.double(), reference, rtol=1e-4, atol=1e-5)


def walk_with_a_crop_and_a_beam_reorder(cache, monkeypatch, after_update=lambda cache: None):
    """Keys appended to ``cache`` one step at a time (the codes written by each call), a crop re-grown with other
    keys, a beam reorder: every step equals the full step and the codes equal codes written afresh (after the
    reorder: the same codes reordered, not re-coded). Returns the page summaries seen (kept alive: ids can be
    reused) and the keys and values the cache must hold."""
    module, attn = module_for("learned", torch.float32)
    module.eval()
    q_all, k, v = inputs(2, 1, 120, seed=5)
    cache.update(k[:, :, :70], v[:, :, :70], 0)
    g = torch.Generator().manual_seed(6)
    position, cropped, summaries = 70, False, []
    while position < 120:
        q = torch.randn(2, H, 1, D, generator=g) * 2
        module.layer_idx = 0
        pages.remember_cache(module, (), {"cache": cache})
        keys, values = cache.update(k[:, :, position : position + 1], v[:, :, position : position + 1], 0)
        after_update(cache)
        with torch.no_grad():
            out = sparse_attention_forward(module, q, keys, values, None, scaling=SCALING, mapping=attn)[0]
        assert torch.equal(out, full_step(module, attn, q, keys, values, None, monkeypatch))
        summary = getattr(cache.layers[0], pages.SUMMARY_ATTR)
        if not any(seen is summary for seen in summaries):
            summaries.append(summary)
        assert_codes_as_written_afresh(summary.codes, q, keys, values)
        position += 1
        if position == 95 and not cropped:
            cache.crop(-7)
            k[:, :, 88:95] = torch.randn(2, H_KV, 7, D, generator=g)
            position, cropped = 88, True
        if position == 105:
            cache.reorder_cache(torch.tensor([1, 0]))
            k, v = k.flip(0), v.flip(0)
    return summaries, k, v


def test_step_by_step_with_a_crop_and_a_beam_reorder(monkeypatch):
    summaries, _, _ = walk_with_a_crop_and_a_beam_reorder(DynamicCache(), monkeypatch)
    assert len(summaries) == 2  # built once, rebuilt after the crop; the reorder reorders its codes (equal to fresh)
    assert keycodes.certified_share() > 0.5


def key_codes(codes, n: int) -> torch.Tensor:
    """The int8 codes ``[B, Hkv, n, D]`` of the first ``n`` keys, from their blocks of 16 keys (channel pairs
    interleaved key by key, fused.c's code_at)."""
    batch, heads, slots, dim = codes.codes.shape
    blocks = codes.codes.view(batch, heads, slots // 16, dim // 2, 16, 2).permute(0, 1, 2, 4, 3, 5)
    return blocks.reshape(batch, heads, slots, dim)[:, :, :n]


def assert_codes_as_written_afresh(codes, q, keys, values):
    """The codes a cache carried (through crops, reorders, reallocations) equal those one decoding step writes for
    the same keys from nothing: scales, int8 codes and bounds."""
    fresh = keycodes.KeyCodes(keys)
    fresh.reserve(keys.shape[-2], keys.shape[-2])
    fused.decode(fused_problem(q, keys.contiguous(), values.contiguous()), 2.0, codes=fresh, length=keys.shape[-2])
    n = keys.shape[-2]
    assert codes.coded == n and torch.equal(codes.scales[:, :, :n], fresh.scales[:, :, :n])
    assert torch.equal(key_codes(codes, n), key_codes(fresh, n))
    assert torch.equal(codes.bounds, fresh.bounds)


def fused_problem(q, keys, values):
    from hf_sparsemax.attention.blocked.blocks import grouped

    return grouped(q, keys, values, None, False, 2.0, SCALING, None)


def test_static_cache_unwritten_slots(monkeypatch):
    from transformers import LlamaConfig, StaticCache

    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=H, num_key_value_heads=H_KV, hidden_size=H * D)
    cache = StaticCache(config=config, max_cache_len=200)
    module, attn = module_for("entmax15", torch.float32)
    q_all, k, v = inputs(1, 1, 110, seed=9)
    cache.update(k[:, :, :100], v[:, :, :100], 0)
    for position in range(100, 110):
        q = torch.randn(1, H, 1, D, generator=torch.Generator().manual_seed(position)) * 2
        module.layer_idx = 0
        pages.remember_cache(module, (), {"cache": cache})
        keys, values = cache.update(k[:, :, position : position + 1], v[:, :, position : position + 1], 0)
        mask = torch.zeros(1, 1, 1, 200)
        mask[..., position + 1 :] = MIN  # the unwritten slots
        with torch.no_grad():
            out = sparse_attention_forward(module, q, keys, values, mask, scaling=SCALING, mapping=attn)[0]
        assert torch.equal(out, full_step(module, attn, q, keys, values, mask, monkeypatch))
    assert keycodes.COUNTS["calls"] == 10 and keycodes.certified_share() > 0.5


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("stale", [False, True], ids=["never written", "cropped away"])
@pytest.mark.parametrize("setup", ["sparsemax", "entmax15", "learned"])
def test_a_top_key_without_a_code_is_scored_exactly(setup, stale, rows, monkeypatch):
    """A static cache whose custom mask shows slots past the filled length (zeros never written, or keys written and
    then cropped away): those keys have no code, and here every row's top-scoring key is one of them. A key without
    a code is bounded by ``+inf`` (read and scored exactly), so the row's largest bound (``reach`` in ``fused.c``)
    is ``+inf``, no level is counted and the floor of tau is -1; the row's ``M`` is taken over the coded keys, at
    most its true top. The step equals the full step bit for bit, with keys certified."""
    from transformers import LlamaConfig, StaticCache

    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=H, num_key_value_heads=H_KV, hidden_size=H * D)
    cache = StaticCache(config=config, max_cache_len=200)
    module, attn = module_for(setup, torch.float32)
    module.eval()
    q, k, v = inputs(1, rows, 120, seed=9)
    q = q.abs() + 0.1
    k = -k.abs() * 0.3 - 0.2  # every key scores below 0, so a slot never written (zeros) tops each row
    if stale:
        k[:, :, 110:] = k[:, :, 110:].abs() * 3  # far above every coded key, then cropped away
    cache.update(k, v, 0)
    cache.crop(-20)
    module.layer_idx = 0
    pages.remember_cache(module, (), {"cache": cache})
    keys, values = cache.update(k[:, :, 100:101], v[:, :, 100:101], 0)  # 101 keys filled and coded
    mask = torch.zeros(1, 1, rows, 200)
    mask[..., 150:] = MIN  # slots 101 to 149 shown
    top = (q @ keys.repeat_interleave(H // H_KV, 1).transpose(-1, -2) + mask).argmax(-1)
    assert bool((top > 100).all())
    with torch.no_grad():
        out = sparse_attention_forward(module, q, keys, values, mask, scaling=SCALING, mapping=attn)[0]
    assert torch.equal(out, full_step(module, attn, q, keys, values, mask, monkeypatch))
    assert keycodes.COUNTS["calls"] == 1 and keycodes.COUNTS["certified"] > 0


def test_the_bound_is_what_makes_it_exact(monkeypatch):
    """Adversarial keys: a key with one channel large (it sets the scale) and the others just under half a
    quantisation step along the query (each rounds to 0), so its int8 score is 0 while its true score is the
    row's maximum, 0.5 above a decoy's (score 3, exact in int8). Without its error term the certificate drops
    that key (a wrong output); with it, the output is exact."""
    module, attn = module_for("sparsemax", torch.float32)
    module.eval()
    q, k, v = inputs(1, 1, 200, seed=11)
    q = q.abs() + 0.5
    q[..., 0] = 0.0
    k = k * 0.01
    k[0, :, 10] = q[0, ::2, 0] / (q[0, ::2, 0] ** 2).sum(-1, keepdim=True) * 3.0 / SCALING
    large = 3.5 / (0.49 / 127 * SCALING * q[0, ::2, 0, 1:].sum(-1))  # [H_KV]
    k[0, :, 50, 0] = large
    k[0, :, 50, 1:] = 0.49 * large[:, None] / 127  # rounds to 0: the int8 copy sees nothing of the query
    expected = full_step(module, attn, q, *cached(k, v)[1:], None, monkeypatch)
    assert expected.abs().sum() > 0
    out = step(module, attn, q, *cached(k, v), None)
    assert torch.equal(out, expected)
    monkeypatch.setattr(fused, "CODE_ERROR", 0.0)
    wrong = step(module, attn, q, *cached(k, v), None)
    assert not torch.allclose(wrong, expected, atol=1e-3)


def test_half_caches_nan_keys_and_the_back_off(monkeypatch):
    module, attn = module_for("sparsemax", torch.float32)
    module.eval()
    q, k, v = inputs(B, 1, KV, seed=13)
    q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = step(module, attn, q16, *cached(k16, v16), None)
    assert out.dtype == torch.bfloat16 and keycodes.certified_share() > 0.5
    assert torch.equal(out, full_step(module, attn, q16, k16, v16, None, monkeypatch))
    broken = k.clone()
    broken[1, 0, 40, 3] = float("nan")  # a NaN key: NaN rows, as the full step gives
    out = step(module, attn, q, *cached(broken, v), None)
    torch.testing.assert_close(out, full_step(module, attn, q, broken, v, None, monkeypatch), rtol=0, atol=0,
                               equal_nan=True)
    assert out[1, :, :2].isnan().all() and not out[1, :, 2:].isnan().any() and not out[0].isnan().any()
    # keys that all score alike: nothing certified, so the layer scores every key for the next RETRY steps
    same = k[:, :, :1].expand(B, H_KV, KV, D).contiguous()
    cache, keys, values = cached(same, v)
    keycodes.reset_counts()
    step(module, attn, q, cache, keys, values, None)
    codes = getattr(cache.layers[0], pages.SUMMARY_ATTR).codes
    assert keycodes.COUNTS["calls"] == 1 and codes.wait == keycodes.RETRY
    out = step(module, attn, q, cache, keys, values, None)
    assert keycodes.COUNTS["calls"] == 1 and codes.wait == keycodes.RETRY - 1
    assert torch.equal(out, full_step(module, attn, q, keys, values, None, monkeypatch))


def test_a_key_whose_float32_score_overflows_is_read_as_the_full_step_reads_it():
    """A key of entries +-3e38 scores q.k = 0 in int8 (a finite bound far below a large key's), but the
    full step's float32 sum overflows (inf or NaN: a NaN row); the certificate dropped it and answered a finite
    row. Now a key whose float32 sum could overflow is read and scored exactly: the certified step (dense cache
    and paged cache) equals the full step bit for bit, NaN where NaN, and a masked huge key changes nothing."""
    from hf_sparsemax.attention.blocked.blocks import grouped

    q, k, v = inputs(1, 1, 64, seed=19)
    q = q.abs() + 0.5  # all positive: +-big entries cancel in q.k's true value, not in a float32 sum
    k = k * 0.01
    k[0, :, 9] = 3e38 / q[0, ::2, 0].sum(-1, keepdim=True)  # the row's top score (1.5e38), far above the others
    slots = torch.arange(64).view(1, 64)
    rows = lambda t: t[0].transpose(0, 1).contiguous()  # noqa: E731  [64 slots, H_KV, D]
    for big in (1e36, 1e38, 3e38):
        k[0, :, 5, ::2], k[0, :, 5, 1::2] = big, -big
        for alpha, dtype in ((2.0, torch.float32), (1.5, torch.float32), (1.3, torch.bfloat16)):
            key, value = k.to(dtype), v.to(dtype)
            for mask in (None, torch.zeros(1, 1, 1, 64).index_fill(-1, torch.tensor([5]), MIN)):
                problem = grouped(q, key, value, mask, False, alpha, SCALING, None)
                full = fused.decode(problem, alpha)
                codes = keycodes.KeyCodes(key)
                codes.reserve(64, 64)
                certified = fused.decode(problem, alpha, codes=codes, length=64, certify=True)
                assert int(codes.certified.max()) >= 0  # the certificate ran (it did not fall back)
                torch.testing.assert_close(certified, full, rtol=0, atol=0, equal_nan=True)
                query = problem.query
                paged_mask = None if mask is None else mask.view(1, 1, 1, 1, 64)
                slot_codes = keycodes.SlotCodes(rows(key))
                paged = fused.paged_decode(query, rows(key), rows(value), slots, paged_mask, alpha, SCALING,
                                           codes=slot_codes)
                torch.testing.assert_close(paged, full, rtol=0, atol=0, equal_nan=True)
                overflows = big > 1e37 and mask is None
                assert full.isnan().any() == overflows, (big, alpha, mask is None)


def test_memory_of_the_codes():
    """``D + 4`` bytes a key (int8 codes and a float32 scale) against ``4 D`` for a float32 key; 1000 keys take 1008
    slots (a block is 16 keys; before, slots came in steps of 512: 1024)."""
    key = torch.zeros(1, 3, 1000, 64)
    codes = keycodes.KeyCodes(key)
    codes.reserve(1000, 1000)
    slots = codes.codes.shape[2]
    assert slots == 1008 and codes.nbytes() == slots * 3 * (64 + 4) + 3 * 16
    dense = slots * 3 * 64 * key.element_size()
    assert codes.nbytes() / dense < 0.27


@pytest.mark.slow
def test_greedy_generate_on_the_pretrained_model_is_the_same_with_the_certificate(monkeypatch, attn="entmax15"):
    """SmolLM2 (float32) on a prompt of fortunes: greedy ``generate`` gives the same tokens with the int8
    certificate (from 64 cached keys here) and without it, and the certificate skipped most keys."""
    runs = greedy_with_and_without_skipping(attn, monkeypatch, 120, 8, lambda: keycodes.certified_share() > 0.5)
    assert torch.equal(*runs)


def test_calls_the_kernel_does_not_serve_keep_no_codes(monkeypatch):
    """A float16 cache (the kernel reads float32 and bfloat16): the page bounds' path, no int8 copy kept."""
    module, attn = module_for("sparsemax", torch.float32)
    module.eval()
    q, k, v = (t.half() for t in inputs(B, 1, KV, seed=17))
    cache, keys, values = cached(k, v)
    out = step(module, attn, q, cache, keys, values, None)
    assert getattr(cache.layers[0], pages.SUMMARY_ATTR).codes is None and keycodes.COUNTS["calls"] == 0
    assert torch.equal(out, full_step(module, attn, q, keys, values, None, monkeypatch))


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86 builds of the products")
@pytest.mark.parametrize("flags", [("-march=native", "-mno-avx512f"), ("-march=x86-64",)], ids=["avx2", "plain"])
def test_every_build_of_the_integer_products_gives_the_full_step(flags, tmp_path, monkeypatch):
    """fused.c's code products come in AVX-512, AVX2 and plain C, chosen at build time: the machine CI runs on
    compiles one. Build the others (the same source, other -m flags) and ask each for the certified step: equal to
    the full step bit for bit, over 1 to 9 query rows a kv head (the products take rows four at a time)."""
    import ctypes

    from hf_sparsemax.attention.cpu import kernel_build
    from hf_sparsemax.attention.blocked.blocks import grouped

    build_flags = tuple(f for f in kernel_build.FLAGS if not f.startswith("-march")) + flags
    path = kernel_build.compile_into(str(tmp_path), "products.so", kernel_build.compiler(), build_flags,
                                     fused.header())
    lib = ctypes.CDLL(path)
    lib.hf_sparsemax_decode.restype = ctypes.c_int
    lib.hf_sparsemax_decode.argtypes = [ctypes.POINTER(fused.Params)]
    monkeypatch.setattr(fused, "library", lambda: lib)
    g = torch.Generator().manual_seed(3)
    for groups, rows in [(1, 1), (3, 1), (5, 1), (4, 2), (9, 1)]:
        key, value = torch.randn(2, 2, 300, 64, generator=g) * 2, torch.randn(2, 2, 300, 64, generator=g)
        query = torch.randn(2, 2 * groups, rows, 64, generator=g) * 3
        for alpha in (2.0, 1.3):
            problem = grouped(query, key, value, None, False, alpha, 0.125, None)
            codes = keycodes.KeyCodes(key)
            codes.reserve(300, 300)
            certified = fused.decode(problem, alpha, codes=codes, length=300, certify=True)
            assert min(codes.certified.tolist()) > 150  # most keys never read
            assert torch.equal(certified, fused.decode(problem, alpha))


@pytest.mark.parametrize("alpha", [2.0, 1.5, 1.3])
def test_the_keys_certified_do_not_depend_on_their_order(alpha):
    """The kernel certifies keys in one pass against the cut of the row's running maximum (at most the final cut)
    and tests the survivors again against the final cut: the keys it reads are those the final cut cannot exclude,
    whatever their order. The same keys ascending by score (each block raises the maximum: every key survives the
    running cut and is dropped by the final one), descending and shuffled: each equal to its full step bit for
    bit, and the same number certified per kv head. Head size 18 (nine channel pairs: the products' odd tail), one
    to four query rows a kv head (each row count of the AVX-512 products)."""
    from hf_sparsemax.attention.blocked.blocks import grouped

    g = torch.Generator().manual_seed(5)
    for groups in (1, 2, 3, 4):
        key, value = torch.randn(1, 2, 400, 18, generator=g), torch.randn(1, 2, 400, 18, generator=g)
        query = torch.randn(1, 2 * groups, 1, 18, generator=g) * 3
        by_score = (key[0, 0] @ query[0, 0, 0]).argsort()  # by kv head 0's first query row
        counts = []
        for order in (by_score, by_score.flip(0), torch.randperm(400, generator=g)):
            k, v = key[:, :, order].contiguous(), value[:, :, order].contiguous()
            problem = grouped(query, k, v, None, False, alpha, 0.5, None)
            codes = keycodes.KeyCodes(k)
            codes.reserve(400, 400)
            certified = fused.decode(problem, alpha, codes=codes, length=400, certify=True)
            assert torch.equal(certified, fused.decode(problem, alpha)), (groups, alpha)
            counts.append(codes.certified.tolist())
        assert counts[0] == counts[1] == counts[2], (groups, alpha, counts)
        assert min(counts[0]) > 200, counts  # most keys never read


@pytest.mark.parametrize("alpha", [2.0, 1.5, 1.3])
def test_keys_above_the_old_cut_are_certified_by_the_floor_of_tau(alpha):
    """A flat row: 100 keys tied near the top, 300 within 1 / (alpha - 1) of it (z in (-0.9, -0.35)), 200 far below.
    The cut at tau >= -1 leaves the 300 candidates; the floor of tau from the counts near the top (fused.c
    tau_floor: -1/32 - 100 ** (1 - alpha) > -0.3) places them below it, so the certificate never reads them and
    the full step does not solve over them: the same output bit for bit, the formula's to float32 rounding."""
    from hf_sparsemax.attention.blocked.blocks import grouped
    from hf_sparsemax import entmax_bisect

    g = torch.Generator().manual_seed(13)
    z = torch.cat([-1e-3 * torch.rand(100, generator=g), -0.35 - 0.55 * torch.rand(300, generator=g),
                   -1.5 - torch.rand(200, generator=g)])
    z = z[torch.randperm(600, generator=g)]
    query = torch.zeros(1, 2, 1, 16)
    query[..., 0] = 4.0
    key = 0.01 * torch.randn(1, 2, 600, 16, generator=g)
    key[..., 0] = (8.0 + z / (alpha - 1)) / (4.0 * 0.5)  # scores 8 + z / (alpha - 1) at scaling 0.5
    value = torch.randn(1, 2, 600, 16, generator=g)
    problem = grouped(query, key, value, None, False, alpha, 0.5, None)
    codes = keycodes.KeyCodes(key)
    codes.reserve(600, 600)
    certified = fused.decode(problem, alpha, codes=codes, length=600, certify=True)
    assert torch.equal(certified, fused.decode(problem, alpha))
    scores = (query.double() @ key.double().transpose(-1, -2)) * 0.5  # [1, 2, 1, 600]
    old_cut = (alpha - 1) * (scores - scores.amax(-1, keepdim=True)) <= -fused.CANDIDATE_MARGIN
    assert old_cut.sum(-1).flatten().tolist() == [200, 200]  # the cut at -1 certifies the far keys only
    assert min(codes.certified.tolist()) >= 480, codes.certified  # the floor: most of the 300 as well
    reference = entmax_bisect(scores, alpha=alpha, dim=-1) @ value.double()
    torch.testing.assert_close(certified.double().reshape(reference.shape), reference, rtol=1e-4, atol=1e-5)
