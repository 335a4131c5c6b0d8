"""TRL's GRPO with vLLM rollouts (``use_vllm=True``, colocate mode) samples the trained distribution, or is refused.

A tiny random Llama with SmolLM2's tokenizer, trained with top-3 sparse softmax: its rollouts come from vLLM
started inside the training process (TRL's colocate mode, run here in a subprocess: ``grpo_rollouts.py``).
Loaded from its base folder and told the loss by ``vllm_generation_kwargs(model)``, or loaded from its saved
patched folder with nothing else, every rollout token lies in the top-3 of the training model's logits for its
prefix (up to ties within bfloat16 rounding: vLLM runs a float32 folder in bfloat16 on CPU, as TRL leaves
its dtype "auto"). Loaded from the base folder without that, vLLM would sample softmax (the first rollouts show it) and
the guard refuses before the first step.

Sparse attention (``grpo_sparse_rollouts.py``): a tiny Llama saved with entmax-bisect attention learning its alphas,
trained loaded from that folder, its alphas moved before the first weight sync and again after the first step: vLLM's
greedy rollouts equal transformers' greedy ``generate`` of the training model after each sync.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_sparsemax as hs

WORKER = Path(__file__).with_name("grpo_rollouts.py")


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    from hf_sparsemax.app.assets import load_smollm2

    root = tmp_path_factory.mktemp("grpo")
    _, tokenizer = load_smollm2(dtype=torch.float32)
    torch.manual_seed(0)  # initializer_range 0.2: logits spread enough that the top 3 stand apart
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, initializer_range=0.2, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    hs.patch_model(model, loss="sparse_softmax", loss_options={"top_k": 3}).save_pretrained(root / "patched")
    tokenizer.save_pretrained(root / "patched")
    out = root / "rollouts.json"
    done = subprocess.run([sys.executable, str(WORKER), str(root), str(out), "helper", "folder", "refused"],
                          check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["helper", "folder"])
def test_grpo_rollouts_from_vllm_lie_in_the_trained_support(rollouts, case):
    """helper: base folder + vllm_generation_kwargs(model); folder: the saved patched folder, no flag."""
    seen = rollouts[case]
    assert "error" not in seen and seen["steps"] == 2 and seen["generations"] == 2
    assert seen["vllm_dtype"] == "torch.bfloat16"  # vLLM's "auto" on CPU; training runs float32
    assert seen["tokens"] > 32 and seen["outside"] == 0, seen  # 2 generations of 4 completions, up to 8 tokens
    assert seen["near_ties"] <= 4, seen  # the k-th and the next logit within bfloat16 rounding
    errors = seen["logprob_errors"]  # vLLM's processed log p (of bfloat16 logits) vs hf_sparsemax's (float32)
    finite = sorted(e for e in errors if math.isfinite(e))
    assert len(errors) - len(finite) <= seen["near_ties"]  # log p = -inf only for a tie that vLLM kept
    assert finite[len(finite) // 2] < 0.05, errors  # median
    for step in seen["log"]:  # TRL's own view: its importance sampling ratios stay near 1, and the step trains
        assert step["sampling/importance_sampling_ratio/min"] > 0.5 and step["grad_norm"] > 0


def test_grpo_rollouts_from_a_base_folder_without_the_loss_are_refused(rollouts):
    seen = rollouts["refused"]
    assert seen["steps"] == 0 and seen["log"] == []  # refused after the first rollouts, before any step
    assert seen["error"].startswith("GRPOTrainer with use_vllm=True would sample its rollouts with vLLM from softmax")
    assert "vllm_generation_kwargs(model)" in seen["error"]
    assert seen["outside"] >= seen["tokens"] * 3 // 4  # what was refused: softmax rollouts, far outside the top 3


SPARSE_WORKER = Path(__file__).with_name("grpo_sparse_rollouts.py")


@pytest.fixture(scope="module")
def sparse_rollouts(tmp_path_factory):
    """``grpo_sparse_rollouts.py``'s record: a tiny Llama saved with entmax-bisect attention learning its alphas."""
    from hf_sparsemax.app.assets import load_smollm2

    root = tmp_path_factory.mktemp("grpo_sparse")
    _, tokenizer = load_smollm2(dtype=torch.float32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    hs.patch_model(model, attn="entmax_bisect", attn_options={"alpha": 1.5, "learn_alpha": True})
    model.save_pretrained(root / "sparse")
    tokenizer.save_pretrained(root / "sparse")
    out = root / "sparse_rollouts.json"
    done = subprocess.run([sys.executable, str(SPARSE_WORKER), str(root), str(out)], check=False,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and out.exists(), done.stderr[-4000:]
    return json.loads(out.read_text())


def test_grpo_rollouts_of_sparse_attention_equal_transformers_generate_after_each_weight_sync(sparse_rollouts):
    """GRPO (colocate) on a model loaded from a folder saved with its sparse attention: allowed, and after each
    weight sync (learned alphas moved before the first and again after the first step) vLLM's greedy rollouts are
    transformers' greedy ``generate`` of the training model, token for token; under the alphas before the sync
    (the folder's, then the first step's) ``generate`` gives other tokens, so the synced alphas are what vLLM
    computes with."""
    seen = sparse_rollouts
    assert "error" not in seen and seen["steps"] == 2 and len(seen["generations"]) == 2
    first, second = seen["generations"]
    assert first["alphas"] != second["alphas"]
    for generation in (first, second):
        assert sum(len(tokens) for tokens in generation["rollouts"]) > 16
        assert generation["rollouts"] == generation["generate"]
        assert generation["stale"] != generation["generate"]
