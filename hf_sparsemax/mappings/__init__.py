"""Sparse probability mappings: one implementation each, shared by attention, losses and decoding."""

from .budget import budget_bisect
from .entmax import entmax15, entmax_bisect, sparsemax_bisect
from .normmax import normmax_bisect
from .perturb import perturb_max
from .sparse_softmax import sparse_softmax
from .sparsemax import sparsemax
from .taylor import taylor_softmax

__all__ = ["budget_bisect", "entmax15", "entmax_bisect", "normmax_bisect", "perturb_max", "sparse_softmax",
           "sparsemax", "sparsemax_bisect", "taylor_softmax"]
