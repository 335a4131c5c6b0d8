"""What a decoding step's attention works out once for all the model's layers.

A decoding step calls the attention once per layer. The operands differ from layer to layer (each layer's query,
keys and values), but part of what the call works out around the kernel does not: the mapping's path (whether a
threshold mapping serves the call, its options and fixed alpha, whether float32 computes it exactly:
:func:`hf_sparsemax.attention.interface.threshold_path`) and the mask's analysis (whether the mask hides every slot
of a static cache past the filled length: :func:`.pages.filled_part`). Each is a function of a few arguments. A
:class:`Memo` keeps its function's last value beside the arguments it was computed from, and gives it back to a
call whose arguments are the same objects (``is``, held by weak reference: the model's options object, the mask
tensor itself, never one merely equal to it; a reference whose object was freed matches no call, not even one
without such an object) with the same values (dtypes, lengths, the mask's in-place version
counter). So the first layer of a step computes and the other layers reuse; the next step reuses what did not
change (the options) and computes again what did (the mask transformers makes anew each step, a static cache's
filled length, a mask written in place, a crop). A reused value is the one the call would have computed: the
arguments are the whole of what it is computed from.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


def reference(obj: Any):
    """A weak reference to ``obj``, or ``obj`` itself where it takes none (None, a string: held, so never freed)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return obj


def same(held, obj: Any) -> bool:
    """Whether ``held`` (from :func:`reference`) refers to ``obj`` itself. A reference whose object was freed
    refers to nothing: it is not ``obj``, whatever ``obj`` is (None included, as a model without options passes)."""
    if isinstance(held, weakref.ref):
        target = held()
        return target is not None and target is obj
    return held is obj


class Memo:
    """``Memo(function)(objects, values)`` is ``function(*objects, *values)``, computed again only where the
    objects are not the last call's (the same objects, by identity) or the values differ (``==``)."""

    def __init__(self, function: Callable) -> None:
        self.function = function
        self.last = None  # (weak references to the objects, the values, the result)
        self.computed = 0  # calls that computed (a test's count of the reuse)

    def __call__(self, objects: tuple, values: tuple):
        last = self.last
        if (last is not None and last[1] == values and len(last[0]) == len(objects)
                and all(same(held, obj) for held, obj in zip(last[0], objects))):
            return last[2]
        result = self.function(*objects, *values)
        self.computed += 1
        self.last = (tuple(reference(obj) for obj in objects), values, result)
        return result

    def clear(self) -> None:
        self.last = None
