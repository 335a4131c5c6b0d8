"""The seed survey's mappings, first-class: perturb_max, taylor_softmax (loss, processor) and AM-softmax (cosine head)."""

import copy
import math

import pytest
import torch
import transformers
from torch.nn import functional as F

import hf_sparsemax as hs
from hf_sparsemax.mappings.perturb import MAX_CLASSES
from hf_sparsemax.settings import SparseSettings

F64 = torch.float64


# ---- perturb_max ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [0.1, 1.0, 5.0, 30.0])
def test_perturb_max_with_gumbel_noise_is_softmax(scale):
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(0), dtype=F64) * scale
    torch.testing.assert_close(hs.perturb_max(x, noise="gumbel"), torch.softmax(x, -1), rtol=1e-9, atol=1e-13)
    x32 = x.float()
    torch.testing.assert_close(hs.perturb_max(x32, noise="gumbel"), torch.softmax(x32, -1), rtol=1e-4, atol=1e-6)


def test_perturb_max_gaussian_two_classes_is_the_normal_cdf():
    # P[x1 + e1 > x2 + e2] = Phi((x1 - x2) / sqrt(2)) for standard normal noise
    d = torch.linspace(-6, 6, 25, dtype=F64)
    x = torch.stack([d, torch.zeros_like(d)], -1)
    torch.testing.assert_close(hs.perturb_max(x)[:, 0], torch.special.ndtr(d / math.sqrt(2)), rtol=1e-9, atol=1e-12)


def test_perturb_max_gaussian_agrees_with_monte_carlo():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, generator=g, dtype=F64) * 1.5
    samples = 400_000
    eps = torch.randn(samples, *x.shape, generator=g, dtype=F64)
    frequency = F.one_hot((x + eps).argmax(-1), x.shape[-1]).to(F64).mean(0)
    p = hs.perturb_max(x)
    tolerance = 5 * (p * (1 - p) / samples).sqrt() + 1e-4  # five standard errors
    assert ((p - frequency).abs() <= tolerance).all(), (p - frequency).abs().max()


@pytest.mark.parametrize("noise", ["gaussian", "gumbel"])
def test_perturb_max_gradients_match_finite_differences(noise):
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(2), dtype=F64, requires_grad=True)
    fn = lambda x: hs.perturb_max(x, noise=noise, points=64)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))
    masked = torch.tensor([[0.3, -math.inf, 1.2, -0.5]], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (masked,))


def test_perturb_max_masking_conventions():
    low = torch.finfo(torch.float32).min
    x = torch.tensor([[1.0, -math.inf, 2.0, low], [-math.inf] * 4, [low] * 4, [0.5, 0.1, -0.2, 3.0]],
                     requires_grad=True)
    p = hs.perturb_max(x)
    assert p[0, 1] == 0 and p[0, 3] == 0 and torch.equal(p[1:3], torch.zeros(2, 4))  # exact zeros, no NaN
    torch.testing.assert_close(p[[0, 3]].sum(-1), torch.ones(2))
    torch.testing.assert_close(p[0, [0, 2]], hs.perturb_max(torch.tensor([[1.0, 2.0]]))[0])  # masked = absent
    (p * torch.arange(4.0)).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1:3] == 0).all()


def test_perturb_max_nan_and_inf_stay_in_their_slice():
    x = torch.tensor([[1.0, math.nan, 0.0], [1.0, math.inf, 0.0], [1.0, 2.0, 0.0]])
    p = hs.perturb_max(x)
    assert torch.isnan(p[:2]).all() and torch.isfinite(p[2]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_perturb_max_dtypes_shapes_and_dims(dtype):
    x = torch.randn(2, 7, 3, generator=torch.Generator().manual_seed(3)).to(dtype)
    p = hs.perturb_max(x, dim=1)
    assert p.dtype == dtype and p.shape == x.shape
    reference = hs.perturb_max(x.float().transpose(1, 2).contiguous()).transpose(1, 2)
    torch.testing.assert_close(p.float(), reference, rtol=1e-2, atol=1e-3)
    assert hs.perturb_max(x.transpose(0, 2), dim=0).shape == (3, 7, 2)  # non-contiguous
    assert hs.perturb_max(torch.empty(0, 4, dtype=dtype)).shape == (0, 4)
    assert torch.equal(hs.perturb_max(torch.ones(3, 1, dtype=dtype)), torch.ones(3, 1, dtype=dtype))


def test_perturb_max_is_permutation_equivariant():
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(4), dtype=F64)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(hs.perturb_max(x[:, perm]), hs.perturb_max(x)[:, perm], rtol=1e-12, atol=1e-15)


def test_perturb_max_refuses_bad_options_and_large_label_sets():
    x = torch.randn(2, 4)
    for kwargs in ({"noise": "laplace"}, {"points": 1}, {"points": True}, {"points": 2.5}):
        with pytest.raises(ValueError):
            hs.perturb_max(x, **kwargs)
    with pytest.raises(ValueError, match=str(MAX_CLASSES)):
        hs.perturb_max(torch.zeros(1, MAX_CLASSES + 1))
    with pytest.raises(ValueError, match="not an attention"):
        SparseSettings(attn="perturb_max")


def test_perturb_max_loss_is_minus_log_p_target():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 7, generator=g, dtype=F64) * 2
    t = torch.tensor([0, 3, -100, 6, 2])
    kept = t != -100
    torch.testing.assert_close(hs.perturb_max_loss(x, t, noise="gumbel"), F.cross_entropy(x, t), rtol=1e-9, atol=1e-12)
    expected = -hs.perturb_max(x).log()[kept, t[kept]]
    torch.testing.assert_close(hs.perturb_max_loss(x, t, reduction="none")[kept], expected)
    assert hs.perturb_max_loss(x, t, reduction="none")[2] == 0
    torch.testing.assert_close(hs.perturb_max_loss(x, t, reduction="sum"), expected.sum())
    far = torch.tensor([[60.0, 0.0, -60.0]], dtype=F64)  # p_t underflows nowhere: the loss stays finite
    assert torch.isfinite(hs.perturb_max_loss(far, torch.tensor([2])))
    xg = x[:3].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda v: hs.perturb_max_loss(v, t[:3], points=64), (xg,))


# ---- taylor_softmax --------------------------------------------------------------------------------------------

def test_taylor_softmax_loss_closed_form_and_gradient():
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(7), dtype=F64) * 3
    t = torch.tensor([0, 4, 2, -100, 1, 1])
    kept = t != -100
    f = 1 + x + x * x / 2
    expected = (f.sum(-1).log() - f.gather(-1, t.clamp_min(0)[:, None]).squeeze(-1).log())[kept].mean()
    torch.testing.assert_close(hs.taylor_softmax_loss(x, t), expected)
    torch.testing.assert_close(hs.taylor_softmax_loss(x, t), -hs.taylor_softmax(x).log()[kept, t[kept]].mean())
    xg = x.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda v: hs.taylor_softmax_loss(v, t, order=4), (xg,))
    huge = torch.tensor([[1e4, -1e4, 0.0]])
    assert torch.isfinite(hs.taylor_softmax_loss(huge, torch.tensor([1])))  # p is never 0: finite perplexity


def test_taylor_softmax_loss_masking_and_dtypes():
    x = torch.tensor([[1.0, -math.inf, 0.5], [-math.inf, -math.inf, -math.inf]], requires_grad=True)
    t = torch.tensor([2, -100])
    loss = hs.taylor_softmax_loss(x, t, reduction="sum")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and (x.grad[1] == 0).all() and x.grad[0, 1] == 0
    half = torch.randn(4, 6).to(torch.bfloat16)
    target = torch.tensor([1, 2, 3, 0])
    torch.testing.assert_close(hs.taylor_softmax_loss(half, target), hs.taylor_softmax_loss(half.float(), target))
    with pytest.raises(ValueError):
        hs.taylor_softmax_loss(half, target, order=3)


def test_taylor_and_perturb_processors_sample_the_trained_distribution():
    scores = torch.randn(3, 11, generator=torch.Generator().manual_seed(8))
    ids = torch.zeros(3, 1, dtype=torch.long)
    cases = [("taylor_softmax", {"order": 4}, hs.taylor_softmax(scores, order=4)),
             ("perturb_max", {"noise": "gaussian"}, hs.perturb_max(scores)),
             ("am_softmax", {"scale": 5.0}, torch.softmax(5 * scores, -1))]
    for name, options, expected in cases:
        processor = hs.MappingLogitsProcessor(name, **options)
        torch.testing.assert_close(torch.softmax(processor(ids, scores), -1), expected, rtol=0, atol=1e-6)
        hot = hs.MappingLogitsProcessor(name, temperature=2.0, **options)
        torch.testing.assert_close(torch.softmax(hot(ids, scores * 2), -1), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError):
        hs.MappingLogitsProcessor("taylor_softmax", order=0)


def test_taylor_loss_on_a_causal_lm_with_matched_decoding():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0)).eval()
    ids = torch.randint(1, 32, (2, 6), generator=torch.Generator().manual_seed(9))
    hs.patch_model(model, attn="taylor_softmax", loss="taylor_softmax", loss_options={"order": 2})
    out = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, hs.taylor_softmax_loss(out.logits[:, :-1], ids[:, 1:]))
    (processor,) = hs.logits_processors(model)
    torch.testing.assert_close(torch.softmax(processor(ids, out.logits[:, -1]), -1),
                               hs.taylor_softmax(out.logits[:, -1]), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="dense support"):
        hs.patch_model(model, loss="taylor_softmax", loss_options={"fused": True})
    assert model.config.hf_sparsemax["loss"] == "taylor_softmax"  # the refused patch changed nothing
    generated = model.generate(ids, do_sample=True, max_new_tokens=3, pad_token_id=0)
    assert generated.shape == (2, 9)


# ---- AM-softmax ------------------------------------------------------------------------------------------------

def test_am_softmax_loss_is_cross_entropy_of_the_margin_logits():
    g = torch.Generator().manual_seed(10)
    cos = torch.rand(6, 4, generator=g, dtype=F64) * 2 - 1
    t = torch.tensor([0, 3, -100, 1, 2, 2])
    z = 30.0 * (cos - 0.35 * F.one_hot(t.clamp_min(0), 4))
    torch.testing.assert_close(hs.am_softmax_loss(cos, t), F.cross_entropy(z, t))
    z = 4.0 * (cos - 0.1 * F.one_hot(t.clamp_min(0), 4))
    torch.testing.assert_close(hs.am_softmax_loss(cos, t, margin=0.1, scale=4.0, reduction="none"),
                               F.cross_entropy(z, t, reduction="none"))
    cg = cos.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda c: hs.am_softmax_loss(c, t, 0.2, 3.0, reduction="sum"), (cg,))
    none = torch.full((6,), -100)
    assert hs.am_softmax_loss(cos, none) == 0
    for kwargs in ({"margin": -0.1}, {"margin": 2.5}, {"scale": 0}, {"scale": math.inf}, {"margin": True}):
        with pytest.raises(ValueError):
            hs.am_softmax_loss(cos, t, **kwargs)
    with pytest.raises(ValueError, match="cosine head"):
        hs.am_softmax_loss(cos * 3, t)


ENCODER = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
               max_position_embeddings=64, num_labels=3, pad_token_id=0)
DECODER = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
               intermediate_size=32, max_position_embeddings=64, num_labels=3, pad_token_id=0)
HEAD_FAMILIES = {
    "bert": ("Bert", ENCODER),
    "roberta": ("Roberta", ENCODER),
    "distilbert": ("DistilBert", dict(vocab_size=64, dim=32, hidden_dim=32, n_layers=1, n_heads=2, num_labels=3,
                                      pad_token_id=0)),
    "modernbert": ("ModernBert", dict(ENCODER, global_attn_every_n_layers=1, local_attention=4)),
    "llama": ("Llama", DECODER),
    "mistral": ("Mistral", DECODER),
    "qwen2": ("Qwen2", DECODER),
    "gpt2": ("GPT2", dict(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64, num_labels=3,
                          pad_token_id=0)),
}


def classifier(family, seed=0):
    prefix, config = HEAD_FAMILIES[family]
    torch.manual_seed(seed)
    config_class = getattr(transformers, f"{prefix}Config")
    return getattr(transformers, f"{prefix}ForSequenceClassification")(config_class(**config)).eval()


def cosine_oracle(model):
    """The plain model with its head's Linear fed ``h / |h|`` and weight ``W / |W|``, bias 0: its logits are cosines."""
    from hf_sparsemax.losses.cosine_head import COSINE_HEADS

    oracle = copy.deepcopy(model)
    linear = oracle.get_submodule(COSINE_HEADS[model.config.model_type])
    with torch.no_grad():
        linear.weight.copy_(F.normalize(linear.weight, dim=-1))
        if linear.bias is not None:
            linear.bias.zero_()
    linear.register_forward_pre_hook(lambda module, args: (F.normalize(args[0], dim=-1),))
    return oracle


@pytest.mark.parametrize("family", HEAD_FAMILIES)
def test_cosine_head_follows_the_plain_pooling_path(family):
    model = classifier(family)
    ids = torch.randint(1, 64, (4, 9), generator=torch.Generator().manual_seed(11))
    ids[1, -3:] = 0  # right padding: pooling must pick the same position as the plain head
    mask = (ids != 0).long()
    labels = torch.tensor([0, 2, -100, 1])
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        expected = cosine_oracle(model)(input_ids=ids, attention_mask=mask).logits
    keys = sorted(model.state_dict())
    hs.patch_model(model, loss="am_softmax", loss_options={"margin": 0.2, "scale": 8.0})
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-6)
    assert out.logits.abs().max() <= 1 + 1e-6
    torch.testing.assert_close(out.loss, hs.am_softmax_loss(out.logits, labels, margin=0.2, scale=8.0))
    out.loss.backward()
    assert sorted(model.state_dict()) == keys  # same parameters, same checkpoint keys
    hs.unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, plain)
    assert not hasattr(model.config, "hf_sparsemax")


def test_cosine_head_honours_num_items_and_reapplies_from_the_config(tmp_path):
    model = classifier("bert")
    ids = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(12))
    labels = torch.tensor([0, 1, 2])
    hs.patch_model(model, loss="am_softmax")
    out = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(6))
    torch.testing.assert_close(out.loss, hs.am_softmax_loss(out.logits, labels, reduction="sum") / 6)
    assert model(input_ids=ids, labels=labels, return_dict=False)[0] == out.loss * 2
    model.save_pretrained(tmp_path)
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path).eval()
    hs.patch_model(loaded)
    torch.testing.assert_close(loaded(input_ids=ids).logits, out.logits)


def test_cosine_head_refusals_change_nothing():
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in DECODER.items() if k != "num_labels"}))
    with pytest.raises(ValueError, match="sequence-classification"):
        hs.patch_model(lm, loss="am_softmax")
    assert not hasattr(lm.config, "hf_sparsemax")
    deberta = transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(**ENCODER))
    with pytest.raises(ValueError, match="families"):
        hs.patch_model(deberta, loss="am_softmax")
    model = classifier("bert")
    model.config.problem_type = "multi_label_classification"
    with pytest.raises(ValueError, match="single-label"):
        hs.patch_model(model, loss="am_softmax")
    with pytest.raises(ValueError, match="fused"):
        SparseSettings(loss="am_softmax", loss_options={"fused": True})
    with pytest.raises(ValueError, match="sequence_classification"):
        hs.compute_loss_func("am_softmax", task="causal_lm")


def test_compute_loss_func_am_softmax_on_cosine_logits():
    model = classifier("bert")
    ids = torch.randint(1, 64, (4, 7), generator=torch.Generator().manual_seed(13))
    labels = torch.tensor([0, 1, -100, 2])
    hs.patch_model(model, loss="am_softmax", loss_options={"scale": 10.0})
    out = model(input_ids=ids)
    fn = hs.compute_loss_func("am_softmax", task="sequence_classification", scale=10.0)
    torch.testing.assert_close(fn(out, labels, num_items_in_batch=torch.tensor(3)),
                               hs.am_softmax_loss(out.logits, labels, scale=10.0))


def test_classify_recipe_has_an_am_softmax_variant():
    from hf_sparsemax.app.recipes import RecipeError, load_recipe

    variant = load_recipe("classify").variant("am_softmax")
    assert variant.loss == "am_softmax" and variant.loss_options == {"margin": 0.35, "scale": 30.0}
    with pytest.raises(RecipeError, match="sequence_classification"):
        load_recipe("default", ["variants.top3={loss: am_softmax}"])


def test_cosine_head_through_peft_trains_the_saved_copy_of_the_head():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(classifier("bert"), LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query", "value"]))
    ids = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(14))
    labels = torch.tensor([0, 1, 2])
    hs.patch_model(model, loss="am_softmax")
    out = model(input_ids=ids, labels=labels)
    assert out.logits.abs().max() <= 1
    torch.testing.assert_close(out.loss, hs.am_softmax_loss(out.logits, labels))
    out.loss.backward()
    trained = model.base_model.model.classifier.modules_to_save["default"].weight
    assert trained.grad is not None and trained.grad.abs().sum() > 0
    hs.unpatch_model(model)
    assert model(input_ids=ids).logits.abs().max() != out.logits.abs().max()
