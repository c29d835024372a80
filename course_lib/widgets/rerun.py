"""A small re-run box for a measurement that is not a training run (a kernel sweep, a torchrun launch): a few controls,
a Run button, and the figure of the last run. `run(**values)` returns (result, figure); every result is kept in
`results`, a plain list outside the widgets, and the figure is shown as PNG bytes in an Image widget (a figure
displayed into an Output widget from a button's callback came out blank in JupyterLab: widgets/figure.py's
FigureView, which it uses).
An error is shown as one line, the results so far are kept, and the box goes on. `show(result, fig, **values)` puts a
run the notebook already made in the box, so that the first press with those values shows it instead of running again.
"""

from __future__ import annotations

import html
from typing import Callable

import ipywidgets as W
from matplotlib.figure import Figure

from .figure import FigureView
from .pressing import made


class Rerun:
    def __init__(self, run: Callable[..., tuple[object, Figure]], title: str = "", **controls: W.ValueWidget):
        self.run_fn, self.controls, self.results = run, controls, []
        self.button = W.Button(description="Run", button_style="primary", icon="play")
        self.status = W.HTML(html.escape(title))
        self.figure = FigureView()  # the panel's figure widget, shown from a figure the run made
        self.button.on_click(lambda _b: self.press())
        self.box = W.VBox([W.HBox([*controls.values(), self.button]), self.status, self.figure.image])
        self.press_title, self._presses, self._shown, self.last_press, self.shown_again = title, 0, None, "", False
        made(self)

    def show(self, result: object, fig: Figure, **values) -> "Rerun":
        """Show a run the notebook already made (`values`: the controls' values it ran with), kept in `results`; the
        first press of Run with those values shows it again instead of running it anew."""
        self.results.append(result)
        self.figure.show_figure(fig)
        self._shown = values
        self.status.value = html.escape(f"measured above: {values}; press Run to run it again, or change a control")
        return self

    def press(self) -> str:
        """What the Run button does: returns why the press gave no result ("" when it did; kept in `last_press`). The
        first press with the values of the run `show` gave shows that run as it was measured; any other press runs."""
        self._presses += 1
        values = {name: w.value for name, w in self.controls.items()}
        self.shown_again = self._presses == 1 and self._shown is not None and values == self._shown
        if self.shown_again:
            self.status.value = html.escape(
                f"measured above: {values}; shown as it was, not run again (press Run again to run it anew)"
            )
            self.last_press = ""
            return ""
        count = len(self.results)
        self.run()
        error = html.unescape(self.status.value.replace("<b>error</b>", "error"))
        self.last_press = "" if len(self.results) > count else error
        return self.last_press

    def run(self, _=None) -> object:
        """One run with the controls' values: its result kept in `results`, its figure shown."""
        values = {name: w.value for name, w in self.controls.items()}
        self.button.disabled, self.status.value = True, "running ..."
        try:
            result, fig = self.run_fn(**values)
        except Exception as e:  # noqa: BLE001 - the learner sees the reason in one line; what ran before is kept
            self.status.value = f"<b>error</b>: {html.escape(f'{type(e).__name__}: {e}')}"
            return None
        finally:
            self.button.disabled = False
        self.results.append(result)
        self.figure.show_figure(fig)
        self.status.value = html.escape(f"run {len(self.results)}: {values}")
        return result

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.box)
