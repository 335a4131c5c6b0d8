"""Shared fixtures, and the Hypothesis profiles.

Hypothesis profiles: CI replays a fixed search (derandomized, so a submission that changed nothing cannot turn
red by chance); a developer's run keeps searching randomly and prints the reproducing blob of any failure.

``HYPOTHESIS_PROFILE=dev`` or ``=ci`` picks one explicitly; otherwise ``CI`` in the environment picks "ci".
``HYPOTHESIS_EXAMPLES`` sets the examples per property (default 60).
"""

import os

import pytest
import torch

# Without a GPU the Triton kernels' tests run under Triton's interpreter, which must be chosen before triton is first
# imported (torch's compiler imports it below): triton's own reductions are jit functions decorated at import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

from hf_sparsemax.mappings import compiled  # noqa: E402

settings.register_profile(
    "dev", max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", "60")), deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile("ci", parent=settings.get_profile("dev"), derandomize=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))

# Under pytest-xdist (`-n auto`, the README's command) each worker process takes its share of the cores: torch's
# default of every core in every worker would oversubscribe them (threads spinning against each other).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture
def compiled_kernels(monkeypatch):
    """The compiled threshold kernels on inputs of every size, traced with ``aot_eager`` (no C++ build: cheap in CI),
    from a fresh compiler (dynamo's recompile count per function is global: other tests' shapes must not use up
    this test's). Yields the names of the functions run compiled, in order."""
    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    monkeypatch.setattr(compiled, "_failed", [])
    monkeypatch.delenv(compiled.ENVIRONMENT, raising=False)
    calls = []
    original = compiled.run
    monkeypatch.setattr(compiled, "run", lambda fn, *args, **kw: calls.append(fn.__name__) or original(fn, *args, **kw))
    torch._dynamo.reset()
    compiled.compiled.cache_clear()
    yield calls
    torch._dynamo.reset()
    compiled.compiled.cache_clear()
