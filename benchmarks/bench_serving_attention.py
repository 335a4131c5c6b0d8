"""vLLM decoding throughput of a folder with sparse attention against its softmax twin, and against transformers.

The offline SmolLM2-135M-Instruct (30 layers, float32), saved twice: as it is (vLLM's own CPU attention) and
patched with ``--attn`` (hf_sparsemax's attention backend, in torch over vLLM's paged cache). Each folder gets
its own engine, one after the other; a batch of ``--batch`` requests decodes ``--new-tokens`` tokens
(``ignore_eos``), median of ``--repeats`` rounds. The engine's start time is timed too, and its memory: the
peak resident memory (``VmHWM``) of the engine's processes summed, read before the engine shuts down (the KV
cache is the same ``VLLM_CPU_KVCACHE_SPACE`` for both). transformers' own ``generate`` decodes the same batch
(left padding) from the sparse folder, for the second baseline.

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bench_serving_attention.py --batch 8 --new-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import torch

import hf_sparsemax as hs
from hf_sparsemax.app.assets import load_smollm2


def save_folders(root: str, attn: str, **config) -> dict[str, str]:
    """SmolLM2 (float32) saved as it is (``softmax``) and patched with ``attn``; ``config``: ``from_pretrained``
    keywords that change its config (the rope), saved in both folders alike."""
    model, tokenizer = load_smollm2(dtype=torch.float32, **config)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folders = {"softmax": os.path.join(root, "softmax"), attn: os.path.join(root, attn)}
    model.save_pretrained(folders["softmax"])
    tokenizer.save_pretrained(folders["softmax"])
    hs.patch_model(model, attn=attn).save_pretrained(folders[attn])
    tokenizer.save_pretrained(folders[attn])
    return folders


def engine_memory() -> float:
    """Peak resident memory (``VmHWM``, MiB) of this process's child processes (the engine's) summed."""
    import psutil

    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            with open(f"/proc/{child.pid}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        except (OSError, StopIteration):
            continue
    return total / 1024


def vllm_rate(folder: str, prompts: list[str], new_tokens: int, repeats: int) -> tuple[float, float, float]:
    """(engine start in s, median tokens/s, engine peak memory in MiB) of one engine serving ``folder``; the engine
    is shut down after."""
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=folder, dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
    started = time.perf_counter() - start
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    memory = engine_memory()
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return started, len(prompts) * new_tokens / statistics.median(times), memory


def transformers_rate(folder: str, prompts: list[str], new_tokens: int, repeats: int) -> float:
    """Median tokens/s of transformers' ``generate`` on the batch (greedy, left padding, one torch thread)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)  # as vLLM's engine runs
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            times.append(time.perf_counter() - start)
    return len(prompts) * new_tokens / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attn", default="entmax15")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompts = [f"Story number {i}: once upon a time" for i in range(args.batch)]
    with tempfile.TemporaryDirectory() as root:
        folders = save_folders(root, args.attn)
        rows = {f"vLLM, {name} attention": vllm_rate(folder, prompts, args.new_tokens, args.repeats)
                for name, folder in folders.items()}
        rows[f"transformers generate, {args.attn} attention"] = (
            None, transformers_rate(folders[args.attn], prompts, args.new_tokens, args.repeats), None)
    base_start, base_rate, base_memory = rows["vLLM, softmax attention"]
    print(f"batch {args.batch}, {args.new_tokens} new tokens, median of {args.repeats}\n")
    print("| engine | tokens/s | vs vLLM softmax | engine start (s) | vs softmax | engine peak RSS (MiB) | vs softmax |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (started, rate, memory) in rows.items():
        start = f"{started:.1f} | {started / base_start:.2f}" if started is not None else "- | -"
        peak = f"{memory:.0f} | {memory / base_memory:.2f}" if memory is not None else "- | -"
        print(f"| {name} | {rate:.1f} | {rate / base_rate:.2f} | {start} | {peak} |")


if __name__ == "__main__":
    main()
