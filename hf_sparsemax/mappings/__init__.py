"""Sparse probability mappings: one implementation each, shared by attention, losses and decoding."""

from .entmax import entmax15, entmax_bisect
from .perturb import perturb_max
from .sparse_softmax import sparse_softmax
from .sparsemax import sparsemax
from .taylor import taylor_softmax

__all__ = ["entmax15", "entmax_bisect", "perturb_max", "sparse_softmax", "sparsemax", "taylor_softmax"]
