"""Hypothesis profiles: CI replays a fixed search (derandomized, so a submission that changed nothing cannot turn
red by chance); a developer's run keeps searching randomly and prints the reproducing blob of any failure.

``HYPOTHESIS_PROFILE=dev`` or ``=ci`` picks one explicitly; otherwise ``CI`` in the environment picks "ci".
``HYPOTHESIS_EXAMPLES`` sets the examples per property (default 60).
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "dev", max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", "60")), deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile("ci", parent=settings.get_profile("dev"), derandomize=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))
