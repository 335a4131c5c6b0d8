"""patch_model / unpatch_model (loss half), settings in the config, compute_loss_func, Trainer and peft."""

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    Trainer,
    TrainingArguments,
)

import hf_sparsemax as hs

VOCAB = 64
LOSS_CASES = [
    ("sparse_softmax", {"top_k": 5}, lambda x, t: hs.sparse_softmax_loss(x, t, top_k=5, reduction="sum")),
    ("sparse_softmax", {"top_p": 0.8}, lambda x, t: hs.sparse_softmax_loss(x, t, top_p=0.8, reduction="sum")),
    ("sparsemax", {}, lambda x, t: hs.sparsemax_loss(x, t, reduction="sum")),
    ("entmax15", {}, lambda x, t: hs.entmax15_loss(x, t, reduction="sum")),
    ("entmax_bisect", {"alpha": 1.3}, lambda x, t: hs.entmax_bisect_loss(x, t, 1.3, reduction="sum")),
]


def llama_config(**overrides):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    return LlamaConfig(**{**base, **overrides})


def tiny_lm(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config()).eval()


def batch(seed=0, size=4, length=10):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, length), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    labels[2, 7:] = -100
    return ids, labels


@pytest.mark.parametrize("name,options,reference", LOSS_CASES)
def test_causal_lm_loss_is_the_chosen_loss(name, options, reference):
    model = tiny_lm()
    ids, labels = batch()
    hs.patch_model(model, loss=name, loss_options=options)
    out = model(input_ids=ids, labels=labels)
    shifted = labels[:, 1:]
    expected = reference(out.logits[:, :-1], shifted) / (shifted != -100).sum()
    assert torch.allclose(out.loss, expected, atol=1e-6)
    n = torch.tensor(37)
    assert torch.allclose(model(input_ids=ids, labels=labels, num_items_in_batch=n).loss,
                          reference(out.logits[:, :-1], shifted) / 37, atol=1e-6)
    own = torch.full_like(labels, -100)
    own[:, :3] = ids[:, :3]
    loss = model(input_ids=ids, labels=labels, shift_labels=own).loss
    assert torch.allclose(loss, reference(out.logits, own) / (own != -100).sum(), atol=1e-6)


def test_cross_entropy_and_unpatch_restore_the_model():
    model = tiny_lm()
    ids, labels = batch()
    original = model(input_ids=ids, labels=labels).loss
    hs.patch_model(model, loss="sparsemax")
    assert not torch.allclose(model(input_ids=ids, labels=labels).loss, original)
    hs.patch_model(model, loss="cross_entropy")
    assert torch.allclose(model(input_ids=ids, labels=labels).loss, original)
    assert not hasattr(model.config, "hf_sparsemax")
    hs.patch_model(model, loss="entmax15")
    hs.unpatch_model(model)
    assert torch.allclose(model(input_ids=ids, labels=labels).loss, original)
    assert not hasattr(model.config, "hf_sparsemax")


def test_settings_survive_save_pretrained(tmp_path):
    model = tiny_lm()
    ids, labels = batch()
    hs.patch_model(model, loss="sparse_softmax", loss_options={"top_k": 7, "top_p": 0.9})
    expected = model(input_ids=ids, labels=labels).loss
    model.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert '"hf_sparsemax"' in text and '"top_k": 7' in text
    loaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert hs.patch_model(loaded) is loaded
    assert torch.allclose(loaded(input_ids=ids, labels=labels).loss, expected, atol=1e-6)


def test_options_update_keeps_the_loss():
    model = tiny_lm()
    hs.patch_model(model, loss="sparse_softmax", loss_options={"top_k": 3})
    hs.patch_model(model, loss_options={"top_k": 9})
    assert model.config.hf_sparsemax["loss"] == "sparse_softmax"
    assert model.config.hf_sparsemax["loss_options"] == {"top_k": 9}


@pytest.mark.parametrize("head,labels", [
    (LlamaForSequenceClassification, torch.tensor([0, 2, 1, 2])),
    (LlamaForTokenClassification, torch.randint(0, 3, (4, 10))),
])
def test_classification_heads(head, labels):
    torch.manual_seed(0)
    model = head(llama_config(num_labels=3)).eval()
    ids, _ = batch()
    hs.patch_model(model, loss="sparsemax")
    out = model(input_ids=ids, labels=labels)
    logits = out.logits
    assert torch.allclose(out.loss, hs.sparsemax_loss(logits.reshape(-1, 3), labels.reshape(-1)), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss": "focal"},
        {"loss": "sparse_softmax", "loss_options": {"top_k": 0}},
        {"loss": "sparse_softmax", "loss_options": {"top_p": 1.5}},
        {"loss": "sparse_softmax", "loss_options": {"k": 3}},
        {"loss": "sparsemax", "loss_options": {"alpha": 1.5}},
        {"loss": "entmax_bisect", "loss_options": {"alpha": 1.0}},
        {"attn": "flash_sparsemax"},
    ],
)
def test_bad_settings_raise_and_leave_the_model_untouched(kwargs):
    model = tiny_lm()
    hs.patch_model(model, loss="entmax15")
    before = dict(model.config.hf_sparsemax)
    with pytest.raises(ValueError):
        hs.patch_model(model, **kwargs)
    assert model.config.hf_sparsemax == before
    assert model.loss_function.__name__ == "causal_lm_loss"


def test_heads_that_hard_code_cross_entropy_are_refused():
    model = BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32))
    with pytest.raises(ValueError, match="compute_loss_func"):
        hs.patch_model(model, loss="sparsemax")
    assert not hasattr(model.config, "hf_sparsemax")
    with pytest.raises(ValueError):
        hs.patch_model(torch.nn.Linear(2, 2), loss="sparsemax")


def test_peft_lora_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_lm(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids, labels = batch()
    assert hs.patch_model(model, loss="entmax15") is model
    out = model(input_ids=ids, labels=labels)
    shifted = labels[:, 1:]
    assert torch.allclose(out.loss, hs.entmax15_loss(out.logits[:, :-1], shifted), atol=1e-6)
    out.loss.backward()
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and any(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)
    hs.unpatch_model(model)
    assert not hasattr(model.get_base_model().config, "hf_sparsemax")


# ---------------------------------------------------------------- Trainer


class Rows(torch.utils.data.Dataset):
    def __init__(self, ids, labels):
        self.ids, self.labels = ids, labels

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def one_step(model, data, tmp_path, per_device, accumulation, **trainer_kwargs):
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        max_steps=1, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=data, **trainer_kwargs).train()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def uneven_data():
    ids, labels = batch(seed=3, size=8, length=12)
    labels[1, :9] = -100  # the halves hold very different numbers of counted tokens
    labels[5, 2:] = -100
    labels[6, :] = -100
    return Rows(ids, labels)


@pytest.mark.parametrize("loss,options", [("sparse_softmax", {"top_k": 4}), ("entmax15", {})])
def test_gradient_accumulation_is_exact_with_patch_model(loss, options, tmp_path):
    data = uneven_data()
    whole = one_step(hs.patch_model(tiny_lm(), loss=loss, loss_options=options), data, tmp_path, 8, 1)
    halves = one_step(hs.patch_model(tiny_lm(), loss=loss, loss_options=options), data, tmp_path, 4, 2)
    assert not torch.allclose(whole, torch.cat([p.detach().reshape(-1) for p in tiny_lm().parameters()]))
    assert torch.allclose(whole, halves, atol=1e-6)


def test_gradient_accumulation_is_exact_with_compute_loss_func(tmp_path):
    data = uneven_data()
    fn = hs.compute_loss_func("sparsemax", task="causal_lm")
    whole = one_step(tiny_lm(), data, tmp_path, 8, 1, compute_loss_func=fn)
    halves = one_step(tiny_lm(), data, tmp_path, 4, 2, compute_loss_func=fn)
    assert torch.allclose(whole, halves, atol=1e-6)


def test_compute_loss_func_for_bert_sequence_classification():
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32, num_labels=4))
    ids, _ = batch()
    labels = torch.tensor([0, 3, -100, 1])
    out = model(input_ids=ids)
    fn = hs.compute_loss_func("sparse_softmax", task="sequence_classification", top_k=2)
    expected = hs.sparse_softmax_loss(out.logits, labels, top_k=2, reduction="sum")
    assert torch.allclose(fn(out, labels, num_items_in_batch=torch.tensor(3)), expected / 3)
    assert torch.allclose(fn(out, labels), expected / 3)
    with pytest.raises(ValueError):
        hs.compute_loss_func("sparsemax", task="regression")
    with pytest.raises(ValueError):
        hs.compute_loss_func("sparse_softmax", top_k=-3)
