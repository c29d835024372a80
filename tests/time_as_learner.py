"""Time a notebook as a learner meets it: every cell in a fresh kernel at the budget in force (COURSE_BUDGET unset: the
learner's full size), exercises unsolved, torch.compile's cache empty (a first run), then every panel's and re-run
box's Run pressed twice (course_lib.widgets.pressing). Writes one JSON record to data/measured/as-learner/ (a folder of
its own: data/measured/*.json are climbs) with the command, the device, its CPU flags, the torch version, the date and
commit, and the seconds of the cells and of each press.

    python tests/time_as_learner.py notebooks/08_model_parallelism.ipynb [--presses 2] [--note "..."] [--out DIR]

--note says how the machine was (e.g. "shared: other test runs at the same time"): the record keeps it, so a time
measured on a busy machine is never read as a quiet one's. A run that fails writes its record too, with the error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESS_SOURCE = (
    "import json as _json\nfrom course_lib.widgets import pressing as _pressing\n"
    "_presses = _pressing.press_all({times}, until_it_runs=False)\n"
    "print('PRESSES ' + _json.dumps([{{'title': p.title, 'seconds': round(p.seconds, 2), 'drew': p.drew, "
    "'error': p.error}} for p in _presses]))"
)


def machine() -> dict:
    """The device the notebooks use, its CPU flags and torch's version (as the course records them)."""
    from course_lib.capabilities import capabilities
    from course_lib.config import default_device
    from course_lib.results import provenance

    caps = capabilities(default_device())
    return {**provenance(caps.name), "cpu_flags": caps.cpu.summary() if caps.cpu else None, "cores": os.cpu_count()}


def time_notebook(path: Path, presses: int = 2, timeout_s: int = 1800) -> dict:
    """The notebook run top to bottom in a fresh kernel, then its buttons: cells_s (and cells_over_5_s, by the cell's
    index), presses, total_s and error."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PRESS_SOURCE.format(times=presses)))
    where = {"metadata": {"path": str(path.parent)}}  # the kernel starts in the notebook's folder, as in Jupyter
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", resources=where)
    t0, error, cells_s, slow = time.perf_counter(), "", None, {}
    try:
        with client.setup_kernel():
            for i, cell in enumerate(nb.cells):
                if i == len(nb.cells) - 1:
                    cells_s = time.perf_counter() - t0
                if cell.cell_type == "code":
                    start = time.perf_counter()
                    client.execute_cell(cell, i)
                    if (took := time.perf_counter() - start) >= 5:  # the cells worth shortening, by index
                        slow[i] = round(took, 1)
    except Exception as e:  # noqa: BLE001 - the record says what failed, and how far it got
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
    total = time.perf_counter() - t0
    found = [
        json.loads(o["text"].split("PRESSES ", 1)[1])
        for o in nb.cells[-1].get("outputs", [])
        if o.get("name") == "stdout" and "PRESSES " in o.get("text", "")
    ]
    return {
        "cells_s": None if cells_s is None else round(cells_s, 1),
        "cells_over_5_s": slow,
        "presses": found[0] if found else [],
        "total_s": round(total, 1),
        "error": error,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebook", type=Path)
    ap.add_argument("--presses", type=int, default=2, help="presses of each Run button after the last cell (2)")
    ap.add_argument("--note", default="", help="how the machine was while it ran (kept in the record)")
    ap.add_argument("--out", type=Path, default=ROOT / "data" / "measured" / "as-learner", help="folder of the record")
    args = ap.parse_args(argv)
    os.environ.setdefault("COURSE_FILL_EXERCISES", "0")  # as a learner first meets it: exercises unsolved
    with tempfile.TemporaryDirectory(prefix="learner-inductor-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # a first run: nothing compiled yet (the kernel inherits it)
        timing = time_notebook(args.notebook.resolve(), args.presses)
    where = machine()
    from course_lib.capabilities import kernel_caps

    capped = [f"{k}={v}" for k, v in kernel_caps().items()]  # kernels held to an instruction set
    record = {
        "what": f"a notebook as a learner meets it: all cells, then each Run button pressed {args.presses} times",
        "notebook": args.notebook.name,
        "budget": os.environ.get("COURSE_BUDGET", "full") or "full",
        "command": " ".join([*capped, "python tests/time_as_learner.py", *map(shlex.quote, argv or sys.argv[1:])]),
        "machine_note": args.note,
        **where,
        **timing,
    }
    slug = re.sub(r"[^a-z0-9]+", "-", where["device"].lower()).strip("-")[:40]
    kind = "_kernels-capped" if capped else ""  # beside the record of the CPU as it is, not over it
    out = args.out / f"{where['date'][:10]}_{slug}{kind}_{args.notebook.stem}_as-learner.json"
    from course_lib.cache import write_atomic

    write_atomic(out, lambda f: f.write_text(json.dumps(record, indent=1) + "\n"), strict=True)
    print(json.dumps({k: record[k] for k in ("notebook", "budget", "cells_s", "total_s", "error")}), "->", out)
    return 1 if timing["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
