"""vLLM: serving a saved hf_sparsemax folder with the decoding it was trained for, and TRL's vLLM rollouts.

:mod:`.plugin`: vLLM's plugins (imported by vLLM, needs vLLM >= 0.31, :mod:`.versions`), adapting the
engine-neutral step of :mod:`hf_sparsemax.decoding.engine`; :mod:`.reload`: weights copied into a running CPU
engine whose GEMMs packed them (TRL's colocate weight sync); :mod:`.rollouts` (torch only): TRL's online
trainers with vLLM rollouts (``use_vllm=True``) sample the trained distribution, through
:func:`vllm_generation_kwargs`, or are refused.
"""

from .rollouts import vllm_generation_kwargs

__all__ = ["vllm_generation_kwargs"]
