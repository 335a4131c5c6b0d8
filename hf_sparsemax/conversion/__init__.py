"""Converting a pretrained softmax model to sparse attention: an alpha schedule and self-distillation.

:mod:`.schedule`: :class:`AlphaScheduleCallback`, alpha from near 1 to the patched target over the first
steps, ending on the target's own path; :mod:`.distill`: :class:`SelfDistillation`, a loss term matching
the model's own softmax attention outputs and, optionally, its logits (adapter off), and
:func:`distillation_trainer` for ``Trainer``; :mod:`.transfer`: :func:`transfer_attention`, each layer's
attention fitted to the softmax parent's before training, some heads kept wide.
Imports the attention, the swaps and transformers' ``TrainerCallback``; never ``patch`` or the app.
"""

from .distill import SelfDistillation, distillation_trainer
from .schedule import AlphaScheduleCallback
from .transfer import transfer_attention

__all__ = ["AlphaScheduleCallback", "SelfDistillation", "distillation_trainer", "transfer_attention"]
