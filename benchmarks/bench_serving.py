"""vLLM decoding throughput with hf_sparsemax's logits processor vs without, side by side in one engine.

The offline SmolLM2-135M-Instruct (float32 folder) patched with the sparsemax loss, served by vLLM's
offline ``LLM`` (hf_sparsemax installed in vLLM's environment). A batch of ``--batch`` requests decodes
``--new-tokens`` tokens; requests opting out (``extra_args={"hf_sparsemax": "off"}``: the processor skips
them, vLLM samples softmax) are the baseline; the other rows sample a loss's distribution (the folder's,
or another by request). Median tokens/s of interleaved rounds, and the ratio to the baseline. On a machine
that other jobs share, those ratios swing by more than the processor costs; so the processor's own step
(``BatchDecoding.apply`` on the model's next-token logits of the batch's prompts, one torch thread like
vLLM's engine) is also timed, and shown as a share of the baseline's time per decoding step.

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bench_serving.py --batch 8 --new-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

import hf_sparsemax as hs
from hf_sparsemax.app.assets import load_smollm2
from hf_sparsemax.decoding.engine import BatchDecoding, Choice, request_choice
from common import interleaved_medians

CONTENDERS = {
    "vLLM softmax (opted out)": {"hf_sparsemax": "off"},
    "sparsemax (the folder's loss)": None,
    "entmax15": {"hf_sparsemax": "entmax15"},
    "entmax_bisect(alpha=1.3)": {"hf_sparsemax": "entmax_bisect", "hf_sparsemax_alpha": 1.3},
    "sparse_softmax(top_k=50)": {"hf_sparsemax": "sparse_softmax", "hf_sparsemax_top_k": 50},
    "sparse_softmax(top_p=0.9)": {"hf_sparsemax": "sparse_softmax", "hf_sparsemax_top_p": 0.9},
    "taylor_softmax(order=2)": {"hf_sparsemax": "taylor_softmax"},
}


def sparsemax_folder(root: str, prompts: list[str]) -> tuple[str, torch.Tensor]:
    """The patched folder, and the model's next-token logits for ``prompts`` (what the processor step sees)."""
    model, tokenizer = load_smollm2(dtype=torch.float32)
    with torch.no_grad():
        logits = torch.stack([model(**tokenizer(prompt, return_tensors="pt")).logits[0, -1] for prompt in prompts])
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder = os.path.join(root, "sparsemax")
    hs.patch_model(model, loss="sparsemax").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as root:
        prompts = [f"Story number {i}: once upon a time" for i in range(args.batch)]
        folder, logits = sparsemax_folder(root, prompts)
        llm = LLM(model=folder, dtype="float32", max_model_len=256, enforce_eager=True, seed=0)

        def decode(extra_args):
            params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True,
                                    extra_args=extra_args)
            return lambda: llm.generate(prompts, params, use_tqdm=False)

        ms = interleaved_medians({name: decode(extra) for name, extra in CONTENDERS.items()}, args.repeats)
    step_ms = {name: step_cost(extra, logits) for name, extra in CONTENDERS.items()}
    tokens = args.batch * args.new_tokens
    base = ms["vLLM softmax (opted out)"]
    base_step = base / args.new_tokens
    print(f"vLLM {__import__('vllm').__version__}, batch {args.batch}, {args.new_tokens} new tokens, vocabulary "
          f"{logits.shape[-1]}; median of {args.repeats} interleaved rounds; a decoding step of the baseline: {base_step:.1f} ms\n")
    print("| sampling | tokens/s | throughput vs vLLM softmax | processor step (ms) | share of a decoding step |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, value in ms.items():
        print(f"| {name} | {tokens / value * 1e3:.1f} | {base / value:.3f} | {step_ms[name]:.2f} | "
              f"{step_ms[name] / base_step:.1%} |")


def step_cost(extra_args, logits: torch.Tensor) -> float:
    """Median ms of the processor's step on these logits, one request per row (1 torch thread, as vLLM's engine)."""
    choice = request_choice(Choice.make("sparsemax"), extra_args)
    decoding = BatchDecoding()
    for slot in range(logits.shape[0]):
        decoding.set(slot, choice, 1.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return interleaved_medians({"step": lambda: decoding.apply(logits.clone(), scaled=True)}, 20)["step"]
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
