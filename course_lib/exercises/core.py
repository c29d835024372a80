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

import contextlib
import html
import inspect
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
    # describe also an answer whose structure differs from the reference's (a list of buckets of other lengths)
    describe_structure: bool = False
    # a shortcut the exercise is there to avoid: (an operator the learner's function ran, its output) -> what to say,
    # or None (torch.softmax in the online-softmax exercise); the reference may use it, the learner may not
    shortcut: Callable[[object, object], str | None] | None = None


@dataclass(repr=False)
class Verdict:
    exercise: str
    solved: bool
    message: str
    case: str = ""
    mistake: str = ""  # the known mistake the answer matched, if any

    def __str__(self) -> str:
        return self.message

    __repr__ = __str__  # a console shows the message, as a notebook's box does

    def _repr_html_(self) -> str:
        colour = "#1a7f37" if self.solved else "#b35900"
        style = f"border-left:4px solid {colour};padding:4px 10px;white-space:pre-wrap"  # the reference's lines kept
        return f'<div style="{style}">{html.escape(self.message)}</div>'


@dataclass(frozen=True)
class Raised:
    """What a function raised instead of returning: a case where the reference refuses its input (a batch that does
    not divide, say) must be refused by the learner's function too, with the same kind of exception."""

    kind: type
    message: str

    def __str__(self) -> str:
        return f"{self.kind.__name__}: {self.message}"


def _leaves(x) -> list:
    """An answer's leaves, in order: tensors, numbers, and anything else (a label, None) as it is."""
    if isinstance(x, (tuple, list)):
        return [leaf for item in x for leaf in _leaves(item)]
    return [x]


def _numeric(leaf) -> bool:
    return torch.is_tensor(leaf) or (isinstance(leaf, (int, float)) and not isinstance(leaf, bool))


def _flat(x) -> list[torch.Tensor]:
    """An answer as a list of float tensors: a number, a tensor, or a tuple/list of them."""
    return [t.detach().double() if torch.is_tensor(t) else torch.as_tensor(t, dtype=torch.float64) for t in _leaves(x)]


def _same_structure(expected, got) -> bool:
    """The same nesting (a list of 2 buckets is not a list of 3 holding the same indices), numbers where the reference
    has numbers (an int where it has an int: range() refuses 32.0), tensors of the same shapes; anything else is
    compared by value later."""
    if isinstance(expected, (tuple, list)) or isinstance(got, (tuple, list)):
        return (
            isinstance(expected, (tuple, list))
            and isinstance(got, (tuple, list))
            and len(expected) == len(got)
            and all(_same_structure(a, b) for a, b in zip(expected, got))
        )
    a, b = expected, got
    if _numeric(a) != _numeric(b):
        return False
    if torch.is_tensor(a) and not torch.is_tensor(b):  # a tensor is what the next cell backpropagates or indexes
        return False
    if isinstance(a, int) and not isinstance(a, bool) and isinstance(b, float):
        return False
    return not _numeric(a) or torch.as_tensor(a).shape == torch.as_tensor(b).shape


def distance(expected, got) -> tuple[float, float] | None:
    """(largest absolute difference, largest relative difference) between two answers, or None when their
    structure or shapes differ, or they hold something other than numbers."""
    if not _same_structure(expected, got) or not all(_numeric(leaf) for leaf in _leaves(expected)):
        return None
    e, g = _flat(expected), _flat(got)
    absolute = max((float((a - b).abs().max()) if a.numel() else 0.0) for a, b in zip(e, g))
    relative = max(
        (float(((a - b).abs() / a.abs().clamp_min(1e-12)).max()) if a.numel() else 0.0) for a, b in zip(e, g)
    )
    return absolute, relative


def close(ex: Exercise, expected, got, equal_nan: bool = False) -> bool:
    if isinstance(expected, Raised) or isinstance(got, Raised):
        return isinstance(expected, Raised) and isinstance(got, Raised) and issubclass(got.kind, expected.kind)
    if not _same_structure(expected, got):
        return False
    for a, b in zip(_leaves(expected), _leaves(got)):
        if not _numeric(a):
            if a != b:
                return False
            continue
        a, b = _flat(a)[0], _flat(b)[0]
        if not torch.allclose(b, a, rtol=ex.rtol, atol=ex.atol, equal_nan=equal_nan):
            return False
    return True


def _structure(x) -> str:
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of {len(x)}: (" + ", ".join(_structure(i) for i in x) + ")"
    if torch.is_tensor(x):
        return f"tensor {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    return type(x).__name__


def _clone(x):
    """A copy of the arguments, tensors inside lists included: a function that changes its inputs in place must not
    change the case for the next function checked on it."""
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(a) for a in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x.clone() if torch.is_tensor(x) else x


def _outcome(fn: Callable, case: Case):
    """fn's answer on a case, or what it raised (a stub's NotImplementedError goes through)."""
    try:
        return fn(*_clone(case.args), **_clone(case.kwargs))
    except NotImplementedError:
        raise
    except Exception as e:
        return Raised(type(e), str(e))


class _Shortcuts(TorchDispatchMode):
    """Watches the operators a learner's function runs for the exercise's shortcut; the first one found is kept."""

    def __init__(self, rule):
        super().__init__()
        self.rule, self.found = rule, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.found is None:
            self.found = self.rule(func, out)
        return out


def check_function(ex: Exercise, fn: Callable, show_reference: bool = False) -> Verdict:
    """Run `fn` on every case of `ex` against the reference; the first wrong case explained."""
    for case in ex.cases():
        expected = _outcome(ex.reference, case)
        watch = _Shortcuts(ex.shortcut) if ex.shortcut is not None and fn is not ex.reference else None
        try:
            with watch if watch is not None else contextlib.nullcontext():
                got = _outcome(fn, case)
        except NotImplementedError:
            return Verdict(ex.name, False, f"{ex.title}: not solved yet (the stub raises NotImplementedError).")
        if watch is not None and watch.found:
            return Verdict(ex.name, False, f"{ex.title}, case '{case.name}': {watch.found}", case.name, "shortcut")
        if isinstance(got, Raised) and not close(ex, expected, got):  # the learner's code failed: say where
            return Verdict(ex.name, False, f"{ex.title}, case '{case.name}': your function raised {got}", case.name)
        if close(ex, expected, got, equal_nan=True):  # a NaN where the reference has one is right (a bad gradient)
            continue
        message, matched = _explain(ex, case, expected, got)
        if show_reference:
            message += "\n\nThe reference:\n" + inspect.getsource(ex.reference)
        return Verdict(ex.name, False, message, case.name, matched)
    return Verdict(ex.name, True, f"{ex.title}: solved (all {len(ex.cases())} cases match the reference).")


def _short(x, limit: int = 80) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _what(ex: Exercise, case: Case, expected, got) -> str:
    """What is wrong, and by how much."""
    if isinstance(expected, Raised):
        return f"the reference refuses this case ({expected}), yours returned {_short(got)}"
    d = distance(expected, got)
    if d is not None:
        bad = sum(int((~torch.isfinite(g) & torch.isfinite(e)).sum()) for e, g in zip(_flat(expected), _flat(got)))
        if bad:
            return f"your answer has {bad} values that are inf or NaN where the reference's are finite"
        return ex.describe(case, expected, got) if ex.describe else f"off by up to {d[0]:.3g} ({d[1]:.1%} relative)"
    if ex.describe and ex.describe_structure:
        return ex.describe(case, expected, got)
    e, g = _leaves(expected), _leaves(got)
    if len(e) == len(g):
        for a, b in zip(e, g):
            if isinstance(a, int) and not isinstance(a, bool) and isinstance(b, float):
                return f"the answer should be an int, yours is the float {b!r}"
        if _same_structure(expected, got):  # a label or None where the reference has another
            return (
                ex.describe(case, expected, got)
                if ex.describe
                else (f"your answer is {_short(got)}, the reference's {_short(expected)}")
            )
    return f"the answer should be {_structure(expected)}, yours is {_structure(got)}"


def _explain(ex: Exercise, case: Case, expected, got) -> tuple[str, str]:
    head = f"{ex.title}, case '{case.name}': "
    what = _what(ex, case, expected, got)
    for m in ex.mistakes:
        try:
            wrong = _outcome(m.fn, case)
        except NotImplementedError:
            continue
        if close(ex, wrong, got, equal_nan=True):
            return head + f"{what}. {m.hint}", m.name
    return head + f"{what}. Compare your function with the rule its docstring states, one step at a time.", ""


def fill_stubs() -> bool:
    return os.environ.get(FILL_ENV, "") not in ("", "0")
