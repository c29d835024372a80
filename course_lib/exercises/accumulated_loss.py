"""Notebook 06: the loss of an accumulated step, with padding: every micro-batch's summed loss divided by the target
tokens of the whole step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data import IGNORE_INDEX
from .core import Case, Exercise, Mistake


def step_loss(micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The reference. micro_batches: (logits (b, s, V), targets (b, s)) pairs, padding marked IGNORE_INDEX. The step's
    loss per real target token: the sum over every micro-batch, divided by the count of real targets in all of them,
    so that the accumulated gradient equals the big batch's."""
    total = sum(
        F.cross_entropy(lg.flatten(0, 1), tg.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        for lg, tg in micro_batches
    )
    return total / sum(int((tg != IGNORE_INDEX).sum()) for _, tg in micro_batches)


def _micro(b, s, vocab, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, vocab, generator=gen)
    targets = torch.randint(0, vocab, (b, s), generator=gen)
    if pad:
        targets[:, s - pad :] = IGNORE_INDEX
    return logits, targets


def _cases() -> list[Case]:
    return [
        Case("no padding, two micro-batches", ([_micro(2, 6, 11, 0, 0), _micro(2, 6, 11, 0, 1)],)),
        Case("padding in the last micro-batch", ([_micro(2, 6, 11, 0, 2), _micro(2, 6, 11, 4, 3)],)),
        Case("uneven padding, four micro-batches", ([_micro(1, 8, 7, p, 4 + i) for i, p in enumerate((0, 5, 1, 7))],)),
    ]


def _mean_of_means(micro_batches):
    return sum(
        F.cross_entropy(lg.flatten(0, 1), tg.flatten(), ignore_index=IGNORE_INDEX) for lg, tg in micro_batches
    ) / len(micro_batches)


def _padding_counted(micro_batches):
    total = sum(
        F.cross_entropy(lg.flatten(0, 1), tg.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        for lg, tg in micro_batches
    )
    return total / sum(tg.numel() for _, tg in micro_batches)


def _sum_of_means(micro_batches):
    return sum(F.cross_entropy(lg.flatten(0, 1), tg.flatten(), ignore_index=IGNORE_INDEX) for lg, tg in micro_batches)


EXERCISE = Exercise(
    name="step_loss",
    notebook="06",
    title="The loss of an accumulated step",
    reference=step_loss,
    cases=_cases,
    mistakes=(
        Mistake(
            "mean of the micro-batches' means",
            _mean_of_means,
            "A micro-batch that is mostly padding then weighs as much as a full one: sum every micro-batch's loss "
            "and divide once, by the real target tokens of the whole step.",
        ),
        Mistake(
            "padding counted",
            _padding_counted,
            "Padding positions are not targets: count only the tokens that are not IGNORE_INDEX.",
        ),
        Mistake(
            "the means summed",
            _sum_of_means,
            "Summing the micro-batches' means makes the loss (and its gradient) grow with the number of "
            "micro-batches: divide by the step's token count.",
        ),
    ),
    rtol=1e-5,
    atol=1e-6,
    describe=lambda case, expected, got: (
        f"your step loss is {float(got):.4f}, the reference's {float(expected):.4f} "
        f"({float(got) / float(expected):.2f}x)"
    ),
)
