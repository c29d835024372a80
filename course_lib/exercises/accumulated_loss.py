"""Notebook 06: the loss of an accumulated step, with padding: every micro-batch's summed loss divided by the target
tokens of the whole step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data import IGNORE_INDEX
from ..lessons.accumulated_gradients import accumulation_steps_for
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


def micro_steps(target_tokens: int, micro_batch: int, context: int, processes: int = 1) -> int:
    """The reference: the accumulation steps K that make `target_tokens` per optimizer step with micro-batches of
    `micro_batch` sequences of `context` tokens on each of `processes` processes (T = b s K P), as an int; a target
    that is not a whole multiple of b s P raises ValueError rather than changing the batch you asked for."""
    return accumulation_steps_for(target_tokens, micro_batch, context, processes)


def _steps_cases() -> list[Case]:
    return [
        Case("2^19 tokens, b 16, s 1024, one process", (2**19, 16, 1024)),
        Case("2^19 tokens on 8 processes", (2**19, 16, 1024, 8)),
        Case("a target that is not a multiple of b s P (500,000 tokens)", (500_000, 16, 1024)),
        Case("2^20 tokens, b 8, s 2048, 4 processes", (2**20, 8, 2048, 4)),
    ]


def _true_division(target_tokens, micro_batch, context, processes=1):
    return target_tokens / (micro_batch * context * processes)


def _rounded_down(target_tokens, micro_batch, context, processes=1):
    return target_tokens // (micro_batch * context * processes)


def _processes_left_out(target_tokens, micro_batch, context, processes=1):
    return target_tokens // (micro_batch * context)


MICRO_STEPS = Exercise(
    name="micro_steps",
    notebook="06",
    title="Accumulation steps for a token budget",
    reference=micro_steps,
    cases=_steps_cases,
    mistakes=(
        Mistake(
            "true division",
            _true_division,
            "T / (b s P) is a float (32.0), and range(32.0) raises TypeError: divide with divmod or //, after "
            "checking that nothing is left over.",
        ),
        Mistake(
            "rounded down",
            _rounded_down,
            "When b s P does not divide T, rounding K down silently trains on a smaller batch than the recipe's: "
            "raise ValueError and let the caller change b or T.",
        ),
        Mistake(
            "processes left out",
            _processes_left_out,
            "Each of the P processes runs its own micro-batches: one micro-step covers b s P tokens, so K = T / "
            "(b s P), P times fewer micro-steps.",
        ),
    ),
    rtol=0.0,
    atol=0.0,
    describe=lambda case, expected, got: f"your K is {got}, the reference's {expected} ({got / expected:.3g}x)",
)
