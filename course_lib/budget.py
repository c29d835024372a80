"""How much work the notebooks do: COURSE_BUDGET=smoke (the tests') runs every experiment small on a 2-core CPU;
unset, or full, gives the learner the full experiment."""

from __future__ import annotations

import os

BUDGETS = {"full": "the learner's full experiment", "smoke": "a quick, test-sized run"}


def budget() -> str:
    """The budget COURSE_BUDGET names (case and spaces aside; unset or empty: full), else a ValueError."""
    given = os.environ.get("COURSE_BUDGET", "full")
    if (value := given.strip().lower() or "full") not in BUDGETS:
        allowed = ", ".join(f"{name} ({what})" for name, what in BUDGETS.items())
        raise ValueError(
            f"COURSE_BUDGET={given!r} is not a budget: set it to one of {allowed}, or unset it for the full one"
        )
    return value


def is_smoke() -> bool:
    return budget() == "smoke"


def describe() -> str:
    """The budget in force, and how to get the other one (a notebook's first lines say it)."""
    if is_smoke():
        return "smoke: the quick, test-sized run (unset COURSE_BUDGET for the full size)"
    return "full (COURSE_BUDGET=smoke gives a quick, test-sized run)"


def pick(full, smoke):
    """`full` for a learner, `smoke` under the test budget."""
    return smoke if is_smoke() else full
