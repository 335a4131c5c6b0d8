"""The registry of mappings: every mapping once, with what each swap point needs to know about it.

An entry says, for one name: its mapping function, its options (one frozen
dataclass per mapping, validated in ``__post_init__``, a ``ValueError`` with
one sentence on bad input), its row solver, its support routine (sparse
mappings: what the fused head loss reads), its loss (a Fenchel-Young alpha or
another rule) and the swap points it supports:

- ``attention``: ``patch_model(attn=name)`` / ``attn_implementation=name``;
  ``attention_options`` names the mapping options attention accepts (besides
  ``chunk_size``, and ``learn_alpha`` for a mapping with an ``alpha``);
- ``loss``: ``patch_model(loss=name)``, ``compute_loss_func``, recipes;
- ``fused``: ``loss_options={"fused": True}`` (needs a sparse support);
- ``processor``: matched decoding, ``logits_processors(model)``;
- ``head="cosine"``: the loss needs a cosine classification head.

An entry whose slices do not lie on the probability simplex (``simplex=False``:
``budget_bisect``, which sums to its budget) is a mapping only: no loss, no decoding,
no metrics. Every entry also gets ``nn.Module`` forms (:mod:`hf_sparsemax.mappings.modules`),
named ``class_name`` and ``class_name + "Loss"``.

``keeps_argmax`` says whether ``argmax(p) == argmax(x)`` always holds (Taylor
softmax's polynomial is not monotone): what a serving engine needs to know to
order its sampling steps.

A swap point an entry does not support has a sentence in ``refusals`` saying
why; that sentence is the ``ValueError`` a user sees. Attention names, loss
names, processors, the fused head, ``SparseSettings``, recipes and the CLI all
read this table, so adding a mapping is its module, one entry here and its
tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import torch

from . import likelihood
from . import loss_functions as losses
from . import margin
from .entmax import check_alpha, entmax15, entmax15_rows, entmax15_support, entmax_bisect, entmax_bisect_rows
from .entmax import entmax15_threshold, entmax_bisect_support, entmax_bisect_threshold
from .budget import budget_bisect, budget_rows, check_budget
from .normmax import normmax_bisect, normmax_rows
from .perturb import DEFAULT_POINTS, MAX_CLASSES, check_perturb, perturb_log_rows, perturb_max
from .sparse_softmax import check_top, sparse_softmax, sparse_softmax_rows, sparse_softmax_support
from .sparsemax import sparsemax, sparsemax_rows, sparsemax_support, sparsemax_threshold
from .taylor import check_order, taylor_rows, taylor_softmax

SWAP_POINTS = ("attention", "loss", "fused", "processor")
TASKS = ("causal_lm", "sequence_classification", "token_classification")


# ---- options: one validated dataclass per mapping -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SparsemaxOptions:
    """sparsemax takes no options."""


@dataclasses.dataclass(frozen=True)
class Entmax15Options:
    """entmax15 takes no options."""


@dataclasses.dataclass(frozen=True)
class EntmaxBisectOptions:
    """``alpha``: a float > 1, or (losses) a tensor of them."""

    alpha: float | torch.Tensor = 1.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", check_alpha(self.alpha))


@dataclasses.dataclass(frozen=True)
class NormmaxBisectOptions:
    """``alpha``: a float > 1 (any: alpha > 2 too), or (the mapping, attention) a tensor of them."""

    alpha: float | torch.Tensor = 2.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", check_alpha(self.alpha))


@dataclasses.dataclass(frozen=True)
class BudgetBisectOptions:
    """``budget``: a float > 0 (the sum of every slice), or a tensor of them."""

    budget: float | torch.Tensor = 2.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", check_budget(self.budget))


@dataclasses.dataclass(frozen=True)
class SparseSoftmaxOptions:
    """``top_k`` (a positive int) and / or ``top_p`` (in (0, 1]); neither: softmax."""

    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        top_k, top_p = check_top(self.top_k, self.top_p)
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "top_p", top_p)


@dataclasses.dataclass(frozen=True)
class TaylorSoftmaxOptions:
    """``order``: a positive even integer."""

    order: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", check_order(self.order))


@dataclasses.dataclass(frozen=True)
class PerturbMaxOptions:
    """``noise``: ``"gaussian"`` or ``"gumbel"``; ``points``: quadrature nodes (>= 2)."""

    noise: str = "gaussian"
    points: int = DEFAULT_POINTS

    def __post_init__(self) -> None:
        check_perturb(self.noise, self.points)
        object.__setattr__(self, "points", int(self.points))


@dataclasses.dataclass(frozen=True)
class AMSoftmaxOptions:
    """``margin`` in [0, 2) (cosine units) and ``scale`` > 0."""

    margin: float = 0.35
    scale: float = 30.0

    def __post_init__(self) -> None:
        m, s = margin.check_margin(self.margin, self.scale)
        object.__setattr__(self, "margin", m)
        object.__setattr__(self, "scale", s)


def option_values(options: Any) -> dict[str, Any]:
    """An options object as keyword arguments (tensors kept as they are, not copied)."""
    return {field.name: getattr(options, field.name) for field in dataclasses.fields(options)}


# ---- entries -------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Mapping:
    """One registry entry (see the module docstring)."""

    name: str
    options: type
    function: Callable[..., torch.Tensor]  # function(x, dim=-1, **options): the distribution, along dim
    rows: Callable[..., Any]  # row solver on [rows, n] float rows: rows(rows, masked, options) -> p (or log p)
    loss: Callable[..., torch.Tensor] | None  # loss(logits, target, **options, ignore_index=, reduction=), or None
    loss_rule: str  # "fenchel_young", "kept_logsumexp" (Su's sparse softmax), "nll" (-log p_t), "margin", "none"
    alpha: float | str | None = None  # Fenchel-Young alpha, or the name of the option holding it
    support: Callable[..., Any] | None = None  # support(rows, masked, options) -> (index, p, tau) [rows, K]
    # threshold mappings: threshold(rows, masked, alpha) -> (shift, tau), [rows, 1] each, with
    # p = relu((alpha - 1)(x - shift) - tau) ** (1 / (alpha - 1)); alpha a float or [rows, 1] (blocked attention)
    threshold: Callable[..., Any] | None = None
    attention_options: tuple[str, ...] | None = None  # None: not an attention
    fused: bool = False
    processor: bool = True
    head: str | None = None
    tasks: tuple[str, ...] = TASKS
    max_classes: int | None = None  # largest label set / vocabulary the loss accepts (cost grows faster than n)
    keeps_argmax: bool = True  # argmax(p) == argmax(x) for every x (a serving engine may skip it for greedy decoding)
    refusals: dict[str, str] = dataclasses.field(default_factory=dict)
    simplex: bool = True  # slices on the probability simplex: what losses, decoding and metrics need
    module_name: str | None = None  # the nn.Module's class name, when not the CamelCase of ``name``

    @property
    def class_name(self) -> str:
        """The name of the ``nn.Module`` form (``EntmaxBisect``; its loss module adds ``Loss``)."""
        return self.module_name or "".join(part[:1].upper() + part[1:] for part in self.name.split("_"))

    @property
    def swap_points(self) -> tuple[str, ...]:
        supported = {"attention": self.attention_options is not None, "loss": self.loss is not None,
                     "fused": self.fused,
                     "processor": self.processor}
        return tuple(point for point in SWAP_POINTS if supported[point])

    def refuse(self, point: str) -> ValueError:
        reason = self.refusals.get(point, f"{self.name!r} does not support {point}")
        return ValueError(reason)

    def parse(self, options: dict[str, Any] | None, allowed: tuple[str, ...] | None = None, what: str = "options"):
        """Validated options object from a dict; ``allowed`` restricts the names (default: all fields)."""
        options = dict(options or {})
        names = tuple(f.name for f in dataclasses.fields(self.options)) if allowed is None else allowed
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ValueError(f"{unknown} are not {what} of {self.name!r}; it takes {list(names) or 'none'}")
        return self.options(**options)

    def fenchel_young_alpha(self, options) -> float | torch.Tensor | None:
        return getattr(options, self.alpha) if isinstance(self.alpha, str) else self.alpha

    def distribution(self, options) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> p`` along the last dim with these options: what the loss trains and decoding samples."""
        values = option_values(options)
        return lambda x: self.function(x, **values)


def _entries() -> dict[str, Mapping]:
    dense = ("{} has dense support (every class gets p > 0), so the fused head loss would cost the full "
             "[tokens, vocab] gradient it exists to avoid: drop fused (the unfused loss is exact)")
    off_simplex = ("budget_bisect is no probability distribution (its slices sum to budget, each entry in [0, 1]), "
                   "so it has no loss against one target class: use it as a layer, or sparsemax_loss (budget 1)")
    entries = [
        Mapping("sparsemax", SparsemaxOptions, sparsemax,
                rows=lambda rows, masked, o: sparsemax_rows(rows, masked)[0],
                loss=losses.sparsemax_loss, loss_rule="fenchel_young", alpha=2.0,
                support=lambda rows, masked, o: sparsemax_support(rows, masked),
                threshold=lambda rows, masked, alpha: sparsemax_threshold(rows, masked),
                attention_options=(), fused=True),
        Mapping("entmax15", Entmax15Options, entmax15,
                rows=lambda rows, masked, o: entmax15_rows(rows, masked)[0],
                loss=losses.entmax15_loss, loss_rule="fenchel_young", alpha=1.5,
                support=lambda rows, masked, o: entmax15_support(rows, masked),
                threshold=lambda rows, masked, alpha: entmax15_threshold(rows, masked),
                attention_options=(), fused=True),
        Mapping("entmax_bisect", EntmaxBisectOptions, entmax_bisect,
                rows=lambda rows, masked, o: entmax_bisect_rows(rows, o.alpha, masked)[0],
                loss=losses.entmax_bisect_loss, loss_rule="fenchel_young", alpha="alpha",
                support=lambda rows, masked, o: entmax_bisect_support(rows, o.alpha, masked),
                threshold=lambda rows, masked, alpha: entmax_bisect_threshold(rows, alpha, masked),
                attention_options=("alpha",), fused=True),
        Mapping("normmax_bisect", NormmaxBisectOptions, normmax_bisect,
                rows=lambda rows, masked, o: normmax_rows(rows, o.alpha, masked)[0],
                loss=losses.normmax_bisect_loss, loss_rule="fenchel_young", attention_options=("alpha",),
                refusals={"fused": "the fused head loss computes entmax (Tsallis) Fenchel-Young losses, not "
                                   "normmax_bisect's: drop fused (the unfused normmax_bisect loss is exact)"}),
        Mapping("budget_bisect", BudgetBisectOptions, budget_bisect,
                rows=lambda rows, masked, o: budget_rows(rows, o.budget, masked),
                loss=None, loss_rule="none", processor=False, simplex=False, refusals={
                    "loss": off_simplex,
                    "processor": "budget_bisect is no probability distribution (its slices sum to budget), so "
                                 "there is nothing to sample from: decode with sparsemax (budget 1)",
                    "attention": "budget_bisect weights sum to budget, not 1, so as attention they would scale "
                                 "every output by budget: use sparsemax attention (budget 1)",
                    "fused": off_simplex,  # the fused head is a loss too
                }),
        Mapping("sparse_softmax", SparseSoftmaxOptions, sparse_softmax,
                rows=lambda rows, masked, o: sparse_softmax_rows(rows, o.top_k, o.top_p, masked),
                loss=losses.sparse_softmax_loss, loss_rule="kept_logsumexp",
                support=lambda rows, masked, o: sparse_softmax_support(rows, o.top_k, o.top_p, masked),
                attention_options=("top_k",), fused=True),
        Mapping("taylor_softmax", TaylorSoftmaxOptions, taylor_softmax,
                rows=lambda rows, masked, o: taylor_rows(rows, o.order, masked)[0],
                loss=likelihood.taylor_softmax_loss, loss_rule="nll",
                attention_options=("order",), keeps_argmax=False,  # f(t) = 1 + t + t^2/2 + ... is not monotone
                refusals={"fused": dense.format("taylor_softmax")}),
        Mapping("perturb_max", PerturbMaxOptions, perturb_max,
                rows=lambda rows, masked, o: perturb_log_rows(rows, o.noise, o.points, masked).exp(),
                loss=likelihood.perturb_max_loss, loss_rule="nll", max_classes=MAX_CLASSES,
                refusals={
                    "fused": dense.format("perturb_max"),
                    "attention": "perturb_max is not an attention: it costs `points` (default 256) softmaxes per "
                                 "row and keeps [rows, keys, points] for backward, with no sparse support to "
                                 "exploit; use it as a loss or a classification head's distribution",
                }),
        Mapping("am_softmax", AMSoftmaxOptions, margin.am_softmax,
                rows=lambda rows, masked, o: torch.softmax(o.scale * rows, -1),
                loss=margin.am_softmax_loss, loss_rule="margin", head="cosine", module_name="AMSoftmax",
                tasks=("sequence_classification",),
                refusals={
                    "fused": "am_softmax is a sequence-classification loss on a cosine head; the fused head loss "
                             "is for causal LMs: drop fused",
                    "attention": "am_softmax is a loss on a cosine classification head, not an attention",
                }),
    ]
    return {entry.name: entry for entry in entries}


REGISTRY: dict[str, Mapping] = _entries()


def get(name: str) -> Mapping:
    """The entry of a registered name, or a ``ValueError`` listing the names."""
    entry = REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"unknown mapping {name!r}: choose one of {list(REGISTRY)}")
    return entry


def names(point: str | None = None) -> tuple[str, ...]:
    """Registered names, or those that support one swap point (``"attention"``, ``"loss"``, ...)."""
    if point is not None and point not in SWAP_POINTS:
        raise ValueError(f"swap point must be one of {SWAP_POINTS}, got {point!r}")
    return tuple(name for name, entry in REGISTRY.items() if point is None or point in entry.swap_points)


def attention_entry(name: str) -> Mapping:
    """The entry of a sparse attention name, or a ``ValueError`` naming the attentions."""
    entry = REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"unknown attention {name!r}: choose one of {['softmax', *names('attention')]}")
    if entry.attention_options is None:
        raise entry.refuse("attention")
    return entry


class LossOptions(NamedTuple):
    """A loss name's validated ``loss_options``: its entry, its mapping options object and ``fused``."""

    entry: Mapping
    options: Any
    fused: bool


def loss_options(name: str, options: dict[str, Any] | None) -> LossOptions:
    """The entry, validated mapping options and ``fused`` of a loss name and its ``loss_options``."""
    entry = REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"unknown loss {name!r}: choose one of {['cross_entropy', *names('loss')]}")
    if entry.loss is None:
        raise entry.refuse("loss")
    options = dict(options or {})
    fused = options.pop("fused", False)
    if not isinstance(fused, bool):
        raise ValueError("loss option fused must be True or False")
    fields = tuple(f.name for f in dataclasses.fields(entry.options))
    parsed = entry.parse(options, fields + ("fused",), what="options of loss")
    if fused and not entry.fused:
        raise entry.refuse("fused")
    return LossOptions(entry, parsed, fused)


def mapping_function(mapping: str | Callable, **options) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> p`` along the last dim from a registered name (with its options) or a callable (no options)."""
    if callable(mapping):
        if options:
            raise ValueError(f"options {sorted(options)} are for a mapping given by name; bind them into the callable")
        return mapping
    entry = get(mapping)
    if not entry.simplex:
        raise ValueError(f"{entry.name!r} gives no probability distribution, which losses, decoding and metrics "
                         "need: " + entry.refusals.get("processor", "choose another mapping"))
    return entry.distribution(entry.parse(options))


def check_head(entry: Mapping, task: str, classes: int | None = None) -> None:
    """Refuse a loss on a head it is not for: another task, or more classes than ``max_classes``."""
    if task not in entry.tasks:
        raise ValueError(f"loss {entry.name!r} is for {' / '.join(entry.tasks)} heads, not {task}")
    if entry.max_classes is not None and classes is not None and classes > entry.max_classes:
        raise ValueError(f"loss {entry.name!r} supports at most {entry.max_classes} classes and this head has "
                         f"{classes}: use sparsemax, entmax15 or sparse_softmax for large label sets and vocabularies")
