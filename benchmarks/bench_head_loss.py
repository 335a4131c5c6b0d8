"""Output head + loss, forward and backward, from hidden states: HF's default path vs unfused vs fused sparse losses.

SmolLM2-135M shapes (hidden 576, vocab 49152, float32, CPU). Each contender
goes from hidden states ``h`` [tokens, 576] and the head weight ``W`` to the
gradients of ``h`` and ``W``:

- HF default: ``logits = h @ W.T``, ``F.cross_entropy(logits, t)`` (what
  ``LlamaForCausalLM`` does);
- unfused: the same logits, then an hf_sparsemax loss;
- fused: ``hf_sparsemax.fused_head_loss(h, W, t, loss)`` (chunked logits,
  sparse backward).

Median milliseconds (interleaved rounds, one process) and the peak memory
each adds (a fresh spawned process each), as ratios to HF's default.
``--step`` instead times one whole training step (forward, backward, AdamW)
of a SmolLM2-135M-shaped Llama (random weights, batch 8 x 512) with plain
cross-entropy, the unfused and the fused sparse loss.

    python benchmarks/bench_head_loss.py                       # 4096 and 16384 tokens
    python benchmarks/bench_head_loss.py --tokens 4096 --repeats 3
    python benchmarks/bench_head_loss.py --tokens 16384 --repeats 1 --skip-slow
    python benchmarks/bench_head_loss.py --step
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import hf_sparsemax as hs
from common import interleaved_medians, peak_memory_mb

HIDDEN, VOCAB = 576, 49152
LOGIT_STD = 2.0  # scale of the random logits (h ~ N(0, 1), W ~ N(0, (LOGIT_STD / sqrt(HIDDEN))**2))
BASELINE = "HF default: logits + cross_entropy"


def contenders():
    def unfused(loss):
        return lambda h, w, t: loss(h @ w.T, t)

    def fused(name, **options):
        return lambda h, w, t: hs.fused_head_loss(h, w, t, name, **options)

    return {
        BASELINE: lambda h, w, t: F.cross_entropy(h @ w.T, t),
        "unfused sparse_softmax(top_k=64)": unfused(lambda x, t: hs.sparse_softmax_loss(x, t, top_k=64)),
        "unfused sparsemax": unfused(hs.sparsemax_loss),
        "unfused entmax15": unfused(hs.entmax15_loss),
        "fused sparse_softmax(top_k=10)": fused("sparse_softmax", top_k=10),
        "fused sparse_softmax(top_k=64)": fused("sparse_softmax", top_k=64),
        "fused sparse_softmax(top_p=0.9)": fused("sparse_softmax", top_p=0.9),
        "fused sparsemax": fused("sparsemax"),
        "fused entmax15": fused("entmax15"),
        "fused entmax_bisect(1.5)": fused("entmax_bisect", alpha=1.5),
    }


SLOW = ("unfused sparsemax", "unfused entmax15", "fused sparse_softmax(top_p=0.9)")  # each > 1.5x HF at 4096


def setup(tokens, skip_slow=False):
    torch.manual_seed(0)
    h = torch.randn(tokens, HIDDEN)
    w = torch.randn(VOCAB, HIDDEN) * (LOGIT_STD / HIDDEN**0.5)
    t = torch.randint(0, VOCAB, (tokens,))

    def call(fn):
        def once():
            hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
            fn(hh, ww, t).backward()

        return once

    return {name: call(fn) for name, fn in contenders().items() if not (skip_slow and name in SLOW)}


def smollm2_shaped():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    return LlamaForCausalLM(config).train()


STEP_CONTENDERS = {  # name -> patch_model(loss=..., loss_options=...)
    "cross_entropy (HF)": ("cross_entropy", None),
    "unfused sparse_softmax(top_k=64)": ("sparse_softmax", {"top_k": 64}),
    "fused sparse_softmax(top_k=64)": ("sparse_softmax", {"top_k": 64, "fused": True}),
}


def setup_step(batch, length, names=None):
    """One model and optimizer shared by the contenders (re-patched before each step: memory stays one model's)."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, length))
    model = smollm2_shaped()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step_with(loss, options):
        def step():
            hs.patch_model(model, loss=loss, loss_options=options)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    return {name: step_with(*loss) for name, loss in STEP_CONTENDERS.items() if names is None or name in names}


def setup_one_step(batch, length, name):
    """The first step: its peak includes AdamW's state (2 x 540 MB), the same for every contender."""
    return setup_step(batch, length, {name})


def table(ms, memory, base_name):
    base, base_mem = ms[base_name], max(memory[base_name], 1.0)
    for name in ms:
        yield f"| {name} | {ms[name]:.0f} | {ms[name] / base:.2f} | {memory[name]:.0f} | {memory[name] / base_mem:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-slow", action="store_true", help=f"leave out {', '.join(SLOW)}")
    parser.add_argument("--step", action="store_true", help="one training step of a SmolLM2-135M-shaped model")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, float32, median of {args.repeats}\n")
    if args.step:
        print(f"One training step (forward, backward, AdamW), SmolLM2-135M-shaped Llama, batch "
              f"{args.batch} x {args.length}\n")
        print("| loss | ms | x HF | peak MiB | x HF |")
        print("|---|---:|---:|---:|---:|")
        ms = interleaved_medians(setup_step(args.batch, args.length), args.repeats)
        memory = {name: peak_memory_mb(setup_one_step, (args.batch, args.length, name), name) for name in ms}
        print("\n".join(table(ms, memory, "cross_entropy (HF)")), flush=True)
        return
    print(f"Output head + loss, forward + backward, hidden {HIDDEN}, vocab {VOCAB}, logit std {LOGIT_STD}\n")
    for tokens in args.tokens:
        print(f"\n{tokens} tokens\n")
        print("| path | ms | x HF default | peak MiB | x HF default |")
        print("|---|---:|---:|---:|---:|")
        ms = interleaved_medians(setup(tokens, args.skip_slow), args.repeats)
        memory = {name: peak_memory_mb(setup, (tokens, args.skip_slow), name) for name in ms}
        print("\n".join(table(ms, memory, BASELINE)), flush=True)


if __name__ == "__main__":
    main()
