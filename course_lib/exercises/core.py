"""What an exercise is, and how a learner's answer is checked.

An `Exercise` is a function the learner writes (a stub in the notebook), the course's reference for it, cases that
a wrong answer cannot pass (varied shapes and dtypes, and the edge a typical mistake misses), and the typical
mistakes themselves (`Mistake`: a function that makes the mistake, and the hint that names it). `check` runs the
learner's function on every case; at the first case it gets wrong it says what is wrong and by how much, and when the
answer matches a known mistake's, that mistake's hint. It never says only "assertion failed", and shows the
reference only when asked (`show_reference=True`).

`verify` proves the checker honest: the reference passes, and every recorded mistake is caught with its own hint.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

# Under the tests a stub is replaced by the reference (COURSE_FILL_EXERCISES=1, set by conftest.py): every check then
# runs in full, and the notebook goes on exactly as for a learner who solved it.
FILL_ENV = "COURSE_FILL_EXERCISES"


@dataclass(frozen=True)
class Case:
    name: str  # what makes this case matter ("one step", "padding in the last micro-batch", ...)
    args: tuple
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Mistake:
    name: str  # e.g. "no bias correction"
    fn: Callable  # the learner's function with this mistake made
    hint: str  # what the checker says when an answer matches it


@dataclass(frozen=True)
class Exercise:
    name: str
    notebook: str
    title: str
    reference: Callable
    cases: Callable[[], list[Case]]
    mistakes: tuple[Mistake, ...]
    rtol: float = 1e-5
    atol: float = 1e-6
    # how a wrong answer is described: (case, expected, got) -> "your first update is 3.2x the reference's"
    describe: Callable[[Case, object, object], str] | None = None


@dataclass
class Verdict:
    exercise: str
    solved: bool
    message: str
    case: str = ""
    mistake: str = ""  # the known mistake the answer matched, if any

    def __str__(self) -> str:
        return self.message

    def _repr_html_(self) -> str:
        colour = "#1a7f37" if self.solved else "#b35900"
        return f'<div style="border-left:4px solid {colour};padding:4px 10px">{self.message}</div>'


def _flat(x) -> list[torch.Tensor]:
    """An answer as a list of float tensors: a number, a tensor, or a tuple/list of them."""
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _flat(item)]
    return [torch.as_tensor(x, dtype=torch.float64) if not torch.is_tensor(x) else x.detach().double()]


def distance(expected, got) -> tuple[float, float] | None:
    """(largest absolute difference, largest relative difference) between two answers, or None when their
    structure or shapes differ."""
    e, g = _flat(expected), _flat(got)
    if len(e) != len(g) or any(a.shape != b.shape for a, b in zip(e, g)):
        return None
    absolute = max((float((a - b).abs().max()) if a.numel() else 0.0) for a, b in zip(e, g))
    relative = max(
        (float(((a - b).abs() / a.abs().clamp_min(1e-12)).max()) if a.numel() else 0.0) for a, b in zip(e, g)
    )
    return absolute, relative


def close(ex: Exercise, expected, got, equal_nan: bool = False) -> bool:
    e, g = _flat(expected), _flat(got)
    if len(e) != len(g) or any(a.shape != b.shape for a, b in zip(e, g)):
        return False
    return all(torch.allclose(b, a, rtol=ex.rtol, atol=ex.atol, equal_nan=equal_nan) for a, b in zip(e, g))


def _structure(x) -> str:
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of {len(x)}: (" + ", ".join(_structure(i) for i in x) + ")"
    if torch.is_tensor(x):
        return f"tensor {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    return type(x).__name__


def _clone(args):
    return tuple(a.clone() if torch.is_tensor(a) else a for a in args)


def check_function(ex: Exercise, fn: Callable, show_reference: bool = False) -> Verdict:
    """Run `fn` on every case of `ex` against the reference; the first wrong case explained."""
    for case in ex.cases():
        expected = ex.reference(*_clone(case.args), **case.kwargs)
        try:
            got = fn(*_clone(case.args), **case.kwargs)
        except NotImplementedError:
            return Verdict(ex.name, False, f"{ex.title}: not solved yet (the stub raises NotImplementedError).")
        except Exception as e:  # the learner's code failed: say where, not a traceback
            return Verdict(
                ex.name,
                False,
                f"{ex.title}, case '{case.name}': your function raised {type(e).__name__}: {e}",
                case.name,
            )
        if close(ex, expected, got):
            continue
        message, matched = _explain(ex, case, expected, got)
        if show_reference:
            message += "\n\nThe reference:\n" + inspect.getsource(ex.reference)
        return Verdict(ex.name, False, message, case.name, matched)
    return Verdict(ex.name, True, f"{ex.title}: solved (all {len(ex.cases())} cases match the reference).")


def _explain(ex: Exercise, case: Case, expected, got) -> tuple[str, str]:
    head = f"{ex.title}, case '{case.name}': "
    d = distance(expected, got)
    if d is None:
        return head + f"the answer should be {_structure(expected)}, yours is {_structure(got)}.", ""
    bad = sum(int((~torch.isfinite(t)).sum()) for t in _flat(got))
    if bad:
        what = f"your answer has {bad} values that are inf or NaN where the reference's are finite"
    else:
        what = ex.describe(case, expected, got) if ex.describe else f"off by up to {d[0]:.3g} ({d[1]:.1%} relative)"
    for m in ex.mistakes:
        try:
            wrong = m.fn(*_clone(case.args), **case.kwargs)
        except Exception:
            continue
        if close(ex, wrong, got, equal_nan=True):
            return head + f"{what}. {m.hint}", m.name
    return head + f"{what}. Compare your steps with the formula above, one line at a time.", ""


def fill_stubs() -> bool:
    return os.environ.get(FILL_ENV, "") not in ("", "0")
