"""Print a pip constraints file pinning every requirement of pyproject.toml to its lower bound.

    python .ci/lower_bounds.py [EXTRA ...] > constraints.txt

Reads ``[project] dependencies`` and the named optional-dependency groups; each ``name>=X`` becomes
``name==X`` (an environment marker, ``name>=X; platform_system == 'Linux'``, is kept). A requirement without a ``>=`` bound is an error: every bound in pyproject.toml is meant to be
one the lower-bounds CI stage (``.ci/lower-bounds``) installs and tests.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*>=\s*([0-9][0-9a-zA-Z.]*)\s*(;.*)?$")


def pins(requirements: list[str]) -> dict[str, str]:
    """``{name: version and marker}`` of each requirement's lower bound."""
    found = {}
    for requirement in requirements:
        match = REQUIREMENT.match(requirement)
        if match is None:
            raise SystemExit(f"lower_bounds: {requirement!r} is not of the form 'name>=version'")
        name, version = match.group(1).lower().replace("_", "-"), match.group(2) + (match.group(3) or "").rstrip()
        if found.setdefault(name, version) != version:
            raise SystemExit(f"lower_bounds: {name} has two lower bounds, {found[name]} and {version}")
    return found


def main(extras: list[str]) -> None:
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    groups = project.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(groups))
    if unknown:
        raise SystemExit(f"lower_bounds: no extras {unknown} in pyproject.toml; it has {sorted(groups)}")
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += groups[extra]
    for name, version in sorted(pins(requirements).items()):
        print(f"{name}=={version}")


if __name__ == "__main__":
    main(sys.argv[1:])
