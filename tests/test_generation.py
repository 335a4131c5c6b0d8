"""Decoding that matches training: processors, matched generate, sampling statistics, report."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList, TextStreamer, TopKLogitsWarper

import hf_sparsemax as hs

VOCAB = 120
PROCESSORS = [
    (hs.SparseSoftmaxLogitsProcessor(top_k=7), lambda x: hs.sparse_softmax(x, top_k=7)),
    (hs.SparseSoftmaxLogitsProcessor(top_p=0.6), lambda x: hs.sparse_softmax(x, top_p=0.6)),
    (hs.SparseSoftmaxLogitsProcessor(top_k=20, top_p=0.8), lambda x: hs.sparse_softmax(x, top_k=20, top_p=0.8)),
    (hs.SparsemaxLogitsProcessor(), hs.sparsemax),
    (hs.EntmaxLogitsProcessor(), hs.entmax15),
    (hs.EntmaxLogitsProcessor(alpha=1.3), lambda x: hs.entmax_bisect(x, 1.3)),
    (hs.SparsemaxLogitsProcessor(temperature=0.5), lambda x: hs.sparsemax(x / 0.5)),
]


@pytest.mark.parametrize("processor,mapping", PROCESSORS)
def test_softmax_of_processed_scores_is_the_mapping(processor, mapping):
    torch.manual_seed(0)
    scores = torch.randn(6, VOCAB) * torch.tensor([0.3, 1, 2, 4, 8, 1])[:, None]  # different support sizes
    scores[5, :30] = float("-inf")
    processed = processor(torch.zeros(6, 3, dtype=torch.long), scores)
    assert torch.allclose(torch.softmax(processed, -1), mapping(scores), atol=1e-6)
    assert torch.equal(processed == float("-inf"), mapping(scores) == 0)


@pytest.mark.parametrize("bad", [
    lambda: hs.SparseSoftmaxLogitsProcessor(top_k=0), lambda: hs.SparseSoftmaxLogitsProcessor(top_p=0),
    lambda: hs.EntmaxLogitsProcessor(alpha=1.0), lambda: hs.SparsemaxLogitsProcessor(temperature=0),
])
def test_bad_processor_options(bad):
    with pytest.raises(ValueError):
        bad()


def fixed_model(bias, seed=0):
    """A tiny Llama whose next-token logits are ``bias`` whatever the input (final norm zeroed)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(bias), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=None,
                         bos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    return model


def chi_square_critical(df, z=3.09):
    """Upper 0.999 quantile of chi-square (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("loss,options,mapping", [
    ("sparse_softmax", {"top_k": 6}, lambda x: hs.sparse_softmax(x, top_k=6)),
    ("sparse_softmax", {"top_p": 0.7}, lambda x: hs.sparse_softmax(x, top_p=0.7)),
    ("sparsemax", {}, hs.sparsemax),
    ("entmax15", {}, hs.entmax15),
])
def test_generate_samples_the_trained_distribution(loss, options, mapping):
    torch.manual_seed(1)
    bias = torch.randn(VOCAB) * 0.5
    model = hs.patch_model(fixed_model(bias), loss=loss, loss_options=options)
    p = mapping(bias)
    torch.manual_seed(123)
    out = model.generate(input_ids=torch.full((20000, 1), 5), do_sample=True, max_new_tokens=1)
    counts = torch.bincount(out[:, -1], minlength=VOCAB).double()
    assert counts[p == 0].sum() == 0  # never a zero-probability token
    expected = p[p > 0].double() * 20000
    stat = ((counts[p > 0] - expected) ** 2 / expected).sum().item()
    assert stat < chi_square_critical(int((p > 0).sum()) - 1), stat


def test_default_top_k_does_not_cut_a_wide_sparsemax_support():
    bias = torch.linspace(0, 0.02, VOCAB)  # sparsemax keeps all of these
    assert (hs.sparsemax(bias) > 0).sum() > 60
    model = hs.patch_model(fixed_model(bias), loss="sparsemax")
    torch.manual_seed(0)
    out = model.generate(input_ids=torch.full((3000, 1), 5), do_sample=True, max_new_tokens=1)
    ranks_used = torch.unique(out[:, -1])
    assert (ranks_used < VOCAB - 50).any()  # tokens outside transformers' default top-50 are sampled


def test_user_options_interplay():
    torch.manual_seed(2)
    bias = torch.randn(VOCAB) * 2
    model = hs.patch_model(fixed_model(bias), loss="sparsemax")
    ids = torch.full((4000, 1), 5)
    out = model.generate(input_ids=ids, do_sample=True, max_new_tokens=1, temperature=2.0)
    hot = hs.sparsemax(bias / 2.0)
    assert set(out[:, -1].unique().tolist()) <= set((hot > 0).nonzero().squeeze(1).tolist())
    assert (hs.sparsemax(bias) > 0).sum() < (hot > 0).sum()  # temperature before the mapping widens it
    out = model.generate(input_ids=ids, do_sample=True, max_new_tokens=1, top_k=2)
    assert set(out[:, -1].unique().tolist()) <= set(bias.topk(2).indices.tolist())
    extra = LogitsProcessorList([TopKLogitsWarper(3)])
    out = model.generate(input_ids=ids, do_sample=True, max_new_tokens=1, logits_processor=extra)
    assert set(out[:, -1].unique().tolist()) <= set(bias.topk(3).indices.tolist())


def tiny_lm(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                         bos_token_id=2)
    return LlamaForCausalLM(config).eval()


def test_greedy_beam_padding_cache_and_streaming(capsys):
    model = hs.patch_model(tiny_lm(), loss="sparse_softmax", loss_options={"top_k": 4})
    ids = torch.randint(3, VOCAB, (3, 6))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0  # left padding
    assert model.generation_config.do_sample  # what engines read (see test_reload): greedy is asked for
    greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    plain = type(model).generate(model, input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(greedy, plain)  # the mapping keeps the argmax
    beams = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False,
                           output_scores=True, return_dict_in_generate=True)
    assert torch.isfinite(beams.sequences_scores).all()
    results = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        results.append(model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=6,
                                      use_cache=use_cache))
    assert torch.equal(*results)

    class Tokens:
        def decode(self, tokens, **kwargs):
            return " ".join(str(int(t)) for t in tokens)

    model.generate(input_ids=ids[1:2], do_sample=True, max_new_tokens=3, streamer=TextStreamer(Tokens()))
    assert capsys.readouterr().out.strip()


def test_unpatch_restores_generate_and_processor_list():
    model = hs.patch_model(tiny_lm(), loss="entmax15")
    assert len(hs.logits_processors(model)) == 1 and "generate" in vars(model)
    hs.patch_model(model, loss="cross_entropy")
    assert len(hs.logits_processors(model)) == 0 and "generate" not in vars(model)
    hs.patch_model(model, loss="sparsemax")
    hs.unpatch_model(model)
    assert "generate" not in vars(model)


class CharTokenizer:
    """A tiny tokenizer over VOCAB ids for the report (ids 3.. map to letters)."""

    pad_token, pad_token_id, eos_token, eos_token_id, padding_side = "<pad>", 0, "</s>", 1, "right"

    def __call__(self, texts, return_tensors="pt", padding=True):
        from transformers import BatchEncoding

        rows = [[3 + (ord(c) % (VOCAB - 3)) for c in text] for text in texts]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        return BatchEncoding({"input_ids": ids, "attention_mask": (ids != 0).long()})

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r.tolist())) for r in rows]


def test_decoding_report_matched_and_unmatched():
    model = hs.patch_model(tiny_lm(), loss="sparse_softmax", loss_options={"top_k": 5})
    matched = hs.decoding_report(model, CharTokenizer(), ["hello", "sparse world"], max_new_tokens=8)
    assert matched["tokens"] > 0 and matched["zero_prob_share"] == 0
    assert matched["mean_support_size"] == 5 and matched["mean_truncated_mass"] < 1e-6
    unmatched = hs.decoding_report(model, CharTokenizer(), ["hello", "sparse world"], max_new_tokens=8,
                                   matched=False, top_k=50)
    assert unmatched["zero_prob_share"] > 0 and unmatched["mean_decoder_support_size"] == 50
    softmax_trained = hs.decoding_report(tiny_lm(), CharTokenizer(), ["hi"], max_new_tokens=8, matched=False, top_k=10)
    assert softmax_trained["zero_prob_share"] == 0 and softmax_trained["mean_truncated_mass"] > 0
