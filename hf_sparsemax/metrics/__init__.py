"""Metrics for sparse models, where perplexity can be infinite (see :mod:`.sparse_text`).

:mod:`.sparse_text`: per-token statistics, their summary and ``Trainer`` metrics; ``sparse_metrics/``: the
same as an ``evaluate`` module, loaded by path (``evaluate.load(hf_sparsemax.metrics.METRIC_PATH)``).
Imports :mod:`hf_sparsemax.mappings` only.
"""

from .sparse_text import METRIC_PATH, STATS, outside_support_mass, summarize, token_stats, trainer_metrics

__all__ = ["METRIC_PATH", "STATS", "outside_support_mass", "summarize", "token_stats", "trainer_metrics"]
