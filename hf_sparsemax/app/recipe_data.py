"""Recipe data: text entries from the offline fortunes, a ``datasets`` dataset or local files, split and packed.

The held-out split is decided per entry by a hash of its text (``eval_fraction``
of the hash range), so it is deterministic, independent of sizes and order,
and the same on every process of a distributed run. Entries are then shuffled
with ``data.seed``. Causal LM: each side's entries, joined by the tokenizer's
end-of-sequence token, are cut into blocks of ``block_size`` tokens.
Classification: ``train_size`` / ``eval_size`` examples per label (balanced).
"""

from __future__ import annotations

import hashlib
import os
import random

import torch

from .recipes import DataSpec, RecipeError

TEXT_SUFFIXES = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def held_out(text: str, fraction: float) -> bool:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def check_source(spec: DataSpec) -> None:
    """What can be checked of ``data.source`` without reading it (before a model loads).

    Fortune categories must exist; local files must exist and be of one kind;
    a dataset name must be one name (whether it loads is known only on loading).
    """
    from . import assets

    if spec.source == "fortunes":
        unknown = [c for c in spec.categories or [] if c not in assets.FORTUNE_FILES]
        if unknown:
            raise RecipeError(f"data.categories: unknown fortune categories {unknown}: choose from "
                              f"{list(assets.FORTUNE_FILES)}")
        return
    sources = spec.source if isinstance(spec.source, list) else [spec.source]
    local = [s for s in sources if os.path.splitext(s)[1].lower() in TEXT_SUFFIXES or os.path.exists(s)]
    if local and len(local) != len(sources):
        raise RecipeError(f"data.source mixes local files and dataset names: {sources}")
    if not local and len(sources) != 1:
        raise RecipeError(f"data.source names several datasets {sources}: give one dataset name or local files")
    missing = [p for p in local if not os.path.isfile(p)]
    if missing:
        raise RecipeError(f"data file(s) {missing} not found: fix data.source")
    kinds = {TEXT_SUFFIXES.get(os.path.splitext(p)[1].lower(), "text") for p in local}
    if len(kinds) > 1:
        raise RecipeError(f"data.source mixes file kinds {sorted(kinds)}: use one of .txt, .json/.jsonl, .csv")


def load_entries(spec: DataSpec) -> list[tuple[str, str]]:
    """``(text, label)`` pairs (label: the fortune category or the dataset's label field, "" if none)."""
    from . import assets

    if spec.source == "fortunes":
        categories = spec.categories or ["fortunes"]
        out = []
        for category in categories:
            try:
                out += [(text, category) for text in assets.fortunes(category)]
            except ValueError as error:
                raise RecipeError(f"data.categories: {error}") from None
        return out
    sources = spec.source if isinstance(spec.source, list) else [spec.source]
    local = [s for s in sources if os.path.splitext(s)[1].lower() in TEXT_SUFFIXES or os.path.exists(s)]
    if local and len(local) != len(sources):
        raise RecipeError(f"data.source mixes local files and dataset names: {sources}")
    if local:
        return load_files(local, spec)
    if len(sources) != 1:
        raise RecipeError(f"data.source names several datasets {sources}: give one dataset name or local files")
    return load_hub_dataset(sources[0], spec)


def load_files(paths: list[str], spec: DataSpec) -> list[tuple[str, str]]:
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise RecipeError(f"data file(s) {missing} not found: fix data.source")
    kinds = {TEXT_SUFFIXES.get(os.path.splitext(p)[1].lower(), "text") for p in paths}
    if len(kinds) > 1:
        raise RecipeError(f"data.source mixes file kinds {sorted(kinds)}: use one of .txt, .json/.jsonl, .csv")
    kind = kinds.pop()
    if kind == "text":
        out = []
        for path in paths:
            with open(path, encoding="utf-8", errors="replace") as handle:
                chunks = handle.read().replace("\n%\n", "\n\n").split("\n\n")
            out += [(c.strip(), "") for c in chunks if c.strip() and c.strip() != "%"]
        return out
    import datasets

    try:
        table = datasets.load_dataset(kind, data_files=paths, split="train")
    except Exception as error:  # datasets raises many types for unreadable files
        raise RecipeError(f"cannot read {paths} as {kind}: {error}") from None
    return rows(table, spec)


def load_hub_dataset(name: str, spec: DataSpec) -> list[tuple[str, str]]:
    import datasets

    try:
        table = datasets.load_dataset(name, spec.config, split=spec.split)
    except Exception as error:  # missing dataset, no network, bad config or split
        raise RecipeError(f"cannot load dataset {name!r} (config {spec.config!r}, split {spec.split!r}): "
                          f"{type(error).__name__}: {error}; fix data.source or use local files") from None
    return rows(table, spec)


def rows(table, spec: DataSpec) -> list[tuple[str, str]]:
    if spec.text_field not in table.column_names:
        raise RecipeError(f"data.text_field {spec.text_field!r} is not a column: the data has {table.column_names}")
    labels = table[spec.label_field] if spec.label_field in table.column_names else [""] * len(table)
    return [(str(t), str(l)) for t, l in zip(table[spec.text_field], labels) if t and str(t).strip()]


def split_entries(spec: DataSpec) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(train, held-out)`` entries, filtered by length, split by hash, shuffled with ``spec.seed``."""
    entries = [e for e in load_entries(spec)
               if len(e[0]) >= spec.min_chars and (spec.max_chars is None or len(e[0]) <= spec.max_chars)]
    if not entries:
        raise RecipeError(f"data.source {spec.source!r} gave no text entries (check min_chars / max_chars / fields)")
    train = [e for e in entries if not held_out(e[0], spec.eval_fraction)]
    test = [e for e in entries if held_out(e[0], spec.eval_fraction)]
    random.Random(spec.seed).shuffle(train)
    random.Random(spec.seed + 1).shuffle(test)
    return train, test


class Examples(torch.utils.data.Dataset):
    """A list of feature dicts (tensors), for ``Trainer``."""

    def __init__(self, items: list[dict[str, torch.Tensor]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


def pack(texts: list[str], tokenizer, block_size: int, count: int, where: str) -> Examples:
    """``count`` blocks of ``block_size`` tokens from ``texts`` joined by end-of-sequence tokens."""
    eos = tokenizer.eos_token_id
    needed = block_size * count
    ids: list[int] = []
    step = 256
    for start in range(0, len(texts), step):
        for encoded in tokenizer(texts[start:start + step], add_special_tokens=False).input_ids:
            ids += encoded + ([eos] if eos is not None else [])
        if len(ids) >= needed:
            break
    if len(ids) < needed:
        raise RecipeError(f"the {where} text holds {len(ids) // block_size} blocks of {block_size} tokens, "
                          f"fewer than data.{where}_size={count}: lower it or add data")
    blocks = torch.tensor(ids[:needed]).view(count, block_size)
    return Examples([{"input_ids": b, "attention_mask": torch.ones_like(b), "labels": b} for b in blocks])


def causal_lm_datasets(spec: DataSpec, tokenizer) -> tuple[Examples, Examples]:
    train, test = split_entries(spec)
    return (pack([t for t, _ in train], tokenizer, spec.block_size, spec.train_size, "train"),
            pack([t for t, _ in test], tokenizer, spec.block_size, spec.eval_size, "eval"))


def classification_datasets(spec: DataSpec, tokenizer) -> tuple[Examples, Examples, list[str]]:
    """Balanced train / held-out examples and the label names (sorted)."""
    train, test = split_entries(spec)
    names = sorted({label for _, label in train + test})
    if len(names) < 2 or "" in names:
        raise RecipeError("classification needs a label per entry and >= 2 labels: set data.label_field "
                          "(or data.categories for the fortunes)")
    out = []
    for entries, count, where in ((train, spec.train_size, "train"), (test, spec.eval_size, "eval")):
        chosen = []
        for label in names:
            texts = [t for t, l in entries if l == label][:count]
            if len(texts) < count:
                raise RecipeError(f"label {label!r} has {len(texts)} {where} examples, fewer than "
                                  f"data.{where}_size={count}: lower it")
            chosen += [(t, names.index(label)) for t in texts]
        random.Random(spec.seed).shuffle(chosen)
        encoded = tokenizer([t for t, _ in chosen], truncation=True, max_length=spec.max_length)
        out.append(Examples([{"input_ids": torch.tensor(i), "attention_mask": torch.tensor(m),
                              "labels": torch.tensor(y)}
                             for i, m, (_, y) in zip(encoded.input_ids, encoded.attention_mask, chosen)]))
    return out[0], out[1], names
