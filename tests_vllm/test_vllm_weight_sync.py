"""Weights copied into a running vLLM engine, as TRL's colocate mode does before each rollout, are the ones it computes.

On an AVX-512 machine vLLM's CPU build packs each linear layer's weight for oneDNN and drops it, so TRL's
``sync_weights`` (``model.load_weights`` one parameter a call) failed there with ``'Parameter' object has no attribute
'weight_loader'``; hf_sparsemax's plugin makes those calls vLLM's in-place reload (:mod:`hf_sparsemax.integrations.vllm
.reload`). A tiny Llama with tied embeddings (the head's packed copy must follow the embedding): an engine on folder A
that received folder B's weights decodes as an engine started on folder B, token for token and log-probability for
log-probability (same kernels, same weights). On a machine where vLLM packs nothing the same must hold (vLLM's own
load). Where it packs, a layer that gets only part of its weights is refused, naming it.
"""

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

WORKER = Path(__file__).with_name("weight_sync.py")


def test_weights_synced_into_a_running_engine_are_the_ones_it_computes(tmp_path):
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         initializer_range=0.2, tie_word_embeddings=True)
    for name, seed in (("a", 0), ("b", 1)):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(tmp_path / name)
    out = tmp_path / "seen.json"
    done = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "a"), str(tmp_path / "b"), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and out.exists(), done.stderr[-4000:]
    seen = json.loads(out.read_text())
    print("packed layers:", len(seen["packed"]), seen["packed"][:3])
    assert [tokens for tokens, _ in seen["before"]] != [tokens for tokens, _ in seen["fresh"]]  # B differs from A
    assert seen["synced"] == seen["fresh"]
    if seen["packed"]:
        logged = (seen["partial"] or "") + done.stdout + done.stderr
        assert "model.layers.0.self_attn.qkv_proj: " in logged and "load all of a layer's weights at once" in logged, \
            logged[-3000:]
