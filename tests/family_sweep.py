"""The family sweep: every causal-LM model type of the installed transformers, from a tiny random config.

Each family is WORKS (patch_model(attn="entmax15") changes the logits, gives exact zeros among the keys no mask
hides (those the library's softmax path weighs), trains, generates with and without a cache; the library's softmax
path equals the model's; unpatch restores it; the sparse loss swaps or is refused) or REFUSED (``patch_model``
raises one ValueError and leaves the model as it was), as ``hf_sparsemax.attention.families.family_verdict``
predicts from the source. ``NOT_BUILT``: model types that no tiny config builds here, each with the reason (shown
in the docs' table, never counted as checked; none with transformers 5.24). ``NOTES``: how a family was built where
it is not plainly (a stand-in for an uninstalled library's vision tower, a composite's part, a drafter beside its
target), shown in the table too.
Run ``python tests/family_sweep.py`` to rewrite the table in docs/families.md.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import sys

import torch
import transformers
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_sparsemax as hs
from hf_sparsemax.attention.families import family_verdict

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128, head_dim=16)
BASE.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
BASE.update(initializer_range=0.2, init_std=0.2)  # scores spread enough for entmax15 to zero some unmasked keys
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, qk_head_dim=16,
           v_head_dim=8, head_dim=8)  # query / key heads of 16, value heads of 8
DSA = dict(MLA, index_topk=4)  # DeepSeek-V3.2's indexer selecting 4 keys a query: fewer than most queries see
SEQ2SEQ = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=128, decoder_ffn_dim=128)
HYBRID = dict(num_hidden_layers=4)  # at least one attention layer among the linear / recurrent ones
# hybrids whose config lays out its layers at construction (for 48 layers): a linear / recurrent layer, then attention
LINEAR_FIRST = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)  # 8 heads of 16 = 2 x hidden
GATED_DELTA = dict(LINEAR_FIRST, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16)  # Qwen's linear attention: 32 value heads of 128 took 20 s a family
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
MOE = dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1)
# A released model's experts (up to 512 of 2048 wide, and LongCat's 256 identity "zero experts"): each of these
# settings a config already has (not None) is set, so that no tiny mixture of experts holds more than ~3M weights
# (LongCat-Flash held 269M and took 112 s of the sweep, Inkling 307M)
SMALL = dict(n_routed_experts=4, num_experts=4, num_local_experts=4, moe_num_experts=4, num_experts_per_tok=2,
             moe_topk=2, moe_k=2, zero_expert_num=2, n_group=1, topk_group=1, moe_intermediate_size=32,
             expert_ffn_hidden_size=32, shared_expert_intermediate_size=32, shared_experts_intermediate_size=32,
             moe_shared_expert_intermediate_size=32, shared_intermediate_size=32)
NO_FORWARD = {"mamba2": "the tiny config's heads do not fit its state size", "rwkv": "a tiny config runs no forward",
              "xlstm": "a tiny config runs no forward",
              "git": "its own loss needs the image inputs (pixel_values) the sweep does not make"}  # built and refused at patch time, but not run
# MusicGen's causal-LM class is its decoder alone: built from that part of the composite config (text encoder, audio
# encoder, decoder), with 1 codebook. Its tokens pad with the vocabulary's size (the released checkpoints: 2048, the
# embedding's extra row, never predicted), and its own generate (a delay pattern over the codebooks) needs that as
# decoder_start_token_id and num_return_sequences given: transformers 5.24's generation config leaves it None
PART = {t: "decoder" for t in ("musicgen", "musicgen_melody")}  # model type -> the sub-config its class takes
MUSICGEN = dict(ffn_dim=128, num_codebooks=1, pad_token_id=256, bos_token_id=256, decoder_start_token_id=256)
GENERATE = {t: dict(pad_token_id=256, decoder_start_token_id=256, num_return_sequences=1) for t in PART}
TWEAKS: dict[str, dict] = {  # model type -> config changes on top of BASE
    **{t: MLA for t in ("axk1", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash", "minicpm3",
                        "sarvam_mla", "youtu")},
    **{t: DSA for t in ("axk2", "deepseek_v32", "dots3_note", "dots3_note_text", "glm_moe_dsa", "hy_v4")},
    **{t: SEQ2SEQ for t in ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp",
                            "pegasus", "plbart", "whisper")},
    "recurrent_gemma": dict(HYBRID, lru_width=64), **{t: GATED_DELTA for t in ("qwen3_5", "qwen3_5_text")},
    **{t: dict(GATED_DELTA, **QWEN_MOE) for t in ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")},
    **{t: dict(GATED_DELTA, **QWEN_MOE, layer_types=["linear_attention", "indexed_attention"],
               indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=2,
               hc_lowrank=16) for t in ("qwen4_exp", "qwen4_exp_text")},  # its indexer picks 2 blocks of 2 keys
    "bamba": dict(MAMBA2, attn_layer_indices=[1]),
    # their Mamba-2 layers as released (128 heads, states of 128 / 256, chunks of 256) took 2-3 s a forward
    "falcon_h1": dict(MAMBA2, mamba_d_ssm=128, mamba_n_groups=1),
    "nemotron_h": dict(ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=1, chunk_size=16),
    "granitemoehybrid": dict(LINEAR_FIRST, **MAMBA2),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4),
    **{t: dict(MLA, **LINEAR_FIRST, **MOE, mlp_layer_types=["dense", "sparse"], linear_head_dim=16, linear_num_heads=4)
       for t in ("bailing_hybrid", "kimi_linear")},
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32),
    "hrm_text": dict(num_layers_per_stack=1, H_cycles=1, L_cycles=1, L_bp_cycles=[1]),  # 1 x 1 x (1 + 1) = 2 layers
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, num_dense_layers=1),
    "dory": dict(num_hidden_layers=3),
    **{t: dict(num_hidden_layers=4, intermediate_size=[128] * 4) for t in ("gemma3n", "gemma3n_text")},  # as
    # constructed: BASE sets 2 and 128
    "lfm3": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "sliding_attention"]),
    "olmo_hybrid": dict(LINEAR_FIRST, linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=32),
    "zamba": dict(num_hidden_layers=2, layers_block_type=["hybrid", "hybrid"], attention_hidden_size=128,  # ties
                  attention_head_dim=32, n_mamba_heads=2, mamba_d_state=8, mamba_dt_rank=4),  # 2+ shared blocks
    "zamba2": dict(num_hidden_layers=2, layers_block_type=["linear_attention", "hybrid"], hybrid_layer_ids=[1],
                   n_mamba_heads=8, mamba_headdim=16, mamba_d_state=16, attention_hidden_size=128, head_dim=32,
                   chunk_size=16, kv_channels=16),
    **{t: dict(is_decoder=True) for t in ("bert", "bert-generation", "camembert", "data2vec-text", "electra", "ernie",
                                          "roberta", "roberta-prelayernorm", "xlm-roberta",
                                          "xlm-roberta-xl")},  # their causal-LM heads want a decoder
    "deepseek_v2": dict(MLA, n_group=1, topk_group=1, num_experts_per_tok=2, n_routed_experts=4,
                        moe_intermediate_size=32),  # 1407 floats a row: its grouped product wants 16-byte strides
    "marian": dict(SEQ2SEQ, decoder_vocab_size=256),
    "roc_bert": dict(is_decoder=True, shape_embed_dim=16, pronunciation_embed_dim=16),  # 24858 x 512 glyph shapes
    **{t: dict(unpadded_vocab_size=256) for t in ("inkling2_text", "inkling2_loop_text")},  # its LM head's size
    **{t: dict(query_pre_attn_scalar=1) for t in ("gemma3", "gemma3_text")},  # normalised queries and keys
    # scaled by 1/16 left no zeros
    "prophetnet": dict(num_encoder_layers=2, num_decoder_layers=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
                       num_encoder_attention_heads=4, num_decoder_attention_heads=4), "xlnet": dict(d_inner=128),
    "xmod": dict(is_decoder=True, default_language="en_XX"),  # its adapters are per language: one chosen
    **{t: MUSICGEN for t in PART},
    "codegen": dict(rotary_dim=8), "gptj": dict(rotary_dim=8), "reformer": dict(
        is_decoder=True, attn_layers=("local", "lsh"), attention_head_size=16, feed_forward_size=128, num_buckets=2,
        axial_pos_shape=(8, 16), axial_pos_embds_dim=(16, 48), local_attn_chunk_length=4, lsh_attn_chunk_length=4),
}
# Gemma 4 lays out its layers (and their per-layer head sizes) at construction: set there, not after
GEMMA4 = dict(hidden_size=64, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], head_dim=16,
              global_head_dim=16, vocab_size=256, vocab_size_per_layer_input=256, hidden_size_per_layer_input=16)
GEMMA3N = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
               intermediate_size=[128] * 4, vocab_size_per_layer_input=256, hidden_size_per_layer_input=16,
               laurel_rank=8, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0])  # its last 2 layers reuse KV states
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)  # a multimodal model's vision tower: the default SigLIP took over 15 s to build
BLT_LOCAL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
CONSTRUCT: dict[str, dict] = {  # model type -> settings its config is constructed with (before BASE and TWEAKS)
    **{t: GEMMA4 for t in ("gemma4_text", "gemma4_unified_text")},
    **{t: dict(text_config=GEMMA4) for t in ("gemma4", "gemma4_unified")},
    "blt": dict(patcher_config=BLT_LOCAL, encoder_config=dict(BLT_LOCAL, hidden_size_global=64),
                decoder_config=dict(BLT_LOCAL, hidden_size_global=64), encoder_hash_byte_group_size=[3, 4],
                global_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128),
                encoder_hash_byte_group_vocab=64),  # 6 hash tables of 500002 x 1024 took over 15 s to build
    "gemma3n_text": GEMMA3N, "gemma3": dict(vision_config=VISION, mm_tokens_per_image=4),
    "git": dict(vision_config=VISION),  # its CLIP encoder: 12 layers of 768
    "got_ocr2": dict(vision_config=dict(hidden_size=32, output_channels=32, num_hidden_layers=2, num_attention_heads=2,
                                        image_size=64, patch_size=16, window_size=2, global_attn_indexes=[1],
                                        mlp_dim=64)),  # its SAM encoder: 12 layers of 768 on 1024 x 1024 images
    "gemma3n": dict(text_config=GEMMA3N, vision_config=dict(hidden_size=32), audio_config=dict(
        hidden_size=32, conf_num_hidden_layers=1, conf_num_attention_heads=2, sscp_conv_channel_size=[8, 8])),
    "phi4_multimodal": dict(vision_config=dict(VISION, crop_size=28), audio_config=dict(
        hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2, ext_pw_out_channel=32,
        depthwise_separable_out_channel=32, nemo_conv_channels=32)),  # its 24 audio blocks of 1024 too
    "moss_transcribe_diarize": dict(audio_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=2, max_source_positions=64)),
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, sliding_window=4,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),  # the middle one loops
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0)}),
    "dbrx": dict(d_model=64, ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2),  # its modeling
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0)),  # reads rope_theta, clamps qkv
}
# Gemma 4's drafters run on their target's outputs (transformers' SinglePositionMultiTokenCandidateGenerator): each
# token's embedding beside the target's last hidden state (inputs_embeds) and the target's keys and values
# (shared_kv_states), every layer of theirs reading those. Checked on such inputs, and drafting for their target
DRAFTERS = {"gemma4_assistant": "gemma4_text", "gemma4_unified_assistant": "gemma4_unified_text"}  # -> its target
CONSTRUCT.update({t: dict(text_config=dict(GEMMA4, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0),
                          backbone_hidden_size=BASE["hidden_size"]) for t in DRAFTERS})  # no per-layer inputs
NOT_BUILT: dict[str, str] = {}  # model type -> why no tiny config of it builds and runs here (transformers 5.24)


class NoVisionTower(nn.Module):
    """Stands in for a vision tower built by a library not installed here (Gemma 3n's: timm); the sweep's text
    inputs never reach it, and a call says so."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("the family sweep built this model without its vision tower (timm is not installed)")


STAND_IN = {"gemma3n": "Gemma3nVisionConfig"}  # model type -> the config class of the sub-model NoVisionTower replaces
NOTES = {  # model type -> how it was built or what a swap leaves, where the table should say so
    "gemma3n": "built without its vision tower (`TimmWrapperModel`, whose construction requires timm: not installed "
               "here), which text inputs never reach; the swap serves its text decoder, and its audio encoder "
               "(`Gemma3nAudioAttention`) keeps the softmax it hard-codes",
    **{t: "built from its composite config's decoder (its causal-LM class is the decoder alone), 1 codebook; its "
          "`generate` needs `decoder_start_token_id` and `num_return_sequences` given (transformers 5.24 fails "
          "without them, patched or not)" for t in PART},
    **{t: f"a drafter: checked on its target's (`{target}`) outputs, and drafting for it in assisted `generate`; "
          "its `num_assistant_tokens` set (transformers 5.24 leaves it None and drafting fails)"
       for t, target in DRAFTERS.items()},
}


SDPA_REFERENCE = {  # model type -> why its softmax path is checked against its sdpa attention, not eager
    "blt": "padded bytes reach its real positions through its patches, where eager's all-masked attention rows take "
           "the values' mean and sdpa and this library zeros (left-padded: eager and sdpa differ by 0.64, library and "
           "sdpa by 2e-6; unpadded all three agree)",
    "recurrent_gemma": "its recurrent layers read the padded positions, whose all-masked attention rows eager fills "
                       "with the values' mean where sdpa and this library give zeros (eager and sdpa differ by 5e-3)",
}
KEY_SCALE = {"ZayaQKNorm": "temp"}  # learned key scales that start at 0 (every score 0): set to 1 after building


def causal_lm_types() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@contextlib.contextmanager
def stand_in(config_class: str | None):
    """While it is open, ``AutoModel.from_config`` builds a :class:`NoVisionTower` for a config of ``config_class``."""
    auto = transformers.AutoModel
    own, original = vars(auto)["from_config"], auto.from_config  # its own classmethod, and that bound to it
    if config_class is not None:
        auto.from_config = lambda config, **kwargs: (
            NoVisionTower() if type(config).__name__ == config_class else original(config, **kwargs))
    try:
        yield
    finally:
        auto.from_config = own


def build(model_type: str):
    """A tiny random float32 model of ``model_type`` in eval mode, eager attention."""
    config = transformers.AutoConfig.for_model(model_type, **copy.deepcopy(CONSTRUCT.get(model_type, {})))
    config = getattr(config, PART[model_type]) if model_type in PART else config
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        small = {name: value for name, value in SMALL.items() if getattr(part, name, None) is not None}
        for name, value in {**BASE, **small, **TWEAKS.get(model_type, {})}.items():
            try:
                setattr(part, name, value)
            except (AttributeError, TypeError, ValueError, NotImplementedError):
                pass  # a config without that setting (or refusing it: prophetnet's layers, xlnet's length)
    torch.manual_seed(0)
    with stand_in(STAND_IN.get(model_type)):
        if model_type in PART:  # the part's own model type (musicgen_decoder) is not one of the causal-LM mapping's
            model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])._from_config(
                config, attn_implementation="eager").eval()
        else:
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    if model_type in DRAFTERS:  # tokens drafted a round: transformers 5.24 leaves it None, and its drafting fails
        model.generation_config.num_assistant_tokens = 2
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ in KEY_SCALE:
                getattr(module, KEY_SCALE[type(module).__name__]).fill_(1.0)
    return model


def inputs(length: int = 8) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, BASE["vocab_size"], (2, length), generator=generator)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask}


def drafter_inputs(target, batch) -> dict:
    """A drafter's inputs for its first token, as transformers' candidate generator makes them from ``target``'s
    outputs on ``batch``: one query, the last token's embedding beside the target's last hidden state there (more
    queries a forward fail in transformers 5.24: Gemma 4 slices per-layer inputs the drafter does not have)."""
    with torch.no_grad():
        out = target(**batch, output_hidden_states=True, return_shared_kv_states=True)
    ids, length = batch["input_ids"][:, -1:], batch["input_ids"].shape[1]
    embeds = torch.cat([target.get_input_embeddings()(ids), out.hidden_states[-1][:, -1:]], dim=-1)
    return dict(inputs_embeds=embeds, attention_mask=batch["attention_mask"], shared_kv_states=out.shared_kv_states,
                position_ids=torch.full((ids.shape[0], 1), length - 1))


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def attention_weights(model, batch) -> list[torch.Tensor]:
    with torch.no_grad():
        weights = [w for w in model(**batch, output_attentions=True).attentions or () if w is not None]
    assert weights, "no attention weights came back"
    return weights


def check_works(model, batch, model_type: str, target=None) -> None:
    """Every step of a family that patches (AssertionError on the first that fails)."""
    own = reference = logits(model, batch)
    if model_type in SDPA_REFERENCE:
        model.set_attn_implementation("sdpa")
        reference = logits(model, batch)
        model.set_attn_implementation("eager")
    hs.patch_model(model, attn="sparse_softmax")  # no cut: softmax through the library's path
    # padded positions: eager spreads them evenly, the library zeroes them (a drafter: its queries are the last ones)
    real = batch["attention_mask"].bool()[:, -reference.shape[1]:]
    torch.testing.assert_close(logits(model, batch)[real], reference[real], atol=2e-5, rtol=1e-4)
    # the keys no mask hides (causal, padding, window, an indexer's selection): where softmax weighs them
    unmasked = [w > 0 for w in attention_weights(model, batch)]
    hs.patch_model(model, attn="entmax15")
    sparse = logits(model, batch)
    assert not torch.allclose(sparse, own), "entmax15 left the logits as they were"
    weights = attention_weights(model, batch)
    assert len(weights) == len(unmasked), "the softmax and entmax15 paths returned different layers' weights"
    assert any(((w == 0) & seen).any() for w, seen in zip(weights, unmasked)), "no exact zeros among unmasked keys"
    model.train()
    torch.manual_seed(0)
    out = model(**batch)
    out.logits.float().square().mean().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters()), "no gradient"
    model.eval()
    check_generate(model, model_type, target)
    hs.unpatch_model(model)
    torch.testing.assert_close(logits(model, batch), own, atol=0, rtol=0)


def check_generate(model, model_type: str, target=None) -> None:
    """``generate`` with and without a cache; a drafter drafts for its ``target`` (greedy: the target's tokens)."""
    prompt = {k: v[:1] for k, v in inputs().items()}
    if target is not None:
        calls = []
        hook = model.register_forward_hook(lambda *args: calls.append(1))
        assisted = target.generate(**prompt, assistant_model=model, max_new_tokens=4, do_sample=False, pad_token_id=0)
        hook.remove()
        assert calls, "the drafter drafted nothing"
        plain = target.generate(**prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(assisted, plain), "greedy assisted decoding changed the target's tokens"
        return
    options = GENERATE.get(model_type, dict(pad_token_id=0))
    cached = model.generate(**prompt, max_new_tokens=2, do_sample=False, use_cache=True, **options)
    fresh = model.generate(**prompt, max_new_tokens=2, do_sample=False, use_cache=False, **options)
    # MusicGen's delay pattern puts its start token in the prompt's first place and returns [batch, codebooks, length]
    # without it
    length = prompt["input_ids"].shape[1] + 2
    assert cached.shape == fresh.shape == ((1, 1, length - 1) if model_type in PART else (1, length))


def check_loss(model, batch, model_type: str) -> str:
    """``patch_model(loss="sparsemax")``: WORKS (a finite loss other than cross-entropy) or REFUSED."""
    if model_type in DRAFTERS:  # no loss: its forward takes no labels, so a swapped loss would never run
        try:
            hs.patch_model(model, loss="sparsemax")
        except ValueError:
            return "REFUSED"
        raise AssertionError("the loss of a model that computes none was swapped")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():  # MusicGen's labels: [batch, length, codebooks]
        own = model(**batch, labels=labels[..., None] if model_type in PART else labels).loss
    try:
        hs.patch_model(model, loss="sparsemax")
    except ValueError:
        return "REFUSED"
    with torch.no_grad():
        sparse = model(**batch, labels=labels).loss
    with torch.no_grad():  # the loss of the model's own logits, shifted as transformers' causal-LM loss shifts them
        scores = model(**batch).logits[:, :-1].float()
    expected = hs.sparsemax_loss(scores.reshape(-1, scores.shape[-1]), labels[:, 1:].reshape(-1))
    assert torch.isfinite(sparse) and not torch.equal(sparse, own), "the sparse loss did not change the loss"
    torch.testing.assert_close(sparse.float(), expected, rtol=1e-4, atol=1e-5)
    return "WORKS"


def sweep(model_type: str) -> tuple[str, str]:
    """``(attention outcome, loss outcome)`` of one family; AssertionError / any other error: a failing row."""
    model, batch, target = build(model_type), inputs(), None
    if model_type in DRAFTERS:
        target = build(DRAFTERS[model_type])
        batch = drafter_inputs(target, batch)
    fresh = copy.deepcopy(model)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    try:
        hs.patch_model(model, attn="entmax15")
    except ValueError:
        assert model.config._attn_implementation == "eager", "a refused patch changed the model"
        assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
        return "REFUSED", "not run" if model_type in NO_FORWARD else check_loss(fresh, batch, model_type)
    else:
        hs.unpatch_model(model)
        check_works(model, batch, model_type, target)
        attention = "WORKS"
    return attention, check_loss(fresh, batch, model_type)


TABLE_START, TABLE_END = "<!-- family table: start -->", "<!-- family table: end -->"


def table() -> str:
    """The docs' family table, from the source reading the sweep is checked against."""
    rows = [f"Checked with transformers {transformers.__version__} by `tests/test_family_sweep.py` (every causal-LM "
            "model type, tiny random configs). WORKS: `patch_model(attn=...)` serves it; REFUSED: `patch_model` "
            "raises a `ValueError` saying why, and the model is left as it was.", "",
            "| model type | attention | why refused (or how it was built) |", "| --- | --- | --- |"]
    for model_type in causal_lm_types():
        if model_type in NOT_BUILT:
            rows.append(f"| `{model_type}` | not built | {NOT_BUILT[model_type]} |")
            continue
        reason = family_verdict(model_type)
        rows.append(f"| `{model_type}` | {'REFUSED' if reason else 'WORKS'} | {reason or NOTES.get(model_type, '')} |")
    return "\n".join(rows)


def docs_section(text: str) -> str:
    match = re.search(re.escape(TABLE_START) + r"\n(.*?)\n" + re.escape(TABLE_END), text, re.S)
    return match.group(1) if match else ""


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "families.md")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if TABLE_START not in text:
        sys.exit(f"{path} has no {TABLE_START} marker")
    start, end = text.index(TABLE_START), text.index(TABLE_END)
    text = text[:start] + TABLE_START + "\n" + table() + "\n" + text[end:]
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
