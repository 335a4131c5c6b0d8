"""``nn.Module`` forms of every mapping and every loss, generated from the registry of mappings.

For each registry entry ``name`` (its ``class_name``, e.g. ``EntmaxBisect``):

- the mapping module takes the mapping's options, then ``dim``, then the function's other keywords
  (``EntmaxBisect(alpha=1.5, dim=-1, n_iter=None)``, ``Sparsemax(dim=-1, k=None)``,
  ``SparseSoftmax(top_k=None, top_p=None, dim=-1)``) and its ``forward(x)`` is the function;
- the loss module (entries with a loss) takes the loss function's keywords
  (``NormmaxBisectLoss(alpha=2.0, ignore_index=-100, reduction="mean")``) and its
  ``forward(logits, target)`` is the loss. The four loss modules of :mod:`hf_sparsemax.mappings.loss_functions`
  (``SparsemaxLoss``, ``Entmax15Loss``, ``EntmaxBisectLoss``, ``SparseSoftmaxLoss``) are those classes.

Options are validated at construction (the registry's options dataclass: a ``ValueError``); a tensor option
that is an ``nn.Parameter`` (a learned ``alpha``) is registered as the module's parameter, another tensor
as a non-persistent buffer, so both follow ``.to(device)``. The signatures are real
(``inspect.signature(EntmaxBisect)``), one place for every default: the function's own.
The entmax package's ``SparsemaxBisect`` / ``SparsemaxBisectLoss`` (sparsemax by another solver) are here too.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import torch
from torch import nn

from . import loss_functions as losses
from .loss_functions import module_reduction, sparsemax_bisect_loss
from . import registry
from .entmax import sparsemax_bisect


def option_names(entry: registry.Mapping | None) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(entry.options)) if entry is not None else ()


def _store(module: nn.Module, values: dict[str, Any]) -> None:
    for name, value in values.items():
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            module.register_buffer(name, value, persistent=False)
        else:
            setattr(module, name, value)


class _Generated(nn.Module):
    """Shared by the generated modules: bind the constructor's arguments to ``__signature__`` and keep them."""

    __signature__: inspect.Signature
    function: Callable[..., torch.Tensor]
    entry: registry.Mapping | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()
        try:
            bound = self.__signature__.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{type(self).__name__}{self.__signature__}: {error}") from None
        bound.apply_defaults()
        values = dict(bound.arguments)
        if self.entry is not None:  # the registry's options dataclass validates (ValueError, one sentence)
            self.entry.parse({f: values[f] for f in option_names(self.entry)})
        if "reduction" in values:  # entmax's names too: "elementwise_mean" is kept as "mean"
            values["reduction"] = module_reduction(values["reduction"])
        self._names = tuple(values)
        _store(self, values)

    def arguments(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._names}

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.arguments().items()
                         if not isinstance(value, torch.Tensor))


class MappingModule(_Generated):
    """``forward(x)``: the mapping along ``dim`` with the options given at construction."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return type(self).function(x, **self.arguments())


class LossModule(_Generated):
    """``forward(logits, target)``: the loss with the options given at construction."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return type(self).function(logits, target, **self.arguments())


def mapping_module(class_name: str, function: Callable, entry: registry.Mapping | None = None) -> type:
    """The module class of ``function(x, ..., dim=-1, ...)``: its options first, then ``dim``, then the rest."""
    params = list(inspect.signature(function).parameters.values())[1:]
    options = set(option_names(entry))
    ordered = ([p for p in params if p.name in options] + [p for p in params if p.name == "dim"]
               + [p for p in params if p.name not in options and p.name != "dim"])
    signature = inspect.Signature([p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in ordered])
    doc = f"Module form of :func:`hf_sparsemax.{function.__name__}`: ``{class_name}{signature}``, ``forward(x)``."
    namespace = {"__signature__": signature, "function": staticmethod(function), "entry": entry, "__doc__": doc,
                 "__module__": __name__}
    return type(class_name, (MappingModule,), namespace)


def loss_module(class_name: str, function: Callable, entry: registry.Mapping | None = None) -> type:
    """The module class of ``function(logits, target, **keywords)``: the keywords, in the function's order."""
    params = list(inspect.signature(function).parameters.values())[2:]
    signature = inspect.Signature(params)
    doc = (f"Module form of :func:`hf_sparsemax.{function.__name__}`: ``{class_name}{signature}``, "
           "``forward(logits, target)``.")
    namespace = {"__signature__": signature, "function": staticmethod(function), "entry": entry, "__doc__": doc,
                 "__module__": __name__}
    return type(class_name, (LossModule,), namespace)


def _generate() -> tuple[dict[str, type], dict[str, type]]:
    mapping_modules, loss_modules = {}, {}
    for name, entry in registry.REGISTRY.items():
        mapping_modules[name] = mapping_module(entry.class_name, entry.function, entry)
        if entry.loss is not None:
            written = getattr(losses, entry.class_name + "Loss", None)  # the hand-written API classes stay
            loss_modules[name] = written or loss_module(entry.class_name + "Loss", entry.loss, entry)
    mapping_modules["sparsemax_bisect"] = mapping_module("SparsemaxBisect", sparsemax_bisect)
    loss_modules["sparsemax_bisect"] = loss_module("SparsemaxBisectLoss", sparsemax_bisect_loss)
    return mapping_modules, loss_modules


MAPPING_MODULES, LOSS_MODULES = _generate()  # registered name -> module class

# Named one by one (not through globals()), so that editors, type checkers and the API reference see them;
# tests/test_entmax_api.py checks that these are exactly the generated classes.
Sparsemax = MAPPING_MODULES["sparsemax"]
Entmax15 = MAPPING_MODULES["entmax15"]
EntmaxBisect = MAPPING_MODULES["entmax_bisect"]
SparsemaxBisect = MAPPING_MODULES["sparsemax_bisect"]
NormmaxBisect = MAPPING_MODULES["normmax_bisect"]
BudgetBisect = MAPPING_MODULES["budget_bisect"]
SparseSoftmax = MAPPING_MODULES["sparse_softmax"]
TaylorSoftmax = MAPPING_MODULES["taylor_softmax"]
PerturbMax = MAPPING_MODULES["perturb_max"]
AMSoftmax = MAPPING_MODULES["am_softmax"]
NormmaxBisectLoss = LOSS_MODULES["normmax_bisect"]
SparsemaxBisectLoss = LOSS_MODULES["sparsemax_bisect"]
TaylorSoftmaxLoss = LOSS_MODULES["taylor_softmax"]
PerturbMaxLoss = LOSS_MODULES["perturb_max"]
AMSoftmaxLoss = LOSS_MODULES["am_softmax"]

__all__ = sorted(cls.__name__ for cls in (*MAPPING_MODULES.values(), *LOSS_MODULES.values()))
