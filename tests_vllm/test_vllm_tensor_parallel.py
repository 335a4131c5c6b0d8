"""A learned-alpha folder served with tensor_parallel_size=2 on vLLM's CPU build: each rank loads its own heads'
alphas, and greedy tokens equal transformers' ``generate``.

A tiny Llama (4 query heads, 2 key / value heads: SmolLM2's 9 heads do not split over 2 ranks, which vLLM refuses)
with SmolLM2's tokenizer, ``entmax_bisect`` attention with one learned alpha per head, spread over (1, 2) and
different in every head. Two ranks, one core each (``VLLM_CPU_OMP_THREADS_BIND=0|1``: vLLM's automatic binding
wants a NUMA node per rank). Rank ``r`` must hold the saved pre-alphas of heads ``2r, 2r + 1`` of every layer.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_sparsemax as hs

WORKER = Path(__file__).with_name("tensor_parallel.py")
PROMPTS = ["The capital of France is", "Once upon a time, a little", "def fibonacci(n):", "My favourite food is"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores")
def test_two_ranks_load_their_own_alphas_and_decode_as_transformers(tmp_path):
    from hf_sparsemax.app.assets import load_smollm2

    _, tokenizer = load_smollm2(dtype=torch.float32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False))
    hs.patch_model(model, attn="entmax_bisect", attn_options={"alpha": 1.5, "learn_alpha": True})
    generator = torch.Generator().manual_seed(1)
    saved = {}
    for name, parameter in model.named_parameters():
        if name.endswith("pre_alpha"):
            parameter.data = torch.randn(parameter.shape, generator=generator) * 1.5
            saved[int(name.split(".")[2])] = parameter.data.tolist()
    folder = tmp_path / "learned_alpha"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    (folder / "prompts.json").write_text(json.dumps(prompts))
    out = tmp_path / "served.json"
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")
    done = subprocess.run([sys.executable, str(WORKER), str(folder), str(out)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0 and out.exists(), done.stderr[-4000:]
    served = json.loads(out.read_text())
    ranks = dict((rank, alphas) for rank, alphas in served["ranks"])
    assert sorted(ranks) == [0, 1]
    for rank, alphas in ranks.items():
        assert len(alphas) == len(saved)
        for name, values in alphas.items():
            full = saved[int(name.split(".")[2])]
            torch.testing.assert_close(torch.tensor(values), torch.tensor(full[2 * rank:2 * rank + 2]), rtol=0, atol=0)
    expected = []
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for ids in prompts:
            sequence = loaded.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       max_new_tokens=16, do_sample=False)
            expected.append(sequence[0, len(ids):].tolist())
    assert served["tokens"] == expected
