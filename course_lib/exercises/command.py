"""`python -m course_lib exercises`: the exercises listed or verified, the notebooks' progress, the guide rewritten."""

from __future__ import annotations

from pathlib import Path

from . import EXERCISES, guide, status, verify


def listing(verified: bool) -> int:
    """A line per exercise, or with `verified` a line per checker's answer (its reference, each recorded mistake)."""
    width = max(len(name) for name in EXERCISES)
    if not verified:
        for ex in EXERCISES.values():
            print(f"  {ex.notebook}  {ex.name:<{width}} {ex.title} ({len(ex.mistakes)} typical mistakes recorded)")
        return 0
    rows = verify()
    for r in rows:
        mark = "ok  " if r["ok"] else "FAIL"
        what = "passes" if r["answer"] == "reference" else "caught, with its hint"
        print(f"{mark} {r['notebook']} {r['exercise']:<{width}} {r['answer']:<38} {what if r['ok'] else r['said']}")
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} as they must be")
    return 1 if bad else 0


def progress_table(folder: str) -> str:
    """Which exercises pass in the notebooks of `folder` (default: ./notebooks, else the course's own)."""
    here = Path(folder or "notebooks")
    if not folder and not here.is_dir():  # run from elsewhere
        here = Path(__file__).resolve().parents[2] / "notebooks"
    return status.table(status.progress(here))


def rewrite_guide(path: str) -> str:
    """The teachers' guide at `path` (default: docs/exercises.md) rewritten from the checkers: what was done."""
    target = Path(path) if path else guide.GUIDE
    if not target.is_file():
        raise FileNotFoundError(f"{target} is not a file: give the exercises' guide (default: docs/exercises.md)")
    return f"{target}: " + ("the exercises' blocks rewritten" if guide.write(target) else "up to date")
