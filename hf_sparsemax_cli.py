"""The ``hf-sparsemax`` command: run fine-tuning recipes, and check decoding against training.

    hf-sparsemax compare default                         # 5 variants side by side -> runs/default/report.md
    hf-sparsemax compare default --seeds 0,1,2           # each variant once per seed: mean ± std in the report
    hf-sparsemax train default --variant entmax15_loss --set training.max_steps=20
    hf-sparsemax evaluate default --variant entmax15_loss  # held-out metrics of runs/default/entmax15_loss
    hf-sparsemax generate default --variant entmax15_loss --set 'eval.prompts=["Murphy says"]'
    hf-sparsemax decoding-report --loss sparse_softmax --loss-option top_k=10 --prompt "Once upon a time"
    hf-sparsemax serve default --variant entmax15_loss    # vLLM's OpenAI server on 127.0.0.1:8000 (needs vLLM)
    hf-sparsemax build-kernels                            # the CPU attention kernel, built now into its cache
    hf-sparsemax bench attention --quick                  # sparse attention against sdpa on this machine

A recipe is a YAML file (or the name of a recipe shipped with the package:
@RECIPES@). Override any field with --set PATH=VALUE (repeatable): PATH is the
dotted field (training.max_steps, data.block_size, lora.r, eval.prompts,
variants.entmax15_loss.loss_options.alpha), VALUE is read as YAML (20, 5e-4, true,
null, [q_proj, v_proj]). `training` is passed to transformers.TrainingArguments,
`lora` to peft.LoraConfig (null: full fine-tuning). Results go to
--output (default runs/<recipe name>), written to a .partial folder first and
renamed when complete; --resume continues an interrupted run from its last
checkpoint. One run per output folder at a time (a second is refused at once,
naming the other's pid). Bad input exits with code 2 and one line saying what
to fix, before any model loads where it can be checked without one.
Distributed: accelerate launch --num_processes 2 -m hf_sparsemax_cli train ...

This module is the command's entry point and its argument parser, kept apart from the ``hf_sparsemax``
package on purpose: importing any part of the package imports torch and transformers (5-8 s), so parsing the
arguments here first lets ``--help`` and argument errors answer at once; the command that runs then imports
:mod:`hf_sparsemax.app.cli`, which does the work. The package never imports this module (its import graph has
no circle: tests/test_layout.py checks it), so the parser's few facts about the package (where the shipped
recipes are) are found here again, without importing it; tests/test_cli.py checks they agree.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys


def recipe_dir(package_dir: str) -> str:
    """The shipped recipes of the ``hf_sparsemax`` package in ``package_dir``: the data package
    ``hf_sparsemax.app.recipes`` of an installed wheel, else ``recipes/`` at the top of a source checkout
    (``hf_sparsemax.app.recipes.recipe_dir``, found here without importing the package)."""
    installed = os.path.join(package_dir, "app", "recipes")
    checkout = os.path.join(package_dir, os.pardir, "recipes")
    return installed if os.path.isdir(installed) else os.path.normpath(checkout)


def shipped_recipes(folder: str | None = None) -> list[str]:
    """Names of the recipes that ship (``hf-sparsemax compare <name>``), found without importing the package."""
    if folder is None:
        spec = importlib.util.find_spec("hf_sparsemax")  # locates the package; runs none of it
        if spec is None or not spec.submodule_search_locations:
            return []
        folder = recipe_dir(list(spec.submodule_search_locations)[0])
    if not os.path.isdir(folder):
        return []
    return sorted(f.removesuffix(".yaml") for f in os.listdir(folder) if f.endswith(".yaml"))


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors as one line (exit code 2), like every other error of the command."""

    def error(self, message: str):
        self.exit(2, f"hf-sparsemax: error: {message} (see: {self.prog} --help)\n")


def parse_option(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    name, value = text.split("=", 1)
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2`` -> ``[0, 1, 2]`` (checked further as the recipe field ``seeds``)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 0,1,2, got {text!r}") from None


RECIPE_COMMANDS = {
    "train": "fine-tune one variant of a recipe, evaluate it on the held-out split and sample from it",
    "evaluate": "held-out metrics of a trained variant",
    "generate": "matched sampling from a trained variant (eval.prompts)",
    "compare": "train, evaluate and sample every variant; write a report folder",
}


def add_recipe_command(commands, name: str, recipes: str) -> None:
    sub = commands.add_parser(name, help=RECIPE_COMMANDS[name], description=RECIPE_COMMANDS[name])
    sub.add_argument("recipe", help=f"recipe YAML file, or the name of a shipped recipe ({recipes})")
    sub.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                     help="override a recipe field, e.g. --set training.max_steps=20 (VALUE is YAML; repeatable)")
    sub.add_argument("--output", help="results folder (default runs/<recipe name>)")
    if name != "compare":
        sub.add_argument("--variant", help="which of the recipe's variants (default: the first)")
    if name == "compare":
        sub.add_argument("--seeds", type=parse_seeds, metavar="S1,S2,...",
                         help="train every variant once per seed (training.seed) and report mean ± std; "
                              "the same as --set 'seeds=[0,1,2]' (default: one run, training.seed)")
    if name in ("train", "compare"):
        sub.add_argument("--resume", action="store_true",
                         help="continue an interrupted run from its last checkpoint")


def loss_names() -> list[str]:
    """The losses ``decoding-report --loss`` takes, from the registry (imports the package: only that command,
    which loads a model anyway, asks for them)."""
    from hf_sparsemax.mappings import registry

    return ["cross_entropy", *registry.names("processor")]


def build_parser(losses: list[str] | None = None) -> OneLineParser:
    """The whole command line; building it imports nothing of torch, transformers or ``hf_sparsemax``.
    ``losses``: the names ``decoding-report --help`` lists (:func:`loss_names`; None: a few, and the rest on
    a wrong name)."""
    recipes = ", ".join(shipped_recipes())
    parser = OneLineParser(prog="hf-sparsemax", description=__doc__.split("\n\nThis module")[0].replace(
        "@RECIPES@", recipes), formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in RECIPE_COMMANDS:
        add_recipe_command(commands, name, recipes)
    report = commands.add_parser("decoding-report", help="how far sampling strays from the trained distribution")
    report.add_argument("--model", help="model id, folder or .gguf file (default: offline SmolLM2-135M-Instruct)")
    report.add_argument("--loss", help="the training loss whose distribution decoding should match: one of "
                        + (", ".join(losses) if losses else "cross_entropy, sparsemax, entmax15, sparse_softmax, ..."
                           " (an unknown name is refused with the list)"))
    report.add_argument("--loss-option", type=parse_option, action="append", default=[], metavar="NAME=VALUE")
    report.add_argument("--decode-option", type=parse_option, action="append", default=[], metavar="NAME=VALUE",
                        help="decode with plain transformers sampling and these generate options instead")
    report.add_argument("--prompt", action="append", required=True)
    report.add_argument("--max-new-tokens", type=int, default=32)
    report.add_argument("--seed", type=int, default=0)
    serve = commands.add_parser("serve", help="serve a trained variant with vLLM's OpenAI-compatible server",
                                description="Serve a trained causal-LM variant with `vllm serve` on 127.0.0.1 "
                                            "(vLLM and hf_sparsemax in one environment); arguments after -- go to "
                                            "vllm serve.")
    serve.add_argument("recipe", help=f"recipe YAML file, or the name of a shipped recipe ({recipes})")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    serve.add_argument("--output", help="results folder the variant was trained into (default runs/<recipe name>)")
    serve.add_argument("--variant", help="which of the recipe's variants (default: the first)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dry-run", action="store_true", help="prepare the folder and print the vllm command")
    commands.add_parser("build-kernels", help="build the CPU attention kernel now (container images, read-only "
                        "homes)", description="Build the CPU attention kernel now into $HF_SPARSEMAX_CACHE "
                        "(default ~/.cache/hf_sparsemax), so that later processes load it.")
    add_bench_commands(commands)
    return parser


BENCH = """Benchmarks a user runs on their own machine: each prints one table of ratios to its reference
(sdpa, softmax / cross-entropy, vLLM's softmax twin) and writes a JSON file with the numbers and what a reader
needs to trust them (CPU model and flags or GPU name, torch / transformers versions, threads, dtype, clock,
load average before and after, the command line). --quick: tiny shapes, under a minute on a 2-core CPU (a
rehearsal: its ratios mean little)."""

BENCH_COMMANDS = {
    "attention": "one attention call, training step, prefill and decoding step of each sparse attention against "
                 "sdpa, over contexts",
    "generation": "whole-model greedy decoding at a context on each cache (sdpa, sdpa + GrowingCache, the sparse "
                  "attentions, the no-attention floor): tokens/s and ratios",
    "serving": "vLLM serving a saved sparse-attention folder against its softmax twin (needs vLLM)",
    "losses": "the mappings and losses (and the fused head) against softmax / cross-entropy",
}


def add_bench_commands(commands) -> None:
    """``hf-sparsemax bench <what>``: the parser only (the work is :mod:`hf_sparsemax.app.bench`)."""
    bench = commands.add_parser("bench", help="benchmark the library against its reference on this machine",
                                description=BENCH, formatter_class=argparse.RawDescriptionHelpFormatter)
    whats = bench.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(BENCH_COMMANDS) + "}")
    subs = {name: whats.add_parser(name, help=text, description=text) for name, text in BENCH_COMMANDS.items()}
    for name, sub in subs.items():
        sub.add_argument("--quick", action="store_true",
                         help="tiny shapes and few repeats, one thread on a CPU: under a minute")
        sub.add_argument("--json", metavar="PATH", help=f"where the results go (default runs/bench/{name}.json)")
        sub.add_argument("--repeats", type=int, help="timed rounds (interleaved; median)")
        sub.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # the test suite's smaller --quick
        if name != "serving":
            sub.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
            sub.add_argument("--threads", type=int, help="torch threads (default: torch's; --quick: 1)")
            sub.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                             help="wall: elapsed time (on cuda, synchronised); cpu: the process's CPU time, fairer on "
                                  "a shared, loaded machine with --threads 1")
    attention, generation, serving, losses = subs.values()
    attention.add_argument("--contexts", type=int, nargs="+", help="tokens (default 512 2048 8192)")
    attention.add_argument("--attn", nargs="+", metavar="ATTN",
                           help="sparse attentions: sparsemax, entmax15, entmax_bisect:ALPHA, learned "
                                "(entmax_bisect with a learned alpha per head, from 1.3), sparse_softmax:TOP_K "
                                "(default sparsemax entmax15 entmax_bisect:1.3 learned)")
    attention.add_argument("--passes", nargs="+", choices=["call", "train", "prefill", "decode"],
                           help="one attention call (forward), a training step (forward + backward of a 4-layer "
                                "SmolLM2-shaped model), a prefill and a decoding step (default: all four)")
    attention.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    attention.add_argument("--memory", action="store_true",
                           help="also the training step's peak memory, each attention in a fresh process (slower: each "
                                "imports torch and compiles its kernels again)")
    attention.add_argument("--model", choices=["smollm2", "random"],
                           help="prefill / decode: the pretrained SmolLM2-135M-Instruct (default where its offline "
                                "asset is installed) or SmolLM2's shape with random weights; smollm2 named: the "
                                "training step's model too (default: 4 layers, random weights)")
    generation.add_argument("--context", type=int, help="cached tokens (default 8192)")
    generation.add_argument("--tokens", type=int, help="decoding steps a variant (default 8)")
    generation.add_argument("--attn", nargs="+", metavar="ATTN",
                            help="sdpa and sparse attentions, named as for `bench attention` (default sdpa "
                                 "sparsemax entmax15)")
    generation.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    generation.add_argument("--model", choices=["smollm2", "random"], help="as for `bench attention`")
    serving.add_argument("--prompt-tokens", type=int, nargs="+",
                         help="prompt lengths (default 0: short prompts of a few tokens; past 8192 the rope is "
                              "interpolated in both folders)")
    serving.add_argument("--new-tokens", type=int, help="tokens each request decodes (default 64)")
    serving.add_argument("--batch", type=int, nargs="+", help="requests at once (default 8)")
    serving.add_argument("--attn", default="entmax15", help="the sparse folder's attention (default entmax15)")
    serving.add_argument("--folder", help="time this saved folder (sparse attention, e.g. a converted variant's "
                                          "merged <variant>/serve) against its softmax twin instead of --attn")
    serving.add_argument("--sampling", action="store_true",
                         help="the sampling processors' cost instead (requests sampling each loss's distribution "
                              "against requests that opt out; default file runs/bench/serving-sampling.json)")
    losses.add_argument("--vocab", type=int, help="vocabulary of the rows (default 49152, SmolLM2's)")
    losses.add_argument("--tokens", type=int, help="rows of logits (default 4096)")
    losses.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line (``--help`` and usage errors exit here, exit code 0 / 2); what follows ``--``
    goes to ``vllm serve`` as ``vllm_args``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command_line = ["hf-sparsemax", *argv]
    argv, vllm_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = build_parser(loss_names() if "decoding-report" in argv else None).parse_args(argv)
    args.vllm_args = vllm_args
    args.command_line = command_line  # as typed (a benchmark's JSON file records it)
    return args


def main(argv: list[str] | None = None) -> int:
    """The ``hf-sparsemax`` console script: parse, then import the package and run the command."""
    args = parse(argv)
    from hf_sparsemax.app.cli import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
