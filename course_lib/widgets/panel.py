"""The technique panel: one control per technique, a Run button, a progress bar, plots and a results table
that keeps every run of the session. It can be driven from code (`set`, `run`), which is how tests use it.

The panel holds no result that is not also in `panel.results` (a plain list), and it can save them to JSON.

The Run button's first press shows a run the notebook already made of the configuration the controls describe (the
runs it put in `panel.results`, or ran through `panel.run`) as it was measured, instead of training it again; any
later press, or a changed control, trains.

A notebook fits the panel to its own lesson with three arguments, and nothing else:

- `runner(cfg, label, callback, **extras) -> RunResult` decides what Run does (default: course_lib.train.run);
  it calls `callback(step, result)` for the progress bar.
- `extras={name: widget}`: controls of the notebook's own that are not TrainConfig fields (any ipywidgets value
  widget: a Dropdown, an IntSlider...). Their values reach the runner as keyword arguments, `set` sets them, and
  a run's label names those that differ from their starting value.
- `plots=(...)`: one panel of the figure per entry, a name of course_lib.plots.PLOTS ("speed", "memory", "loss",
  "step_times", "grad_norm", "lr") or a callable `fn(results, ax)` that draws every run on the matplotlib Axes it
  is given (no pyplot: the figure is course_lib.plots.new_figure's).

What a runner measured for its own plots beyond a RunResult's fields goes in `RunResult.details` (JSON-able
numbers and lists), so that it is in `panel.results` and its saved file too: `result.with_details(**details)`.

The code: under the plots, a collapsed "Code" section shows what the current configuration changes in the exported
training script against naive fp32 (course_lib.export.diff_html against techniques.naive of the panel's base), redrawn
whenever a control changes while it is open; "Export this configuration" writes that script (export.script) next to
the notebook. A runner whose runs are not the config as it stands (the strategies of notebooks 07 and 08) says what its
runs train with an attribute `runner.export_config(cfg, **extras) -> TrainConfig` (or raises ConfigError: not
exportable).

The panel is its parts put together, each in its own module: the controls (controls.py, made from the technique
registry), the run queue (run_queue.py: runs, OOM and errors as rows, the results list), the figure (figure.py) and the
table (table.py), both made from the results alone, and the code section (export_box.py).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable, Sequence

import ipywidgets as W
from IPython.display import display

from .. import config as C, presets, techniques as T
from ..capabilities import device_name
from ..plots import PlotSpec
from ..results import ResultsFile, RunResult, check_writable
from .controls import ALL_CONTROLS, Controls
from .export_box import ExportBox
from .figure import FigureView
from .pressing import made
from .run_queue import RunQueue
from .table import TableView


def _check_extras(extras: dict, runner) -> None:
    """Extra controls reach the runner as keywords: a runner must be given, and take them."""
    if extras and runner is None:
        raise ValueError(f"extra controls ({', '.join(extras)}) need a runner that reads them: pass runner=")
    if extras:
        params = inspect.signature(runner).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        missing = [k for k in extras if k not in params and not takes_any]
        if missing:
            raise ValueError(
                f"the runner takes no argument named {', '.join(missing)}: its extra controls reach it as keywords"
            )


def _file_of_its_own(path) -> tuple[Path, str]:
    """(the file a panel keeps its runs in, what to tell the learner): `path`, checked now, or where a file is there
    already (an earlier session's runs), the first free `<name>-2.json`, `-3`... beside it, so that nothing already
    written is replaced."""
    path = check_writable(path)
    if not path.exists():
        return path, f"runs saved to {path}"
    n = 2
    while (free := path.with_name(f"{path.stem}-{n}{path.suffix}")).exists():
        n += 1
    return free, f"runs saved to {free} ({path} holds earlier runs: kept as it is)"


class Panel:
    def __init__(
        self,
        base: C.TrainConfig | None = None,
        controls: Sequence[str] = ALL_CONTROLS,
        *,
        title: str = "Technique panel",
        runner: Callable[..., RunResult] | None = None,
        plots: Sequence[PlotSpec] = ("speed", "memory"),
        extras: dict[str, W.ValueWidget] | None = None,
        save_to: str | Path | None = None,
    ):
        """base: the starting config; controls: TrainConfig/ModelConfig field names, one control each; runner, extras
        and plots: the notebook's own Run, controls and plots (module docstring); save_to: a JSON file kept current."""
        _check_extras(dict(extras or {}), runner)
        self.inputs = Controls(base or presets.auto_preset(), controls, extras=extras)
        self.controls, self.extras, self.reasons = self.inputs.widgets, self.inputs.extras, self.inputs.reasons
        self.save_to, self.save_note = _file_of_its_own(save_to) if save_to else (None, "")
        self._file = ResultsFile(self.save_to) if self.save_to else None
        self.queue = RunQueue(runner, on_start=self._started, on_step=self._stepped, on_result=self._kept)
        self.runner = self.queue.runner
        self.figure = FigureView(plots)
        self.plot_names, self.plot_image = self.figure.plots, self.figure.image
        self.table_view = TableView()
        self.table = self.table_view.widget
        self.export_config = getattr(runner, "export_config", None)
        self.code_box = ExportBox(self.export_target, lambda: T.naive(self.base), self.inputs.describe)
        self.code_box.follow([*self.controls.values(), *self.extras.values()])
        self.code, self.code_view = self.code_box.code, self.code_box.view
        self.export_button, self.export_status = self.code_box.button, self.code_box.status

        self.run_button = W.Button(description="Run", button_style="primary", icon="play")
        self.clear_button = W.Button(description="Clear", icon="trash")
        self.progress = W.IntProgress(value=0, min=0, max=1, description="idle", layout=W.Layout(width="320px"))
        self.status = W.HTML(self.save_note)
        self.run_button.add_class("course-run")  # stable hooks for the browser test
        self.clear_button.add_class("course-clear")
        self.run_button.on_click(lambda _b: self.press())
        self.press_title, self._presses, self.last_press, self.shown_again = title, 0, "", False
        self.clear_button.on_click(lambda _b: self.clear())
        header = W.HTML(
            f"<b>{title}</b> &nbsp; <small>{device_name(self.base.device)}</small>"
            + "".join(f"<br><small>&#9888; {n}</small>" for n in self.inputs.notes)
        )
        grid = W.GridBox(
            [*self.controls.values(), *self.extras.values()],
            layout=W.Layout(grid_template_columns="repeat(3, 330px)"),
        )
        self.widget = W.VBox(
            [
                header,
                grid,
                W.HBox([self.run_button, self.clear_button, self.progress]),
                self.status,
                self.plot_image,
                self.table,
                self.code,
                W.HBox([self.export_button, self.export_status]),
            ]
        )
        made(self)

    # ---- what the parts hold ---------------------------------------------------------------------------------------
    @property
    def base(self) -> C.TrainConfig:
        """The starting config the runs are named against (start_from changes it)."""
        return self.inputs.base

    @property
    def results(self) -> list[RunResult]:
        """Every run of this panel, in order (the run queue's list: clear() empties it)."""
        return self.queue.results

    @property
    def last_figure(self):
        """The matplotlib Figure shown now (None before the first run)."""
        return self.figure.last

    # ---- the controls ----------------------------------------------------------------------------------------------
    def config(self) -> C.TrainConfig:
        """The TrainConfig the controls describe (raises ConfigError with a message when invalid)."""
        return self.inputs.config()

    def extra_values(self) -> dict:
        """The values of the notebook's own controls (`extras`), as the runner receives them."""
        return self.inputs.extra_values()

    def set(self, **values) -> "Panel":
        """Set controls from code, e.g. panel.set(precision="bf16", compile=True); extra controls too. A value a control
        does not offer raises ConfigError (a slider would clamp it)."""
        self.inputs.set(**values)
        return self

    def start_from(self, cfg: C.TrainConfig) -> "Panel":
        """Set every config control to `cfg`'s value (the loop a ladder kept, a rung's config) and make it the panel's
        starting config, which the runs' labels are named against (another network too: the preset control and the
        sliders' ranges follow it)."""
        self.inputs.start_from(cfg)
        return self

    def loop_buttons(self, results: list[RunResult]) -> W.ToggleButtons:
        """A choice of a climb's two loops (ladder.final_config: the optimised, the leanest): the panel starts from the
        one chosen."""
        from ..ladder import final_config

        buttons = W.ToggleButtons(options=["optimised", "leanest"], value="optimised", description="start from")
        buttons.observe(lambda change: self.start_from(final_config(results, change["new"])).redraw(), names="value")
        return buttons

    def label(self, cfg: C.TrainConfig) -> str:
        """A short name for a run: what differs from the panel's starting config."""
        return f"#{self.queue.next_number()} {self.inputs.describe(cfg)}"

    # ---- the code: the configuration as a training script ----------------------------------------------------------
    def export_target(self) -> C.TrainConfig:
        """The config the controls describe as a training script would run it (raises ConfigError when invalid)."""
        cfg = self.config()
        return self.export_config(cfg, **self.extra_values()) if self.export_config else cfg

    def code_diff(self) -> str:
        """What the current configuration changes in the exported script against naive fp32, as HTML (or why not)."""
        return self.code_box.diff()

    def export_script(self, directory: str | Path | None = None) -> Path | None:
        """Write the current configuration's script to train_<what changed>.py in `directory` (default: the working
        directory, the notebook's own folder in Jupyter) and say where; a config that cannot be exported says why."""
        return self.code_box.export(directory)

    # ---- running ---------------------------------------------------------------------------------------------------
    def run(self, label: str | None = None) -> RunResult:
        """Run the experiment the controls describe; an invalid config becomes a 'skipped' row with the reason."""
        try:
            cfg = self.config()
        except (C.ConfigError, ValueError) as e:
            self.status.value = f"<span style='color:#c44e52'>Not run: {e}</span>"
            return self.queue.not_run(label or f"#{self.queue.next_number()} invalid", self.base.device, str(e))
        result = self.queue.run(cfg, label or self.label(cfg), **self.extra_values())
        peak = f", peak {result.peak_text(unit=' GiB')}" if result.peak_gib is not None else ", memory not measured"
        speed = f"{result.tokens_per_s:,.0f} tokens/s" if result.tokens_per_s is not None else "done"
        self.status.value = (
            f"<b>{result.label}</b>: {speed}{peak}" + (f" ({result.note})" if result.note else "")
            if result.ok
            else f"<b>{result.label}</b>: {result.status.upper()} {result.reason}"
        ) + (f"<br><span style='color:#c44e52'>{self.unsaved}</span>" if self.unsaved else "")
        return result

    def _started(self, cfg: C.TrainConfig, label: str) -> None:
        self.progress.max, self.progress.value, self.progress.description = cfg.steps, 0, "running"
        self.status.value = f"Running <b>{label}</b> ({cfg.steps} steps)..."

    def _stepped(self, done: int, _steps: int) -> None:
        self.progress.value = done

    def _kept(self, result: RunResult) -> None:
        """A result is in `results` (the queue put it there first: nothing here can lose it): saved and drawn."""
        if self.progress.description == "running":  # a run ended (an invalid config never started one)
            self.progress.description = "done" if result.ok else result.status
        if result.status == "interrupted":  # Panel.run's own status line is never reached: the interrupt goes on up
            self.status.value = f"<b>{result.label}</b>: interrupted; the panel is ready for the next run"
        if self._file is not None:
            self._file.save(self.results)  # a failed write (the folder removed) is kept and shown: the runs go on
        self.redraw()

    @property
    def unsaved(self) -> str:
        """Why the last save failed, shown with every run until one succeeds; "" when it did not."""
        e = self._file.error if self._file is not None else None
        if e is None:
            return ""
        return (
            f"Not saved to {self.save_to} ({e.strerror or e}): the {len(self.results)} runs are kept in this panel's "
            ".results; .save_runs('another.json') saves them, and every later run, there"
        )

    def save_runs(self, path: str | Path) -> Path:
        """Save every run so far to `path` now, and each later run there too (as `save_to` does); a file already there
        is kept, and the runs go beside it (`<name>-2.json`). Returns the file written."""
        self.save_to, self.save_note = _file_of_its_own(path)
        self._file = ResultsFile(self.save_to)
        self._file.save(self.results)
        if self._file.error is not None:  # asked for by name: said as an error
            raise self._file.error
        self.status.value = self.save_note
        return self.save_to

    def press(self) -> str:
        """What the Run button does, never raising (an error is shown and the kernel lives on); returns why the press
        gave no result ("" when it did), also kept in `last_press`. The first press shows a run of this configuration
        the notebook already made (`measured_already`) as it was measured instead of training it again; any later
        press trains."""
        self._presses += 1
        self.shown_again = False
        self.last_press = self._press()
        return self.last_press

    def _press(self) -> str:
        try:
            shown = self.measured_already() if self._presses == 1 else None
            self.shown_again = shown is not None
            if shown is not None:
                self.redraw()
                self.status.value = (
                    f"<b>{shown.label}</b> is this configuration, measured above: shown as it was, not trained again "
                    "(press Run again to train it anew, or change a control)"
                )
                return ""
            result = self.run()
        except Exception as e:  # noqa: BLE001 - shown to the learner, the kernel lives on
            self.status.value = f"<span style='color:#c44e52'>Error: {type(e).__name__}: {e}</span>"
            return f"{type(e).__name__}: {e}"
        return "" if result.ok else f"{result.status}: {result.reason}"

    def measured_already(self) -> RunResult | None:
        """The latest successful run in `results` of the configuration the controls describe now (None if there is
        none, or the panel has controls of the notebook's own, whose values a result does not record)."""
        if self.extras:
            return None
        try:
            now = self.config().to_dict()
        except (C.ConfigError, ValueError):
            return None
        return next((r for r in reversed(self.results) if r.ok and r.config == now), None)

    def clear(self) -> None:
        self.queue.clear()
        self.redraw()
        self.status.value = "Cleared."

    def redraw(self) -> None:
        self.table_view.show(self.results)
        self.figure.show(self.results)

    def _ipython_display_(self):
        display(self.widget)
