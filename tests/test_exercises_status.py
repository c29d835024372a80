"""`python -m course_lib exercises --status`: a learner's progress read from notebooks on disk. A temporary notebook
holds a solved, an unsolved and a broken exercise cell (and one whose answer hangs); each gets its row, and nothing
the cells run besides their definitions is executed."""

import json
import os
import re

import pytest

from course_lib import __main__ as cli, exercises as X
from course_lib.exercises import status as S


def cell(source: str, tags=("exercise",)) -> dict:
    return {
        "cell_type": "code",
        "execution_count": None,
        "id": f"c{abs(hash(source)) % 10**8}",
        "metadata": {"tags": list(tags)},
        "outputs": [],
        "source": source.splitlines(keepends=True),
    }


def notebook(path, *cells) -> None:
    path.write_text(json.dumps({"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))


IMPORTS = cell("import math\nimport statistics\n\nimport torch\n\nfrom course_lib import exercises\n", tags=())

SOLVED = '''
def step_time(times, warmup):
    """The median of the timed steps."""
    return statistics.median(times[warmup:])


step_time = exercises.attempt("step_time", step_time)
open(MARK, "w").write("the attempt line ran")  # only the definitions may run
'''

UNSOLVED_STUB = '''
def adamw_step(p, g, m, v, t, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    """Your code."""
    raise NotImplementedError
'''

WRONG = """
def warmup_cosine(step, lr, warmup, total, min_lr_ratio=0.1):
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - 1 - warmup)
    return 0.5 * lr * (1 + math.cos(math.pi * progress))  # decays to zero
"""

BROKEN = """
def step_loss(micro_batches):
    return sum(loss for loss in micro_batches
"""


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    folder = tmp_path_factory.mktemp("learner") / "notebooks"
    folder.mkdir()
    mark = folder.parent / "ran-the-cell"
    notebook(folder / "01_naive_loop.ipynb", IMPORTS, cell(f"MARK = {str(mark)!r}\n" + SOLVED))
    notebook(folder / "05_algorithmic_hyperparameters.ipynb", IMPORTS, cell(UNSOLVED_STUB), cell(WRONG))
    notebook(folder / "06_gradient_accumulation.ipynb", IMPORTS, cell(BROKEN))
    return folder, {r.exercise: r for r in S.progress(folder)}


def test_solved_unsolved_wrong_and_broken_cells_each_get_their_row(learner):
    folder, rows = learner
    assert rows["step_time"].status == S.SOLVED and "solved" in rows["step_time"].message
    # a stub: not yet, although the tests' switch (conftest) is on here: it does not reach the check
    assert os.environ.get("COURSE_FILL_EXERCISES") == "1"
    assert rows["adamw_step"].status == S.NOT_YET and "not solved yet" in rows["adamw_step"].message
    # a wrong answer: not yet, with the checker's hint on one line
    assert rows["warmup_cosine"].status == S.NOT_YET and "min_lr_ratio * lr" in rows["warmup_cosine"].message
    assert "\n" not in rows["warmup_cosine"].message
    assert rows["step_loss"].status == S.ERROR and "does not parse" in rows["step_loss"].message
    assert not (folder.parent / "ran-the-cell").exists()  # the attempt line and the write were not executed
    # every exercise of the notebooks in the folder has its row (04 is not in the folder); those without a cell here:
    expected = {ex.name for ex in X.EXERCISES.values() if ex.notebook in ("01", "05", "06")}
    assert set(rows) == expected
    for name in expected - {"step_time", "adamw_step", "warmup_cosine", "step_loss"}:
        assert rows[name].status == S.ERROR and "no cell tagged 'exercise'" in rows[name].message


def test_a_missing_cell_an_endless_loop_and_a_crash_are_rows(tmp_path):
    folder = tmp_path / "nb"
    folder.mkdir()
    hang = "def adamw_step(p, g, m, v, t, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):\n    while True:\n" + (
        "        pass\n"
    )
    crash = "import os\n\ndef warmup_cosine(step, lr, warmup, total, min_lr_ratio=0.1):\n    os._exit(3)\n"
    notebook(folder / "05_x.ipynb", IMPORTS, cell(hang), cell(crash))
    notebook(folder / "01_x.ipynb", IMPORTS, cell("def step_time(times, warmup):\n    return 0.0\n", tags=()))
    rows = {r.exercise: r for r in S.progress(folder, timeout=15)}
    assert rows["adamw_step"].status == S.ERROR and "timed out" in rows["adamw_step"].message
    assert rows["warmup_cosine"].status == S.ERROR and "exit code 3" in rows["warmup_cosine"].message
    assert rows["step_time"].status == S.ERROR and "no cell tagged 'exercise'" in rows["step_time"].message


def test_only_the_imports_the_cell_uses_are_executed(tmp_path):
    path = tmp_path / "01_x.ipynb"
    imports = cell("import statistics\nimport this_module_does_not_exist\n", tags=())
    notebook(path, imports, cell("def step_time(times, warmup):\n    return statistics.median(times[warmup:])\n"))
    (job,), _ = S.jobs_of(path)  # (the other exercises of notebook 01 have no cell here)
    assert job["exercise"] == "step_time" and job["imports"] == ["import statistics"]


def test_the_cli_prints_the_table(learner, capsys):
    folder, _ = learner
    assert cli.main(["exercises", "--status", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "01_naive_loop.ipynb" in out and re.search(r"^1 of \d+ exercises solved$", out, re.M)
    assert cli.main(["exercises", "--status", str(folder / "nowhere")]) == 2


@pytest.mark.parametrize("text", ["[]", '{"cells": [1]}', "{not json"], ids=["a list", "a cell not a dict", "not json"])
def test_a_file_that_is_not_a_notebook_is_one_error_row_per_exercise(tmp_path, text):
    """A notebook saved as something else (an editor's accident): its exercises are error rows, the others still
    checked, and the count still says how many exercises there are."""
    folder = tmp_path / "nb"
    folder.mkdir()
    (folder / "01_naive_loop.ipynb").write_text(text)
    notebook(folder / "05_x.ipynb", IMPORTS)
    rows = S.progress(folder, timeout=15)
    of_01 = [r for r in rows if r.notebook == "01_naive_loop.ipynb"]
    assert [r.exercise for r in of_01] == [ex.name for ex in X.EXERCISES.values() if ex.notebook == "01"]
    assert all(r.status == S.ERROR and "cannot read the notebook" in r.message for r in of_01)
    total = sum(ex.notebook in ("01", "05") for ex in X.EXERCISES.values())
    assert S.table(rows).endswith(f"0 of {total} exercises solved")
