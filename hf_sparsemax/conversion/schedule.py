"""An alpha schedule for converting a softmax model: alpha moves from near 1 to the target over the first steps.

A pretrained model's attention scores were trained under softmax (alpha = 1). Swapping in 1.5-entmax or
sparsemax at once changes every head's weights at step 0; the schedule instead runs alpha-entmax
(``entmax_bisect``) with

    alpha(t) = start + (target - start) * t / T,    T = max(1, round(share * max_steps)) (halves up),

at training step ``t < T`` (0-based, the step about to run), then the target from step ``T`` on. The target is
read from the model as :func:`hf_sparsemax.patch_model` left it:

- ``attn="sparsemax"`` (alpha 2) or ``attn="entmax15"`` (alpha 1.5): from step ``T`` on, and when training
  ends, the attention is that mapping again, its own closed-form path (the module options and the
  implementation name ``patch_model`` set, given back unchanged), not ``entmax_bisect`` at that alpha;
- ``attn="entmax_bisect"`` with a fixed ``alpha``: that alpha;
- ``attn="entmax_bisect"`` with ``learn_alpha``: the learned alphas' start. During the ramp every head's
  ``pre_alpha`` is set to ``sigmoid^-1(alpha(t) - 1)`` before each step and frozen (``requires_grad`` off,
  so the optimizer skips it: no gradient, no update, no optimizer state); at step ``T`` it is set to exactly
  the value a fresh :class:`~hf_sparsemax.LearnedAlpha` starts from and released (trainable again), and the
  heads learn apart from there. Starting the learned alphas at 1.5 after the ramp, rather than at 1.05,
  also puts them where ``1 + sigmoid`` has its largest slope (0.25 against 0.0475).

Per-head temperatures (attention option ``temperature``, e.g. fitted by :func:`hf_sparsemax.calibrate_attention`
for the target) are fitted for the target's alpha, not for alpha near 1, where they would sharpen softmax:
on the ramp head ``h``'s temperature is ``T_h ** f``, ``f = (alpha(t) - start) / (target - start)`` (1 at
the start, ``T_h`` at the target; a learned temperature is frozen meanwhile, as a learned alpha), and at
step ``T`` the fitted values are given back exactly. The ramp sets only the exponent ``f``
(:meth:`~hf_sparsemax.HeadTemperature.set_exponent`): the values and a learned ``log_temperature`` keep the
fitted ``T_h`` throughout, so a checkpoint saved on the ramp holds them.

Resuming (``Trainer.train(resume_from_checkpoint=...)``): the state is derived from ``global_step`` alone.
Trainer loads the checkpoint before ``on_train_begin``; a run resumed inside the ramp continues it (the frozen
alphas are set from the step), and a run resumed past step ``T`` keeps the alphas and temperatures the
checkpoint restored (only the step that crosses ``T`` sets the learned alphas to their start).

The module options and the model's config (``config.hf_sparsemax``) keep the target throughout, so a model
saved during the ramp reloads with the target attention.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .._model import base_model
from ..attention.interface import ATTENTION_MAPPINGS, OPTIONS_ATTR, AttentionOptions, LearnedAlpha
from ..attention.query_scale import HeadTemperature
from ..mappings import registry
from ..swaps.attention_swap import set_attention

RAMP_MAPPING = "entmax_bisect"  # what the attention runs during the ramp (alpha-entmax at any alpha in (1, 2])
TARGET_ALPHA = {"sparsemax": 2.0, "entmax15": 1.5}  # the alphas of the mappings with a closed form
DEFAULT_START = 1.01  # alpha at step 0: the softmax model's weights, nearly (AdaSplash anneals from 1.01)
DEFAULT_SHARE = 0.3  # share of the training steps the ramp takes


class TrainerEvents:
    """transformers' ``TrainerCallback`` protocol without importing ``transformers.trainer_callback`` (which pulls
    in peft and accelerate: seconds at ``import hf_sparsemax``): ``Trainer`` calls ``on_<event>(args, state,
    control, **kwargs)`` on each callback, and every event a subclass does not define does nothing here."""

    def __getattr__(self, name: str):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def share_steps(share: float, max_steps: int) -> int:
    """``max(1, round(share * max_steps))``, halves rounded up: the first steps a share of training covers."""
    return max(1, math.floor(share * max_steps + 0.5))


def scheduled_alpha(step: int, start: float, target: float, steps: int) -> float:
    """``start + (target - start) * step / steps`` for ``step < steps``, ``target`` from then on."""
    return target if step >= steps else start + (target - start) * step / steps


def pre_alpha_of(alpha: float) -> float:
    """``sigmoid^-1(alpha - 1)``, computed as :class:`LearnedAlpha` computes its start (the same float)."""
    return math.log((alpha - 1) / (2 - alpha))


class AlphaScheduleCallback(TrainerEvents):
    """``transformers`` callback: anneal the attention's alpha from ``start`` to the patched target over
    ``share`` of the training steps (see the module docstring). ``Trainer(..., callbacks=[hs.AlphaScheduleCallback()])``
    on a model patched with ``attn="entmax15"`` / ``"sparsemax"`` / ``"entmax_bisect"`` (fixed or learned alpha).
    ``alpha`` (read only): the alpha of the last scheduled step; ``ramping``: whether the ramp is in progress."""

    def __init__(self, share: float = DEFAULT_SHARE, start: float = DEFAULT_START) -> None:
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"share must be a number in (0, 1] (the share of the training steps), got {share!r}")
        if isinstance(start, bool) or not isinstance(start, (int, float)) or not 1 < start < 2:
            raise ValueError(f"start must be an alpha in (1, 2), got {start!r}")
        self.share, self.start = float(share), float(start)
        self.alpha: float | None = None
        self._plan = None

    @property
    def ramping(self) -> bool:
        """Whether training runs the ramp (from train begin until the step that reaches the target)."""
        return self._plan is not None and not self._plan.get("released")

    # -- the plan: what the patch left, read once at train begin

    def _read(self, model):
        inner = base_model(model)
        mapping = inner.config._attn_implementation
        modules = [m for m in inner.modules() if isinstance(vars(m).get(OPTIONS_ATTR), AttentionOptions)]
        if mapping not in ATTENTION_MAPPINGS or not modules:
            raise ValueError("AlphaScheduleCallback needs a model patched with a sparse attention "
                             f"(attn='entmax15', 'sparsemax' or 'entmax_bisect'); its attention is {mapping!r}")
        options = [vars(m)[OPTIONS_ATTR] for m in modules]
        if mapping in TARGET_ALPHA:
            target = TARGET_ALPHA[mapping]
        elif mapping == RAMP_MAPPING:
            target = options[0].alpha
        else:
            raise ValueError(f"AlphaScheduleCallback anneals alpha-entmax; attn={mapping!r} has no alpha: use "
                             f"one of {[*TARGET_ALPHA, RAMP_MAPPING]}")
        if not self.start < target:
            raise ValueError(f"the schedule starts at alpha {self.start} and must rise to the target, {target}")
        learned = [m for m in model.modules() if isinstance(m, LearnedAlpha)]  # peft: the adapter's copies too
        grads = [m.pre_alpha.requires_grad for m in learned]
        heats = [m for m in model.modules() if isinstance(m, HeadTemperature)]
        heat_grads = [m.log_temperature.requires_grad if m.learn else None for m in heats]
        return dict(inner=inner, mapping=mapping, modules=modules, options=options, target=target,
                    learned=learned, grads=grads, heats=heats, heat_grads=heat_grads)

    def _temperatures(self, fraction: float | None) -> None:
        """On the ramp (``fraction`` of the way): ``T ** fraction``, learned ones frozen; None: the fitted values."""
        plan = self._plan
        for heat, grad in zip(plan["heats"], plan["heat_grads"]):
            heat.set_exponent(1.0 if fraction is None else fraction)
            if heat.learn:
                heat.log_temperature.requires_grad_(grad if fraction is None else False)

    def _check_fresh_alphas(self) -> None:
        """The ramp ends by restarting every learned alpha at the target: refuse alphas that already hold other
        values (fitted per head by :func:`~hf_sparsemax.transfer_attention`, or trained), which it would discard."""
        if not self._plan["learned"]:
            return
        start = pre_alpha_of(self._plan["target"])  # learned alphas start below 2 (LearnedAlpha)
        for module in self._plan["learned"]:
            values = module.pre_alpha.detach().float()
            if not torch.allclose(values, torch.full_like(values, start), rtol=0, atol=1e-6):
                raise ValueError("AlphaScheduleCallback restarts the learned alphas at the target after its ramp; "
                                 "this model's alphas already differ from it per head (fitted by transfer_attention "
                                 "or trained): train without the alpha schedule to keep them")

    # -- the two states: on the ramp at alpha a, or the target as patched

    def _ramp(self, alpha: float) -> None:
        plan = self._plan
        self._temperatures((alpha - self.start) / (plan["target"] - self.start))
        if plan["learned"]:
            with torch.no_grad():
                for module in plan["learned"]:
                    module.pre_alpha.fill_(pre_alpha_of(alpha))
                    module.pre_alpha.requires_grad_(False)
        else:
            entry = registry.attention_entry(RAMP_MAPPING)
            for module, own in zip(plan["modules"], plan["options"]):
                vars(module)[OPTIONS_ATTR] = dataclasses.replace(
                    own, mapping=RAMP_MAPPING, options=entry.options(alpha=alpha), learn_alpha=False)
            if plan["inner"].config._attn_implementation != RAMP_MAPPING:
                set_attention(plan["inner"], RAMP_MAPPING)
        self.alpha = alpha

    def _release(self, restart: bool) -> None:
        """The target as patched; ``restart``: the learned alphas start afresh (the step crossing the ramp's end),
        else they keep their values (a run resumed past the ramp: the checkpoint's trained alphas)."""
        plan = self._plan
        self._temperatures(None)
        if plan["learned"]:
            with torch.no_grad():
                for module, grad in zip(plan["learned"], plan["grads"]):
                    if restart:
                        module.pre_alpha.fill_(pre_alpha_of(plan["target"]))
                    module.pre_alpha.requires_grad_(grad)
        else:
            for module, own in zip(plan["modules"], plan["options"]):
                vars(module)[OPTIONS_ATTR] = own
            if plan["inner"].config._attn_implementation != plan["mapping"]:
                set_attention(plan["inner"], plan["mapping"])
        self.alpha = plan["target"]
        plan["released"] = True

    def _step(self, step: int) -> None:
        plan = self._plan
        if plan is None or plan.get("released"):
            return
        alpha = scheduled_alpha(step, self.start, plan["target"], plan["steps"])
        self._release(restart=step == plan["steps"]) if step >= plan["steps"] else self._ramp(alpha)

    # -- Trainer's events

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._plan = self._read(model)
        if state.global_step == 0:
            self._check_fresh_alphas()
        self._plan["steps"] = share_steps(self.share, state.max_steps)
        self._step(state.global_step)  # a resumed run starts where its steps left the ramp

    def on_step_begin(self, args, state, control, **kwargs):
        self._step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self._plan is not None and not self._plan.get("released"):
            self._release(restart=True)  # a run shorter than its ramp still ends on the target
