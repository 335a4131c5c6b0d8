"""trl.SFTTrainer on a patched model trains the patched loss (and logs its distribution's metrics)."""

import copy
import pathlib
import types
import warnings

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer
from trl.trainer.callbacks import _generate_completions  # what TRL's completion logging calls

import hf_sparsemax as hs
from hf_sparsemax.settings import SparseSettings

LOSSES = [
    ("sparse_softmax", {"top_k": 5}),
    ("sparse_softmax", {"top_p": 0.8}),
    ("sparsemax", {}),
    ("entmax15", {}),
    ("entmax_bisect", {"alpha": 1.3}),
]
PROMPTS = ["hello ", "sparse ", "a b ", "zebra ", "quiet ", "x "]
COMPLETIONS = ["world", "models rule", "c d e f g", "stripes", "please", "marks the spot"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)


def tokenizer():
    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<s>", *"abcdefghijklmnopqrstuvwxyz "])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_lm(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=30, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return LlamaForCausalLM(config)


def prompt_completion(n=6):
    return Dataset.from_dict({"prompt": PROMPTS[:n], "completion": COMPLETIONS[:n]})


def trainer(model, tmp_path, data=None, per_device=2, accumulation=1, peft_config=None, compute_loss_func=None,
            **config):
    config = {"gradient_checkpointing": False, "bf16": False, **config}  # SFTConfig defaults both to True (CPU too)
    args = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        max_steps=1, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, seed=0, disable_tqdm=True, **config,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SFTTrainer(model=model, args=args, train_dataset=data if data is not None else prompt_completion(),
                          processing_class=tokenizer(), peft_config=peft_config,
                          compute_loss_func=compute_loss_func)


def first_batch(sft, size=4):
    return sft.data_collator([sft.train_dataset[i] for i in range(size)])


def own_loss(model, batch, **kwargs):
    """The patched model's own loss on the batch (its loss_function, or its fused forward in train mode)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs, labels=batch["labels"], **kwargs).loss


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def check_logged_metrics(sft, model, batch, name, options):
    """TRL's last logged entropy and accuracy are those of the trained distribution; returns (it, softmax's)."""
    with torch.no_grad():
        logits = model.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    target = batch["labels"][:, 1:]
    kept = target != -100
    p = hs.losses.loss_mapping(name, **options)(logits[kept])
    entropy = -torch.special.xlogy(p, p).sum(-1).mean().item()
    accuracy = (p.argmax(-1) == target[kept]).float().mean().item()
    logged = sft._metrics["train"]
    assert abs(logged["entropy"][-1] - entropy) < 1e-5
    assert abs(logged["mean_token_accuracy"][-1] - accuracy) < 1e-6
    dense = torch.log_softmax(logits[kept], -1)
    return entropy, -(dense.exp() * dense).sum(-1).mean().item()


@pytest.mark.parametrize("name,options,fused", [(n, o, f) for n, o in LOSSES for f in (False, True)]
                         + [("taylor_softmax", {}, False), ("perturb_max", {}, False)])  # no support: dense mapping
def test_sft_optimises_the_patched_loss_and_logs_its_distribution(name, options, fused, tmp_path):
    model = hs.patch_model(tiny_lm(), loss=name, loss_options={**options, "fused": fused})
    sft = trainer(model, tmp_path)
    batch = first_batch(sft)
    labels = batch["labels"]
    assert (labels[:, :4] == -100).all()  # completion_only_loss: the prompt is not trained
    model.train()
    trl_loss = sft.compute_loss(model, dict(batch))
    assert torch.allclose(trl_loss, own_loss(model, batch), rtol=1e-5, atol=1e-6)
    n = torch.tensor(23)
    assert torch.allclose(sft.compute_loss(model, dict(batch), num_items_in_batch=n),
                          own_loss(model, batch, num_items_in_batch=n), rtol=1e-5, atol=1e-6)
    # the gradient TRL back-propagates is the patched loss's gradient
    model.zero_grad()
    sft.compute_loss(model, dict(batch)).backward()
    via_trl = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    own_loss(model, batch).backward()
    for a, b in zip(via_trl, (p.grad for p in model.parameters())):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)

    entropy, dense_entropy = check_logged_metrics(sft, model, batch, name, options)
    if name in ("sparsemax", "entmax15", "entmax_bisect") or "top_k" in options:  # sparse (top_p may keep all)
        assert entropy < dense_entropy


def test_prompt_tokens_are_ignored_with_assistant_only_loss(tmp_path):
    data = Dataset.from_dict({"messages": [
        [{"role": "user", "content": p}, {"role": "assistant", "content": c}] for p, c in zip(PROMPTS, COMPLETIONS)
    ]})
    model = hs.patch_model(tiny_lm(), loss="entmax15")
    sft = trainer(model, tmp_path, data=data, assistant_only_loss=True)
    batch = first_batch(sft)
    assert (batch["labels"][:, :4] == -100).all() and (batch["labels"] != -100).any()
    model.train()
    assert torch.allclose(sft.compute_loss(model, dict(batch)), own_loss(model, batch), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_packing(fused, tmp_path):
    model = hs.patch_model(tiny_lm(), loss="sparse_softmax", loss_options={"top_k": 4, "fused": fused})
    sft = trainer(model, tmp_path, packing=True, max_length=24, completion_only_loss=False)
    batch = first_batch(sft, size=2)
    assert batch["input_ids"].shape[0] == 1 and (batch["position_ids"] == 0).sum() >= 2  # padding-free: one row
    model.train()
    assert torch.allclose(sft.compute_loss(model, dict(batch)), own_loss(model, batch), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_gradient_accumulation_is_exact(fused, tmp_path):
    """One SGD step with 2 x 2 accumulated == 4 x 1 == the step down the patched loss's own gradient."""
    def step(per_device, accumulation):
        model = hs.patch_model(tiny_lm(), loss="sparsemax", loss_options={"fused": fused})
        sft = trainer(model, tmp_path, prompt_completion(4), per_device, accumulation, max_grad_norm=0.0)
        sft.train()
        return flat(model), sft

    whole, sft = step(4, 1)
    halves, _ = step(2, 2)
    assert torch.allclose(whole, halves, atol=1e-6)
    model = hs.patch_model(tiny_lm(), loss="sparsemax", loss_options={"fused": fused}).train()
    own_loss(model, sft.data_collator([sft.train_dataset[i] for i in range(4)])).backward()
    expected = torch.cat([(p - 0.5 * p.grad).detach().reshape(-1) for p in model.parameters()])
    assert torch.allclose(whole, expected, atol=1e-6)


def test_lora_fused_trains_and_evaluates_the_patched_loss(tmp_path):  # (TRL refuses a LoRA on lm_head)
    model = hs.patch_model(tiny_lm(), loss="sparse_softmax", loss_options={"top_k": 4, "fused": True})
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    sft = trainer(model, tmp_path, peft_config=lora, gradient_checkpointing=True, bf16=True)  # TRL's defaults
    sft.eval_dataset = sft.train_dataset
    batch = first_batch(sft)
    sft.model.train()
    assert torch.allclose(sft.compute_loss(sft.model, dict(batch)), own_loss(sft.model, batch), rtol=1e-5, atol=1e-6)
    before = {n: p.detach().clone() for n, p in sft.model.named_parameters() if p.requires_grad}
    sft.train()
    assert all(not torch.equal(before[n], p) for n, p in sft.model.named_parameters() if p.requires_grad)
    metrics = sft.evaluate()
    assert torch.isfinite(torch.tensor([metrics["eval_loss"], metrics["eval_entropy"]])).all()
    history = [row for row in sft.state.log_history if "loss" in row]
    assert history and 0 <= history[-1]["mean_token_accuracy"] <= 1


@pytest.mark.parametrize("fused", [False, True])
def test_patching_after_the_trainer_was_built(fused, tmp_path):
    model = tiny_lm()
    sft = trainer(model, tmp_path)
    hs.patch_model(model, loss="entmax_bisect", loss_options={"alpha": 1.7, "fused": fused})
    batch = first_batch(sft)
    model.train()
    assert torch.allclose(sft.compute_loss(model, dict(batch)), own_loss(model, batch), rtol=1e-5, atol=1e-6)


def test_compute_loss_func_route(tmp_path):
    """The documented alternative: TRL calls compute_loss_func, and its metrics pass still sees the patched model."""
    model = hs.patch_model(tiny_lm(), loss="sparsemax")
    sft = trainer(model, tmp_path, compute_loss_func=hs.compute_loss_func("sparsemax"))
    batch = first_batch(sft)
    model.train()
    assert torch.allclose(sft.compute_loss(model, dict(batch)), own_loss(model, batch), rtol=1e-5, atol=1e-6)
    check_logged_metrics(sft, model, batch, "sparsemax", {})


def test_unpatch_gives_trl_back_its_own_loss(tmp_path):
    model = hs.patch_model(tiny_lm(), loss="sparse_softmax", loss_options={"top_k": 3})
    hs.unpatch_model(model)
    assert not model._forward_pre_hooks and "forward" not in vars(model)
    sft = trainer(model, tmp_path)
    batch = first_batch(sft)
    model.train()
    assert torch.allclose(sft.compute_loss(model, dict(batch)), own_loss(model, batch), rtol=1e-5, atol=1e-6)


def test_trl_generation_samples_the_trained_distribution(tmp_path):
    """TRL's completion sampling goes through the patched generate: top_k=1 sparse softmax samples greedily."""
    model = hs.patch_model(tiny_lm(seed=1), loss="sparse_softmax", loss_options={"top_k": 1})
    sft = trainer(model, tmp_path)
    config = GenerationConfig(do_sample=True, max_new_tokens=12, temperature=0.7, pad_token_id=0, eos_token_id=-1)
    tok = sft.processing_class
    torch.manual_seed(0)
    sampled = _generate_completions(PROMPTS, sft.model, tok, sft.accelerator, config, batch_size=1)
    greedy = _generate_completions(PROMPTS, sft.model, tok, sft.accelerator,
                                   GenerationConfig(do_sample=False, max_new_tokens=12, pad_token_id=0,
                                                    eos_token_id=-1), batch_size=1)
    assert sampled == greedy
    hs.unpatch_model(model)
    torch.manual_seed(0)
    assert _generate_completions(PROMPTS, sft.model, tok, sft.accelerator, config, batch_size=1) != greedy


@pytest.mark.parametrize("name,options,fused", [(n, o, f) for n, o in LOSSES for f in (False, True)]
                         + [("taylor_softmax", {}, False)])
def test_token_outputs_carry_the_fields_preference_trainers_read(name, options, fused):
    """mean_logits (DPO's logits/* metrics) and log_sum_sq_probs (its WPO weight), under the trained distribution."""
    from hf_sparsemax.losses.names import loss_mapping

    model = hs.patch_model(tiny_lm(), loss=name, loss_options={**options, "fused": fused})
    ids = torch.randint(3, 30, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = ids.masked_fill(torch.arange(9) < 3, -100)
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    mask = labels[:, 1:] != -100
    p = loss_mapping(name, **options)(logits.double())
    expected_mean = logits.mean(-1).masked_fill(~mask, 0)
    expected_sq = p.square().sum(-1).log().float().masked_fill(~mask, 0)
    assert torch.allclose(out.mean_logits, expected_mean, rtol=1e-5, atol=1e-5)
    assert torch.allclose(out.log_sum_sq_probs, expected_sq, rtol=1e-5, atol=1e-5)
    assert not out.mean_logits.requires_grad and not out.log_sum_sq_probs.requires_grad


def test_a_deep_copy_answers_with_its_own_weights():
    """TRL copies models (reference models): the copy's request runs the copy, and unpatching it leaves the original."""
    model = hs.patch_model(tiny_lm(), loss="sparsemax")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
    ids = torch.randint(3, 30, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(twin(input_ids=ids, labels=ids, fused_lm_head=True).loss, twin(input_ids=ids, labels=ids).loss)
    hs.unpatch_model(twin)
    assert model._forward_pre_hooks and not twin._forward_pre_hooks
    assert torch.allclose(model(input_ids=ids, labels=ids, fused_lm_head=True).loss, model(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize("config", [{"label_smoothing_factor": 0.1}, {"loss_type": "dft"}])
def test_settings_that_replace_a_fenchel_young_loss_are_refused(config, tmp_path):
    """Label smoothing trains dense cross-entropy; DFT's exp(log_probs) weight is no probability under sparsemax."""
    model = hs.patch_model(tiny_lm(), loss="sparsemax")
    sft = trainer(model, tmp_path, **config)
    model.train()
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1|loss_type='dft'"):
        sft.compute_loss(model, dict(first_batch(sft)))


def test_dft_weights_a_likelihood_loss_by_its_own_probability(tmp_path):
    """Under sparse_softmax, DFT's weight exp(log_probs_t) is the trained distribution's p_t."""
    model = hs.patch_model(tiny_lm(), loss="sparse_softmax", loss_options={"top_k": 5})
    sft = trainer(model, tmp_path, loss_type="dft")
    batch = first_batch(sft)
    model.train()
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1]
    target = batch["labels"][:, 1:]
    per_token = hs.sparse_softmax_loss(logits.flatten(0, 1), target.flatten(), top_k=5, reduction="none")
    expected = (per_token * torch.exp(-per_token)).sum() / (target != -100).sum()
    assert torch.allclose(sft.compute_loss(model, dict(batch)), expected, rtol=1e-5, atol=1e-6)


def preference_trainer(model, reference, tmp_path):
    from trl import DPOConfig, DPOTrainer

    data = Dataset.from_dict({"prompt": PROMPTS[:4], "chosen": COMPLETIONS[:4], "rejected": COMPLETIONS[2:6]})
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[],
                     save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, gradient_checkpointing=False,
                     bf16=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=data,
                          processing_class=tokenizer())


@pytest.mark.parametrize("name,options", [("sparsemax", {}), ("entmax_bisect", {"alpha": 1.3})])
def test_preference_trainers_are_refused_under_a_fenchel_young_loss(name, options, tmp_path):
    """DPO reads log_probs as log pi(y_t); a Fenchel-Young model answers -loss_t, which is no log-probability."""
    model, reference = (hs.patch_model(tiny_lm(), loss=name, loss_options=options) for _ in range(2))
    dpo = preference_trainer(model, reference, tmp_path)
    batch = dpo.data_collator([dpo.train_dataset[i] for i in range(2)])
    model.train()
    with pytest.raises(ValueError, match="DPOTrainer reads log_probs .* no log-probability"):
        dpo.compute_loss(model, batch)


def test_dpo_under_sparse_softmax_reads_the_trained_log_probabilities(tmp_path):
    """Under a likelihood loss DPO's policy log-probabilities are those of the trained sparse distribution."""
    model, reference = (hs.patch_model(tiny_lm(), loss="sparse_softmax", loss_options={"top_k": 5}) for _ in range(2))
    dpo = preference_trainer(model, reference, tmp_path)
    batch = dpo.data_collator([dpo.train_dataset[i] for i in range(2)])
    model.train()
    loss = dpo.compute_loss(model, dict(batch))
    assert torch.isfinite(loss)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)[:, 1:]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    per_token = hs.sparse_softmax_loss(logits.flatten(0, 1), labels.flatten(), top_k=5, reduction="none")
    sequence_log_p = -per_token.view(labels.shape).sum(1)
    chosen = sequence_log_p.chunk(2)[0]
    assert dpo._metrics["train"]["logps/chosen"][-1] == pytest.approx(chosen.mean().item(), rel=1e-5)


@pytest.mark.parametrize("trainer_name", ["DPOTrainer", "KTOTrainer", "GRPOTrainer", "RLOOTrainer", "SFTTrainer"])
@pytest.mark.parametrize("loss,rule", [("sparsemax", "fenchel_young"), ("am_softmax", "margin"),
                                       ("sparse_softmax", "kept_logsumexp"), ("taylor_softmax", "nll")])
def test_which_trl_trainers_are_refused(trainer_name, loss, rule):
    """Every TRL trainer but SFTTrainer reads log_probs as log pi(y_t): refused where -loss_t is no log-probability."""
    import types

    import trl

    from hf_sparsemax.integrations.trainer import refusal

    trainer = object.__new__(getattr(trl, trainer_name))
    trainer.args = types.SimpleNamespace(loss_type="sigmoid")
    reason = refusal(trainer, loss, rule)
    if trainer_name != "SFTTrainer" and rule in ("fenchel_young", "margin"):
        assert reason is not None and trainer_name in reason and "no log-probability" in reason
    else:
        assert reason is None


def small_grpo(model, tmp_path):
    """A one-step GRPOTrainer on CPU: 4 prompts, 2 generations of 4 tokens, reward = completion length."""
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, max_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                      disable_tqdm=True, gradient_checkpointing=False, bf16=False, beta=0.0, seed=0)
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                       args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS[:4]}),
                       processing_class=tokenizer())


def test_grpo_under_sparse_softmax_scores_the_trained_distribution(tmp_path):
    """GRPO samples with the patched generate and scores with the patched request: its entropy is that of top-5."""
    import math

    model = hs.patch_model(tiny_lm(), loss="sparse_softmax", loss_options={"top_k": 5})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grpo = small_grpo(model, tmp_path)
        grpo.train()
    entropy = next(log["entropy"] for log in grpo.state.log_history if "entropy" in log)
    assert 0 < entropy <= math.log(5) + 1e-4  # dense softmax over 30 tokens would be near log(30) = 3.4


@pytest.mark.parametrize("loss,rule", [("sparse_softmax", "kept_logsumexp"), ("sparsemax", "fenchel_young")])
def test_trl_trainers_that_compute_their_own_objective_from_the_logits_are_refused(loss, rule):
    """ORPO runs the model without labels and adds dense cross-entropy itself: the patched loss would not train."""
    import types

    from trl.experimental.orpo import ORPOTrainer

    from hf_sparsemax.integrations.trainer import refusal

    orpo = object.__new__(ORPOTrainer)
    orpo.args = types.SimpleNamespace(loss_type="sigmoid")
    reason = refusal(orpo, loss, rule, asked_for_tokens=False)
    assert reason is not None and "ORPOTrainer runs the model without labels" in reason
    sft = object.__new__(SFTTrainer)
    sft.args = types.SimpleNamespace(loss_type="nll")
    assert refusal(sft, loss, rule, asked_for_tokens=False) is None  # SFT: its compute_loss_func route is its own


def rollout_trainer(trainer_name="GRPOTrainer", folder=None, **args):
    """A TRL online trainer as the guard reads it: ``args`` and ``model.name_or_path`` (no vLLM needed)."""
    import types

    import trl

    online = object.__new__(getattr(trl, trainer_name))
    settings = {"use_vllm": True, "vllm_mode": "colocate", "generation_kwargs": None, "top_k": 0, "top_p": 1.0}
    online.args = types.SimpleNamespace(**{**settings, **args})
    online.model = types.SimpleNamespace(name_or_path=str(folder) if folder is not None else "")
    return online


def test_vllm_rollouts_must_sample_the_trained_distribution(tmp_path):
    """use_vllm=True: vLLM loads model.name_or_path; from a base folder it samples softmax unless told the loss."""
    from hf_sparsemax.integrations.vllm import vllm_generation_kwargs
    from hf_sparsemax.integrations.vllm.rollouts import rollout_refusal

    base = tmp_path / "base"
    tiny_lm().save_pretrained(base)
    model = hs.patch_model(tiny_lm(), loss="sparse_softmax", loss_options={"top_k": 5})
    reason = rollout_refusal(rollout_trainer(folder=base), model)
    assert reason.startswith("GRPOTrainer with use_vllm=True would sample its rollouts with vLLM from softmax")
    assert "sparse_softmax(top_k=5)" in reason and "vllm_generation_kwargs(model)" in reason
    shown = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()  # the page's refusal
    shown = shown.split("with one `ValueError`:\n\n```text\nValueError: ", 1)[1].split("```", 1)[0]
    top3 = hs.patch_model(tiny_lm(), loss="sparse_softmax", loss_options={"top_k": 3})
    assert " ".join(rollout_refusal(rollout_trainer(folder=base), top3).replace(str(base), "path/to/base").split()) \
        == " ".join(shown.split())
    assert rollout_refusal(rollout_trainer(folder=base, use_vllm=False), model) is None
    kwargs = vllm_generation_kwargs(model, {"max_tokens": 9, "extra_args": {"mine": 1, "hf_sparsemax": "off"}})
    assert kwargs == {"max_tokens": 9, "extra_args": {"mine": 1, "hf_sparsemax": "sparse_softmax",
                                                       "hf_sparsemax_top_k": 5}}
    for name in ("GRPOTrainer", "RLOOTrainer"):
        for mode in ("colocate", "server"):
            assert rollout_refusal(rollout_trainer(name, base, vllm_mode=mode, generation_kwargs=kwargs), model) is None
    assert rollout_refusal(rollout_trainer(folder=base, top_k=5), model) is None  # vLLM's own top-k samples it
    assert rollout_refusal(rollout_trainer(folder=base, top_k=5, vllm_mode="server"), model) is None
    assert "sparse_softmax(top_k=5)" in rollout_refusal(rollout_trainer(folder=base, top_k=4), model)

    saved = tmp_path / "patched"  # a saved patched folder: vLLM's processor reads the loss from it, no flag
    copy.deepcopy(model).save_pretrained(saved)
    assert rollout_refusal(rollout_trainer(folder=saved), model) is None
    server = rollout_refusal(rollout_trainer(folder=saved, vllm_mode="server"), model)  # the server's folder is unseen
    assert "vllm_mode='server'" in server and "hf-sparsemax in the server's environment" in server
    other = hs.patch_model(tiny_lm(), loss="sparse_softmax", loss_options={"top_k": 3})
    assert "from sparse_softmax(top_k=5) (from the folder it loads" in rollout_refusal(rollout_trainer(folder=saved),
                                                                                        other)
    wrong = {"extra_args": {"hf_sparsemax": "sparsemax"}}
    assert "from sparsemax() (from its generation_kwargs' extra_args)" in rollout_refusal(
        rollout_trainer(folder=saved, generation_kwargs=wrong), model)
    bad = {"extra_args": {"hf_sparsemax": "nope"}}
    assert "extra_args'] is refused" in rollout_refusal(rollout_trainer(folder=base, generation_kwargs=bad), model)


def test_vllm_rollouts_of_sparse_attention_where_vllm_computes_it_exactly(tmp_path):
    """vLLM computes a saved folder's sparse attention (learned alphas synced with the weights): colocate rollouts
    from a folder saved with the model's attention are allowed; a folder with softmax or other settings, server
    mode, or an alpha ramp in progress are refused in one sentence saying why."""
    from hf_sparsemax.integrations.vllm import vllm_generation_kwargs
    from hf_sparsemax.integrations.vllm.rollouts import rollout_refusal

    tiny_lm().save_pretrained(tmp_path / "base")
    options = {"alpha": 1.5, "learn_alpha": True}
    hs.patch_model(tiny_lm(), attn="entmax_bisect", attn_options=options).save_pretrained(tmp_path / "saved")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "saved")  # as GRPO trains it: vLLM loads the same folder
    assert SparseSettings.from_config(model.config).attention_options.learn_alpha
    assert rollout_refusal(rollout_trainer(folder=tmp_path / "saved"), model) is None
    assert rollout_refusal(rollout_trainer(folder=tmp_path / "saved", top_k=5), model) is None
    assert vllm_generation_kwargs(model) == {"extra_args": {"hf_sparsemax": "off"}}  # cross-entropy: softmax
    hs.patch_model(tiny_lm(), attn="entmax_bisect", attn_options={"alpha": 1.3}).save_pretrained(tmp_path / "other")
    refused = {
        "base": rollout_refusal(rollout_trainer(folder=tmp_path / "base"), model),
        "other": rollout_refusal(rollout_trainer(folder=tmp_path / "other"), model),
        "server": rollout_refusal(rollout_trainer(folder=tmp_path / "saved", vllm_mode="server"), model),
    }
    assert refused["base"].startswith("GRPOTrainer with use_vllm=True: this model trains entmax_bisect attention")
    assert "whose attention is softmax: save the patched model (save_pretrained)" in refused["base"]
    assert "whose attention is other entmax_bisect settings" in refused["other"]
    assert "vllm_mode='server'" in refused["server"] and "use vllm_mode='colocate'" in refused["server"]
    assert all(reason.count(": ") <= 2 and "\n" not in reason for reason in refused.values())
    ramp = hs.AlphaScheduleCallback()
    ramped = copy.deepcopy(model)
    state = types.SimpleNamespace(global_step=0, max_steps=10)
    ramp.on_train_begin(None, state, None, model=ramped)
    trainer = rollout_trainer(folder=tmp_path / "saved")
    trainer.callback_handler = types.SimpleNamespace(callbacks=[ramp])
    assert ramp.ramping and "an alpha ramp (AlphaScheduleCallback) is in progress" in rollout_refusal(trainer, model)
    state.global_step = 3  # the ramp's end (30% of 10 steps): the learned alphas start afresh and train
    ramp.on_step_begin(None, state, None)
    assert not ramp.ramping and rollout_refusal(trainer, model) is None


@pytest.mark.parametrize("patch, refused", [
    ({"loss": "sparse_softmax", "loss_options": {"top_k": 5}}, "use_vllm=True would sample its rollouts with vLLM "
                                                               "from softmax"),
    ({"attn": "entmax15"}, "entmax15 attention"),  # sparse attention alone (no sparse loss) is refused too
])
def test_grpo_with_vllm_rollouts_from_a_base_folder_is_refused_before_any_step(tmp_path, patch, refused):
    """The guard reads use_vllm at the first forward GRPO makes after its first rollouts: no step is taken.

    The trainer is built without vLLM (not installed here) and then told use_vllm=True, which is what the guard
    reads; its rollouts come from transformers' generate, and the guard refuses at its first scoring forward.
    """
    tiny_lm().save_pretrained(tmp_path / "base")
    model = hs.patch_model(LlamaForCausalLM.from_pretrained(tmp_path / "base"), **patch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grpo = small_grpo(model, tmp_path)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        grpo.args.use_vllm = True
        with pytest.raises(ValueError, match=refused):
            grpo.train()
    assert grpo.state.global_step == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
