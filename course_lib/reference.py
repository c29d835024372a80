"""Reference results measured on GPUs and shipped with the course in data/reference/ (JSON written by
`python -m course_lib ladder --json`). Each file says its device, torch version and date. Installed, they are
package data: `data.DATA_DIR` finds them in an editable install, `pip install .` and a wheel alike."""
from __future__ import annotations

from pathlib import Path

from .data import DATA_DIR
from .results import RunResult, load_results

REFERENCE_DIR = DATA_DIR / "reference"


def reference_files() -> list[Path]:
    return sorted(REFERENCE_DIR.glob("*.json")) if REFERENCE_DIR.exists() else []


def load_reference(preset: str | None = None) -> list[tuple[Path, list[RunResult], dict]]:
    """Every shipped reference run (optionally only those of one preset): (file, results, metadata)."""
    out = []
    for f in reference_files():
        results, meta = load_results(f)
        if preset is None or meta.get("preset") == preset:
            out.append((f, results, meta))
    return out


def describe_missing() -> str:
    return ("No GPU reference results are shipped yet: they are measured on a real GPU with "
            "`python -m course_lib ladder --preset reference --json data/reference/<device>.json` and committed with "
            "the device name, torch version and date. None are invented.")
