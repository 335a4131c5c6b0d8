"""Griffe extension for the API reference: the docstrings' Sphinx roles as Markdown.

The docstrings write cross-references the Sphinx way (``:func:`~hf_sparsemax.patch_model```), which Markdown
would show verbatim. A public name of the package (``hf_sparsemax.<name in __all__>`` or the bare name, each
rendered in the reference) becomes a link to where it is defined, which the strict build checks; any other target becomes
inline code.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:func|meth|class|mod|data|attr|exc|obj):`(~?)([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        linked = {f"{pkg.path}.{name}": definition(pkg, name) for name in (pkg.exports or ())}

        def replace(match: re.Match) -> str:
            short, target = match.group(1) == "~", match.group(2)
            shown = target.rsplit(".", 1)[-1] if short else target.lstrip(".")
            target = target if target in linked else f"{pkg.path}.{target}"  # a bare public name, `patch_model`
            return f"[`{shown}`][{linked[target]}]" if target in linked else f"`{shown}`"

        def visit(obj: griffe.Object) -> None:
            if obj.docstring is not None:
                obj.docstring.value = ROLE.sub(replace, obj.docstring.value)
            for member in obj.members.values():
                if not member.is_alias:
                    visit(member)

        visit(pkg)


def definition(pkg: griffe.Module, name: str) -> str:
    """Where ``pkg.<name>`` is defined. ``hf_sparsemax.sparsemax`` names the function that
    ``hf_sparsemax.mappings`` imports over its submodule of the same name, which griffe resolves to the module."""
    target = pkg.members[name]
    target = target.final_target if target.is_alias else target
    if target.is_module and name in target.members:
        target = target.members[name]
        target = target.final_target if target.is_alias else target
    return target.path
