r"""Long generation on SmolLM2-135M: sdpa and a sparse attention, on transformers' DynamicCache and StaticCache and
on the library's GrowingCache, alternating in one process (issue 55).

One prefill of ``--context`` tokens of fortunes text (the pretrained SmolLM2-135M-Instruct, float32, sdpa) fills a
``DynamicCache``; every variant decodes from its own copy of it (a GrowingCache gets the same keys and values,
filled to their length: its first step reallocates, as after a prefill in ``generate``; a StaticCache of
``--context + --static-room`` slots gets them in its first slots, as ``generate(cache_implementation="static")``
makes one for ``max_new_tokens=--static-room``; ``--static-every-slot`` adds the sparse models on a StaticCache
with the cut to the filled slots switched off, :func:`hf_sparsemax.attention.blocked.pages.filled_part`). Then ``--tokens``
rounds: each round times one greedy decoding step of every variant, in alternating order, CPU time on one thread.
The sparse models decode from the softmax model's cache (one prefill, not one a model: the keys are those of the
softmax model it was converted from). Printed per variant: the median and mean ms a token, the ratio to sdpa +
DynamicCache (what a user runs today) and to the same attention on a DynamicCache (the same cache's copy cost
removed), the keys the int8 certificate never read, and the cache's bytes: what it holds (buffers, and the int8
codes where the attention keeps them) against the keys and values it caches (plus ``D + 4`` bytes a coded key),
after the last step and at worst over the steps.

    PYTHONPATH=. python benchmarks/bench_long_generation.py --context 8192 --tokens 8 --attn entmax15 \
        --growth 2 1.05 --static-room 4096 --static-every-slot
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from bench_inference import prompt


def code_bytes(cache) -> tuple[int, int]:
    """``(bytes of the int8 codes kept, D + 4 bytes a key they code)`` over the cache's layers."""
    from hf_sparsemax.attention.blocked import pages

    held = coded = 0
    for layer in cache.layers:
        codes = getattr(getattr(layer, pages.SUMMARY_ATTR, None), "codes", None)
        if codes is not None:
            batch, heads, _, dim = codes.codes.shape
            held += codes.nbytes()
            coded += batch * heads * codes.coded * (dim + 4)
    return held, coded


def cache_bytes(cache) -> tuple[int, int]:
    """``(bytes the cache holds, bytes of the keys and values it caches)``, codes included in both (a static
    cache holds all its slots and caches its filled ones)."""
    from hf_sparsemax.attention.blocked.pages import filled

    if hasattr(cache, "nbytes"):
        held, cached = cache.nbytes()
    else:
        tensors = [(t, filled(layer)) for layer in cache.layers for t in (layer.keys, layer.values)]
        held = sum(t.numel() * t.element_size() for t, _ in tensors)
        cached = sum(t[:, :, :length].numel() * t.element_size() for t, length in tensors)
    extra_held, extra_cached = code_bytes(cache)
    return held + extra_held, cached + extra_cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=8, help="decoding steps (rounds)")
    parser.add_argument("--attn", nargs="+", default=["entmax15"], help="the sparse attentions (one model each)")
    parser.add_argument("--growth", nargs="+", type=float, default=[2.0], help="GrowingCache growth factors")
    parser.add_argument("--static-room", type=int, default=0,
                        help="slots of a StaticCache beyond the context (0: no StaticCache variants)")
    parser.add_argument("--static-every-slot", action="store_true",
                        help="also the sparse models on a StaticCache reading every slot (no cut to the filled ones)")
    parser.add_argument("--prefill-threads", type=int, default=2)
    args = parser.parse_args()
    import hf_sparsemax as hs
    from hf_sparsemax.app.assets import load_smollm2
    from hf_sparsemax.attention import interface
    from hf_sparsemax.attention.blocked import keycodes, pages
    from transformers import DynamicCache, StaticCache

    os.environ[pages.ENVIRONMENT] = "1"
    base, tokenizer = load_smollm2(dtype=torch.float32)
    models = {"sdpa": base.eval()}
    for attn in args.attn:
        models[attn], _ = load_smollm2(dtype=torch.float32)
        hs.patch_model(models[attn].eval(), attn=attn)
    ids, _ = prompt(tokenizer, args.context, 1)
    with torch.no_grad():
        torch.set_num_threads(args.prefill_threads)
        out = base(input_ids=ids, past_key_values=DynamicCache(config=base.config), logits_to_keep=1)
        prefilled, first = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        del out
        state = {}  # name -> [model, cache, next token]
        for name in models:
            state[f"{name} + DynamicCache"] = [models[name], copy.deepcopy(prefilled), first]
            for growth in args.growth:
                grown = hs.GrowingCache(growth=growth)
                for index, layer in enumerate(prefilled.layers):
                    grown.update(layer.keys, layer.values, index)
                state[f"{name} + GrowingCache x{growth:g}"] = [models[name], grown, first]
            kinds = ["StaticCache"] + (["StaticCache, every slot read"] if args.static_every_slot and name != "sdpa"
                                       else [])
            for kind in kinds if args.static_room else []:
                static = StaticCache(config=base.config, max_cache_len=args.context + args.static_room)
                for index, layer in enumerate(prefilled.layers):
                    static.update(layer.keys, layer.values, index)
                state[f"{name} + {kind}"] = [models[name], static, first]
        del prefilled
        every_slot = lambda layer, key, value, mask: (key, value, mask)  # noqa: E731 (the cut switched off)
        names = list(state)
        times = {name: [] for name in names}
        never = {name: [0, 0] for name in names}
        worst = {name: 0.0 for name in names}
        torch.set_num_threads(1)
        for round_ in range(args.tokens):
            for name in names if round_ % 2 == 0 else names[::-1]:
                model, cache, token = state[name]
                keycodes.reset_counts()
                interface.filled_part = every_slot if name.endswith("every slot read") else pages.filled_part
                start = time.process_time()
                out = model(input_ids=token, past_key_values=cache)
                times[name].append(time.process_time() - start)
                interface.filled_part = pages.filled_part
                state[name][2] = out.logits[:, -1].argmax(-1, keepdim=True)
                never[name][0] += keycodes.COUNTS["certified"]
                never[name][1] += keycodes.COUNTS["keys"]
                held, cached = cache_bytes(cache)
                worst[name] = max(worst[name], held / cached)
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    reference = median["sdpa + DynamicCache"]
    print(f"SmolLM2-135M, float32, {args.context} cached tokens, {args.tokens} decoding steps a variant, alternating "
          f"in one process, CPU time on 1 thread; load (uptime): {os.getloadavg()[0]:.2f}")
    print("| variant | ms/token (median) | ms/token (mean) | / sdpa + DynamicCache | / same attention + DynamicCache "
          "| keys never read | cache bytes / KV (+codes) held, last | worst |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        same = median[f"{name.split(' + ')[0]} + DynamicCache"]
        held, cached = cache_bytes(state[name][1])
        share = f"{never[name][0] / never[name][1]:.1%}" if never[name][1] else ""
        print(f"| {name} | {median[name]:.1f} | {statistics.mean(times[name]) * 1e3:.1f} | {median[name] / reference:.2f}x"
              f" | {median[name] / same:.2f}x | {share} | {held / 2**20:.0f} MiB / {cached / 2**20:.0f} MiB = "
              f"{held / cached:.3f} | {worst[name]:.3f} |")


if __name__ == "__main__":
    main()
