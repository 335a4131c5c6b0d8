"""Run TRL's GRPO with vLLM rollouts (colocate mode) on a tiny sparse-attention model; write what was generated.

``python grpo_sparse_rollouts.py FOLDER OUT_JSON``: ``FOLDER/sparse`` holds a tiny Llama saved with entmax-bisect
attention that learns one alpha per head. The model GRPO trains is loaded from that folder (so vLLM, started by TRL
on ``model.name_or_path``, computes the same attention) and its learned alphas are then moved away from the saved
ones, as training would move them; after the first step they move again (a callback, before the next weight
sync). Rollouts are greedy (``top_k=1``), and vLLM runs in float32 (TRL starts it with dtype "auto", bfloat16 on
CPU: the worker passes float32, so that its tokens can be compared with transformers' float32 ones).

Right after each generation (the weights just synced into vLLM) each rollout is compared with transformers'
greedy ``generate`` of the training model itself (the same weights), and with ``generate`` of those weights under
the alphas of the sync before (``stale``: the folder's, then the first generation's: what vLLM would give had
this sync not carried the alphas). Writes
``{"steps", "generations": [{"alphas", "rollouts", "generate", "stale"}], "error"?}``.
"""

import copy
import functools
import json
import os
import sys
import warnings

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402

import hf_sparsemax as hs  # noqa: E402
from grpo_rollouts import train_recorded  # noqa: E402  (this folder: the worker runs as a script)

PROMPTS = ["The capital of France is", "Once upon a time, a little", "def fibonacci(n):", "My favourite food is"]
TOKENS = 8


def learned(model):
    return [m for m in model.modules() if isinstance(m, hs.LearnedAlpha)]


def move_alphas(model, low: float) -> None:
    """Every head's learned alpha set somewhere in ``[low, low + 0.2)``, as training would move it (far enough from
    the folder's 1.5 and from each other that greedy tokens change)."""
    generator = torch.Generator().manual_seed(int(low * 100))
    with torch.no_grad():
        for module in learned(model):
            alpha = low + 0.2 * torch.rand(module.pre_alpha.shape, generator=generator)
            module.pre_alpha.copy_(torch.log((alpha - 1) / (2 - alpha)))


def alphas(model) -> list[list[float]]:
    return [module().flatten().tolist() for module in learned(model)]


def greedy(model, tokenizer, prompt_ids) -> list[list[int]]:
    out = []
    for ids in prompt_ids:
        with torch.no_grad():
            tokens = model.generate(torch.tensor([list(ids)]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        out.append(tokens[0, len(ids):].tolist())
    return out


def with_alphas(saved, model, pre_alphas):
    """A model of ``model``'s weights but for its learned alphas, ``pre_alphas`` (``saved``: a model of the folder,
    copied: a copy of the training model would keep calling its forward, which the trainer wrapped)."""
    stale = copy.deepcopy(saved).eval()
    stale.load_state_dict(model.state_dict())
    with torch.no_grad():
        for module, pre_alpha in zip(learned(stale), pre_alphas):
            module.pre_alpha.copy_(pre_alpha)
    return stale


class MoveAlphas(TrainerCallback):
    """After each step, the learned alphas move again (the next generation must see them)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        move_alphas(model, low=1.75)


def main(folder, out):
    import trl.generation.vllm_generation as vllm_generation
    from trl import GRPOConfig, GRPOTrainer

    vllm_generation.LLM = functools.partial(vllm_generation.LLM, dtype="float32")
    path = os.path.join(folder, "sparse")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    saved = copy.deepcopy(model)  # the folder's model, its alphas those of vLLM's load
    move_alphas(model, low=1.1)
    args = GRPOConfig(output_dir=os.path.join(folder, "out"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=TOKENS, max_steps=2, learning_rate=1e-3, report_to=[], save_strategy="no",
                      use_cpu=True, disable_tqdm=True, bf16=False, beta=0.0, seed=0, logging_steps=1, top_k=1,
                      use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grpo = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                           args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                           processing_class=tokenizer, callbacks=[MoveAlphas()])
    seen = {"generations": []}
    generate = grpo.vllm_generation.generate
    before = [module.pre_alpha.detach().clone() for module in learned(saved)]  # the alphas of the last sync

    def checked_generate(*a, **kw):
        prompt_ids, completion_ids, logprobs, _ = result = generate(*a, **kw)
        stale = with_alphas(saved, model, before)
        was_training = model.training
        model.eval()
        seen["generations"].append({
            "alphas": alphas(model), "rollouts": [list(c) for c in completion_ids],
            "generate": greedy(model, tokenizer, prompt_ids), "stale": greedy(stale, tokenizer, prompt_ids)})
        model.train(was_training)
        before[:] = [module.pre_alpha.detach().clone() for module in learned(model)]
        return result

    grpo.vllm_generation.generate = checked_generate
    train_recorded(grpo, seen)
    with open(out, "w") as handle:
        json.dump(seen, handle)
    os._exit(0)  # the colocated engine: no shutdown handshake


if __name__ == "__main__":
    main(*sys.argv[1:3])
