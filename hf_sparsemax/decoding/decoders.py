"""A trained causal LM scored under each distribution a user could sample it from.

A softmax-trained model is usually decoded with truncation: top-k, top-p
(nucleus) or transformers' default ``top_k=50``, each renormalised over the
kept tokens, which is :func:`hf_sparsemax.sparse_softmax` with that ``top_k`` /
``top_p``. A model trained with a sparse loss has its own distribution
``p`` (what matched decoding samples); plain ``generate`` without this library
would sample ``q = sparse_softmax(logits, top_k=50)`` instead. Every decoder
``q`` gets the held-out metrics of :mod:`hf_sparsemax.metrics` computed from
``q`` itself, and the mass ``q`` puts outside the trained support,
``sum_v q_v [p_v = 0]`` averaged over held-out positions: the chance that a
sampled token is one training ruled out (0 for matched decoding; 0 for every
decoder of a softmax model, whose ``p`` is positive everywhere).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..metrics import sparse_text as metrics
from ..losses.names import loss_mapping
from ..mappings import sparse_softmax

TRANSFORMERS_TOP_K = 50  # GenerationConfig's default top_k


Mapping = Callable[[torch.Tensor], torch.Tensor]


def decoders(loss: str | None, loss_options: dict[str, Any]) -> list[tuple[str, Mapping]]:
    """``(name, logits -> distribution)`` of the decoders a user of a model trained with ``loss`` would use."""
    out = [("matched", loss_mapping(loss or "cross_entropy", **(loss_options or {})))]
    if (loss or "cross_entropy") == "cross_entropy":
        out += [("top-k=10", lambda x: sparse_softmax(x, top_k=10)),
                ("top-p=0.9", lambda x: sparse_softmax(x, top_p=0.9)),
                (f"top-k={TRANSFORMERS_TOP_K} (transformers default)",
                 lambda x: sparse_softmax(x, top_k=TRANSFORMERS_TOP_K))]
    else:
        out.append((f"plain generate (softmax, top-k={TRANSFORMERS_TOP_K})",
                    lambda x: sparse_softmax(x, top_k=TRANSFORMERS_TOP_K)))
    return out


def score_decoders(model, eval_set, loss: str | None, loss_options: dict[str, Any], vocab_size: int,
                   epsilon: float = 1e-6, batch_size: int = 8) -> list[dict[str, Any]]:
    """One row per decoder: :func:`~hf_sparsemax.metrics.summarize` of its distribution on the held-out blocks
    (position ``i`` predicts token ``i + 1``, labels -100 ignored) and ``outside_support_mass``."""
    from transformers import default_data_collator

    chosen = decoders(loss, loss_options)
    stats: dict[str, list[torch.Tensor]] = {name: [] for name, _ in chosen}
    outside: dict[str, list[torch.Tensor]] = {name: [] for name, _ in chosen}
    device = next(model.parameters()).device
    loader = torch.utils.data.DataLoader(eval_set, batch_size=batch_size, collate_fn=default_data_collator)
    was_training = model.training
    model.eval()
    try:
        for batch in loader:
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"].to(device),
                               attention_mask=batch["attention_mask"].to(device)).logits
            logits, target = logits[:, :-1].float().cpu(), batch["labels"][:, 1:]
            keep = target != -100
            trained = chosen[0][1](logits)
            for name, mapping in chosen:
                decoded = trained if name == "matched" else mapping(logits)
                stats[name].append(metrics.token_stats(decoded, target)[keep])
                outside[name].append(metrics.outside_support_mass(decoded, trained)[keep])
                del decoded
    finally:
        model.train(was_training)
    rows = []
    for name, _ in chosen:
        kept = torch.cat(stats[name]).double().numpy()
        row = metrics.summarize(*(kept[:, i] for i in range(len(metrics.STATS))), vocab_size=vocab_size,
                                epsilon=epsilon)
        rows.append({"decoder": name, **row, "outside_support_mass": float(torch.cat(outside[name]).double().mean())})
    return rows
