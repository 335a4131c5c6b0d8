"""Smoke test of the Triton attention kernels on a GPU: errors against the torch path, timings against sdpa.

    python benchmarks/triton_smoke.py            # CUDA: checks at 512 tokens, timings at 1k / 4k, bfloat16 (~2 min,
                                                 # most of it Triton compiling ~25 kernel variants)
    python benchmarks/triton_smoke.py --tiny     # rehearsal: tiny sizes (without CUDA under TRITON_INTERPRET=1)

Checks: ``triton_attention`` forward and backward (dQ, dK, dV, d alpha) against the materialised formula of the
library's mappings (``reference_attention``: the torch path's math) for sparsemax, entmax15, alpha 1.3 and a learned
per-head alpha, causal, a padding mask and a sliding window, float32 and bfloat16; max abs errors relative to the
reference's max abs value printed, MISMATCH where one exceeds its bound. Timings: forward and forward + backward, causal, bfloat16, SmolLM2's heads (9 / 3, d 64)
and a Llama-8B layer's (32 / 8, d 128), median of a few runs after a warm-up, against sdpa (flash).

Measured on an H100 (torch 2.11, triton 3.6; a stripped copy of this script), 4096 tokens, causal, bfloat16:
9 / 3 heads d 64: sdpa fwd 0.11 ms, fwd+bwd 0.38 ms; sparsemax 1.39 / 2.26 ms, entmax15 1.26 / 2.13 ms,
alpha 1.3 2.62 / 4.22 ms. 32 / 8 heads d 128: sdpa 0.32 / 1.22 ms; sparsemax 3.90 / 6.79 ms, entmax15
3.73 / 6.53 ms, alpha 1.3 7.23 / 11.87 ms. Errors against the float32 formula: float32 <= 1e-6 relative,
bfloat16 <= 5e-3 relative (outputs and every gradient, d alpha included).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

TINY = "--tiny" in sys.argv
if TINY and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_sparsemax.attention.gpu import triton_attention as ta  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # max abs error / max abs value, outputs and gradients


def operands(batch, heads, kv_heads, n, dim, dtype, seed=0):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    make = lambda h: torch.randn(batch, h, n, dim, generator=generator, device=DEVICE).to(dtype)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def mask_of(kind, batch, n):
    if kind is None:
        return None
    i, j = torch.arange(n, device=DEVICE)[:, None], torch.arange(n, device=DEVICE)[None, :]
    seen = j <= i
    if kind == "padding":
        seen = torch.stack([seen & (j >= 17 * b) for b in range(batch)]).unsqueeze(1)
    elif kind == "window":
        seen = (seen & (j > i - 100)).view(1, 1, n, n)
    return torch.zeros(seen.shape, device=DEVICE).masked_fill(~seen, torch.finfo(torch.float32).min)


def check(name, alpha, dtype, mask_kind, n, heads=(4, 2), dim=64, batch=2):
    query, key, value = operands(batch, heads[0], heads[1], n, dim, dtype, seed=n)
    mask = mask_of(mask_kind, batch, n)
    scaling = dim**-0.5
    learned = isinstance(alpha, torch.Tensor)
    ins = [t.clone().requires_grad_() for t in (query, key, value)]
    a_in = alpha.clone().requires_grad_() if learned else alpha
    refs = [t.detach().float().requires_grad_() for t in (query, key, value)]
    a_ref = alpha.clone().requires_grad_() if learned else alpha
    start = time.time()
    out = ta.triton_attention(*ins, mask, causal=mask is None, alpha=a_in, scaling=scaling)
    ref = ta.reference_attention(*refs, mask, causal=mask is None, alpha=a_ref, scaling=scaling)
    grad = torch.randn(out.shape, device=DEVICE)
    out.backward(grad.to(out.dtype))
    ref.float().backward(grad)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    relative = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()  # noqa
    errors = {"out": relative(out, ref)}
    for label, mine, theirs in zip(("dq", "dk", "dv"), ins, refs):
        errors[label] = relative(mine.grad, theirs.grad)
    if learned:
        errors["dalpha"] = relative(a_in.grad, a_ref.grad)
    worst = max(errors.values())
    nan = not all(map(lambda e: e == e, errors.values()))
    flag = "ok" if worst <= BOUNDS[dtype] and not nan else "MISMATCH"
    text = " ".join(f"{k}={v:.1e}" for k, v in errors.items())
    print(f"check {name:9s} {str(dtype)[6:]:8s} {mask_kind or 'causal':8s} n={n:5d}: {text}  [{flag}] "
          f"({time.time() - start:.1f}s incl. compile)", flush=True)
    return flag == "ok"


def timed(fn, reps):
    fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def timings(n, heads, kv_heads, dim, reps, batch=1):
    query, key, value = operands(batch, heads, kv_heads, n, dim, torch.bfloat16, seed=1)
    ins = [t.clone().requires_grad_() for t in (query, key, value)]
    grad = torch.randn_like(query)
    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, enable_gqa=True)
    rows = {"sdpa": sdpa}
    for name, alpha in (("sparsemax", 2.0), ("entmax15", 1.5), ("alpha1.3", 1.3)):
        rows[name] = lambda q, k, v, a=alpha: ta.triton_attention(q, k, v, None, causal=True, alpha=a)
    learned = torch.linspace(1.2, 1.8, heads, device=DEVICE).requires_grad_()
    rows["learned"] = lambda q, k, v: ta.triton_attention(q, k, v, None, causal=True, alpha=learned)
    base = {}
    for name, fn in rows.items():
        with torch.no_grad():
            forward = timed(lambda: fn(query, key, value), reps)
        both = timed(lambda: fn(*ins).backward(grad), reps)
        base.setdefault("fwd", forward)
        base.setdefault("both", both)
        with torch.no_grad():
            _, _, live, _ = ta._forward(query, key, value, torch.full((heads,), 1.5, device=DEVICE), None, 0.0, True,
                                     dim**-0.5)
        print(f"time n={n:5d} heads={heads}/{kv_heads} d={dim} {name:9s}: fwd {forward:8.2f} ms ({forward / base['fwd']:5.2f}x)"
              f"  fwd+bwd {both:8.2f} ms ({both / base['both']:5.2f}x)", flush=True)
    causal_tiles = torch.ones(live.shape[-2:], device=live.device).tril().sum().item() * heads * batch
    print(f"      entmax15 live tiles: {live.sum().item() / causal_tiles:.1%} of the causal tiles", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (a rehearsal; the interpreter on a CPU)")
    args = parser.parse_args()
    n_check = 40 if args.tiny else 512
    heads = (4, 2)
    dim = 16 if args.tiny else 64
    print(f"device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu (interpreter)'}, torch "
          f"{torch.__version__}, triton {__import__('triton').__version__}", flush=True)
    learned = torch.tensor([1.25, 1.5, 2.0, 1.7], device=DEVICE)
    cases = [("sparsemax", 2.0, torch.float32, None), ("entmax15", 1.5, torch.float32, None),
             ("alpha1.3", 1.3, torch.float32, None), ("learned", learned, torch.float32, None),
             ("sparsemax", 2.0, torch.bfloat16, "padding"), ("entmax15", 1.5, torch.bfloat16, None),
             ("alpha1.3", 1.3, torch.bfloat16, "window"), ("learned", learned, torch.bfloat16, "padding")]
    ok = True
    for name, alpha, dtype, mask_kind in cases:
        try:
            ok &= check(name, alpha, dtype, mask_kind, n_check, heads=heads, dim=dim)
        except Exception as error:  # keep going: the other cases still say something
            ok = False
            print(f"check {name} {dtype} {mask_kind}: FAILED {type(error).__name__}: {error}", flush=True)
    sizes = [(48, 4, 2, 16)] if args.tiny else [(1024, 9, 3, 64), (4096, 9, 3, 64), (4096, 32, 8, 128)]
    for n, h, hk, d in sizes:
        try:
            timings(n, h, hk, d, reps=1 if args.tiny else 5)
        except Exception as error:
            ok = False
            print(f"time n={n} {h}/{hk} d={d}: FAILED {type(error).__name__}: {error}", flush=True)
    print("ALL CHECKS OK" if ok else "SOME CHECKS FAILED", flush=True)


if __name__ == "__main__":
    main()
