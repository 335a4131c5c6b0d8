"""vLLM decoding throughput with hf_sparsemax's logits processor vs without, side by side in one engine.

The offline SmolLM2-135M-Instruct (float32 folder) patched with the sparsemax loss, served by vLLM's
offline ``LLM`` (hf_sparsemax installed in vLLM's environment). A batch of ``--batch`` requests decodes
``--new-tokens`` tokens; requests opting out (``extra_args={"hf_sparsemax": "off"}``: the processor skips
them, vLLM samples softmax) are the baseline; the other rows sample a loss's distribution (the folder's,
or another by request). Median tokens/s of interleaved rounds, and the ratio to the baseline.

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bench_serving.py --batch 8 --new-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

import hf_sparsemax as hs
from hf_sparsemax.app.assets import load_smollm2
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


def sparsemax_folder(root: str) -> str:
    model, tokenizer = load_smollm2(dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder = os.path.join(root, "sparsemax")
    hs.patch_model(model, loss="sparsemax").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as root:
        llm = LLM(model=sparsemax_folder(root), dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
        prompts = [f"Story number {i}: once upon a time" for i in range(args.batch)]

        def decode(extra_args):
            params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True,
                                    extra_args=extra_args)
            return lambda: llm.generate(prompts, params, use_tqdm=False)

        ms = interleaved_medians({name: decode(extra) for name, extra in CONTENDERS.items()}, args.repeats)
    tokens = args.batch * args.new_tokens
    base = ms["vLLM softmax (opted out)"]
    print(f"vLLM {__import__('vllm').__version__}, batch {args.batch}, {args.new_tokens} new tokens, "
          f"torch threads {torch.get_num_threads()}; median of {args.repeats} interleaved rounds\n")
    print("| sampling | tokens/s | throughput vs vLLM softmax |")
    print("| --- | ---: | ---: |")
    for name, value in ms.items():
        print(f"| {name} | {tokens / value * 1e3:.1f} | {base / value:.3f} |")


if __name__ == "__main__":
    main()
