"""Serving a saved hf_sparsemax folder with the decoding it was trained for.

:mod:`.decoding` (torch only): what each request samples and the batched logits step;
:mod:`.vllm_plugin`: vLLM's plugins (imported by vLLM, needs vLLM); :mod:`.model_card`: the README
written beside a saved folder, saying how to serve it.
"""
