"""Serve a learned-alpha folder with ``tensor_parallel_size=2`` on vLLM's CPU build; print what each rank loaded.

``python tensor_parallel.py FOLDER OUT_JSON``: two ranks (one core each: ``VLLM_CPU_OMP_THREADS_BIND=0|1``, set by
the caller), greedy tokens of the prompt ids in ``FOLDER/prompts.json``, and each rank's learned pre-alphas of every
layer (its own heads). Writes ``{"tokens": [[...], ...], "ranks": [[rank, {parameter: values}], ...]}``.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function (ours)

from vllm import LLM, SamplingParams  # noqa: E402

TOKENS = 16


def pre_alphas(worker):
    """A rank's learned pre-alphas (runs in each worker)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    model = worker.model_runner.model
    return get_tensor_model_parallel_rank(), {name: param.float().tolist() for name, param in model.named_parameters()
                                              if name.endswith("hf_sparsemax_pre_alpha")}


def main(folder, out):
    with open(os.path.join(folder, "prompts.json")) as handle:
        prompts = json.load(handle)
    llm = LLM(model=folder, tensor_parallel_size=2, dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
    ranks = llm.collective_rpc(pre_alphas)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                           SamplingParams(max_tokens=TOKENS, temperature=0.0), use_tqdm=False)
    with open(out, "w") as handle:
        json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outputs], "ranks": ranks}, handle)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
