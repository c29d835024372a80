"""Hosted notebooks (tools/hosted.py): the install cell's logic, run offline. Where course_lib imports, the cell does
nothing (no installer is called); where the import fails, it runs the installer (recorded here, never run) with the
course's repository and the packages the notebooks need, then imports the course; a failed install is an error the
learner sees, not a silent pass. The README's links and the package lists are in step with their sources."""

import json
import re
import subprocess
import sys
import tomllib

import pytest

import course_lib
from tools import hosted as H

README = H.ROOT / "README.md"


def run_cell(source: str) -> dict:
    ns: dict = {}
    exec(compile(source, "<install cell>", "exec"), ns)
    return ns


@pytest.fixture
def installer(monkeypatch):
    """Records every command the cell would run; `succeeds` decides whether the course imports afterwards."""
    calls: list[list[str]] = []
    state = {"succeeds": True}

    def check_call(cmd, *args, **kwargs):
        calls.append(list(cmd))
        if state["succeeds"] and len(calls) == 2:  # both pip commands ran: the course is now importable
            sys.modules["course_lib"] = course_lib
        return 0

    monkeypatch.setattr(subprocess, "check_call", check_call)
    state["calls"] = calls
    return state


def test_where_the_course_imports_the_cell_does_nothing(installer):
    ns = run_cell(H.install_cell())
    assert installer["calls"] == [] and "course_lib" not in ns  # imported, and the name left to the notebook's cells


def test_where_the_import_fails_it_installs_the_course_then_imports_it(installer, monkeypatch):
    monkeypatch.setitem(sys.modules, "course_lib", None)  # `import course_lib` now raises ImportError
    run_cell(H.install_cell("me/course", "dev"))  # raises ImportError unless it imported the course after pip
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    assert installer["calls"] == [
        pip + ["--no-deps", "course_lib @ git+https://github.com/me/course@dev"],  # the service's torch is kept
        pip + list(H.RUNTIME_PACKAGES),
    ]
    assert sys.modules["course_lib"] is course_lib


def test_a_missing_dependency_of_an_installed_course_is_raised_not_installed_over(installer, monkeypatch):
    class MissingTiktoken:  # the course is found, but importing it fails on one of its dependencies
        def find_spec(self, name, path=None, target=None):
            if name == "course_lib":
                raise ModuleNotFoundError("No module named 'tiktoken'", name="tiktoken")

    monkeypatch.delitem(sys.modules, "course_lib")
    monkeypatch.setattr(sys, "meta_path", [MissingTiktoken(), *sys.meta_path])
    with pytest.raises(ModuleNotFoundError, match="tiktoken"):
        run_cell(H.install_cell())
    assert installer["calls"] == []


def test_an_install_that_leaves_the_course_missing_is_an_error(installer, monkeypatch):
    monkeypatch.setitem(sys.modules, "course_lib", None)
    installer["succeeds"] = False
    with pytest.raises(ImportError):
        run_cell(H.install_cell())
    assert len(installer["calls"]) == 2


def test_a_failed_pip_is_the_learners_error_to_read(monkeypatch):
    monkeypatch.setitem(sys.modules, "course_lib", None)

    def check_call(cmd, *args, **kwargs):
        raise subprocess.CalledProcessError(1, cmd)

    monkeypatch.setattr(subprocess, "check_call", check_call)
    with pytest.raises(subprocess.CalledProcessError):
        run_cell(H.install_cell())


def test_the_cell_is_short_and_touches_the_network_only_through_pip():
    src = H.install_cell()
    assert len(src.splitlines()) <= 18
    assert src.count("check_call") == 2 and src.count("https://") == 1 and "urllib" not in src


def test_the_runtime_packages_are_the_projects_dependencies_less_what_the_service_provides():
    deps = tomllib.loads((H.ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    name = lambda req: re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0]  # noqa: E731
    assert set(H.HOSTED_PROVIDES) <= {name(d) for d in deps}
    assert sorted(H.RUNTIME_PACKAGES) == sorted(d for d in deps if name(d) not in H.HOSTED_PROVIDES)


def test_the_readme_links_every_notebook_and_is_up_to_date():
    text = README.read_text()
    assert H.update_readme(text) == text, "run `python tools/hosted.py` (the README's links are stale)"
    for nb in sorted(p.name for p in (H.ROOT / "notebooks").glob("*.ipynb")):
        assert H.colab_url(nb) in text
    url = "https://colab.research.google.com/github/me/course/blob/main/notebooks/01_naive_loop.ipynb"
    assert H.colab_url("01_naive_loop.ipynb", "me/course") == url


def test_every_install_cell_in_the_notebooks_is_the_one_written_here():
    for nb in sorted((H.ROOT / "notebooks").glob("*.ipynb")):
        for source in H.install_cells(nb):
            assert source == H.install_cell(), f"{nb.name}: run `python tools/hosted.py`"
        cells = json.loads(nb.read_text())["cells"]
        tagged = [i for i, c in enumerate(cells) if H.TAG in c.get("metadata", {}).get("tags", [])]
        assert tagged == [1], f"{nb.name}: the install cell is the first code cell, right after the title"
