"""One trl.SFTTrainer training step (forward + backward) with a patched sparse loss vs TRL's dense default.

A SmolLM2-135M-shaped Llama (random weights, tied embeddings, float32, CPU),
a batch of ``--batch`` x ``--length`` tokens whose first quarter is prompt
(label -100, as with ``completion_only_loss``). Each contender is its own
model (same weights) under its own ``SFTTrainer``; ``trainer.training_step``
is timed in interleaved rounds (median). TRL's default computes
``log_softmax`` of the head in chunks (its ``fused_lm_head``); a patched model
answers that request with its own loss (``hf_sparsemax.integrations.trl``).

    python benchmarks/bench_trl.py                  # 4 x 256 tokens, 2 timed rounds
    python benchmarks/bench_trl.py --batch 8 --length 512 --repeats 1
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import hf_sparsemax as hs
from common import interleaved_medians

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                    tie_word_embeddings=True, rope_theta=100000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
BASELINE = "TRL default (dense NLL)"
CONTENDERS = {
    BASELINE: None,
    "sparse_softmax(top_k=64)": ("sparse_softmax", {"top_k": 64}),
    "sparse_softmax(top_k=64), fused": ("sparse_softmax", {"top_k": 64, "fused": True}),
    "entmax15": ("entmax15", {}),
    "entmax15, fused": ("entmax15", {"fused": True}),
}


def sft_step(state, patch, batch, folder):
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    model.load_state_dict(state)
    if patch is not None:
        hs.patch_model(model, loss=patch[0], loss_options=patch[1])
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                        pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    args = SFTConfig(output_dir=folder, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                     per_device_train_batch_size=len(batch["input_ids"]), save_strategy="no", disable_tqdm=True)
    data = Dataset.from_dict({"input_ids": batch["input_ids"][:2].tolist()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    count = (batch["labels"][:, 1:] != -100).sum()

    def step():
        trainer.training_step(trainer.model, dict(batch), num_items_in_batch=count)
        trainer.model.zero_grad(set_to_none=True)

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    state = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).state_dict()
    ids = torch.randint(3, SMOLLM2_135M["vocab_size"], (args.batch, args.length))
    labels = ids.clone()
    labels[:, : args.length // 4] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    with tempfile.TemporaryDirectory() as folder:
        steps = {name: sft_step(state, patch, batch, folder) for name, patch in CONTENDERS.items()}
        ms = interleaved_medians(steps, args.repeats)
    print(f"SFTTrainer.training_step, SmolLM2-135M shapes, {args.batch} x {args.length} tokens, float32, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}\n")
    print("| loss | ms | x TRL default |\n|---|---:|---:|")
    for name, value in ms.items():
        print(f"| {name} | {value:.0f} | {value / ms[BASELINE]:.2f} |")


if __name__ == "__main__":
    main()
