"""The cache a patched model's ``generate`` decodes with (:mod:`hf_sparsemax.attention.blocked.growing_cache`), and a
static cache's decoding steps over its filled slots only (:func:`hf_sparsemax.attention.blocked.pages.filled_part`).

Checked: with no cache given, a sparse-attention model's ``generate`` (greedy, beam search, assisted decoding with
crops) makes a GrowingCache and gives the tokens and scores of an explicit DynamicCache bit for bit (every causal
family of the sweep: a GrowingCache unless it has sliding-window layers); a given cache and a
``cache_implementation`` are kept; a sliding-window family, an encoder-decoder and an unpatched model keep
transformers' cache; a saved and reloaded model makes it again. With a StaticCache, greedy ``generate`` gives
DynamicCache's tokens and scores bit for bit while every decoding step reads only the filled slots; a mask that
lets a row see an unwritten slot keeps them all; rows read from a cache's strided views equal a copy's.
"""

import pytest
import torch
from transformers import DynamicCache, EncoderDecoderCache, StaticCache

import hf_sparsemax as hs
from hf_sparsemax.attention.cpu import fused
from hf_sparsemax.attention.blocked import growing_cache, keycodes, pages
from hf_sparsemax.attention import interface
from hf_sparsemax.attention.blocked.growing_cache import GrowingCache
from families import FAMILIES, batch, tiny_model
from test_growing_cache import CACHE, cache_of, certify_from_64_keys, generate, prompt, tiny_llama  # noqa: F401

needs_kernel = pytest.mark.skipif(not fused.available(), reason="no C compiler: the fused kernel is not built")


def same(got, want) -> bool:
    return torch.equal(got.sequences, want.sequences) and len(got.scores) == len(want.scores) and all(
        torch.equal(a, b) for a, b in zip(got.scores, want.scores))


@needs_kernel
@pytest.mark.parametrize("attn", ["entmax15", "sparsemax"])
def test_a_patched_generate_makes_a_growing_cache_with_dynamic_caches_results(attn):
    model = tiny_llama(attn)
    want = generate(model, DynamicCache())
    got = generate(model, None)
    assert type(cache_of(got)) is GrowingCache and cache_of(got).growth == growing_cache.GENERATE_GROWTH
    assert all(layer.views_buffers() for layer in cache_of(got).layers) and len(cache_of(got).layers) == 2
    assert keycodes.COUNTS["calls"] > 0  # the certificate ran on the default cache's views
    assert same(got, want)
    beams = generate(model, None, num_beams=2)
    assert type(cache_of(beams)) is GrowingCache
    assert torch.equal(beams.sequences, generate(model, DynamicCache(), num_beams=2).sequences)


@needs_kernel
def test_assisted_decoding_on_the_default_caches_crops_and_equals_greedy(monkeypatch):
    """Both the model and a patched assistant decode on their default GrowingCache, cropped where drafts fail."""
    from hf_sparsemax.attention.blocked.growing_cache import GrowingLayer

    model, assistant = tiny_llama("entmax15"), tiny_llama("sparsemax", seed=3)
    crops = []
    monkeypatch.setattr(GrowingLayer, "crop", lambda self, n, crop=GrowingLayer.crop: (crops.append(n), crop(self, n)))
    ids = prompt(batch=1)
    with torch.no_grad():
        want = model.generate(**ids, max_new_tokens=12, do_sample=False, **{CACHE: DynamicCache()})
        got = model.generate(**ids, max_new_tokens=12, do_sample=False, assistant_model=assistant,
                             return_dict_in_generate=True)
    assert type(cache_of(got)) is GrowingCache
    assert torch.equal(got.sequences, want) and any(n < 0 for n in crops)


def test_a_given_cache_or_implementation_is_kept():
    model = tiny_llama("entmax15")
    given = DynamicCache()
    assert cache_of(generate(model, given)) is given
    assert type(cache_of(generate(model, None, cache_implementation="dynamic"))) is DynamicCache
    assert type(cache_of(generate(model, None, cache_implementation="static"))) is StaticCache
    hs.unpatch_model(model)
    assert "_prepare_cache_for_generation" not in vars(model)
    assert type(cache_of(generate(model, None))) is DynamicCache


@pytest.mark.parametrize("family", ["mistral", "gemma2", "bart"])
def test_sliding_windows_and_encoder_decoders_keep_transformers_cache(family):
    model = hs.patch_model(tiny_model(family), attn="entmax15")
    assert "_prepare_cache_for_generation" in vars(model)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    if family == "bart":
        assert type(cache_of(out)) is EncoderDecoderCache
        assert not isinstance(cache_of(out).self_attention_cache, GrowingCache)
    else:
        assert type(cache_of(out)) is DynamicCache  # with its sliding-window layers
        assert any(type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in cache_of(out).layers)


WINDOWED = {"mistral", "gemma2", "gemma3_text", "gpt_oss"}  # the sweep's configs with sliding-window layers


@pytest.mark.parametrize("family", [name for name, entry in FAMILIES.items() if entry[2] == "causal"])
def test_every_causal_family_decodes_on_the_default_as_on_dynamic_cache(family):
    model = hs.patch_model(tiny_model(family), attn="entmax15")
    with torch.no_grad():
        got, want = (model.generate(**batch(family), max_new_tokens=4, do_sample=False, pad_token_id=0,
                                    return_dict_in_generate=True, output_scores=True, **{CACHE: cache})
                     for cache in (None, DynamicCache(config=model.config)))
    assert type(cache_of(got)) is (DynamicCache if family in WINDOWED else GrowingCache)
    assert same(got, want)


def test_a_saved_patched_model_reloads_with_the_default(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_llama("entmax15")
    want = generate(model, None)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    got = generate(loaded, None)
    assert type(cache_of(got)) is GrowingCache and same(got, want)


def read_lengths(monkeypatch) -> list[tuple[int, int]]:
    """``(keys the decoding step got, keys of the cache it was handed)`` of every decoding call, recorded."""
    seen = []
    filled_part = interface.filled_part

    def spy_cut(layer, key, value, mask):
        cut = filled_part(layer, key, value, mask)
        seen.append((cut[0].shape[-2], key.shape[-2]))
        return cut

    monkeypatch.setattr(interface, "filled_part", spy_cut)
    return seen


@needs_kernel
@pytest.mark.parametrize("attn", ["entmax15", "sparsemax"])
def test_a_static_cache_reads_its_filled_slots_only_and_equals_dynamic_cache(attn, monkeypatch):
    model = tiny_llama(attn)
    want = generate(model, DynamicCache())
    seen = read_lengths(monkeypatch)
    got = generate(model, None, cache_implementation="static")
    assert type(cache_of(got)) is StaticCache and same(got, want)
    length = prompt()["input_ids"].shape[1]
    size = cache_of(got).layers[0].max_cache_len  # the static cache's slots
    assert size >= length + 11  # the last step fills them all
    steps = [(length + step + 1, size) for step in range(11) for _ in range(2)]  # 2 layers a step
    assert seen == steps  # every decoding step read its filled slots, never the unwritten ones
    assert keycodes.COUNTS["calls"] > 0


def test_a_mask_that_shows_an_unwritten_slot_keeps_every_slot():
    config = tiny_llama("sdpa").config
    cache = StaticCache(config=config, max_cache_len=16)
    key, value = torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    keys, values = cache.update(key, value, 0)
    layer = cache.layers[0]
    masked = torch.finfo(torch.float32).min
    mask = torch.zeros(1, 1, 1, 16)
    mask[..., 10:] = masked
    cut = pages.filled_part(layer, keys, values, mask)
    assert cut[0].shape[-2] == cut[1].shape[-2] == 10 and cut[2] is None  # every filled slot seen: no mask left
    assert torch.equal(cut[0], key) and torch.equal(cut[1], value)
    mask[..., 2] = masked  # a padded slot among the filled ones: the mask is kept, cut to them
    cut = pages.filled_part(layer, keys, values, mask)
    assert cut[0].shape[-2] == 10 and torch.equal(cut[2], mask[..., :10])
    mask[..., 2] = 0.0
    mask[..., 13] = 0.0  # a row may see slot 13: nothing is cut
    assert pages.filled_part(layer, keys, values, mask)[0] is keys
    seen = torch.zeros(1, 1, 1, 16, dtype=torch.bool)
    seen[..., :10] = True
    cut = pages.filled_part(layer, keys, values, seen)
    assert cut[0].shape[-2] == 10 and cut[2] is None
    seen[..., 4] = False
    assert torch.equal(pages.filled_part(layer, keys, values, seen)[2], seen[..., :10])
    seen[..., 4] = True
    seen[..., 15] = True
    assert pages.filled_part(layer, keys, values, seen)[0] is keys
    assert pages.filled_part(layer, keys, values, None)[0] is keys  # no mask: every slot is seen
    assert pages.filled_part(layer, keys.clone(), values, mask)[0].shape[-2] == 16  # not this layer's keys
    assert pages.filled_part(None, keys, values, mask)[0] is keys


def test_rows_of_a_strided_cache_view_equal_a_copys():
    buffer = torch.randn(2, 3, 40, 8)
    view = buffer[:, :, :25]
    index = torch.randint(0, 2 * 3 * 25, (60,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(pages.take_rows(view, index), view.reshape(-1, 8).index_select(0, index))
    assert torch.equal(pages.take_rows(buffer, index), buffer.reshape(-1, 8).index_select(0, index))
    odd = buffer.transpose(1, 2)[:, :3]  # not rows of a cache: read from a copy, the same rows
    assert torch.equal(pages.take_rows(odd, index[:10] % 18), odd.reshape(-1, 8).index_select(0, index[:10] % 18))
