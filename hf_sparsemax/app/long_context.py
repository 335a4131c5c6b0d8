"""Evaluation at length (``eval.long_context`` of a causal-LM recipe; ``recipes/convert_long.yaml``).

For a trained model, on held-out text and a synthetic retrieval task:

- ``cross_entropy_by_length``: held-out documents of ``length`` tokens (the held-out entries, joined by the
  end-of-sequence token, cut into ``documents`` documents: text never trained on), one forward pass each; the
  cross-entropy of the token at position ``p`` (predicted from positions ``0 .. p-1``) is averaged per
  position bucket ``[lo, hi)`` (:data:`BUCKETS`, those that fit in ``length``).
- ``passkey_accuracy``: ``{context: {depth: share}}``. A prompt of exactly ``context`` tokens: an instruction,
  filler sentences, and at ``depth`` of the filler (the sentence boundary nearest it) a needle stating a random
  5-digit pass key, then the question; the answer is decoded greedily from a ``DynamicCache`` (the prefill,
  then one step per answer token) and counts when every answer token is right. The tokenizer must give the
  answer's tokens unchanged after the question (SmolLM2: a space, then one token per digit); one that merges
  them across the boundary is refused (``ValueError``), never scored on a different split. Every prompt begins
  with the same tokens (the instruction, then the filler up to its needle), so the cells of one rotary setting
  share one prefill of that prefix (:class:`SharedPrefix`), each cell feeding only the rest of its prompt.
- ``attention_zero_share_at_length``: the share of the attention weights that are exactly 0 (every layer and head,
  the cells the causal mask allows) on the first ``zeros_length`` tokens of the first held-out document
  (:func:`hf_sparsemax.app.curves.measure`; its own key: ``attention_zero_share`` is the heatmap head's).
- ``keys_never_read``: the share of cached keys the int8 certificate (:mod:`hf_sparsemax.attention.blocked.keycodes`)
  proved weightless and never read, over the decoding steps at ``decode_context`` tokens (passkey answers and
  the timed steps); ``keys_never_read_by_context`` per passkey context. ``None`` where no step was certified
  (softmax attention, or a context under the certificate's first 1024 keys).
- ``decode``: ``decode_steps`` greedy decoding steps at ``decode_context`` tokens, each timed (wall clock, the
  process's threads) alternately with the same step of the same model (its LoRA adapter included) with its
  attention switched to sdpa, on a copy of the same cache: ``tokens_per_s``, ``sdpa_tokens_per_s`` and their
  ratio (medians).

Contexts longer than the model's ``max_position_embeddings`` run with the rotary positions interpolated
``rope_factor`` times (linear scaling, ``rope_type: linear`` with that factor): the model's
rotary module is replaced by one built from a copy of its config with ``rope_type: linear`` for those contexts
only. A context longer than the positions without a ``rope_factor`` covering it, a model without a rotary
module, and an empty document are refused with one ``ValueError``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import random
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from .._model import base_model, cache_keyword
from .recipes import LongSpec, RecipeError, long_spec  # noqa: F401  (long_spec: the spec's parser, with the recipe's)
from .runner import timed

BUCKETS = ((0, 512), (512, 2048), (2048, 4096), (4096, 8192))
LOGIT_CHUNK = 1024  # positions whose logits are formed at a time (8192 x 49152 float32 logits would be 1.6 GB)
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about it.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER = " {key}"


# -- positions: the model's own, or interpolated

def positions_of(model) -> int:
    return int(base_model(model).config.max_position_embeddings)


def rope_for(model, tokens: int, rope_factor: float | None) -> float | None:
    """The rope factor a sequence of ``tokens`` needs (None: the model's own positions), or a ``ValueError``."""
    positions = positions_of(model)
    if tokens <= positions:
        return None
    if rope_factor is None or tokens > positions * rope_factor:
        raise ValueError(f"a context of {tokens} tokens is longer than the model's {positions} positions"
                         + (f" times the rope factor {rope_factor:g}" if rope_factor else "")
                         + f": set eval.long_context.rope_factor >= {tokens / positions:g} (linear rotary "
                         "interpolation) or use shorter contexts")
    return float(rope_factor)


@contextlib.contextmanager
def extended_rope(model, factor: float | None):
    """While the block runs: the model's rotary positions interpolated ``factor`` times (None: unchanged)."""
    if factor is None:
        yield
        return
    inner = base_model(model)
    owner = next((m for m in inner.modules() if isinstance(getattr(m, "rotary_emb", None), torch.nn.Module)), None)
    if owner is None:
        raise ValueError(f"{type(inner).__name__} has no rotary embedding (rotary_emb) to extend: contexts past its "
                         f"{positions_of(model)} positions cannot be evaluated")
    old = owner.rotary_emb
    config = copy.deepcopy(old.config)
    config.rope_parameters = {**dict(config.rope_parameters), "rope_type": "linear", "factor": float(factor)}
    config.max_position_embeddings = int(config.max_position_embeddings * factor)
    owner.rotary_emb = type(old)(config=config).to(next(old.buffers()).device)
    try:
        yield
    finally:
        owner.rotary_emb = old


# -- held-out documents and the cross-entropy by position

def held_out_documents(spec: LongSpec, data_spec, tokenizer) -> list[torch.Tensor]:
    """``spec.documents`` documents of ``spec.length`` tokens from the recipe's held-out entries."""
    from .recipe_data import quiet, split_tables

    with quiet():
        _, _, table, rows = split_tables(data_spec)
    texts = table.select(rows)["text"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    need = spec.documents * spec.length
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False).input_ids + eos
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise RecipeError(f"the held-out text holds {len(ids)} tokens, fewer than eval.long_context.documents x "
                          f"length = {need}: lower them, or raise data.eval_fraction")
    return [torch.tensor(ids[i * spec.length:(i + 1) * spec.length]) for i in range(spec.documents)]


def forward_document(model, ids: torch.Tensor, rope_factor: float | None = None,
                     zeros_length: int = 0) -> tuple[torch.Tensor, float | None]:
    """One forward pass over a document: ``(losses, zero share)``. ``losses [T - 1]`` float64: the cross-entropy
    of token ``p`` (from ``1``) given tokens ``0 .. p-1``. With ``zeros_length``, the first that many tokens go
    first with the attention weights returned (:func:`.curves.returning_weights`) and their exact zeros counted
    (every layer and head, the cells the causal mask allows), the rest after them from their cache: the same
    pass, no second prefill; else the zero share is None."""
    from transformers import DynamicCache

    from .curves import allowed_cells, returning_weights

    if ids.dim() != 1 or ids.numel() < 2:
        raise ValueError(f"a document must be a 1-d sequence of at least 2 tokens, got shape {tuple(ids.shape)}")
    inner = base_model(model)
    model.eval()
    ids = ids.to(inner.device)
    first = min(zeros_length, ids.numel())
    zero_share, hidden = None, []
    with torch.no_grad(), extended_rope(model, rope_for(model, ids.numel(), rope_factor)):
        cache = DynamicCache(config=inner.config) if first else None
        if first:
            with returning_weights(model):
                out = inner.model(input_ids=ids[None, :first], **{cache_keyword(inner): cache}, use_cache=True,
                                  output_attentions=True)
            allowed = allowed_cells(torch.ones(1, first, dtype=torch.long, device=ids.device), first)
            zeros = sum(float((w[allowed.expand_as(w)] == 0).sum()) for w in out.attentions)
            zero_share = zeros / (float(allowed.sum()) * sum(w.shape[1] for w in out.attentions))
            hidden.append(out.last_hidden_state[0])
            del out
        if first < ids.numel():
            hidden.append(inner.model(input_ids=ids[None, first:], **{cache_keyword(inner): cache},
                                      use_cache=cache is not None).last_hidden_state[0])
        hidden = torch.cat(hidden)
        head = inner.get_output_embeddings()
        targets = ids[1:]
        losses = [F.cross_entropy(head(hidden[s:s + LOGIT_CHUNK]).float()[: targets.numel() - s],
                                  targets[s:s + LOGIT_CHUNK], reduction="none")
                  for s in range(0, targets.numel(), LOGIT_CHUNK)]
    return torch.cat(losses).double().cpu(), zero_share


def token_losses(model, ids: torch.Tensor, rope_factor: float | None = None) -> torch.Tensor:
    """``[T - 1]`` float64: the cross-entropy of token ``p`` (from ``1``) given tokens ``0 .. p-1``."""
    return forward_document(model, ids, rope_factor)[0]


def bucket_means(losses: list[torch.Tensor], buckets=BUCKETS) -> dict[str, float]:
    """``{"lo-hi": mean of the losses of the tokens at positions [lo, hi)}`` over documents' :func:`token_losses`."""
    sums: dict[str, list[float]] = {}
    for loss in losses:  # loss[p - 1]: the token at position p
        for lo, hi in buckets:
            part = loss[max(lo, 1) - 1:hi - 1]
            if part.numel():
                total = sums.setdefault(f"{lo}-{hi}", [0.0, 0])
                total[0] += float(part.sum())
                total[1] += part.numel()
    return {name: s / n for name, (s, n) in sums.items()}


def parent_at_length(model, documents: list[torch.Tensor], spec: LongSpec) -> dict[str, Any]:
    """The model as loaded, before any patch or training step: its held-out ``cross_entropy_by_length`` on the
    same documents (the report's parent row, the reference of "never worse than the parent"), and the wall
    ``seconds`` it took."""
    if not documents:
        raise ValueError("the evaluation at length needs at least one document")
    start = time.perf_counter()
    ce = cross_entropy_by_length(model, documents, rope_factor=spec.rope_factor)
    return {"cross_entropy_by_length": ce, "seconds": round(time.perf_counter() - start, 1)}


def cross_entropy_by_length(model, documents: list[torch.Tensor], buckets=BUCKETS,
                            rope_factor: float | None = None) -> dict[str, float]:
    """``{"lo-hi": mean cross-entropy of the tokens at positions [lo, hi)}`` over ``documents`` (module docstring)."""
    if not documents:
        raise ValueError("cross_entropy_by_length needs at least one document")
    return bucket_means([token_losses(model, ids, rope_factor) for ids in documents], buckets)


# -- the passkey task

def passkey_parts(tokenizer, context: int, depth: float, key: int) -> tuple[list[int], list[int], list[int]]:
    """``(prefix, rest, answer ids)``: the prompt of exactly ``context`` tokens is ``prefix + rest``, where ``prefix``
    (the instruction and the filler before the needle) is a prefix of the same token sequence for every context,
    depth and key (what :func:`passkey` shares between its cells); or a ``ValueError`` (module docstring)."""
    def encode(text):
        return tokenizer(text, add_special_tokens=False).input_ids

    answer, question = encode(ANSWER.format(key=key)), encode(QUESTION)
    if encode(QUESTION + ANSWER.format(key=key)) != question + answer:
        raise ValueError(f"the tokenizer splits the pass key {key} differently after the question than alone "
                         f"({tokenizer.convert_ids_to_tokens(answer)}): the greedy answer could not be checked "
                         "token by token")
    intro, needle, unit = encode(INTRO), encode(NEEDLE.format(key=key)), encode(FILLER)
    room = context - len(intro) - len(needle) - len(question)
    if room < len(unit):
        raise ValueError(f"a passkey context of {context} tokens leaves no room for filler (at least "
                         f"{len(intro) + len(needle) + len(question) + len(unit)} tokens)")
    filler = (unit * (room // len(unit) + 1))[:room]
    cut = round(depth * room / len(unit)) * len(unit)  # the sentence-group boundary nearest the depth
    cut = min(cut, room)
    return intro + filler[:cut], needle + filler[cut:] + question, answer


def passkey_prompt(tokenizer, context: int, depth: float, key: int) -> tuple[list[int], list[int]]:
    """``(prompt ids of exactly context tokens, answer ids)`` (module docstring), or a ``ValueError``."""
    prefix, rest, answer = passkey_parts(tokenizer, context, depth, key)
    return prefix + rest, answer


@contextlib.contextmanager
def sdpa_attention(model):
    """While the block runs: the model's attention is torch's ``sdpa`` (softmax), everything else unchanged."""
    from ..swaps.attention_swap import set_attention

    inner = base_model(model)
    current = inner.config._attn_implementation
    if current != "sdpa":
        set_attention(inner, "sdpa")
    try:
        yield
    finally:
        if current != "sdpa":
            set_attention(inner, current)


def step(model, token: torch.Tensor, cache) -> torch.Tensor:
    """One greedy decoding step: the next token ``[1, 1]``."""
    out = model(input_ids=token, **{cache_keyword(model): cache}, use_cache=True)
    return out.logits[:, -1].argmax(-1, keepdim=True)


@contextlib.contextmanager
def counted(into: dict[str, int]):
    """While the block runs: the int8 certificate's counts (:data:`keycodes.COUNTS`) it adds, summed into ``into``."""
    from ..attention.blocked import keycodes

    before = dict(keycodes.COUNTS)
    try:
        yield
    finally:
        for name, value in keycodes.COUNTS.items():
            into[name] = into.get(name, 0) + value - before[name]


def greedy(model, prompt: list[int], steps: int, timed: int = 0, cache=None,
           counts: dict[str, int] | None = None) -> tuple[list[int], dict[str, Any]]:
    """``steps`` greedy tokens after ``prompt`` from a ``DynamicCache``; with ``timed``, that many more steps,
    each timed alternately with the same step of the same model, its attention switched to sdpa
    (:func:`sdpa_attention`), on a copy of the cache: ``(tokens, timings)``. ``cache``: one that holds the
    prompt's first tokens already (its length says how many; those are not fed again). ``counts``: the
    certificate's counts of the decoding steps (not of the prompt) are added to it (:func:`counted`)."""
    from transformers import DynamicCache

    inner = base_model(model)
    cache = DynamicCache(config=inner.config) if cache is None else cache
    fed = cache.get_seq_length()
    if not 0 <= fed < len(prompt):
        raise ValueError(f"the cache holds {fed} tokens of a prompt of {len(prompt)}: nothing left to feed")
    out = model(input_ids=torch.tensor([prompt[fed:]], device=inner.device), **{cache_keyword(model): cache},
                use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = [int(token)]
    with counted(counts if counts is not None else {}):
        for _ in range(steps - 1):
            token = step(model, token, cache)
            tokens.append(int(token))
        if not timed:
            return tokens, {}
        twin, twin_token = copy.deepcopy(cache), token
        times: dict[str, list[float]] = {"model": [], "sdpa": []}
        for round_ in range(timed):
            for name in ("model", "sdpa") if round_ % 2 == 0 else ("sdpa", "model"):
                with sdpa_attention(model) if name == "sdpa" else contextlib.nullcontext():
                    start = time.perf_counter()
                    if name == "model":
                        token = step(model, token, cache)
                    else:
                        twin_token = step(model, twin_token, twin)
                    times[name].append(time.perf_counter() - start)
    model_s, sdpa_s = statistics.median(times["model"]), statistics.median(times["sdpa"])
    return tokens, {"tokens_per_s": 1 / model_s, "sdpa_tokens_per_s": 1 / sdpa_s, "ratio_to_sdpa": sdpa_s / model_s,
                    "steps": timed, "context": len(prompt),
                    "seconds": round(sum(times["model"]) + sum(times["sdpa"]), 4)}


class SharedPrefix:
    """One growing ``DynamicCache`` of the passkey prompts' common prefix (:func:`passkey_parts`): the cells of
    one rotary setting, taken by increasing prefix, each start from a copy of it grown to their own prefix. The
    keys and values of a position depend on the tokens up to it only, so the copy holds what the cell's own
    prefill would compute: the whole prompt is the model's, fed in two parts instead of one."""

    def __init__(self, model):
        from transformers import DynamicCache

        self.model, self.ids = model, []
        self.cache = DynamicCache(config=base_model(model).config)

    def grown_to(self, prefix: list[int]):
        """A copy of the cache holding ``prefix`` (a longer prefix than any before; the same sequence)."""
        if prefix[:len(self.ids)] != self.ids or len(prefix) < len(self.ids):
            raise ValueError("passkey prefixes must be taken in increasing order, each extending the last")
        if len(prefix) > len(self.ids):
            device = base_model(self.model).device
            fed = torch.tensor([prefix[len(self.ids):]], device=device)
            self.model(input_ids=fed, **{cache_keyword(self.model): self.cache},
                       use_cache=True, logits_to_keep=1)
            self.ids = list(prefix)
        return copy.deepcopy(self.cache)


def passkey(model, tokenizer, spec: LongSpec) -> dict[str, Any]:
    """``passkey_accuracy``, ``keys_never_read(_by_context)`` and ``decode`` (module docstring). The cells
    (context, depth, trial) of one rotary setting share the prefill of their common prefix (:class:`SharedPrefix`).
    ``passkey_seconds``: ``{context: {"prefix": [wall, cpu], "prompt": [wall, cpu]}}``, the seconds of growing the
    shared prefix to the context's prompts and of their rest and answers (the timed decoding steps included: their
    own wall seconds are ``decode["seconds"]``)."""
    model.eval()
    ropes = {context: rope_for(model, context, spec.rope_factor) for context in spec.contexts}  # all checked first
    rng = random.Random(spec.seed)
    cells = []  # (rope, prefix, rest, answer, context, depth): the keys drawn in the order of the loops
    for context in spec.contexts:
        for depth in spec.depths:
            for _ in range(spec.trials):
                prefix, rest, answer = passkey_parts(tokenizer, context, depth, rng.randrange(10000, 100000))
                cells.append((ropes[context], prefix, rest, answer, context, depth))
    right: dict[tuple[int, float], int] = {}
    counts: dict[int, dict[str, int]] = {context: {} for context in spec.contexts}
    decode: dict[str, Any] = {}
    seconds: dict[str, dict[str, list[float]]] = {str(context): {} for context in spec.contexts}
    with torch.no_grad():
        for rope in dict.fromkeys(ropes.values()):
            group = sorted((c for c in cells if c[0] == rope), key=lambda c: len(c[1]))
            with extended_rope(model, rope):
                shared = SharedPrefix(model)
                for _, prefix, rest, answer, context, depth in group:
                    steps = spec.decode_steps if context == spec.decode_context and not decode else 0
                    with timed(seconds[str(context)], "prefix"):
                        cache = shared.grown_to(prefix)
                    with timed(seconds[str(context)], "prompt"):
                        tokens, timing = greedy(model, prefix + rest, len(answer), steps, cache, counts[context])
                    decode.update(timing)
                    right[context, depth] = right.get((context, depth), 0) + (tokens == answer)
    accuracy = {str(c): {f"{d:g}": right[c, d] / spec.trials for d in spec.depths} for c in spec.contexts}
    never = {str(c): counts[c]["certified"] / counts[c]["keys"] if counts[c].get("calls") else None
             for c in spec.contexts}
    return {"passkey_accuracy": accuracy, "keys_never_read_by_context": never,
            "keys_never_read": never.get(str(spec.decode_context)), "decode": decode, "passkey_seconds": seconds}


def evaluate(model, tokenizer, documents: list[torch.Tensor], spec: LongSpec) -> dict[str, Any]:
    """Every measurement of the module docstring, as ``results.json`` keys; ``long_context`` adds the spec and the
    seconds of each part (``ce_seconds``: the documents' forward passes, the exact zeros' included, and
    ``ce_cpu_seconds``; ``passkey_seconds`` per context, :func:`passkey`), the process's CPU seconds (every
    thread) and the load at the end."""
    if not documents:
        raise ValueError("the evaluation at length needs at least one document")
    start, cpu = time.perf_counter(), time.process_time()
    losses, zero_share, ce = [], None, {}
    with timed(ce, "ce"):
        for index, ids in enumerate(documents):  # the zeros counted on the first document's first tokens, same pass
            loss, zeros = forward_document(model, ids, spec.rope_factor, spec.zeros_length if index == 0 else 0)
            losses.append(loss)
            zero_share = zeros if index == 0 else zero_share
    out = {"cross_entropy_by_length": bucket_means(losses), "attention_zero_share_at_length": zero_share}
    out.update(passkey(model, tokenizer, spec))
    out["long_context"] = {**dataclasses.asdict(spec), "positions": positions_of(model),
                           "seconds": round(time.perf_counter() - start, 1), "ce_seconds": ce["ce"][0],
                           "ce_cpu_seconds": ce["ce"][1],
                           "cpu_seconds": round(time.process_time() - cpu, 1), "load": round(os.getloadavg()[0], 2),
                           "passkey_seconds": out.pop("passkey_seconds")}
    return out
