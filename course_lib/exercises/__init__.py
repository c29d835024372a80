"""Exercises: functions the learner writes in the notebooks, each checked against the course's reference with
explanations (course_lib.exercises.core), and plugged into the course where it makes sense.

In a notebook:

    def merge_tiles(o1, lse1, o2, lse2):
        ...  # your code (the stub raises NotImplementedError)

    merge = exercises.attempt("merge_tiles", merge_tiles)   # says solved, or what is wrong; returns what to use next

`attempt` returns the learner's function when it passes, else the reference, so the notebook always goes on. Under
the tests (COURSE_FILL_EXERCISES=1) a stub is replaced by the reference first, so every check runs.
`python -m course_lib exercises --verify` runs each checker against its reference (it must pass) and against every
recorded mistake (each must be caught, with its own hint), and prints the table; CI runs it.
"""

from __future__ import annotations

import inspect
from typing import Callable

from . import (
    accumulated_loss,
    adamw,
    bf16_rounding,
    capstone,
    flops,
    gradient_buckets,
    loss_scaling,
    memory,
    online_softmax,
    pipeline_schedule,
    ring_all_reduce,
    step_timing,
    tensor_parallel_split,
)
from .core import FILL_ENV, Exercise, Verdict, check_function, fill_stubs

# In the order of the notebooks, each notebook's in the order it asks them.
EXERCISES: dict[str, Exercise] = {
    ex.name: ex
    for ex in (
        step_timing.EXERCISE,
        flops.EXERCISE,
        memory.STATIC,
        memory.BLOCK,
        bf16_rounding.EXERCISE,
        loss_scaling.EXERCISE,
        online_softmax.SOFTMAX,
        online_softmax.EXERCISE,
        adamw.EXERCISE,
        adamw.SCHEDULE,
        accumulated_loss.MICRO_STEPS,
        accumulated_loss.EXERCISE,
        gradient_buckets.EXERCISE,
        ring_all_reduce.EXERCISE,
        pipeline_schedule.EXERCISE,
        pipeline_schedule.BUBBLE,
        tensor_parallel_split.EXERCISE,
        capstone.CHOOSE,
        capstone.BATCH,
    )
}


def _is_stub(fn: Callable) -> bool:
    """A function whose body only raises NotImplementedError (after its docstring)."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    body = [line.strip() for line in src.splitlines()[1:] if line.strip() and not line.strip().startswith("#")]
    return bool(body) and body[-1].startswith("raise NotImplementedError")


def _to_check(name: str, fn: Callable) -> tuple[Exercise, Callable]:
    if name not in EXERCISES:
        raise KeyError(f"no exercise {name!r}: the exercises are {', '.join(EXERCISES)}")
    ex = EXERCISES[name]
    return ex, (ex.reference if fill_stubs() and _is_stub(fn) else fn)


def check(name: str, fn: Callable, show_reference: bool = False) -> Verdict:
    """The verdict on the learner's `fn` for exercise `name` (shown in a notebook as a coloured box)."""
    ex, fn = _to_check(name, fn)
    return check_function(ex, fn, show_reference)


def attempt(name: str, fn: Callable, show_reference: bool = False) -> Callable:
    """Check `fn`, show the verdict, and return what the notebook should use next: `fn` when solved, else the
    reference (the notebook goes on either way). Under the tests' switch a stub is the reference, and says so."""
    from IPython.display import display

    ex, used = _to_check(name, fn)
    verdict = check_function(ex, used, show_reference)
    if used is not fn:
        verdict.message += f" (The stub was filled with the course's reference: {FILL_ENV} is set.)"
    elif not verdict.solved:
        verdict.message += " The notebook goes on with the course's reference for now."
    display(verdict)
    return used if verdict.solved else ex.reference


def verify() -> list[dict]:
    """Every checker against its reference and its recorded mistakes: one row per (exercise, answer)."""
    rows = []
    for ex in EXERCISES.values():
        v = check_function(ex, ex.reference)
        rows.append(
            {"exercise": ex.name, "notebook": ex.notebook, "answer": "reference", "ok": v.solved, "said": v.message}
        )
        for m in ex.mistakes:
            v = check_function(ex, m.fn)
            caught = not v.solved and m.hint in v.message
            said = v.message
            if v.solved:
                said = f"not caught: no case tells this wrong answer from the reference ({v.message})"
            elif not caught:
                said = f"caught without its own hint: {v.message}"
            rows.append({"exercise": ex.name, "notebook": ex.notebook, "answer": m.name, "ok": caught, "said": said})
    return rows
