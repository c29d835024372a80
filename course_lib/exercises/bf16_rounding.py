"""Notebook 03: rounding fp32 to bf16 by hand, on the bits: bf16 is the top 16 bits of an fp32, rounded to nearest,
ties to even."""

from __future__ import annotations

import torch

from .core import Case, Exercise, Mistake


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """The reference: each fp32 value rounded to the nearest bf16 value (ties to the even one), returned as fp32.
    torch's own conversion."""
    return x.to(torch.bfloat16).to(torch.float32)


def _bits(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _cases() -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    return [
        Case(
            "random values around 1 and 0.02",
            (torch.cat([torch.randn(64, generator=gen), 0.02 * torch.randn(64, generator=gen)]),),
        ),
        Case("just above and below half a bf16 step", (_bits([0x3F808001, 0x3F807FFF, 0xBF80C001, 0x3C23D70A]),)),
        Case(
            "exact ties: half a step above an even and an odd bf16 value",
            (_bits([0x3F808000, 0x3F818000, 0xC0008000, 0xC0018000]),),
        ),
        Case(
            "rounding up into the next power of two, and past the largest finite value",
            (_bits([0x3F7FFFFF, 0x7F7FFFFF, 0x00008001]),),
        ),
    ]


def _truncate(x):
    return (x.view(torch.int32) & -65536).view(torch.float32)


def _half_up(x):
    return ((x.view(torch.int32) + 0x8000) & -65536).view(torch.float32)


def _fp16(x):
    return x.to(torch.float16).to(torch.float32)


def _describe(case, expected, got) -> str:
    differ = int((expected != got).sum())
    return f"{differ} of your {got.numel()} values differ from bf16's rounding"


def _bf16_shortcut(func, out) -> str | None:
    if isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16:
        return (
            "your function makes a torch.bfloat16 tensor, which rounds for you: the exercise is to round on the bits "
            "of the fp32 values (view them as int32, add the rounding bias, clear the low 16 bits)."
        )
    return None


EXERCISE = Exercise(
    name="round_to_bf16",
    notebook="03",
    title="Rounding fp32 to bf16",
    reference=round_to_bf16,
    cases=_cases,
    mistakes=(
        Mistake(
            "truncation",
            _truncate,
            "Dropping the low 16 bits rounds toward zero: up to a whole bf16 step off, always the same way. Add half "
            "a step (0x7FFF, plus the lowest kept bit for ties) before masking.",
        ),
        Mistake(
            "ties rounded up",
            _half_up,
            "Exactly half a step rounds to the *even* neighbour (the one whose lowest kept bit is 0), not always up: "
            "add 0x7FFF + ((bits >> 16) & 1), then mask.",
        ),
        Mistake(
            "fp16, not bf16",
            _fp16,
            "That is fp16: 5 exponent and 10 mantissa bits. bf16 keeps fp32's 8 exponent bits and 7 mantissa bits: "
            "the top 16 bits of the fp32 pattern.",
        ),
    ),
    rtol=0.0,
    atol=0.0,
    describe=_describe,
    shortcut=_bf16_shortcut,
)
