"""Quality of sparse models, where perplexity can be infinite ("Sparse Text Generation", Martins et al., 2020).

Per predicted token, from the model's distribution ``p`` and the target ``t``:

- epsilon-perplexity: ``exp(mean -log((p_t + eps) / (1 + eps |V|)))``;
- sparsemax score: ``p_t - ||p||^2 / 2 + 1/2`` (1 for a perfect one-hot);
- Jensen-Shannon divergence to the one-hot, natural log, in ``[0, log 2]``:
  with ``m = (p + e_t)/2`` it depends on ``p_t`` only,
  ``JS = 1/2 [(1 - p_t) log 2 + p_t log(2 p_t / (1 + p_t))] + 1/2 [log 2 - log(1 + p_t)]``;
- accuracy (argmax hits), the share of targets with zero probability, mean support size,
  and cross-entropy where it is finite;
- for a decoder ``q`` of a model trained to ``p``: the mass ``q`` puts outside ``p``'s support.

``token_stats`` computes the per-token numbers (small: 4 per token, so
Trainer never has to keep the full logits); ``summarize`` aggregates them;
``trainer_metrics`` plugs both into ``Trainer`` for a model's patched loss;
``METRIC_PATH`` is an ``evaluate`` module doing the same, loaded offline by
``evaluate.load(hf_sparsemax.metrics.METRIC_PATH)``.
"""

from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np
import torch

METRIC_PATH = os.path.join(os.path.dirname(__file__), "sparse_metrics", "sparse_metrics.py")
STATS = ("target_prob", "sq_norm", "hit", "support")


def token_stats(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``[..., 4]``: p_t, ||p||^2, argmax == t, support size, for ``probs [..., V]`` and ``target [...]``."""
    p_t = probs.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    sq_norm = probs.square().sum(-1)
    hit = (probs.argmax(-1) == target).to(probs.dtype)
    support = (probs > 0).sum(-1).to(probs.dtype)
    return torch.stack([p_t, sq_norm, hit, support], -1).float()


def outside_support_mass(decoded: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """``[...]``: ``sum_v q_v [p_v = 0]``, the probability a decoder ``q`` gives tokens the trained ``p`` rules out.

    It is the chance that one token sampled from ``q`` has probability 0 under
    ``p`` (0 when ``q = p``: matched decoding).
    """
    return (decoded * (trained <= 0)).sum(-1)


def summarize(target_prob, sq_norm, hit, support, vocab_size: int, epsilon: float = 1e-6) -> dict[str, float]:
    """Aggregate per-token statistics (array-likes of equal length) into the metrics above."""
    p = np.asarray(target_prob, dtype=np.float64)
    if p.size == 0:
        raise ValueError("no tokens to evaluate (every label is ignored)")
    eps_nll = -np.log((p + epsilon) / (1 + epsilon * vocab_size))
    with np.errstate(divide="ignore", invalid="ignore"):
        js_target = np.where(p > 0, p * np.log(2 * p / (1 + p)), 0.0)
    js = 0.5 * ((1 - p) * math.log(2) + js_target) + 0.5 * (math.log(2) - np.log1p(p))
    zero = p <= 0
    return {
        "epsilon_perplexity": float(np.exp(eps_nll.mean())),
        "sparsemax_score": float((p - 0.5 * np.asarray(sq_norm, dtype=np.float64) + 0.5).mean()),
        "jensen_shannon": float(js.mean()),
        "accuracy": float(np.asarray(hit, dtype=np.float64).mean()),
        "zero_prob_share": float(zero.mean()),
        "support_size": float(np.asarray(support, dtype=np.float64).mean()),
        "cross_entropy": float("inf") if zero.any() else float(-np.log(p).mean()),
        "tokens": int(p.size),
    }


def trainer_metrics(mapping: str | Callable[[torch.Tensor], torch.Tensor], vocab_size: int, causal: bool = True,
                    epsilon: float = 1e-6):
    """``(preprocess_logits_for_metrics, compute_metrics)`` for ``Trainer``.

    ``mapping`` turns logits into the model's distribution: a callable or a
    registered name (use :func:`hf_sparsemax.losses.names.loss_mapping` for a
    patched loss with its options). The first
    reduces each batch's logits to 4 numbers per token; the second aggregates
    over the evaluation set, ignoring labels equal to -100.
    """
    from ..mappings.registry import mapping_function

    mapping = mapping_function(mapping)

    def preprocess(logits, labels):
        logits = logits[0] if isinstance(logits, tuple) else logits
        if causal:  # position i holds the prediction of labels[i], made at i - 1
            stats = token_stats(mapping(logits[:, :-1].float()), labels[:, 1:])
            return torch.cat([torch.full_like(stats[:, :1], -100.0), stats], 1)
        return token_stats(mapping(logits.float()), labels)

    def compute_metrics(eval_pred):
        stats, labels = np.asarray(eval_pred.predictions), np.asarray(eval_pred.label_ids)
        keep = labels != -100
        if causal:
            keep[:, 0] = False
        kept = stats[keep]
        return summarize(*(kept[:, i] for i in range(len(STATS))), vocab_size=vocab_size, epsilon=epsilon)

    return preprocess, compute_metrics
