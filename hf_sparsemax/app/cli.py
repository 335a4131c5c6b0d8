"""The ``hf-sparsemax`` command's work: what each command does once its arguments are parsed.

The command line itself (its help, its parser, the console script's ``main``) is the top-level module
:mod:`hf_sparsemax_cli`, which imports nothing heavy, so that ``--help`` and argument errors answer at once;
its ``main`` parses, then calls :func:`run` here. The package never imports that module (the import graph keeps
one direction: console -> package), so ``python -m hf_sparsemax_cli`` is the command as a module
(``accelerate launch -m hf_sparsemax_cli train ...``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings

RECIPE_COMMANDS = ("train", "evaluate", "generate", "compare")  # the console's commands that run a recipe


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
        for line in compared.get("verdict", [])[2:]:  # the report's verdict, without its heading
            if line:
                print(line.replace("**", "").replace("`", ""), flush=True)
        rows = compared["results"]
        key, best = ("macro_f1", max) if "macro_f1" in rows[0] else ("epsilon_perplexity", min)
        winner = best(rows, key=lambda r: r[key])
        text += (f"; best {key.replace('_', '-')}: {winner['variant']} ({winner[key]:.3f}); "
                 f"report: {os.path.join(compared['folder'], 'report.md')}")
    print(f"hf-sparsemax: {text}", flush=True)


def run(args) -> int:
    """Run the parsed command (``hf_sparsemax_cli.parse``); bad input: one line on stderr, exit code 2.
    A warning is shown once per run, not once per variant (:func:`each_warning_once`)."""
    with each_warning_once():
        return run_command(args)


@contextlib.contextmanager
def each_warning_once():
    """Show each warning (same category, text and place) once while the block runs. The filter action "once"
    does not do this: CPython's C warnings keep its memory in the module's registry, which every
    ``warnings.catch_warnings`` in torch or transformers clears, so a transformers FutureWarning printed once per
    variant."""
    shown, show = set(), warnings.showwarning

    def once(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message), filename, lineno)
        if key not in shown:
            shown.add(key)
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = once
    try:
        yield
    finally:
        if warnings.showwarning is once:
            warnings.showwarning = show


def run_command(args) -> int:
    try:
        if args.command in RECIPE_COMMANDS:
            return recipe_command(args)
        if args.command == "serve":
            return serve_cli(args)
        if args.command == "bench":
            from . import bench

            return bench.run(args)
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
