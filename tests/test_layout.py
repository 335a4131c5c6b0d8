"""The package's layout: its parts are layers (no import runs back up, none circles), the library never imports the
app, and the shipped recipes survive a real install."""

import ast
import os
import subprocess
import sys

import pytest

import hf_sparsemax

PACKAGE = os.path.dirname(hf_sparsemax.__file__)
ROOT = os.path.dirname(PACKAGE)


def imported_modules(path, top_level_only=False, package=None):
    """Absolute names of the hf_sparsemax modules a file imports (relative imports resolved).

    ``top_level_only``: only the imports run when the module is imported (not those inside functions);
    ``package``: the file's package (default: from its place under the checkout).
    """
    package = package or os.path.relpath(os.path.dirname(path), ROOT).replace(os.sep, ".")
    tree = ast.parse(open(path).read())
    names = set()
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return {n for n in names if n.startswith("hf_sparsemax")}


def library_files():
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d not in ("app", "__pycache__")]
        yield from (os.path.join(folder, f) for f in files if f.endswith(".py"))


def test_imported_modules_resolves_relative_imports(tmp_path):
    app_module = os.path.join(PACKAGE, "app", "runner.py")
    assert "hf_sparsemax.patch" in imported_modules(app_module)
    assert "hf_sparsemax.app.recipes" in imported_modules(app_module)
    plugin = os.path.join(PACKAGE, "integrations", "vllm", "plugin.py")
    assert "hf_sparsemax.decoding.engine" in imported_modules(plugin)  # three levels up, then down


def test_no_library_module_imports_the_app():
    offenders = {os.path.relpath(path, ROOT): sorted(n for n in imported_modules(path) if n.startswith("hf_sparsemax.app"))
                 for path in library_files()}
    assert {path: names for path, names in offenders.items() if names} == {}


@pytest.mark.slow
def test_named_recipes_work_from_a_built_wheel(tmp_path):
    """A non-editable install (the built wheel, not this checkout) still finds `default` and `classify` by name,
    and ships the fused attention kernel's C source (built on first use)."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), ROOT],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("hf_sparsemax-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of any editable install of the checkout
    script = ("import hf_sparsemax, os; from hf_sparsemax.app.recipes import load_recipe; "
              "from hf_sparsemax.attention.cpu import kernel_build; "
              "print(os.path.dirname(hf_sparsemax.__file__)); "
              "print(load_recipe('default').name, load_recipe('classify').name, os.path.exists(kernel_build.SOURCE))")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    installed, names = done.stdout.strip().splitlines()
    assert installed == str(site / "hf_sparsemax") and names == "default classify True"  # the kernel's C source too
    command = subprocess.run([sys.executable, str(site / "bin" / "hf-sparsemax"), "compare", "--help"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=300)
    assert command.returncode == 0 and "shipped recipe" in command.stdout, command.stderr[-2000:]
    assert "(classify, convert, convert_long, default)" in " ".join(command.stdout.split())  # the wheel's own


def module_name(path):
    name = os.path.relpath(path, ROOT).removesuffix(".py").replace(os.sep, ".")
    return name.removesuffix(".__init__")


def shipped_modules():
    """Module name -> file of every module the wheel ships: the package's, and the top-level modules beside it
    (pyproject's ``py-modules``: the console script's parser)."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        top_level = tomllib.load(handle)["tool"]["setuptools"].get("py-modules", [])
    modules = {module_name(os.path.join(folder, f)): os.path.join(folder, f)
               for folder, _, files in os.walk(PACKAGE) for f in files if f.endswith(".py")}
    modules.update({name: os.path.join(ROOT, f"{name}.py") for name in top_level})
    return modules


def import_cycles(modules, package_inits=frozenset({"hf_sparsemax"})):
    """Each module that an import chain (lazy imports inside functions too) leads back to, with the chain."""
    graph = {name: {m for m in imported_modules(path, package=None if "." in name else name)
                    if m in modules and m != name and m not in package_inits}
             for name, path in modules.items()}

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return trail + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
        return None

    return [c for name in sorted(modules) if name not in package_inits and (c := cycle_from(name))]


def test_library_modules_import_no_cycle():
    """No cycle among the package's imports (the app's included) and the top-level modules it ships (the console
    script's parser imports the app to run a command; nothing in the package imports it back), lazy ones (inside
    functions) too.

    Sub-package ``__init__`` files (``mappings``, ``swaps``) are modules like any other, so an import through
    one counts; only the top-level ``hf_sparsemax/__init__.py`` (the public names, which import everything) is
    left out.
    """
    modules = shipped_modules()
    assert "hf_sparsemax_cli" in modules and "hf_sparsemax.app.bench.attention" in modules
    assert import_cycles(modules) == []


def test_the_cycle_check_sees_the_package_importing_the_console(tmp_path):
    """The check above can fail: an app module that imports the console script's parser (which imports the app's
    command runner) closes a circle."""
    probe = tmp_path / "probe.py"
    probe.write_text("def names():\n    from hf_sparsemax_cli import RECIPE_COMMANDS\n    return RECIPE_COMMANDS\n")
    modules = shipped_modules()
    modules["hf_sparsemax.app.cli"] = str(probe)  # stands in for the command runner
    (cycle,) = {tuple(c) for c in import_cycles(modules) if c[0] == "hf_sparsemax_cli"}
    assert cycle == ("hf_sparsemax_cli", "hf_sparsemax.app.cli", "hf_sparsemax_cli")


def test_every_package_ships_and_the_recipes_have_one_copy_at_the_top_level():
    """pyproject.toml lists the packages by hand (the recipes need a package-dir mapping): a new sub-package
    missing from the list would be left out of the wheel. The recipes live once, in ``recipes/``."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        setuptools = tomllib.load(handle)["tool"]["setuptools"]
    on_disk = {os.path.relpath(folder, ROOT).replace(os.sep, ".") for folder, _, files in os.walk(PACKAGE)
               if "__init__.py" in files}
    assert set(setuptools["packages"]) == on_disk | {"hf_sparsemax.app.recipes"}
    assert setuptools["package-dir"] == {"hf_sparsemax.app.recipes": "recipes"}
    assert sorted(f for f in os.listdir(os.path.join(ROOT, "recipes")) if f.endswith(".yaml")) == [
        "classify.yaml", "convert.yaml", "convert_long.yaml", "default.yaml"]
    assert not os.path.exists(os.path.join(PACKAGE, "app", "recipes"))


# The parts of the package, lowest first: a module imports its own part and lower layers only (lazy imports
# included). Parts on one layer import none of each other. The root's modules are parts of their own.
LAYERS = [
    {"mappings", "_model"},  # the maths: mappings, their losses, row and compiled kernels, the registry
    {"attention", "losses", "metrics"},  # what each swap point computes
    {"settings"},  # the choices a user made, validated against the registry and the attention options
    {"decoding"},  # sampling what the loss trained (reads the settings and the losses)
    {"swaps"},  # plan / apply / remove per swap point
    {"integrations", "conversion"},  # Trainer, TRL, peft, reload, vLLM; converting a softmax model (schedule, distillation)
    {"patch"},  # patch_model: the library's swaps, then the engines'
    {"app"},  # recipes and the command line
]
LAYER_OF = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def part_of(module):
    """``hf_sparsemax.attention.blocked.blocks`` -> ``attention``; ``hf_sparsemax.patch`` -> ``patch``."""
    return module.split(".")[1]


def test_every_part_of_the_package_has_a_layer_and_the_root_holds_few_modules():
    entries = {name.removesuffix(".py") for name in os.listdir(PACKAGE) if name != "__init__.py" and (
        name.endswith(".py") or os.path.exists(os.path.join(PACKAGE, name, "__init__.py")))}
    assert entries == set(LAYER_OF)
    assert sorted(name for name in os.listdir(PACKAGE) if name.endswith(".py")) == [
        "__init__.py", "_model.py", "patch.py", "settings.py"]


def test_no_module_imports_a_part_above_its_own():
    """mappings <- attention / losses / metrics <- settings <- decoding <- swaps <- integrations <- patch <- app."""
    paths = [os.path.join(folder, f) for folder, dirs, files in os.walk(PACKAGE) for f in files if f.endswith(".py")]
    modules = {module_name(path) for path in paths} - {"hf_sparsemax"}  # the root's __init__: the public names
    upward = {}
    for path in paths:
        name = module_name(path)
        if name == "hf_sparsemax":
            continue
        part = part_of(name)
        bad = sorted(m for m in imported_modules(path) & modules
                     if part_of(m) != part and LAYER_OF[part_of(m)] >= LAYER_OF[part])
        if bad:
            upward[name] = bad
    assert upward == {}


def test_the_layer_check_sees_an_import_running_up(tmp_path):
    """The check above can fail: a lazy import of the swaps inside a mapping is found."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from ..swaps import LOSS\n    return LOSS\n")
    imported = imported_modules(str(path), package="hf_sparsemax.mappings")
    assert "hf_sparsemax.swaps" in imported
    assert LAYER_OF[part_of("hf_sparsemax.swaps")] > LAYER_OF[part_of("hf_sparsemax.mappings.probe")]


def test_each_folder_says_what_lives_there_and_what_it_may_import():
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if "__init__.py" in files and folder != PACKAGE:
            doc = ast.get_docstring(ast.parse(open(os.path.join(folder, "__init__.py")).read()))
            assert doc and len(doc.splitlines()) >= 2, folder


# Inside attention/: one folder per backend, lowest first; the modules at attention/'s top (the interface, the
# routing, the family check, the query scales) sit above them all.
ATTENTION_LAYERS = ["cpu", "blocked", "gpu", None]


def attention_layer(module):
    """``hf_sparsemax.attention.cpu.fused`` -> 0; ``hf_sparsemax.attention.interface`` -> 3."""
    parts = module.split(".")
    folder = parts[2] if len(parts) > 3 else None
    return ATTENTION_LAYERS.index(folder if folder in ATTENTION_LAYERS else None)


def test_attention_backends_import_downward_only():
    """cpu <- blocked <- gpu <- interface / routing / families: a backend never imports the one above it or the
    interface (lazy imports included), so each folder can be read with the ones below it only."""
    folder = os.path.join(PACKAGE, "attention")
    backends = sorted(d for d in os.listdir(folder) if os.path.exists(os.path.join(folder, d, "__init__.py")))
    assert backends == sorted(ATTENTION_LAYERS[:-1])
    upward = {}
    for root, dirs, files in os.walk(folder):
        for f in files:
            if not f.endswith(".py"):
                continue
            name = module_name(os.path.join(root, f))
            if name == "hf_sparsemax.attention":
                continue
            bad = sorted(m for m in imported_modules(os.path.join(root, f)) if m.startswith("hf_sparsemax.attention")
                         and m != "hf_sparsemax.attention" and attention_layer(m) > attention_layer(name))
            if bad:
                upward[name] = bad
    assert upward == {}
    assert attention_layer("hf_sparsemax.attention.gpu.triton_decode") > attention_layer(
        "hf_sparsemax.attention.blocked.decode") > attention_layer("hf_sparsemax.attention.cpu.fused")
