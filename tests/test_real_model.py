"""The offline SmolLM2-135M-Instruct fine-tuned for a few steps with each sparse loss (slow, runs in CI)."""

import pytest
import torch
from transformers import Trainer, TrainingArguments

import hf_sparsemax as hs
from hf_sparsemax.metrics import sparse_text as metrics
from hf_sparsemax.app import assets
from hf_sparsemax.losses.names import loss_mapping

pytestmark = pytest.mark.slow
BLOCK = 48


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = assets.load_smollm2()
    return model, tokenizer, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def fortunes_split(smollm2):
    _, tokenizer, _ = smollm2
    texts = [t for t in assets.fortunes("fortunes") if 60 < len(t) < 400]
    ids = tokenizer("\n\n".join(texts[:400]), return_tensors="pt").input_ids[0]
    blocks = ids[: len(ids) // BLOCK * BLOCK].view(-1, BLOCK)
    return blocks[:32], blocks[-8:]  # train, held-out (different fortunes)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def held_out_loss(model, blocks):
    model.eval()
    with torch.no_grad():
        return model(input_ids=blocks, labels=blocks).loss.item()


def train(model, blocks, tmp_path, lr, steps=4, **kwargs):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=steps,
                             learning_rate=lr, lr_scheduler_type="constant", report_to=[], save_strategy="no",
                             logging_steps=1, use_cpu=True, seed=0, disable_tqdm=True, **kwargs)
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(blocks))
    trainer.train()
    return trainer


@pytest.mark.parametrize("loss,options", [
    ("sparse_softmax", {"top_k": 10}),
    ("sparsemax", {}),
    ("entmax15", {}),
    ("entmax_bisect", {"alpha": 1.3}),
])
def test_fine_tuning_lowers_the_held_out_loss(smollm2, fortunes_split, loss, options, tmp_path):
    model, _, initial = smollm2
    model.load_state_dict(initial)
    hs.patch_model(model, loss=loss, loss_options=options)
    train_blocks, test_blocks = fortunes_split
    before = held_out_loss(model, test_blocks)
    trainer = train(model, train_blocks, tmp_path, lr=1e-4)
    after = held_out_loss(model, test_blocks)
    hs.unpatch_model(model)
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 4 and all(v == v and v >= 0 for v in logged)
    assert after < before, (loss, before, after)


def test_lora_on_a_patched_model_trains_and_reports_metrics(smollm2, fortunes_split, tmp_path):
    from peft import LoraConfig, get_peft_model

    model, _, initial = smollm2
    model.load_state_dict(initial)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    hs.patch_model(peft_model, loss="sparse_softmax", loss_options={"top_k": 10})
    train_blocks, test_blocks = fortunes_split
    before = held_out_loss(peft_model, test_blocks)
    preprocess, compute = metrics.trainer_metrics(loss_mapping("sparse_softmax", top_k=10), model.config.vocab_size)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             max_steps=4, learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, disable_tqdm=True)
    trainer = Trainer(model=peft_model, args=args, train_dataset=Blocks(train_blocks),
                      eval_dataset=Blocks(test_blocks), preprocess_logits_for_metrics=preprocess,
                      compute_metrics=compute)
    trainer.train()
    after = held_out_loss(peft_model, test_blocks)
    report = trainer.evaluate()
    peft_model.unload()
    hs.unpatch_model(model)
    assert after < before
    assert report["eval_tokens"] == 8 * (BLOCK - 1)
    assert 0 < report["eval_accuracy"] < 1 and 1 <= report["eval_support_size"] <= 10
    assert 0 < report["eval_zero_prob_share"] < 1 and report["eval_cross_entropy"] == float("inf")
    assert report["eval_epsilon_perplexity"] > 1 and 0 < report["eval_jensen_shannon"] < 0.7


@pytest.mark.parametrize("loss,options", [("entmax15", {}), ("sparse_softmax", {"top_k": 10})])
def test_smollm2_matched_sampling(smollm2, loss, options):
    model, tokenizer, initial = smollm2
    model.load_state_dict(initial)
    hs.patch_model(model, loss=loss, loss_options=options)
    report = hs.decoding_report(model, tokenizer, ["The secret of a happy life is", "Murphy's law says"],
                                max_new_tokens=16)
    hs.unpatch_model(model)
    assert report["zero_prob_share"] == 0 and report["tokens"] >= 16
    assert all(len(text.split()) >= 3 for text in report["texts"]), report["texts"]
    unmatched = hs.decoding_report(model, tokenizer, ["The secret of a happy life is"], max_new_tokens=16,
                                   loss="sparse_softmax", loss_options={"top_k": 3}, matched=False, top_k=50)
    assert unmatched["mean_truncated_mass"] >= 0 and unmatched["mean_support_size"] == 3


@pytest.mark.parametrize("attn", ["entmax15", "sparsemax"])
def test_smollm2_with_sparse_attention_generates_and_fine_tunes(smollm2, fortunes_split, attn, tmp_path):
    model, tokenizer, initial = smollm2
    model.load_state_dict(initial)
    model.requires_grad_(True)  # an earlier test's peft unload() leaves the shared model frozen
    hs.patch_model(model, attn=attn)
    train_blocks, test_blocks = fortunes_split
    before = held_out_loss(model, test_blocks)
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        maps = model(**prompt, output_attentions=True).attentions
        tokens = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(tokens[0, prompt.input_ids.shape[1]:], skip_special_tokens=True)
    trainer = train(model, train_blocks, tmp_path, lr=1e-4)
    after = held_out_loss(model, test_blocks)
    hs.unpatch_model(model)
    assert model.config._attn_implementation != attn
    words = [w for w in text.split() if w.strip(".,!?;:'\"").isalpha()]
    assert len(words) >= 3, text  # English words, not token soup
    zero_share = sum(int((a == 0).sum()) for a in maps) / sum(a.numel() for a in maps)
    assert zero_share > 0.6, zero_share  # beyond the causal half, keys get exactly zero weight
    assert before < 7.0, before  # far below a uniform guess (log 49152 = 10.8): the pretrained model still works
    assert after < before and all(e["loss"] == e["loss"] for e in trainer.state.log_history if "loss" in e)


def test_minilm_with_sparsemax_attention_encodes_with_padding():
    from transformers import AutoModel, AutoTokenizer

    folder = assets.minilm_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, attn_implementation="sparsemax").eval()
    sentences = ["A cat sits on the mat.", "Stock markets around the world fell sharply after the announcement."]
    padded = tokenizer(sentences, padding=True, return_tensors="pt")
    assert (padded.attention_mask == 0).any()
    with torch.no_grad():
        output = model(**padded, output_attentions=True)
        alone = [model(**tokenizer(s, return_tensors="pt")).last_hidden_state[0] for s in sentences]
    for i, hidden in enumerate(alone):
        torch.testing.assert_close(output.last_hidden_state[i, : len(hidden)], hidden, rtol=1e-4, atol=1e-5)
    maps = torch.stack(output.attentions)  # [layers, B, H, q, kv]
    real_keys = padded.attention_mask.bool()[None, :, None, None, :]
    assert (maps.masked_select(~real_keys) == 0).all()  # padding keys get exactly 0
    torch.testing.assert_close(maps.sum(-1), torch.ones_like(maps.sum(-1)), rtol=0, atol=1e-5)
    assert (maps.masked_select(real_keys) == 0).float().mean() > 0.3  # and so do many real keys
