"""hs.GrowingCache (:mod:`hf_sparsemax.attention.blocked.growing_cache`): appends in place into buffers grown
geometrically, and is the same cache as transformers' DynamicCache to the model.

Checked: greedy ``generate`` (sdpa and entmax15 with the int8 certificate from 64 keys) gives DynamicCache's
tokens and scores bit for bit, with one page summary a layer carried across every append and reallocation and
the codes written step by step; beam search; assisted decoding (crops); a step-by-step layer through
reallocations, a crop and a beam reorder equal to the full step with codes equal to fresh ones; the memory held
against the keys cached; replaced tensors taken back into buffers; bad input.
"""

import gc
import warnings

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.generation.utils import GenerateDecoderOnlyOutput

import hf_sparsemax as hs
from hf_sparsemax.attention.cpu import fused
from hf_sparsemax.attention.blocked import growing_cache, keycodes, pages
from hf_sparsemax.attention.blocked.growing_cache import GrowingCache, GrowingLayer
from test_attention_keycodes import walk_with_a_crop_and_a_beam_reorder

needs_kernel = pytest.mark.skipif(not fused.available(), reason="no C compiler: the fused kernel is not built")


@pytest.fixture(autouse=True)
def certify_from_64_keys(monkeypatch):
    """The certificate from one page of keys, and every step certified (no back-off), counts from zero."""
    monkeypatch.setattr(pages, "MIN_KEYS", 64)
    monkeypatch.setattr(keycodes, "MIN_CERTIFIED", 0.0)
    monkeypatch.delenv(pages.ENVIRONMENT, raising=False)
    keycodes.reset_counts()
    warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(autouse=True)
def without_gradients():
    """The cache's steps as ``generate`` makes them, without gradients (with them it appends as a DynamicLayer)."""
    with torch.no_grad():
        yield


def tiny_llama(attn: str, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    if attn != "sdpa":
        hs.patch_model(model, attn=attn)
    return model


def prompt(batch: int = 2, length: int = 90) -> dict:
    ids = torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[-1, :5] = 0  # left padding on the last row
    return dict(input_ids=ids, attention_mask=mask)


# generate's name for the cache, in its arguments and its output: `cache` from transformers 5.24, before it
# `past_key_values` (the lower bounds run tests/test_generate_cache.py, which takes these from here)
CACHE = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


def cache_of(output):
    return getattr(output, CACHE)


def generate(model, cache, **kwargs):
    with torch.no_grad():
        return model.generate(**prompt(), max_new_tokens=12, do_sample=False, **{CACHE: cache}, output_scores=True,
                              return_dict_in_generate=True, **kwargs)


@needs_kernel
@pytest.mark.parametrize("attn", ["sdpa", "entmax15"])
def test_greedy_generate_equals_dynamic_cache(attn, monkeypatch):
    monkeypatch.setattr(growing_cache, "ROUND", 8)  # several reallocations over the generation
    model = tiny_llama(attn)
    made = []
    monkeypatch.setattr(pages.PageSummary, "__init__", lambda self, key, init=pages.PageSummary.__init__: (
        made.append(self), init(self, key))[1])
    want = generate(model, DynamicCache())
    made.clear()
    keycodes.reset_counts()
    cache = GrowingCache(growth=1.1)
    got = generate(model, cache)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))
    assert all(isinstance(layer, GrowingLayer) and layer.views_buffers() for layer in cache.layers)
    if attn == "entmax15":  # one summary a layer, carried through every step; its codes follow the keys
        assert len(made) == len(cache.layers)
        for layer in cache.layers:
            summary = getattr(layer, pages.SUMMARY_ATTR)
            assert summary.codes.coded == layer.keys.shape[-2]
        assert keycodes.COUNTS["calls"] == 11 * len(cache.layers)


@needs_kernel
@pytest.mark.parametrize("attn", ["sdpa", "entmax15"])
def test_beam_search_equals_dynamic_cache(attn):
    model = tiny_llama(attn)
    want = generate(model, DynamicCache(), num_beams=2)
    got = generate(model, GrowingCache(), num_beams=2)
    assert torch.equal(got.sequences, want.sequences)


@needs_kernel
@pytest.mark.parametrize("make", [DynamicCache, GrowingCache])
def test_a_reset_cache_reorders_without_taking_freed_keys_for_its_own(make):
    """A layer's page summary follows its keys by weak reference: once ``reset`` drops them (None) and they are
    freed, the summary describes nothing, so a reorder (a beam search on the reused cache) neither fails nor
    carries the old pages; the next generation equals one on a new cache."""
    model = tiny_llama("entmax15")
    cache = make()
    generate(model, cache)
    assert all(getattr(layer, pages.SUMMARY_ATTR, None) is not None for layer in cache.layers)
    cache.reset()
    gc.collect()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(generate(model, cache, num_beams=2).sequences, generate(model, make(), num_beams=2).sequences)


@pytest.mark.parametrize("trained", ["every weight", "queries only"])
@pytest.mark.parametrize("attn", ["sdpa", "entmax15"])
def test_appends_under_autograd_give_dynamic_caches_gradients(attn, trained):
    """Forwards with gradients that append (a training loop with ``use_cache=True``, a rollout with gradients),
    after and between steps without: the same logits and gradients as with a DynamicCache (the buffers' in-place
    writes into views autograd saved made backward fail), and the layer keeps growing in buffers afterwards. Also
    where only the query projections train (the first layer's keys need no gradient, yet are saved for the
    queries')."""
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    got = {}
    for make in (DynamicCache, lambda: GrowingCache(growth=2.0)):
        model = tiny_llama(attn).train()
        for name, param in model.named_parameters():
            param.requires_grad_(trained == "every weight" or "q_proj" in name)
        cache, total = make(), 0.0
        for start, stop, grad in ((0, 12, False), (12, 20, True), (20, 21, True), (21, 22, False), (22, 30, True)):
            with torch.set_grad_enabled(grad):
                logits = model(ids[:, start:stop], cache=cache, use_cache=True).logits
                total = total + (logits * torch.linspace(-1, 1, 96)).sum() if grad else total
            got.setdefault(type(cache), []).append(logits.detach())
        total.backward()
        got[type(cache)].extend(p.grad for p in model.parameters() if p.requires_grad)
        if isinstance(cache, GrowingCache):
            with torch.no_grad():
                model(ids[:, 30:31], cache=cache, use_cache=True)
            assert all(layer.views_buffers() and layer.capacity >= 31 for layer in cache.layers)
    want, have = got[DynamicCache], got[GrowingCache]
    assert len(want) == len(have)
    for a, b in zip(want, have):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("attn", ["sdpa", "entmax15"])
def test_assisted_decoding_crops_and_equals_greedy(attn, monkeypatch):
    model, assistant = tiny_llama(attn), tiny_llama("sdpa", seed=3)
    crops = []
    monkeypatch.setattr(GrowingLayer, "crop", lambda self, n, crop=GrowingLayer.crop: (crops.append(n), crop(self, n)))
    ids = prompt(batch=1)
    with torch.no_grad():
        want = model.generate(**ids, max_new_tokens=12, do_sample=False, cache=DynamicCache())
        got = model.generate(**ids, max_new_tokens=12, do_sample=False, cache=GrowingCache(),
                             assistant_model=assistant)
    assert torch.equal(got, want) and any(n < 0 for n in crops)


@needs_kernel
def test_step_by_step_through_reallocations_a_crop_and_a_beam_reorder(monkeypatch):
    """A layer fed one key a step, reallocated every few steps: each step equals the full step, its codes equal
    codes written afresh, and the summary is built once (rebuilt after the crop), never per reallocation."""
    monkeypatch.setattr(growing_cache, "ROUND", 8)
    buffers = []  # the buffers themselves, kept alive (a freed buffer's address can be reused)

    def keep_buffer(cache):
        if not any(seen is cache.layers[0].key_buffer for seen in buffers):
            buffers.append(cache.layers[0].key_buffer)

    cache = GrowingCache(growth=1.1)
    summaries, k, v = walk_with_a_crop_and_a_beam_reorder(cache, monkeypatch, after_update=keep_buffer)
    assert len(summaries) == 2 and len(buffers) >= 4  # reallocated several times, the summary carried
    assert torch.equal(cache.layers[0].keys, k[:, :, :120]) and torch.equal(cache.layers[0].values, v[:, :, :120])


def test_memory_held_against_the_keys_cached():
    k, v = torch.randn(1, 2, 1000, 8), torch.randn(1, 2, 1000, 8)
    for growth, bound in ((2.0, 2.0), (1.05, 1.05)):
        cache = GrowingCache(growth=growth)
        cache.update(k[:, :, :500], v[:, :, :500], 0)
        worst = 0.0
        for position in range(500, 1000):
            cache.update(k[:, :, position : position + 1], v[:, :, position : position + 1], 0)
            held, cached = cache.nbytes()
            worst = max(worst, held / cached)
        assert torch.equal(cache.layers[0].keys, k) and torch.equal(cache.layers[0].values, v)
        assert 1 < worst <= bound + growing_cache.ROUND / 500


@pytest.mark.parametrize("prompt_length", [8100, 8192, 16300, 32700])
def test_default_growth_holds_within_5_percent_at_long_lengths(prompt_length):
    """The default cache (growth 1.04) after a prefill of ``prompt_length`` keys, one key a step through a
    reallocation and a half: its buffers and the layer's int8 codes (grown by the same rule) each hold at most 5%
    more than the keys they hold, at every step (the codes grown in steps of 512 keys held 6.2% more at 8193)."""
    k, v = torch.randn(1, 1, prompt_length, 2), torch.randn(1, 1, prompt_length, 2)
    cache = GrowingCache(growth=growing_cache.GENERATE_GROWTH)
    cache.update(k, v, 0)
    codes = keycodes.KeyCodes(torch.empty(1, 1, 0, 64))
    worst = worst_codes = 0.0
    capacities = {cache.layers[0].capacity}
    for length in range(prompt_length + 1, int(prompt_length * 1.07)):
        cache.update(k[:, :, :1], v[:, :, :1], 0)
        capacities.add(cache.layers[0].capacity)
        held, cached = cache.nbytes()
        worst = max(worst, held / cached)
        codes.reserve(length, length)
        codes.coded = length  # as the kernel leaves it after writing the codes
        worst_codes = max(worst_codes, (codes.codes.nbytes + codes.scales.nbytes) / (length * (64 + 4)))
    assert len(capacities) >= 3  # reallocated at least twice
    assert worst <= 1.05 and worst_codes <= 1.05, (worst, worst_codes)


@pytest.mark.parametrize("growth", [1.04, 1.25])
def test_a_reallocation_holds_what_the_docs_say(growth):
    """docs/attention.md: right after a reallocation (a prefill, or a full buffer taking one more key) the buffers
    hold at most ``growth`` times the keys, or their number rounded up to 64 keys where that is more: under 64 keys
    over, within 5% from 1260 keys, within ``growth`` times from ``63 / (growth - 1)`` keys; below that, a cache
    can be a page over ``growth`` times (at 1.04: between 1260 and 1575 keys, up to 1.049 times)."""
    sizes = [(length, growing_cache.grown_size(length, filled, growth, growing_cache.ROUND))
             for length in range(1, 6000) for filled in (0, length - 1)]
    for length, size in sizes:
        assert length <= size < length + growing_cache.ROUND or size <= growth * length
        assert size <= max(growth, 1.05) * length or length < 1260
        assert size <= growth * length or length < 63 / (growth - 1)
    over = [length for length, size in sizes if size > growth * length and length >= 1260]
    assert bool(over) == (growth < 1.05)


def test_replaced_tensors_are_taken_back_into_buffers():
    """batch_select_indices / batch_repeat_interleave (DynamicLayer's, new tensors): the next update copies them
    into new buffers; the cache then equals a DynamicCache given the same calls."""
    k, v = torch.randn(3, 2, 10, 8), torch.randn(3, 2, 10, 8)
    caches = [GrowingCache(), DynamicCache()]
    for cache in caches:
        cache.update(k[:, :, :6], v[:, :, :6], 0)
        cache.batch_select_indices(torch.tensor([2, 0]))
        cache.update(k[[2, 0], :, 6:8], v[[2, 0], :, 6:8], 0)
        cache.batch_repeat_interleave(2)
        cache.update(k[[2, 2, 0, 0], :, 8:], v[[2, 2, 0, 0], :, 8:], 0)
    assert caches[0].layers[0].views_buffers()
    assert torch.equal(caches[0].layers[0].keys, caches[1].layers[0].keys)
    assert torch.equal(caches[0].layers[0].values, caches[1].layers[0].values)
    caches[0].reset()
    assert caches[0].get_seq_length() == 0 and caches[0].layers[0].key_buffer is None


@pytest.mark.parametrize("growth", [1, 1.0, 0.5, 17, True, "2", None])
def test_a_bad_growth_is_refused(growth):
    with pytest.raises(ValueError, match="growth"):
        GrowingCache(growth=growth)


def test_keys_that_do_not_extend_the_cache_are_refused():
    cache = GrowingCache()
    cache.update(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), 0)
    with pytest.raises(ValueError, match="do not extend"):
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)  # copy_ would broadcast it
