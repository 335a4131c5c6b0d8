"""Running one variant of a recipe: load the model, patch it, train with ``Trainer``, evaluate, sample.

A trained variant is a folder::

    <variant>/model/          the adapter (LoRA) or the full weights, with the tokenizer
    <variant>/variant.json    the recipe's model, the variant's attention / loss settings, lora or not
    <variant>/log_history.json  Trainer's log (training loss per step, evaluations)
    <variant>/results.json    held-out metrics and samples (after evaluation)

Bad input (a missing model or dataset, a model transformers cannot load, a
``.gguf`` of an architecture transformers' GGUF loader does not know) raises
:class:`~hf_sparsemax.app.recipes.RecipeError` before any folder is written.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import time
from typing import Any, NamedTuple

import numpy as np
import torch

from ..metrics import sparse_text as metrics
from ..attention.query_scale import LENGTH_SCALE_ATTR, query_scale_parameters
from ..losses.names import loss_mapping
from ..patch import base_model, compute_loss_func, patch_model, swaps_loss
from .assets import gguf_cache
from .recipes import Recipe, RecipeError, Variant, one_line


def model_location(spec: str) -> tuple[str, str | None]:
    """``(folder or model id, gguf file name or None)`` for a recipe's ``model``."""
    from . import assets

    if spec == "smollm2":
        return assets.smollm2_gguf()
    if spec == "minilm":
        return assets.minilm_folder(), None
    if spec.lower().endswith(".gguf"):
        if not os.path.isfile(spec):
            raise RecipeError(f"model file {spec} not found: fix `model` (a model id, folder or .gguf file)")
        folder, name = os.path.split(os.path.abspath(spec))
        return folder, name
    if os.path.exists(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise RecipeError(f"model folder {spec} has no config.json: give a folder saved by save_pretrained")
        return spec, None
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or spec.endswith("/"):
        raise RecipeError(f"model folder {spec} not found: fix `model` (a model id, folder or .gguf file)")
    return spec, None


def local_model(spec: str) -> str:
    """The folder to load a recipe's model from (GGUF files through :func:`gguf_cache`)."""
    location, gguf = model_location(spec)
    if gguf is None:
        return location
    try:
        return gguf_cache(location, gguf)
    except Exception as error:  # unsupported GGUF architecture, unreadable file
        raise RecipeError(f"cannot load model {spec!r}: {explain(error, gguf)}") from None


def explain(error: Exception, gguf: str | None) -> str:
    """One line for a loading error; for GGUF files, the architectures transformers can read."""
    text = one_line(error)
    if gguf and "not supported" in text:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        known = sorted(k for k in GGUF_CONFIG_MAPPING if k not in ("general", "tokenizer"))
        text += f" Use a .gguf of one of {known}, or a model folder / id."
    return text


def load_tokenizer(recipe: Recipe, folder: str | None = None):
    from transformers import AutoTokenizer

    location = folder or local_model(recipe.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
    except Exception as error:  # OSError, ValueError, hub errors: all mean "this model cannot be read"
        raise RecipeError(f"cannot load the tokenizer of model {recipe.model!r}: {one_line(error)}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(recipe: Recipe, labels: list[str] | None = None, folder: str | None = None):
    """The recipe's pretrained model (or a saved fine-tuned ``folder``), de-quantised if it came from GGUF."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    location = folder or local_model(recipe.model)
    kwargs: dict[str, Any] = {}
    if recipe.task == "sequence_classification":
        auto = AutoModelForSequenceClassification
        kwargs.update(num_labels=len(labels), id2label=dict(enumerate(labels)),
                      label2id={name: i for i, name in enumerate(labels)})
    else:
        auto = AutoModelForCausalLM
    try:
        model = auto.from_pretrained(location, **kwargs)
    except Exception as error:  # unsupported GGUF architecture, bad folder, unknown hub id, no network
        raise RecipeError(f"cannot load model {recipe.model!r} for {recipe.task}: {one_line(error)}") from None
    if model.config.pad_token_id is None and model.config.eos_token_id is not None:
        eos = model.config.eos_token_id
        model.config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    return model


def lora_config(recipe: Recipe):
    from peft import LoraConfig

    task_type = "SEQ_CLS" if recipe.task == "sequence_classification" else "CAUSAL_LM"
    try:
        return LoraConfig(**{"task_type": task_type, **recipe.lora})
    except (TypeError, ValueError) as error:
        raise RecipeError(f"lora: {one_line(error)}") from None


def prepare(model, recipe: Recipe, variant: Variant):
    """Wrap in LoRA (if the recipe asks) and patch attention and loss. Returns ``(model, compute_loss_func)``.

    Heads that hard-code cross-entropy (BERT, GPT-2 classification) get the
    sparse loss through ``Trainer(compute_loss_func=...)`` instead.
    """
    if recipe.lora is not None:
        from peft import get_peft_model
        from transformers import set_seed

        set_seed(recipe.training_args(variant).get("seed", 42))  # LoRA's random init: the same on every run
        model = get_peft_model(model, lora_config(recipe))
    return model, patch_variant(model, recipe, variant)


def patch_variant(model, recipe: Recipe, variant: Variant):
    """Patch attention and loss as ``variant`` says; returns the ``compute_loss_func`` (or None) for heads that
    hard-code cross-entropy. On a ``PeftModel`` learned alphas are saved with the adapter (``modules_to_save``)."""
    loss, options = variant.loss, variant.loss_options
    custom = None
    if not swaps_loss(model, loss):
        custom = compute_loss_func(loss, task=recipe.task, **options)
        loss, options = None, {}
    patch_model(model, attn=variant.attn, loss=loss, attn_options=variant.attn_options or None,
                loss_options=options or None)
    return custom


@contextlib.contextmanager
def timed(into: dict[str, list[float]], name: str):
    """While the block runs: its wall-clock and process CPU seconds (every thread) added to ``into[name]``, a
    ``[wall, cpu]`` pair (where a comparison's time goes: ``part_seconds`` in a variant's results)."""
    start, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        wall, used = into.get(name, (0.0, 0.0))
        into[name] = [round(wall + time.perf_counter() - start, 1), round(used + time.process_time() - cpu, 1)]


def calibrate(model, variant: Variant, train_set, batch_size: int) -> dict[str, Any]:
    """Fit the per-head temperatures on the first ``variant.calibrate`` training batches
    (:func:`hf_sparsemax.calibrate_attention`); returns ``temperatures`` ``[layer][head]`` and ``calibration``
    (the relative output error against softmax before and after, on those batches)."""
    from transformers import default_data_collator

    from ..swaps.calibration import calibrate_attention

    count = min(variant.calibrate * batch_size, len(train_set))
    items = [train_set[i] for i in range(count)]
    batches = [default_data_collator(items[i:i + batch_size]) for i in range(0, count, batch_size)]
    start = time.perf_counter()
    report = calibrate_attention(model, batches)
    return {"temperatures": [layer["temperatures"] for layer in report["layers"]],
            "calibration": {"error_before": report["error_before"], "error_after": report["error_after"],
                            "batches": len(batches), "seconds": round(time.perf_counter() - start, 1)}}


def transfer(model, variant: Variant, train_set) -> dict[str, Any]:
    """:func:`hf_sparsemax.transfer_attention` on ``variant.transfer``'s blocks: consecutive training blocks joined
    into ``blocks`` sequences of ``block_size`` tokens (the packed training text is one stream, so joined blocks are
    running text). Returns ``temperatures`` and ``transfer`` (the relative output errors before, calibrated and
    after, per layer too, the heads kept wide, the seconds)."""
    spec = dict(variant.transfer)
    count, size = spec.pop("blocks", 1), spec.pop("block_size", None)
    stride = len(train_set[0]["input_ids"])
    size = size or stride
    per = size // stride
    if count * per > len(train_set):
        raise RecipeError(f"variants.{variant.name}.transfer: {count} blocks of {size} tokens need {count * per} "
                          f"training blocks of {stride}; data.train_size holds {len(train_set)}")
    batches = []
    for index in range(count):
        ids = torch.cat([train_set[index * per + j]["input_ids"] for j in range(per)])[None]
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    from ..conversion.transfer import transfer_attention

    start = time.perf_counter()
    report = transfer_attention(model, batches, progress=True, **spec)
    return {"temperatures": [layer["temperatures"] for layer in report["layers"]],
            "transfer": {"error_before": report["error_before"], "error_calibrated": report["error_calibrated"],
                         "error_after": report["error_after"], "dense_heads": report["dense_heads"],
                         "layers": [[layer[k] for k in ("error_before", "error_calibrated", "error_after")]
                                    for layer in report["layers"]],
                         "blocks": count, "block_size": size, "seconds": round(time.perf_counter() - start, 1)}}


def variant_mapping(variant: Variant):
    return loss_mapping(variant.loss or "cross_entropy", **variant.loss_options)


def classification_metrics(mapping, num_labels: int, epsilon: float, keep: dict | None = None):
    """``(preprocess, compute)`` for Trainer: accuracy, macro-F1 and the sparse metrics of the model's mapping.

    ``keep`` (a dict), if given, receives the last evaluation's ``predicted`` and ``labels`` arrays, from
    which :func:`evaluate` adds per-class scores and the confusion matrix to the results.
    """

    def preprocess(logits, labels):
        logits = logits[0] if isinstance(logits, tuple) else logits
        stats = metrics.token_stats(mapping(logits.float()), labels)
        return torch.cat([stats, logits.argmax(-1, keepdim=True).float()], -1)

    def compute(eval_pred):
        stats, labels = np.asarray(eval_pred.predictions), np.asarray(eval_pred.label_ids)
        out = metrics.summarize(*(stats[:, i] for i in range(len(metrics.STATS))), vocab_size=num_labels,
                                epsilon=epsilon)
        predicted = stats[:, -1].astype(int)
        out["accuracy"] = float((predicted == labels).mean())
        out["macro_f1"] = macro_f1(predicted, labels, num_labels)
        if keep is not None:
            keep.update(predicted=predicted, labels=labels.astype(int))
        return out

    return preprocess, compute


def confusion_matrix(predicted: np.ndarray, labels: np.ndarray, num_labels: int) -> np.ndarray:
    """``[true class, predicted class]`` counts."""
    matrix = np.zeros((num_labels, num_labels), dtype=np.int64)
    np.add.at(matrix, (labels, predicted), 1)
    return matrix


def class_scores(predicted: np.ndarray, labels: np.ndarray, num_labels: int) -> dict[str, np.ndarray]:
    """Per class ``c``: precision ``tp / (tp + fp)``, recall ``tp / (tp + fn)``, F1 ``2 tp / (2 tp + fp + fn)``
    (each 0 where its denominator is 0), support (held-out examples of ``c``) and predicted counts."""
    matrix = confusion_matrix(predicted, labels, num_labels)
    tp = np.diag(matrix).astype(np.float64)
    support, predicted_count = matrix.sum(1), matrix.sum(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = np.where(predicted_count > 0, tp / predicted_count, 0.0)
        recall = np.where(support > 0, tp / support, 0.0)
        f1 = np.where(support + predicted_count > 0, 2 * tp / (support + predicted_count), 0.0)
    return {"precision": precision, "recall": recall, "f1": f1, "support": support, "predicted": predicted_count}


def macro_f1(predicted: np.ndarray, labels: np.ndarray, num_labels: int) -> float:
    """Mean F1 over the classes that occur among the held-out labels or the predictions (as scikit-learn)."""
    scores = class_scores(predicted, labels, num_labels)
    present = (scores["support"] + scores["predicted"]) > 0
    return float(scores["f1"][present].mean())


def per_class(predicted: np.ndarray, labels: np.ndarray, names: list[str]) -> dict[str, Any]:
    """``per_class`` (label name -> precision / recall / f1 / support) and ``confusion_matrix`` for results."""
    scores = class_scores(predicted, labels, len(names))
    table = {name: {"precision": float(scores["precision"][c]), "recall": float(scores["recall"][c]),
                    "f1": float(scores["f1"][c]), "support": int(scores["support"][c])}
             for c, name in enumerate(names)}
    return {"per_class": table, "class_names": list(names),
            "confusion_matrix": confusion_matrix(predicted, labels, len(names)).tolist()}


def training_arguments(recipe: Recipe, variant: Variant, output_dir: str):
    from transformers import TrainingArguments

    try:
        return TrainingArguments(output_dir=output_dir, **recipe.training_args(variant))
    except (TypeError, ValueError) as error:
        raise RecipeError(f"training: {one_line(error)}") from None


def make_trainer(recipe: Recipe, variant: Variant, model, tokenizer, train_set, eval_set, work_dir: str,
                 num_labels: int | None = None, custom_loss=None):
    """A ``Trainer`` for a prepared model (see :func:`prepare`), with the held-out metrics of its mapping."""
    from transformers import DataCollatorWithPadding, Trainer, default_data_collator

    args = training_arguments(recipe, variant, os.path.join(work_dir, "checkpoints"))
    kept: dict[str, np.ndarray] = {}
    if recipe.task == "sequence_classification":
        preprocess, compute = classification_metrics(variant_mapping(variant), num_labels, recipe.eval.epsilon,
                                                      kept)
        collator = DataCollatorWithPadding(tokenizer)
    else:
        vocab = base_model(model).config.vocab_size
        preprocess, compute = metrics.trainer_metrics(variant_mapping(variant), vocab, causal=True,
                                                      epsilon=recipe.eval.epsilon)
        collator = default_data_collator
    args.per_device_eval_batch_size = recipe.eval.batch_size
    groups = {name: rate for name, rate in (("alpha", variant.alpha_learning_rate),
                                            ("query_scale", variant.scale_learning_rate)) if rate is not None}
    if groups:
        Trainer = own_rate_trainer(Trainer, groups)
    callbacks, curve = conversion_callbacks(recipe, variant, eval_set if train_set is not None else None)
    if variant.distill is not None:
        from ..conversion import SelfDistillation, distillation_trainer

        Trainer = distillation_trainer(Trainer, SelfDistillation(**variant.distill))
    trainer = Trainer(model=model, args=args, train_dataset=train_set, eval_dataset=eval_set,
                      data_collator=collator, processing_class=tokenizer, compute_loss_func=custom_loss,
                      preprocess_logits_for_metrics=preprocess, compute_metrics=compute, callbacks=callbacks)
    quiet_console(trainer, variant.name)
    trainer.hf_sparsemax_predictions = kept  # classification: filled by each evaluation (see evaluate)
    trainer.hf_sparsemax_curve = curve  # causal LM with eval.curve_every: the held-out curves (see .curves)
    return trainer


def quiet_console(trainer, name: str) -> None:
    """Trainer's console as a progress bar per phase with the loss in it (:func:`loss_bar`), instead of a line
    per logging step (``{'loss': ...}``); nothing with ``training.disable_tqdm``."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if not trainer.args.disable_tqdm:
        trainer.add_callback(loss_bar(name))


def loss_bar(name: str):
    """transformers' own progress bars (tqdm), named ``name training`` / ``name evaluation``, showing the last
    logged losses in the training bar rather than printing each log entry on a line of its own."""
    from tqdm.auto import tqdm
    from transformers.trainer_callback import ProgressCallback
    from transformers.trainer_utils import has_length

    class LossBar(ProgressCallback):  # each bar made with its name, so that its first line shows it too
        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.training_bar = tqdm(total=state.max_steps, desc=f"{name} training", dynamic_ncols=True)
            self.current_step = 0

        def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
            if self.prediction_bar is None and state.is_world_process_zero and has_length(eval_dataloader):
                self.prediction_bar = tqdm(total=len(eval_dataloader), desc=f"{name} evaluation",
                                           leave=self.training_bar is None, dynamic_ncols=True)
            super().on_prediction_step(args, state, control, eval_dataloader=eval_dataloader, **kwargs)

        def on_log(self, args, state, control, logs=None, **kwargs):
            shown = {key: f"{logs[key]:.4g}" for key in ("loss", "eval_loss") if isinstance(logs.get(key), float)}
            if self.training_bar is not None and shown:
                self.training_bar.set_postfix(shown, refresh=False)

    return LossBar()


def conversion_callbacks(recipe: Recipe, variant: Variant, eval_set) -> tuple[list, Any]:
    """Trainer callbacks of a variant: its alpha schedule, and the curve callback (None without curves)."""
    callbacks, curve = [], None
    if variant.alpha_schedule is not None:
        from ..conversion import AlphaScheduleCallback

        callbacks.append(AlphaScheduleCallback(**variant.alpha_schedule))
    if recipe.eval.curve_every is not None and recipe.task == "causal_lm" and eval_set is not None:
        from .curves import CurveCallback

        curve = CurveCallback(eval_set, recipe.eval.curve_every, recipe.eval.curve_blocks, recipe.eval.batch_size)
        callbacks.append(curve)
    return callbacks, curve


OWN_RATE_PARAMETERS = {  # parameter groups a variant can give a learning rate of their own, and what learns them
    "alpha": (lambda model: trainable_alphas(model), "alpha_learning_rate", "the model learns no alpha"),
    "query_scale": (lambda model: query_scale_parameters(model), "scale_learning_rate",
                    "the model learns no query scale (attn_options.length_scale or learn_temperature)"),
}


def own_rate_trainer(trainer_class, rates: dict[str, float]):
    """``trainer_class`` whose optimizer trains each group of :data:`OWN_RATE_PARAMETERS` named in ``rates`` (the
    learned alphas; the learned query scales: temperatures, ASEntmax's length scale) in a group of its own:
    learning rate ``rates[name]``, no weight decay (decay would pull each alpha's ``a`` to 0, that is alpha to
    1.5, and ``log T`` or the length scale's ``delta`` to 0); the other groups as Trainer made them. Built by
    Trainer's own ``create_optimizer``, so a resumed run gets the same groups."""

    class OwnRateTrainer(trainer_class):
        def create_optimizer(self, model=None):
            optimizer = super().create_optimizer(model)
            if any(group.get("hf_sparsemax_group") for group in optimizer.param_groups):
                return optimizer  # grouped already (Trainer calls this again after a resume)
            for name, rate in rates.items():
                find, key, none = OWN_RATE_PARAMETERS[name]
                params = [p for _, p in find(self.model if model is None else model)]
                if not params:
                    raise RecipeError(f"{key} is set but {none}")
                ids = {id(p) for p in params}
                for group in optimizer.param_groups:
                    group["params"] = [p for p in group["params"] if id(p) not in ids]
                optimizer.param_groups = [group for group in optimizer.param_groups if group["params"]]
                optimizer.add_param_group({"params": params, "lr": rate, "weight_decay": 0.0,
                                           "hf_sparsemax_group": name})
            return optimizer

    return OwnRateTrainer


def last_checkpoint(work_dir: str) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    folder = os.path.join(work_dir, "checkpoints")
    return get_last_checkpoint(folder) if os.path.isdir(folder) else None


def train(trainer, work_dir: str, resume: bool) -> dict[str, Any]:
    """Train (from the last checkpoint with ``resume``) and save the model; returns train metrics: wall-clock
    ``train_seconds``, ``train_cpu_seconds`` (this process's CPU time, every thread: what the training cost,
    less swayed by other work on the machine) and ``train_load`` (the 1-minute load average at start and end)."""
    checkpoint = last_checkpoint(work_dir) if resume else None
    start, cpu, load = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    result = trainer.train(resume_from_checkpoint=checkpoint)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    trainer.save_model(os.path.join(work_dir, "model"))
    if trainer.args.should_save:
        write_json(os.path.join(work_dir, "log_history.json"), trainer.state.log_history)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"train_seconds": round(seconds, 1), "train_cpu_seconds": round(cpu, 1),
            "train_load": [round(load, 2), round(os.getloadavg()[0], 2)], "train_loss": result.training_loss,
            "final_loss": losses[-1] if losses else None, "steps": trainer.state.global_step,
            "resumed_from": os.path.basename(checkpoint) if checkpoint else None}


def evaluate(trainer) -> dict[str, Any]:
    """Held-out metrics; ``eval_examples`` counts the examples scored (causal LM: blocks); classification
    adds per-class precision / recall / F1 and the confusion matrix (:func:`per_class`)."""
    out = trainer.evaluate()
    results = {("eval_loss" if k == "eval_loss" else k.removeprefix("eval_")): v for k, v in out.items()}
    results["eval_examples"] = len(trainer.eval_dataset)
    kept = getattr(trainer, "hf_sparsemax_predictions", None)
    if kept:
        config = base_model(trainer.model).config
        names = [config.id2label[i] for i in range(config.num_labels)]
        results.update(per_class(kept["predicted"], kept["labels"], names))
    return results


def sample(model, tokenizer, recipe: Recipe) -> dict[str, Any]:
    """Matched sampling (the distribution the loss trained, no default top-k) and its consistency report."""
    from ..decoding.generation import decoding_report

    model.eval()
    report = decoding_report(model, tokenizer, recipe.eval.prompts, max_new_tokens=recipe.eval.max_new_tokens,
                             seed=recipe.eval.seed, top_k=0, top_p=1.0)
    return {"texts": report["texts"], "sample_zero_prob_share": report["zero_prob_share"],
            "sample_support_size": report["mean_support_size"], "sample_tokens": report["tokens"]}


def attention_map(model, tokenizer, recipe: Recipe) -> tuple[np.ndarray, list[str]]:
    """``[q, kv]`` attention weights of ``eval.heatmap_layer`` / ``heatmap_head`` on ``eval.heatmap_text``."""
    weights, tokens = attention_weights(model, tokenizer, recipe)
    return weights[recipe.eval.heatmap_layer, recipe.eval.heatmap_head], tokens


def attention_weights(model, tokenizer, recipe: Recipe) -> tuple[np.ndarray, list[str]]:
    """``[layer, head, q, kv]`` attention weights of every layer and head on ``eval.heatmap_text``, its tokens."""
    from .curves import returning_weights

    inner = base_model(model)
    with returning_weights(model):  # sdpa and the like return no weights; eager is the same softmax attention
        encoded = tokenizer(recipe.eval.heatmap_text, return_tensors="pt").to(inner.device)
        model.eval()
        with torch.no_grad():
            out = model(**encoded, output_attentions=True)
    if not out.attentions or out.attentions[0] is None:
        raise RecipeError("the model returned no attention weights for the heatmap")
    weights = torch.stack([a[0] for a in out.attentions]).float().cpu().numpy()
    tokens = tokenizer.convert_ids_to_tokens(encoded.input_ids[0])
    return weights, [t.replace("Ġ", " ").replace("▁", " ") for t in tokens]


def trainable_alphas(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable ``pre_alpha`` parameters (one per layer, one entry per head), in layer order; under peft
    the adapter's copies (``modules_to_save``), not the frozen originals."""
    return [(name, p) for name, p in model.named_parameters() if name.endswith("pre_alpha") and p.requires_grad]


def alphas_by_head(model) -> list[list[float]] | None:
    """``[layer][head]`` alphas, ``1 + sigmoid(pre_alpha)``; None when the attention learns no alpha."""
    values = [(1 + torch.sigmoid(p.detach().float())).tolist() for _, p in trainable_alphas(model)]
    return values or None


def learned_alphas(model, start: list[list[float]] | None = None) -> dict[str, Any]:
    """``learned_alpha_mean`` / ``_min`` / ``_max`` over the trained per-head alphas, and the alphas themselves
    per layer and head (``learned_alpha_end``; ``learned_alpha_start``: ``start``, taken before training);
    empty when the attention learns no alpha."""
    end = alphas_by_head(model)
    if end is None:
        return {}
    alpha = np.concatenate([np.asarray(layer) for layer in end])
    return {"learned_alpha_mean": float(alpha.mean()), "learned_alpha_min": float(alpha.min()),
            "learned_alpha_max": float(alpha.max()), "learned_alpha_start": start, "learned_alpha_end": end}


def learned_length_scale(model) -> dict[str, Any]:
    """``learned_length_scale``: ``{delta, beta, gamma: {min, mean, max}}`` over every layer and head of ASEntmax's
    length scale (started at 1, 0, 1); empty when the model has none."""
    values: dict[str, list[torch.Tensor]] = {}
    for name, p in query_scale_parameters(model):
        if LENGTH_SCALE_ATTR in name:
            values.setdefault(name.rsplit(".", 1)[-1], []).append(p.detach().float().flatten())
    if not values:
        return {}
    return {"learned_length_scale": {key: {"min": float(torch.cat(v).min()), "mean": float(torch.cat(v).mean()),
                                           "max": float(torch.cat(v).max())} for key, v in values.items()}}


def save_variant(folder: str, recipe: Recipe, variant: Variant, labels: list[str] | None, model=None) -> None:
    """variant.json; ``settings``: those the trained ``model`` holds (fitted temperatures included), else the
    variant's."""
    from ..settings import SparseSettings

    settings = SparseSettings.from_config(base_model(model).config) if model is not None else None
    write_json(os.path.join(folder, "variant.json"), {
        "recipe": recipe.name, "model": recipe.model, "task": recipe.task, "lora": recipe.lora is not None,
        "variant": variant.name, "settings": (settings or variant.settings).to_dict(), "labels": labels,
    })


class TrainedVariant(NamedTuple):
    """A trained variant loaded back: the model patched as it was trained, and what evaluation needs."""

    model: Any
    tokenizer: Any
    variant: Variant
    loss_func: Any  # Trainer's compute_loss_func when the model's head hard-codes its loss, else None
    info: dict[str, Any]  # the folder's variant.json


def load_trained(recipe: Recipe, folder: str) -> TrainedVariant:
    """A trained variant folder loaded back (:class:`TrainedVariant`), patched as it was trained."""
    info_path = os.path.join(folder, "variant.json")
    if not os.path.isfile(info_path):
        raise RecipeError(f"no trained variant in {folder}: run `hf-sparsemax train` (or compare) first")
    info = read_json(info_path)
    model_dir = os.path.join(folder, "model")
    tokenizer = load_tokenizer(recipe, model_dir)
    settings = info["settings"]
    variant = Variant(info["variant"], attn=settings.get("attn"), attn_options=settings.get("attn_options", {}),
                      loss=settings.get("loss"), loss_options=settings.get("loss_options", {}))
    if info["lora"]:
        from peft import PeftModel

        # the base patched as in training (fresh alphas); the adapter then restores the trained ones (modules_to_save)
        base = load_base_model(recipe, info["labels"])
        custom = patch_variant(base, recipe, variant)
        model = PeftModel.from_pretrained(base, model_dir)
    else:
        model = load_base_model(recipe, info["labels"], folder=model_dir)  # restored from its config on load
        patch_model(model)  # re-applies the saved settings (folders saved before the load hook), keeps the alphas
        custom = None
        if not swaps_loss(model, variant.loss):
            custom = compute_loss_func(variant.loss, task=recipe.task, **variant.loss_options)
    model.eval()
    return TrainedVariant(model, tokenizer, variant, custom, info)


def fresh_copy(model):
    return copy.deepcopy(model)


NON_FINITE = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}  # results.json's strings for them
TEXT = "\u0000"  # written before a text that would otherwise read as a number of NON_FINITE (or begins with it)


def strict(data: Any) -> Any:
    """``data`` with every non-finite float replaced by its string in :data:`NON_FINITE` (strict JSON has no
    infinity or NaN: ``jq`` and JavaScript refuse Python's bare ``Infinity``), and every text that :func:`loose`
    would take for something else (one of those strings, or one beginning with :data:`TEXT`) marked as a text:
    :data:`TEXT` before it. So a prompt or a sample that reads "NaN" comes back a text, a NaN a float."""
    if isinstance(data, float) and not math.isfinite(data):
        return "NaN" if math.isnan(data) else ("Infinity" if data > 0 else "-Infinity")
    if isinstance(data, str) and (data in NON_FINITE or data.startswith(TEXT)):
        return TEXT + data
    if isinstance(data, dict):
        return {key: strict(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [strict(value) for value in data]
    return data


def loose(data: Any) -> Any:
    """The inverse of :func:`strict`: the strings of :data:`NON_FINITE` back to floats, marked texts unmarked.
    Files written before texts were marked read back as they were written (their bare strings were numbers)."""
    if isinstance(data, str):
        return data[len(TEXT):] if data.startswith(TEXT) else NON_FINITE.get(data, data)
    if isinstance(data, dict):
        return {key: loose(value) for key, value in data.items()}
    if isinstance(data, list):
        return [loose(value) for value in data]
    return data


def write_json(path: str, data: Any) -> None:
    """Strict JSON (:func:`strict`: ``"Infinity"``, ``"-Infinity"``, ``"NaN"`` for the non-finite floats, a text
    that reads as one marked), read back by :func:`read_json` to what was written (tuples as lists)."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(strict(data), handle, indent=2, sort_keys=True, default=str, allow_nan=False)
        handle.write("\n")


def read_json(path: str) -> Any:
    """A file :func:`write_json` wrote, its non-finite numbers floats again."""
    with open(path, encoding="utf-8") as handle:
        return loose(json.load(handle))
