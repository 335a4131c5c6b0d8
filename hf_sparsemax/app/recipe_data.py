"""Recipe data: text entries from the offline fortunes, a ``datasets`` dataset or local files, split and packed.

Entries live in an Arrow table (``datasets``; memory-mapped from disk for
files and datasets), so a large file is never held as Python objects. The
held-out split is decided per entry by a hash of its text (``eval_fraction``
of the hash range), so it is deterministic, independent of sizes and order,
and the same on every process of a distributed run; entries are then
shuffled with ``data.seed`` (a permutation of row indices). Held-out data of
one's own (``eval_source`` files or a dataset's ``eval_split``) replaces the
hash split and is used as given, in its order.

Causal LM: each side's entries, joined by the tokenizer's end-of-sequence
token, are tokenised with ``datasets``' batched ``map`` on a stream and cut
into blocks of ``block_size`` tokens, written as int32 to an unlinked
temporary file and memory-mapped (memory stays bounded by one batch, not the
corpus). Classification: ``train_size`` / ``eval_size`` examples per label
(``balance: true``) or in all (``balance: false``), tokenised by a batched
``map`` into a torch-formatted ``datasets.Dataset``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import tempfile

import numpy as np
import torch

from .recipes import DataSpec, RecipeError

TEXT_SUFFIXES = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}
BATCH = 1024


@contextlib.contextmanager
def quiet():
    """No ``datasets`` progress bars (they would break the one-line error contract of the command on stderr)."""
    from datasets.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def held_out(text: str, fraction: float) -> bool:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def as_list(source) -> list[str]:
    return source if isinstance(source, list) else [source]


def is_local(path: str) -> bool:
    """A local file (by its suffix, or an existing file); anything else is a ``datasets`` name (or folder)."""
    return os.path.splitext(path)[1].lower() in TEXT_SUFFIXES or os.path.isfile(path)


def check_files(paths: list[str], field: str) -> str:
    """Local files exist and are of one kind; returns the kind (text / json / csv)."""
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise RecipeError(f"data file(s) {missing} not found: fix data.{field}")
    kinds = {TEXT_SUFFIXES.get(os.path.splitext(p)[1].lower(), "text") for p in paths}
    if len(kinds) > 1:
        raise RecipeError(f"data.{field} mixes file kinds {sorted(kinds)}: use one of .txt, .json/.jsonl, .csv")
    return kinds.pop()


def check_source(spec: DataSpec) -> None:
    """What can be checked of ``data.source`` / ``eval_source`` / ``eval_split`` without reading them.

    Fortune categories must exist; local files must exist and be of one kind;
    a dataset name must be one name (whether it loads is known only on
    loading); ``eval_split`` needs a dataset name, ``eval_source`` local files.
    """
    from . import assets

    if spec.source == "fortunes":
        unknown = [c for c in spec.categories or [] if c not in assets.FORTUNE_FILES]
        if unknown:
            raise RecipeError(f"data.categories: unknown fortune categories {unknown}: choose from "
                              f"{list(assets.FORTUNE_FILES)}")
    elif spec.source != "pydoc_topics":
        sources = as_list(spec.source)
        local = [s for s in sources if is_local(s)]
        if local and len(local) != len(sources):
            raise RecipeError(f"data.source mixes local files and dataset names: {sources}")
        if not local and len(sources) != 1:
            raise RecipeError(f"data.source names several datasets {sources}: give one dataset name or local files")
        if local:
            check_files(local, "source")
    if spec.eval_split is not None and (spec.source in ("fortunes", "pydoc_topics") or is_local(as_list(spec.source)[0])):
        raise RecipeError("data.eval_split needs data.source to be a `datasets` name: for local files or the "
                          "fortunes give held-out files as data.eval_source")
    if spec.eval_source is not None:
        sources = as_list(spec.eval_source)
        if not all(is_local(s) for s in sources):
            raise RecipeError(f"data.eval_source must be local .txt / .json / .jsonl / .csv files, got {sources}; "
                              "for a `datasets` name use data.eval_split")
        check_files(sources, "eval_source")


def load_table(source, spec: DataSpec, split: str, field: str = "source"):
    """The entries of ``source`` as a ``datasets.Dataset`` with string columns ``text`` and ``label``."""
    import datasets

    from . import assets

    if source == "pydoc_topics":
        texts = assets.pydoc_topics()
        return datasets.Dataset.from_dict({"text": texts, "label": ["pydoc"] * len(texts)})
    if source == "fortunes":
        texts, labels = [], []
        for category in spec.categories or ["fortunes"]:
            try:
                entries = assets.fortunes(category)
            except ValueError as error:
                raise RecipeError(f"data.categories: {error}") from None
            texts += entries
            labels += [category] * len(entries)
        return datasets.Dataset.from_dict({"text": texts, "label": labels})
    sources = as_list(source)
    if all(is_local(s) for s in sources):
        kind = check_files(sources, field)
        if kind == "text":
            texts = []
            for path in sources:
                with open(path, encoding="utf-8", errors="replace") as handle:
                    chunks = handle.read().replace("\n%\n", "\n\n").split("\n\n")
                texts += [c.strip() for c in chunks if c.strip() and c.strip() != "%"]
            return datasets.Dataset.from_dict({"text": texts, "label": [""] * len(texts)})
        try:
            table = datasets.load_dataset(kind, data_files=sources, split="train")
        except Exception as error:  # datasets raises many types for unreadable files
            raise RecipeError(f"cannot read {sources} as {kind}: {error}") from None
    else:
        try:
            table = datasets.load_dataset(sources[0], spec.config, split=split)
        except Exception as error:  # missing dataset, no network, bad config or split
            which = "eval_split" if field == "eval_split" else "split"
            raise RecipeError(f"cannot load dataset {sources[0]!r} (config {spec.config!r}, split {split!r}): "
                              f"{type(error).__name__}: {error}; fix data.source / data.{which} or use local "
                              "files") from None
    return text_and_label(table, spec)


def text_and_label(table, spec: DataSpec):
    """``text`` and ``label`` string columns (class-label ids become their names; no label: "")."""
    if spec.text_field not in table.column_names:
        raise RecipeError(f"data.text_field {spec.text_field!r} is not a column: the data has {table.column_names}")
    feature = table.features.get(spec.label_field)
    has_label = spec.label_field in table.column_names
    names = getattr(feature, "names", None)

    def convert(batch):
        labels = batch[spec.label_field] if has_label else [""] * len(batch[spec.text_field])
        return {"text": ["" if t is None else str(t) for t in batch[spec.text_field]],
                "label": ["" if l is None else names[l] if names else str(l) for l in labels]}

    import datasets

    return table.map(convert, batched=True, batch_size=BATCH, remove_columns=table.column_names,
                     features=datasets.Features({"text": datasets.Value("string"), "label": datasets.Value("string")}))


def kept_rows(table, spec: DataSpec | None, fraction: float | None = None) -> tuple[list[int], list[int]]:
    """Row indices of non-empty entries (and, given ``spec``, within its ``min_chars`` / ``max_chars``):
    ``(kept, held out)``, the second by the text hash when ``fraction`` is given (else empty)."""
    keep, held, row = [], [], 0
    for batch in table.select_columns(["text"]).iter(batch_size=BATCH):
        for text in batch["text"]:
            if text.strip() and (spec is None or (len(text) >= spec.min_chars and
                                                  (spec.max_chars is None or len(text) <= spec.max_chars))):
                (held if fraction is not None and held_out(text, fraction) else keep).append(row)
            row += 1
    return keep, held


def split_tables(spec: DataSpec):
    """``(train table, train rows, held-out table, held-out rows)``, rows in the order they are used.

    Without held-out data of one's own: filtered by length, split by the text hash, each side shuffled
    with ``data.seed``. With ``eval_source`` / ``eval_split``: every source entry trains (shuffled); the
    held-out entries are used as given (order kept, only empty entries dropped).
    """
    own = spec.eval_source is not None or spec.eval_split is not None
    table = load_table(spec.source, spec, spec.split)
    train, test = kept_rows(table, spec, None if own else spec.eval_fraction)
    if not train and not test:
        raise RecipeError(f"data.source {spec.source!r} gave no text entries (check min_chars / max_chars / fields)")
    random.Random(spec.seed).shuffle(train)
    if not own:
        random.Random(spec.seed + 1).shuffle(test)
        return table, train, table, test
    if spec.eval_source is not None:
        held_table = load_table(spec.eval_source, spec, spec.split, "eval_source")
    else:
        held_table = load_table(spec.source, spec, spec.eval_split, "eval_split")
    test = kept_rows(held_table, None)[0]
    if not test:
        raise RecipeError(f"the held-out data {spec.eval_source or spec.eval_split!r} has no text entries")
    return table, train, held_table, test


class Blocks(torch.utils.data.Dataset):
    """Causal-LM blocks ``[n, block_size]`` (int32, memory-mapped), each item ``input_ids = labels``."""

    def __init__(self, blocks: np.ndarray):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(np.array(self.blocks[index], dtype=np.int64))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def pack(table, rows: list[int], tokenizer, block_size: int, count: int | None, where: str) -> Blocks:
    """``count`` (``None``: every full) blocks of ``block_size`` tokens from the entries ``rows`` of ``table``,
    joined by end-of-sequence tokens; tokenised by a batched ``map`` on a stream that stops once enough."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch):
        return {"ids": [ids + eos for ids in tokenizer(batch["text"], add_special_tokens=False).input_ids]}

    stream = (table.select(rows).select_columns(["text"]).to_iterable_dataset()
              .map(tokenize, batched=True, batch_size=256, remove_columns=["text"]))
    store = tempfile.TemporaryFile(prefix="hf_sparsemax_blocks_")
    buffer: list[int] = []
    made = 0
    for item in stream:
        buffer += item["ids"]
        full = len(buffer) // block_size
        if count is not None:
            full = min(full, count - made)
        if full:
            store.write(np.asarray(buffer[:full * block_size], dtype=np.int32).tobytes())
            del buffer[:full * block_size]
            made += full
        if count is not None and made == count:
            break
    if made == 0 or (count is not None and made < count):
        store.close()
        raise RecipeError(f"the {where} text holds {made} blocks of {block_size} tokens, fewer than "
                          f"data.{where}_size={count if count is not None else 1}: lower it or add data")
    store.flush()
    return Blocks(np.memmap(store, dtype=np.int32, mode="r", shape=(made, block_size)))


def causal_lm_datasets(spec: DataSpec, tokenizer) -> tuple[Blocks, Blocks]:
    with quiet():
        train_table, train, test_table, test = split_tables(spec)
        return (pack(train_table, train, tokenizer, spec.block_size, spec.train_size, "train"),
                pack(test_table, test, tokenizer, spec.block_size, spec.eval_size, "eval"))


def choose(labels: list[str], names: list[str], count: int | None, balance: bool, where: str) -> list[int]:
    """Positions in ``labels`` to use: the first ``count`` of each label (``balance``) or in all; None: all."""
    if not balance:
        if count is not None and count > len(labels):
            raise RecipeError(f"the {where} data holds {len(labels)} entries, fewer than data.{where}_size={count}: "
                              "lower it, or set it to null (every entry)")
        return list(range(len(labels) if count is None else count))
    chosen = []
    for name in names:
        positions = [i for i, label in enumerate(labels) if label == name][:count]
        if count is not None and len(positions) < count:
            raise RecipeError(f"label {name!r} has {len(positions)} {where} examples, fewer than "
                              f"data.{where}_size={count}: lower it, or set data.balance=false to keep the "
                              "natural label distribution")
        chosen += positions
    return chosen


def classification_datasets(spec: DataSpec, tokenizer):
    """Train / held-out examples (torch-formatted ``datasets.Dataset``) and the label names (sorted).

    The labels are those of the training entries; a label that occurs only in the held-out data is refused.
    """
    with quiet():
        return labelled_datasets(spec, tokenizer)


def labelled_datasets(spec: DataSpec, tokenizer):
    train_table, train, test_table, test = split_tables(spec)
    train_labels = train_table.select(train)["label"]
    test_labels = test_table.select(test)["label"]
    names = sorted(set(train_labels))
    if len(names) < 2 or "" in names:
        raise RecipeError("classification needs a label per entry and >= 2 labels: set data.label_field "
                          "(or data.categories for the fortunes)")
    out = []
    for table, rows, labels, count, where in ((train_table, train, train_labels, spec.train_size, "train"),
                                              (test_table, test, test_labels, spec.eval_size, "eval")):
        if where == "eval":
            unseen = sorted(set(labels) - set(names))
            if unseen:
                raise RecipeError(f"label(s) {unseen} occur only in the held-out data, never in training: add "
                                  "training entries for them or remove them from the held-out data")
        chosen = choose(labels, names, count, spec.balance, where)
        if spec.balance:
            random.Random(spec.seed).shuffle(chosen)
        ids = [names.index(labels[i]) for i in chosen]

        def tokenize(batch, index):
            encoded = tokenizer(batch["text"], truncation=True, max_length=spec.max_length)
            return {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
                    "labels": [ids[i] for i in index]}

        subset = table.select([rows[i] for i in chosen])
        encoded = subset.map(tokenize, batched=True, batch_size=BATCH, with_indices=True,
                             remove_columns=subset.column_names)
        out.append(encoded.with_format("torch"))
    return out[0], out[1], names
