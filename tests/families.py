"""Tiny random configs of the model families the attention sweep covers (built offline from a config)."""

from __future__ import annotations

import torch
import transformers

from hf_sparsemax import supported_families

DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, head_dim=8,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
ENCODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# family -> (model class, config kwargs, kind); kind: "causal", "encoder" or "seq2seq"
FAMILIES = {
    "llama": ("LlamaForCausalLM", DECODER, "causal"),
    "qwen2": ("Qwen2ForCausalLM", DECODER, "causal"),
    "qwen3": ("Qwen3ForCausalLM", DECODER, "causal"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
                  "causal"),
    "mistral": ("MistralForCausalLM", dict(DECODER, sliding_window=4), "causal"),
    "mixtral": ("MixtralForCausalLM", dict(DECODER, num_local_experts=4, num_experts_per_tok=2), "causal"),
    "gemma": ("GemmaForCausalLM", DECODER, "causal"),
    "gemma2": ("Gemma2ForCausalLM", dict(DECODER, attn_logit_softcapping=5.0, sliding_window=4), "causal"),
    "gemma3_text": ("Gemma3ForCausalLM", dict(DECODER, sliding_window=4, sliding_window_pattern=2), "causal"),
    "phi3": ("Phi3ForCausalLM", DECODER, "causal"),
    "smollm3": ("SmolLM3ForCausalLM", DECODER, "causal"),
    "olmo2": ("Olmo2ForCausalLM", DECODER, "causal"),
    "granite": ("GraniteForCausalLM", DECODER, "causal"),
    "starcoder2": ("Starcoder2ForCausalLM", DECODER, "causal"),
    "gpt_oss": ("GptOssForCausalLM", dict(DECODER, num_local_experts=4, num_experts_per_tok=2, sliding_window=4),
                "causal"),
    "gpt2": ("GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                  bos_token_id=1, eos_token_id=2), "causal"),
    "gpt_neox": ("GPTNeoXForCausalLM", dict(ENCODER, rotary_pct=0.5), "causal"),
    "opt": ("OPTForCausalLM", dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                   vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=32,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2), "causal"),
    "bart": ("BartForConditionalGeneration", dict(d_model=32, encoder_layers=2, decoder_layers=2,
                                                  encoder_attention_heads=4, decoder_attention_heads=4,
                                                  encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128,
                                                  max_position_embeddings=64), "seq2seq"),
    "t5": ("T5ForConditionalGeneration", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                              vocab_size=128, decoder_start_token_id=0), "seq2seq"),
    "bert": ("BertForMaskedLM", ENCODER, "encoder"),
    "roberta": ("RobertaForMaskedLM", dict(ENCODER, max_position_embeddings=80), "encoder"),
    "distilbert": ("DistilBertForMaskedLM", dict(dim=32, hidden_dim=64, n_layers=2, n_heads=4, vocab_size=128,
                                                 max_position_embeddings=64), "encoder"),
    "electra": ("ElectraForMaskedLM", dict(ENCODER, embedding_size=32), "encoder"),
    "modernbert": ("ModernBertForMaskedLM", dict(ENCODER, global_attn_every_n_layers=2, local_attention=4,
                                                 cls_token_id=1, sep_token_id=2), "encoder"),
}
# Families that moved onto the attention interface in a later transformers release join the sweep where the
# installed release routes them (transformers 5.24: GPT-J; 5.25: Falcon, whose attention module takes
# output_attentions by name and keeps it from its attention function); on older releases they are refused
# (test_attention).
NEWLY_ROUTED = {
    "falcon": ("FalconForCausalLM", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                                         max_position_embeddings=64, bos_token_id=1, eos_token_id=2), "causal"),
    "gptj": ("GPTJForCausalLM", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64, rotary_dim=4,
                                     bos_token_id=1, eos_token_id=2), "causal"),
}
FAMILIES.update({family: entry for family, entry in NEWLY_ROUTED.items() if family in supported_families()})


def tiny_model(family: str, attn_implementation: str = "eager", seed: int = 0):
    """A tiny random model of ``family`` in eval mode, float32."""
    class_name, kwargs, _ = FAMILIES[family]
    model_class = getattr(transformers, class_name)
    config = model_class.config_class(**kwargs)
    torch.manual_seed(seed)
    return model_class._from_config(config, attn_implementation=attn_implementation).eval()


def batch(family: str, length: int = 10, seed: int = 1) -> dict[str, torch.Tensor]:
    """Two sequences, the second padded (left for decoders, right for encoders) over its first/last 3 tokens."""
    kind = FAMILIES[family][2]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (2, length), generator=generator)
    mask = torch.ones(2, length, dtype=torch.long)
    if kind == "causal":
        mask[1, :3] = 0
    else:
        mask[1, -3:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if kind == "seq2seq":
        inputs["decoder_input_ids"] = torch.randint(3, 128, (2, 6), generator=generator)
    return inputs
