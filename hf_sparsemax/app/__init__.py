"""The recipe app: YAML recipes, data, training runs, reports and the ``hf-sparsemax`` command.

It sits above the library (``hf_sparsemax``): it imports the library's public
functions, and no library module imports it (a test checks this). The shipped
recipes (``recipes/*.yaml`` beside this file) are package data, so
``hf-sparsemax compare default`` works after a plain ``pip install``.
"""
