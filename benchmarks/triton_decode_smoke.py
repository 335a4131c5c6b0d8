"""Smoke test and timing of the Triton decoding kernel on a GPU (hf_sparsemax/attention/gpu/triton_decode.py).

One query row per sequence against a bfloat16 cache of random keys, SmolLM2-135M's heads (9 query / 3 kv, d 64)
and a Llama-3-8B layer's (32 / 8, d 128), 2k and 8k cached keys, batch 1 and 8 (batch 8 left-padded: a boolean
mask), for sparsemax, 1.5-entmax, alpha 1.3 and a learned alpha per head. For each: the largest difference from
the torch decoding path (``decode_attention``, eager solvers) and from the float64 materialised formula (both
paths), the mean time a call (launches included) against sdpa's (``enable_gqa``, same mask) and the torch path's.

    python benchmarks/triton_decode_smoke.py            # on CUDA, < 1.5 min
    python benchmarks/triton_decode_smoke.py --tiny     # rehearsal on the CPU under Triton's interpreter
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_SPARSEMAX_COMPILED_SOLVER", "0")  # the torch path's eager solvers: nothing to compile
import torch  # noqa: E402  (torch does not import triton; the package's compiled solvers do)

if "--tiny" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import hf_sparsemax as hs  # noqa: E402
from hf_sparsemax.attention.blocked.decode import decode_attention  # noqa: E402
from hf_sparsemax.attention.gpu.triton_decode import triton_decode  # noqa: E402
from hf_sparsemax.mappings import registry  # noqa: E402

MODELS = {"SmolLM2 (9/3, d64)": (9, 3, 64), "Llama-8B layer (32/8, d128)": (32, 8, 128)}
TINY_MODELS = {"tiny (6/2, d16)": (6, 2, 16)}


def mappings(heads: int, device) -> dict:
    learned = torch.linspace(1.2, 1.9, heads, device=device)
    return {"sparsemax": 2.0, "entmax15": 1.5, "alpha 1.3": 1.3, "learned per head": learned}


def inputs(batch, heads, kv_heads, dim, keys, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads, 1, dim, device=device, generator=g).bfloat16()
    k = torch.randn(batch, kv_heads, keys, dim, device=device, generator=g).bfloat16()
    v = torch.randn(batch, kv_heads, keys, dim, device=device, generator=g).bfloat16()
    mask = None
    if batch > 1:  # left padding: sequence b starts after b * keys / 64 pad slots
        start = torch.arange(batch, device=device)[:, None] * (keys // 64)
        mask = (torch.arange(keys, device=device)[None, :] >= start).view(batch, 1, 1, keys)
    return q, k, v, mask


def by_torch(q, k, v, mask, alpha, scaling):
    additive = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
        ~mask, torch.finfo(q.dtype).min)
    learned = isinstance(alpha, torch.Tensor)
    name = "entmax_bisect" if learned else {2.0: "sparsemax", 1.5: "entmax15"}.get(alpha, "entmax_bisect")
    out = decode_attention(q, k, v, additive, scaling=scaling, alpha=alpha.view(1, -1, 1, 1) if learned else None,
                           fixed_alpha=None if learned else alpha, threshold=registry.get(name).threshold)
    return out.transpose(1, 2)


def exact(q, k, v, mask, alpha, scaling):
    """The float64 materialised formula."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    s = q.double() @ k.transpose(-1, -2) * scaling
    if mask is not None:
        s = s.masked_fill(~mask, torch.finfo(torch.float64).min)
    if isinstance(alpha, torch.Tensor):
        p = hs.entmax_bisect(s, alpha.double().view(1, -1, 1, 1))
    else:
        p = hs.sparsemax(s) if alpha == 2.0 else hs.entmax15(s) if alpha == 1.5 else hs.entmax_bisect(s, alpha)
    return p @ v


def per_call_ms(fn, reps: int, device) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def graph_ms(fn, reps: int, device) -> float:
    """Mean ms a call replayed from a CUDA graph (the GPU's time, without the host's launches); NaN where capture
    fails or off CUDA."""
    if device.type != "cuda":
        return float("nan")
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps * 1e3
    except Exception as error:  # noqa: BLE001 - a smoke test reports and goes on
        print(f"(graph capture failed: {type(error).__name__}: {str(error)[:200]})")
        return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU under Triton's interpreter)")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = TINY_MODELS if args.tiny else MODELS
    lengths, batches, reps = ((130, 300), (1, 2), 1) if args.tiny else ((2048, 8192), (1, 8), args.reps)
    torch_reps = 1 if args.tiny else 5
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"{name}, torch {torch.__version__}, triton {__import__('triton').__version__}; bfloat16, one query "
          f"row a sequence; ms a call (mean of {reps}, launches included; graph: replayed from a CUDA graph, the "
          f"GPU's time alone)\n")
    print("| heads | keys | batch | mapping | max err vs torch path | max err vs float64: triton / torch | "
          "triton ms | sdpa ms | triton / sdpa | graph: triton / sdpa ms | torch path ms |")
    print("|---|---:|---:|---|---:|---|---:|---:|---:|---|---:|")
    worst = 0.0
    with torch.no_grad():
        for model, (heads, kv_heads, dim) in models.items():
            scaling = dim ** -0.5
            for keys in lengths:
                for batch in batches:
                    q, k, v, mask = inputs(batch, heads, kv_heads, dim, keys, device)
                    sdpa_mask = None if mask is None else mask.expand(batch, heads, 1, keys)
                    call_sdpa = lambda: F.scaled_dot_product_attention(  # noqa: E731
                        q, k, v, attn_mask=sdpa_mask, scale=scaling, enable_gqa=True)
                    sdpa, sdpa_graph = per_call_ms(call_sdpa, reps, device), graph_ms(call_sdpa, reps, device)
                    for mapping, alpha in mappings(heads, device).items():
                        out = triton_decode(q, k, v, mask, alpha=alpha, scaling=scaling)
                        reference = by_torch(q, k, v, mask, alpha, scaling)
                        formula = exact(q, k, v, mask, alpha, scaling)
                        err = (out.float() - reference.float()).abs().max().item()
                        err_ours = (out.double() - formula).abs().max().item()
                        err_torch = (reference.double() - formula).abs().max().item()
                        worst = max(worst, err_ours)
                        call = lambda: triton_decode(q, k, v, mask, alpha=alpha, scaling=scaling)  # noqa: E731
                        ms, graph = per_call_ms(call, reps, device), graph_ms(call, reps, device)
                        torch_ms = per_call_ms(lambda: by_torch(q, k, v, mask, alpha, scaling), torch_reps, device)
                        print(f"| {model} | {keys} | {batch} | {mapping} | {err:.2e} | {err_ours:.2e} / "
                              f"{err_torch:.2e} | {ms:.3f} | {sdpa:.3f} | {ms / sdpa:.2f} | {graph:.3f} / "
                              f"{sdpa_graph:.3f} | {torch_ms:.3f} |",
                              flush=True)
    print(f"\nlargest difference from the float64 formula: {worst:.2e} (bfloat16 output: one rounding is ~4e-3 "
          f"at 1)")


if __name__ == "__main__":
    main()
