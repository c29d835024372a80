"""`.ci/gpu` runs the course on a GPU machine, a few minutes at a time. The Python it runs is checked here against what
course_lib has, so that a renamed function costs a failed test on a CPU, not a GPU call."""

import ast
import importlib
import importlib.util
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
    """`from module import name`, as Python finds it: an attribute of the module, else its submodule."""
    parent = importlib.import_module(module)
    return getattr(parent, name) if hasattr(parent, name) else importlib.import_module(f"{module}.{name}")


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
    text = SCRIPT.read_text()
    assert len(python_snippets()) == text.count("<<") + text.count("$PY -c ") >= 8, "mend python_snippets()"


def course_lib_commands() -> list[tuple[str, list[str]]]:
    """(module and subcommand, its --options) for each `$PY -m course_lib...` line of the script."""
    found = re.findall(r"\$PY -m (course_lib\S*)( [a-z]+)?((?: [^\n;&|)]*)?)", SCRIPT.read_text())
    return [(module + sub, re.findall(r"(?<!\S)--[a-z][a-z-]*", rest)) for module, sub, rest in found]


@pytest.mark.parametrize("command, options", course_lib_commands())
def test_every_course_lib_command_and_option_the_script_runs_is_there(command, options):
    from course_lib.__main__ import build_parser

    module, _, sub = command.partition(" ")
    assert importlib.util.find_spec(module) is not None, module
    if module == "course_lib":
        accepted = build_parser()._subparsers._group_actions[0].choices[sub]._option_string_actions
        assert [o for o in options if o not in accepted] == []
    else:  # a lesson's own command line
        source = Path(importlib.util.find_spec(module).origin).read_text()
        assert [o for o in options if f'"{o}"' not in source] == []


def test_the_script_runs_each_course_lib_command_this_test_reads():
    commands = {c for c, _ in course_lib_commands()}
    assert {"course_lib ladder", "course_lib profile", "course_lib doctor"} <= commands, commands
    assert "course_lib.lessons.flash_attention_triton" in commands


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
