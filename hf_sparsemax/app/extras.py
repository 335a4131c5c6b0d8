"""The optional packages each command path needs, checked before anything loads or is written.

``pip install hf-sparsemax`` installs the library and the ``hf-sparsemax`` command; the recipes also need the
``recipes`` extra (datasets, peft, matplotlib, gguf). A command whose packages are missing stops at once with one
line naming the install command (exit 2), instead of a traceback after minutes of training.
"""

from __future__ import annotations

import importlib.util

EXTRAS = {"datasets": "recipes", "peft": "recipes", "matplotlib": "recipes", "gguf": "offline"}


class MissingExtra(ValueError):
    """Packages a command needs are not installed; the message names the extra that brings them."""


def require(packages: list[str], what: str, extra: str | None = None) -> None:
    """Raise :class:`MissingExtra` if any of ``packages`` cannot be imported (looked up, not imported)."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        extra = extra or EXTRAS[missing[0]]
        raise MissingExtra(f"{what} needs {', '.join(missing)}, not installed here: "
                           f'pip install "hf-sparsemax[{extra}]"')


def offline_gguf(model: str | None) -> bool:
    """Whether a model spec loads from a GGUF file (the offline SmolLM2 is one), which transformers reads with gguf."""
    return model is None or model == "smollm2" or model.endswith(".gguf")
