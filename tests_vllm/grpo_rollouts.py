"""Run TRL's GRPO with vLLM rollouts (colocate mode) on a tiny model; print one JSON line of what was sampled.

``python grpo_rollouts.py FOLDER OUT_JSON CASE...``; each CASE trains its own GRPOTrainer for 2 steps in this
process (TRL's colocate mode starts vLLM in the training process, torchrun-style: a subprocess keeps that
out of pytest's process):

- ``helper``: ``FOLDER/base`` loaded, patched with top-3 sparse softmax in memory, and
  ``generation_kwargs=vllm_generation_kwargs(model)``;
- ``folder``: ``FOLDER/patched`` (saved patched) loaded, nothing else;
- ``refused``: ``FOLDER/base`` patched in memory, no generation_kwargs: the guard's ValueError is expected.

Right after each generation (the weights just copied into vLLM) every rollout token is checked against the
trained distribution of the training model's own logits for its prefix: its rank among the logits (top-3
support; vLLM computes in bfloat16, so ties within bfloat16 rounding are counted apart) and vLLM's processed
log-probability against hf_sparsemax's ``log p`` of the float32 logits.
"""

import json
import math
import os
import sys
import warnings

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_sparsemax as hs
from hf_sparsemax.integrations.vllm import vllm_generation_kwargs

TOP_K = 3
PROMPTS = ["The capital of France is", "Once upon a time, a little", "def fibonacci(n):", "My favourite food is"]


def run(case, folder):
    from trl import GRPOConfig, GRPOTrainer

    path = os.path.join(folder, "patched" if case == "folder" else "base")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if case != "folder":
        hs.patch_model(model, loss="sparse_softmax", loss_options={"top_k": TOP_K})
    args = GRPOConfig(output_dir=os.path.join(folder, "out-" + case), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=8, max_steps=2, learning_rate=1e-2, report_to=[], save_strategy="no",
                      use_cpu=True, disable_tqdm=True, bf16=False, beta=0.0, seed=0, logging_steps=1,
                      use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128,
                      generation_kwargs=vllm_generation_kwargs(model) if case == "helper" else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grpo = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                           args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                           processing_class=AutoTokenizer.from_pretrained(path))
    seen = {"tokens": 0, "outside": 0, "near_ties": 0, "worst_rank": 0, "logprob_errors": [], "generations": 0}
    generate = grpo.vllm_generation.generate

    def checked_generate(*a, **kw):
        prompt_ids, completion_ids, logprobs, _ = out = generate(*a, **kw)
        seen["generations"] += 1
        for prompt, completion, returned in zip(prompt_ids, completion_ids, logprobs):
            ids = torch.tensor([list(prompt) + list(completion)])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
            log_p = hs.sparse_softmax(logits, top_k=TOP_K).log()
            for step, token in enumerate(completion):
                row = logits[step]
                # vLLM runs a float32 folder in bfloat16 on CPU (dtype "auto"; TRL passes none): a token within
                # two bfloat16 steps of the k-th logit may be the k-th of vLLM's logits (a tie in bfloat16)
                kth = float(row.topk(TOP_K).values[-1])
                slack = 2 * torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(abs(kth)))
                rank = int((row > row[token]).sum())
                seen["tokens"] += 1
                seen["worst_rank"] = max(seen["worst_rank"], rank)
                if rank >= TOP_K:
                    tie = kth - float(row[token]) <= slack
                    seen["near_ties" if tie else "outside"] += 1
                seen["logprob_errors"].append(abs(float(returned[step][0]) - float(log_p[step, token])))
        return out

    grpo.vllm_generation.generate = checked_generate
    seen["vllm_dtype"] = str(grpo.vllm_generation.llm.llm_engine.model_config.dtype)
    train_recorded(grpo, seen)
    seen["log"] = [{k: v for k, v in entry.items() if k.startswith("sampling/") or k in ("loss", "grad_norm")}
                   for entry in grpo.state.log_history if "loss" in entry]
    return seen


def train_recorded(grpo, seen: dict) -> None:
    """``grpo.train()``, warnings quiet; a refusal (ValueError) kept as ``seen["error"]``, the steps as ``"steps"``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grpo.train()
    except ValueError as error:
        seen["error"] = str(error)
    seen["steps"] = grpo.state.global_step


if __name__ == "__main__":
    folder, out, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
    results = {case: run(case, folder) for case in cases}
    with open(out, "w") as handle:
        json.dump(results, handle)
