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
LAYERS = 2  # SmolLM2's first layers in the learned-alpha folders


def synced(folder_a, folder_b, out, *flags):
    """``weight_sync.py``'s record (``before``, ``synced``, ``fresh``, ``packed``, ``partial``) and its process."""
    done = subprocess.run([sys.executable, str(WORKER), str(folder_a), str(folder_b), str(out), *flags],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and out.exists(), done.stderr[-4000:]
    return json.loads(out.read_text()), done


def test_weights_synced_into_a_running_engine_are_the_ones_it_computes(tmp_path):
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         initializer_range=0.2, tie_word_embeddings=True)
    for name, seed in (("a", 0), ("b", 1)):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(tmp_path / name)
    seen, done = synced(tmp_path / "a", tmp_path / "b", tmp_path / "seen.json")
    print("packed layers:", len(seen["packed"]), seen["packed"][:3])
    assert [tokens for tokens, _ in seen["before"]] != [tokens for tokens, _ in seen["fresh"]]  # B differs from A
    assert seen["synced"] == seen["fresh"]
    if seen["packed"]:
        logged = (seen["partial"] or "") + done.stdout + done.stderr
        assert "model.layers.0.self_attn.qkv_proj: " in logged and "load all of a layer's weights at once" in logged, \
            logged[-3000:]


def learned_folders(root):
    """Folders A and B: SmolLM2's first LAYERS layers with entmax-bisect attention that learned its alphas, one
    temperature per head and ASEntmax's length scale; the same weights but for those learned values (B's differ
    from A's in every layer and head), so that only they can tell an engine on A from one on B."""
    import hf_sparsemax as hs
    from smollm2 import float32_smollm2

    model, tokenizer = float32_smollm2()
    model.model.layers = model.model.layers[:LAYERS]
    model.config.num_hidden_layers = LAYERS
    hs.patch_model(model, attn="entmax_bisect", attn_options={"alpha": 1.5, "learn_alpha": True,
                                                              "learn_temperature": True, "length_scale": True})
    learned = [(name, p) for name, p in model.named_parameters() if name.endswith("pre_alpha")]
    learned += hs.query_scale_parameters(model)
    assert {name.rsplit(".", 1)[-1] for name, _ in learned} == {"pre_alpha", "log_temperature", "delta", "beta",
                                                                "gamma"}
    start = {name: p.data.clone() for name, p in learned}
    for folder, seed in (("a", 1), ("b", 2)):
        generator = torch.Generator().manual_seed(seed)
        for name, parameter in learned:
            spread = 1.5 if name.endswith("pre_alpha") else 0.3
            parameter.data = start[name] + torch.randn(parameter.shape, generator=generator) * spread
        model.save_pretrained(root / folder)
        tokenizer.save_pretrained(root / folder)
    return root / "a", root / "b"


def test_learned_alphas_and_query_scales_synced_into_a_running_engine_are_the_ones_it_computes(tmp_path):
    """The same with a sparse-attention folder whose alphas, temperatures and length scales were learned: the
    backend computes with them, so an engine on A that received B's weights must decode as an engine on B (not
    with A's alphas and scales kept from its load)."""
    folder_a, folder_b = learned_folders(tmp_path)
    seen, _ = synced(folder_a, folder_b, tmp_path / "seen.json", "--learned-first")
    print({key: seen[key][0] for key in ("before", "learned", "restored", "synced", "fresh")})
    assert seen["before"] != seen["fresh"]  # B's learned values change what the engine computes
    assert seen["learned"] == seen["fresh"]  # loaded by vLLM's own load_weights (no reload)
    assert seen["restored"] == seen["before"]
    assert seen["synced"] == seen["fresh"]  # TRL's sync (through the plugin's reload where vLLM packed)
