"""The panel's code section: a collapsed "Code" view of what the configuration changes in the exported training script
against naive fp32 (course_lib.export.diff_html), redrawn on a control's change while it is open, and the button that
writes the configuration's script (export.script) next to the notebook.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Callable, Iterable

import ipywidgets as W

from .. import config as C, export


def _error(text: str, e: Exception) -> str:
    return f"<span style='color:#c44e52'>{text}: {html.escape(str(e), quote=False)}</span>"


class ExportBox:
    """target() is the config a training script would run (raises ConfigError when there is none), baseline() the
    naive fp32 config it is compared with, name(cfg) what differs in it (the script's file name)."""

    def __init__(
        self,
        target: Callable[[], C.TrainConfig],
        baseline: Callable[[], C.TrainConfig],
        name: Callable[[C.TrainConfig], str],
    ):
        self.target, self.baseline, self.name = target, baseline, name
        self.view = W.HTML()
        self.code = W.Accordion(
            children=[self.view],
            titles=("Code: this configuration's training script against naive fp32",),
            selected_index=None,
        )  # collapsed: the plots come first
        self.button = W.Button(
            description="Export this configuration",
            icon="download",
            layout=W.Layout(width="240px"),
            tooltip="write this configuration's standalone training script next to the notebook",
        )
        self.status = W.HTML()
        for w, css in (
            (self.code, "course-code"),
            (self.view, "course-diff"),
            (self.button, "course-export"),
            (self.status, "course-export-status"),
        ):
            w.add_class(css)  # stable hooks for the browser test
        self.code.observe(lambda _change: self.refresh_if_open(), names="selected_index")
        self.button.on_click(lambda _b: self.export())

    def follow(self, widgets: Iterable[W.Widget]) -> None:
        # Formatting a diff takes a fraction of a second: redraw it on a change only while someone is looking at it.
        for w in widgets:
            w.observe(lambda _change: self.refresh_if_open(), names="value")

    def diff(self) -> str:
        """What the configuration changes in the exported script against naive fp32, as HTML (or why there is none)."""
        try:
            return export.diff_html(self.baseline(), self.target(), "naive fp32 -> this configuration")
        except (C.ConfigError, ValueError) as e:
            return _error("No script for this configuration", e)

    def refresh_if_open(self) -> None:
        if self.code.selected_index == 0:
            self.view.value = self.diff()

    def export(self, directory: str | Path | None = None) -> Path | None:
        """Write the configuration's script to train_<what changed>.py in `directory` (default: the working directory,
        the notebook's own folder in Jupyter) and say where; a config that cannot be exported says why."""
        try:
            cfg = self.target()
            text = export.script(cfg)
        except (C.ConfigError, ValueError) as e:
            self.status.value = _error("Not exported", e)
            return None
        what = re.sub(r"[^A-Za-z0-9]+", "_", self.name(cfg)).strip("_")[:60]
        path = Path(directory or Path.cwd()) / f"train_{what or 'baseline'}.py"
        path.write_text(text, encoding="utf-8")
        run = export.run_command(cfg, path.name, nproc="2")
        self.status.value = (
            f"Wrote <code>{html.escape(str(path.resolve()))}</code> ({text.count(chr(10))} lines); "
            f"run it with <code>{html.escape(run)}</code>"
        )
        return path
