"""Copy a folder's weights into a running vLLM engine as TRL's colocate mode does; print what it then computes.

``python weight_sync.py FOLDER_A FOLDER_B OUT_JSON``: an engine on ``FOLDER_A`` (vLLM in this process, as TRL's
colocate mode runs it; dtype "auto": bfloat16 on CPU) receives ``FOLDER_B``'s parameters one ``load_weights`` call
each (TRL's ``sync_weights``), then decodes; a second engine loads ``FOLDER_B`` from disk and decodes the same prompts.
Then, where vLLM packed the weights, one linear layer's weights are copied alone, which must be refused. Writes
``{"before", "synced", "fresh": [[tokens, logprobs], ...], "packed": [...], "partial": message or None}``.
``--learned-first`` (folders that differ only in learned alphas, temperatures and length scales): before that sync,
only ``FOLDER_B``'s learned values are loaded through vLLM's own ``load_weights`` (as an engine whose weights are not
packed loads every weight, without hf_sparsemax's reload) and decoded (``"learned"``), then ``FOLDER_A``'s
(``"restored"``).
"""

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, as TRL's colocate mode has it

from transformers import AutoModelForCausalLM  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

PROMPTS = [[1, 5, 9, 33, 100], [7, 8, 200]]
ENGINE = dict(max_model_len=128, seed=0, skip_tokenizer_init=True)
LEARNED = ".hf_sparsemax_"  # in the names of learned alphas, temperatures and length scales


def decode(llm):
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
    return [[list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]]
            for o in out]


def shut(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def main(folder_a, folder_b, out, learned_first=False):
    from hf_sparsemax.integrations.vllm.reload import packed_modules

    seen = {}
    fresh = LLM(model=folder_b, **ENGINE)
    seen["fresh"] = decode(fresh)
    shut(fresh)
    llm = LLM(model=folder_a, **ENGINE)
    seen["before"] = decode(llm)
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    seen["packed"] = packed_modules(model)
    trained = AutoModelForCausalLM.from_pretrained(folder_b)
    if learned_first:  # vLLM's own load_weights (an engine that packs nothing), the learned values only
        own_load = type(model).load_weights.__get__(model)  # the class's, not the plugin's wrapper on the instance
        for folder, key in ((folder_b, "learned"), (folder_a, "restored")):
            source = trained if folder == folder_b else AutoModelForCausalLM.from_pretrained(folder_a)
            own_load([(name, param.data) for name, param in source.named_parameters() if LEARNED in name])
            llm.reset_prefix_cache()
            seen[key] = decode(llm)
    for name, param in trained.named_parameters():  # TRL's sync_weights: one parameter a call
        model.load_weights([(name, param.data)])
    llm.reset_prefix_cache()
    seen["synced"] = decode(llm)
    seen["partial"] = None
    if seen["packed"]:
        model.load_weights([("model.layers.0.self_attn.q_proj.weight",
                             trained.model.layers[0].self_attn.q_proj.weight.data)])
        try:
            decode(llm)
        except Exception as error:  # noqa: BLE001 - whatever vLLM wraps it in, the message is the plugin's
            seen["partial"] = f"{type(error).__name__}: {error}"
    with open(out, "w") as handle:
        json.dump(seen, handle)
    os._exit(0)  # the engine may be dead (the refused partial load): no shutdown handshake


if __name__ == "__main__":
    main(*sys.argv[1:4], learned_first="--learned-first" in sys.argv[4:])
