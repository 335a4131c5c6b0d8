"""Exact KV skipping at decode time (:mod:`hf_sparsemax.attention.blocked.pages`): the output equals the full computation.

Keys are made of pages whose keys lie close together (a page's own centre plus small noise), so the page bounds are
tight and the certificate skips most pages; every test checks that it did, and that the output equals the full
decoding step (skipping off) and the materialised formula in float64, to float64 rounding. Across the threshold
mappings (sparsemax, entmax15, entmax_bisect 1.3, a learned per-head alpha), grouped-query heads, batches,
left padding, per-head masks, a query that sees nothing, partly filled last pages, caches shorter than a page,
cropped caches and a static cache; a hypothesis property; and greedy ``generate`` on the pretrained SmolLM2.
"""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from hf_sparsemax.attention.blocked import decode, pages
from hf_sparsemax.attention.interface import sparse_attention_forward
from test_attention_blocks import SETUPS, materialised, module_for

B, H, H_KV, D, PAGE = 3, 4, 2, 8, 8
MIN64 = torch.finfo(torch.float64).min


@pytest.fixture(autouse=True)
def small_pages(monkeypatch):
    """Pages of 8 keys from the first full page on, two scored first; counts from zero. The fused kernel's int8
    certificate (tests/test_attention_keycodes.py), which takes the calls it serves before the page bounds, off."""
    monkeypatch.setattr(decode, "coded_attention", lambda *args: None)
    monkeypatch.setattr(pages, "PAGE", PAGE)
    monkeypatch.setattr(pages, "MIN_KEYS", 0)
    monkeypatch.setattr(pages, "FIRST_PAGES", 2)
    monkeypatch.setattr(pages, "MAX_KEPT", 1.0)
    monkeypatch.delenv(pages.ENVIRONMENT, raising=False)
    pages.reset_counts()


def paged_keys(batch: int, keys: int, seed: int, spread: float = 3.0):
    """``(k, v) [batch, H_KV, keys, D]`` float64: per page a centre (``spread`` apart) plus noise 0.05."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(batch, H_KV, -(-keys // PAGE), 1, D, generator=g, dtype=torch.float64) * spread
    k = (centres + 0.05 * torch.randn(*centres.shape[:3], PAGE, D, generator=g, dtype=torch.float64)).flatten(2, 3)
    return k[:, :, :keys].contiguous(), torch.randn(batch, H_KV, keys, D, generator=g, dtype=torch.float64)


def masks(batch: int, rows: int, keys: int) -> dict:
    seen = torch.ones(batch, 1, rows, keys, dtype=torch.bool)
    padded = seen.clone()
    padded[1 % batch, ..., :13] = False  # left padding, past the first page
    nothing = padded.clone()
    nothing[-1, ..., 0, :] = False  # a query that sees no key: zeros
    per_head = torch.rand(batch, H, rows, keys, generator=torch.Generator().manual_seed(3)) > 0.3
    per_head[..., -1] = True
    additive = lambda keep: torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, MIN64)  # noqa: E731
    return {"none": None, "left padding": additive(padded), "per head": additive(per_head),
            "a query that sees nothing": additive(nothing)}


def cached(k, v):
    """A DynamicCache of one layer holding ``k``, ``v`` (the keys tensor the attention gets)."""
    cache = DynamicCache()
    keys, values = cache.update(k, v, 0)
    return cache, keys, values


def attend(module, attn, q, cache, keys, values, mask, scaling=0.5):
    """One decoding call as a model makes it: the pre-hook sees the cache, then the attention its keys."""
    module.layer_idx = 0
    pages.remember_cache(module, (), {"cache": cache})
    with torch.no_grad():
        return sparse_attention_forward(module, q, keys, values, mask, scaling=scaling, mapping=attn)[0]


def full_step(module, attn, q, keys, values, mask, scaling=0.5):
    with torch.no_grad():
        return sparse_attention_forward(module, q, keys, values, mask, scaling=scaling, mapping=attn)[0]


@pytest.mark.parametrize("keys", [PAGE * 12, PAGE * 12 + 5])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_skipping_equals_the_full_step_and_the_formula(setup, rows, keys):
    g = torch.Generator().manual_seed(rows + keys)
    q = torch.randn(B, H, rows, D, generator=g, dtype=torch.float64) * 2
    k, v = paged_keys(B, keys, seed=keys)
    skipped = 0
    for name, mask in masks(B, rows, keys).items():
        module, attn = module_for(setup, torch.float64)
        module.eval()
        cache, keys_, values = cached(k, v)
        pages.reset_counts()
        out = attend(module, attn, q, cache, keys_, values, mask)
        full = full_step(module, attn, q, keys_, values, mask)
        reference = materialised(module, setup, q, k, v, mask, 0.5)
        torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-13, msg=name)
        torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-13, msg=name)
        if name == "a query that sees nothing":
            assert (out[-1, 0] == 0).all()  # no certificate: the full step, zeros for that row
        elif rows == 1:
            assert pages.COUNTS["skipped"] > 0.25 * pages.COUNTS["pages"], name  # pages never read
        skipped += pages.COUNTS["skipped"]
    assert skipped > 0


@pytest.mark.parametrize("setup", ["sparsemax", "learned"])
def test_value_heads_of_another_size_skip_exactly(setup):
    """Values of 5 channels beside keys of 8 (an MLA attention): pages are skipped, and the step equals the
    formula."""
    q = torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 2
    k, v = paged_keys(B, PAGE * 12, seed=4)
    v = v[..., :5].contiguous()
    mask = masks(B, 1, PAGE * 12)["left padding"]
    module, attn = module_for(setup, torch.float64)
    module.eval()
    cache, keys, values = cached(k, v)
    out = attend(module, attn, q, cache, keys, values, mask)
    assert out.shape == (B, 1, H, 5) and pages.COUNTS["skipped"] > 0
    torch.testing.assert_close(out, materialised(module, setup, q, k, v, mask, 0.5), rtol=1e-12, atol=1e-13)


def test_a_cache_shorter_than_a_page_is_not_summarised():
    module, attn = module_for("sparsemax", torch.float64)
    q = torch.randn(B, H, 1, D, dtype=torch.float64)
    k, v = paged_keys(B, PAGE - 3, seed=1)
    cache, keys, values = cached(k, v)
    out = attend(module, attn, q, cache, keys, values, None)
    torch.testing.assert_close(out, full_step(module, attn, q, keys, values, None), rtol=0, atol=0)
    assert pages.COUNTS["calls"] == 0 and not hasattr(cache.layers[0], pages.SUMMARY_ATTR)


@pytest.mark.parametrize("setup", ["entmax15", "learned"])
def test_decoding_step_by_step_keeps_the_summary_exact(setup):
    """Keys appended one step at a time (pages filling up, new pages summarised incrementally), a crop and a
    re-grow with other keys (speculative decoding), a batch reordered (beam search): the output stays exact."""
    module, attn = module_for(setup, torch.float64)
    k, v = paged_keys(2, 80, seed=5)
    cache, keys, values = cached(k[:, :, :40], v[:, :, :40])
    g = torch.Generator().manual_seed(6)
    step = 40
    summaries, cropped = set(), False
    while step < 80:
        q = torch.randn(2, H, 1, D, generator=g, dtype=torch.float64) * 2
        module.layer_idx = 0
        pages.remember_cache(module, (), {"cache": cache})
        keys, values = cache.update(k[:, :, step : step + 1], v[:, :, step : step + 1], 0)
        with torch.no_grad():
            out = sparse_attention_forward(module, q, keys, values, None, scaling=0.5, mapping=attn)[0]
        torch.testing.assert_close(out, full_step(module, attn, q, keys, values, None), rtol=1e-12, atol=1e-13)
        summary = getattr(cache.layers[0], pages.SUMMARY_ATTR)
        summaries.add(id(summary))
        fresh = pages.PageSummary(keys).update(keys, keys.shape[-2])
        assert torch.equal(summary.mins, fresh.mins) and torch.equal(summary.maxs, fresh.maxs)
        step += 1
        if step == 61 and not cropped:  # crop 9 keys (across a page boundary), grow again with other keys
            cache.crop(-9)
            k[:, :, 52:61] = paged_keys(2, 80, seed=7)[0][:, :, 52:61]
            step, cropped = 52, True
        if step == 70:
            cache.reorder_cache(torch.tensor([1, 0]))
            k, v = k.flip(0), v.flip(0)
    assert len(summaries) == 2  # built once, rebuilt after the crop; the reorder reorders it (equal to fresh)
    assert pages.COUNTS["skipped"] > 0
    copied = copy.deepcopy(cache)  # the reorder hook binds to the copy: reordering it leaves the original alone
    before = cache.layers[0].keys.clone()
    copied.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.layers[0].keys, before) and torch.equal(copied.layers[0].keys, before.flip(0))


def test_static_cache_skips_exactly():
    from transformers import LlamaConfig, StaticCache

    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=H, num_key_value_heads=H_KV, hidden_size=H * D)
    cache = StaticCache(config=config, max_cache_len=128)
    module, attn = module_for("sparsemax", torch.float64)
    k, v = paged_keys(1, 100, seed=9)
    cache.update(k[:, :, :90].float().double(), v[:, :, :90], 0)
    for step in range(90, 100):
        q = torch.randn(1, H, 1, D, dtype=torch.float64) * 2
        module.layer_idx = 0
        pages.remember_cache(module, (), {"cache": cache})
        keys, values = cache.update(k[:, :, step : step + 1], v[:, :, step : step + 1], 0)
        mask = torch.zeros(1, 1, 1, 128, dtype=torch.float64)
        mask[..., step + 1 :] = MIN64  # the unwritten slots
        with torch.no_grad():
            out = sparse_attention_forward(module, q, keys, values, mask, scaling=0.5, mapping=attn)[0]
        torch.testing.assert_close(out, full_step(module, attn, q, keys, values, mask), rtol=1e-12, atol=1e-13)
    assert pages.COUNTS["calls"] == 10 and pages.COUNTS["skipped"] > 0


def test_switched_off_and_softmax_like_mappings_do_not_skip(monkeypatch):
    k, v = paged_keys(B, 96, seed=2)
    q = torch.randn(B, H, 1, D, dtype=torch.float64)
    monkeypatch.setenv(pages.ENVIRONMENT, "0")
    module, attn = module_for("sparsemax", torch.float64)
    attend(module, attn, q, *cached(k, v), None)
    monkeypatch.delenv(pages.ENVIRONMENT)
    from hf_sparsemax.attention.interface import AttentionOptions, OPTIONS_ATTR

    setattr(module, OPTIONS_ATTR, AttentionOptions.from_settings("sparse_softmax", {}))
    attend(module, "sparse_softmax", q, *cached(k, v), None)
    assert pages.COUNTS["calls"] == 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), keys=st.integers(PAGE, 6 * PAGE + 7), batch=st.integers(1, 3),
       spread=st.floats(0.5, 4.0), padding=st.integers(0, 20), setup=st.sampled_from(list(SETUPS)))
def test_skipping_is_exact_on_any_input(seed, keys, batch, spread, padding, setup):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, H, 1, D, generator=g, dtype=torch.float64) * spread
    k, v = paged_keys(batch, keys, seed, spread)
    mask = torch.zeros(batch, 1, 1, keys, dtype=torch.float64)
    mask[0, ..., : min(padding, keys - 1)] = MIN64
    module, attn = module_for(setup, torch.float64)
    out = attend(module, attn, q, *cached(k, v), mask)
    torch.testing.assert_close(out, materialised(module, setup, q, k, v, mask, 0.5), rtol=1e-12, atol=1e-13)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sparsemax", "entmax15"])
def test_greedy_generate_on_the_pretrained_model_is_the_same_with_skipping(attn, monkeypatch):
    """SmolLM2 (float32) on a prompt of fortunes: greedy ``generate`` gives the same tokens with and without
    skipping (pages of 4 keys here, so that real keys get a tight bound and some pages are skipped)."""
    monkeypatch.setattr(pages, "PAGE", 4)
    monkeypatch.setattr(pages, "RETRY", 0)
    runs = greedy_with_and_without_skipping(attn, monkeypatch, 300, 12, lambda: pages.COUNTS["skipped"] > 0)
    assert torch.equal(*runs)


def greedy_with_and_without_skipping(attn: str, monkeypatch, prompt: int, tokens: int, skipped) -> list:
    """Greedy ``generate`` on SmolLM2 (float32) from ``prompt`` tokens of fortunes, ``tokens`` new ones: the two
    token sequences with KV skipping on (``skipped()`` must hold after it) and off."""
    import hf_sparsemax as hs
    from hf_sparsemax.app.assets import fortunes, load_smollm2

    model, tokenizer = load_smollm2(dtype=torch.float32)
    hs.patch_model(model.eval(), attn=attn)
    ids = tokenizer("\n\n".join(fortunes()), return_tensors="pt").input_ids[:, :prompt]
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv(pages.ENVIRONMENT, flag)
        with torch.no_grad():
            runs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                       do_sample=False))
        assert flag == "0" or skipped()
    return runs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("setup", ["sparsemax", "learned"])
def test_a_half_precision_cache_skips_exactly(setup, dtype):
    """A half model's cache: its page summary is kept in the cache's dtype, the step computes in float32
    (:func:`~hf_sparsemax.attention.blocked.blocks.work_operands`); the output equals the full step's, pages skipped."""
    keys = PAGE * 12 + 5
    q = (torch.randn(B, H, 1, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 2).to(dtype)
    k, v = (t.to(dtype) for t in paged_keys(B, keys, seed=11))
    mask = masks(B, 1, keys)["left padding"].to(dtype).clamp_min(torch.finfo(dtype).min)
    module, attn = module_for(setup, torch.float32)
    module.eval()
    cache, keys_, values = cached(k, v)
    out = attend(module, attn, q, cache, keys_, values, mask)
    assert out.dtype == dtype and pages.COUNTS["skipped"] > 0.25 * pages.COUNTS["pages"]
    torch.testing.assert_close(out, full_step(module, attn, q, keys_, values, mask), rtol=0, atol=0)
