"""Every panel and re-run box of every notebook is pressed in the tests, and must draw a figure with no error.

How: notebooks/conftest.py adds one step after each notebook's last cell, run by nbval in the notebook's own kernel,
that clicks every Run button the notebook made (ipywidgets' Button.click, as a browser's click does) through
course_lib.widgets.pressing.check_all. The panels pressed are the notebook's own, built by its own cells, at the
controls the notebook left them at. CI runs it at COURSE_BUDGET=smoke; a learner's budget is the notebook run with
COURSE_BUDGET unset (each panel then costs what a learner's press costs: minutes for some):

    COURSE_BUDGET=smoke python -m pytest -q notebooks/08_model_parallelism.ipynb     # as CI
    COURSE_BUDGET=full python -m pytest -q notebooks/08_model_parallelism.ipynb      # as a learner

(tests/time_as_learner.py times a notebook that way, its panels pressed twice.) This file tests the pressing itself,
and that every notebook gets the step."""

import os
import subprocess
import sys
from pathlib import Path

import ipywidgets as W
import pytest
from matplotlib.figure import Figure

from course_lib.widgets import Panel, Rerun, pressing

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _figure():
    fig = Figure()
    fig.subplots().plot([0, 1], [0, 1])
    return fig


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(pressing, "MADE", [])


def test_a_press_of_every_button_says_what_each_drew_and_fails_on_an_error(tiny):
    panel = Panel(tiny(steps=3, timing_warmup=1), controls=("steps",), title="a panel")
    fine = Rerun(lambda n: (n, _figure()), "a box", n=W.IntSlider(value=2))
    broken = Rerun(lambda n: (_ for _ in ()).throw(ValueError("no such n")), "a broken box", n=W.IntSlider(value=1))
    assert pressing.live() == [panel, fine, broken]
    with pytest.raises(AssertionError, match="a broken box: drew NO figure.*ValueError: no such n"):
        pressing.check_all()
    presses = pressing.press_all()
    assert [p.ok for p in presses] == [True, True, False] and panel.results[-1].ok and fine.results == [2, 2]


def test_a_panel_whose_run_fails_is_a_failed_press(tiny):
    def runner(cfg, label, callback):
        raise RuntimeError("the launch died")

    Panel(tiny(), controls=("steps",), runner=runner, title="failing")
    (press,) = pressing.press_all()
    assert not press.ok and "RuntimeError: the launch died" in press.error


def test_no_button_at_all_is_a_failure_not_a_pass():
    with pytest.raises(AssertionError, match="nothing to press"):
        pressing.check_all()


def test_the_first_press_shows_the_notebooks_own_run_and_the_second_trains(tiny):
    panel = Panel(tiny(steps=3, timing_warmup=1), controls=("precision", "steps"))
    first = panel.run(label="run by the notebook")
    assert panel.press() == "" and panel.results == [first] and "measured above" in panel.status.value
    assert panel.last_figure is not None
    assert panel.press() == "" and len(panel.results) == 2  # a second press trains anew
    panel.set(steps=4)
    fresh = Panel(tiny(steps=3, timing_warmup=1), controls=("precision", "steps"))
    fresh.results.extend(panel.results)  # runs of another configuration: the first press trains
    fresh.set(steps=5)
    assert fresh.press() == "" and len(fresh.results) == 3 and fresh.results[-1].config["steps"] == 5


def test_pressing_a_box_that_shows_the_notebooks_run_presses_again_so_that_its_own_run_is_tested():
    calls = []

    def run(m):
        calls.append(m)
        raise RuntimeError("the launch asks for too few steps")

    box = Rerun(run, "a box", m=W.Dropdown(options=[2, 4], value=4)).show("measured", _figure(), m=4)
    (press,) = pressing.press_all()
    assert calls == [4] and not press.ok and "too few steps" in press.error and box.results == ["measured"]
    assert pressing.press_all(until_it_runs=False)[0].error  # its first press is spent: this one runs too
    fresh = Rerun(lambda m: (m, _figure()), "b", m=W.Dropdown(options=[2, 4], value=4)).show("measured", _figure(), m=4)
    assert pressing.press(fresh, until_it_runs=False).ok and fresh.results == ["measured"]  # a learner's first press


def test_a_rerun_box_shows_the_notebooks_run_first_then_runs(tiny):
    calls = []

    def run(m):
        calls.append(m)
        return m, _figure()

    box = Rerun(run, "a box", m=W.Dropdown(options=[2, 4], value=4)).show("measured", _figure(), m=4)
    assert box.press() == "" and calls == [] and box.results == ["measured"] and box.figure.last is not None
    assert box.press() == "" and calls == [4]
    box.controls["m"].value = 2
    assert box.press() == "" and calls == [4, 2]


def test_the_pipeline_asks_for_the_steps_its_run_can_time(tiny):
    from course_lib.distributed import pipeline as P
    from course_lib.widgets import fewest_steps

    for warmup in (0, 1, 2, 3):
        cfg = tiny(timing_warmup=warmup, measure_memory=True)
        # the pipeline's run is `steps` + its memory step: exactly the loop's own fewest on a CPU with the ledger
        assert P.fewest_steps(cfg) + 1 == fewest_steps(cfg)
        P.check_steps(P.fewest_steps(cfg), cfg)
        with pytest.raises(ValueError, match=f'raise "steps" to at least {warmup + 1}'):
            P.check_steps(P.fewest_steps(cfg) - 1, cfg)


def test_every_notebook_gets_its_buttons_pressed_after_its_last_cell():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *map(str, NOTEBOOKS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "COURSE_FILL_EXERCISES": "1"},  # CI's first pass (its second presses nothing more)
    )
    ids = [line for line in proc.stdout.splitlines() if ".ipynb::" in line]
    for nb in NOTEBOOKS:
        mine = [i for i in ids if i.startswith(f"notebooks/{nb.name}::")]
        assert mine and mine[-1] == f"notebooks/{nb.name}::Press every Run button", (nb.name, mine[-3:])
