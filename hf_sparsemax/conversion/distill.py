"""Self-distillation for converting a softmax model: the sparse attention learns the softmax model's outputs.

The teacher is the same model, not a second one in memory: the same base weights with the peft adapter
disabled, under the attention implementation the model had before the swap (softmax: sdpa / eager), run
without gradient in eval mode. For every attention module ``l`` (``L`` of them) the term is

    D = weight / L * sum_l  sum_i m_i ||s_l,i - t_l,i||^2  /  sum_i m_i ||t_l,i||^2,

``s_l,i`` / ``t_l,i`` the student's / teacher's output of attention module ``l`` (after its output projection)
at token ``i``, ``m_i`` the batch's ``attention_mask`` (1 without one): each layer's squared error relative
to the teacher's own energy there, so every layer counts alike whatever its scale.

Why the attention outputs and not the logits: what the swap changed is each layer's attention, and the
per-layer target gives each of them its own signal (LoLCATs and DeepSeek-V3.2 match attention outputs for
the same reason), where a KL on the logits reaches layer ``l`` only through every layer above it; the
held-out cross-entropy already trains the logits. Calibration (``calibrate``) fits the same quantity, once,
at patch time; distillation keeps fitting it while the adapter learns.

Logit distillation (``logit_weight > 0``; LoLCATs' second stage, RADLADS): the parent's next-token distribution
as a second target, ``logit_weight * tau^2 * KL(softmax(z_t / tau) || softmax(z_s / tau))`` averaged over the
tokens the mask keeps (``z_t`` / ``z_s`` the teacher's / student's logits, ``tau`` = ``logit_temperature``). The
LM head stays softmax, so this KL is finite where one between sparse attention weights would not be. It reaches
every layer through the ones above it; the per-layer term (``weight``; 0 turns it off) stays beside it as an
auxiliary. The student's logits are the ones its forward returned: a model whose loss never builds them (the
fused output-head loss) cannot use it and is refused.

The term is added to the training loss during the first ``share`` of the steps (``step < max(1, round(share *
max_steps))``, halves up), then dropped: the model then trains on the data alone. Under gradient accumulation
an optimizer step's term is the mean of its micro-batches' terms (:func:`micro_batch_share`), as the
cross-entropy beside it counts each token once per step.
"""

from __future__ import annotations

import contextlib

import torch

from .._model import base_model
from ..attention.interface import ATTENTION_MAPPINGS, attention_modules
from ..swaps.attention_swap import ORIGINAL_ATTR, set_attention
from .schedule import share_steps

DEFAULT_WEIGHT = 1.0
DEFAULT_SHARE = 0.5  # share of the training steps the term is on


def softmax_implementation(inner) -> str:
    """The attention implementation the model had before the swap (what :func:`unpatch_model` gives back)."""
    original = vars(inner).get(ORIGINAL_ATTR)
    return original or ("sdpa" if getattr(inner, "_supports_sdpa", False) else "eager")


@contextlib.contextmanager
def captured_outputs(model):
    """Yields a list that receives the output of every attention module of ``model`` (in call order) while the
    block runs."""
    outputs: list[torch.Tensor] = []

    def hook(module, args, output):
        outputs.append(output[0] if isinstance(output, tuple) else output)

    handles = [m.register_forward_hook(hook) for m in attention_modules(base_model(model))]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def teacher_mode(model):
    """The model as its own teacher while the block runs: adapter disabled, softmax attention, eval mode, no
    gradient; everything given back after, each parameter's ``requires_grad`` included (peft's adapter switch
    sets its trainable copies' to True on the way out, which would unfreeze what the alpha schedule froze between
    a student's forward and its backward: a query block recomputed in the backward would then differ from it)."""
    inner = base_model(model)
    if not callable(getattr(model, "disable_adapter", None)):
        raise ValueError("self-distillation needs a peft model: the teacher is the frozen base weights with the "
                         "adapter disabled (with full fine-tuning no frozen copy of the softmax model is left)")
    current, was_training = inner.config._attn_implementation, model.training
    if current not in ATTENTION_MAPPINGS:
        raise ValueError(f"self-distillation trains a sparse attention; this model's attention is {current!r}: "
                         "patch it first (hs.patch_model(model, attn='entmax15'))")
    trainable = [(parameter, parameter.requires_grad) for parameter in model.parameters()]
    set_attention(inner, softmax_implementation(inner))
    model.eval()
    try:
        with torch.no_grad(), model.disable_adapter():
            yield
    finally:
        set_attention(inner, current)
        model.train(was_training)
        for parameter, grad in trainable:
            parameter.requires_grad_(grad)


def relative_error(student: list[torch.Tensor], teacher: list[torch.Tensor], mask: torch.Tensor | None):
    """``1/L sum_l sum_i m_i ||s_l,i - t_l,i||^2 / sum_i m_i ||t_l,i||^2`` (outputs ``[B, T, hidden]``)."""
    if len(student) != len(teacher) or not student:
        raise ValueError(f"the student ran {len(student)} attention modules and the teacher {len(teacher)}")
    terms = []
    for s, t in zip(student, teacher):
        weight = torch.ones(s.shape[:-1], device=s.device) if mask is None else mask.to(s.device, torch.float32)
        error = ((s.float() - t.float()) ** 2).sum(-1)
        energy = (t.float() ** 2).sum(-1)
        terms.append((error * weight).sum() / (energy * weight).sum().clamp_min(torch.finfo(torch.float32).tiny))
    return torch.stack(terms).mean()


LOGIT_ROWS = 256  # token rows of the vocabulary's log-softmax computed at once (bounds the KL's memory)


def logit_divergence(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None,
                     temperature: float = 1.0) -> torch.Tensor:
    """``tau^2 * mean_i m_i KL(softmax(t_i / tau) || softmax(s_i / tau))`` over tokens (logits ``[B, T, V]``),
    computed ``LOGIT_ROWS`` token rows at a time in float32."""
    if student.shape != teacher.shape:
        raise ValueError(f"student logits {tuple(student.shape)} and teacher logits {tuple(teacher.shape)} differ")
    s, t = student.flatten(0, -2), teacher.detach().flatten(0, -2)
    weight = (torch.ones(s.shape[0], device=s.device) if mask is None
              else mask.to(s.device, torch.float32).reshape(-1)[: s.shape[0]])
    total = s.new_zeros((), dtype=torch.float32)
    for start in range(0, s.shape[0], LOGIT_ROWS):
        rows = slice(start, start + LOGIT_ROWS)
        log_s = torch.log_softmax(s[rows].float() / temperature, -1)
        log_t = torch.log_softmax(t[rows].float() / temperature, -1)
        kl = (log_t.exp() * (log_t - log_s)).sum(-1)
        total = total + (kl * weight[rows]).sum()
    return total * temperature ** 2 / weight.sum().clamp_min(1.0)


class SelfDistillation:
    """The distillation term (module docstring): ``weight`` and the ``share`` of the steps it is on.

    In a training loop::

        distill = hs.SelfDistillation(weight=1.0)
        with distill.student(model) as outputs:      # records the student's attention outputs
            loss = model(**batch).loss
        loss = loss + distill.term(model, batch, outputs)   # runs the teacher, adds the term

    With ``transformers.Trainer``: ``hs.distillation_trainer(Trainer, distill)`` (the term on during the first
    ``share`` of ``max_steps``). ``last`` holds the last term's value (a float), for logs and tests.
    """

    def __init__(self, weight: float = DEFAULT_WEIGHT, share: float = DEFAULT_SHARE, logit_weight: float = 0.0,
                 logit_temperature: float = 1.0) -> None:
        for name, value in (("weight", weight), ("logit_weight", logit_weight)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if not weight > 0 and not logit_weight > 0:
            raise ValueError("weight and logit_weight are both 0: the distillation would add nothing")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"share must be a number in (0, 1] (the share of the training steps), got {share!r}")
        if (isinstance(logit_temperature, bool) or not isinstance(logit_temperature, (int, float))
                or not 0 < logit_temperature < float("inf")):
            raise ValueError(f"logit_temperature must be a finite number > 0, got {logit_temperature!r}")
        self.weight, self.share = float(weight), float(share)
        self.logit_weight, self.logit_temperature = float(logit_weight), float(logit_temperature)
        self.last: float | None = None

    def active(self, step: int, max_steps: int) -> bool:
        """Whether the term is on at (0-based) ``step`` of ``max_steps``."""
        return step < share_steps(self.share, max_steps)

    def student(self, model):
        """Context manager: records the attention outputs of the forward passes run inside it."""
        return captured_outputs(model)

    def teacher(self, model, inputs: dict) -> list[torch.Tensor]:
        """The teacher's attention outputs on ``inputs`` (no ``labels``: the teacher computes no loss)."""
        return self.teacher_pass(model, inputs)[0]

    def teacher_pass(self, model, inputs: dict) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The teacher's attention outputs on ``inputs`` and its logits (None where its forward returns none)."""
        batch = {k: v for k, v in inputs.items() if k not in ("labels", "num_items_in_batch")}
        with teacher_mode(model), captured_outputs(model) as outputs:
            result = model(**batch)
        return [t.detach() for t in outputs], getattr(result, "logits", None)

    def term(self, model, inputs: dict, student: list[torch.Tensor],
             student_logits: torch.Tensor | None = None) -> torch.Tensor:
        """``weight`` times the relative error of ``student``'s attention outputs against the teacher's, plus
        ``logit_weight`` times the KL of the student's logits from the teacher's (module docstring)."""
        attention, logits = self.teacher_pass(model, inputs)
        mask = inputs.get("attention_mask")
        value = 0.0
        if self.weight > 0:
            value = self.weight * relative_error(student, attention, mask)
        if self.logit_weight > 0:
            if student_logits is None or logits is None:
                raise ValueError("logit distillation needs the student's and the teacher's logits; this model's "
                                 "forward returned none (a fused output-head loss builds no logits: use "
                                 "logit_weight=0 there)")
            value = value + self.logit_weight * logit_divergence(student_logits, logits, mask,
                                                                 self.logit_temperature)
        self.last = float(value.detach())
        return value


def micro_batch_share(trainer, num_items_in_batch) -> float:
    """What one micro-batch's distillation term is multiplied by, so that an optimizer step's objective is the
    term's mean over its micro-batches, as with no accumulation: ``1 / accumulation steps`` where Trainer leaves
    the loss undivided (it was normalised by ``num_items_in_batch``, which spans the whole step), else 1
    (Trainer divides the whole loss, the term with it)."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:  # Trainer's own rule (transformers' training_step)
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
            trainer.compute_loss_func is not None)
    return 1.0 / trainer.current_gradient_accumulation_steps if scaled else 1.0


def distillation_trainer(trainer_class, distillation: SelfDistillation):
    """``trainer_class`` (``transformers.Trainer`` or a subclass: TRL's ``SFTTrainer``) whose loss adds
    ``distillation``'s term while it is active (``state.global_step`` against ``state.max_steps``); the
    term's value is logged as ``distill``."""

    class DistillationTrainer(trainer_class):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            if not (model.training and distillation.active(self.state.global_step, self.state.max_steps)):
                return super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
            with distillation.student(model) as outputs:
                loss, out = super().compute_loss(model, inputs, return_outputs=True, **kwargs)
            share = micro_batch_share(self, kwargs.get("num_items_in_batch"))
            logits = getattr(out, "logits", None) if distillation.logit_weight > 0 else None
            loss = loss + distillation.term(model, inputs, outputs, logits) * share
            return (loss, out) if return_outputs else loss

        def log(self, logs, *args, **kwargs):
            if "loss" in logs and distillation.last is not None:
                logs = {**logs, "distill": distillation.last}
                distillation.last = None
            return super().log(logs, *args, **kwargs)

    DistillationTrainer.__name__ = DistillationTrainer.__qualname__ = f"Distillation{trainer_class.__name__}"
    return DistillationTrainer
