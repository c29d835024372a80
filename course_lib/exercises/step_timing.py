"""Notebook 01: a step's time from a run's step times (warm-up left out, the median, not the mean)."""

from __future__ import annotations

import statistics

from .core import Case, Exercise, Mistake


def step_time(times: list[float], warmup: int) -> float:
    """The reference: the median of the step times after the first `warmup` steps."""
    return statistics.median(times[warmup:])


def _cases() -> list[Case]:
    return [
        Case("a compile step first, then steady steps", ([9.0, 0.21, 0.20, 0.22, 0.20, 0.21], 1)),
        Case("one slow step in the middle (a page fault, the garbage collector)", ([0.5, 0.10, 0.11, 0.90, 0.10], 1)),
        Case("an even number of timed steps", ([1.0, 0.3, 0.1, 0.2, 0.4], 1)),
        Case("no warm-up", ([0.3, 0.1, 0.2], 0)),
        Case("two warm-up steps", ([5.0, 2.0, 0.25, 0.24, 0.26], 2)),
    ]


EXERCISE = Exercise(
    name="step_time",
    notebook="01",
    title="A step's time",
    reference=step_time,
    cases=_cases,
    mistakes=(
        Mistake(
            "the mean",
            lambda times, warmup: statistics.fmean(times[warmup:]),
            "One slow step (the garbage collector, a page fault, another process) pulls the mean with it; the median "
            "of the timed steps does not move.",
        ),
        Mistake(
            "warm-up kept",
            lambda times, warmup: statistics.median(times),
            "The first steps include one-off work (compiling, the allocator finding its blocks): leave the first "
            "`warmup` steps out before taking the median.",
        ),
        Mistake(
            "the middle element of unsorted times",
            lambda times, warmup: times[warmup:][len(times[warmup:]) // 2],
            "The median is the middle of the *sorted* times (with an even count, the mean of the two middle ones).",
        ),
    ),
    rtol=1e-6,
    atol=1e-12,
    describe=lambda case, expected, got: (
        f"your step time is {got:.4g} s where the median of the timed steps is {expected:.4g} s"
    ),
)
