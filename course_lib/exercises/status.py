"""A learner's progress, read from the notebooks on disk: `python -m course_lib exercises --status [notebooks]`.

An exercise's stub cell is a code cell tagged "exercise" that defines the exercise's function (named as the exercise,
or as its reference). What that cell *defines* (its imports, functions, classes and literal constants; not what it
runs, such as its `exercises.attempt(...)` call) is executed in a fresh namespace, after those of the notebook's
imports that the cell uses, and the exercise's checker is run on the function. That happens in a child process, with
COURSE_FILL_EXERCISES unset (a stub reads "not yet", as in the learner's kernel) and a time limit per exercise: a
learner's endless loop or crash costs one row of the table, not the table. The exercises share one child process
(torch is imported once); after a timeout or a crash, the next exercise starts a new one.

Each row: the notebook, the exercise, solved / not yet / error, and the checker's message on one line ("error": the
cell does not parse or its definitions raise, the function is not defined, the check timed out or crashed).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import EXERCISES, Exercise, check
from .core import FILL_ENV

SOLVED, NOT_YET, ERROR = "solved", "not yet", "error"
TAG = "exercise"
TIMEOUT_S = 60.0  # per exercise, the child's start (Python and torch, several seconds on a laptop) included
_PREFIX = "@@exercise-status@@ "  # marks the child's result lines among whatever a learner's code prints


@dataclass(frozen=True)
class Row:
    notebook: str
    exercise: str
    status: str
    message: str


# ---- reading a notebook (in this process: parsing runs nothing) ---------------------------------------------------


def code_cells(path: Path) -> list[tuple[list[str], str]]:
    """(tags, source) of each code cell; a line of IPython magic (% or !) is left out: it is not Python."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = nb.get("cells") if isinstance(nb, dict) else None
    if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
        raise ValueError("not a notebook (no list of cells in it)")
    out = []
    for cell in cells:
        if cell.get("cell_type") != "code":
            continue
        src = cell.get("source", "")
        if not isinstance(src, (str, list)):
            raise ValueError("not a notebook (a cell whose source is neither text nor lines)")
        src = "".join(src) if isinstance(src, list) else src
        src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))
        out.append((list(cell.get("metadata", {}).get("tags", [])), src))
    return out


def _bound_name(alias: ast.alias) -> str:
    return alias.asname or alias.name.split(".")[0]


def _notebook_imports(cells: list[tuple[list[str], str]]) -> list[ast.stmt]:
    """Every top-level import of the notebook, one statement per name it binds (a cell that does not parse is
    skipped here; its own row says so)."""
    out: list[ast.stmt] = []
    for _, src in cells:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.Import):
                out += [ast.Import(names=[a]) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.names[0].name != "*":
                out += [ast.ImportFrom(module=node.module, names=[a], level=0) for a in node.names]
    return out


def _is_literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _definitions(tree: ast.Module) -> ast.Module:
    """What the cell defines, without what it runs: imports, functions, classes, and names bound to literals."""
    keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    body = [
        node
        for node in tree.body
        if isinstance(node, keep)
        or (isinstance(node, ast.Assign) and _is_literal(node.value))
        or (isinstance(node, ast.AnnAssign) and node.value is not None and _is_literal(node.value))
    ]
    return ast.Module(body=body, type_ignores=[])


def _names_used(tree: ast.Module) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _defined_functions(tree: ast.Module) -> set[str]:
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _function_names(ex: Exercise) -> tuple[str, ...]:
    return tuple(dict.fromkeys((ex.name, ex.reference.__name__)))


def jobs_of(path: Path) -> tuple[list[dict], list[Row]]:
    """The checks to run for notebook `path` (one per exercise whose stub cell was found and parses), and the rows
    already decided here (a cell that does not parse, no cell for an exercise)."""
    nb = path.name[:2]
    cells = code_cells(path)
    tagged = [src for tags, src in cells if TAG in tags]
    parsed: list[tuple[str, ast.Module | None, SyntaxError | None]] = []
    for src in tagged:
        try:
            parsed.append((src, ast.parse(src), None))
        except SyntaxError as e:
            parsed.append((src, None, e))
    imports = _notebook_imports(cells)
    jobs, rows = [], []
    for ex in (ex for ex in EXERCISES.values() if ex.notebook == nb):
        names = _function_names(ex)
        found = None  # the last tagged cell that defines it: a learner may have copied the stub further down
        for src, tree, err in parsed:
            defines = _defined_functions(tree) if tree else {m for m in re.findall(r"^\s*def\s+(\w+)", src, re.M)}
            hit = next((n for n in names if n in defines), None)
            if hit:
                found = (hit, tree, err)
        if found is None:
            rows.append(Row(path.name, ex.name, ERROR, f"no cell tagged '{TAG}' defines {' or '.join(names)}"))
            continue
        function, tree, err = found
        if err is not None:
            rows.append(Row(path.name, ex.name, ERROR, f"the cell does not parse: line {err.lineno}: {err.msg}"))
            continue
        defs = _definitions(tree)
        needed = _names_used(defs) - _defined_functions(defs)
        needed_imports = [ast.unparse(i) for i in imports if _bound_name(i.names[0]) in needed]
        jobs.append(
            {
                "notebook": path.name,
                "exercise": ex.name,
                "function": function,
                "imports": needed_imports,
                "source": ast.unparse(defs),
            }
        )
    return jobs, rows


# ---- checking, in a child process ---------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(text.split())


def run_job(job: dict) -> dict:
    """In the child: the cell's definitions in a fresh namespace, then the checker (FILL_ENV is unset here)."""
    result = {"exercise": job["exercise"], "status": ERROR}
    ns: dict = {"__name__": "__exercise__"}
    for statement in job["imports"]:
        try:
            exec(statement, ns)
        except BaseException as e:  # noqa: BLE001 (a learner's environment: any failure is a row)
            return result | {"message": f"the notebook's `{statement}` failed: {type(e).__name__}: {e}"}
    try:
        exec(compile(job["source"], f"<{job['notebook']}: {job['exercise']}>", "exec"), ns)
    except BaseException as e:  # noqa: BLE001
        return result | {"message": f"the cell's definitions raised {type(e).__name__}: {e}"}
    fn = ns.get(job["function"])
    if not callable(fn):
        return result | {"message": f"the cell does not define a function {job['function']}"}
    try:
        verdict = check(job["exercise"], fn)
    except BaseException as e:  # noqa: BLE001 (an answer the checker could not even compare)
        return result | {"message": f"the checker could not compare your answer: {type(e).__name__}: {e}"}
    return result | {"status": SOLVED if verdict.solved else NOT_YET, "message": verdict.message}


def _child() -> None:
    jobs = json.load(sys.stdin)
    out = sys.stdout
    for job in jobs:
        with contextlib.redirect_stdout(sys.stderr):  # what the learner's code prints stays out of the results
            result = run_job(job)
        out.write(_PREFIX + json.dumps(result) + "\n")
        out.flush()


def _child_run(jobs: list[dict], timeout: float) -> tuple[dict[str, dict], str]:
    """Run `jobs` in one child; the results it gave, and why it stopped early ("" when it did not)."""
    env = {k: v for k, v in os.environ.items() if k != FILL_ENV}
    results: dict[str, dict] = {}
    lines: queue.Queue = queue.Queue()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, "--child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
        )

        def read() -> None:  # a thread, not select(): select does not take pipes on Windows
            for line in proc.stdout:
                lines.put(line.decode("utf-8", "replace"))
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        proc.stdin.write(json.dumps(jobs).encode())
        proc.stdin.close()
        deadline, why = time.monotonic() + timeout, ""
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                proc.kill()
                why = f"timed out after {timeout:g} s (an endless loop, or a very slow answer?)"
                break
            if line is None:
                break
            if line.startswith(_PREFIX):
                r = json.loads(line[len(_PREFIX) :])
                results[r["exercise"]] = r
                deadline = time.monotonic() + timeout
        rc = proc.wait()
        if not why and len(results) < len(jobs):
            err.seek(0)
            tail = [t for t in err.read().decode("utf-8", "replace").splitlines() if t.strip()][-1:]
            why = f"the check process ended with exit code {rc}" + (f": {tail[0]}" if tail else "")
    return results, why


def check_jobs(jobs: list[dict], timeout: float = TIMEOUT_S) -> list[Row]:
    rows, pending = [], list(jobs)
    while pending:
        results, why = _child_run(pending, timeout)
        for job in pending:
            if job["exercise"] in results:
                r = results[job["exercise"]]
                rows.append(Row(job["notebook"], job["exercise"], r["status"], _one_line(r["message"])))
        pending = [j for j in pending if j["exercise"] not in results]
        if pending:  # the child stopped at the first of those left: that one is the row, the rest get a new child
            rows.append(Row(pending[0]["notebook"], pending[0]["exercise"], ERROR, why))
            pending = pending[1:]
    return rows


def progress(folder: str | Path, timeout: float = TIMEOUT_S) -> list[Row]:
    """One row per exercise of the notebooks in `folder` (NN_*.ipynb), in the order of EXERCISES."""
    folder = Path(folder)
    notebooks = sorted(p for p in folder.glob("*.ipynb") if p.name[:2].isdigit())
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder: give the folder that holds the course's notebooks")
    if not notebooks:
        raise FileNotFoundError(f"no course notebooks (01_....ipynb) in {folder}")
    rows: list[Row] = []
    jobs: list[dict] = []
    for path in notebooks:
        try:
            mine, decided = jobs_of(path)
        except (OSError, ValueError, KeyError) as e:  # not JSON, or JSON but no notebook (code_cells)
            why = f"cannot read the notebook: {type(e).__name__}: {e}"
            # one row per exercise it holds, so that the count says how many there are
            rows += [
                Row(path.name, ex.name, ERROR, why) for ex in EXERCISES.values() if ex.notebook == path.name[:2]
            ] or [Row(path.name, "-", ERROR, why)]
            continue
        rows += decided
        jobs += mine
    rows += check_jobs(jobs, timeout)  # all in one child process (torch imported once), a new one after a failure
    order = {name: i for i, name in enumerate(EXERCISES)}
    return sorted(rows, key=lambda r: (r.notebook, order.get(r.exercise, -1)))


def table(rows: list[Row]) -> str:
    width = max([len("exercise")] + [len(r.exercise) for r in rows])
    nb_width = max([len("notebook")] + [len(r.notebook) for r in rows])
    lines = [f"{'notebook':<{nb_width}}  {'exercise':<{width}}  {'status':<7}  message"]
    lines += [f"{r.notebook:<{nb_width}}  {r.exercise:<{width}}  {r.status:<7}  {r.message}" for r in rows]
    solved = sum(r.status == SOLVED for r in rows)
    lines.append(f"{solved} of {sum(r.exercise != '-' for r in rows)} exercises solved")
    return "\n".join(lines)


if __name__ == "__main__" and sys.argv[1:] == ["--child"]:
    _child()
