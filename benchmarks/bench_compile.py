"""Graph breaks of a patched tiny Llama's forward with its loss, per sparse attention and loss (torch._dynamo.explain).

Two layers, the KV cache on (the model's default); ``--no-cache`` for ``use_cache=False``.

    python benchmarks/bench_compile.py
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_sparsemax as hs

SETUPS = {  # label -> (attention, attn_options, loss, loss_options)
    "sparsemax attention + sparsemax loss": ("sparsemax", {}, "sparsemax", {}),
    "entmax15 attention + entmax15 loss": ("entmax15", {}, "entmax15", {}),
    "entmax_bisect(1.3) attention + loss": ("entmax_bisect", {"alpha": 1.3}, "entmax_bisect", {"alpha": 1.3}),
    "learned-alpha attention + sparse_softmax(top_p=0.9) loss": (
        "entmax_bisect", {"alpha": 1.5, "learn_alpha": True}, "sparse_softmax", {"top_p": 0.9}),
    "sparse_softmax(top_k=4) attention + sparse_softmax(top_k=5) loss": (
        "sparse_softmax", {"top_k": 4}, "sparse_softmax", {"top_k": 5}),
}


def main() -> None:
    print(f"torch {torch.__version__}\n\n| setup | graphs | graph breaks |\n|---|---:|---:|")
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, head_dim=8)
    ids = torch.randint(0, 96, (2, 12))
    labels = ids.clone()
    labels[0, -3:] = -100
    for label, (attn, attn_options, loss, loss_options) in SETUPS.items():
        model = hs.patch_model(LlamaForCausalLM(config), attn=attn, loss=loss, attn_options=attn_options,
                               loss_options=loss_options)
        use_cache = "--no-cache" not in sys.argv
        explained = torch._dynamo.explain(lambda i: model(input_ids=i, labels=labels, use_cache=use_cache).loss)(ids)
        print(f"| {label} | {explained.graph_count} | {explained.graph_break_count} |", flush=True)
        for reason in explained.break_reasons:
            print(f"|   {str(reason.reason).splitlines()[0][:120]} | | |")


if __name__ == "__main__":
    main()
