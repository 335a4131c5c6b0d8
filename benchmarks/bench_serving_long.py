r"""vLLM decoding throughput at long context: a sparse-attention folder against its softmax twin, alternating.

The offline SmolLM2-135M-Instruct (30 layers, float32) saved twice (``bench_serving_attention.save_folders``): as
it is (vLLM's own C++ CPU attention) and patched with ``--attn`` (hf_sparsemax's backend over vLLM's paged cache,
the int8 key certificate on its decode steps). Both engines are up at once (chunked prefill and prefix caching on,
each its own engine process) and every timed round runs one after the other, in alternating order.

Prompts: for each ``--prompt-tokens`` length (0: the short prompts of ``bench_serving_attention.py``), ``--batch``
requests of CPython's documentation text (``pydoc_data.topics``). A batch of long prompts shares its first
``length - TAIL`` tokens and each prompt ends with ``TAIL`` tokens of its own (a different passage): prefix caching
prefills the shared part once. Every prompt is prefilled once (and its prefix cached) by a warm-up before the timed
rounds, so a round prefills only the tokens of each prompt that the prefix cache does not hold (its last partial
block).

Decoding time, prefill separated: each round times ``generate(max_tokens=1)`` and then
``generate(max_tokens=1 + --new-tokens)`` of the same prompts (``ignore_eos``); both prefill the same
(prefix-cached) way, so their difference is the time of ``--new-tokens`` decode steps of the batch:
``tokens/s = batch * new_tokens / (t_long - t_short)``, median over ``--repeats`` rounds, ``t`` by the wall clock
and by the CPU time (user + system) of the engine's own processes (its engine core and worker: on a shared machine
the wall clock counts the other programs' bursts too). Printed per setting: both engines' decoding tokens/s and
the ratio (sparse / softmax), each by both clocks, the share of keys the int8 certificate never read
in the sparse engine's steps of the setting, warm-up included (read from its engine process), each engine's
median wall seconds to the first token (``t_short``: the uncached tails prefilled over the cached prefix, one
token sampled), ``uptime``'s load before and after, and the targets of issue 55 (long prompts at 8k: >= 1.3x at
batch 1 and 8; short prompts at batch 8: >= 1.0x) met or MISSED by each clock. ``--profile``: then one
``generate(1 + new tokens)`` of the last setting profiled in each engine process (cProfile, the thread's CPU time).

SmolLM2 has 8192 positions: ``--rope-factor F`` saves both folders with its rotary positions linearly interpolated
``F`` times (``bench_interleaved.rope_options``: the same config in both, so the twin is the same model; vLLM and
transformers read it from the folder), for prompts up to ``8192 F`` tokens; a longer prompt is refused. Memory:
SmolLM2's float32 KV is 45 KiB a token, so 16000-token prompts (``--rope-factor 2``) hold ~0.75 GiB of cache in
each engine at batch 1 and 8 alike (a batch's shared prefix is cached once, each prompt's own last blocks beside
it); ``VLLM_CPU_KVCACHE_SPACE=3`` (69.5k tokens) leaves room for the earlier settings' prefixes, and the entmax15
engine's int8 codes take 14% more than the cache space (they code every slot: 0.42 GiB for 3 GiB).

    VLLM_CPU_KVCACHE_SPACE=2 PYTHONPATH=.:benchmarks python benchmarks/bench_serving_long.py \
        --prompt-tokens 0 2048 8000 --batch 1 8 --new-tokens 32 --repeats 3
    VLLM_CPU_KVCACHE_SPACE=3 PYTHONPATH=.:benchmarks python benchmarks/bench_serving_long.py --rope-factor 2 \
        --prompt-tokens 16000 --batch 1 8 --new-tokens 32 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the certificate's counts read by collective_rpc

from bench_interleaved import rope_options  # noqa: E402
from bench_serving_attention import save_folders  # noqa: E402

TAIL = 16  # tokens of its own at the end of each prompt of a long batch
BLOCK_SIZE = 128  # vLLM's cache block (slots): a multiple of the certificate's code blocks
POSITIONS = 8192  # SmolLM2's trained positions
TARGETS = {(8000, 1): 1.3, (8000, 8): 1.3, (0, 8): 1.0}  # (prompt tokens from, batch): decoding tokens/s ratio


def text_ids(tokenizer) -> list[int]:
    from hf_sparsemax.app.assets import pydoc_topics

    return tokenizer("\n\n".join(pydoc_topics()))["input_ids"]


def prompts_of(ids: list[int], tokenizer, length: int, batch: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` tokens sharing all but their last ``TAIL`` (0: the short prompts)."""
    if length == 0:
        return [tokenizer(f"Story number {i}: once upon a time")["input_ids"] for i in range(batch)]
    if len(ids) < length + batch * TAIL * 64:
        raise ValueError(f"the documentation text has {len(ids)} tokens, too few for {length}-token prompts")
    shared = ids[: length - TAIL]
    return [shared + ids[length + i * TAIL * 64 : length + i * TAIL * 64 + TAIL] for i in range(batch)]


def certificate_counts(worker) -> dict:
    """The int8 certificate's counts in an engine process (run there by ``collective_rpc``)."""
    from hf_sparsemax.attention.blocked import keycodes

    return dict(keycodes.COUNTS)


def reset_counts(worker) -> None:
    from hf_sparsemax.attention.blocked import keycodes

    keycodes.reset_counts()


def start_profile(worker) -> None:
    """Profile the engine process's thread (cProfile) from now on (run there by ``collective_rpc``)."""
    import cProfile
    import time

    worker.hf_sparsemax_profile = cProfile.Profile(time.thread_time)
    worker.hf_sparsemax_profile.enable()


def stop_profile(worker, lines: int = 30) -> str:
    """The profile since :func:`start_profile`: the functions with most time of their own, and the cumulative time
    of the attention layers' forward (hf_sparsemax's backend, or vLLM's own)."""
    import io
    import pstats

    worker.hf_sparsemax_profile.disable()
    stream = io.StringIO()
    stats = pstats.Stats(worker.hf_sparsemax_profile, stream=stream)  # CPU time of the thread (not the wall)
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(r"(backend|cpu_attn|paged_attention|fused|keycodes|layer)\.py.*"
                                               r"(forward|paged_attention|kernel_decode|write_cache|step_of|step_plan"
                                               r"|paged_decode|code_slots|tally|execute_model)")
    return stream.getvalue()


def load() -> str:
    return os.getloadavg()[0].__format__(".1f")


def engine(folder: str, max_len: int, batched: int):
    from vllm import LLM

    return LLM(model=folder, dtype="float32", max_model_len=max_len, enforce_eager=True, seed=0,
               block_size=BLOCK_SIZE, enable_chunked_prefill=True, enable_prefix_caching=True,
               max_num_batched_tokens=batched)


def children() -> set:
    import psutil

    return set(psutil.Process().children(recursive=True))


def cpu_seconds(processes) -> float:
    """User + system CPU seconds of an engine's processes (those still running)."""
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except Exception:  # noqa: BLE001 (psutil.NoSuchProcess and the like: a process that ended)
            continue
        total += times.user + times.system
    return total


def timed(llm, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(wall seconds, the engine's CPU seconds) of one ``generate`` of ``tokens`` tokens a prompt."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    processes = getattr(llm, "bench_processes", ())
    cpu, start = cpu_seconds(processes), time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, cpu_seconds(processes) - cpu


def setting(engines: dict, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict[str, tuple]:
    """Each engine's median decoding tokens/s on ``prompts`` by the wall clock and by its processes' CPU time, and
    its median wall seconds to the first token (``generate(max_tokens=1)``: the prefix-cached prompts' uncached
    tails prefilled; rounds alternating the engines' order)."""
    names = list(engines)
    for name in names:  # warm-up: every prompt prefilled and its blocks cached
        timed(engines[name], prompts[:1], 1)
        timed(engines[name], prompts, 2)
    decode = {name: [] for name in names}
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            short = timed(engines[name], prompts, 1)
            long = timed(engines[name], prompts, 1 + new_tokens)
            decode[name].append((long[0] - short[0], long[1] - short[1], short[0]))
    tokens = len(prompts) * new_tokens
    return {name: (*(tokens / statistics.median(t[i] for t in times) for i in (0, 1)),
                   statistics.median(t[2] for t in times)) for name, times in decode.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attn", default="entmax15")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[0, 2048, 8000])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="then profile one generate(1 + new tokens) of the last setting in each engine (cProfile)")
    parser.add_argument("--max-batched", type=int, default=2048, help="vLLM's max_num_batched_tokens (chunk size)")
    parser.add_argument("--rope-factor", type=float, default=None,
                        help="SmolLM2's rope interpolated linearly this many times in both folders (16k prompts: 2)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    max_len = max(max(args.prompt_tokens), 64) + args.new_tokens + 8
    if max_len > POSITIONS * (args.rope_factor or 1):
        raise ValueError(f"prompts of {max(args.prompt_tokens)} tokens and {args.new_tokens} new ones pass "
                         f"SmolLM2's {POSITIONS} positions (x{args.rope_factor or 1}): pass a larger --rope-factor")
    with tempfile.TemporaryDirectory() as root:
        folders = save_folders(root, args.attn, **rope_options(args.rope_factor))
        tokenizer = AutoTokenizer.from_pretrained(folders["softmax"])
        ids = text_ids(tokenizer)
        engines = {}
        for name, folder in folders.items():
            before = children()
            engines[name] = engine(folder, max_len, args.max_batched)
            engines[name].bench_processes = children() - before  # its engine core and worker
        sparse = engines[args.attn]
        print(f"\n{args.attn} against softmax, vLLM {BLOCK_SIZE}-slot blocks, chunked prefill "
              f"({args.max_batched} tokens a step), prefix caching; {args.new_tokens} decode tokens a request, "
              f"median of {args.repeats} alternating rounds; long batches share all but {TAIL} tokens a prompt"
              + (f"; rope x{args.rope_factor:g} (linear)" if args.rope_factor else ""))
        print("Each engine's decoding tokens/s by the wall clock, and by its processes' CPU time (user + system: "
              "what a step costs, less the other programs that share the cores)")
        print(f"| prompt tokens | batch | softmax tokens/s (wall / CPU) | {args.attn} tokens/s (wall / CPU) | "
              "ratio (wall / CPU) | keys never read | first token s (softmax / sparse) | load before / after | "
              "target (wall / CPU) |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
        for length in args.prompt_tokens:
            for batch in args.batch:
                prompts = prompts_of(ids, tokenizer, length, batch)
                before = load()
                sparse.collective_rpc(reset_counts)
                rates = setting(engines, prompts, args.new_tokens, args.repeats)
                counts = sparse.collective_rpc(certificate_counts)[0]
                never = f"{counts['certified'] / counts['keys']:.1%}" if counts["keys"] else "-"
                ratios = [rates[args.attn][i] / rates["softmax"][i] for i in (0, 1)]
                goal = next((floor for (start, size), floor in TARGETS.items()
                             if size == batch and (length >= start if start else length == 0)), None)
                verdict = "-" if goal is None else f">= {goal}x: " + " / ".join(
                    "met" if ratio >= goal else "MISSED" for ratio in ratios)
                soft, mine = (" / ".join(f"{rate:.1f}" for rate in rates[name][:2]) for name in ("softmax", args.attn))
                first = " / ".join(f"{rates[name][2]:.2f}" for name in ("softmax", args.attn))
                print(f"| {length or 'short'} | {batch} | {soft} | {mine} | {ratios[0]:.2f}x / {ratios[1]:.2f}x | "
                      f"{never} | {first} | {before} / {load()} | {verdict} |", flush=True)
        for name, llm in engines.items() if args.profile else ():
            timed(llm, prompts, 1)
            llm.collective_rpc(start_profile)
            timed(llm, prompts, 1 + args.new_tokens)
            print(f"\n### {name}: profile of generate(1 + {args.new_tokens}), {len(prompts)} prompts of "
                  f"{length or 'short'} tokens\n{llm.collective_rpc(stop_profile)[0]}", flush=True)
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
