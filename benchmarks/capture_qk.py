"""Real-text attention inputs for ``bench_gpu.py``: post-rotary queries, keys and values of the pretrained
SmolLM2-135M-Instruct (the offline GGUF asset) on the fortunes corpus, captured on the CPU.

One forward over ``--tokens`` tokens of fortunes text (float32, sdpa), stopped after the last captured layer; an
attention function registered for the run records each chosen layer's ``query [1, 9, T, 64]`` (after the rotary
embedding, as the attention sees it) and ``key`` / ``value [1, 3, T, 64]``, then computes sdpa. Saved as bfloat16
to ``.bench_data/smollm2_qkv.pt`` (git-ignored; carried to the GPU machine), with the layers' indices, the
attention scale and ``--rows`` rows of text token ids (different passages, ``--tokens + 64`` each) for the
whole-model sections. One middle layer at 8192 tokens is about 16 MB (the size is printed).

    PYTHONPATH=. python benchmarks/capture_qk.py                  # layer 15, 8192 tokens
    PYTHONPATH=. python benchmarks/capture_qk.py --layers 3 15 --tokens 4096
"""

from __future__ import annotations

import argparse
import os
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT = os.path.join(ROOT, ".bench_data", "smollm2_qkv.pt")
NAME = "capture_qk"


class Done(Exception):
    """Raised after the last captured layer: the rest of the forward is not needed."""


def text_ids(tokenizer, rows: int, length: int) -> torch.Tensor:
    """``[rows, length]`` token ids of fortunes text, row ``i`` from a different passage."""
    from hf_sparsemax.app.assets import fortunes

    ids = tokenizer("\n\n".join(fortunes()), return_tensors="pt").input_ids[0]
    if ids.numel() < length + rows * 997:
        raise ValueError(f"the fortunes text has {ids.numel()} tokens, too few for {rows} rows of {length}")
    return torch.stack([ids[i * 997 : i * 997 + length] for i in range(rows)]).to(torch.int32)


def capture(model, ids: torch.Tensor, layers: list[int]) -> dict[int, tuple[torch.Tensor, ...]]:
    """``{layer: (query, key, value)}`` of one forward over ``ids`` ``[1, T]``."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    found = {}

    def attention(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx in layers:
            found[module.layer_idx] = tuple(t.detach().to(torch.bfloat16).clone() for t in (query, key, value))
            if len(found) == len(layers):
                raise Done
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # without a mask function the model would build no mask
    model.set_attn_implementation(NAME)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except Done:
        pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[15])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=8, help="rows of token ids saved for the whole-model sections")
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args()
    from hf_sparsemax.app.assets import load_smollm2

    start = time.perf_counter()
    model, tokenizer = load_smollm2(dtype=torch.float32)
    model.eval()
    ids = text_ids(tokenizer, args.rows, args.tokens + 64)
    found = capture(model, ids[:1, : args.tokens].long(), sorted(args.layers))
    layers = sorted(found)
    attention = model.model.layers[layers[0]].self_attn
    data = {"layers": layers, "scaling": float(attention.scaling), "tokens": ids,
            **{name: torch.cat([found[i][j] for i in layers]) for j, name in enumerate(("query", "key", "value"))},
            "source": "SmolLM2-135M-Instruct (GGUF), fortunes, post-rotary q / k / v, bfloat16"}
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    torch.save(data, args.output)
    print(f"layers {layers}: query {tuple(data['query'].shape)}, key {tuple(data['key'].shape)}; "
          f"{os.path.getsize(args.output) / 2 ** 20:.1f} MiB in {args.output} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
