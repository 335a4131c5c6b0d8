"""hf_sparsemax: sparse attention, sparse training losses and matching decoding for transformers."""

from .mappings import entmax15, entmax_bisect, sparse_softmax, sparsemax, taylor_softmax

__version__ = "0.1.0"

__all__ = ["entmax15", "entmax_bisect", "sparse_softmax", "sparsemax", "taylor_softmax"]
