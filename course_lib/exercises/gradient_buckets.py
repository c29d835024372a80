"""Notebook 07: the bucket plan of a bucketed data-parallel step: which gradients are all-reduced together, in the
order backward makes them."""

from __future__ import annotations

from ..techniques.data_parallel import bucket_plan  # the reference: the rule the course's hand-written DDP uses
from .core import Case, Exercise, Mistake


def _cases() -> list[Case]:
    return [
        Case("buckets of two gradients each", ([400, 400, 400, 400], 800)),
        Case("gradients of different sizes", ([4096, 64, 1024, 64, 4096, 64], 1500)),
        Case("a bucket that fills exactly", ([100, 300, 200, 100, 200], 300)),
        Case("a bucket smaller than every gradient: one gradient each", ([512, 256, 1024], 100)),
        Case("one bucket large enough for everything", ([512, 256, 1024], 10_000)),
    ]


def _model_order(sizes, bucket_bytes):
    plan = bucket_plan(sizes[::-1], bucket_bytes)
    return [[len(sizes) - 1 - i for i in bucket] for bucket in plan]


def _never_over(sizes, bucket_bytes):
    buckets, held = [[]], 0
    for i in reversed(range(len(sizes))):
        if buckets[-1] and held + sizes[i] > bucket_bytes:
            buckets.append([])
            held = 0
        buckets[-1].append(i)
        held += sizes[i]
    return buckets


def _strictly_more(sizes, bucket_bytes):
    buckets, held = [[]], 0
    for i in reversed(range(len(sizes))):
        if held > bucket_bytes:
            buckets.append([])
            held = 0
        buckets[-1].append(i)
        held += sizes[i]
    return buckets


def _describe(case, expected, got) -> str:
    try:
        first = next(i for i, (e, g) in enumerate(zip(expected, got)) if list(e) != list(g))
    except StopIteration:
        first = min(len(expected), len(got))

    def show(plan):
        return plan[first] if first < len(plan) else "none"

    return (
        f"you made {len(got)} buckets, the reference {len(expected)}; bucket {first}: yours {show(got)}, the "
        f"reference's {show(expected)}"
    )


EXERCISE = Exercise(
    name="bucket_plan",
    notebook="07",
    title="The gradient buckets",
    reference=bucket_plan,
    cases=_cases,
    mistakes=(
        Mistake(
            "the model's order",
            _model_order,
            "Backward runs from the loss back to the input: the last parameters' gradients are ready first, so the "
            "buckets fill from the last parameter to the first (and the first bucket can be sent while backward goes "
            "on).",
        ),
        Mistake(
            "a bucket never over the size",
            _never_over,
            "A gradient joins the open bucket even when it takes the bucket past bucket_bytes; the bucket is closed "
            "once it holds at least bucket_bytes (torch's DDP does the same, with its first bucket capped at 1 MiB).",
        ),
        Mistake(
            "full only above the size",
            _strictly_more,
            "A bucket holding exactly bucket_bytes is full: start the next one when held >= bucket_bytes, not >.",
        ),
    ),
    rtol=0.0,
    atol=0.0,
    describe=_describe,
    describe_structure=True,
)
