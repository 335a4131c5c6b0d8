"""Serving a saved hf_sparsemax folder with the decoding it was trained for.

:mod:`.decoding` (torch only): what each request samples and the batched logits step;
:mod:`.vllm_plugin`: vLLM's plugins (imported by vLLM, needs vLLM); :mod:`.model_card`: the README
written beside a saved folder, saying how to serve it; :mod:`.rollouts` (torch only): TRL's online
trainers with vLLM rollouts (``use_vllm=True``) sample the trained distribution, through
:func:`vllm_generation_kwargs`, or are refused.
"""

from .rollouts import vllm_generation_kwargs

__all__ = ["vllm_generation_kwargs"]
