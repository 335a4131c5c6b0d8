"""Block budget on an accelerator: prefill and per-token decode of a SmolLM2-shaped Llama (30 layers, 9 / 3 heads;
random weights and tokens, so nothing has to travel to the GPU machine) against sdpa, with the CPU's block budget
(``ATTENTION_BUDGET``, "before") and the accelerator's (``DEVICE_ATTENTION_BUDGET``), in one process on CUDA.
Prints one row per case as it comes (medians of 2 prefills and 5 decoding steps, the wall clock after a
synchronise). Needs a GPU:

    PYTHONPATH=. python benchmarks/bench_device_blocks.py
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_sparsemax as hs
from hf_sparsemax.attention.blocked import blocks

CONFIG = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True,
                     max_position_embeddings=8192)
CPU, DEVICE = blocks.ATTENTION_BUDGET, blocks.DEVICE_ATTENTION_BUDGET
CASES = [("sdpa", torch.float32, 0), ("sparsemax", torch.float32, CPU), ("sparsemax", torch.float32, DEVICE),
         ("entmax15", torch.float32, DEVICE), ("entmax15", torch.float32, CPU), ("sdpa", torch.bfloat16, 0),
         ("sparsemax", torch.bfloat16, DEVICE), ("entmax15", torch.bfloat16, DEVICE)]


def timed(call, repeats: int):
    """(median milliseconds, last result) of ``call`` on the GPU."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2], result


def measure(attn: str, dtype: torch.dtype, budget: int, contexts=(2048, 8192)) -> list[tuple[int, float, float]]:
    """``(context, prefill ms, decode ms a token)`` for one case."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).to("cuda", dtype).eval()
    if attn != "sdpa":
        hs.patch_model(model, attn=attn)
    blocks.DEVICE_ATTENTION_BUDGET = budget
    tokens = torch.Generator().manual_seed(1)
    rows = []
    with torch.no_grad():
        for context in contexts:
            ids = torch.randint(0, CONFIG.vocab_size, (1, context), generator=tokens).cuda()
            model(input_ids=ids[:, :256], logits_to_keep=1)  # compiles the kernels
            prefill, out = timed(lambda: model(input_ids=ids, past_key_values=DynamicCache(config=CONFIG),
                                               logits_to_keep=1), 2)
            cache, steps = out.past_key_values, []
            for _ in range(6):
                following = out.logits[:, -1].argmax(-1, keepdim=True)
                step, out = timed(lambda: model(input_ids=following, past_key_values=cache), 1)
                steps.append(step)
            rows.append((context, prefill, sorted(steps[1:])[2]))
    blocks.DEVICE_ATTENTION_BUDGET = DEVICE
    return rows


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_device_blocks.py measures the block budget on a GPU: no CUDA device here")
    base = {}
    for attn, dtype, budget in CASES:
        for context, prefill, decode in measure(attn, dtype, budget):
            if attn == "sdpa":
                base[dtype, context] = prefill, decode
            sdpa = base[dtype, context]
            print(f"{attn:9s} {str(dtype)[6:]:8s} budget={budget:>9d} ctx={context}: prefill {prefill:8.1f} ms "
                  f"({prefill / sdpa[0]:.2f}x)  decode {decode:6.1f} ms ({decode / sdpa[1]:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
