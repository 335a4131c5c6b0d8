"""The offline SmolLM2-135M-Instruct as a float32 transformers model that saves as a plain folder (shared by the
vLLM tests)."""

import torch


def float32_smollm2():
    """``(model, tokenizer)``: the GGUF's dequantized weights in float32, without transformers' quantizer marks."""
    from hf_sparsemax.app.assets import load_smollm2

    model, tokenizer = load_smollm2(dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer
