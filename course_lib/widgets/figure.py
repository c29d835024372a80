"""The panel's figure, made from the results alone: `draw(results, plots)` is a matplotlib Figure (no pyplot, no
widget), `FigureView` shows it as PNG bytes in one persistent ipywidgets.Image, replaced on every redraw.

Why an Image and not a figure displayed into an Output widget: from the Run button's callback that came out blank or
half drawn in JupyterLab (tests/test_browser.py).
"""

from __future__ import annotations

from typing import Sequence

import ipywidgets as W
from matplotlib.figure import Figure

from ..plots import PlotSpec, figure_png, plot_results
from ..results import RunResult


def draw(results: Sequence[RunResult], plots: Sequence[PlotSpec] = ("speed", "memory")) -> Figure | None:
    """One panel of the figure per entry of `plots` (a name of course_lib.plots.PLOTS or fn(results, ax)) with every
    run in it; None before the first run."""
    return plot_results(list(results), tuple(plots)) if results else None


class FigureView:
    """The figure of `results` in an Image widget (`image`), hidden before the first run; `last`: the Figure shown."""

    def __init__(self, plots: Sequence[PlotSpec] = ("speed", "memory")):
        self.plots = tuple(plots)
        self.last: Figure | None = None
        self.image = W.Image(
            format="png", layout=W.Layout(display="none", align_self="flex-start", max_width="100%", height="auto")
        )
        self.image.add_class("course-plots")  # a stable hook for the browser test

    def show(self, results: Sequence[RunResult]) -> None:
        self.show_figure(draw(results, self.plots))  # a Figure outside pyplot: nothing to close

    def show_figure(self, fig: Figure | None) -> None:
        """Show `fig` (None: hide the image until there is one)."""
        self.last = fig
        if fig is None:
            self.image.layout.display = "none"
            return
        self.image.value = figure_png(fig)
        self.image.layout.display = None
