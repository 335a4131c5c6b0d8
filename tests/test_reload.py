"""A saved sparse model loads back as exactly that model: every entry point, every sparse attention and loss."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments,
                          pipeline)

import hf_sparsemax as hs
from hf_sparsemax.integrations import reload
from hf_sparsemax.attention.interface import ALPHA_ATTR, OPTIONS_ATTR
from test_patch import Rows
from test_recipes import CHARS, char_tokenizer, run, write_recipe

# every sparse attention (non-default options, a learned alpha) and every sparse loss, in pairs
CASES = {
    "sparsemax+sparse_softmax": ("sparsemax", {"chunk_size": 3}, "sparse_softmax", {"top_k": 5, "top_p": 0.9}),
    "entmax15+sparsemax": ("entmax15", {}, "sparsemax", {}),
    "bisect+entmax15": ("entmax_bisect", {"alpha": 1.3}, "entmax15", {}),
    "learned+bisect": ("entmax_bisect", {"alpha": 1.6, "learn_alpha": True}, "entmax_bisect", {"alpha": 1.2}),
    "topk_attention": ("sparse_softmax", {"top_k": 3}, None, None),
    "loss_only_fused": (None, None, "sparsemax", {"fused": True}),
}


def tiny_lm(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(CHARS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return LlamaForCausalLM(config)


def patched(case):
    attn, attn_options, loss, loss_options = CASES[case]
    model = hs.patch_model(tiny_lm(), attn=attn, attn_options=attn_options, loss=loss, loss_options=loss_options)
    scramble_alphas(model)
    return model.eval()


def scramble_alphas(model, seed=1):
    """Learned alphas unlike their initial value (as after training)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if ALPHA_ATTR in module._modules:
                alpha = module._modules[ALPHA_ATTR].pre_alpha
                alpha.copy_(torch.rand(alpha.shape, generator=generator) * 4 - 2)


IDS = torch.tensor([[5, 40, 41, 42, 50, 60, 33, 34, 35], [0, 0, 17, 18, 19, 20, 21, 22, 23]])
MASK = (IDS != 0).long()


def behaviour(model):
    """Logits, loss (eval and train mode), the sampling distribution and sampled tokens of a causal LM."""
    model.eval()
    with torch.no_grad():
        out = model(input_ids=IDS, attention_mask=MASK, labels=IDS)
        processed = hs.logits_processors(model)(IDS, out.logits[:, -1].clone())
        model.train()
        train_loss = model(input_ids=IDS, attention_mask=MASK, labels=IDS).loss
        model.eval()
        torch.manual_seed(0)
        tokens = model.generate(IDS[:1, :4], max_new_tokens=6, do_sample=True, pad_token_id=0)
    return {"logits": out.logits, "loss": out.loss, "train_loss": train_loss, "sampling": processed.softmax(-1),
            "tokens": tokens}


def assert_same(got, expected):
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6, msg=key)


def same_attention(loaded, model):
    assert loaded.config._attn_implementation == model.config._attn_implementation
    for a, b in zip(loaded.modules(), model.modules()):
        assert getattr(a, OPTIONS_ATTR, None) == getattr(b, OPTIONS_ATTR, None)


@pytest.mark.parametrize("case", CASES)
def test_auto_class_round_trip(tmp_path, case):
    model = patched(case)
    expected = behaviour(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # no patch_model call
    assert not loaded.is_quantized and getattr(loaded, "hf_quantizer", None) is None
    assert loaded.config.hf_sparsemax == model.config.hf_sparsemax
    same_attention(loaded, model)
    assert_same(behaviour(loaded), expected)
    again = tmp_path / "again"
    loaded.save_pretrained(again)  # a reloaded model saves its settings again
    assert_same(behaviour(AutoModelForCausalLM.from_pretrained(again)), expected)


def test_learned_alphas_load_as_weights_and_stay_trainable(tmp_path):
    model = patched("learned+bisect")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    alphas = {n: p for n, p in loaded.named_parameters() if ALPHA_ATTR in n}
    assert len(alphas) == 2 and all(p.requires_grad for p in alphas.values())
    for name, param in alphas.items():
        torch.testing.assert_close(param, model.get_parameter(name), rtol=0, atol=0)


def test_pipeline_round_trip(tmp_path):
    model = patched("learned+bisect")
    model.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path))
    assert generator.model.config._attn_implementation == "entmax_bisect"
    same_attention(generator.model, model)
    assert_same(behaviour(generator.model), behaviour(model))
    prompt = "Murphy"
    torch.manual_seed(0)
    tokens = generator(prompt, max_new_tokens=5, do_sample=True, temperature=1.0,  # the pipeline defaults to 0.7
                       return_tensors=True)[0]["generated_token_ids"]
    torch.manual_seed(0)
    reference = model.generate(**char_tokenizer()(prompt, return_tensors="pt"), max_new_tokens=5, do_sample=True)
    assert list(tokens) == reference[0].tolist()


@pytest.mark.parametrize("case", ["learned+bisect", "sparsemax+sparse_softmax"])
def test_peft_round_trip_on_a_patched_base(tmp_path, case):
    from peft import LoraConfig, PeftModel, get_peft_model

    base = patched(case)
    base.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    attn, attn_options, loss, loss_options = CASES[case]
    hs.patch_model(peft_model, attn=attn, attn_options=attn_options)  # after get_peft_model: alphas trainable
    scramble_alphas(peft_model, seed=2)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    expected = behaviour(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    if attn_options.get("learn_alpha"):
        saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
        assert ALPHA_ATTR in saved["modules_to_save"]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    assert_same(behaviour(loaded), expected)
    assert_same(behaviour(hs.patch_model(loaded)), expected)  # re-applying keeps the adapter's alphas
    hs.unpatch_model(peft_model)
    assert ALPHA_ATTR not in (peft_model.peft_config["default"].modules_to_save or [])
    assert not any(ALPHA_ATTR in name for name, _ in peft_model.named_parameters())


def without_plugin(folder, code):
    """Run ``code`` in a fresh interpreter where ``import hf_sparsemax`` fails (the plugin is not installed)."""
    script = "import sys\nsys.modules['hf_sparsemax'] = None\nfolder = sys.argv[1]\n" + code
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, env=env,
                          timeout=300)


def test_without_the_plugin_sparse_attention_fails_loudly_and_a_sparse_loss_says_how_to_decode(tmp_path):
    patched("entmax15+sparsemax").save_pretrained(tmp_path / "attention")
    loss_only = patched("loss_only_fused")
    loss_only.save_pretrained(tmp_path / "loss")
    with torch.no_grad():
        plain_logits = hs.unpatch_model(loss_only)(input_ids=IDS, attention_mask=MASK).logits
    torch.save(plain_logits, tmp_path / "logits.pt")
    code = (
        "from transformers import AutoModelForCausalLM, GenerationConfig\n"
        "try:\n    import hf_sparsemax\nexcept ImportError:\n    print('NO PLUGIN')\n"
        "AutoModelForCausalLM.from_pretrained(folder)\n"
    )
    failed = without_plugin(tmp_path / "attention", code)
    assert "NO PLUGIN" in failed.stdout and failed.returncode != 0
    assert 'ValueError: Specified `attn_implementation="entmax15"` is not supported' in failed.stderr

    code = (
        "import json, torch\nfrom transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(folder)\n"
        f"ids, mask = torch.tensor({IDS.tolist()}), torch.tensor({MASK.tolist()})\n"
        "expected = torch.load(folder + '/../logits.pt')\n"
        "got = model(input_ids=ids, attention_mask=mask).logits\n"
        "assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got - expected).abs().max()\n"  # another process: threads may reduce in another order
        "print(json.dumps({'config': model.config.hf_sparsemax, 'generation': model.generation_config.hf_sparsemax}))\n"
    )
    loaded = without_plugin(tmp_path / "loss", code)
    assert loaded.returncode == 0, loaded.stderr
    assert "hf_sparsemax" in loaded.stderr  # transformers' warning names the unknown load hook
    notes = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert notes["config"]["loss"] == "sparsemax" and notes["generation"]["loss"] == "sparsemax"
    for note in (notes["config"]["decoding"], notes["generation"]["decoding"]):
        assert note.startswith("trained with the sparsemax loss") and "SparsemaxLogitsProcessor" in note


def test_sparse_softmax_note_names_the_plain_transformers_equivalent(tmp_path):
    model = patched("sparsemax+sparse_softmax")
    note = model.generation_config.hf_sparsemax["decoding"]
    assert "generate(do_sample=True, top_k=5, top_p=0.9)" in note
    # plain transformers' warpers with those settings sample the very distribution the loss trained
    logits = torch.randn(3, len(CHARS))
    plain = model.generation_config.__class__(do_sample=True, top_k=5, top_p=0.9)
    warpers = model._get_logits_processor(plain, input_ids_seq_length=1, encoder_input_ids=IDS[:3],
                                          prefix_allowed_tokens_fn=None, logits_processor=[])
    torch.testing.assert_close(warpers(IDS[:3], logits.clone()).softmax(-1),
                               hs.sparse_softmax(logits, top_k=5, top_p=0.9), rtol=0, atol=1e-6)


def test_model_card_tags_and_undo(tmp_path):
    model = patched("learned+bisect")
    assert {"hf_sparsemax", "sparse-attention-entmax_bisect", "sparse-loss-entmax_bisect"} <= set(model.model_tags)
    hs.unpatch_model(model)
    assert not model.model_tags and not hasattr(model.config, "quantization_config")
    assert "attn_implementation" not in vars(model.config) and "hf_sparsemax" not in vars(model.generation_config)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not {"hf_sparsemax", "quantization_config", "attn_implementation"} & set(saved)


def test_remove_load_hook_gives_the_plain_load_back(tmp_path):
    model = patched("learned+bisect")
    model.save_pretrained(tmp_path)
    reload.remove_load_hook()
    try:
        plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    finally:
        reload.install_load_hook(hs.patch_model)
    assert "_loss_function" not in vars(plain) and "generate" not in vars(plain)
    assert not any(ALPHA_ATTR in name for name, _ in plain.named_parameters())
    assert_same(behaviour(hs.patch_model(plain)), behaviour(model))  # the way to load such a folder quantized
    restored = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "_loss_function" in vars(restored) and "generate" in vars(restored)


def test_another_quantization_config_is_refused_loudly(tmp_path):
    from transformers import BitsAndBytesConfig

    patched("entmax15+sparsemax").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="quantized with SparseLoadConfig but you are passing a BitsAndBytesConfig"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(load_in_4bit=True))


def test_a_checkpoint_without_its_learned_alphas_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    patched("learned+bisect").save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    weights = {k: v for k, v in load_file(path).items() if ALPHA_ATTR not in k}
    save_file(weights, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no learned alphas"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def train_args(folder, steps, **extra):
    return TrainingArguments(output_dir=str(folder), per_device_train_batch_size=2, max_steps=steps, learning_rate=0.05,
                             lr_scheduler_type="constant", report_to=[], save_strategy="steps", save_steps=1,
                             logging_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, **extra)


def test_resume_from_a_checkpoint_folder_keeps_the_objective(tmp_path):
    torch.manual_seed(3)
    data = Rows(torch.randint(3, len(CHARS), (4, 9)), torch.randint(3, len(CHARS), (4, 9)))
    whole = patched("learned+bisect").train()
    Trainer(model=whole, args=train_args(tmp_path / "whole", 2), train_dataset=data).train()

    first = patched("learned+bisect").train()
    Trainer(model=first, args=train_args(tmp_path / "cut", 1), train_dataset=data).train()
    checkpoint = tmp_path / "cut" / "checkpoint-1"
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint)  # a fresh process would start from the folder
    Trainer(model=reloaded, args=train_args(tmp_path / "cut", 2), train_dataset=data).train(
        resume_from_checkpoint=str(checkpoint))
    for name, param in whole.named_parameters():
        torch.testing.assert_close(reloaded.get_parameter(name), param, rtol=0, atol=1e-6, msg=name)
    assert reloaded.config.hf_sparsemax["loss"] == "entmax_bisect"


@pytest.mark.parametrize("lora", [True, False])
def test_trained_variant_evaluates_as_the_in_memory_model(tmp_path, tmp_path_factory, capsys, lora):
    """`evaluate` of a variant with learned alphas equals the evaluation right after training."""
    folder = tmp_path_factory.mktemp("tiny_llama_reload")
    tiny_lm().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    variants = {"learned": {"attn": "entmax_bisect", "attn_options": {"alpha": 1.5, "learn_alpha": True},
                            "loss": "entmax15"}}
    changes = {"variants": variants, "training": {"max_steps": 3, "per_device_train_batch_size": 4,
                                                  "learning_rate": 0.1, "save_steps": 2, "disable_tqdm": True}}
    if not lora:
        changes["lora"] = None
    recipe, out = write_recipe(tmp_path, str(folder), **changes), tmp_path / "runs"
    assert run("train", recipe, "--variant", "learned", "--output", out) == 0
    trained = json.loads((out / "learned" / "results.json").read_text())
    capsys.readouterr()
    assert run("evaluate", recipe, "--variant", "learned", "--output", out) == 0
    printed = capsys.readouterr().out
    evaluated = json.loads(printed[printed.index("{\n"):printed.rindex("}") + 1])
    for key in ("eval_loss", "epsilon_perplexity", "sparsemax_score", "support_size"):
        assert evaluated[key] == pytest.approx(trained[key], rel=1e-6, abs=1e-7), key


def test_an_explicit_other_attention_is_named_and_the_saved_model_comes_back(tmp_path):
    model = patched("bisect+entmax15")
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="saved with entmax_bisect attention; attn_implementation='eager' is ignored"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert_same(behaviour(loaded), behaviour(model))


def test_a_quantized_model_keeps_its_own_quantization_config():
    model = tiny_lm()
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.warns(UserWarning, match="call hf_sparsemax.patch_model"):
        hs.patch_model(model, loss="sparsemax")
    assert model.config.quantization_config == {"quant_method": "gptq", "bits": 4}
    hs.unpatch_model(model)
    assert model.config.quantization_config == {"quant_method": "gptq", "bits": 4}
    # the entry of a folder loaded without hf_sparsemax (a dict) is ours: replaced, no warning
    model.config.quantization_config = {"quant_method": "hf_sparsemax", "dequantize": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hs.patch_model(model, loss="sparsemax")
    assert isinstance(model.config.quantization_config, reload.SparseLoadConfig)


def test_sequence_classification_round_trip(tmp_path):
    from transformers import AutoModelForSequenceClassification, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(CHARS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, num_labels=3)
    model = hs.patch_model(LlamaForSequenceClassification(config), attn="sparse_softmax", attn_options={"top_k": 2},
                           loss="entmax_bisect", loss_options={"alpha": 1.3}).eval()
    labels = torch.tensor([2, 0])
    with torch.no_grad():
        expected = model(input_ids=IDS, attention_mask=MASK, labels=labels)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    with torch.no_grad():
        got = loaded(input_ids=IDS, attention_mask=MASK, labels=labels)
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=1e-6)
    assert got.loss != torch.nn.functional.cross_entropy(got.logits, labels)


def test_the_body_of_a_sparse_model_loads_with_its_attention(tmp_path):
    from transformers import AutoModel

    model = patched("learned+bisect")
    model.save_pretrained(tmp_path)
    body = AutoModel.from_pretrained(tmp_path)  # no LM head: the loss does not apply, the attention does
    assert body.config.hf_sparsemax["attn_options"] == {"alpha": 1.6, "learn_alpha": True}
    assert body.config.hf_sparsemax["loss"] == "cross_entropy"
    with torch.no_grad():
        expected = model.model(input_ids=IDS, attention_mask=MASK).last_hidden_state
        got = body(input_ids=IDS, attention_mask=MASK).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
