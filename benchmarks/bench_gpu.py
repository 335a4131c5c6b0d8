"""Issue 46's targets on one GPU, in one process: sparse attention's Triton kernels against sdpa (its flash
backend), today's torch path and AdaSplash-2, bfloat16. Every table prints with met / MISSED beside its target.

Sections (``--sections``; each guarded: an error prints and the next section runs; each has a time budget, after
which its remaining rows print "skipped"):

- ``random``: one attention call, forward (no autograd, as a prefill) and forward + backward, causal, at 1k / 4k /
  16k tokens, SmolLM2's heads (9 query / 3 kv, d 64) and a Llama-8B layer's (32 / 8, d 128), q / k / v drawn from
  N(0, 1) (scores ~ N(0, 1) with the 1/sqrt(d) scale); batch = 16k tokens / length, so every call fills the GPU;
- ``real``: the same on real-text q / k / v, captured post-rotary from the pretrained SmolLM2 on the fortunes
  corpus at 8k tokens (``benchmarks/capture_qk.py`` writes ``.bench_data/smollm2_qkv.pt``; a prefix of a causal
  model's q / k is exactly what the shorter text gives), at 1k / 4k / 8k, tiled to the same batch;
- ``train``: a whole training step (forward + backward of the causal-LM loss) of SmolLM2-135M at 2k and 4k tokens,
  with its peak GPU memory;
- ``inference``: prefill and per-token decoding (teacher-forced text tokens, transformers' DynamicCache) of
  SmolLM2-135M at 2k / 4k / 8k cached tokens, batch 1 and 8 (8 passages, full length, no padding); then one
  decoding step of sdpa and of each Triton contender under torch.profiler (its wall time and top operators).

The whole-model sections load the pretrained SmolLM2-135M-Instruct where its offline GGUF asset is installed; where
it is not (the GPU machine: 93 MB, over what can be carried) they build a random-init Llama with SmolLM2-135M's
config and say so: its attention scores are near uniform, so supports are wide and few blocks are empty (a
pessimistic case for the sparse kernels). Text tokens come from the capture file.

Contenders: ``sdpa`` (flash backend, ``enable_gqa``, else repeated kv; in the model sections the model's own sdpa);
``triton`` (``hf_sparsemax.attention.gpu.triton_attention``; in the model sections ``attn_options={"kernel": "triton"}``);
``torch`` (today's path: ``sparse_attention_forward``, the function the patched model calls; ``"kernel": "torch"``
where that option exists); AdaSplash-2 (``adasplash``, entmax15 causal only, where importable). A contender that
cannot be imported or called prints "n/a" with the reason once below its table. Times: CUDA events, one warm-up
call (compilation), median of ``reps`` calls (one call only where it takes over ``SLOW_MS``).

Targets (issue 46; ratios of the Triton kernels to sdpa): attention forward + backward at >= 4k tokens <= 1.3x for
sparsemax / entmax15, <= 2x for entmax_bisect(1.3) and a learned alpha, and no slower than AdaSplash-2 (entmax15);
forward alone <= 1.5x at >= 4k; decoding per token <= 1.15x; whole prefill <= 1.5x at >= 4k (the forward target);
training step <= 1.1x, its peak memory <= 1.05x.

On the CPU, ``--tiny`` runs every section on tiny sizes with ``TRITON_INTERPRET=1`` (a rehearsal, nothing timed
that means anything):

    PYTHONPATH=. python benchmarks/bench_gpu.py --tiny

The wheel carried to the GPU machine (the device README's "wheels"), once, from the repository root:

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl adasplash==0.2.2

and the real-text capture (a few minutes on the CPU): ``PYTHONPATH=. python benchmarks/capture_qk.py``. The device
command (carry ``.whl`` and ``.bench_data``; the section budgets add up to 370 s, plus start-up and a cell that
overruns its section's budget: planned for under 8 minutes on one H100, not yet timed there):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site python3 benchmarks/bench_gpu.py 2>&1 | tee $OUT/bench_gpu.log
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
import warnings

if "--tiny" in sys.argv:  # before anything imports triton or hf_sparsemax
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HF_SPARSEMAX_COMPILED_SOLVER", "0")  # a rehearsal: no minutes of C++ compilation

import torch

from common import markdown_table

warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")  # newer transformers: "cache"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPTURE = os.path.join(ROOT, ".bench_data", "smollm2_qkv.pt")
MAPPINGS = {  # name -> (attention, attn_options, alpha for the kernels, forward + backward target)
    "sparsemax": ("sparsemax", {}, 2.0, 1.3),
    "entmax15": ("entmax15", {}, 1.5, 1.3),
    "entmax_bisect(1.3)": ("entmax_bisect", {"alpha": 1.3}, 1.3, 2.0),
    "learned alpha(1.3)": ("entmax_bisect", {"alpha": 1.3, "learn_alpha": True}, "learned", 2.0),
}
TARGET_FORWARD, TARGET_DECODE, TARGET_STEP, TARGET_MEMORY = 1.5, 1.15, 1.1, 1.05
HEADS = {"SmolLM2 (9 / 3 heads, d 64)": (9, 3, 64), "Llama-8B layer (32 / 8 heads, d 128)": (32, 8, 128)}
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
               max_position_embeddings=8192)
TINY_LLAMA = dict(SMOLLM2, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3,
                  num_key_value_heads=1)
SLOW_MS = 2000.0  # a call slower than this is timed once
TOO_SLOW_MS = 8000.0  # a contender slower than this skips the larger sizes of its section
MODEL_KERNELS = ("triton", "torch")


@dataclasses.dataclass(frozen=True)
class Sizes:
    attention: tuple[int, ...]  # tokens per attention call, random scores
    real: tuple[int, ...]  # ... real-text scores
    fill: int  # batch = fill // tokens
    train: tuple[int, ...]
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    steps: int  # decoding steps per context (median of all but the first two)
    reps: int
    decode_calls: int  # calls a sample of the decoding call's time
    target_from: int  # attention and prefill targets hold from this many tokens (shorter rows: reported)
    budgets: dict  # section -> seconds


GPU_SIZES = Sizes(attention=(1024, 4096, 16384), real=(1024, 4096, 8192), fill=16384, train=(2048, 4096),
                  contexts=(2048, 4096, 8192), batches=(1, 8), steps=10, reps=5, decode_calls=10, target_from=4096,
                  budgets={"random": 120, "real": 50, "decode": 30, "train": 70, "inference": 100})
TINY_SIZES = Sizes(attention=(64, 128), real=(64, 128), fill=128, train=(64,), contexts=(64,), batches=(1, 2), steps=4,
                   reps=1, decode_calls=1, target_from=64,
                   budgets={"random": 900, "real": 300, "decode": 300, "train": 300, "inference": 300})


class Unavailable(Exception):
    """A contender that cannot run here (its reason is printed once below the table)."""


# --- reporting -----------------------------------------------------------------------------------------------


class Report:
    """Prints each part as it comes and keeps ``$OUT/bench_gpu.md`` up to date (a later crash loses nothing)."""

    def __init__(self):
        self.parts, self.verdicts = [], []
        out = os.environ.get("OUT")
        self.path = os.path.join(out, "bench_gpu.md") if out else None

    def add(self, text: str) -> None:
        print(text + "\n", flush=True)
        self.parts.append(text)
        if self.path:
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                with open(self.path, "w") as handle:
                    handle.write("\n\n".join(self.parts) + "\n")
            except OSError as error:
                print(f"cannot write {self.path}: {error}", flush=True)
                self.path = None

    def verdict(self, ratio: float | None, target: float | None, what: str) -> str:
        """"met" / "MISSED" for ``ratio`` against ``target`` (recorded for the summary), "" without a target."""
        if target is None:
            return ""
        if ratio is None:
            self.verdicts.append((what, "not measured"))
            return "n/a"
        word = "met" if ratio <= target else "MISSED"
        self.verdicts.append((what, word))
        return f"{word} (<= {target:g}x)"

    def summary(self) -> None:
        counts = {word: sum(1 for _, w in self.verdicts if w == word) for word in ("met", "MISSED", "not measured")}
        missed = [what for what, word in self.verdicts if word == "MISSED"]
        self.add(f"## Summary\n\nTargets: {counts['met']} met, {counts['MISSED']} MISSED, {counts['not measured']} "
                 "not measured." + ("\n\nMISSED:\n" + "\n".join(f"- {what}" for what in missed) if missed else ""))


def ratio_cell(ms: float | None, base: float | None) -> str:
    if ms is None:
        return "n/a"
    if base is None:
        return f"{ms:.2f} ms"
    return f"{ms / base:.2f}x"


def ms_cell(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.2f}"


class Notes(dict):
    """Why contenders printed n/a (or what else to know of them): one line per reason, naming the contenders."""

    def failed(self, name: str, error: BaseException | str) -> None:
        if isinstance(error, BaseException):
            lines = str(error).strip().splitlines()
            error = f"not available ({type(error).__name__}: {lines[0][:300] if lines else ''})"
        names = self.setdefault(error, [])
        if name not in names:
            names.append(name)

    def text(self) -> str:
        return "\n".join(f"- {', '.join(names)}: {reason}" for reason, names in self.items())


# --- timing --------------------------------------------------------------------------------------------------


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() and not ARGS.tiny else "cpu")


def sync() -> None:
    if device().type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, reps: int, calls: int = 1) -> float:
    """Median milliseconds of ``fn()`` after one warm-up call; a call slower than ``SLOW_MS`` is timed once. Each
    sample is the mean of ``calls`` calls in a row (short calls: one launch's time is mostly noise)."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    first = (time.perf_counter() - start) * 1e3
    if first > SLOW_MS or reps <= 1:
        return first
    return statistics.median(event_ms(fn, calls) for _ in range(reps))


def event_ms(fn, calls: int = 1) -> float:
    """Milliseconds of one ``fn()`` (the mean of ``calls``): CUDA events on the GPU, the wall clock on the CPU."""
    if device().type != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) * 1e3 / calls
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / calls


class Deadline:
    """A section's time budget: today's torch path (the slowest, a reference) is measured until ``SOFT`` of it has
    passed, the others until all of it has."""

    SOFT = 0.6

    def __init__(self, seconds: float):
        self.start, self.seconds = time.monotonic(), seconds * ARGS.budget_scale

    def passed(self, name: str = "") -> bool:
        share = self.SOFT if name.endswith("torch") else 1.0
        return time.monotonic() - self.start > share * self.seconds


# --- attention contenders: each returns (call(q, k, v, scaling) -> [B, H, q, D], extra parameters) --------------


SDPA = {"gqa": True}


def sdpa_attention(q, k, v, scaling):
    """sdpa's flash backend on CUDA (its default elsewhere), grouped heads by ``enable_gqa`` where the backend
    takes it, else by repeating k / v (as transformers does); causal unless a single query row (a decoding step,
    which sees every cached key)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    backend = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if q.is_cuda else contextlib.nullcontext()
    with backend:
        if SDPA["gqa"]:
            try:
                return sdpa(q, k, v, is_causal=q.shape[-2] > 1, scale=scaling, enable_gqa=True)
            except RuntimeError:
                SDPA["gqa"] = False
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return sdpa(q, k, v, is_causal=q.shape[-2] > 1, scale=scaling)


def sdpa_contender(mapping, heads):
    return sdpa_attention, []


def per_head_alpha(heads: int, alpha: float) -> torch.Tensor:
    """A learnable pre-alpha ``a`` per head (alpha = 1 + sigmoid(a), as ``LearnedAlpha``), starting at ``alpha``."""
    start = math.log((alpha - 1) / (2 - alpha))
    return torch.full((heads,), start, device=device(), dtype=torch.float32, requires_grad=True)


def triton_contender(mapping, heads):
    from hf_sparsemax.attention.gpu.triton_attention import triton_attention

    alpha = MAPPINGS[mapping][2]
    pre = per_head_alpha(heads, MAPPINGS[mapping][1]["alpha"]) if alpha == "learned" else None

    def call(q, k, v, scaling):
        a = 1 + torch.sigmoid(pre) if pre is not None else alpha
        return triton_attention(q, k, v, None, causal=True, alpha=a, scaling=scaling)

    return call, [pre] if pre is not None else []


def attention_options(attention: str, options: dict):
    """The options of today's torch path: ``kernel="torch"`` where that option exists (else the only path)."""
    from hf_sparsemax.attention import interface

    try:
        return interface.AttentionOptions.from_settings(attention, {**options, "kernel": "torch"})
    except ValueError as error:
        if "kernel" not in str(error):
            raise
        return interface.AttentionOptions.from_settings(attention, options)


def torch_contender(mapping, heads):
    """Today's path on the same tensors: ``sparse_attention_forward``, as the patched model calls it."""
    from hf_sparsemax.attention import interface

    attention, options = MAPPINGS[mapping][:2]
    module = torch.nn.Module()
    module.is_causal = True
    setattr(module, interface.OPTIONS_ATTR, attention_options(attention, options))
    if options.get("learn_alpha"):
        module.add_module(interface.ALPHA_ATTR, interface.LearnedAlpha(heads, options["alpha"]).to(device()))

    def call(q, k, v, scaling):
        out, _ = interface.sparse_attention_forward(module, q, k, v, None, scaling=scaling, mapping=attention)
        return out.transpose(1, 2)

    return call, list(module.parameters())


def adasplash_contender(mapping, heads):
    """AdaSplash-2 (entmax15, causal; its scale is fixed at 1/sqrt(d))."""
    if mapping != "entmax15":
        return None
    import adasplash

    if device().type != "cuda":
        raise Unavailable(f"adasplash {getattr(adasplash, '__version__', '?')} imported; its kernels need CUDA "
                          "(inline PTX), not the interpreter")

    def call(q, k, v, scaling):
        if abs(scaling - q.shape[-1] ** -0.5) > 1e-9:
            raise Unavailable("adasplash fixes the scale at 1/sqrt(d)")
        return adasplash.adasplash(q, k, v, alpha=1.5, is_causal=True)

    return call, []


def triton_decode_contender(mapping, heads):
    from hf_sparsemax.attention.gpu.triton_decode import triton_decode

    alpha = MAPPINGS[mapping][2]
    if alpha == "learned":
        alpha = (1 + torch.sigmoid(per_head_alpha(heads, MAPPINGS[mapping][1]["alpha"]))).detach()

    def call(q, k, v, scaling):
        return triton_decode(q, k, v, None, alpha=alpha, scaling=scaling)

    return call, []


CONTENDERS = {"sdpa": sdpa_contender, "triton": triton_contender, "torch": torch_contender,
              "AdaSplash-2": adasplash_contender}
DECODE_CONTENDERS = {"sdpa": sdpa_contender, "triton": triton_decode_contender, "torch": torch_contender}


def runner(call, params, q, k, v, scaling, backward: bool):
    """A callable for :func:`time_ms`: the forward without autograd, or forward + backward (dQ, dK, dV and the
    extra parameters' gradients; the output's gradient drawn once)."""
    if not backward:
        def forward():
            with torch.no_grad():
                return call(q, k, v, scaling)
        return forward
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grad = {}

    def both():
        out = call(*leaves, scaling)
        if "out" not in grad:
            grad["out"] = torch.randn_like(out)
        torch.autograd.grad(out, [*leaves, *params], grad["out"], allow_unused=True)
        return out

    return both


def relative_error(out, reference) -> str:
    if out is None or reference is None:
        return "—"
    out, reference = out.float(), reference.float()
    return f"{(out - reference).norm().item() / max(reference.norm().item(), 1e-30):.1e}"


# --- attention sections --------------------------------------------------------------------------------------


def random_inputs(batch, heads, kv_heads, dim, tokens, queries=None, seed=0):
    """q ``[batch, heads, queries (default tokens), dim]``, k / v ``[batch, kv_heads, tokens, dim]`` from N(0, 1)."""
    generator = torch.Generator(device=device()).manual_seed(seed)
    shapes = [(batch, heads, queries or tokens, dim), (batch, kv_heads, tokens, dim), (batch, kv_heads, tokens, dim)]
    return [torch.randn(shape, generator=generator, device=device()).to(torch.bfloat16) for shape in shapes]


def load_capture() -> dict:
    if not os.path.exists(CAPTURE):
        raise Unavailable(f"{os.path.relpath(CAPTURE, ROOT)} is missing: run benchmarks/capture_qk.py and carry "
                          ".bench_data")
    return torch.load(CAPTURE, weights_only=True)


def real_inputs(capture: dict, batch: int, tokens: int):
    """The captured layers' q / k / v, their first ``tokens`` positions, tiled to ``batch``."""
    q, k, v = (capture[name][:, :, :tokens] for name in ("query", "key", "value"))
    index = torch.arange(batch) % q.shape[0]
    return [t[index].contiguous().to(device(), torch.bfloat16) for t in (q, k, v)]


class Cells:
    """Measures contenders on the same tensors, one table's worth: builds each contender once per mapping, times
    its calls, keeps the forward's output for the error column, notes why a cell is n/a, and skips a contender
    at larger sizes after a call over ``TOO_SLOW_MS`` or past the section's deadline."""

    def __init__(self, contenders: dict, heads: int, deadline: Deadline, calls: int = 1):
        self.contenders, self.heads, self.deadline, self.calls = contenders, heads, deadline, calls
        self.notes, self.built, self.slow = Notes(), {}, set()

    def measure(self, mapping, q, k, v, scaling, backward: bool, base=None) -> tuple[dict, dict]:
        """``({contender: ms, "—" (not a contender here), "skipped" or None (n/a)}, {contender: forward output})``;
        ``base``: sdpa's time already measured on these tensors."""
        times, outs = {}, {}
        for name in self.contenders:
            if name == "sdpa" and base is not None:
                times[name] = base
                continue
            times[name] = self.one(name, mapping, q, k, v, scaling, backward, outs)
        return times, outs

    def one(self, name, mapping, q, k, v, scaling, backward, outs):
        if self.deadline.passed(name):
            return "skipped"
        key = (name, mapping)
        if key in self.slow:
            self.notes.failed(name, f"not measured at larger sizes after a call over {TOO_SLOW_MS / 1e3:g} s")
            return None
        try:
            if key not in self.built:
                self.built[key] = self.contenders[name](mapping, self.heads)
            if self.built[key] is None:
                return "—"
            run = runner(*self.built[key], q, k, v, scaling, backward)
            ms = time_ms(run, ARGS.sizes.reps, self.calls)
            if not backward:
                outs[name] = run()
            if ms > TOO_SLOW_MS:
                self.slow.add(key)
            return ms
        except Exception as error:  # noqa: BLE001 - a contender's failure is a table cell
            self.notes.failed(name, error)
            if device().type == "cuda":
                torch.cuda.empty_cache()  # after an out-of-memory error, for the next contender
            return None


def sdpa_note() -> str:
    return f"sdpa: flash backend on CUDA, grouped heads by {'enable_gqa' if SDPA['gqa'] else 'repeated k / v'}"


def attention_table(report, title, shape, sizes_list, make_inputs, scaling, deadline) -> None:
    cells, rows = Cells(CONTENDERS, shape[0], deadline), []
    for tokens in sizes_list:
        q, k, v = make_inputs(max(1, ARGS.sizes.fill // tokens), tokens)
        for backward in (False, True):
            base = None
            for mapping in MAPPINGS:
                times, outs = cells.measure(mapping, q, k, v, scaling, backward, base)
                base = times["sdpa"]
                rows.append(attention_row(report, title, tokens, backward, mapping, times, outs))
        del q, k, v
    text = markdown_table(["tokens", "pass", "attention", "sdpa ms", "triton", "torch path", "AdaSplash-2",
                           "triton err", "target (triton)", "vs AdaSplash-2"], rows)
    report.add(f"### {title}\n\n{text}\n\nRatios to sdpa ({sdpa_note()}); batch = {ARGS.sizes.fill} tokens / "
               "length; \"triton err\": ||triton - torch path|| / ||torch path|| of the forward.\n"
               + cells.notes.text())


def attention_row(report, title, tokens, backward, mapping, times, outs) -> list:
    base = times.get("sdpa")
    base = base if isinstance(base, float) else None
    cells = []
    for name in ("triton", "torch", "AdaSplash-2"):
        value = times.get(name)
        cells.append(value if value in ("—", "skipped") else ratio_cell(value, base))
    triton = times.get("triton")
    ratio = triton / base if isinstance(triton, float) and base else None
    target = MAPPINGS[mapping][3] if backward else TARGET_FORWARD
    what = f"{short(title)}, {tokens} tokens, {'fwd+bwd' if backward else 'fwd'}, {mapping}"
    verdict = report.verdict(ratio, target, what) if tokens >= ARGS.sizes.target_from else "reported"
    versus = ""
    ada = times.get("AdaSplash-2")
    if backward and isinstance(ada, float) and mapping == "entmax15":
        versus = report.verdict(triton / ada if isinstance(triton, float) else None, 1.0, what + " vs AdaSplash-2")
    error = relative_error(outs.get("triton"), outs.get("torch")) if not backward else ""
    return [tokens, "fwd+bwd" if backward else "fwd", mapping, ms_cell(base), *cells, error, verdict, versus]


def decode_inputs(batch, shape, context, capture=None):
    """One query row against ``context`` cached keys: random, or the captured text's row at ``context - 1``."""
    if capture is None:
        return random_inputs(batch, *shape, context, queries=1)
    q, k, v = real_inputs(capture, batch, context)
    return q[:, :, -1:].contiguous(), k, v


def section_decode(report) -> None:
    """One decoding call (a query row against a cache, no autograd): sdpa, ``triton_decode``, the torch path."""
    deadline = Deadline(ARGS.sizes.budgets["decode"])
    capture = load_capture() if os.path.exists(CAPTURE) else None
    cases = [(title, shape, None, shape[-1] ** -0.5) for title, shape in HEADS.items()]
    if capture is not None:
        cases.append(("SmolLM2, real text", capture_shape(capture), capture, float(capture["scaling"])))
    for title, shape, data, scaling in cases:
        cells, rows = Cells(DECODE_CONTENDERS, shape[0], deadline, calls=ARGS.sizes.decode_calls), []
        for batch in ARGS.sizes.batches:
            for context in ARGS.sizes.contexts:
                q, k, v = decode_inputs(batch, shape, context, data)
                base = None
                for mapping in MAPPINGS:
                    times, outs = cells.measure(mapping, q, k, v, scaling, False, base)
                    base = times["sdpa"]
                    sdpa = base if isinstance(base, float) else None
                    rows.append([context, batch, mapping, "n/a" if sdpa is None else f"{sdpa * 1e3:.0f}",
                                 *(times[n] if times[n] in ("—", "skipped") else ratio_cell(times[n], sdpa)
                                   for n in ("triton", "torch")),
                                 relative_error(outs.get("triton"), outs.get("torch"))])
        report.add(f"### Decoding call (one query row against the cache), {title}\n\n"
                   + markdown_table(["cached tokens", "batch", "attention", "sdpa µs", "triton_decode", "torch path",
                                     "triton err"], rows)
                   + f"\n\nRatios to sdpa ({sdpa_note()}); each sample the mean of {ARGS.sizes.decode_calls} calls; "
                   "reported (the target is the whole model's token, below).\n" + cells.notes.text())


def capture_shape(capture: dict) -> tuple[int, int, int]:
    """``(query heads, kv heads, head dim)`` of the captured layers."""
    return capture["query"].shape[1], capture["key"].shape[1], capture["query"].shape[-1]


def short(title: str) -> str:
    """A table's title without its parenthesised details, for the summary."""
    return re.sub(r" \([^)]*\)", "", title)


def section_random(report) -> None:
    deadline = Deadline(ARGS.sizes.budgets["random"])
    for title, shape in HEADS.items():
        heads, kv_heads, dim = shape
        make = lambda batch, tokens, s=shape: random_inputs(batch, *s, tokens)  # noqa: E731
        attention_table(report, f"Attention call, random scores, {title}", shape, ARGS.sizes.attention, make,
                        dim ** -0.5, deadline)


def section_real(report) -> None:
    deadline = Deadline(ARGS.sizes.budgets["real"])
    capture = load_capture()
    layers, shape = capture["layers"], capture_shape(capture)
    sizes_list = [t for t in ARGS.sizes.real if t <= capture["query"].shape[2]]
    make = lambda batch, tokens: real_inputs(capture, batch, tokens)  # noqa: E731
    attention_table(report, f"Attention call, real-text scores (SmolLM2 layers {layers}, fortunes)", shape,
                    sizes_list, make, float(capture["scaling"]), deadline)


# --- whole-model sections ------------------------------------------------------------------------------------


def build_model():
    """``(model, what it is)``: the pretrained SmolLM2-135M-Instruct where its offline asset is installed, else a
    random-init Llama with its config (``--tiny``: a tiny one), bfloat16 on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    what, reason = None, "--model random"
    if not ARGS.tiny and ARGS.model != "random":
        try:
            from hf_sparsemax.app.assets import load_smollm2

            model, _ = load_smollm2(dtype=torch.bfloat16, attn_implementation="sdpa")
            what = "the pretrained SmolLM2-135M-Instruct (offline GGUF)"
        except Exception as error:  # noqa: BLE001 - the fallback is said in the output
            reason = f"{type(error).__name__}: {error}"
    if what is None:
        config = LlamaConfig(**(TINY_LLAMA if ARGS.tiny else SMOLLM2))
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.set_attn_implementation("sdpa")
        what = ("a tiny random-init Llama (--tiny)" if ARGS.tiny else "a RANDOM-INIT Llama with SmolLM2-135M's "
                f"config (the pretrained model is not here: {reason[:200]}); near-uniform attention, wide supports")
    return model.to(device(), torch.bfloat16), what


def text_tokens(rows: int, length: int, vocab: int) -> tuple[torch.Tensor, str]:
    """``[rows, length]`` token ids: fortunes text from the capture file, else random ids."""
    if os.path.exists(CAPTURE):
        tokens = torch.load(CAPTURE, weights_only=True)["tokens"]
        if tokens.shape[0] >= rows and tokens.shape[1] >= length:
            return tokens[:rows, :length].long().to(device()), "fortunes text"
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (rows, length), generator=generator).to(device()), "random token ids"


def patched(model, mapping: str, kernel: str) -> str:
    """Patch ``model`` with ``mapping`` on ``kernel`` ("sdpa": the model as loaded); returns a note ("" if none)."""
    import hf_sparsemax as hs

    hs.unpatch_model(model)
    if mapping == "sdpa":
        return ""
    attention, options = MAPPINGS[mapping][:2]
    try:
        hs.patch_model(model, attn=attention, attn_options={**options, "kernel": kernel})
        return ""
    except ValueError as error:
        if "kernel" not in str(error):
            raise
        if kernel != "torch":
            raise Unavailable("patch_model takes no 'kernel' attention option here") from None
        hs.patch_model(model, attn=attention, attn_options=options)
        return "patch_model takes no 'kernel' option here: its only path, the torch path"


def each_cell(model, mapping: str, kernel: str, cases: list, notes: Notes, deadline: Deadline):
    """Yields ``(case, cell)`` for one contender patched into ``model`` (unpatched after); ``cell(measure)`` gives
    ``measure()``, None where it fails (the reason in ``notes``), "skipped" past the deadline."""
    import hf_sparsemax as hs

    name = f"{mapping} {kernel}" if mapping != "sdpa" else "sdpa"
    try:
        note = patched(model, mapping, kernel)
    except Exception as error:  # noqa: BLE001 - the contender's cells print n/a
        notes.failed(name, error)
        note = None
    if note:
        notes.failed(f"{mapping} {kernel}", note)

    def cell(measure):
        if deadline.passed(kernel):
            return "skipped"
        if note is None:
            return None
        try:
            return measure()
        except Exception as error:  # noqa: BLE001
            notes.failed(name, error)
            return None

    try:
        for case in cases:
            yield case, cell
    finally:
        hs.unpatch_model(model)


def model_contenders() -> list[tuple[str, str]]:
    return [("sdpa", "sdpa")] + [(m, k) for k in MODEL_KERNELS for m in MAPPINGS]  # torch path last


def peak_mb(fn) -> float | None:
    if device().type != "cuda":
        return None
    sync()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return torch.cuda.max_memory_allocated() / 2 ** 20


def section_train(report) -> None:
    deadline = Deadline(ARGS.sizes.budgets["train"])
    model, what = build_model()
    model.train()
    ids, source = text_tokens(1, max(ARGS.sizes.train), model.config.vocab_size)
    notes, results = Notes(), {}

    def step(tokens):
        def run():
            model(input_ids=ids[:, :tokens], labels=ids[:, :tokens]).loss.backward()
            model.zero_grad(set_to_none=True)
        return run

    for mapping, kernel in model_contenders():
        for tokens, cell in each_cell(model, mapping, kernel, ARGS.sizes.train, notes, deadline):
            results[mapping, kernel, tokens] = cell(lambda: (time_ms(step(tokens), ARGS.sizes.reps),
                                                             peak_mb(step(tokens))))
    report.add(train_table(report, results, notes, what, source))
    del model


def train_table(report, results, notes, what, source) -> str:
    rows = []
    for tokens in ARGS.sizes.train:
        base = results.get(("sdpa", "sdpa", tokens))
        base = base if isinstance(base, tuple) else (None, None)
        for mapping, kernel in model_contenders()[1:]:
            got = results.get((mapping, kernel, tokens))
            if got == "skipped":
                rows.append([tokens, mapping, kernel, "skipped (section time budget)", "", "", "", ""])
                continue
            ms, mb = got if isinstance(got, tuple) else (None, None)
            step = ms / base[0] if ms and base[0] else None
            memory = mb / base[1] if mb and base[1] else None
            what_row = f"training step, {tokens} tokens, {mapping} {kernel}"
            rows.append([tokens, mapping, kernel, ms_cell(base[0]), ratio_cell(ms, base[0]),
                         report.verdict(step, TARGET_STEP, what_row) if kernel == "triton" else "",
                         "n/a" if mb is None else f"{mb:.0f} MiB ({memory:.2f}x)" if memory else f"{mb:.0f} MiB",
                         report.verdict(memory, TARGET_MEMORY, what_row + " memory") if kernel == "triton" else ""])
    sdpa_mb = [results.get(("sdpa", "sdpa", t)) for t in ARGS.sizes.train]
    memory = ", ".join(f"{t}: {r[1]:.0f} MiB" for t, r in zip(ARGS.sizes.train, sdpa_mb)
                       if isinstance(r, tuple) and r[1] is not None)
    return (f"### Training step (forward + backward, batch 1), {what}, {source}\n\n"
            + markdown_table(["tokens", "attention", "kernel", "sdpa ms", "step", "target", "peak memory",
                              "memory target"], rows)
            + f"\n\nsdpa's peak memory: {memory or 'n/a'}.\n" + notes.text())


def prefill(model, ids):
    from transformers import DynamicCache

    with torch.no_grad():
        return model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True,
                     logits_to_keep=1)


def decode_ms(model, ids, context: int) -> float:
    """Median milliseconds of a decoding step from a ``context``-token cache (teacher-forced next tokens)."""
    out = prefill(model, ids[:, :context])
    cache, times = out.past_key_values, []
    with torch.no_grad():
        for i in range(ARGS.sizes.steps):
            following = ids[:, context + i : context + i + 1]
            times.append(event_ms(lambda: model(input_ids=following, past_key_values=cache, use_cache=True)))
    return statistics.median(times[2:] if len(times) > 3 else times)


def step_profile(model, ids, context: int, name: str) -> str:
    """One decoding step from a ``context``-token cache under torch.profiler: its wall time (synchronised) and the
    ten operators with the most self time on the device (the CPU under ``--tiny``), to tell where a step's time
    goes (the H100 run measured sdpa's whole-model step at 62-98 ms, slower than its 2048-token prefill: a
    number to explain, not to trust)."""
    from torch.profiler import ProfilerActivity, profile

    cache = prefill(model, ids[:, :context]).past_key_values
    following = ids[:, context : context + 1]
    cuda = device().type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad():
        model(input_ids=following, past_key_values=cache, use_cache=True)  # warm-up, then crop back
        cache.crop(-1)
        sync()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            model(input_ids=following, past_key_values=cache, use_cache=True)
            sync()
            wall = (time.perf_counter() - start) * 1e3
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:10]
    rows = [[e.key[:60], e.count, f"{e.self_cpu_time_total / 1e3:.3f}"]
            + ([f"{getattr(e, key, 0.0) / 1e3:.3f}"] if cuda else []) for e in events]
    return (f"**{name}**, {context} cached tokens, batch {ids.shape[0]}: wall {wall:.2f} ms\n\n"
            + markdown_table(["operator", "calls", "self CPU ms"] + (["self device ms"] if cuda else []), rows))


def section_inference(report) -> None:
    deadline = Deadline(ARGS.sizes.budgets["inference"])
    model, what = build_model()
    model.eval()
    longest = max(ARGS.sizes.contexts) + ARGS.sizes.steps
    ids, source = text_tokens(max(ARGS.sizes.batches), longest, model.config.vocab_size)
    notes, results, profiles = Notes(), {}, []
    cases = [(batch, context) for batch in ARGS.sizes.batches for context in ARGS.sizes.contexts]
    for mapping, kernel in model_contenders():
        for (batch, context), cell in each_cell(model, mapping, kernel, cases, notes, deadline):
            rows = ids[:batch]
            results[mapping, kernel, batch, context] = cell(lambda: (
                time_ms(lambda: prefill(model, rows[:, :context]), min(ARGS.sizes.reps, 3)),
                decode_ms(model, rows, context)))
            if (batch, context) == cases[0] and kernel in ("sdpa", "triton") and not deadline.passed(kernel):
                try:
                    profiles.append(step_profile(model, rows, context, f"{mapping} {kernel}"))
                except Exception as error:  # noqa: BLE001 - a profile is a diagnostic; the table stands
                    notes.failed(f"{mapping} {kernel} profile", error)
    report.add(inference_table(report, results, notes, what, source))
    report.add("### One decoding step, profiled\n\n" + "\n\n".join(profiles))
    del model


def inference_table(report, results, notes, what, source) -> str:
    rows = []
    for batch in ARGS.sizes.batches:
        for context in ARGS.sizes.contexts:
            base = results.get(("sdpa", "sdpa", batch, context))
            base = base if isinstance(base, tuple) else (None, None)
            for mapping, kernel in model_contenders()[1:]:
                got = results.get((mapping, kernel, batch, context))
                if got == "skipped":
                    rows.append([context, batch, mapping, kernel, "skipped (section time budget)", "", "", "", "", ""])
                    continue
                pre, dec = got if isinstance(got, tuple) else (None, None)
                label = f"{context} cached tokens, batch {batch}, {mapping} {kernel}"
                pre_ratio = pre / base[0] if pre and base[0] else None
                dec_ratio = dec / base[1] if dec and base[1] else None
                triton = kernel == "triton"
                pre_verdict = (report.verdict(pre_ratio, TARGET_FORWARD, "prefill, " + label)
                               if triton and context >= ARGS.sizes.target_from else "reported" if triton else "")
                rows.append([context, batch, mapping, kernel, ms_cell(base[0]), ratio_cell(pre, base[0]), pre_verdict,
                             ms_cell(base[1]), ratio_cell(dec, base[1]),
                             report.verdict(dec_ratio, TARGET_DECODE, "decoding, " + label) if triton else ""])
    return (f"### Prefill and decoding per token, {what}, {source}\n\n"
            + markdown_table(["context", "batch", "attention", "kernel", "sdpa prefill ms", "prefill", "target",
                              "sdpa decode ms", "decode / token", "target"], rows)
            + "\n\n" + notes.text())


# --- main ----------------------------------------------------------------------------------------------------


SECTIONS = {"random": section_random, "real": section_real, "decode": section_decode, "train": section_train,
            "inference": section_inference}


def versions() -> str:
    found = [f"torch {torch.__version__}"]
    for name in ("triton", "transformers", "adasplash"):
        try:
            found.append(f"{name} {getattr(__import__(name), '__version__', '?')}")
        except Exception as error:  # noqa: BLE001
            found.append(f"{name} not importable ({type(error).__name__})")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    where = torch.cuda.get_device_name() if device().type == "cuda" else "CPU"
    interpret = " TRITON_INTERPRET=1" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return f"{where}{interpret}; {', '.join(found)}; hf_sparsemax {commit or '(no git)'}"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="every section on CPU, tiny sizes, TRITON_INTERPRET=1")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--model", default="auto", choices=["auto", "random"],
                        help="auto: the pretrained SmolLM2 where its asset is installed, else random-init")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiplies every section's time budget")
    args = parser.parse_args()
    args.sizes = TINY_SIZES if args.tiny else GPU_SIZES
    return args


def main() -> None:
    started = time.monotonic()
    report = Report()
    report.add(f"# bench_gpu.py (issue 46)\n\n{versions()}; bfloat16")
    if device().type != "cuda" and not ARGS.tiny:
        report.add("No CUDA device: the sizes are the GPU's; use --tiny for a rehearsal on the CPU.")
    for name in ARGS.sections:
        section_start = time.monotonic()
        try:
            SECTIONS[name](report)
        except Unavailable as error:
            report.add(f"### section {name}: not available ({error})")
        except Exception as error:  # noqa: BLE001 - a crash must not lose the other tables
            report.add(f"### section {name}: FAILED\n\n```\n{traceback.format_exc()[-3000:]}```")
            del error
        if device().type == "cuda":
            torch.cuda.empty_cache()
        print(f"[section {name}: {time.monotonic() - section_start:.0f} s]", flush=True)
    report.summary()
    report.add(f"Total time: {time.monotonic() - started:.0f} s.")


if __name__ == "__main__":
    ARGS = parse()
    main()
