"""Every notebook's Run buttons pressed in its tests: after a notebook's last cell, nbval runs one more step in the same
kernel that clicks each panel's and re-run box's Run button (course_lib.widgets.pressing.check_all) and fails unless
each drew a figure with no error. It runs at the budget in force: COURSE_BUDGET=smoke in CI, a learner's own size with
COURSE_BUDGET unset (tests/test_panels_pressed.py says how). With COURSE_FILL_EXERCISES=0 (CI's second pass over the
notebooks, exercises unsolved) the step is left out: the first pass pressed every button."""

import os
from collections import defaultdict

import pytest

PRESS_NAME = "Press every Run button"
PRESS_SOURCE = "from course_lib.widgets import pressing\n\n_ = pressing.check_all()"


@pytest.hookimpl(tryfirst=True)  # before the root conftest's, which marks and orders the items by their file
def pytest_collection_modifyitems(config, items):
    if os.environ.get("COURSE_FILL_EXERCISES") == "0":
        return  # CI's second pass (exercises unsolved) presses nothing more: the first pass pressed every button
    import nbformat
    from nbval.plugin import IPyNbCell, IPyNbFile

    last = {}  # a notebook file -> the index of its last cell's item
    for i, item in enumerate(items):
        if isinstance(item, IPyNbCell) and isinstance(item.parent, IPyNbFile):
            last[item.parent] = i
    for parent, i in sorted(last.items(), key=lambda kv: -kv[1]):  # from the end: earlier indices stay valid
        press = IPyNbCell.from_parent(
            parent,
            name=PRESS_NAME,
            cell_num=items[i].cell_num + 1,
            cell=nbformat.v4.new_code_cell(PRESS_SOURCE),
            options=defaultdict(bool, check=False),
        )
        items.insert(i + 1, press)
