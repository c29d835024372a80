"""Notebook 08: a GPipe step worked out by hand: when each stage starts each micro-batch's forward and backward, and
the share of the step the stages sit idle (the bubble)."""

from __future__ import annotations

import torch

from ..distributed.pipeline import bubble_fraction, simulate
from .core import Case, Exercise, Mistake


def gpipe_start_times(p: int, m: int, backward_cost: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: (F, B), each (p, m): F[s, i] and B[s, i] are when stage s starts micro-batch i's forward and
    backward, in units of one forward's time (a backward costs `backward_cost` forwards). GPipe: each stage runs its m
    forwards, then its m backwards, in micro-batch order, one thing at a time; a forward needs the previous stage's
    forward of that micro-batch, a backward the next stage's backward of it. Replayed by the course's own
    course_lib.distributed.pipeline.simulate."""
    orders = [[("F", s, i) for i in range(m)] + [("B", s, i) for i in range(m)] for s in range(p)]
    timelines = simulate(orders, {"F": 1.0, "B": backward_cost})
    f, b = torch.zeros(p, m, dtype=torch.float64), torch.zeros(p, m, dtype=torch.float64)
    for s, timeline in enumerate(timelines):
        for kind, i, start, _end, _stage in timeline:
            (f if kind == "F" else b)[s, i] = start
    return f, b


def _cases() -> list[Case]:
    return [
        Case("2 stages, 2 micro-batches", (2, 2)),
        Case("4 stages, 4 micro-batches", (4, 4)),
        Case("3 stages, 6 micro-batches", (3, 6)),
        Case("a backward as long as 3 forwards", (3, 4, 3.0)),
        Case("one stage: no pipeline", (1, 3)),
    ]


def _backward_like_forward(p, m, backward_cost=2.0):
    return gpipe_start_times(p, m, 1.0)


def _dependencies_only(p, m, backward_cost=2.0):
    f = torch.arange(p, dtype=torch.float64)[:, None].expand(p, m).clone()  # no micro-batch waits for the one before
    b = (p + backward_cost * (p - 1 - torch.arange(p, dtype=torch.float64)))[:, None].expand(p, m).clone()
    return f, b


def _stages_together(p, m, backward_cost=2.0):
    f = torch.arange(m, dtype=torch.float64)[None, :].expand(p, m).clone()  # no stage waits for the one before
    b = (m + backward_cost * torch.arange(m, dtype=torch.float64))[None, :].expand(p, m).clone()
    return f, b


def _describe(case, expected, got) -> str:
    for name, e, g in zip(("forward", "backward"), expected, got):
        wrong = (e != g).nonzero()
        if len(wrong):
            s, i = (int(v) for v in wrong[0])
            return (
                f"stage {s} starts micro-batch {i}'s {name} at {float(g[s, i]):g}, the reference at "
                f"{float(e[s, i]):g} ({len(wrong)} of the {e.numel()} {name} times differ)"
            )
    return "your times differ from the reference's"


EXERCISE = Exercise(
    name="gpipe_start_times",
    notebook="08",
    title="A GPipe step by hand",
    reference=gpipe_start_times,
    cases=_cases,
    mistakes=(
        Mistake(
            "a backward as long as a forward",
            _backward_like_forward,
            "A backward makes two matmuls for each one of the forward (the input's and the weight's gradients): it "
            "takes backward_cost forwards (2 by default).",
        ),
        Mistake(
            "micro-batches all at once",
            _dependencies_only,
            "A stage runs one thing at a time: micro-batch i + 1's forward on stage s starts when stage s has "
            "finished micro-batch i's, F[s, i] = max(F[s - 1, i], F[s, i - 1]) + 1.",
        ),
        Mistake(
            "the stages start together",
            _stages_together,
            "Stage s needs stage s - 1's output for micro-batch i before its forward, and stage s + 1's gradient "
            "before its backward: the work moves down the pipeline and back up it.",
        ),
    ),
    rtol=0.0,
    atol=1e-9,
    describe=_describe,
)


def gpipe_bubble(p: int, m: int) -> float:
    """The reference: the idle share of a GPipe step with p equal stages and m micro-batches, (p - 1)/(m + p - 1):
    the step lasts m + p - 1 slots of a micro-batch's work on one stage, and each stage is busy for m of them."""
    return bubble_fraction(p, m)


def _bubble_cases() -> list[Case]:
    return [
        Case("4 stages, 4 micro-batches", (4, 4)),
        Case("4 stages, 32 micro-batches", (4, 32)),
        Case("8 stages, 8 micro-batches", (8, 8)),
        Case("one stage", (1, 4)),
    ]


BUBBLE = Exercise(
    name="gpipe_bubble",
    notebook="08",
    title="The pipeline bubble",
    reference=gpipe_bubble,
    cases=_bubble_cases,
    mistakes=(
        Mistake(
            "bubble over the busy time",
            lambda p, m: (p - 1) / m,
            "(p - 1)/m is the idle time over the busy time (Narayanan et al.'s ratio); the share of the step is "
            "idle over the whole step, (p - 1)/(m + p - 1), which stays below 1.",
        ),
        Mistake(
            "a step of m + p slots",
            lambda p, m: (p - 1) / (m + p),
            "The step lasts m + p - 1 slots: the last stage starts its first micro-batch after p - 1 slots and then "
            "runs m of them.",
        ),
    ),
    rtol=1e-6,
    atol=1e-12,
    describe=lambda case, expected, got: (
        f"your bubble is {got:.4g} of the step, the reference's {expected:.4g} ({got / expected:.3g}x)"
        if expected
        else f"your bubble is {got:.4g} of the step where the reference's is 0"
    ),
)
