"""transformers.Trainer settings that would replace a patched loss by a dense one are refused, not obeyed."""

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, Trainer, TrainingArguments

import hf_sparsemax as hs

CONFIG = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)


def build_trainer(model, tmp_path, **config):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=2,
                             save_strategy="no", disable_tqdm=True, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Trainer(model=model, args=args)


def batch(labels):
    torch.manual_seed(1)
    return {"input_ids": torch.randint(3, 40, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long),
            "labels": labels}


@pytest.mark.parametrize("task", ["causal_lm", "sequence_classification"])
def test_label_smoothing_is_refused_on_a_patched_loss(task, tmp_path):
    torch.manual_seed(0)
    if task == "causal_lm":
        model, labels = LlamaForCausalLM(LlamaConfig(**CONFIG)), torch.randint(3, 40, (2, 8))
    else:
        model, labels = LlamaForSequenceClassification(LlamaConfig(**CONFIG, num_labels=3)), torch.tensor([0, 2])
    hs.patch_model(model, loss="entmax15")
    model.train()
    smoothing = build_trainer(model, tmp_path, label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1 .* 'entmax15'"):
        smoothing.compute_loss(model, batch(labels))
    plain = build_trainer(model, tmp_path)  # the same model trains its patched loss without label smoothing
    inputs = batch(labels)
    assert torch.allclose(plain.compute_loss(model, dict(inputs)), model(**inputs).loss)


def test_label_smoothing_with_the_users_own_loss_function_is_left_alone(tmp_path):
    """compute_loss_func takes precedence over label smoothing in Trainer: the user's loss is what trains."""
    torch.manual_seed(0)
    model = hs.patch_model(LlamaForCausalLM(LlamaConfig(**CONFIG)), loss="sparsemax")
    model.train()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, label_smoothing_factor=0.1,
                             save_strategy="no", disable_tqdm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, compute_loss_func=hs.compute_loss_func("sparsemax"))
    inputs = batch(torch.randint(3, 40, (2, 8)))
    assert torch.allclose(trainer.compute_loss(model, dict(inputs)), model(**inputs).loss, rtol=1e-5, atol=1e-6)


def test_unpatch_removes_the_guard(tmp_path):
    torch.manual_seed(0)
    model = hs.unpatch_model(hs.patch_model(LlamaForCausalLM(LlamaConfig(**CONFIG)), loss="sparsemax"))
    model.train()
    assert not model._forward_pre_hooks
    build_trainer(model, tmp_path, label_smoothing_factor=0.1).compute_loss(model, batch(torch.randint(3, 40, (2, 8))))
