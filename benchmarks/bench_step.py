"""Training-step scaling: a 4-layer SmolLM2-shaped Llama (random weights), forward + backward, per attention.

Hidden 576, 9 heads, 3 KV heads, intermediate 1536, vocabulary 49152, batch 1;
cross-entropy loss, ``use_cache=False`` (training). Medians of interleaved rounds in one process per sequence
length; ratios to transformers' eager softmax attention (which materialises the
same ``B x H x q x kv`` weights as the sparse attentions) and to sdpa, the
default users start from.

    python benchmarks/bench_step.py                       # seq 512 1024 2048
    python benchmarks/bench_step.py --seqs 512 --repeats 3
    python benchmarks/bench_step.py --seqs 512 --compiled    # inductor: x compiled eager / compiled sdpa
    python benchmarks/bench_step.py --seqs 4096 --repeats 2 --chunk-size 512 --memory   # + chunked, peak memory

``--chunk-size N`` adds each sparse attention on its memory-bounded path
(queries in blocks of ``N``, recomputed in backward); ``--memory`` adds the
peak resident memory one step adds, each contender in a fresh process, as
ratios to sdpa (which never materialises the attention weights) and eager.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_sparsemax as hs
from common import interleaved_medians, peak_memory_mb

CONTENDERS = {  # name -> (attention, attn_options or None for a transformers implementation)
    "sdpa (softmax)": ("sdpa", None),
    "eager (softmax)": ("eager", None),
    "sparsemax": ("sparsemax", {}),
    "entmax15": ("entmax15", {}),
    "entmax_bisect(1.3)": ("entmax_bisect", {"alpha": 1.3}),
    "entmax_bisect(learned alpha)": ("entmax_bisect", {"alpha": 1.5, "learn_alpha": True}),
    "entmax_bisect(learned alpha from 1.05)": ("entmax_bisect", {"alpha": 1.05, "learn_alpha": True}),
}


def smollm2_shaped(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
    return LlamaForCausalLM(config).train()


def patched(layers: int, attn: str, options: dict | None) -> LlamaForCausalLM:
    model = smollm2_shaped(layers)
    if options is None:
        model.set_attn_implementation(attn)
        return model
    return hs.patch_model(model, attn=attn, attn_options=options)


def contenders(chunk_size: int | None) -> dict:
    """``CONTENDERS``, plus each sparse attention with ``chunk_size`` when one is given."""
    found = dict(CONTENDERS)
    if chunk_size:
        found.update({f"{name}, chunk_size={chunk_size}": (attn, {**options, "chunk_size": chunk_size})
                      for name, (attn, options) in CONTENDERS.items() if options is not None})
    return found


def memory_setup(layers: int, attn: str, options: dict | None, seq: int) -> dict:
    """For :func:`common.peak_memory_mb`: a fresh process holding the model and its inputs, and the step."""
    model = patched(layers, attn, options)
    ids = torch.randint(0, 49152, (1, seq), generator=torch.Generator().manual_seed(seq))
    return {"step": step(model, ids)}


def step(model, ids):
    def once():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    return once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compiled", action="store_true", help="add each step compiled with inductor")
    parser.add_argument("--chunk-size", type=int, help="add each sparse attention with this chunk_size")
    parser.add_argument("--memory", action="store_true", help="add peak memory per step (a fresh process each)")
    parser.add_argument("--skip", nargs="+", default=[], help="leave out the contenders whose names contain these")
    args = parser.parse_args()
    specs = {name: spec for name, spec in contenders(args.chunk_size).items()
             if not any(part in name for part in args.skip)}
    models = {name: patched(args.layers, *spec) for name, spec in specs.items()}
    if args.compiled:  # the same step compiled with inductor (one graph per model; compile time not counted)
        models.update({f"compiled {name}": torch.compile(models[name]) for name in CONTENDERS if name in models})
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, float32, {args.layers}-layer "
          f"SmolLM2-shaped Llama, batch 1, median of {args.repeats} interleaved rounds\n")
    print("| seq | attention | step ms | x eager | x sdpa |\n|---:|---|---:|---:|---:|")
    for seq in args.seqs:
        ids = torch.randint(0, 49152, (1, seq), generator=torch.Generator().manual_seed(seq))
        ms = interleaved_medians({name: step(model, ids) for name, model in models.items()}, args.repeats)
        for name in models:
            base = "compiled " if name.startswith("compiled ") else ""
            print(f"| {seq} | {name} | {ms[name]:.0f} | {ms[name] / ms[base + 'eager (softmax)']:.2f} | "
                  f"{ms[name] / ms[base + 'sdpa (softmax)']:.2f} |", flush=True)
    if args.memory:
        del models
        print("\n| seq | attention | peak MiB | x sdpa | x eager |\n|---:|---|---:|---:|---:|")
        for seq in args.seqs:
            mib = {name: peak_memory_mb(memory_setup, (args.layers, *spec, seq), "step")
                   for name, spec in specs.items()}
            for name in specs:
                print(f"| {seq} | {name} | {mib[name]:.0f} | {mib[name] / mib['sdpa (softmax)']:.2f} | "
                      f"{mib[name] / mib['eager (softmax)']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
