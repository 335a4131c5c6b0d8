r"""One sparse attention layer's decoding step over a StaticCache with unwritten slots: the step cut to the filled
slots (:func:`hf_sparsemax.attention.blocked.pages.filled_part`, the library's path), the same step reading every slot
(the cut switched off), and a DynamicCache holding the same keys, alternating in one process (issue 55).

SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head size 64), random keys and queries, float32, one
thread, CPU time; each round appends one key to every cache and times one step of each variant. A whole token is
30 such layers and the rest of the model (``bench_long_generation.py --static-room``).

    PYTHONPATH=. python benchmarks/bench_static_slots.py --filled 4096 --slots 16384 --rounds 40
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--filled", type=int, default=4096)
    parser.add_argument("--slots", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--attn", default="entmax15")
    args = parser.parse_args()
    from transformers import DynamicCache, LlamaConfig, StaticCache

    from hf_sparsemax.attention import interface
    from hf_sparsemax.attention.blocked import pages
    from hf_sparsemax.attention.interface import AttentionOptions, OPTIONS_ATTR, sparse_attention_forward

    heads, kv_heads, dim = 9, 3, 64
    torch.set_num_threads(1)
    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         hidden_size=heads * dim)
    module = torch.nn.Module().eval()
    module.layer_idx, module.is_causal = 0, False
    setattr(module, OPTIONS_ATTR, AttentionOptions.from_settings(args.attn, {}))
    generator = torch.Generator().manual_seed(0)
    total = args.filled + args.rounds
    key, value = torch.randn(1, kv_heads, total, dim, generator=generator), torch.randn(1, kv_heads, total, dim,
                                                                                         generator=generator)
    caches = {"StaticCache, cut to the filled slots": StaticCache(config=config, max_cache_len=args.slots),
              "StaticCache, every slot read": StaticCache(config=config, max_cache_len=args.slots),
              "DynamicCache": DynamicCache()}
    for cache in caches.values():
        cache.update(key[:, :, : args.filled], value[:, :, : args.filled], 0)
    every_slot = lambda layer, k, v, mask: (k, v, mask)  # noqa: E731
    times = {name: [] for name in caches}
    masked = torch.finfo(torch.float32).min
    for round_ in range(args.rounds):
        position = args.filled + round_
        query = torch.randn(1, heads, 1, dim, generator=generator) * 2
        names = list(caches) if round_ % 2 == 0 else list(caches)[::-1]
        for name in names:
            cache = caches[name]
            pages.remember_cache(module, (), {"cache": cache})
            keys, values = cache.update(key[:, :, position : position + 1], value[:, :, position : position + 1], 0)
            mask = torch.zeros(1, 1, 1, keys.shape[-2])
            mask[..., position + 1 :] = masked  # the unwritten slots (none in a DynamicCache)
            interface.filled_part = every_slot if name.endswith("every slot read") else pages.filled_part
            with torch.no_grad():
                start = time.process_time()
                sparse_attention_forward(module, query, keys, values, mask, scaling=dim**-0.5, mapping=args.attn)
                times[name].append(time.process_time() - start)
            interface.filled_part = pages.filled_part
    reference = statistics.median(times["DynamicCache"][4:])
    print(f"{args.attn}, one layer (9 / 3 heads, D 64), {args.filled}-{total} keys filled of {args.slots} static "
          f"slots, {args.rounds} rounds alternating (first 4 dropped), CPU time on 1 thread; "
          f"load (uptime): {os.getloadavg()[0]:.2f}")
    for name, spent in times.items():
        median = statistics.median(spent[4:])
        print(f"| {name} | {median * 1e6:.0f} us (median) | {statistics.mean(spent[4:]) * 1e6:.0f} us (mean) | "
              f"{median / reference:.2f}x DynamicCache |")


if __name__ == "__main__":
    main()
