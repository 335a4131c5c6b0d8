"""``hf-sparsemax bench attention``: each sparse attention against sdpa, at each context, four passes.

- ``call``: one attention call, forward without autograd (as in a prefill), on random queries, keys and values
  of SmolLM2-135M's heads (9 query heads, 3 KV heads, dimension 64; scores ~ N(0, 1)), causal, batch 1: sdpa is
  transformers' sdpa function, the sparse attentions the function the patched model calls;
- ``train``: one training step (forward and backward of the causal-LM loss) of a 4-layer SmolLM2-shaped Llama
  with random weights (dense attention: the sparse attentions' worst case), batch 1; ``--model smollm2``: of the
  pretrained SmolLM2-135M-Instruct (30 layers) on the fortunes text;
- ``prefill``: one forward over the prompt (fortunes text where the offline SmolLM2 asset is installed) into a
  fresh ``DynamicCache``, under ``no_grad``, of the pretrained SmolLM2-135M-Instruct (``--model random``: its
  shape with random weights, whose near-uniform scores give the sparse attentions wide supports); past its 8192
  positions the rope is interpolated linearly (x2 to 16384 tokens, x4 to 32768);
- ``decode``: a greedy decoding step (one token) from that cache.

Each contender is its own copy of the model; every number is the median of interleaved rounds (every contender
once a round, after a warm-up round); the table shows sdpa's milliseconds and each sparse attention's time as a
multiple of sdpa's. ``--memory`` adds the training step's peak memory: what one step adds over the loaded model
and its inputs, after a warm-up step, each contender in a fresh process (CPU: the resident high-water mark, with
glibc's heap trimmed first and its mmap threshold fixed, so that it is the peak of live memory rather than of
what the allocator happened to keep; CUDA: ``torch.cuda.max_memory_allocated``). AdaSplash (``adasplash``,
entmax 1.5) joins the ``call`` pass under ``--device cuda`` where it is installed.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import multiprocessing
import os

import torch

from . import timing

DEFAULT_ATTN = ["sparsemax", "entmax15", "entmax_bisect:1.3", "learned"]
PASSES = ["call", "train", "prefill", "decode"]
ORDER = ["call", "train", "train memory", "prefill", "decode"]
TRAIN_LAYERS = 4


def settings(args) -> dict:
    """The run's sizes: ``--quick`` (and the test suite's smaller ``--smoke``) shrink the defaults."""
    small = args.quick or args.smoke
    return {
        "contexts": args.contexts or ([32] if args.smoke else [256] if small else [512, 2048, 8192]),
        "attn": args.attn or DEFAULT_ATTN,
        "passes": args.passes or PASSES,
        "repeats": args.repeats or (1 if args.smoke else 3),
        "decode_steps": 2 if args.smoke else 4 if small else 8,
    }


def contenders(names: list[str]) -> dict[str, tuple[str, dict | None]]:
    found = {"sdpa": ("sdpa", None)}
    found.update({name: timing.attention_spec(name) for name in names if name != "sdpa"})
    return found


def models(base, specs: dict, device: torch.device, train: bool) -> dict:
    """One copy of ``base`` a contender, with its attention."""
    out = {}
    for name, (attention, options) in specs.items():
        model = timing.with_attention(copy.deepcopy(base), attention, options).to(device)
        out[name] = model.train(train)
    return out


def call_pass(specs, context, dtype, device, read, repeats, tiny) -> dict[str, float]:
    """Milliseconds of one attention call of each contender (forward, no autograd)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    held = models(timing.smollm2_shaped(1, tiny=tiny).to(dtype), specs, device, train=False)
    config = next(iter(held.values())).config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    generator = torch.Generator().manual_seed(context)
    q = torch.randn(1, heads, context, dim, generator=generator).to(device, dtype)
    k, v = (torch.randn(1, kv_heads, context, dim, generator=generator).to(device, dtype) for _ in range(2))
    fns = {}
    for name, model in held.items():
        module = model.model.layers[0].self_attn
        function = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]

        def call(function=function, module=module):
            with torch.no_grad():
                function(module, q, k, v, None, scaling=dim ** -0.5, dropout=0.0)

        fns[name] = call
    if device.type == "cuda" and not tiny:
        fns.update(adasplash_call(q, k, v))
    return timing.interleaved(fns, repeats, read)


def adasplash_call(q, k, v) -> dict:
    """AdaSplash's entmax 1.5 attention, causal, where the package is installed (keys and values repeated to the
    query heads); nothing otherwise."""
    try:
        import adasplash
    except ImportError:
        return {}
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))

    def call():
        with torch.no_grad():
            adasplash.adasplash(q, k, v, alpha=1.5, is_causal=True)

    try:
        call()
    except Exception as error:  # noqa: BLE001 (a contender outside the library: left out, saying why)
        print(f"hf-sparsemax: AdaSplash left out: {type(error).__name__}: {error}"[:300])
        return {}
    return {"AdaSplash (entmax15)": call}


def train_model(args, dtype, tokens: int):
    """The training pass's model and its description: a 4-layer SmolLM2-shaped Llama with random weights, or
    with ``--model smollm2`` the pretrained SmolLM2-135M-Instruct (30 layers) on real text."""
    tiny = args.quick or args.smoke
    if getattr(args, "model", None) == "smollm2" and not tiny:
        return timing.base_model("smollm2", False, dtype, tokens=tokens)
    if tiny:
        return timing.smollm2_shaped(2, tiny=True).to(dtype), "2-layer tiny Llama, random weights"
    return timing.base_model("random", False, dtype, layers=TRAIN_LAYERS)


def train_pass(specs, context, base, device, read, repeats) -> dict[str, float]:
    """Milliseconds of one training step of each contender (forward + backward, batch 1)."""
    held = models(base, specs, device, train=True)
    ids = timing.text_ids(context, base.config.vocab_size, seed=context).to(device)

    def step(model):
        def once():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return once

    return timing.interleaved({name: step(model) for name, model in held.items()}, repeats, read)


MALLOC_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # read by a spawned child's C library at start


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _memory_child(name: str, spec, context: int, model_args: dict, dtype: str, device: str, threads: int,
                  queue) -> None:
    """In a fresh process: MiB one training step of ``spec``'s attention adds at its peak (see the module
    docstring); None where the platform cannot tell (no /proc)."""
    import argparse

    torch.set_num_threads(threads)
    base, _ = train_model(argparse.Namespace(**model_args), timing.DTYPES[dtype], context)
    model = models(base, {name: spec}, torch.device(device), train=True)[name]
    del base
    ids = timing.text_ids(context, model.config.vocab_size, seed=context).to(device)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: compiled kernels and first-use buffers are not the step's memory
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        queue.put((torch.cuda.max_memory_allocated() - start) / 2**20)
        return
    try:
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (AttributeError, OSError):  # not glibc: nothing to trim
            pass
        start = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")  # the high-water mark starts again from the current size
        step()
        queue.put((_status_kib("VmHWM") - start) / 1024)
    except OSError:
        queue.put(None)


def memory_pass(specs: dict, context: int, args, device: torch.device) -> dict[str, float | None]:
    """Peak MiB of a training step, each contender in a fresh spawned process (a forked one would deadlock in
    torch's thread pool)."""
    spawn = multiprocessing.get_context("spawn")
    model_args = {"model": getattr(args, "model", None), "quick": args.quick, "smoke": args.smoke}
    found = {}
    saved = {name: os.environ.get(name) for name in MALLOC_ENVIRONMENT}
    os.environ.update(MALLOC_ENVIRONMENT)
    try:
        for name, spec in specs.items():
            queue = spawn.Queue()
            child = spawn.Process(target=_memory_child, args=(name, spec, context, model_args, args.dtype,
                                                               device.type, torch.get_num_threads(), queue))
            child.start()
            found[name] = queue.get()
            child.join()
            if child.exitcode:
                raise RuntimeError(f"the peak-memory process of {name} failed (exit code {child.exitcode})")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return found


def inference_passes(specs, contexts, dtype, device, read, repeats, steps, args, passes) -> tuple[dict, str]:
    """``{(pass, context): {contender: ms}}`` of the prefill and the decoding step, and the model's description."""
    from transformers import DynamicCache

    base, described = timing.base_model(getattr(args, "model", None), args.quick or args.smoke, dtype,
                                        tokens=max(contexts))
    held = models(base.eval(), specs, device, train=False)
    keyword = timing.cache_keyword(base)
    del base
    found = {}
    for context in contexts:
        ids = timing.text_ids(context, held["sdpa"].config.vocab_size, seed=context).to(device)
        state = {}

        def prefill(name, model):
            def once():
                with torch.no_grad():
                    out = model(input_ids=ids, use_cache=True, logits_to_keep=1,
                                **{keyword: DynamicCache(config=model.config)})
                state[name] = [timing.cache_of(out), out.logits[:, -1].argmax(-1, keepdim=True)]
            return once

        prefills = {name: prefill(name, model) for name, model in held.items()}
        if "prefill" in passes:
            found[("prefill", context)] = timing.interleaved(prefills, repeats, read)
        else:
            for once in prefills.values():
                once()
        if "decode" in passes:
            def decode(name, model):
                def once():
                    cache, token = state[name]
                    with torch.no_grad():
                        out = model(input_ids=token, use_cache=True, **{keyword: cache})
                    state[name][1] = out.logits[:, -1].argmax(-1, keepdim=True)
                return once

            found[("decode", context)] = timing.interleaved({name: decode(name, model) for name, model in
                                                             held.items()}, max(steps, repeats), read)
        state.clear()
    return found, described


def run(args) -> dict:
    device, read = timing.setup(args)
    dtype = timing.DTYPES[args.dtype]
    plan = settings(args)
    specs = contenders(plan["attn"])
    setting = timing.environment(args, device, args.dtype)
    tiny = args.quick or args.smoke
    measured = {}
    trained, trained_described = (train_model(args, dtype, max(plan["contexts"])) if "train" in plan["passes"]
                                  else (None, None))
    for context in plan["contexts"]:
        if "call" in plan["passes"]:
            measured[("call", context)] = call_pass(specs, context, dtype, device, read, plan["repeats"], tiny)
        if "train" in plan["passes"]:
            measured[("train", context)] = train_pass(specs, context, trained, device, read, plan["repeats"])
        if args.memory:
            measured[("train memory", context)] = memory_pass(specs, context, args, device)
    del trained
    described = None
    if {"prefill", "decode"} & set(plan["passes"]):
        found, described = inference_passes(specs, plan["contexts"], dtype, device, read, plan["repeats"],
                                            plan["decode_steps"], args, plan["passes"])
        measured.update(found)
    setting.update(models={"call": "one attention layer of " + ("a tiny Llama" if tiny else "SmolLM2-135M's shape"),
                           "train": trained_described,
                           "prefill, decode": described},
                   repeats=plan["repeats"], decode_steps=plan["decode_steps"], batch=1)
    extra = sorted({name for times in measured.values() for name in times} - set(specs))
    names = [name for name in specs if name != "sdpa"] + extra
    order = {name: i for i, name in enumerate(ORDER)}
    rows, results = [], []
    for (step, context), values in sorted(measured.items(), key=lambda item: (order[item[0][0]], item[0][1])):
        base = values["sdpa"]
        memory = step == "train memory"
        shown = "-" if base is None else f"{base:.0f} MiB" if memory else timing.ms(base) + (
            "" if base >= 1e3 else " ms")
        rows.append([step, context, shown, *[timing.ratio(values.get(name), base) for name in names]])
        results.append({"pass": step, "context": context, "mib" if memory else "ms": values,
                        "ratio_to_sdpa": {name: value / base for name, value in values.items()
                                          if value is not None and base}})
    title = (f"Sparse attention against sdpa ({args.dtype}, {device}, batch 1): sdpa's time (or peak memory) and "
             f"each attention's as a multiple of sdpa's (median of {plan['repeats']} interleaved rounds; decode: "
             f"of {max(plan['decode_steps'], plan['repeats'])} steps)")
    return timing.finish(args, "attention", setting, title, ["pass", "context", "sdpa", *names], rows, results)
