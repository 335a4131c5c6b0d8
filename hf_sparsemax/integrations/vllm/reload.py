"""Weights copied into a running vLLM CPU engine whose GEMMs packed them: TRL's colocated rollouts (needs vLLM).

After loading, vLLM's CPU build hands each linear layer to a GEMM library that keeps its own packed copy of the
weight (oneDNN on AVX-512 machines, AMX kernels, zentorch): the layer's ``weight`` becomes an empty parameter
without a weight loader, and the LM head (and a tied embedding) computes with a packed copy of its weight. A later
``model.load_weights(...)``, which TRL's colocate mode calls before each rollout to copy the trained weights into
vLLM (``sync_weights``), then fails (``AttributeError: 'Parameter' object has no attribute 'weight_loader'``), and
a weight it could load (the head's) would not reach the packed copy. On AVX2 machines vLLM computes with the
weights themselves, and nothing of this applies.

:func:`keep_loadable` (run by :func:`hf_sparsemax.integrations.vllm.plugin.register` after vLLM's CPU model runner
loads a model whose weights were packed) makes those calls vLLM's own in-place reload
(``vllm.model_executor.model_loader.reload``): the first ``load_weights`` after loading opens it (every layer back
to its checkpoint shapes; a layer is loaded, processed and packed again as soon as all its weights arrived), and the
model's next forward closes it (layers that got no weight keep their tensors; a head tied to a reloaded embedding is
packed again from it). A layer that got only part of its weights cannot be packed (its other weights live only in
the packed copy): closing refuses it with a ``ValueError`` naming the layer.
"""

from __future__ import annotations

import functools

import torch

SESSION = "_hf_sparsemax_reload_open"  # on the model: a reload opened by load_weights, closed by the next forward
INSTALLED = "_hf_sparsemax_keeps_loadable"


def packed_modules(model: torch.nn.Module) -> list[str]:
    """Names of the layers whose weight vLLM's CPU GEMM dispatch dropped (packed into the GEMM library's copy)."""
    return [name for name, module in model.named_modules()
            if hasattr(module, "cpu_linear") and isinstance(getattr(module, "weight", None), torch.Tensor)
            and module.weight.numel() == 0]


def keep_loadable(model: torch.nn.Module, vllm_config) -> bool:
    """Make ``model.load_weights`` after loading reload in place (see the module docstring); True when installed
    (a model with packed weights), False when its weights load as they are. ``vllm_config``: the engine's."""
    packed = frozenset(packed_modules(model))
    if getattr(model, INSTALLED, False) or not packed:
        return False
    load = model.load_weights

    @functools.wraps(load)
    def load_weights(weights):
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(vllm_config):
            if not getattr(model, SESSION, False):
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(model)
                setattr(model, SESSION, True)
            return load(weights)

    model.load_weights = load_weights
    model.register_forward_pre_hook(lambda module, args: close(module, vllm_config, packed))
    setattr(model, INSTALLED, True)
    return True


@torch.no_grad()
def close(model: torch.nn.Module, vllm_config, packed: frozenset[str]) -> None:
    """Finish an open reload: refuse partly loaded ``packed`` layers, give the others back, repack tied heads."""
    if not getattr(model, SESSION, False):
        return
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    setattr(model, SESSION, False)
    for name, module in model.named_modules():
        info = get_layerwise_info(module)
        if name in packed and info.can_load() and 0 < info.load_numel < (info.load_numel_total or 0):
            raise ValueError(f"{name}: {info.load_numel} of its {info.load_numel_total} weights were loaded into "
                             "this running vLLM engine, whose CPU GEMM keeps the layer's weights only in its packed "
                             "copy: load all of a layer's weights at once (as TRL's weight sync does)")
    with torch.inference_mode(False), set_current_vllm_config(vllm_config):
        finalize_layerwise_reload(model, vllm_config.model_config)
        repack_tied(model)


def repack_tied(model: torch.nn.Module) -> None:
    """Pack again the layers that share their weight with another layer (an LM head tied to the embedding): vLLM's
    reload processes one of them only, and the other's packed copy would keep the old weight."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.numel() > 0:
            owners.setdefault(weight.data_ptr(), []).append(module)
    for modules in owners.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)


def patch_cpu_model_runner() -> None:
    """Run :func:`keep_loadable` after vLLM's CPU model runner loads a model (idempotent; the runner's class method
    wrapped once, in the process that calls this)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    load_model = CPUModelRunner.load_model
    if getattr(load_model, INSTALLED, False):
        return

    @functools.wraps(load_model)
    def load_and_keep_loadable(self, *args, **kwargs):
        load_model(self, *args, **kwargs)
        keep_loadable(self.model, self.vllm_config)

    setattr(load_and_keep_loadable, INSTALLED, True)
    CPUModelRunner.load_model = load_and_keep_loadable
