r"""Which bounds on a decoding step's scores would certify SmolLM2's keys, and at how many bytes a key (issue 55).

At 8192 cached keys the int8 certificate (:mod:`hf_sparsemax.attention.blocked.keycodes`) reads ``D + 4`` bytes of
every key (its codes and scale), 1.5 MB a layer for SmolLM2's 3 kv heads: in a model whose weights flush the
caches every token, that is a stream from memory, and it is most of the kernel's time. A bound that reads fewer
bytes a key first, and the int8 codes only of the keys it leaves, would read less. This script measures, on the
model's own queries and keys, the share of the keys each bound would certify (never a candidate of any query row
of its kv head: ``U <= M - CANDIDATE_MARGIN / (alpha - 1)``, ``M`` the row's largest score) and the bytes a key it
would read with the int8 codes as its second stage (``first + (1 - share) (D + 4)``).

One greedy decoding step after a prefill of ``--context`` tokens of fortunes text (``--kv-file``: the prefill
``bench_long_generation.py`` saves), every layer's post-rotary query rows and keys captured; per bound the mean
share over the layers and the least layer's. The bounds are computed in float64 without the kernel's rounding
slack (an upper bound on what an exact kernel would certify with them), all with ``U = t + error``:

- ``exact``: the scores themselves (what any bound can certify at most);
- ``int8 / int4, rho per kv head``: codes ``round(k / s_k)`` (``s_k = max|k| / 127`` or ``/ 7``), error
  ``s_k ||q|| rho`` with ``rho`` the largest residual norm of the kv head (the kernel's form, int8);
  ``rho per key``: each key's own residual norm (4 bytes more a key);
- ``box, n keys``: per block of ``n`` keys the channels' min and max, ``U = sum_d max(q_d min_d, q_d max_d)``
  (the page bounds of :mod:`.pages`, 64 keys);
- ``ball, 16 keys``: per block its mean ``c`` and radius ``r``: ``U = q.c + ||q|| r``;
- ``rank r``: the keys' top ``r`` principal directions ``P`` (of the kv head's keys), ``U = (P q).(P k) +
  ||q - P^T P q|| ||k - P^T P k||``; bytes: ``r`` int8 codes, a scale and the residual norm.

    cd benchmarks && PYTHONPATH=.. python bench_key_bounds.py --context 8192 --kv-file /tmp/prefill8192.pt
"""

from __future__ import annotations

import argparse
import os

import torch

from bench_inference import prompt
from bench_long_generation import prefill


def capture_step(model, cache, token) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """Every layer's ``(query [Hkv, G, D], key [Hkv, n, D], scaling)`` (float64) of one decoding step."""
    from hf_sparsemax.attention import interface

    caught, forward = [], interface.sparse_attention_forward

    def catch(module, query, key, value, mask, **kwargs):
        heads, kv_heads = query.shape[1], key.shape[1]
        caught.append((query[0, :, -1].double().view(kv_heads, heads // kv_heads, -1), key[0].double(),
                       kwargs.get("scaling") or query.shape[-1] ** -0.5))
        return forward(module, query, key, value, mask, **kwargs)

    interface.sparse_attention_forward = catch
    try:
        with torch.no_grad():
            model(input_ids=token, past_key_values=cache)
    finally:
        interface.sparse_attention_forward = forward
    return caught


def shares(query: torch.Tensor, key: torch.Tensor, scaling: float, cut_margin: float) -> dict[str, float]:
    """The share of ``key``'s keys each bound certifies for every row of ``query`` (module docstring)."""
    scores = torch.einsum("hgd,hnd->hgn", query, key) * scaling
    cut = scores.amax(-1, keepdim=True) - cut_margin
    certified = lambda upper: (upper <= cut).all(1).double().mean().item()  # noqa: E731 (every row of the kv head)
    found = {"exact": certified(scores)}
    q_norm = query.norm(dim=-1, keepdim=True)
    for bits, levels in (("int8", 127), ("int4", 7)):
        scale = key.abs().amax(-1, keepdim=True) / levels
        codes = (key / scale).round()
        residual = ((key - codes * scale) / scale).norm(dim=-1)  # [Hkv, n]
        approx = torch.einsum("hgd,hnd->hgn", query, codes * scale) * scaling
        for name, rho in (("rho per kv head", residual.amax(-1, keepdim=True)), ("rho per key", residual)):
            error = scale.squeeze(-1)[:, None, :] * q_norm * rho[:, None, :] * scaling
            low = (approx - error).amax(-1, keepdim=True)  # the kernel's M: the largest lower bound
            found[f"{bits}, {name}"] = ((approx + error) <= low - cut_margin).all(1).double().mean().item()
    n = key.shape[1]
    for size in (16, 64):
        blocks = key[:, : n // size * size].unflatten(1, (n // size, size))
        low, high = blocks.amin(2), blocks.amax(2)
        upper = torch.maximum(query[:, :, None] * low[:, None], query[:, :, None] * high[:, None]).sum(-1) * scaling
        found[f"box, {size} keys"] = certified(upper)
    blocks = key[:, : n // 16 * 16].unflatten(1, (n // 16, 16))
    centre = blocks.mean(2)
    radius = (blocks - centre[:, :, None]).norm(dim=-1).amax(-1)
    found["ball, 16 keys"] = certified((torch.einsum("hgd,hbd->hgb", query, centre) + q_norm * radius[:, None]) * scaling)
    directions = torch.linalg.svd(key, full_matrices=False)[2]  # [Hkv, D, D], rows the principal directions
    for rank in (8, 16, 24, 32, 48):
        basis = directions[:, :rank]
        key_part, query_part = key @ basis.transpose(1, 2), query @ basis.transpose(1, 2)
        key_rest = (key - key_part @ basis).norm(dim=-1)
        query_rest = (query - query_part @ basis).norm(dim=-1)
        upper = (query_part @ key_part.transpose(1, 2) + query_rest[..., None] * key_rest[:, None]) * scaling
        found[f"rank {rank}"] = certified(upper)
    return found


def first_bytes(name: str, dim: int) -> float:
    """Bytes a key the bound reads before the int8 codes (``D + 4``) of the keys it leaves."""
    if name == "exact":
        return float("nan")
    if name.startswith("int8"):
        return dim + 4 + (4 if "per key" in name else 0)
    if name.startswith("int4"):
        return dim / 2 + 4 + (4 if "per key" in name else 0)
    if name.startswith("box"):
        return 2 * dim * 4 / int(name.split()[1])
    if name.startswith("ball"):
        return (dim + 1) * 4 / 16
    return int(name.split()[1]) + 8  # rank r: r int8 codes, a scale, the residual norm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--alpha", type=float, default=1.5, help="the mapping's alpha (the candidates' cut)")
    parser.add_argument("--rope-factor", type=float, default=None)
    parser.add_argument("--prefill-threads", type=int, default=2)
    parser.add_argument("--kv-file", default=None, help="as bench_long_generation.py's (read or written)")
    args = parser.parse_args()
    import hf_sparsemax as hs
    from bench_interleaved import rope_options
    from hf_sparsemax.app.assets import load_smollm2
    from hf_sparsemax.mappings.compiled import CANDIDATE_MARGIN

    model, tokenizer = load_smollm2(dtype=torch.float32, **rope_options(args.rope_factor))
    ids, _ = prompt(tokenizer, args.context, 1)
    with torch.no_grad():
        cache, token = prefill(model.eval(), ids, args)
    hs.patch_model(model, attn="entmax15")  # any attention of the library: the step's operands are captured
    layers = capture_step(model, cache, token)
    per_layer = [shares(q, k, s, CANDIDATE_MARGIN / (args.alpha - 1)) for q, k, s in layers]
    dim = layers[0][1].shape[-1]
    print(f"SmolLM2-135M, {args.context} cached tokens, one decoding step, {len(layers)} layers, alpha {args.alpha:g} "
          f"(cut {CANDIDATE_MARGIN / (args.alpha - 1):.2f} below the row's maximum), head size {dim}; load "
          f"{os.getloadavg()[0]:.2f}")
    print("| bound | keys certified (mean over layers) | least layer | bytes a key, first stage "
          f"| bytes a key with the int8 codes ({dim + 4}) of the rest |")
    print("|---|---:|---:|---:|---:|")
    for name in per_layer[0]:
        values = [found[name] for found in per_layer]
        mean, first = sum(values) / len(values), first_bytes(name, dim)
        total = "" if name == "exact" or name.startswith("int8") else f"{first + (1 - mean) * (dim + 4):.1f}"
        first_text = "" if name == "exact" else f"{first:g}"
        print(f"| {name} | {mean:.1%} | {min(values):.1%} | {first_text} | {total} |")


if __name__ == "__main__":
    main()
