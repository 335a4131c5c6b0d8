"""One SmolLM2-135M training step (forward + backward) with each attention, beside sdpa and eager softmax.

Times are medians of interleaved rounds in one process; ratios are to eager
softmax attention (transformers' own ``eager``), which materialises the same
``B x H x q x kv`` weights the sparse attentions do. Peak memory is the
resident memory one step adds, in a fresh process that holds the loaded model. The last table
compares the materialised path with the chunked one (``chunk_size``: queries
in blocks, recomputed in backward) at a long sequence, on the first layers
of the model.

    python benchmarks/bench_attention.py                       # seq 256 and 1024, batch 4
    python benchmarks/bench_attention.py --seqs 256 --repeats 3
"""

from __future__ import annotations

import argparse
import gc

import torch

import hf_sparsemax as hs
from hf_sparsemax.app import assets
from common import interleaved_medians, peak_memory_mb

CONTENDERS = {  # name -> (attn_implementation or patch_model attn, attn_options)
    "sdpa (softmax)": ("sdpa", None),
    "eager (softmax)": ("eager", None),
    "sparsemax": ("sparsemax", {}),
    "entmax15": ("entmax15", {}),
    "entmax_bisect(1.5)": ("entmax_bisect", {"alpha": 1.5}),
    "entmax_bisect(learned alpha)": ("entmax_bisect", {"alpha": 1.5, "learn_alpha": True}),
    "sparse_softmax(top_k=32)": ("sparse_softmax", {"top_k": 32}),
    "entmax15, chunk_size=256": ("entmax15", {"chunk_size": 256}),
}


def use(model, attn: str, options) -> None:
    if options is None:
        hs.unpatch_model(model)
        model.set_attn_implementation(attn)
    else:
        hs.patch_model(model, attn=attn, attn_options=options)


def training_step(model, attn: str, options, ids: torch.Tensor):
    def step():
        use(model, attn, options)
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        gc.collect()

    return step


def memory_setup(attn: str, options, batch: int, seq: int, layers: int | None) -> dict:
    """For :func:`peak_memory_mb`: a fresh process holding the model, its inputs, and the step to measure."""
    torch.manual_seed(0)
    model = load(layers)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    step = training_step(model, attn, options, ids)
    use(model, attn, options)
    return {"step": step}


def load(layers: int | None):
    model, _ = assets.load_smollm2()
    model.train()
    if layers is not None:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    return model


def table(title: str, rows: dict[str, tuple[float, float]], base: str) -> None:
    ms0, mb0 = rows[base]
    print(f"\n{title}\n\n| attention | step ms | x eager | peak MiB | x eager |\n|---|---:|---:|---:|---:|")
    for name, (ms, mb) in rows.items():
        print(f"| {name} | {ms:.0f} | {ms / ms0:.2f} | {mb:.0f} | {mb / mb0:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--long-seq", type=int, default=4096, help="sequence length of the chunked-path table")
    parser.add_argument("--long-layers", type=int, default=4, help="first layers of the model kept for it")
    args = parser.parse_args()
    model = load(None)
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, SmolLM2-135M, float32, "
          f"median of {args.repeats} interleaved rounds")
    for seq in args.seqs:
        ids = torch.randint(0, model.config.vocab_size, (args.batch, seq), generator=generator)
        steps = {name: training_step(model, attn, options, ids) for name, (attn, options) in CONTENDERS.items()}
        ms = interleaved_medians(steps, args.repeats)
        rows = {name: (ms[name], peak_memory_mb(memory_setup, (attn, options, args.batch, seq, None), "step"))
                for name, (attn, options) in CONTENDERS.items()}
        table(f"Training step, batch {args.batch} x seq {seq}:", rows, "eager (softmax)")

    model = load(args.long_layers)
    ids = torch.randint(0, model.config.vocab_size, (1, args.long_seq), generator=generator)
    long = {
        "eager (softmax)": ("eager", None),
        "entmax15 (materialised)": ("entmax15", {}),
        "entmax15, chunk_size=512": ("entmax15", {"chunk_size": 512}),
        "sparsemax, chunk_size=512": ("sparsemax", {"chunk_size": 512}),
    }
    steps = {name: training_step(model, attn, options, ids) for name, (attn, options) in long.items()}
    ms = interleaved_medians(steps, 1)
    rows = {name: (ms[name], peak_memory_mb(memory_setup, (attn, options, 1, args.long_seq, args.long_layers), "step"))
            for name, (attn, options) in long.items()}
    table(f"Long sequence, batch 1 x seq {args.long_seq}, first {args.long_layers} layers:", rows, "eager (softmax)")


if __name__ == "__main__":
    main()
