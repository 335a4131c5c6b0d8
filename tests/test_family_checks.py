"""Refusal at patch time, attention sinks by either name, and the loss swap on transformers' causal-LM fallback."""

import pytest
import torch
import transformers
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

import hf_sparsemax as hs
from hf_sparsemax.attention import sparse_attention_forward

from family_sweep import build, inputs


@pytest.mark.parametrize("model_type,argument", [("minimax_m3_vl_text", "block_indices")])
def test_an_argument_the_attention_cannot_reproduce_is_refused_at_patch_time(model_type, argument):
    model = build(model_type)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"'{argument}'"):
        hs.patch_model(model, attn="entmax15")
    assert model.config._attn_implementation == "eager"
    assert model_type not in hs.supported_families()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_sinks_by_either_name_give_the_same_attention():
    torch.manual_seed(0)
    query, key, value = torch.randn(3, 2, 4, 5, 8, dtype=torch.float64).unbind(0)
    per_head = torch.randn(4, dtype=torch.float64)
    module = torch.nn.Module()
    by_s_aux = sparse_attention_forward(module, query, key, value, None, s_aux=per_head, mapping="entmax15")[0]
    per_query = per_head.view(1, 4, 1, 1).expand(2, 4, 5, 1)
    by_sinks = sparse_attention_forward(module, query, key, value, None, sinks=per_query, mapping="entmax15")[0]
    torch.testing.assert_close(by_sinks, by_s_aux, atol=0, rtol=0)
    # softmax with a sink column, as Inkling-2's eager attention computes it
    scores = torch.cat([query @ key.transpose(-1, -2) * 8 ** -0.5, per_query], dim=-1)
    mask = torch.ones(5, 6, dtype=torch.bool).tril()
    mask[:, -1] = True
    reference = scores.masked_fill(~mask, float("-inf")).softmax(-1)[..., :-1] @ value
    ours = sparse_attention_forward(module, query, key, value, None, sinks=per_query, mapping="sparse_softmax")[0]
    torch.testing.assert_close(ours, reference.transpose(1, 2), atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="twice"):
        sparse_attention_forward(module, query, key, value, None, s_aux=per_head, sinks=per_query,
                                    mapping="entmax15")


@pytest.mark.parametrize("class_name,config", [
    ("GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64)),
    ("BertLMHeadModel", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             vocab_size=128, is_decoder=True)),
    ("CTRLLMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=128, dff=64)),
])
def test_the_loss_swaps_where_transformers_falls_back_to_the_causal_lm_loss(class_name, config):
    model_class = getattr(transformers, class_name)
    torch.manual_seed(0)
    model = model_class._from_config(model_class.config_class(**config)).eval()
    assert model.loss_type is None  # transformers computes ForCausalLMLoss for it
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    hs.patch_model(model, loss="sparsemax")
    assert LOSS_MAPPING.get(model.loss_type) is ForCausalLMLoss  # Trainer counts the shifted labels
    got = model(input_ids=ids, labels=labels).loss
    logits = model(input_ids=ids).logits
    want = hs.sparsemax_loss(logits[:, :-1].reshape(-1, 128), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(got, want)
    hs.unpatch_model(model)
    assert model.loss_type is None and "_loss_function" not in vars(model)


def test_families_without_attention_are_refused_with_words_that_say_so():
    with pytest.raises(ValueError, match="has no attention"):
        hs.patch_model(build("mamba"), attn="entmax15")
    assert inputs()["attention_mask"][1, :3].sum() == 0
