"""``hf-sparsemax bench``: the library against its reference, on the user's machine, one module a subcommand.

``attention`` (sparse attention against sdpa), ``generation`` (whole-model decoding on each cache), ``serving``
(vLLM, sparse folder against its softmax twin), ``losses`` (mappings and losses against softmax /
cross-entropy); :mod:`.timing` holds what they share (clock, interleaved medians, the machine's description,
the table and the JSON file). The parser is the console module's (``hf_sparsemax_cli``), which imports none of
this; these modules may import any part of the library, as the rest of the app does.
"""

from __future__ import annotations

import importlib


def run(args) -> int:
    """Run ``hf-sparsemax bench <args.bench>`` (parsed by the console script); torch's thread count (``--threads``)
    is given back after, for a caller that goes on in the same process."""
    import torch

    module = importlib.import_module(f"{__name__}.{args.bench}")
    threads = torch.get_num_threads()
    try:
        module.run(args)
    finally:
        torch.set_num_threads(threads)
    return 0
