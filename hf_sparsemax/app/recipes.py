"""Recipes: a YAML file naming model, data, attention, loss, LoRA, training and evaluation settings.

A recipe is read into :class:`Recipe`, a small validated object. Every field
can be overridden from the command line with ``--set PATH=VALUE``: ``PATH`` is
the dotted key (``training.max_steps``, ``data.block_size``,
``variants.entmax15.loss_options.alpha``), ``VALUE`` is read as YAML
(``20``, ``5e-4``, ``true``, ``[q_proj, v_proj]``, ``null``). Unknown keys
anywhere raise :class:`RecipeError` naming the keys that exist, so a typo
never silently does nothing.

``variants`` names the settings ``compare`` trains side by side; each one
overrides the recipe's ``attn``, ``attn_options``, ``loss``, ``loss_options``
and, key by key, ``training``, and may give learned alphas their own
learning rate (``alpha_learning_rate``, see :class:`Variant`). ``seeds`` (``null``: one run with
``training.seed``) repeats every variant of ``compare`` once per seed, each
run with ``training.seed`` set to it (LoRA's initialisation and the order of
the training blocks); the data split and held-out blocks stay the same. ``training`` is passed through to
``transformers.TrainingArguments`` and ``lora`` to ``peft.LoraConfig``
(``null`` = full fine-tuning).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
from typing import Any

import yaml

from ..mappings import registry
from ..settings import SparseSettings

TASKS = ("causal_lm", "sequence_classification")
TRANSFER_FIELDS = ("blocks", "block_size", "steps", "learning_rate", "rows_per_batch", "dense_heads", "dense_alpha",
                   "by_group", "min_alpha")  # a variant's `transfer`: where its blocks come from, then transfer_attention's own


def recipe_dir(package_dir: str) -> str:
    """The shipped recipes of the ``hf_sparsemax`` package in ``package_dir``: the data package
    ``hf_sparsemax.app.recipes`` of an installed wheel, else ``recipes/`` at the top of a source checkout (the
    console module finds the same folder without importing the package; tests/test_cli.py checks they agree)."""
    installed = os.path.join(package_dir, "app", "recipes")
    checkout = os.path.join(package_dir, os.pardir, "recipes")
    return installed if os.path.isdir(installed) else os.path.normpath(checkout)


RECIPE_DIR = recipe_dir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the shipped recipes

TRAINING_DEFAULTS = {  # what a recipe's `training` starts from (TrainingArguments otherwise)
    "report_to": "none",
    "use_cpu": True,
    "seed": 0,
    "logging_steps": 1,
    "save_strategy": "steps",
    "save_steps": 10,
    "save_total_limit": 1,
    "lr_scheduler_type": "constant",
}


TRAINING_RANGES = {  # TrainingArguments accepts these out of range and fails only later, after the model loaded
    "per_device_train_batch_size": (lambda v: v >= 1, ">= 1"),
    "per_device_eval_batch_size": (lambda v: v >= 1, ">= 1"),
    "gradient_accumulation_steps": (lambda v: v >= 1, ">= 1"),
    "max_steps": (lambda v: v == -1 or v >= 1, ">= 1 (or -1: train for num_train_epochs)"),
    "num_train_epochs": (lambda v: v > 0, "> 0"),
    "learning_rate": (lambda v: v >= 0, ">= 0"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "max_grad_norm": (lambda v: v >= 0, ">= 0"),
    "adam_epsilon": (lambda v: v >= 0, ">= 0"),
    "adam_beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "adam_beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "label_smoothing_factor": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "save_steps": (lambda v: v > 0, "> 0"),
    "seed": (lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
    "dataloader_num_workers": (lambda v: v >= 0, ">= 0"),
}


class RecipeError(ValueError):
    """A recipe (or an override of it) that cannot run; the message says what to fix."""


@dataclasses.dataclass
class DataSpec:
    """Where the text comes from and how it is split, deterministically.

    ``source``: ``"fortunes"`` (the offline FreeBSD corpus; ``categories``
    picks its files), ``"pydoc_topics"`` (CPython's documentation topics, long
    offline text: one entry per topic), a ``datasets`` dataset name (``config``, ``split``,
    ``text_field``, ``label_field``), or local ``.txt`` (one entry per
    paragraph) / ``.json`` / ``.jsonl`` / ``.csv`` files (a path or a list).
    An entry goes to the held-out side when a hash of its text says so
    (``eval_fraction``), so the split does not depend on sizes or order.
    Causal LM: entries are packed into blocks of ``block_size`` tokens;
    ``train_size`` / ``eval_size`` count blocks. Classification: they count
    examples per label with ``balance: true`` (the default), examples in all
    with ``balance: false`` (the natural label distribution), truncated to
    ``max_length`` tokens. ``null`` sizes take every entry.

    Your own held-out data: ``eval_source`` (local file(s), read like
    ``source``) or, for a ``datasets`` name, ``eval_split``. Then there is no
    hash split: every ``source`` entry trains, and the held-out entries are
    used as given, in their order, without the ``min_chars`` / ``max_chars``
    filter.
    """

    source: Any = "fortunes"
    categories: list[str] | None = None
    config: str | None = None
    split: str = "train"
    text_field: str = "text"
    label_field: str = "label"
    block_size: int = 64
    max_length: int = 128
    train_size: int | None = 256
    eval_size: int | None = 32
    eval_fraction: float = 0.1
    eval_source: Any = None
    eval_split: str | None = None
    balance: bool = True
    min_chars: int = 1
    max_chars: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.source, (list, tuple)):
            self.source = [str(s) for s in self.source]
        elif not isinstance(self.source, str) or not self.source:
            raise RecipeError(f"data.source must be 'fortunes', 'pydoc_topics', a dataset name or file path(s), got {self.source!r}")
        for name in ("block_size", "max_length", "train_size", "eval_size"):
            value = getattr(self, name)
            if value is None and name in ("train_size", "eval_size"):
                continue  # every entry
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RecipeError(f"data.{name} must be a positive integer"
                                  f"{' or null (every entry)' if name.endswith('_size') else ''}, got {value!r}")
        if isinstance(self.eval_source, (list, tuple)) and self.eval_source and all(
                isinstance(s, str) and s for s in self.eval_source):
            self.eval_source = [str(s) for s in self.eval_source]
        elif self.eval_source is not None and (not isinstance(self.eval_source, str) or not self.eval_source):
            raise RecipeError(f"data.eval_source must be held-out file path(s) or null, got {self.eval_source!r}")
        if self.eval_split is not None and (not isinstance(self.eval_split, str) or not self.eval_split):
            raise RecipeError(f"data.eval_split must be a split name of the data.source dataset or null, "
                              f"got {self.eval_split!r}")
        if self.eval_source is not None and self.eval_split is not None:
            raise RecipeError("data.eval_source and data.eval_split both name held-out data: keep one")
        if not isinstance(self.balance, bool):
            raise RecipeError(f"data.balance must be true (per-label counts) or false (natural label "
                              f"distribution), got {self.balance!r}")
        if not 0 < float(self.eval_fraction) < 1:
            raise RecipeError(f"data.eval_fraction must lie in (0, 1), got {self.eval_fraction!r}")


@dataclasses.dataclass
class LongSpec:
    """``eval.long_context``, the evaluation at length (:mod:`.long_context`); sizes are tokens, depths shares of the
    filler."""

    documents: int = 1
    length: int = 8192
    contexts: list[int] = dataclasses.field(default_factory=lambda: [2048, 4096, 8192, 16384])
    depths: list[float] = dataclasses.field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    trials: int = 20
    rope_factor: float | None = 2.0
    zeros_length: int = 1024
    decode_context: int = 8192
    decode_steps: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("documents", "length", "trials", "zeros_length", "decode_context", "decode_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RecipeError(f"eval.long_context.{name} must be a positive integer, got {value!r}")
        if self.length < 2 or self.zeros_length < 2:
            raise RecipeError("eval.long_context.length and zeros_length must be at least 2 tokens")
        if not isinstance(self.contexts, list) or not self.contexts or not all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 64 for c in self.contexts):
            raise RecipeError(f"eval.long_context.contexts must be a list of token counts >= 64, got {self.contexts!r}")
        if not isinstance(self.depths, list) or not self.depths or not all(
                isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 1 for d in self.depths):
            raise RecipeError(f"eval.long_context.depths must be a list of shares in [0, 1], got {self.depths!r}")
        self.depths = [float(d) for d in self.depths]
        if self.rope_factor is not None and (isinstance(self.rope_factor, bool) or not isinstance(
                self.rope_factor, (int, float)) or not self.rope_factor > 1):
            raise RecipeError(f"eval.long_context.rope_factor must be a number > 1 or null, got {self.rope_factor!r}")


def long_spec(data: Any) -> LongSpec | None:
    """``eval.long_context`` as a :class:`LongSpec` (None when not set), or a ``RecipeError``."""
    if data is None:
        return None
    if isinstance(data, LongSpec):
        return data
    if not isinstance(data, dict):
        raise RecipeError(f"eval.long_context must be a mapping, got {data!r}")
    fields = [f.name for f in dataclasses.fields(LongSpec)]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise RecipeError(f"eval.long_context: unknown field(s) {unknown}: choose from {fields}")
    return LongSpec(**data)


@dataclasses.dataclass
class EvalSpec:
    """Evaluation and sampling: metrics' ``epsilon``, prompts for matched sampling, the heatmap sentence;
    ``curve_every`` (null: no curves): held-out loss and exact attention zeros on the first ``curve_blocks``
    held-out blocks before training and every ``curve_every`` steps (:mod:`.curves`); ``long_context`` (null:
    none): the evaluation at length of :mod:`.long_context` (causal LM, ``compare``)."""

    epsilon: float = 1e-6
    batch_size: int = 8
    prompts: list[str] = dataclasses.field(default_factory=lambda: ["The secret of a happy life is"])
    max_new_tokens: int = 32
    seed: int = 0
    heatmap_text: str = "Anything that can go wrong will go wrong, and at the worst possible moment."
    heatmap_layer: int = -1
    heatmap_head: int = 0
    curve_every: int | None = None
    curve_blocks: int = 8
    long_context: Any = None

    def __post_init__(self) -> None:
        self.long_context = long_spec(self.long_context)
        for name in ("curve_every", "curve_blocks"):
            value = getattr(self, name)
            if (value is not None or name == "curve_blocks") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise RecipeError(f"eval.{name} must be a positive integer{' or null' * (name == 'curve_every')}, "
                                  f"got {value!r}")
        if isinstance(self.prompts, str):
            self.prompts = [self.prompts]
        if not self.prompts or not all(isinstance(p, str) for p in self.prompts):
            raise RecipeError("eval.prompts must be a non-empty list of strings")
        if not float(self.epsilon) > 0:
            raise RecipeError(f"eval.epsilon must be > 0, got {self.epsilon!r}")


@dataclasses.dataclass
class Variant:
    """One trained model of a comparison: its attention, loss and training overrides.

    ``alpha_learning_rate`` (with ``attn_options.learn_alpha``): the learning rate of the learned alphas, in an
    optimizer group of their own without weight decay, as "Adaptively Sparse Transformers" trains them; at a
    fine-tuning rate an alpha near 1 barely moves (``d alpha / d a = sigmoid'(a)`` is 0.05 at alpha 1.05).
    ``null``: the training learning rate. ``scale_learning_rate`` (with ``attn_options.length_scale`` or
    ``learn_temperature``): the same for the learned query scales (:func:`hf_sparsemax.query_scale_parameters`:
    ASEntmax's length scale ``delta, beta, gamma``, learned temperatures); at a LoRA rate the length scale barely
    moves in a short conversion (``recipes/convert_long.yaml``).

    Converting a softmax model (``recipes/convert.yaml``): ``alpha_schedule`` (``{share, start}``, or ``{}``
    for the defaults): :class:`hf_sparsemax.AlphaScheduleCallback`, alpha from ``start`` to the attention's
    target over ``share`` of the steps; ``distill`` (``{weight, share}``): :class:`hf_sparsemax.SelfDistillation`,
    the model's own softmax attention outputs (adapter off) matched during the first ``share`` of the steps
    (needs ``lora``); ``calibrate`` (a number of training batches, with ``attn_options.temperature``): the
    per-head temperatures fitted on them by :func:`hf_sparsemax.calibrate_attention` before training;
    ``transfer`` (``{blocks, block_size, steps, learning_rate, rows_per_batch, dense_heads, dense_alpha,
    by_group, min_alpha}``, each optional): :func:`hf_sparsemax.transfer_attention` before training, on ``blocks`` blocks
    of ``block_size`` tokens (a multiple of ``data.block_size``, never shorter: consecutive training blocks
    joined). ``null``: off.
    """

    name: str
    attn: str | None = None
    attn_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    loss: str | None = None
    loss_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    training: dict[str, Any] = dataclasses.field(default_factory=dict)
    alpha_learning_rate: float | None = None
    scale_learning_rate: float | None = None
    alpha_schedule: dict[str, Any] | None = None
    distill: dict[str, Any] | None = None
    calibrate: int | None = None
    transfer: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.check_conversion()
        options = self.attn_options or {}
        for key, learns, what in (("alpha_learning_rate", options.get("learn_alpha"),
                                   "of learned alphas: set attn_options.learn_alpha"),
                                  ("scale_learning_rate", options.get("length_scale") or options.get("learn_temperature"),
                                   "of learned query scales: set attn_options.length_scale or learn_temperature")):
            rate = getattr(self, key)
            if rate is None:
                continue
            try:
                rate = float(rate) if not isinstance(rate, bool) else None  # YAML reads 5e-2 (no dot) as a string
            except (TypeError, ValueError):
                rate = None
            if rate is None or not math.isfinite(rate) or rate <= 0:
                raise ValueError(f"{key} must be a number > 0 or null, got {getattr(self, key)!r}")
            if not learns:
                raise ValueError(f"{key} is the learning rate {what} to true, or drop it")
            setattr(self, key, rate)

    def check_transfer(self) -> None:
        """``transfer``: null or a mapping of :data:`TRANSFER_FIELDS` (the values checked as the recipe loads)."""
        if self.transfer is None:
            return
        spec = self.transfer
        if not isinstance(spec, dict) or set(spec) - set(TRANSFER_FIELDS):
            raise ValueError(f"transfer must be null or a mapping of {list(TRANSFER_FIELDS)}, got {spec!r}")
        if not (self.attn_options or {}).get("temperature"):
            raise ValueError("transfer fits per-head temperatures: set attn_options.temperature to true")
        if self.calibrate is not None:
            raise ValueError("transfer starts from the calibration's grid itself: drop calibrate")
        for key in ("blocks", "block_size"):
            value = spec.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"transfer.{key} must be a positive integer, got {value!r}")
        from ..conversion.transfer import check_arguments

        check_arguments(**{k: v for k, v in spec.items() if k not in ("blocks", "block_size")})

    def check_conversion(self) -> None:
        """``alpha_schedule`` / ``distill``: null or a mapping of the callback's / term's own arguments."""
        from ..conversion import AlphaScheduleCallback, SelfDistillation

        for key, cls, names in (("alpha_schedule", AlphaScheduleCallback, ("share", "start")),
                                ("distill", SelfDistillation, ("weight", "share", "logit_weight", "logit_temperature"))):
            spec = getattr(self, key)
            if spec is None:
                continue
            if not isinstance(spec, dict) or set(spec) - set(names):
                raise ValueError(f"{key} must be null or a mapping of {list(names)}, got {spec!r}")
            cls(**spec)  # validates the values
        if self.calibrate is not None and (isinstance(self.calibrate, bool) or not isinstance(self.calibrate, int)
                                           or self.calibrate < 1):
            raise ValueError(f"calibrate must be a number of training batches (>= 1) or null, got {self.calibrate!r}")
        if self.calibrate is not None and not (self.attn_options or {}).get("temperature"):
            raise ValueError("calibrate fits per-head temperatures: set attn_options.temperature to true")
        self.check_transfer()
        if self.alpha_schedule is not None and self.attn not in ("sparsemax", "entmax15", "entmax_bisect"):
            raise ValueError(f"alpha_schedule anneals alpha-entmax: attn must be sparsemax, entmax15 or "
                             f"entmax_bisect, not {self.attn!r}")

    @property
    def settings(self) -> SparseSettings:
        return SparseSettings(attn=self.attn, attn_options=self.attn_options, loss=self.loss,
                              loss_options=self.loss_options)

    def describe(self) -> str:
        def part(name, options):
            return (name or "default") + ("(" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")" if options else "")
        return f"attn={part(self.attn or 'softmax', self.attn_options)} loss={part(self.loss or 'cross_entropy', self.loss_options)}"


@dataclasses.dataclass
class Recipe:
    """A whole recipe. ``model``: ``"smollm2"`` / ``"minilm"`` (offline assets), a model id, a folder or a .gguf."""

    name: str = "recipe"
    task: str = "causal_lm"
    model: str = "smollm2"
    data: DataSpec = dataclasses.field(default_factory=DataSpec)
    attn: str | None = "softmax"
    attn_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    loss: str | None = "cross_entropy"
    loss_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    lora: dict[str, Any] | None = None
    training: dict[str, Any] = dataclasses.field(default_factory=dict)
    eval: EvalSpec = dataclasses.field(default_factory=EvalSpec)
    variants: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    seeds: list[int] | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise RecipeError(f"task must be one of {list(TASKS)}, got {self.task!r}")
        if not isinstance(self.model, str) or not self.model:
            raise RecipeError(f"model must be a model id, folder, .gguf file, 'smollm2' or 'minilm', got {self.model!r}")
        self.training = {**TRAINING_DEFAULTS, **(self.training or {})}
        check_training("training", self.training)
        if self.lora is not None:
            check_keys("lora", self.lora, lora_fields())
        self.seeds = check_seeds(self.seeds)
        if not isinstance(self.variants, dict):
            raise RecipeError("variants must be a mapping from a name to {attn, attn_options, loss, loss_options, "
                              "training, alpha_learning_rate, scale_learning_rate, alpha_schedule, distill, calibrate, "
                              "transfer}")
        for variant in self.all_variants():  # validates names, options and training overrides of every variant
            size = (variant.transfer or {}).get("block_size")
            if size is not None and self.data.block_size and (size < self.data.block_size or size % self.data.block_size):
                raise RecipeError(f"variants.{variant.name}.transfer.block_size={size}: the transfer's blocks join "
                                  f"whole training blocks and are never shorter than the blocks the model trains on: "
                                  f"a multiple of data.block_size={self.data.block_size}")
            if variant.distill is not None and self.lora is None:
                raise RecipeError(f"variants.{variant.name}.distill: self-distillation's teacher is the base model "
                                  "with the LoRA adapter disabled; set `lora` (or drop distill)")
            if variant.loss not in (None, "cross_entropy"):
                try:
                    registry.check_head(registry.get(variant.loss), self.task)
                except ValueError as error:
                    raise RecipeError(f"variants.{variant.name}: {error}") from None

    def all_variants(self) -> list[Variant]:
        """The variants to compare, in recipe order (the recipe's own settings alone when it names none)."""
        base = {"attn": self.attn, "attn_options": self.attn_options, "loss": self.loss,
                "loss_options": self.loss_options}
        if not self.variants:
            return [Variant("base", **copy.deepcopy(base))]
        out = []
        for name, spec in self.variants.items():
            spec = spec or {}
            if not isinstance(spec, dict):
                raise RecipeError(f"variants.{name} must be a mapping, got {spec!r}")
            check_keys(f"variants.{name}", spec, [f.name for f in dataclasses.fields(Variant) if f.name != "name"])
            merged = {**copy.deepcopy(base), **copy.deepcopy(spec)}
            merged["training"] = merged.get("training") or {}
            check_training(f"variants.{name}.training", merged["training"])  # numbers coerced in the copy used
            if "attn" in spec and "attn_options" not in spec:
                merged["attn_options"] = {}
            if "loss" in spec and "loss_options" not in spec:
                merged["loss_options"] = {}
            try:
                variant = Variant(str(name), **merged)
                variant.settings
            except ValueError as error:
                raise RecipeError(f"variants.{name}: {error}") from None
            out.append(variant)
        return out

    def runs(self) -> list[tuple[str, Variant]]:
        """``(folder name, variant)`` for every run of ``compare``: one per variant, or with ``seeds`` one per
        variant and seed (folder ``<variant>-seed<seed>``, the variant's ``training.seed`` set to the seed)."""
        if self.seeds is None:
            return [(v.name, v) for v in self.all_variants()]
        return [(f"{v.name}-seed{seed}", dataclasses.replace(v, training={**v.training, "seed": seed}))
                for v in self.all_variants() for seed in self.seeds]

    def variant(self, name: str | None) -> Variant:
        variants = self.all_variants()
        if name is None:
            return variants[0]
        for variant in variants:
            if variant.name == name:
                return variant
        raise RecipeError(f"no variant {name!r} in recipe {self.name!r}: choose one of {[v.name for v in variants]}")

    def training_args(self, variant: Variant) -> dict[str, Any]:
        return {**self.training, **variant.training}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def training_fields() -> list[str]:
    from transformers import TrainingArguments

    return [f.name for f in dataclasses.fields(TrainingArguments) if f.init and f.name != "output_dir"]


def check_training(where: str, training: dict[str, Any]) -> None:
    """Known TrainingArguments fields; numbers and booleans where the field's default is one (in place).

    YAML reads ``5e-4`` (no dot) as a string: such strings become numbers here.
    Numbers must lie in :data:`TRAINING_RANGES` (checked here, before any model loads).
    """
    from transformers import TrainingArguments

    check_keys(where, training, training_fields())
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    for key, value in training.items():
        default = defaults.get(key)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise RecipeError(f"{where}.{key} must be true or false, got {value!r}")
        elif isinstance(default, (int, float)) and value is not None:
            kind = float if isinstance(default, float) else int
            try:
                number = kind(value) if not isinstance(value, bool) else None
            except (TypeError, ValueError):
                number = None
            if number is None or (kind is int and isinstance(value, float) and value != number):
                raise RecipeError(f"{where}.{key} must be {'a number' if kind is float else 'an integer'}, "
                                  f"got {value!r}")
            training[key] = number
            valid, expected = TRAINING_RANGES.get(key, (lambda v: True, ""))
            if not math.isfinite(number) or not valid(number):
                raise RecipeError(f"{where}.{key} must be {expected or 'finite'}, got {value!r}")


def check_seeds(seeds: Any) -> list[int] | None:
    """``seeds``: ``null`` or a non-empty list of distinct integers in [0, 2**32)."""
    if seeds is None:
        return None
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        seeds = [seeds]
    if (not isinstance(seeds, (list, tuple)) or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**32 for s in seeds)):
        raise RecipeError(f"seeds must be null or a non-empty list of integers in [0, 2**32), e.g. [0, 1, 2]; "
                          f"got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise RecipeError(f"seeds must be distinct (each seed is one run per variant), got {list(seeds)!r}")
    return list(seeds)


def lora_fields() -> list[str]:
    from .extras import require

    require(["peft"], "a recipe with `lora` (null: full fine-tuning)")
    from peft import LoraConfig

    return [f.name for f in dataclasses.fields(LoraConfig) if f.init]


def check_keys(where: str, data: Any, allowed) -> None:
    if not isinstance(data, dict):
        raise RecipeError(f"{where} must be a mapping, got {data!r}")
    unknown = sorted(set(map(str, data)) - set(allowed))
    if unknown:
        guesses = [match for name in unknown for match in difflib.get_close_matches(name, sorted(allowed), n=1)]
        hint = f" (did you mean {', '.join(map(repr, guesses))}?)" if guesses else ""
        raise RecipeError(f"unknown field(s) {unknown} in {where}{hint}: valid are {', '.join(sorted(allowed))}")


def shipped_recipes() -> list[str]:
    """Names of the recipes that ship inside the package (``hf-sparsemax compare <name>``)."""
    if not os.path.isdir(RECIPE_DIR):
        return []
    return sorted(f.removesuffix(".yaml") for f in os.listdir(RECIPE_DIR) if f.endswith(".yaml"))


def resolve_path(spec: str) -> str:
    """A recipe file: a path, or a name (``default``) in ``./recipes/`` or among the shipped recipes."""
    if os.path.exists(spec):
        return spec
    for folder in ("recipes", RECIPE_DIR):
        for candidate in (os.path.join(folder, spec), os.path.join(folder, spec + ".yaml")):
            if os.path.isfile(candidate):
                return candidate
    raise RecipeError(f"recipe {spec!r} not found: give a YAML file path or the name of a shipped recipe "
                      f"({', '.join(shipped_recipes())})")


def apply_override(data: dict[str, Any], text: str) -> None:
    """Apply one ``PATH=VALUE`` override (VALUE read as YAML) to the raw recipe dict, in place."""
    if "=" not in text:
        raise RecipeError(f"--set expects PATH=VALUE (e.g. training.max_steps=20), got {text!r}")
    path, raw = text.split("=", 1)
    keys = [k for k in path.strip().split(".")]
    if not all(keys):
        raise RecipeError(f"--set: bad field path {path!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as error:
        raise RecipeError(f"--set {path}: value {raw!r} is not valid YAML ({one_line(error)})") from None
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"--set {path}: {key!r} holds {child!r}, not a mapping")
        node = child
    node[keys[-1]] = value


def load_recipe(spec: str, overrides: list[str] = ()) -> Recipe:
    """Read, override and validate a recipe; raises :class:`RecipeError` with a one-line message."""
    path = resolve_path(spec)
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except yaml.YAMLError as error:
        raise RecipeError(f"recipe {path} is not valid YAML: {one_line(error)}") from None
    except OSError as error:
        raise RecipeError(f"cannot read recipe {path}: {error.strerror}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path} must be a YAML mapping of fields, got {type(data).__name__}")
    data.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    for text in overrides:
        apply_override(data, text)
    return recipe_from_dict(data)


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    check_keys("the recipe", data, [f.name for f in dataclasses.fields(Recipe)])
    data = dict(data)
    try:
        for key, cls in (("data", DataSpec), ("eval", EvalSpec)):
            section = data.get(key) or {}
            check_keys(key, section, [f.name for f in dataclasses.fields(cls)])
            data[key] = cls(**section)
        return Recipe(**data)
    except RecipeError:
        raise
    except (TypeError, ValueError) as error:
        raise RecipeError(one_line(error)) from None


def one_line(error: BaseException | str) -> str:
    return " ".join(str(error).split())
