"""The notebooks as files: committed without outputs, and their code free of what pyflakes finds. nbval runs every
cell, but on a CPU it never runs a notebook's GPU branches (`if DEVICE == "cuda": ...`): a misspelt name there would
first fail on a learner's GPU. pyflakes reads every line, run or not."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def code_of(notebook: Path) -> str:
    """The notebook's code cells as one module, in order (a line of IPython magic, % or !, is not Python: left out)."""
    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    lines = []
    for cell in cells:
        lines += [line for line in "".join(cell["source"]).splitlines() if not line.lstrip().startswith(("%", "!"))]
        lines.append("")
    return "\n".join(lines) + "\n"


def test_there_are_nine_notebooks():
    assert [n.name[:2] for n in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07", "08", "09"]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda n: n.name[:2])
def test_committed_without_outputs(notebook):
    for i, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, f"{notebook.name} cell {i} holds outputs"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda n: n.name[:2])
def test_valid_nbformat_with_an_id_on_every_cell(notebook):
    """nbformat 4.5 gives every cell an id (a cell added by hand without one is only a warning in today's nbformat,
    and an error in a later one); the ids are unique."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    nbformat.validate(nb)
    ids = [cell.get("id") for cell in json.loads(notebook.read_text())["cells"]]
    assert all(ids) and len(set(ids)) == len(ids), [i for i, x in enumerate(ids) if not x]


def test_every_notebooks_code_passes_pyflakes(tmp_path, pyflakes, monkeypatch):
    monkeypatch.setenv("PYFLAKES_BUILTINS", "display")  # a name IPython gives every kernel
    files = []
    for notebook in NOTEBOOKS:
        files.append(tmp_path / f"{notebook.stem}.py")
        files[-1].write_text(code_of(notebook))
    assert pyflakes(*files) == ""
