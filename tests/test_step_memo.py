"""The attention's work made once a decoding step for all layers (:mod:`hf_sparsemax.attention.blocked.step_memo`).

Checked: greedy ``generate`` (a padded batch, StaticCache and the default GrowingCache) gives the same tokens and
scores bit for bit with the memos as with every layer computing for itself, while the mapping's path is computed
once a generation and a static cache's mask analysis once a step, not once a layer; a value is not reused where
its arguments changed: another model's options, a mask written in place, a new mask object, a crop (another
filled length); two models with different alphas (patched, or loaded with ``attn_implementation=``) alternating or
one freed before the other runs: each computes with its own alpha.
"""

import gc
import types
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, StaticCache

import hf_sparsemax as hs
from hf_sparsemax.attention import interface
from hf_sparsemax.attention.blocked import keycodes, pages, step_memo
from test_growing_cache import CACHE, generate, needs_kernel, tiny_llama

MEMOS = (interface.FIXED_THRESHOLD, pages.HIDES_TAIL)


@pytest.fixture(autouse=True)
def certify_from_64_keys(monkeypatch):
    monkeypatch.setattr(pages, "MIN_KEYS", 64)
    monkeypatch.setattr(keycodes, "MIN_CERTIFIED", 0.0)
    monkeypatch.delenv(pages.ENVIRONMENT, raising=False)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for memo in MEMOS:
        memo.clear()
        monkeypatch.setattr(memo, "computed", 0)


def every_layer_computes(monkeypatch):
    monkeypatch.setattr(step_memo.Memo, "__call__", lambda self, objects, values: self.function(*objects, *values))


@needs_kernel
@pytest.mark.parametrize("cache", ["static", "growing"])
@pytest.mark.parametrize("attn", ["entmax15", "sparsemax"])
def test_generate_is_the_same_bit_for_bit_with_the_memos(attn, cache, monkeypatch):
    model = tiny_llama(attn)
    make = (lambda: StaticCache(config=model.config, max_cache_len=128)) if cache == "static" else hs.GrowingCache
    computed = [memo.computed for memo in MEMOS]
    got = generate(model, make())
    threshold, tail = (memo.computed - before for memo, before in zip(MEMOS, computed))
    assert threshold == 1  # one options object, one dtype: once for the generation
    assert tail == (11 if cache == "static" else 0)  # the static mask: once each of the 11 decoding steps
    with monkeypatch.context() as patched:
        every_layer_computes(patched)
        want = generate(model, make())
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))


def test_the_mapping_path_is_not_reused_for_other_options():
    """Two models alternating (as the benchmark runs them): each call gets its own options' alpha."""
    modules = []
    for alpha in (1.3, 1.7):
        model = tiny_llama("sdpa")
        hs.patch_model(model, attn="entmax_bisect", attn_options={"alpha": alpha})
        modules.append(model.model.layers[0].self_attn)
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 70, 16)
    for module, alpha in [*zip(modules, (1.3, 1.7)), *zip(modules, (1.3, 1.7))]:
        path = interface.threshold_path(module, q, k, k, None, scaling=0.25, dropout=0.0, softcap=None,
                                        position_bias=None, sinks=None, mapping="entmax_bisect")
        assert path["fixed_alpha"] == alpha
    assert interface.FIXED_THRESHOLD.computed == 4
    path = interface.threshold_path(modules[1], q.double(), k.double(), k.double(), None, scaling=0.25,
                                    dropout=0.0, softcap=None, position_bias=None, sinks=None, mapping="entmax_bisect")
    assert path is not None and interface.FIXED_THRESHOLD.computed == 5  # another dtype: computed again


def entmax_bisect_llama(route: str):
    """A tiny Llama with entmax_bisect attention: ``patch_model`` at alpha 1.25 or 1.75 (an options object each), or
    loaded with ``attn_implementation="entmax_bisect"`` (no options object: the mapping's default alpha, 1.5)."""
    if route == "load":
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_llama("sdpa").config, attn_implementation="entmax_bisect").eval()
    model = tiny_llama("sdpa")
    hs.patch_model(model, attn="entmax_bisect", attn_options={"alpha": float(route)})
    return model


def alone(model, monkeypatch) -> torch.Tensor:
    """The model's logits with every layer computing its own path (no memo to reuse)."""
    with monkeypatch.context() as patched:
        every_layer_computes(patched)
        return logits(model)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(40).remainder(96)[None]).logits


ROUTES = [("1.25", "load"), ("load", "1.75"), ("1.25", "1.75")]


@pytest.mark.parametrize("first, second", ROUTES)
def test_two_models_alive_at_once_each_get_their_own_alpha(first, second, monkeypatch):
    """Two models alternating in one process (patched at some alpha, or loaded with ``attn_implementation=``, which
    holds no options object): each computes with its own alpha, whichever ran last."""
    models = [entmax_bisect_llama(first), entmax_bisect_llama(second)]
    want = [alone(model, monkeypatch) for model in models]
    assert not torch.allclose(want[0], want[1])
    for model, expected in [*zip(models, want), *zip(models, want)]:
        assert torch.equal(logits(model), expected)


@pytest.mark.parametrize("first, second", ROUTES)
def test_a_freed_model_hands_its_alpha_to_no_other(first, second, monkeypatch):
    """A model that ran last and was freed: the next model (above all one loaded with ``attn_implementation=``,
    whose calls carry no options object) computes with its own alpha, not the freed model's."""
    model = entmax_bisect_llama(second)
    want = alone(model, monkeypatch)
    other = entmax_bisect_llama(first)
    assert not torch.equal(logits(other), want)
    del other
    gc.collect()
    assert torch.equal(logits(model), want)


def test_the_mask_analysis_is_not_reused_after_a_change():
    """A static layer's cut to its filled slots: made again for a mask written in place, a crop (another filled
    length) and a new mask object equal to an old one; reused for the same mask and length (the next layer)."""
    key, value = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    layer = types.SimpleNamespace(keys=key, cumulative_length=6)
    mask = torch.zeros(1, 1, 1, 8)
    mask[..., 6:] = torch.finfo(torch.float32).min  # slots 6, 7 unwritten and hidden

    def cut():
        return pages.filled_part(layer, key, value, mask)[0].shape[-2]

    assert cut() == 6 and cut() == 6 and pages.HIDES_TAIL.computed == 1  # the second layer reuses
    layer.cumulative_length = 4  # a crop: slots 4, 5 are seen by the mask, so nothing is cut
    assert cut() == 8 and pages.HIDES_TAIL.computed == 2
    layer.cumulative_length = 6
    assert cut() == 6
    mask[..., 7] = 0.0  # written in place: slot 7 is seen
    assert cut() == 8
    old, mask = mask, mask.clone()
    old[..., 7] = torch.finfo(torch.float32).min  # the old mask hides the tail again; the new one does not
    assert cut() == 8
    mask = old
    assert cut() == 6 and pages.HIDES_TAIL.computed == 6


def test_a_memo_holds_its_objects_weakly_and_never_reuses_for_another():
    memo = step_memo.Memo(lambda tensor, scale: float(tensor.sum()) * scale)
    a = torch.ones(3)
    assert memo((a,), (2,)) == 6.0 and memo((a,), (2,)) == 6.0 and memo.computed == 1
    assert memo((a,), (3,)) == 9.0 and memo((torch.ones(3),), (3,)) == 9.0 and memo.computed == 3
    del a  # freed: an object made later at its address is not taken for it
    assert memo((torch.zeros(3),), (3,)) == 0.0 and memo.computed == 4
    memo = step_memo.Memo(lambda options, scale: (1.5 if options is None else float(options)) * scale)
    options = torch.tensor(1.25)  # (any object that takes a weak reference, as an options object does)
    assert memo((options,), (2,)) == 2.5
    del options  # freed: a call without an object (None) is not taken for it either
    assert memo((None,), (2,)) == 3.0 and memo.computed == 2
    assert memo((None,), (2,)) == 3.0 and memo.computed == 2  # None is held, so the same None reuses


def learned_llama():
    import test_growing_cache

    model = test_growing_cache.tiny_llama("sdpa")
    hs.patch_model(model, attn="entmax_bisect", attn_options={"alpha": 1.5, "learn_alpha": True})
    return model


def learned_modules(model):
    return [m for m in model.modules() if isinstance(m, interface.LearnedAlpha)]


@needs_kernel
def test_a_learned_alpha_is_held_per_layer_and_computed_again_when_its_values_change(monkeypatch):
    """A learned alpha per head (one ``LearnedAlpha`` a layer): a decoding step takes each layer's alphas as
    computed when ``pre_alpha`` last changed (``without_grad``), not its ~10 operations again. Greedy generate is
    the same bit for bit as with the alphas computed at every call; each layer computed its alphas once for the
    generation; a write no version counter sees (``pre_alpha.data.copy_``) gives the new alphas at the next step
    (the output equals a model whose alphas were those from the start), and so does a new device or dtype."""
    model = learned_llama()
    with torch.no_grad():
        for module in learned_modules(model):
            module.pre_alpha.data.uniform_(-1.0, 1.0, generator=torch.Generator().manual_seed(4))
    calls = []
    forward = interface.LearnedAlpha.forward
    monkeypatch.setattr(interface.LearnedAlpha, "forward", lambda self: calls.append(self) or forward(self))
    got = generate(model, hs.GrowingCache())
    assert len(calls) == len(learned_modules(model)) == 2  # once a layer, for the whole generation
    with monkeypatch.context() as patched:
        patched.setattr(interface.LearnedAlpha, "without_grad",
                        lambda self, device: (self().to(device), interface.precise_in_float32(self())))
        want = generate(model, hs.GrowingCache())
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))
    layer = learned_modules(model)[0]
    held, _ = layer.without_grad(torch.device("cpu"))
    assert layer.without_grad(torch.device("cpu"))[0] is held  # unchanged values: the same tensor
    version = layer.pre_alpha._version
    layer.pre_alpha.data.copy_(torch.linspace(-2.0, 2.0, layer.pre_alpha.numel()))
    assert layer.pre_alpha._version == version  # the write no version counter sees
    fresh, precise = layer.without_grad(torch.device("cpu"))
    assert fresh is not held and torch.equal(fresh, layer()) and precise == interface.precise_in_float32(layer())
    twin = learned_llama()
    twin.load_state_dict(model.state_dict())
    changed = generate(model, hs.GrowingCache())  # alphas held from before the write would give other scores
    assert all(torch.equal(a, b) for a, b in zip(changed.scores, generate(twin, hs.GrowingCache()).scores))
    assert not all(torch.equal(a, b) for a, b in zip(changed.scores, got.scores))
    layer.pre_alpha.data = layer.pre_alpha.data.double()  # another dtype: computed again, not compared across
    assert torch.equal(layer.without_grad(torch.device("cpu"))[0], layer())
