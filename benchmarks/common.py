"""Shared by the benchmark scripts: interleaved medians and peak memory in a fresh process."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import statistics
import time
from typing import Callable

import torch

SLOW_SECONDS = 5.0  # a contender slower than this gets only two timed rounds


def interleaved_medians(fns: dict[str, Callable[[], None]], repeats: int, calls: int = 1) -> dict[str, float]:
    """Median milliseconds of each callable, run round-robin so drift hits all of them alike; each sample is the
    mean of ``calls`` calls in a row (short calls: one call's time is mostly noise)."""
    times = {name: [] for name in fns}
    slow = set()
    for round_ in range(repeats + 1):  # round 0 warms up
        for name, fn in fns.items():
            if name in slow and round_ > 2:
                continue
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            elapsed = (time.perf_counter() - start) / calls
            if round_:
                times[name].append(elapsed)
            if elapsed > SLOW_SECONDS:
                slow.add(name)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def mapping_call(fn: Callable, x, backward: bool) -> Callable[[], None]:
    """One timed call of ``fn(x)``; with ``backward``, also its backward from a fresh leaf (gradient of ones)."""

    def once():
        inp = x.detach().requires_grad_() if backward else x
        out = fn(inp)
        if backward:
            out.backward(torch.ones_like(out))

    return once


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


# glibc's allocator: a fixed mmap threshold (its default grows up to 32 MiB as tensors are freed, after which
# freed tensors stay in the heap, resident, by chance) and a trim before the baseline, so the high-water mark is
# the peak of live memory, not of what the allocator happened to keep (three runs of sdpa at 512 tokens: 395-402
# MiB without, 379 / 379 / 379 with)
MALLOC_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def _trim_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc: nothing to trim
        pass


def _child(setup, args, fn_name, queue):
    state = setup(*args)  # inputs allocated before the baseline
    _trim_heap()
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the high-water mark to the current size
    state[fn_name]()
    queue.put((_status_kib("VmHWM") - base) / 1024)


def peak_memory_mb(setup: Callable[..., dict[str, Callable[[], None]]], args: tuple, fn_name: str) -> float:
    """Peak resident memory (MiB) that ``setup(*args)[fn_name]()`` adds, in a fresh spawned process (its allocator
    set up by :data:`MALLOC_ENVIRONMENT`, its heap trimmed before the baseline).

    ``setup`` must be a module-level function (spawn pickles it by name); a
    forked child would deadlock in torch's thread pool.
    """
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(setup, args, fn_name, queue))
    saved = {name: os.environ.get(name) for name in MALLOC_ENVIRONMENT}
    os.environ.update(MALLOC_ENVIRONMENT)  # read by the child's C library at start
    try:
        process.start()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    result = queue.get()
    process.join()
    return result



def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table: one header row, then one line per row (cells shown with ``str``)."""
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"
    lines = ["| " + " | ".join(headers) + " |", rule]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
