"""The panel's results table, made from the results alone: `html(results)` is the table (speed-up and memory against
the first run that went well, a row per run with its status and reason), `TableView` shows it in an HTML widget."""

from __future__ import annotations

from typing import Sequence

import ipywidgets as W

from ..results import RunResult, html_table, table_rows


def html(results: Sequence[RunResult]) -> str:
    """Every run as a row of an HTML table ("No runs yet." before the first)."""
    return html_table(table_rows(list(results)))


class TableView:
    """The table of `results` in an HTML widget (`widget`)."""

    def __init__(self):
        self.widget = W.HTML(html([]))
        self.widget.add_class("course-table")  # a stable hook for the browser test

    def show(self, results: Sequence[RunResult]) -> None:
        self.widget.value = html(results)
