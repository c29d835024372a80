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


def shipped_results_shown_by_table_rows(source: str) -> list[str]:
    """The names of shipped results (the second item of `for path, results, meta in <load_reference's list>`) that
    the loop's body passes to table_rows, directly or through an expression (`accumulating or results`)."""
    import ast

    tree = ast.parse(source)
    shipped_lists = {  # names bound to load_reference(...)
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "attr", getattr(node.value.func, "id", "")) == "load_reference"
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    found = []
    for loop in (n for n in ast.walk(tree) if isinstance(n, ast.For)):
        over_shipped = isinstance(loop.iter, ast.Name) and loop.iter.id in shipped_lists
        if not (over_shipped and isinstance(loop.target, ast.Tuple)):
            continue
        results = loop.target.elts[1].id
        derived = {results} | {  # names computed from the shipped results inside the loop (a filtered list)
            t.id
            for n in ast.walk(loop)
            if isinstance(n, ast.Assign) and any(isinstance(x, ast.Name) and x.id == results for x in ast.walk(n.value))
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for call in (n for n in ast.walk(loop) if isinstance(n, ast.Call)):
            if getattr(call.func, "id", getattr(call.func, "attr", "")) == "table_rows":
                found += [x.id for a in call.args for x in ast.walk(a) if isinstance(x, ast.Name) and x.id in derived]
    return found


def test_the_shipped_results_check_finds_a_plain_table():
    source = (
        "refs = reference.load_reference()\n"
        "for path, res, meta in refs:\n"
        "    acc = [r for r in res if r.ok]\n"
        "    display(table_rows(acc or res))\n"
    )
    assert shipped_results_shown_by_table_rows(source) == ["acc", "res"]
    assert shipped_results_shown_by_table_rows(source.replace("table_rows", "ladder_rows")) == []


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda n: n.name[:2])
def test_a_shipped_ladder_is_shown_with_its_verdicts(notebook):
    """A shipped ladder's rungs were kept or not on their own device, timed in pairs: a plain table of tokens/s ratios
    (table_rows) would show a rung that was not kept there, e.g. the H200's 16-bit autocast, as a speed-up."""
    for i, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        source = "\n".join(
            line for line in "".join(cell["source"]).splitlines() if not line.lstrip().startswith(("%", "!"))
        )
        if cell["cell_type"] == "code" and "load_reference(" in source:
            assert shipped_results_shown_by_table_rows(source) == [], f"{notebook.name} cell {i}"
