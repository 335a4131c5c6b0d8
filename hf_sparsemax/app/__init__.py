"""The recipe app: YAML recipes, data, training runs, reports, benchmarks and the ``hf-sparsemax`` command.

The top layer: it may import any part of the library, and no library module imports it (a test checks
this). The shipped recipes (``recipes/*.yaml`` at the checkout's top level, the data package
``hf_sparsemax.app.recipes`` once installed) are package data, so ``hf-sparsemax compare default`` works
after a plain ``pip install``.
"""
