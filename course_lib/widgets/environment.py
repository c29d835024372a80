"""The environment cell of every notebook: what this device supports, as course_lib.capabilities answers it."""

from __future__ import annotations

import html

import ipywidgets as W
from IPython.display import display

from ..capabilities import capabilities


def show_environment(device: str) -> None:
    """The environment cell: device, torch version and what this device supports (course_lib.capabilities)."""
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td style='text-align:left'>{html.escape(v)}</td></tr>"
        for k, v in capabilities(device).rows()
    )
    display(W.HTML(f"<table>{rows}</table>"))
