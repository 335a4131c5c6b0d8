"""Every ```python block of README.md and docs/ runs as a test (sybil); ```bash and ```text blocks do not.

A ```python block that starts with ``>>>`` is a doctest: what a page shows as an output is compared with
what the code prints (whitespace runs compare equal, so a long output may wrap). Outputs that depend on a
random model or on sampling are not shown as values; the page says so.

The blocks of one page run in order in one namespace, as a reader would paste them one after the other, so a
page loads a model once and its later examples use it. Each page runs in a temporary folder of its own (what
an example saves, `model.save_pretrained("out")`, lands there). The examples use the offline assets and tiny
models built from a config, never a download. What a page made is dropped when it ends, so that one page's
models never stay in memory during the next.
"""

import doctest
import gc
import os
import tempfile

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser


def setup(namespace):
    namespace["_docs_cwd"] = os.getcwd()
    namespace["_docs_tmp"] = tempfile.TemporaryDirectory(prefix="hf-sparsemax-docs-")
    os.chdir(namespace["_docs_tmp"].name)


def teardown(namespace):
    os.chdir(namespace["_docs_cwd"])
    namespace["_docs_tmp"].cleanup()
    namespace.clear()  # the page's models go now, not when the session ends
    gc.collect()


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(doctest_optionflags=doctest.NORMALIZE_WHITESPACE)],
    patterns=["README.md", "docs/*.md"],
    setup=setup,
    teardown=teardown,
).pytest()
