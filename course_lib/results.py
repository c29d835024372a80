"""The result record of one run and its JSON form. Every record says where its numbers came from."""

from __future__ import annotations

import datetime as _dt
import html
import json
import os
import re
import subprocess
import tempfile
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch

from .cache import write_atomic
from .capabilities import device_name
from .measure import GRAPHS_METHOD, GiB

RESERVED_PEAK = "reserved, CUDA graphs' pool included"  # how a reserved peak is labelled wherever it is shown


def git_commit() -> str | None:
    """The course's commit, "-dirty" where its tracked files differ (code no commit holds); None outside a checkout.
    COURSE_COMMIT names it where the code is a copy whose own git history is another's (a lent GPU machine's)."""
    if named := os.environ.get("COURSE_COMMIT"):
        return named

    def git(*args: str) -> str:
        here = Path(__file__).resolve().parent
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=here).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        return (commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(device_name: str) -> dict:
    """Where a number came from: device, torch (and CUDA) version, date, commit."""
    date = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return dict(device=device_name, torch=torch.__version__, cuda=torch.version.cuda, date=date, commit=git_commit())


@dataclass
class RunResult:
    label: str
    # "ok", "oom", "diverged" (a non-finite loss: the steps up to it are kept), "skipped", "error" or "interrupted"
    status: str
    config: dict
    provenance: dict
    reason: str = ""
    step_times: list[float] = field(default_factory=list)
    excluded_steps: list[int] = field(default_factory=list)  # warm-up (and ledger) steps left out of the median
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    median_step_s: float | None = None
    tokens_per_step: int | None = None
    tokens_per_s: float | None = None
    compile_s: float | None = None  # first step's time beyond a normal step, when compiling
    memory: dict | None = None  # MemoryReport.to_dict()
    n_params: int | None = None
    flops_per_token: int | None = None
    mfu: float | None = None  # model FLOP/s over the device's peak (see mfu_basis); None where no peak is known
    mfu_basis: str = ""  # "data-sheet peak" (a known GPU: MFU proper) or "measured matmul peak" (any other device)
    skipped_optimizer_steps: int = 0  # fp16: steps the GradScaler skipped for inf/nan gradients
    loss_scales: list[float] = field(default_factory=list)
    details: dict = field(default_factory=dict)  # what a notebook's own runner measured for its plots (JSON-able)
    stopped_early: str = ""  # why the run ended before cfg.steps (the ladder gives up on a far slower rung), if it did
    ladder: dict = field(default_factory=dict)  # a ladder rung's verdict against the best loop so far

    @classmethod
    def failed(cls, cfg, label: str, status: str, reason: str, device: str | None = None) -> "RunResult":
        """A run that measured nothing: its `status` and why; `device` says where it would have run when cfg is None."""
        config = cfg.to_dict() if cfg is not None else {}
        where = device_name(cfg.device if cfg is not None else device)
        return cls(label=label, status=status, config=config, provenance=provenance(where), reason=reason)

    def with_details(self, **details) -> "RunResult":
        self.details = {**self.details, **details}
        return self

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def peak_gib(self) -> float | None:
        return self.memory["peak_bytes"] / GiB if self.memory else None

    @property
    def note(self) -> str:
        """What a table says beside a run: its reason, else how its allocator differed (cpu_allocator's)."""
        return self.reason or self.details.get("allocator", "")

    @property
    def peak_is_reserved(self) -> bool:
        """The peak is the allocator's reserved one (CUDA graphs: measure.cuda_memory_report), not the live tensors'."""
        return bool(self.memory) and self.memory.get("method", "").startswith(GRAPHS_METHOD)

    def peak_text(self, spec: str = ".4f", unit: str = "") -> str:
        """The peak in GiB (`unit` after it), labelled where it is the reserved one; "" where not measured."""
        label = f" ({RESERVED_PEAK})" if self.peak_is_reserved else ""
        return "" if self.peak_gib is None else format(self.peak_gib, spec) + unit + label

    def peak_ratio(self, base: RunResult) -> float | None:
        """This peak over `base`'s where both were measured and are of one kind (reserved over live is no ratio)."""
        if not (self.peak_gib is not None and base.peak_gib) or self.peak_is_reserved != base.peak_is_reserved:
            return None
        return self.peak_gib / base.peak_gib

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunResult":
        return cls(**{**d, "val_losses": [tuple(v) for v in d.get("val_losses", [])]})  # JSON made the pairs lists


def check_writable(path: str | Path) -> Path:
    """`path` where a file can be written (write_atomic makes missing folders), else an error saying why."""
    if str(path) == "":
        raise ValueError("an empty path (an unset variable?): give a file name")
    if str(path) == "-":
        raise ValueError("'-' is not a file name here: this command writes a file; give its name")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder: give a file name in it")
    if path.is_symlink() or (path.exists() and not path.is_file()):  # the move over it would replace it by a file
        raise ValueError(f"{path} is not a plain file (a link, a device or a pipe): give the name of a file to write")
    folder = next((p for p in [path.parent, *path.parent.parents] if p.exists()), Path("."))
    if path.exists() and not os.access(path, os.W_OK):
        raise PermissionError(f"cannot write {path}: the file is read-only; choose another path")
    try:  # a file made and dropped there: os.access says yes to root everywhere, /proc and read-only mounts included
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        why = f"no file can be made in {folder} ({e.strerror}); choose another path"
        raise PermissionError(f"cannot write {path}: {why}") from None
    return path


def save_results(results: list[RunResult], path: str | Path, **extra) -> Path:
    """Write the results as JSON in one step (cache.write_atomic): a failed write raises, any earlier file whole."""
    text = json.dumps({**extra, "results": [r.to_dict() for r in results]}, indent=1)
    write_atomic(Path(path), lambda f: f.write_text(text), strict=True)
    return Path(path)


class ResultsFile:
    """A results file kept current as runs end; a failed `save` is kept in `error` so the runs go on. With `replace`
    the results go beside an existing file until `finish`: an unfinished set never takes the place of a whole one."""

    def __init__(self, path: Path, replace: bool = False, fallback_name: str = "results", **meta):
        self.path, self.meta, self.fallback_name = Path(path), meta, fallback_name
        self.replacing = replace and self.path.exists()
        in_progress = self.path.with_name(f"{self.path.stem}.in-progress{self.path.suffix}")
        self.writing = in_progress if self.replacing else self.path
        self.results: list[RunResult] = []
        self.error: OSError | None = None  # why the last save failed; None once one succeeds
        self.note = ""  # what went wrong in `finish`, said as a sentence; "" where nothing did

    def save(self, results: list[RunResult]) -> None:
        self.results = list(results)
        try:
            save_results(self.results, self.writing, **self.meta)
            self.error = None
        except OSError as e:
            self.error = e

    def finish(self, complete: bool) -> Path | None:
        """Where the results are (else in a temporary file, else None: `note` says why); no OSError escapes."""
        self.note = ""
        if not self.results:
            return None
        if self.error is None and complete and self.replacing:
            try:
                os.replace(self.writing, self.path)  # in one step
                return self.path
            except OSError as e:  # the whole set stays where it was written
                self.note = f"could not replace {self.path} ({e}): the results are in {self.writing}"
        if self.error is None:
            return self.writing
        fallback = Path(tempfile.gettempdir()) / f"{self.fallback_name}-{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
        try:
            save_results(self.results, fallback, **self.meta)
        except OSError as e:
            self.note = f"could not write {self.writing} ({self.error}) nor {fallback} ({e})"
            return None
        self.note = f"could not write {self.writing} ({self.error}): the results are in {fallback}"
        return fallback


def load_results(path: str | Path) -> tuple[list[RunResult], dict]:
    """The results and the rest of a file save_results wrote, else a ResultsFileError a learner can act on."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsFileError(f"there is no file {path}") from None
    except IsADirectoryError:
        raise ResultsFileError(f"{path} is a folder: give the file in it") from None
    except UnicodeDecodeError:
        raise ResultsFileError("it is not text (a binary file?)") from None
    except OSError as e:  # a file that cannot be read (its permissions): the system's reason
        raise ResultsFileError(f"it cannot be read ({e.strerror or e})") from None
    if not text.strip():
        raise ResultsFileError("it is empty (a run stopped before its first result was written?)")
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as e:
        # cut short, not mistyped: it stops where more was expected, in a string, or in its last number or word (`tru`)
        rest = text[e.pos :].strip()
        ends = not rest or re.fullmatch(r"[\w.+-]+", rest) is not None or e.msg.startswith("Unterminated string")
        cut = "it ends in the middle of its JSON (cut short: a copy or a download that did not finish?)"
        not_json = f"it is not JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        raise ResultsFileError(cut if ends else not_json) from None
    if not isinstance(payload, dict) or not isinstance(payload.get("results"), list):
        raise ResultsFileError("it holds no list of results, as a file `ladder --json` or a panel wrote does")
    return [_run_record(i, row) for i, row in enumerate(payload.pop("results"))], payload


def _run_record(i: int, row) -> RunResult:
    """Result number i of a file as a RunResult, or a ResultsFileError naming what it lacks or has too many of."""
    known = {f.name for f in fields(RunResult)}
    needed = {f.name for f in fields(RunResult) if f.default is MISSING and f.default_factory is MISSING}
    if not isinstance(row, dict):
        what = f"a {type(row).__name__}, not an object"
    elif needed - set(row):
        what = f"no {sorted(needed - set(row))}"
    elif set(row) - known:
        what = f"fields no run has: {sorted(set(row) - known)}"
    else:
        try:
            return RunResult.from_dict(row)
        except (TypeError, ValueError) as e:  # a field of the wrong kind (val_losses not pairs)
            what = str(e)
    raise ResultsFileError(f"its result {i + 1} is not a run's record ({what})")


class ResultsFileError(ValueError):
    """A file that holds no results save_results could have written; the message says what it holds instead."""


def gflops_text(flop_per_s: float) -> str:
    """A rate in GFLOP/s: whole numbers from 100 up, three significant digits below (a tiny matmul's 0.412, not 0)."""
    g = flop_per_s / 1e9
    return f"{g:,.0f} GFLOP/s" if g >= 100 else f"{g:.3g} GFLOP/s"


def fmt(x: float | None, spec: str = ".3g", missing: str = "n/a") -> str:
    return missing if x is None else format(x, spec)


def table_rows(results: list[RunResult], baseline: RunResult | None = None) -> list[dict[str, str]]:
    """Rows for a table: speed-up and memory relative to `baseline` (default: the first ok result)."""
    base = baseline or next((r for r in results if r.ok), None)
    rows = []
    for r in results:
        row = dict.fromkeys(COLUMNS, "") | {"run": r.label, "status": r.status.upper(), "note": r.reason}
        if r.ok:
            other = not same_model(r, base)  # another network: a ratio to this baseline means nothing
            speed = r.tokens_per_s / base.tokens_per_s if not other and base.tokens_per_s else None
            mem = None if other else r.peak_ratio(base)
            row |= {
                "status": "ok",
                "ms/step": fmt(r.median_step_s * 1e3, ".1f"),
                "tokens/s": fmt(r.tokens_per_s, ",.0f"),
                "speed-up": "other model" if other else (fmt(speed, ".2f") + "x" if speed else ""),
                "peak GiB": r.peak_text() or "n/a",
                "memory vs base": "other model" if other else (fmt(mem, ".2f") + "x" if mem else ""),
                "MFU": efficiency_text(r),
                "compile s": fmt(r.compile_s, ".1f", missing=""),
                "note": r.note,
            }
        rows.append(row)
    return rows


COLUMNS = ("run", "status", "ms/step", "tokens/s", "speed-up", "peak GiB", "memory vs base", "MFU", "compile s", "note")


def same_model(a: RunResult, b: RunResult) -> bool:
    """Whether two runs trained the same network (layers, heads, width, vocabulary), whatever their techniques."""
    ma, mb = (a.config or {}).get("model", {}), (b.config or {}).get("model", {})
    return all(ma.get(k) == mb.get(k) for k in ("n_layer", "n_head", "n_embd", "vocab_size"))


def efficiency_text(r: RunResult) -> str:
    """MFU against the data sheet's peak of the run's precision (named: TF32's is higher), or the measured one."""
    if r.mfu is None:
        return "n/a"
    if r.mfu_basis == "measured matmul peak":
        return f"{r.mfu * 100:.1f}% of measured matmul peak"
    precision = r.config.get("precision")
    return f"{r.mfu * 100:.1f}%" + (f" of {precision} peak" if precision else "")


def text_table(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "(no results)"
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    line = lambda r: "  ".join(r[c].ljust(widths[c]) for c in cols).rstrip()  # noqa: E731
    return "\n".join([line({c: c for c in cols}), "  ".join("-" * widths[c] for c in cols)] + [line(r) for r in rows])


def html_table(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "<p><i>No runs yet.</i></p>"
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(r[c])}</td>" for c in cols) + "</tr>" for r in rows)
    return f'<table class="course-results"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
