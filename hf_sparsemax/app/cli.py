"""The ``hf-sparsemax`` command: run fine-tuning recipes, and check decoding against training.

    hf-sparsemax compare default                         # 5 variants side by side -> runs/default/report.md
    hf-sparsemax compare default --seeds 0,1,2           # each variant once per seed: mean ± std in the report
    hf-sparsemax train default --variant entmax15_loss --set training.max_steps=20
    hf-sparsemax evaluate default --variant entmax15_loss  # held-out metrics of runs/default/entmax15_loss
    hf-sparsemax generate default --variant entmax15_loss --set 'eval.prompts=["Murphy says"]'
    hf-sparsemax decoding-report --loss sparse_softmax --loss-option top_k=10 --prompt "Once upon a time"
    hf-sparsemax serve default --variant entmax15_loss    # vLLM's OpenAI server on 127.0.0.1:8000 (needs vLLM)
    hf-sparsemax build-kernels                            # the CPU attention kernel, built now into its cache

A recipe is a YAML file (or the name of a recipe shipped with the package:
default, classify). Override any field with --set PATH=VALUE (repeatable): PATH is the
dotted field (training.max_steps, data.block_size, lora.r, eval.prompts,
variants.entmax15_loss.loss_options.alpha), VALUE is read as YAML (20, 5e-4, true,
null, [q_proj, v_proj]). `training` is passed to transformers.TrainingArguments,
`lora` to peft.LoraConfig (null: full fine-tuning). Results go to
--output (default runs/<recipe name>), written to a .partial folder first and
renamed when complete; --resume continues an interrupted run from its last
checkpoint. One run per output folder at a time (a second is refused at once,
naming the other's pid). Bad input exits with code 2 and one line saying what
to fix, before any model loads where it can be checked without one.
Distributed: accelerate launch --num_processes 2 -m hf_sparsemax.app.cli train ...
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys


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


def load_model(spec: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import assets

    if spec is None:
        return assets.load_smollm2()
    if spec.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(spec))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name), tokenizer
    return AutoModelForCausalLM.from_pretrained(spec), AutoTokenizer.from_pretrained(spec)


def decoding_report_command(args) -> int:
    from ..decoding.generation import decoding_report
    from ..patch import patch_model

    from ..settings import SparseSettings

    from .extras import offline_gguf, require

    options = dict(args.loss_option)
    SparseSettings(loss=args.loss, loss_options=options)  # bad names or options fail before the model loads
    if offline_gguf(args.model):
        require(["gguf"], "the offline SmolLM2 model (a GGUF file)" if args.model is None else f"{args.model!r}")
    model, tokenizer = load_model(args.model)
    if args.loss:
        patch_model(model, loss=args.loss, loss_options=options)
    decode = dict(args.decode_option)
    report = decoding_report(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                             matched=not decode, seed=args.seed, **decode)
    report.pop("per_token")
    print(json.dumps(report, indent=2))
    return 0


RECIPE_COMMANDS = {
    "train": "fine-tune one variant of a recipe, evaluate it on the held-out split and sample from it",
    "evaluate": "held-out metrics of a trained variant",
    "generate": "matched sampling from a trained variant (eval.prompts)",
    "compare": "train, evaluate and sample every variant; write a report folder",
}


def parse_seeds(text: str) -> list[int]:
    """``--seeds 0,1,2`` -> ``[0, 1, 2]`` (checked further as the recipe field ``seeds``)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 0,1,2, got {text!r}") from None


def add_recipe_command(commands, name: str) -> None:
    sub = commands.add_parser(name, help=RECIPE_COMMANDS[name], description=RECIPE_COMMANDS[name])
    sub.add_argument("recipe", help="recipe YAML file, or the name of a shipped recipe (default, classify)")
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


def recipe_command(args) -> int:
    from .extras import offline_gguf, require
    from .recipes import load_recipe

    require(["datasets", *(["matplotlib"] if args.command == "compare" else [])], f"hf-sparsemax {args.command}")
    seeds = getattr(args, "seeds", None)
    recipe = load_recipe(args.recipe, args.overrides + ([f"seeds={seeds}"] if seeds is not None else []))
    if offline_gguf(recipe.model):
        require(["gguf"], f"the model {recipe.model!r} (a GGUF file)", extra="recipes")
    from . import commands

    if args.command == "compare":
        out = commands.compare_command(recipe, args.output, args.resume)
        runs = f" x {len(recipe.seeds)} seeds" if recipe.seeds is not None else ""
        summary(f"compared {len(out['results'])} variants{runs} of {recipe.name!r} in {out['seconds'] / 60:.1f} min",
                out)
        return 0
    if args.command == "train":
        out = commands.train_command(recipe, args.variant, args.output, args.resume)
        final = "none logged (max_steps < logging_steps)" if out["final_loss"] is None else f"{out['final_loss']:.4f}"
        summary(f"trained {out['variant']!r} ({out['steps']} steps, {out['seconds']:.0f} s), final loss "
                f"{final}, held-out {headline(out)}; saved in {out['folder']}", None)
    elif args.command == "evaluate":
        out = commands.evaluate_command(recipe, args.variant, args.output)
        print(json.dumps(out, indent=2, default=str))
        summary(f"evaluated {out['variant']!r}: {headline(out)}", None)
    else:
        out = commands.generate_command(recipe, args.variant, args.output)
        for prompt, text in zip(out["prompts"], out["texts"]):
            print(f"{prompt}{text}\n---")
        summary(f"sampled {out['sample_tokens']} tokens from {out['variant']!r} with matched decoding; "
                f"share of zero-probability tokens drawn: {out['sample_zero_prob_share']:.3f}", None)
    return 0


def serve_cli(args) -> int:
    from .recipes import load_recipe
    from .serve import serve_command

    recipe = load_recipe(args.recipe, args.overrides)
    command = serve_command(recipe, args.variant, args.output, args.port, args.vllm_args, args.dry_run)
    print(" ".join(command))  # --dry-run: the command; else not reached (the server replaced this process)
    return 0


def headline(out: dict) -> str:
    if "macro_f1" in out:
        return f"accuracy {out['accuracy']:.3f}, macro-F1 {out['macro_f1']:.3f}"
    return (f"epsilon-perplexity {out['epsilon_perplexity']:.2f}, cross-entropy {out['cross_entropy']:.3f}, "
            f"sparsemax score {out['sparsemax_score']:.4f}, zero-prob share {out['zero_prob_share']:.3f}")


def summary(text: str, compared: dict | None) -> None:
    """The one line that ends a run (only the main process prints it)."""
    from .commands import is_main_process

    if not is_main_process():
        return
    if compared is not None:
        rows = compared["results"]
        key, best = ("macro_f1", max) if "macro_f1" in rows[0] else ("epsilon_perplexity", min)
        winner = best(rows, key=lambda r: r[key])
        text += (f"; best {key.replace('_', '-')}: {winner['variant']} ({winner[key]:.3f}); "
                 f"report: {os.path.join(compared['folder'], 'report.md')}")
    print(f"hf-sparsemax: {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    from ..mappings import registry

    parser = OneLineParser(prog="hf-sparsemax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in RECIPE_COMMANDS:
        add_recipe_command(commands, name)
    report = commands.add_parser("decoding-report", help="how far sampling strays from the trained distribution")
    report.add_argument("--model", help="model id, folder or .gguf file (default: offline SmolLM2-135M-Instruct)")
    report.add_argument("--loss", help="the training loss whose distribution decoding should match: one of "
                        + ", ".join(["cross_entropy", *registry.names("processor")]))
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
    serve.add_argument("recipe", help="recipe YAML file, or the name of a shipped recipe")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    serve.add_argument("--output", help="results folder the variant was trained into (default runs/<recipe name>)")
    serve.add_argument("--variant", help="which of the recipe's variants (default: the first)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dry-run", action="store_true", help="prepare the folder and print the vllm command")
    commands.add_parser("build-kernels", help="build the CPU attention kernel now (container images, read-only "
                        "homes)", description="Build the CPU attention kernel now into $HF_SPARSEMAX_CACHE "
                        "(default ~/.cache/hf_sparsemax), so that later processes load it.")
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args = argv[argv.index("--") + 1:] if "--" in argv else []  # serve: what follows -- goes to vllm serve
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.vllm_args = vllm_args
    try:
        if args.command in RECIPE_COMMANDS:
            return recipe_command(args)
        if args.command == "serve":
            return serve_cli(args)
        if args.command == "build-kernels":
            from ..attention.cpu import fused

            return fused.main([])
        return decoding_report_command(args)
    except (ValueError, FileNotFoundError, OSError) as error:
        print(f"hf-sparsemax: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the lock is released and unfinished work removed or kept for --resume
        print("hf-sparsemax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
