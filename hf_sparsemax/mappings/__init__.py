"""The maths: each mapping once, its losses, its row solvers and compiled kernels, and the registry naming them.

One module per family (``sparsemax``, ``entmax``, ``normmax``, ``budget``, ``sparse_softmax``, ``taylor``,
``perturb``, ``margin``), their losses (``loss_functions``: Fenchel-Young and sparse softmax; ``likelihood``:
``-log p_t``), the shared conventions (``_core``), the row kernels (``_sync_free``, ``compiled``), the
registry every swap point reads (``registry``) and the ``nn.Module`` forms built from it (``modules``).
The lowest layer: it imports nothing else of hf_sparsemax.
"""

from .budget import budget_bisect
from .entmax import entmax15, entmax_bisect, sparsemax_bisect
from .normmax import normmax_bisect
from .perturb import perturb_max
from .sparse_softmax import sparse_softmax
from .sparsemax import sparsemax
from .taylor import taylor_softmax

__all__ = ["budget_bisect", "entmax15", "entmax_bisect", "normmax_bisect", "perturb_max", "sparse_softmax",
           "sparsemax", "sparsemax_bisect", "taylor_softmax"]
