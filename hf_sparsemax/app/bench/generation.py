"""``hf-sparsemax bench generation``: whole-model greedy decoding at a long context, on each cache.

One prefill of ``--context`` tokens (the pretrained SmolLM2-135M-Instruct where its offline asset is installed,
sdpa) fills a ``DynamicCache``; every variant decodes from its own copy of those keys and values (the sparse
models decode from the softmax model's cache: the keys of the model they were converted from):

- ``sdpa + DynamicCache``: what a user runs today, the reference;
- ``sdpa + GrowingCache``: the library's cache under softmax attention (what the cache alone changes);
- ``<attention> + GrowingCache``: each sparse attention on the cache ``generate`` gives a patched model
  (``GrowingCache(GENERATE_GROWTH)``);
- ``no attention + DynamicCache``: the same model with an attention that costs nothing (it returns zeros): the
  floor under every ratio, the share of a decoding step that is not attention.

Then ``--tokens`` rounds, each one greedy decoding step of every variant, in alternating order. Printed: the
median milliseconds a token, tokens/s, and the ratio to sdpa + DynamicCache.
"""

from __future__ import annotations

import copy

import torch

from . import timing

FLOOR = "no attention"


def settings(args) -> dict:
    small = args.quick or args.smoke
    attns = args.attn or ["sdpa", "sparsemax", "entmax15"]
    return {"context": args.context or (64 if args.smoke else 512 if small else 8192),
            "tokens": args.tokens or args.repeats or (2 if args.smoke else 8),
            "attn": [name for name in attns if name != "sdpa"]}


def floor_attention() -> str:
    """Register (once) and name an attention that costs nothing: zeros, ``[B, q, H, D]``."""
    from transformers import AttentionInterface

    def no_attention(module, query, *args, **kwargs):
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None

    AttentionInterface.register("hf_sparsemax_bench_no_attention", no_attention)
    return "hf_sparsemax_bench_no_attention"


def run(args) -> dict:
    from transformers import DynamicCache

    from ... import GrowingCache
    from ...attention.blocked.growing_cache import GENERATE_GROWTH

    device, read = timing.setup(args)
    dtype = timing.DTYPES[args.dtype]
    plan = settings(args)
    setting = timing.environment(args, device, args.dtype)
    base, described = timing.base_model(getattr(args, "model", None), args.quick or args.smoke, dtype,
                                        tokens=plan["context"])
    base = base.eval().to(device)
    keyword = timing.cache_keyword(base)
    held = {"sdpa": timing.with_attention(base, "sdpa", None)}
    held[FLOOR] = timing.with_attention(copy.deepcopy(base), floor_attention(), None)
    for name in plan["attn"]:
        held[name] = timing.with_attention(copy.deepcopy(base), *timing.attention_spec(name)).eval()
    ids = timing.text_ids(plan["context"], base.config.vocab_size, seed=plan["context"]).to(device)
    with torch.no_grad():
        out = base(input_ids=ids, use_cache=True, logits_to_keep=1, **{keyword: DynamicCache(config=base.config)})
    prefilled, first = timing.cache_of(out), out.logits[:, -1].argmax(-1, keepdim=True)

    def growing():
        cache = GrowingCache(GENERATE_GROWTH)
        for index, layer in enumerate(prefilled.layers):
            cache.update(layer.keys, layer.values, index)
        return cache

    variants = {"sdpa + DynamicCache": ("sdpa", copy.deepcopy(prefilled)),
                "sdpa + GrowingCache": ("sdpa", growing())}
    variants.update({f"{name} + GrowingCache": (name, growing()) for name in plan["attn"]})
    variants[f"{FLOOR} + DynamicCache"] = (FLOOR, copy.deepcopy(prefilled))
    del prefilled
    state = {name: [held[model], cache, first] for name, (model, cache) in variants.items()}

    def step(name):
        def once():
            model, cache, token = state[name]
            with torch.no_grad():
                out = model(input_ids=token, use_cache=True, **{keyword: cache})
            state[name][2] = out.logits[:, -1].argmax(-1, keepdim=True)
        return once

    times = timing.interleaved({name: step(name) for name in variants}, plan["tokens"], read)
    reference = times["sdpa + DynamicCache"]
    rows, results = [], []
    for name, value in times.items():
        rows.append([name, timing.ms(value), f"{1e3 / value:.1f}", timing.ratio(value, reference)])
        results.append({"variant": name, "ms_per_token": value, "tokens_per_s": 1e3 / value,
                        "ratio_to_sdpa_dynamic": value / reference})
    setting.update(model=described, context=plan["context"], tokens=plan["tokens"], batch=1,
                   growth=GENERATE_GROWTH)
    title = (f"Greedy decoding at {plan['context']} cached tokens ({described}, {args.dtype}, {device}, batch 1): "
             f"median of {plan['tokens']} steps a variant, interleaved")
    return timing.finish(args, "generation", setting, title,
                         ["variant", "ms / token", "tokens/s", "x sdpa + DynamicCache"], rows, results)
