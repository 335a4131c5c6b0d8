"""``patch_model`` / ``unpatch_model``: swap a transformers model's attention and loss (and keep the choice in its config).

The attention swap uses transformers' attention interface: the sparse
attentions are registered on import (:mod:`hf_sparsemax.attention`), and
``patch_model`` sets the implementation with ``model.set_attn_implementation``
and hangs the options (and a learned alpha per head) on each attention module.

The loss swap uses transformers' own hook, ``model.loss_function`` (a setter
exists), never a new ``loss_type`` nor a replaced ``LOSS_MAPPING`` entry:
Trainer's ``num_items_in_batch`` counting keeps recognising the causal-LM
label shift. Instances are patched, never classes, and every patch is undone
by ``unpatch_model``. Everything is validated before anything is changed.
"""

from __future__ import annotations

import glob
import inspect
import os
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from ._model import base_model, model_task, remove_instance_method, routes_loss_function, set_instance_method
from .attention import ALPHA_ATTR, ATTENTION_MAPPINGS, OPTIONS_ATTR, LearnedAlpha, check_supported, num_heads
from .fused import fused_head_loss
from .fused_heads import head_transform, head_values, router_refusal
from .generation import install_matched_generate, remove_matched_generate
from .loss_names import make_loss
from .margin import head_linears, install_cosine_head, remove_cosine_head
from .mappings import registry
from .load_marks import clear as clear_load_marks
from .load_marks import keep_alpha_with_adapter, mark as mark_for_load, release_alpha_from_adapter
from .settings import CONFIG_KEY, SparseSettings
from .trainer_guard import install_trainer_guard, remove_trainer_guard
from .trl_support import install_token_outputs, remove_token_outputs

def reduce_items(loss_sum: torch.Tensor, num_items_in_batch, fallback_count: torch.Tensor) -> torch.Tensor:
    """``sum / num_items_in_batch`` (Trainer's exact gradient accumulation) or the mean over counted items."""
    if num_items_in_batch is None:
        return loss_sum / fallback_count.clamp_min(1)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss_sum.device)
    return loss_sum / num_items_in_batch


def head_classes(model) -> int | None:
    """Number of classes the head scores: the vocabulary of an LM head, else ``num_labels``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear):
        return head.out_features
    return getattr(model.config, "num_labels", None)


def swaps_loss(model, loss: str | None) -> bool:
    """Whether ``patch_model(model, loss=loss)`` can swap the loss (else use :func:`compute_loss_func`)."""
    if loss in (None, "cross_entropy"):
        return True
    if registry.get(loss).head == "cosine":
        return True  # the cosine head swap also takes over the loss of heads that hard-code it
    return routes_loss_function(base_model(model))


class LossPlan(NamedTuple):
    """A validated loss swap: the head's task, its ``loss_function`` and the head it needs (``"cosine"`` or None)."""

    task: str
    loss_function: Callable
    head: str | None


def loss_plan(inner, settings: SparseSettings) -> LossPlan | None:
    """Validate the loss swap (nothing changes); ``None`` for the model's own loss."""
    if settings.loss in (None, "cross_entropy"):
        return None
    entry = registry.get(settings.loss)
    if entry.head == "cosine":
        head_linears(inner)  # refuses families whose head is not known
        task = "sequence_classification"
    else:
        task = model_task(inner)
    registry.check_head(entry, task, head_classes(inner))
    return LossPlan(task, task_loss(task, make_loss(settings.loss, **settings.loss_options)), entry.head)


def task_loss(task: str, loss: Callable, ignore_index: int = -100) -> Callable[..., torch.Tensor]:
    """A ``loss_function`` with transformers' calling conventions for one head type."""

    def summed(logits, labels, num_items_in_batch, ignore):
        labels = labels.reshape(-1).to(logits.device)
        total = loss(logits.reshape(-1, logits.shape[-1]), labels, ignore_index=ignore, reduction="sum")
        return reduce_items(total, num_items_in_batch, (labels != ignore).sum())

    if task == "causal_lm":

        def causal_lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=ignore_index,
                           shift_labels=None, **kwargs):
            if shift_labels is None:
                shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            return summed(logits, shift_labels, num_items_in_batch, ignore_index)

        return causal_lm_loss

    if task == "sequence_classification":

        def sequence_classification_loss(logits=None, labels=None, pooled_logits=None, config=None,
                                         num_items_in_batch=None, ignore_index=ignore_index, **kwargs):
            scores = pooled_logits if pooled_logits is not None else logits
            problem = getattr(config, "problem_type", None)
            if problem not in (None, "single_label_classification") or scores.shape[-1] < 2 or labels.is_floating_point():
                raise ValueError(
                    f"sparse losses need single-label classification with >= 2 labels (got problem_type={problem!r}, "
                    f"{scores.shape[-1]} labels)"
                )
            return summed(scores, labels, num_items_in_batch, ignore_index)

        return sequence_classification_loss

    def token_classification_loss(logits, labels, config=None, num_items_in_batch=None, vocab_size=None,
                                  ignore_index=ignore_index, **kwargs):
        return summed(logits, labels, num_items_in_batch, ignore_index)

    return token_classification_loss


ORIGINAL_ATTR = "_hf_sparsemax_original_attn"  # the implementation a model had before its attention was swapped


class AttentionPlan(NamedTuple):
    """A validated attention swap: the attention modules, their options, heads per module (learned alpha)."""

    modules: list[nn.Module]
    options: Any
    heads: list[int | None]


def attention_plan(inner, settings: SparseSettings) -> AttentionPlan | None:
    """Validate the attention swap (nothing changes): an :class:`AttentionPlan`, or ``None`` (no swap)."""
    options = settings.attention_options
    if options is None:
        return None
    modules = check_supported(inner)
    heads = [num_heads(module) for module in modules] if options.learn_alpha else [None] * len(modules)
    return AttentionPlan(modules, options, heads)


def apply_attention(inner, plan, keep_learned: bool) -> None:
    """Install a validated plan (``None``: the model's own attention). ``keep_learned`` keeps trained alphas."""
    if plan is None:
        restore_attention(inner)
        return
    modules, options, heads = plan
    if ORIGINAL_ATTR not in vars(inner) and inner.config._attn_implementation not in ATTENTION_MAPPINGS:
        setattr(inner, ORIGINAL_ATTR, inner.config._attn_implementation)
    for module, count in zip(modules, heads):
        setattr(module, OPTIONS_ATTR, options)
        learned = module._modules.get(ALPHA_ATTR)
        if not options.learn_alpha:
            module._modules.pop(ALPHA_ATTR, None)
        elif learned is None or not keep_learned or learned.pre_alpha.numel() != count:
            device = next(module.parameters(), torch.empty(0)).device
            module.add_module(ALPHA_ATTR, LearnedAlpha(count, options.alpha).to(device))
    inner.set_attn_implementation(options.mapping)


def restore_attention(inner) -> None:
    for module in inner.modules():
        vars(module).pop(OPTIONS_ATTR, None)
        module._modules.pop(ALPHA_ATTR, None)
    original = vars(inner).pop(ORIGINAL_ATTR, None)
    if inner.config._attn_implementation in ATTENTION_MAPPINGS:
        inner.set_attn_implementation(original or ("sdpa" if getattr(inner, "_supports_sdpa", False) else "eager"))


def load_learned_alpha(inner) -> int:
    """Copy learned alphas saved by ``save_pretrained`` back into the model; returns how many modules got one.

    ``from_pretrained`` drops them (the plain model has no such parameters);
    they are read from the safetensors files of the folder the model came from.
    """
    folder = getattr(inner, "name_or_path", None) or getattr(inner.config, "_name_or_path", "")
    if not folder or not os.path.isdir(folder):
        return 0
    from safetensors import safe_open

    owners = {name: module for name, module in inner.named_modules() if ALPHA_ATTR in module._modules}
    suffix = f".{ALPHA_ATTR}.pre_alpha"
    loaded = 0
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                owner = owners.get(key[: -len(suffix)]) if key.endswith(suffix) else None
                if owner is not None:
                    learned = owner._modules[ALPHA_ATTR]
                    learned = getattr(learned, "original_module", learned)  # peft's wrapper: the base's own alpha
                    with torch.no_grad():
                        learned.pre_alpha.copy_(handle.get_tensor(key))
                    loaded += 1
    return loaded


def check_fusable(model) -> None:
    """A causal LM whose forward is ``base model -> lm_head -> a known head transform`` (see :mod:`.fused_heads`)."""
    params = inspect.signature(type(model).forward).parameters
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (model_task(model) != "causal_lm" or "logits_to_keep" not in params or "labels" not in params
            or not isinstance(head, nn.Linear) or not hasattr(model, model.base_model_prefix)):
        raise ValueError(
            f"loss_options fused=True needs a causal LM whose forward runs its base model then an nn.Linear lm_head "
            f"(with logits_to_keep, as LlamaForCausalLM); {type(model).__name__} is not one: drop fused"
        )
    head_transform(model)


def install_fused_forward(model, loss: str, loss_options: dict[str, Any]) -> None:
    """Make ``model.forward`` (an instance attribute) compute the training loss from hidden states.

    In training mode with ``labels``, the forward runs the base model, shifts
    the labels as transformers does and returns
    ``CausalLMOutputWithPast(loss=fused_head_loss(...), logits=None)``: the
    ``[tokens, vocab]`` logits are never formed, so none are returned. The
    family's head transform (logit scale, soft-capping) comes from
    :data:`~hf_sparsemax.fused_heads.HEAD_TRANSFORMS`, its values are read at
    each call. In eval
    mode, without labels (``generate``), or when the head is not a plain
    ``nn.Linear`` (e.g. a LoRA adapter on ``lm_head``) the original forward
    runs unchanged, with its (unfused, equal) patched loss.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = type(model).forward
    signature = inspect.signature(original)
    options = {k: v for k, v in loss_options.items() if k != "fused"}
    transform = head_transform(model)

    def forward(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        labels = arguments.get("labels")
        head = self.get_output_embeddings()
        if labels is None or not self.training or type(head) is not nn.Linear:
            return original(self, *args, **kwargs)
        inputs = {k: v for k, v in arguments.items() if k not in ("self", "labels", "logits_to_keep", "kwargs")}
        router = inputs.get("output_router_logits")
        if transform.router_aux_loss and (getattr(self.config, "output_router_logits", False) if router is None
                                          else router):
            raise router_refusal(self)  # the forward would add a load-balancing loss the fused path leaves out
        scale, softcap = head_values(self, transform)
        extra = dict(arguments.get("kwargs", {}))
        num_items_in_batch = extra.pop("num_items_in_batch", None)
        shift_labels = extra.pop("shift_labels", None)
        outputs = getattr(self, self.base_model_prefix)(**inputs, **extra)
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        hidden = outputs[0]
        loss_value = fused_head_loss(
            hidden, head.weight, shift_labels.to(hidden.device), loss, bias=head.bias,
            softcap=softcap, logit_scale=scale, num_items_in_batch=num_items_in_batch, **options,
        )
        return CausalLMOutputWithPast(loss=loss_value, logits=None, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)

    forward.__signature__ = inspect.signature(original)
    forward.__doc__ = original.__doc__
    set_instance_method(model, "forward", forward, "hf_sparsemax_fused")


def remove_fused_forward(model) -> None:
    remove_instance_method(model, "forward", "hf_sparsemax_fused")


def patch_model(
    model,
    attn: str | None = None,
    loss: str | None = None,
    *,
    attn_options: dict[str, Any] | None = None,
    loss_options: dict[str, Any] | None = None,
):
    """Swap the attention and / or the loss of a transformers model (or peft model) in place and return it.

    ``attn``: ``None`` (leave as is), ``"softmax"`` (the model's own),
    ``"sparsemax"``, ``"entmax15"``, ``"entmax_bisect"`` (``alpha`` in (1, 2],
    ``learn_alpha``: one trainable alpha per layer and head), ``"sparse_softmax"``
    (``top_k``); every sparse attention takes ``chunk_size`` (queries per
    chunk, recomputed in backward: bounded memory on long sequences).
    ``loss``: ``None`` (leave as is), ``"cross_entropy"`` (the model's own),
    ``"sparse_softmax"`` (``top_k`` / ``top_p``), ``"sparsemax"``, ``"entmax15"``,
    ``"entmax_bisect"`` (``alpha``), ``"taylor_softmax"`` (``order``),
    ``"perturb_max"`` (``noise``, ``points``; label sets up to 4096) or
    ``"am_softmax"`` (``margin``, ``scale``; a sequence-classification head
    becomes a cosine head, undone by :func:`unpatch_model`); the sparse losses also take ``fused``:
    ``True`` makes a causal LM in training mode compute the loss from its
    hidden states with :func:`~hf_sparsemax.fused_head_loss` (no
    ``[tokens, vocab]`` logits; ``outputs.logits`` is then None). With no ``attn`` / ``loss`` the settings
    saved in ``model.config`` are re-applied. Settings are stored in
    ``model.config.hf_sparsemax`` and saved by ``save_pretrained``; with
    hf_sparsemax imported, ``from_pretrained`` of that folder gives the patched
    model back (:mod:`hf_sparsemax.reload`). A causal
    LM's ``generate(do_sample=True)`` then samples from the distribution the
    loss trains (see :mod:`hf_sparsemax.generation`), and ``trl.SFTTrainer``
    trains the patched loss (see :mod:`hf_sparsemax.trl_support`).
    """
    inner = base_model(model)
    reapply = attn is None and loss is None and not attn_options and not loss_options
    if reapply:
        settings = SparseSettings.from_config(inner.config)
        if settings is None:
            return model
    else:
        previous = SparseSettings.from_config(inner.config) or SparseSettings()
        settings = SparseSettings(
            attn=attn if attn is not None else previous.attn,
            attn_options=attn_options if attn is not None or attn_options else previous.attn_options,
            loss=loss if loss is not None else previous.loss,
            loss_options=loss_options if loss is not None or loss_options else previous.loss_options,
        )
    losses = loss_plan(inner, settings)
    loss_function = None if losses is None else losses.loss_function
    plan = attention_plan(inner, settings)
    fused = bool(settings.loss_options.get("fused", False))
    if fused:
        check_fusable(inner)
    # validated: now change the model
    apply_attention(inner, plan, keep_learned=attn is None)
    if reapply and plan is not None and plan.options.learn_alpha:
        load_learned_alpha(inner)
    if model is not inner and plan is not None and plan.options.learn_alpha:
        keep_alpha_with_adapter(model)  # peft saves them with the adapter and restores them on load
    elif model is not inner:
        release_alpha_from_adapter(model)
    remove_matched_generate(inner)
    remove_trainer_guard(inner)
    remove_token_outputs(inner)  # sits above the fused forward
    remove_fused_forward(inner)
    remove_cosine_head(inner)
    if fused:
        install_fused_forward(inner, settings.loss, settings.loss_options)
    if losses is not None and losses.head == "cosine":
        install_cosine_head(inner, None if routes_loss_function(inner) else loss_function)
    if loss_function is not None:
        inner.loss_function = loss_function
        install_trainer_guard(inner, settings.loss, registry.get(settings.loss).loss_rule)
        if losses.task == "causal_lm" and hasattr(inner, "generate"):
            install_matched_generate(inner)
        if losses.task == "causal_lm":
            install_token_outputs(inner)  # TRL's fused_lm_head=True gets the patched loss
    elif "_loss_function" in vars(inner):
        del inner._loss_function
    if settings.is_default:
        if hasattr(inner.config, CONFIG_KEY):
            delattr(inner.config, CONFIG_KEY)
    else:
        setattr(inner.config, CONFIG_KEY, settings.to_dict())
    mark_for_load(inner, settings)  # from_pretrained restores it (hf_sparsemax.reload)
    return model


def unpatch_model(model):
    """Undo :func:`patch_model`: the model's own attention and loss, and no hf_sparsemax settings in its config."""
    inner = base_model(model)
    restore_attention(inner)
    remove_matched_generate(inner)
    remove_trainer_guard(inner)
    remove_token_outputs(inner)
    remove_fused_forward(inner)
    remove_cosine_head(inner)
    if "_loss_function" in vars(inner):
        del inner._loss_function
    if hasattr(inner.config, CONFIG_KEY):
        delattr(inner.config, CONFIG_KEY)
    clear_load_marks(inner)
    if model is not inner:
        release_alpha_from_adapter(model)
    return model


def compute_loss_func(loss: str, task: str = "causal_lm", ignore_index: int = -100, **loss_options):
    """A ``Trainer(compute_loss_func=...)`` callable for heads that hard-code cross-entropy.

    Called by Trainer as ``fn(outputs, labels, num_items_in_batch=...)`` with
    unshifted labels; returns ``sum / num_items_in_batch`` so gradient
    accumulation is exact. ``task``: ``"causal_lm"`` (labels shifted),
    ``"sequence_classification"`` or ``"token_classification"``.
    """
    if task not in ("causal_lm", "sequence_classification", "token_classification"):
        raise ValueError(f"task must be causal_lm, sequence_classification or token_classification, got {task!r}")
    loss_fn = make_loss(loss, **loss_options)
    registry.check_head(registry.get(loss), task)
    head_loss = task_loss(task, loss_fn, ignore_index)

    def compute(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if task == "sequence_classification":
            return head_loss(logits=logits, labels=labels, num_items_in_batch=num_items_in_batch)
        return head_loss(logits, labels, num_items_in_batch=num_items_in_batch)

    compute.__name__ = f"{loss}_{task}_loss"
    return compute
