"""Shared by the benchmark scripts: interleaved medians and peak memory in a fresh process."""

from __future__ import annotations

import multiprocessing
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


def _child(setup, args, fn_name, queue):
    state = setup(*args)  # inputs allocated before the baseline
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the high-water mark to the current size
    state[fn_name]()
    queue.put((_status_kib("VmHWM") - base) / 1024)


def peak_memory_mb(setup: Callable[..., dict[str, Callable[[], None]]], args: tuple, fn_name: str) -> float:
    """Peak resident memory (MiB) that ``setup(*args)[fn_name]()`` adds, in a fresh spawned process.

    ``setup`` must be a module-level function (spawn pickles it by name); a
    forked child would deadlock in torch's thread pool.
    """
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(setup, args, fn_name, queue))
    process.start()
    result = queue.get()
    process.join()
    return result

