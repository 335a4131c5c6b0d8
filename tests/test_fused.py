"""The fused head loss: equal to the unfused path (loss on full logits) in value and gradients, and patch_model's fused mode."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import hf_sparsemax as hs
from hf_sparsemax.losses.names import make_loss

CASES = [
    ("sparse_softmax", {"top_k": 5}),
    ("sparse_softmax", {"top_k": 8, "top_p": 0.6}),
    ("sparse_softmax", {"top_p": 0.9}),  # no size bound: dense fallback on flat chunks
    ("sparse_softmax", {}),  # plain cross-entropy: always the dense fallback
    ("sparsemax", {}),
    ("entmax15", {}),
    ("entmax_bisect", {"alpha": 1.3}),
    ("entmax_bisect", {"alpha": 2.5}),
]
IDS = [f"{name}-{'-'.join(f'{k}{v}' for k, v in options.items())}" for name, options in CASES]
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def head_data(dtype=torch.float64, tokens=37, hidden=16, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=dtype)
    h[: tokens // 2] *= 4  # peaked logits (small supports) in the first chunks, flat ones later
    h[tokens // 2 :] *= 0.05
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype)
    b = torch.randn(vocab, generator=g, dtype=dtype)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[[1, 7, tokens - 3]] = -100
    return h, w, b, t


def unfused(h, w, t, name, options, bias=None, softcap=None, reduction="mean", num_items_in_batch=None):
    x = h @ w.T if bias is None else h @ w.T + bias
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    loss = make_loss(name, **options)(x, t, reduction="sum" if num_items_in_batch is not None else reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def grads(loss_fn, *tensors):
    tensors = [x.detach().requires_grad_() for x in tensors]
    loss = loss_fn(*tensors)
    return loss.detach(), torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("name,options", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_loss_and_gradients_equal_the_unfused_path(name, options, dtype, softcap):
    h, w, b, t = head_data(dtype)
    fused, fused_grads = grads(
        lambda h, w, b: hs.fused_head_loss(h, w, t, name, bias=b, softcap=softcap, chunk_size=8, **options), h, w, b)
    plain, plain_grads = grads(lambda h, w, b: unfused(h, w, t, name, options, b, softcap), h, w, b)
    assert relative_error(fused, plain) <= TOLERANCE[dtype]
    for got, expected in zip(fused_grads, plain_grads):
        assert relative_error(got, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("name,options", CASES[:1] + CASES[4:6], ids=IDS[:1] + IDS[4:6])
def test_sum_num_items_and_batch_shapes(name, options):
    h, w, _, t = head_data()
    h3, t3 = h[:36].reshape(4, 9, -1), t[:36].reshape(4, 9)
    for kwargs in ({"reduction": "sum"}, {"num_items_in_batch": 50}, {"num_items_in_batch": torch.tensor(50)}):
        fused, fused_grads = grads(lambda h, w: hs.fused_head_loss(h, w, t3, name, **kwargs, **options), h3, w)
        plain, plain_grads = grads(lambda h, w: unfused(h.reshape(36, -1), w, t3.reshape(-1), name, options,
                                                        **kwargs), h3, w)
        assert relative_error(fused, plain) <= 1e-12
        assert all(relative_error(a, c) <= 1e-12 for a, c in zip(fused_grads, plain_grads))


def test_all_ignored_gives_zero_loss_and_zero_gradients():
    h, w, b, t = head_data(torch.float32)
    t = torch.full_like(t, -100)
    loss, (dh, dw, db) = grads(lambda h, w, b: hs.fused_head_loss(h, w, t, "entmax15", bias=b), h, w, b)
    assert loss.item() == 0 and not dh.any() and not dw.any() and not db.any()
    loss = hs.fused_head_loss(h, w, t, "sparsemax", reduction="sum", num_items_in_batch=3)
    assert loss.item() == 0


def test_tied_weight_accumulates_both_gradients():
    h, w, _, t = head_data(tokens=12, vocab=40)
    ids = torch.randint(0, 40, (12,), generator=torch.Generator().manual_seed(1))

    def model(loss_fn):
        def run(w):
            hidden = torch.nn.functional.embedding(ids, w) * 2 + h  # the same weight embeds and predicts
            return loss_fn(hidden, w)

        return run

    fused, (dw,) = grads(model(lambda x, w: hs.fused_head_loss(x, w, t, "sparsemax", chunk_size=5)), w)
    plain, (dw_plain,) = grads(model(lambda x, w: unfused(x, w, t, "sparsemax", {})), w)
    assert relative_error(fused, plain) <= 1e-12 and relative_error(dw, dw_plain) <= 1e-12


def test_no_gradient_needed_and_module_form():
    h, w, b, t = head_data(torch.float32)
    module = hs.FusedHeadLoss("sparse_softmax", top_k=4, chunk_size=16)
    with torch.no_grad():
        value = module(h, w, t, b)
    assert torch.allclose(value, unfused(h, w, t, "sparse_softmax", {"top_k": 4}, b), rtol=1e-6)
    assert "top_k=4" in repr(module)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss": "focal"},
        {"loss": "sparse_softmax", "top_k": 0},
        {"loss": "sparsemax", "top_k": 3},
        {"loss": "entmax_bisect", "alpha": 1.0},
        {"loss": "entmax_bisect", "alpha": torch.tensor(1.5, requires_grad=True)},
        {"loss": "sparsemax", "fused": True},
        {"weight": torch.randn(300, 15)},
        {"labels": torch.zeros(36, dtype=torch.long)},
        {"labels": torch.zeros(37)},
        {"labels": torch.full((37,), 300)},
        {"bias": torch.randn(299)},
        {"softcap": 0.0},
        {"reduction": "none"},
        {"chunk_size": 0},
    ],
    ids=lambda kwargs: "-".join(kwargs),
)
def test_bad_input_raises_value_error(kwargs):
    h, w, _, t = head_data(torch.float32)
    args = {"hidden": h, "weight": w, "labels": t, **kwargs}
    with pytest.raises(ValueError):
        hs.fused_head_loss(**args)


# ---------------------------------------------------------------- patched models

VOCAB = 64


def tiny_lm(tie=True, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         tie_word_embeddings=tie)
    return LlamaForCausalLM(config).train()


def batch(seed=0, size=4, length=10):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, length), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    labels[2, 7:] = -100
    return ids, labels


MODEL_CASES = [
    ("sparse_softmax", {"top_k": 5}),
    ("sparse_softmax", {"top_p": 0.8}),
    ("sparsemax", {}),
    ("entmax15", {}),
    ("entmax_bisect", {"alpha": 1.3}),
]


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("name,options", MODEL_CASES)
def test_fused_model_equals_unfused_model(name, options, tie):
    plain = hs.patch_model(tiny_lm(tie), loss=name, loss_options=options)
    fused = hs.patch_model(tiny_lm(tie), loss=name, loss_options={**options, "fused": True})
    ids, labels = batch()
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(21)}):
        out_plain, out_fused = plain(input_ids=ids, labels=labels, **kwargs), fused(input_ids=ids, labels=labels, **kwargs)
        assert out_fused.logits is None and out_plain.logits is not None
        assert torch.allclose(out_fused.loss, out_plain.loss, rtol=1e-6, atol=0)
        out_plain.loss.backward()
        out_fused.loss.backward()
        for (n, p), q in zip(plain.named_parameters(), fused.parameters()):
            assert relative_error(q.grad, p.grad) <= 1e-5, n
        plain.zero_grad()
        fused.zero_grad()


def test_fused_mode_leaves_eval_generate_and_unpatch_alone(tmp_path):
    reference = tiny_lm()
    model = hs.patch_model(tiny_lm(), loss="sparsemax", loss_options={"fused": True})
    ids, labels = batch()
    model.eval()
    reference.eval()
    hs.patch_model(reference, loss="sparsemax")
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and torch.allclose(out.loss, reference(input_ids=ids, labels=labels).loss)
    torch.manual_seed(0)
    generated = model.generate(ids[:1, :3], max_new_tokens=5, do_sample=True)
    torch.manual_seed(0)
    assert torch.equal(generated, reference.generate(ids[:1, :3], max_new_tokens=5, do_sample=True))
    model.save_pretrained(tmp_path)
    loaded = hs.patch_model(LlamaForCausalLM.from_pretrained(tmp_path).train())
    assert loaded.config.hf_sparsemax["loss_options"] == {"fused": True}
    assert loaded(input_ids=ids, labels=labels).logits is None
    hs.patch_model(loaded, loss="sparsemax")  # options replaced: fused off again
    assert loaded(input_ids=ids, labels=labels).logits is not None
    hs.patch_model(model.train(), loss_options={"fused": True})
    hs.unpatch_model(model)
    assert "forward" not in vars(model) and model(input_ids=ids, labels=labels).logits is not None


@pytest.mark.parametrize("options", [{"fused": 1}, {"fused": "yes"}])
def test_bad_fused_option_raises(options):
    with pytest.raises(ValueError):
        hs.patch_model(tiny_lm(), loss="sparsemax", loss_options=options)
    from transformers import LlamaForSequenceClassification

    classifier = LlamaForSequenceClassification(tiny_lm().config)
    with pytest.raises(ValueError, match="fused"):
        hs.patch_model(classifier, loss="sparsemax", loss_options={"fused": True})
    assert not hasattr(classifier.config, "hf_sparsemax")


def test_peft_lora_fused_equals_unfused():
    from peft import LoraConfig, get_peft_model

    def lora(fused):
        model = get_peft_model(tiny_lm(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        torch.manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)  # non-zero B so that lora_A gets a gradient too
        return hs.patch_model(model, loss="entmax15", loss_options={"fused": fused})

    plain, fused = lora(False), lora(True)
    ids, labels = batch()
    out_plain, out_fused = plain(input_ids=ids, labels=labels), fused(input_ids=ids, labels=labels)
    assert out_fused.logits is None and torch.allclose(out_fused.loss, out_plain.loss, rtol=1e-6)
    out_plain.loss.backward()
    out_fused.loss.backward()
    trained = [(n, p, q) for (n, p), q in zip(plain.named_parameters(), fused.parameters()) if p.requires_grad]
    assert trained and all("lora_" in n for n, _, _ in trained)
    assert all(relative_error(q.grad, p.grad) <= 1e-5 for _, p, q in trained)


from test_patch import Rows  # noqa: E402


def loss_curve(fused, tmp_path, tie):
    ids, labels = batch(seed=3, size=8, length=12)
    labels[1, :9] = -100
    labels[6, :] = -100
    model = hs.patch_model(tiny_lm(tie), loss="sparse_softmax", loss_options={"top_k": 6, "fused": fused})
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=4, learning_rate=1e-1, optim="sgd", lr_scheduler_type="constant", report_to=[],
                             save_strategy="no", logging_steps=1, use_cpu=True, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(ids, labels))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], model


@pytest.mark.parametrize("tie", [True, False])
def test_trainer_loss_curve_is_the_same(tmp_path, tie):
    plain, plain_model = loss_curve(False, tmp_path, tie)
    fused, fused_model = loss_curve(True, tmp_path, tie)
    assert len(plain) == 4 and plain == pytest.approx(fused, rel=1e-5)
    for p, q in zip(plain_model.parameters(), fused_model.parameters()):  # plain SGD: the parameters move by the
        assert torch.allclose(p, q, atol=1e-6)  # gradients (~2e-2 here); Adam would amplify rounding of tiny ones


@pytest.mark.slow
def test_smollm2_fused_equals_unfused():
    from hf_sparsemax.app import assets

    model, tokenizer = assets.load_smollm2()
    model.train()
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 6, return_tensors="pt").input_ids[:, :48]
    ids = ids.repeat(2, 1)
    head = model.get_output_embeddings().weight
    assert head is model.get_input_embeddings().weight  # tied
    results = {}
    for fused in (False, True):
        hs.patch_model(model, loss="sparse_softmax", loss_options={"top_k": 10, "fused": fused})
        model.zero_grad()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results[fused] = out.loss.detach(), head.grad.clone(), model.model.layers[-1].mlp.down_proj.weight.grad.clone()
    hs.unpatch_model(model)
    (loss, dw, dlayer), (fused_loss, fused_dw, fused_dlayer) = results[False], results[True]
    assert torch.allclose(fused_loss, loss, rtol=1e-5)
    assert relative_error(fused_dw, dw) <= 1e-4 and relative_error(fused_dlayer, dlayer) <= 1e-4


def test_a_deep_copy_trains_and_samples_with_its_own_weights():
    """The fused forward and matched generate are bound to the model, so a deepcopy (TRL's reference model) uses its own."""
    model = hs.patch_model(tiny_lm(), loss="sparsemax", loss_options={"fused": True})
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.norm.weight.mul_(3.0)
    ids, labels = batch()
    fused_loss = twin.train()(input_ids=ids, labels=labels).loss  # the fused path
    plain_loss = twin.eval()(input_ids=ids, labels=labels).loss  # the model's own forward, same sparse loss
    assert torch.allclose(fused_loss, plain_loss, rtol=1e-6)
    assert not torch.allclose(fused_loss, model.train()(input_ids=ids, labels=labels).loss)
    assert twin.forward.__self__ is twin and twin.generate.__self__ is twin
