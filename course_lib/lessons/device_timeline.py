"""Notebook 04's picture of a launch-bound step: the GPU's kernels on a timeline, and the gaps where it waited."""

from ..plots import new_figure
from ..profiling import idle_share


def timeline_figure(kernels: list[tuple[float, float]], span: tuple[float, float], title: str):
    """The device's timeline over `span`: a bar per kernel, in ms from the span's start; the gaps: the device idle."""
    start, end = span
    fig = new_figure((10, 1.9))
    ax = fig.subplots()
    bars = [((a - start) / 1e3, (b - a) / 1e3) for a, b in kernels if b > start and a < end]
    ax.broken_barh(bars, (0, 1), facecolors="#4c72b0")
    ax.set_xlim(0, (end - start) / 1e3)
    ax.set_yticks([])
    ax.set_xlabel("ms from the start of the recorded steps (a bar: a kernel running; a gap: the device idle)")
    ax.set_title(f"{title}: idle {idle_share(kernels, span):.0%} of the time", fontsize=9)
    return fig
