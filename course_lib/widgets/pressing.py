"""Every Run button this kernel made, pressed as a learner presses it, and what each press drew.

Each Panel and Rerun puts itself in `MADE` when it is made (a weak reference: a panel the notebook dropped goes).
The notebooks' tests press them all after a notebook's last cell (notebooks/conftest.py adds that step), and a notebook
timed as a learner meets it presses each twice (scripts/time_notebook.py): `check_all()` raises AssertionError naming
every button that drew no figure or ended in an error.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

MADE: list[weakref.ref] = []


def made(box) -> None:
    """Called by Panel and Rerun when they are made: `box` joins the buttons a press of everything reaches."""
    MADE.append(weakref.ref(box))


def live() -> list:
    """The panels and re-run boxes of this kernel still alive, in the order they were made."""
    return [box for ref in MADE if (box := ref()) is not None]


@dataclass
class Press:
    title: str
    seconds: float
    drew: bool  # a figure is shown: a PNG in the box's image
    error: str  # why the press did not give a result ("" when it did)

    @property
    def ok(self) -> bool:
        return self.drew and not self.error

    def line(self) -> str:
        what = "drew a figure" if self.drew else "drew NO figure"
        return f"{self.title}: {what} in {self.seconds:.1f} s" + (f"; {self.error}" if self.error else "")


def press(box, until_it_runs: bool = True) -> Press:
    """Click `box`'s Run button (ipywidgets' Button.click, which calls its handlers as a browser's click does) and say
    what it drew. With `until_it_runs`, a first press that only showed the notebook's own run again (`shown_again`) is
    followed by a second, so that the box's own run is always exercised (a learner's two presses: False)."""
    button = box.run_button if hasattr(box, "run_button") else box.button  # a Panel's, or a Rerun's
    t0 = time.perf_counter()
    for _ in range(2 if until_it_runs else 1):
        box.last_press = "the button called nothing"  # what the handler, box.press, replaces
        button.click()
        if not box.shown_again:
            break
    outcome = box.last_press
    image = box.figure.image
    drew = box.figure.last is not None and image.value[:4] == b"\x89PNG" and image.layout.display != "none"
    return Press(box.press_title, time.perf_counter() - t0, drew, outcome)


def press_all(times: int = 1, until_it_runs: bool = True) -> list[Press]:
    """Press every live panel and re-run box `times` times, in the order they were made (`until_it_runs`: press)."""
    return [press(box, until_it_runs) for box in live() for _ in range(times)]


def check_all(times: int = 1) -> list[Press]:
    """press_all, printing one line per press; AssertionError when no button was made or a press failed."""
    presses = press_all(times)
    for p in presses:
        print(p.line())
    assert presses, "no panel or re-run box was made in this kernel: nothing to press"
    failed = [p.line() for p in presses if not p.ok]
    assert not failed, "pressing Run failed:\n" + "\n".join(failed)
    return presses
