"""DeepSeek-V3.2's lightning indexer: the sparse attention runs over the keys the indexer selects (``indices``).

The model's eager attention folds the indexer's top-k keys into its mask (every other key gets ``finfo.min``);
under a sparse attention the model passes ``indices`` instead, and the library folds them into the mask the same
way (``interface.selected_keys``). Checked against eager with softmax as the mapping, and with sparsemax /
entmax15 against eager's own computation with the mapping swapped for the ``entmax`` package's (the oracle).
"""

import pytest
import torch
import transformers
from entmax import entmax15, sparsemax
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as modeling

import hf_sparsemax as hs
from hf_sparsemax.attention.families import family_verdict
from hf_sparsemax.attention.interface import selected_keys

TOP_K = 4  # keys the indexer selects per query: fewer than most queries see, so the selection matters
ORACLES = {"sparse_softmax": torch.softmax, "sparsemax": sparsemax, "entmax15": entmax15}  # sparse_softmax: no cut


def tiny(dtype=torch.float64, top_k=TOP_K, spread=0.02):
    config = transformers.DeepseekV32Config(  # dense MLPs in both layers: the experts take no float64
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, index_topk=top_k, index_head_dim=16, index_n_heads=2,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        initializer_range=spread)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval().to(dtype)


def batch(length=12, padded=True):
    ids = torch.randint(3, 256, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, length, dtype=torch.long)
    if padded:
        mask[1, :3] = 0  # left padding: the indexer must not select padded keys
    return {"input_ids": ids, "attention_mask": mask}


def logits_and_grads(model, inputs):
    """Logits at the real positions and the parameters' gradients of a loss over them."""
    model.zero_grad()
    real = inputs["attention_mask"].bool()
    logits = model(**inputs).logits[real]
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2), dtype=logits.dtype)
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got, want, tolerance):
    torch.testing.assert_close(got[0], want[0], atol=tolerance, rtol=tolerance)
    assert got[1].keys() == want[1].keys() and want[1]
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=tolerance, rtol=tolerance, msg=lambda text: f"{name}: {text}")


def oracle_attention(mapping, masks):
    """Eager's attention function (its mask holds the indexer's selection) with the oracle's mapping for softmax,
    in the model's dtype; each mask it gets is appended to ``masks``."""

    def reference(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        masks.append(attention_mask)
        weights = ORACLES[mapping](torch.matmul(query, key.transpose(2, 3)) * scaling + attention_mask, dim=-1)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    return reference


def test_dsa_families_are_served():
    for model_type in ("deepseek_v32", "glm_moe_dsa", "axk2", "dots3_note_text", "hy_v4"):
        assert family_verdict(model_type) is None, model_type
        assert model_type in hs.supported_families()


def test_softmax_through_the_library_equals_eager():
    # Eager's softmax runs in float32 (so: to 1e-5), where a left-padded row of finfo(float64).min is NaN (so: no
    # padding); the float64 reference with padding is the next test's.
    model, inputs = tiny(), batch(padded=False)
    own = logits_and_grads(model, inputs)
    hs.patch_model(model, attn="sparse_softmax")  # no top-k cut: softmax on the library's path
    assert_same(logits_and_grads(model, inputs), own, 1e-5)
    with torch.no_grad():
        weights = model(**inputs, output_attentions=True).attentions
    seen = torch.stack([(w > 0).sum(-1) for w in weights])  # keys each query weighs: the indexer's TOP_K at most
    assert seen.max() == TOP_K and (seen[..., TOP_K:] == TOP_K).all()
    hs.patch_model(model, attn="softmax")
    assert_same(logits_and_grads(model, inputs), own, 0)


def test_softmax_through_the_library_equals_eager_with_left_padding():
    model, inputs = tiny(torch.float32), batch()
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        own = model(**inputs).logits[real]
        hs.patch_model(model, attn="sparse_softmax")
        torch.testing.assert_close(model(**inputs).logits[real], own, atol=1e-5, rtol=1e-5)
    wide = tiny(torch.float32, top_k=64)  # the indexer selecting every key: another model, so the test can fail
    with torch.no_grad():
        assert not torch.allclose(wide(**inputs).logits[real], own, atol=1e-3)


@pytest.mark.parametrize("mapping", sorted(ORACLES))
def test_attention_over_the_selected_keys_equals_a_dense_reference(mapping, monkeypatch):
    model, inputs = tiny(spread=0.2), batch()  # scores spread enough for entmax15 to zero some selected keys
    masks = []
    monkeypatch.setattr(modeling, "eager_attention_forward", oracle_attention(mapping, masks))
    want = logits_and_grads(model, inputs)
    monkeypatch.undo()
    hs.patch_model(model, attn=mapping)
    assert_same(logits_and_grads(model, inputs), want, 1e-9)
    with torch.no_grad():
        weights = model(**inputs, output_attentions=True).attentions
    real = inputs["attention_mask"].bool()[:, None, :, None]
    for w, mask in zip(weights, masks):
        unselected = mask <= torch.finfo(mask.dtype).min  # the padding, the future and the keys not selected
        assert (w.masked_select(unselected.expand_as(w)) == 0).all()
        torch.testing.assert_close(w.sum(-1)[real.squeeze(-1).expand(w.shape[:-1])], torch.ones(()).double()
                                   .expand(int(real.sum()) * w.shape[1]), atol=1e-12, rtol=0)
    zeros = any(((w == 0) & (m > torch.finfo(m.dtype).min)).any() for w, m in zip(weights, masks))
    assert zeros == (mapping != "sparse_softmax"), "zeros among the selected keys: the mapping's own sparsity"


def test_training_step():
    model, inputs = tiny(torch.float32), batch()
    hs.patch_model(model, attn="entmax15")
    model.train()
    model(**inputs, labels=inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.model.layers[0].self_attn.q_b_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("padded", [False, True])  # without padding the mask function is asked for a plain causal
def test_cached_decoding_equals_the_dense_reference(padded, monkeypatch):  # mask: the model forces it built
    # A cached step against the reference's cached step (not against a forward over the whole sequence: the
    # indexer's relu leaves ties among its scores, which top-k breaks differently at another length, under eager too)
    model = tiny(spread=0.2)
    prompt = {k: v[:, :8] if padded else v[:1, :8] for k, v in batch().items()}
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    monkeypatch.setattr(modeling, "eager_attention_forward", oracle_attention("entmax15", []))
    want = model.generate(**prompt, **settings)
    monkeypatch.undo()
    hs.patch_model(model, attn="entmax15")
    got = model.generate(**prompt, **settings)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-9, rtol=1e-9)
    fresh = model.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(fresh, got.sequences)


def test_selected_keys_folds_the_indices_into_the_mask():
    query, key = torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 5, 8)
    module = torch.nn.Module()
    indices = torch.tensor([[[0, -1], [1, 0], [2, 4]]]).expand(2, 3, 2)  # -1: padding, selects nothing
    mask = torch.zeros(2, 1, 3, 6)  # one key past the call's: cut off
    mask[1, ..., 0] = torch.finfo(torch.float32).min
    got = selected_keys(indices, mask, module, query, key, {})
    seen = got > torch.finfo(torch.float32).min
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(seen[0, 0], want) and torch.equal(seen[1, 0], want & torch.tensor([0, 1, 1, 1, 1]).bool())
    assert torch.equal(selected_keys(indices, mask == 0, module, query, key, {})[0, 0], want)  # a boolean mask
    causal = selected_keys(indices, None, module, query, key, {})  # no mask: the causal mask the attention applies
    assert torch.equal((causal > torch.finfo(torch.float32).min)[0, 0], want & torch.ones(3, 5).bool().tril())
    assert selected_keys(None, mask, module, query, key, {}) is mask
    for bad, words in ((indices.float(), "integer"), (indices[:, :2], "integer"), (indices + 5, "key 9 of 5")):
        with pytest.raises(ValueError, match=words):
            selected_keys(bad, mask, module, query, key, {})


@pytest.mark.parametrize("rows, kwargs", [(1, {}), (3, {"is_causal": False})], ids=["one query", "non-causal"])
def test_selected_keys_without_a_mask_where_no_causal_mask_applies(rows, kwargs):
    """No mask and a call that sees every key (a single query, a non-causal call): the selection alone is the mask
    (it raised an IndexError), and the attention over it equals the same call given that mask."""
    from hf_sparsemax.attention.interface import sparse_attention_forward

    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(2, 4, n, 8, generator=generator, dtype=torch.float64) for n in (rows, 5, 5))
    module = torch.nn.Module()
    indices = torch.tensor([[[0, -1], [1, 3], [2, 4]]])[:, :rows].expand(2, rows, 2)
    got = selected_keys(indices, None, module, query, key, kwargs)
    want = torch.tensor([[1, 0, 0, 0, 0], [0, 1, 0, 1, 0], [0, 0, 1, 0, 1]], dtype=torch.bool)[:rows]
    assert got.shape == (2, 1, rows, 5) and torch.equal(got, want.expand(2, 1, rows, 5))
    mask = torch.zeros(2, 1, rows, 5, dtype=torch.float64).masked_fill(~want, torch.finfo(torch.float64).min)
    out = sparse_attention_forward(module, query, key, value, None, mapping="sparsemax", indices=indices, **kwargs)[0]
    reference = sparse_attention_forward(module, query, key, value, mask, mapping="sparsemax", **kwargs)[0]
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)
    weights = sparsemax(torch.matmul(query, key.transpose(-1, -2)) * 8 ** -0.5 + mask, dim=-1)
    torch.testing.assert_close(out, torch.matmul(weights, value).transpose(1, 2), rtol=0, atol=1e-12)


def test_temperature_calibration_reads_the_selection():
    # the calibration's recorded rows and its softmax reference hold the indexer's selection in their masks
    # (before: the recorded indices did not follow the rows it keeps, a ValueError)
    model = tiny(spread=0.2)
    hs.patch_model(model, attn="entmax15", attn_options={"temperature": True})
    result = hs.calibrate_attention(model, [batch()], rounds=1)
    assert result["error_after"] < result["error_before"]
