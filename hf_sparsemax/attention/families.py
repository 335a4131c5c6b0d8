"""Which model families the sparse attention serves, decided from transformers' source before anything runs.

A family is served when its attention modules call transformers' attention interface (the rule transformers
applies before it switches an implementation) and pass the function they get from it only arguments the sparse
attention reproduces (:data:`KNOWN_ARGUMENTS`). Those arguments are read from the source of each attention
module's ``forward``: the keywords of its call to what ``ALL_ATTENTION_FUNCTIONS.get_interface`` returned. So
``patch_model`` refuses an argument it cannot reproduce (DeepSeek-V3.2's ``indices``, say) in one ``ValueError``
naming it, with the model untouched, instead of the first forward failing. :func:`supported_families` applies
the same reading to the modeling files of the installed transformers, so the list is computed, never kept by hand.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
import re
import textwrap

from torch import nn

from .interface import HARMLESS_KWARGS, INTERFACE_NAME, READ_KWARGS, attention_modules, sparse_attention_forward

KNOWN_ARGUMENTS = (frozenset(inspect.signature(sparse_attention_forward).parameters) - {"mapping", "kwargs"}
                   ) | HARMLESS_KWARGS | READ_KWARGS  # what the sparse attention applies, or may ignore
ATTENTION_NAMES = frozenset({"softmax", "_softmax", "logsumexp", "scaled_dot_product_attention", INTERFACE_NAME})
DELEGATES = re.compile(r"\bAutoModel\w*\.from_config\(")  # a wrapper whose attention is a sub-model's (Fuyu)
POSITIONAL = 5  # module, query, key, value, attention_mask: arguments past these must be passed by keyword


def mentions(tree: ast.AST, name: str) -> bool:
    """Whether the syntax tree uses the name ``name``."""
    return any(isinstance(node, ast.Name) and node.id == name for node in ast.walk(tree))


def interface_arguments(function: ast.AST) -> frozenset[str]:
    """The keywords ``function`` passes to the attention function it gets from transformers' interface (a
    positional argument past the attention mask is named ``positional argument N``: never reproduced)."""
    names = set()
    for node in ast.walk(function):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if mentions(node.value, INTERFACE_NAME):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(target.id for target in targets if isinstance(target, ast.Name))
    passed = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            passed.update(keyword.arg for keyword in node.keywords if keyword.arg)
            passed.update(f"positional argument {i + 1}" for i in range(POSITIONAL, len(node.args)))
    return frozenset(passed)


@functools.lru_cache(maxsize=None)
def class_arguments(module_type: type) -> frozenset[str]:
    """The arguments an attention module class passes to its attention function (none where its source cannot be
    read: a class made at run time; the forward then refuses an unknown argument, :func:`.interface.check_kwargs`)."""
    forward = inspect.unwrap(module_type.forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return interface_arguments(tree)


@functools.lru_cache(maxsize=None)
def source_names(path: str) -> frozenset[str]:
    """Every name and attribute a Python file uses."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    return frozenset(node.attr if isinstance(node, ast.Attribute) else node.id
                     for node in ast.walk(tree) if isinstance(node, (ast.Attribute, ast.Name)))


def computes_attention(model: nn.Module) -> bool:
    """Whether any transformers module of ``model`` comes from a file that computes an attention softmax."""
    paths = {inspect.getsourcefile(type(module)) for module in model.modules()
             if type(module).__module__.startswith("transformers.")}
    return any(path and source_names(path) & ATTENTION_NAMES for path in paths)


def refusal(family: str, owner: str, reason: str) -> ValueError:
    return ValueError(f"the {family!r} family ({owner}) {reason}, so its attention cannot be swapped; "
                      "hf_sparsemax.supported_families() lists the families that work (the loss can still be swapped)")


FOUND_BY_THE_SWEEP = {  # model type -> why the family sweep (tests/test_family_sweep.py, transformers 5.24) refuses it
    "git": "hard-codes the softmax of its text decoder's self-attention (GitSelfAttention; only its vision encoder "
           "calls transformers' attention interface), so a swap would leave its text attention as it was",
}
NO_ATTENTION = "has no attention (no attention softmax in any of its modules: a state-space or recurrent model)"
HARD_CODED = "hard-codes its attention softmax instead of calling transformers' attention interface"


def unknown_reason(unknown: dict[str, str]) -> str:
    names = ", ".join(f"{name!r} ({owner})" for name, owner in sorted(unknown.items()))
    return f"passes {names} to its attention function, which the sparse attention cannot reproduce"


def check_supported(model: nn.Module) -> list[nn.Module]:
    """The model's attention modules, or one ``ValueError`` naming why its attention cannot be swapped: it has
    none, it hard-codes its softmax, or it passes its attention function arguments this library does not apply."""
    modules = attention_modules(model)
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if not modules or (can_set is not None and not can_set()):
        raise refusal(family, type(model).__name__, HARD_CODED if computes_attention(model) else NO_ATTENTION)
    if family in FOUND_BY_THE_SWEEP:
        raise refusal(family, type(model).__name__, FOUND_BY_THE_SWEEP[family])
    unknown = {}
    for module_type in dict.fromkeys(type(module) for module in modules):
        for name in class_arguments(module_type) - KNOWN_ARGUMENTS:
            unknown.setdefault(name, module_type.__name__)
    if unknown:
        raise refusal(family, type(model).__name__, unknown_reason(unknown))
    return modules


def interface_classes(code: str) -> list[ast.ClassDef]:
    """The top-level classes of a Python file that mention the interface (each class parsed alone: fast)."""
    if INTERFACE_NAME not in code:
        return []
    classes = []
    try:
        for chunk in re.split(r"^(?=class )", code, flags=re.M)[1:]:
            if INTERFACE_NAME in chunk:
                chunk = re.split(r"^\S(?!lass )", chunk, maxsplit=1, flags=re.M)[0]  # up to the next top-level line
                classes.append(ast.parse(chunk).body[0])
    except SyntaxError:  # a class cut short (a header over several lines, a string at column 0): the whole file
        return [node for node in ast.parse(code).body if isinstance(node, ast.ClassDef)]
    return classes


@functools.lru_cache(maxsize=None)
def file_verdict(path: str) -> str | None:
    """Why the modeling file at ``path`` cannot be served (None: it can), read as :func:`check_supported` reads a
    model: its attention classes (a ``forward`` that calls the interface) and the arguments they pass."""
    with open(path, encoding="utf-8") as handle:
        code = handle.read()
    unknown, routed = {}, False
    for node in interface_classes(code):
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "forward" and mentions(item, INTERFACE_NAME):
                routed = True
                for name in interface_arguments(item) - KNOWN_ARGUMENTS:
                    unknown.setdefault(name, node.name)
    hard_coded = re.search(r"^class \w*Attention\w*\(nn\.Module\):", code, re.M) and f"{INTERFACE_NAME}.get_interface(" not in code
    if unknown:
        return unknown_reason(unknown)
    if routed and not hard_coded:
        return None
    if not routed and not source_names(path) & ATTENTION_NAMES:
        return None if DELEGATES.search(code) else NO_ATTENTION
    return HARD_CODED


def family_files(model_type: str) -> list[str]:
    """The modeling files of a model type's base model and causal-LM classes in the installed transformers."""
    import transformers
    from transformers.models.auto import modeling_auto

    where = getattr(transformers, "_class_to_module", {})
    root = os.path.dirname(importlib.import_module("transformers").__file__)
    files = []
    for mapping in (modeling_auto.MODEL_MAPPING_NAMES, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        names = mapping.get(model_type, ())
        for name in (names,) if isinstance(names, str) else names:
            module = where.get(name)
            path = module and os.path.join(root, *module.split(".")) + ".py"
            if path and os.path.exists(path) and path not in files:
                files.append(path)
    return files


def family_verdict(model_type: str) -> str | None:
    """Why ``patch_model(attn=...)`` refuses a model type of the installed transformers (None: it serves it)."""
    if model_type in FOUND_BY_THE_SWEEP:
        return FOUND_BY_THE_SWEEP[model_type]
    files = family_files(model_type)
    if not files:
        return "has no modeling file in the installed transformers"
    return next((reason for reason in map(file_verdict, files) if reason is not None), None)


@functools.lru_cache(maxsize=1)
def supported_families() -> tuple[str, ...]:
    """Model types (``config.model_type``) of the installed transformers whose attention the sparse attentions
    serve: read from their modeling files (nothing imported) by the rules ``patch_model`` applies to a model."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return tuple(sorted(model_type for model_type in CONFIG_MAPPING_NAMES if family_verdict(model_type) is None))
