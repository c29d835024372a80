"""The front page and the documents around it: the README short with one figure that exists, a licence, the results
page and its figure generated from data/ and up to date, nothing in the documents about how the project was built,
and every notebook short enough to read."""

import json
import re
import tomllib
from pathlib import Path

import pytest

from tools import results_page as P

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README = 15_000  # characters: a front page read in five minutes
MAX_NOTEBOOK = 45_000  # characters of cell source per notebook


def documents() -> list[Path]:
    return [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def notebook_chars(path: Path) -> int:
    return sum(len("".join(c["source"])) for c in json.loads(path.read_text(encoding="utf-8"))["cells"])


def test_the_readme_is_a_front_page_with_one_figure_that_exists():
    text = README.read_text(encoding="utf-8")
    assert len(text) <= MAX_README, f"README.md has {len(text)} characters; at most {MAX_README}"
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text) + re.findall(r"<img\s[^>]*src=\"([^\"]+)\"", text)
    assert len(images) == 1, images
    assert (ROOT / images[0]).is_file(), images[0]
    assert images[0] == P.FIGURE.relative_to(ROOT).as_posix()  # the figure generated from data/


def test_the_readme_gives_the_learners_set_up_and_the_test_command():
    text = README.read_text(encoding="utf-8")
    learner = next(line for line in text.splitlines() if "python -m jupyterlab notebooks/" in line)
    assert "pip install -e ." in learner and "[test" not in learner  # a learner does not install the test tools
    assert 'pip install -e ".[test,kernels]"' in text and "python -m pytest -n 2" in text
    for command in ("info", "doctor", "ladder", "profile", "export"):
        assert f"python -m course_lib {command}" in text, command
    assert "course-lib" in text  # the console script, the same command line
    for link in ("docs/results.md", "docs/method.md", "docs/gpu.md", "docs/architecture.md", "LICENSE"):
        assert f"({link})" in text and (ROOT / link).is_file(), link


def test_the_readmes_table_is_the_generated_one():
    """The README's "what to expect" table is the results page's, written by the same command."""
    text = README.read_text(encoding="utf-8")
    assert P.readme_with_table(text) == text, f"the README's table is stale: run `{P.COMMAND}` and commit"
    assert "\n".join(P._expect_table()) in P.PAGE.read_text(encoding="utf-8")


def test_the_notebook_times_quoted_are_the_measured_ones():
    """The README's "time" column is the AVX2-only CPU's run, the teacher's guide gives every run: both from the data
    file, never typed in from elsewhere."""
    runs = {r["cpu"]: r for f in P.notebook_times() for r in f["runs"]}
    avx2 = runs["AVX2"]["seconds"]
    readme_rows = re.findall(r"^\| (\d\d) \| \[.*\| (\d+) s \|$", README.read_text(), re.MULTILINE)
    assert dict(readme_rows) == {nb: str(s) for nb, s in avx2.items()}
    guide = (ROOT / "docs" / "teachers_guide.md").read_text()
    guide_rows = re.findall(r"^\| (\d\d) \| [^|]+ \| (\d+) \| (\d+)[^|]* \|$", guide, re.MULTILINE)
    others = [r for cpu, r in runs.items() if cpu != "AVX2"]
    assert len(others) == 1 and len(guide_rows) == len(avx2)
    for nb, first, second in guide_rows:
        assert (int(first), int(second)) == (avx2[nb], others[0]["seconds"][nb]), nb


def test_a_notebooks_time_line_quotes_the_measured_run():
    """A notebook's "Time" line that cites the shipped run times gives its notebook's AVX2-only time from that file."""
    avx2 = next(r for f in P.notebook_times() for r in f["runs"] if r["cpu"] == "AVX2")["seconds"]
    citing = 0
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        first = "".join(json.loads(path.read_text(encoding="utf-8"))["cells"][0]["source"])
        line = next((ln for ln in first.splitlines() if ln.startswith("**Time:**")), "")
        if "data/measured/notebooks/" in line:
            citing += 1
            expected = rf"\*\*Time:\*\* {avx2[path.name[:2]]} s on a 2-core AVX2-only CPU"
            assert re.match(expected, line), (path.name, line)
    assert citing >= 2


def test_a_licence_is_present_and_declared():
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and "LICENSE" in project["license-files"]


def test_the_results_page_and_its_figure_are_up_to_date():
    assert P.PAGE.read_text(encoding="utf-8") == P.page(), f"data/ changed: run `{P.COMMAND}` and commit"
    assert P.png_source() == P.figure_source(), f"the figure is stale: run `{P.COMMAND}` and commit"


def test_the_results_page_shows_every_shipped_climb():
    page = P.page()
    for folder in (P.DATA_DIR / "measured", P.DATA_DIR / "reference"):
        for f in folder.glob("*.json"):
            assert f"`data/{f.relative_to(P.DATA_DIR).as_posix()}`" in page, f.name


def test_a_stale_results_page_is_named_and_rewritten(tmp_path, monkeypatch, capsys):
    page, figure = tmp_path / "results.md", tmp_path / "climbs.png"
    page.write_text(P.page().replace("## What to expect", "## What to expect (an old version)"))
    monkeypatch.setattr(P, "PAGE", page)
    monkeypatch.setattr(P, "FIGURE", figure)
    monkeypatch.setattr(P, "ROOT", tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"# A README\n\n{P.README_BEGIN}\n| an old table |\n{P.README_END}\n\nThe rest.\n")
    monkeypatch.setattr(P, "README", readme)
    assert P.main(["--check"]) == 1 and "results.md is out of date" in capsys.readouterr().err
    assert P.main([]) == 0 and P.main(["--check"]) == 0
    assert page.read_text() == P.page() and P.png_source(figure) == P.figure_source()
    assert "| an old table |" not in readme.read_text() and readme.read_text().endswith("\n\nThe rest.\n")
    with pytest.raises(ValueError, match="no block"):
        P.readme_with_table("# a README without the markers\n")


@pytest.mark.parametrize(
    "pattern, what",
    [
        (r"\blease", "the word lease"),
        (r"\b\d+ (passed|failed|skipped|xfailed|errors?)\b", "a test count (they live in CI's output)"),
        (r"(?<![\w&/])#\d+\b", "an issue number"),
        (r"/work/|\.\./shared|/tmp/bash_jobs", "a path outside the repository"),
    ],
)
def test_the_documents_speak_only_of_the_course(pattern, what):
    for path in documents():
        found = re.search(pattern, path.read_text(encoding="utf-8"), re.IGNORECASE)
        assert not found, f"{path.relative_to(ROOT)} has {what}: {found.group(0)!r}"


@pytest.mark.parametrize("notebook", sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")))
def test_every_notebook_is_short_enough_to_read(notebook):
    chars = notebook_chars(ROOT / "notebooks" / notebook)
    assert chars <= MAX_NOTEBOOK, f"{notebook}: {chars:,} characters of cell source; at most {MAX_NOTEBOOK:,}"
