"""`.ci/gpu` runs the course on a GPU machine, a few minutes at a time. The Python it runs is checked here against what
course_lib has, so that a renamed function costs a failed test on a CPU, not a GPU call."""

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from course_lib import capabilities

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "gpu"


def python_snippets() -> list[str]:
    """The script's Python: its here-documents and its `$PY -c` lines."""
    text = SCRIPT.read_text()
    heredocs = re.findall(r"<<'EOF'[^\n]*\n(.*?)\nEOF\n", text, re.S)
    return heredocs + [quoted[1:-1] for quoted in re.findall(r"\$PY -c ('[^']*'|\"[^\"]*\")", text)]


def resolve(module: str, name: str):
    """`from module import name`: a submodule, or an attribute of the module."""
    try:
        return importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
        return getattr(importlib.import_module(module), name)


def missing_names(snippet: str) -> list[str]:
    """Each name the snippet imports from course_lib, or reads off a course_lib module it imported, that is missing."""
    tree, modules, missing = ast.parse(snippet), {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib"):
            for alias in node.names:
                try:
                    found = resolve(node.module, alias.name)
                except (ImportError, AttributeError):
                    missing.append(f"{node.module}.{alias.name}")
                    continue
                if isinstance(found, ModuleType):
                    modules[alias.asname or alias.name] = found
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if not hasattr(modules[node.value.id], node.attr):
                missing.append(f"{modules[node.value.id].__name__}.{node.attr}")
    return missing


def test_the_script_has_the_python_this_test_reads():
    snippets = python_snippets()
    assert len(snippets) >= 8, "the patterns no longer find the script's Python: mend python_snippets()"
    assert sum("course_lib" in s for s in snippets) >= 4


@pytest.mark.parametrize("snippet", python_snippets(), ids=lambda s: s.strip().splitlines()[-1][:40])
def test_every_name_the_script_takes_from_course_lib_is_there(snippet):
    assert missing_names(snippet) == []


def test_a_name_course_lib_lacks_is_caught():
    assert missing_names("from course_lib.measure import no_such_function") == ["course_lib.measure.no_such_function"]
    assert missing_names("from course_lib import config as C\nC.no_such_preset('x')") == [
        "course_lib.config.no_such_preset"
    ]


def test_the_gpu_slug_names_this_device():
    env = dict(os.environ, DEVICE="cpu", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    run = subprocess.run(["bash", str(SCRIPT), "--do", "gpu_slug"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    slug, first_word = run.stdout.strip(), capabilities.device_name("cpu").split()[0].lower()
    assert re.fullmatch("[a-z0-9]+(-[a-z0-9]+)*", slug) and first_word in slug, (slug, first_word)
