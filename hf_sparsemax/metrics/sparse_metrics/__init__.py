"""The ``evaluate`` module of :mod:`hf_sparsemax.metrics`, shipped as package data and loaded by path.

``evaluate.load`` copies ``sparse_metrics.py`` on its own, so that file imports the library by its absolute
name (:mod:`hf_sparsemax.metrics`) and nothing else of it.
"""
