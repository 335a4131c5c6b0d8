"""Curves of a training run: held-out loss and the share of exact attention zeros, every few steps.

A point is measured on the first ``eval.curve_blocks`` held-out blocks (the same blocks for every variant
and seed), in one forward pass with ``output_attentions``: the model's own loss on them, token-weighted,
and the share of exact zeros among the attention weights of every layer and head at the cells the causal
mask and the padding allow (``[B, H, q, kv]``: key ``j <= q``, both real tokens). Points: before training
(step 0: the patched model as it starts, e.g. after calibration), every ``eval.curve_every`` steps, and at
the last step.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import TrainerCallback, default_data_collator

from .._model import base_model

NO_WEIGHTS = ("sdpa", "flash_attention_2", "flex_attention")  # kernels that return no attention weights


@contextlib.contextmanager
def returning_weights(model):
    """The model with an attention that returns its weights: ``eager`` (the same softmax) for the kernels
    that return none; a sparse attention returns them as it is."""
    inner = base_model(model)
    implementation = getattr(inner.config, "_attn_implementation", None)
    switch = implementation in NO_WEIGHTS
    if switch:
        inner.set_attn_implementation("eager")
    try:
        yield
    finally:
        if switch:
            inner.set_attn_implementation(implementation)


def allowed_cells(mask: torch.Tensor, queries: int) -> torch.Tensor:
    """``[B, 1, q, kv]`` booleans: key at or before the query, both real tokens (``mask [B, kv]``)."""
    keys = mask.shape[-1]
    causal = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril(keys - queries)
    real = mask.bool()
    return causal[None, None] & real[:, None, None, :] & real[:, None, -queries:, None]


def measure(model, eval_set, blocks: int, batch_size: int) -> dict[str, float]:
    """``{"eval_loss", "attention_zero_share"}`` of ``model`` on the first ``blocks`` items of ``eval_set``."""
    was = model.training
    model.eval()
    loss_sum = tokens = zeros = cells = 0.0
    items = [eval_set[i] for i in range(min(blocks, len(eval_set)))]
    device = next(model.parameters()).device
    try:
        with torch.no_grad(), returning_weights(model):
            for start in range(0, len(items), batch_size):
                batch = {k: v.to(device) for k, v in default_data_collator(items[start:start + batch_size]).items()}
                out = model(**batch, output_attentions=True)
                count = float((batch["labels"][:, 1:] != -100).sum())
                loss_sum += float(out.loss) * count
                tokens += count
                for weights in out.attentions:
                    allowed = allowed_cells(batch["attention_mask"], weights.shape[-2]).expand_as(weights)
                    zeros += float((weights[allowed] == 0).sum())
                    cells += float(allowed.sum())
    finally:
        model.train(was)
    return {"eval_loss": loss_sum / max(tokens, 1.0), "attention_zero_share": zeros / max(cells, 1.0)}


class CurveCallback(TrainerCallback):
    """Measures a point (:func:`measure`) every ``every`` optimizer steps and at the last; ``points`` holds
    ``{"step", "eval_loss", "attention_zero_share"}`` in step order (the step-0 point: :meth:`start`)."""

    def __init__(self, eval_set, every: int, blocks: int, batch_size: int) -> None:
        self.eval_set, self.every, self.blocks, self.batch_size = eval_set, every, blocks, batch_size
        self.points: list[dict[str, float]] = []

    def point(self, model, step: int) -> None:
        if not self.points or self.points[-1]["step"] != step:
            self.points.append({"step": step, **measure(model, self.eval_set, self.blocks, self.batch_size)})

    def start(self, model) -> None:
        """The step-0 point: the model as patched, before ``train`` (and before any callback changes it)."""
        self.point(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step >= state.max_steps:
            self.point(model, state.global_step)
