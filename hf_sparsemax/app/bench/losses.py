"""``hf-sparsemax bench losses``: the mappings and losses against softmax / cross-entropy.

Three groups, each against its reference, forward and forward + backward (the gradient of a sum of the
outputs, from a fresh leaf each call):

- ``mapping, vocab``: probability mappings on ``[--tokens, --vocab]`` logits (N(0, 2^2)) against
  ``torch.softmax``;
- ``mapping, attention``: the same on short attention-like rows, causal scores ``[1, 9, 512, 512]`` (SmolLM2's
  heads; masked entries at the dtype's lowest value) against ``torch.softmax``;
- ``loss``: the losses on the vocabulary rows against ``torch.nn.functional.cross_entropy``, and the fused head
  (``fused_head_loss``: hidden states ``[--tokens, 576]`` and the head's weight to the loss, logits in chunks)
  against the head's matrix product followed by cross-entropy, what ``LlamaForCausalLM`` computes.

Contenders: sparsemax, entmax15, entmax_bisect at alpha 1.3, sparse_softmax with top_k=64 and with top_p=0.9;
the ``entmax`` package's sparsemax / entmax15 / entmax_bisect where it is installed (``pip install entmax``;
``--quick`` leaves out its entmax_bisect, whose 50 bisection steps of small operations would take most of the run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import timing

HIDDEN = 576  # SmolLM2-135M's hidden size (the fused head's input)


def settings(args) -> dict:
    small = args.quick or args.smoke
    return {"vocab": args.vocab or (512 if args.smoke else 4096 if small else 49152),
            "tokens": args.tokens or (16 if args.smoke else 64 if small else 4096),
            "scores": (1, 2, 32, 32) if args.smoke else (1, 9, 128, 128) if small else (1, 9, 512, 512),
            "repeats": args.repeats or (1 if args.smoke else 3 if small else 5)}


def entmax_package():
    try:
        import entmax
    except ImportError:
        return None
    return entmax


def mappings(quick: bool = False) -> dict:
    from ... import entmax15, entmax_bisect, sparse_softmax, sparsemax

    found = {"softmax (torch)": lambda x: torch.softmax(x, -1), "sparsemax": sparsemax, "entmax15": entmax15,
             "entmax_bisect(1.3)": lambda x: entmax_bisect(x, 1.3),
             "sparse_softmax(top_k=64)": lambda x: sparse_softmax(x, top_k=64),
             "sparse_softmax(top_p=0.9)": lambda x: sparse_softmax(x, top_p=0.9)}
    package = entmax_package()
    if package is not None:
        found.update({"entmax package: sparsemax": lambda x: package.sparsemax(x, -1),
                      "entmax package: entmax15": lambda x: package.entmax15(x, -1)})
        if not quick:  # its 50 bisection steps of small operations take most of a --quick run on a busy machine
            found["entmax package: entmax_bisect(1.3)"] = lambda x: package.entmax_bisect(x, 1.3, -1)
    return found


def losses(quick: bool = False) -> dict:
    from ... import entmax15_loss, entmax_bisect_loss, sparse_softmax_loss, sparsemax_loss

    found = {"cross_entropy (torch)": F.cross_entropy, "sparsemax_loss": sparsemax_loss,
             "entmax15_loss": entmax15_loss, "entmax_bisect_loss(1.3)": lambda x, t: entmax_bisect_loss(x, t, 1.3),
             "sparse_softmax_loss(top_k=64)": lambda x, t: sparse_softmax_loss(x, t, top_k=64),
             "sparse_softmax_loss(top_p=0.9)": lambda x, t: sparse_softmax_loss(x, t, top_p=0.9)}
    package = entmax_package()
    if package is not None:
        found.update({"entmax package: sparsemax_loss": package.SparsemaxLoss(),
                      "entmax package: entmax15_loss": package.Entmax15Loss()})
        if not quick:
            found["entmax package: entmax_bisect_loss(1.3)"] = package.EntmaxBisectLoss(1.3)
    return found


def heads() -> dict:
    from ... import fused_head_loss

    def fused(loss, **options):
        return lambda h, w, t: fused_head_loss(h, w, t, loss, **options)

    return {"head + cross_entropy (torch)": lambda h, w, t: F.cross_entropy(h @ w.T, t),
            "fused head, sparsemax": fused("sparsemax"), "fused head, entmax15": fused("entmax15"),
            "fused head, sparse_softmax(top_k=64)": fused("sparse_softmax", top_k=64)}


def calls(fns: dict, inputs: tuple, backward: bool) -> dict:
    """One timed call a contender: ``fn(*inputs)``, and with ``backward`` the backward of its sum from fresh
    leaves (the floating-point inputs)."""
    def one(fn):
        def once():
            if backward:
                leaves = [x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
                fn(*leaves).sum().backward()
            else:
                with torch.no_grad():
                    fn(*inputs)
        return once

    return {name: one(fn) for name, fn in fns.items()}


def run(args) -> dict:
    device, read = timing.setup(args)
    dtype = timing.DTYPES[args.dtype]
    plan = settings(args)
    setting = timing.environment(args, device, args.dtype)
    generator = torch.Generator().manual_seed(0)
    tokens, vocab = plan["tokens"], plan["vocab"]
    logits = (torch.randn(tokens, vocab, generator=generator) * 2).to(device, dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    shape = plan["scores"]
    scores = (torch.randn(shape, generator=generator) * 2).to(device, dtype)
    scores = scores.masked_fill(torch.ones(shape[-2:], dtype=torch.bool, device=device).triu(1),
                                torch.finfo(dtype).min)
    hidden = torch.randn(tokens, HIDDEN, generator=generator).to(device, dtype)
    weight = (torch.randn(vocab, HIDDEN, generator=generator) * 2 / HIDDEN ** 0.5).to(device, dtype)
    quick = args.quick or args.smoke
    groups = [("mapping, vocab", f"[{tokens}, {vocab}]", mappings(quick), (logits,), "softmax (torch)"),
              ("mapping, attention", str(list(shape)), mappings(quick), (scores,), "softmax (torch)"),
              ("loss", f"[{tokens}, {vocab}]", losses(quick), (logits, targets), "cross_entropy (torch)"),
              ("loss, from hidden states", f"[{tokens}, {HIDDEN}] x [{vocab}, {HIDDEN}]", heads(),
               (hidden, weight, targets), "head + cross_entropy (torch)")]
    rows, results = [], []
    for group, size, fns, inputs, reference in groups:
        for backward in (False, True):
            times = timing.interleaved(calls(fns, inputs, backward), plan["repeats"], read)
            step = "fwd+bwd" if backward else "fwd"
            for name, value in times.items():
                rows.append([group, size, step, name, timing.ms(value), timing.ratio(value, times[reference])])
                results.append({"group": group, "shape": size, "pass": step, "contender": name, "ms": value,
                                "reference": reference, "ratio": value / times[reference]})
    setting.update(repeats=plan["repeats"], entmax_package=getattr(entmax_package(), "__version__", None)
                   if entmax_package() is not None else None)
    title = (f"Mappings and losses against softmax / cross-entropy ({args.dtype}, {device}): milliseconds and the "
             f"ratio to the group's reference (median of {plan['repeats']} interleaved rounds)")
    return timing.finish(args, "losses", setting, title, ["group", "shape", "pass", "contender", "ms",
                                                          "x reference"], rows, results)
