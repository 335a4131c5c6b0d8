"""Peak resident memory of reading and packing a big local jsonl for a causal-LM recipe.

Writes a jsonl of random word entries (``--mb`` megabytes, words from the
offline fortunes), then, in a fresh process each, builds the train / held-out
blocks with ``hf_sparsemax.app.recipe_data.causal_lm_datasets`` (SmolLM2's
tokenizer, ``block_size`` 128, sizes ``null``: every block) and prints the
peak RSS against the RSS before any data was read.

    HF_DATASETS_CACHE=/tmp/hfcache python benchmarks/bench_data_memory.py --mb 60
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time


def write_jsonl(path: str, megabytes: float) -> None:
    from hf_sparsemax.app import assets

    words = " ".join(assets.fortunes("fortunes")).split()
    rng = random.Random(0)
    size = 0
    with open(path, "w", encoding="utf-8") as handle:
        while size < megabytes * 1e6:
            line = json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(20, 200)))}) + "\n"
            handle.write(line)
            size += len(line)


def measure(path: str) -> None:
    from hf_sparsemax.app.recipe_data import causal_lm_datasets
    from hf_sparsemax.app.recipes import DataSpec, Recipe
    from hf_sparsemax.app.runner import load_tokenizer

    tokenizer = load_tokenizer(Recipe())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    train, test = causal_lm_datasets(DataSpec(source=path, block_size=128, train_size=None, eval_size=None),
                                     tokenizer)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{os.path.getsize(path) / 1e6:.0f} MB jsonl: {len(train)} + {len(test)} blocks of 128 tokens in "
          f"{time.perf_counter() - start:.0f} s; RSS before the data {before:.0f} MB, peak {peak:.0f} MB "
          f"(+{peak - before:.0f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=60)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure)
        return
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "big.jsonl")
        write_jsonl(path, args.mb)
        subprocess.run([sys.executable, __file__, "--measure", path], check=True)


if __name__ == "__main__":
    main()
