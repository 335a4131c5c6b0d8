"""Every ```python block of README.md and docs/ runs as a test (sybil); ```bash and ```text blocks do not.

The blocks of one page run in order in one namespace, as a reader would paste them one after the other, so a
page loads a model once and its later examples use it. Each page runs in a temporary folder of its own (what
an example saves, `model.save_pretrained("out")`, lands there) with Hugging Face's hub switched off: the
examples use the offline assets and tiny models built from a config, never a download.
"""

import os
import tempfile

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser


def setup(namespace):
    namespace["_docs_cwd"] = os.getcwd()
    namespace["_docs_env"] = {name: os.environ.get(name) for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    namespace["_docs_tmp"] = tempfile.TemporaryDirectory(prefix="hf-sparsemax-docs-")
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    os.chdir(namespace["_docs_tmp"].name)


def teardown(namespace):
    os.chdir(namespace["_docs_cwd"])
    for name, value in namespace["_docs_env"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    namespace["_docs_tmp"].cleanup()


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser()],
    patterns=["README.md", "docs/*.md"],
    setup=setup,
    teardown=teardown,
).pytest()
