"""widgets.Rerun: each click runs the measurement with the controls' values, keeps its result outside the widgets and
shows its figure; an error is one line and the results so far stay."""

import ipywidgets as W
from matplotlib.figure import Figure

from course_lib.widgets import Rerun


def _figure(x):
    fig = Figure()
    fig.subplots().plot([0, 1], [0, x])
    return fig


def test_each_run_keeps_its_result_and_shows_its_figure_and_an_error_loses_nothing():
    calls = []

    def run(scale, label):
        calls.append((scale, label))
        if scale < 0:
            raise ValueError("scale must be >= 0")
        return {"scale": scale, "label": label}, _figure(scale)

    box = Rerun(run, "a sweep", scale=W.IntSlider(value=2, min=-1, max=5), label=W.Dropdown(options=["a", "b"]))
    assert box.figure.image.layout.display == "none" and box.results == []
    assert box.run() == {"scale": 2, "label": "a"}
    first = box.figure.image.value
    assert first[:4] == b"\x89PNG" and box.figure.image.layout.display is None and "run 1" in box.status.value
    box.controls["scale"].value, box.controls["label"].value = -1, "b"
    assert box.run() is None
    assert "ValueError: scale must be &gt;= 0" in box.status.value and not box.button.disabled
    assert box.results == [{"scale": 2, "label": "a"}] and box.figure.image.value == first  # nothing lost
    box.controls["scale"].value = 4
    box.run()
    assert len(box.results) == 2 and box.figure.image.value != first and calls[-1] == (4, "b")
