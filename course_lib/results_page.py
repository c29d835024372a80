"""The course's results page and the README's figure, generated from the files in data/ so that no number is copied by
hand: docs/results.md (what to expect on each kind of device, the notebooks' run times, every shipped climb rung by
rung) and docs/climbs.png (speed and memory by rung on an AVX2 CPU, a CPU with bf16 instructions and a GPU).
tests/test_docs.py regenerates both in memory and fails when the committed files differ.

    python -m course_lib.results_page            # rewrite docs/results.md and docs/climbs.png
    python -m course_lib.results_page --check    # exit 1, naming the stale file, where one is out of date
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .cache import write_atomic
from .data import DATA_DIR, MEASURED_DIR
from .ladder import LEANEST, OPTIMISED
from .plots import ladder_speedups, plot_climbs
from .reference import CHECKS_DIR, REFERENCE_DIR, load_reference, measured_cpu_climbs, measured_cpus
from .results import RunResult

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGE = DOCS / "results.md"
FIGURE = DOCS / "climbs.png"
NOTEBOOK_TIMES = MEASURED_DIR / "notebooks"  # `.ci/learner-budget` runs, one JSON file each
PROMISE = 10.0  # the course's promise (notebook 01): about 10x faster in about 10x less memory, made for a GPU
COMMAND = "python -m course_lib.results_page"


@dataclass
class Climb:
    """One shipped `ladder --json` file, read."""

    path: Path
    results: list[RunResult]
    meta: dict

    @property
    def kept(self) -> list[RunResult]:
        return [r for r in self.results if r.ok and (r.ladder or {}).get("kept", True)]

    @property
    def naive(self) -> RunResult | None:
        return next((r for r in self.results if r.ok and r.peak_gib), None)

    def optimised_factor(self) -> float | None:
        row = next((r for r in self.results if r.label == OPTIMISED and r.ok), None)
        return (row.ladder or {}).get("factor") if row else None

    def fastest_kept(self) -> float | None:
        kept = {r.label for r in self.kept}
        speed = [v for i, v in ladder_speedups(self.results).items() if self.results[i].label in kept]
        return max(speed, default=None)

    def memory_saved(self, row: RunResult | None) -> float | None:
        """naive fp32's peak over `row`'s: how many times less memory `row` needs."""
        base = self.naive
        return base.peak_gib / row.peak_gib if base and row and row.ok and row.peak_gib else None

    def leanest(self) -> RunResult | None:
        """The `= leanest here` row, or in a climb shipped before it had one, its kept rung with the smallest peak."""
        row = next((r for r in self.results if r.label == LEANEST and r.ok), None)
        return row or min((r for r in self.kept if r.peak_gib), key=lambda r: r.peak_gib, default=None)

    def optimised(self) -> RunResult | None:
        return next((r for r in self.results if r.label == OPTIMISED and r.ok), None)


def _read(entries) -> list[Climb]:
    return [Climb(path, results, meta) for path, results, meta in entries]


def device_classes() -> list[tuple[str, list[Climb]]]:
    """(class, its climbs) in the order a learner's machine is likely to be: a CPU as the CPU is (a climb with its
    kernels held to another instruction set shows kernels, not a CPU, and is left out), then each GPU shipped."""
    classes = [
        ("CPU, AVX2 only (most laptops)", _read(measured_cpu_climbs(bf16_instructions=False))),
        ("CPU with bf16 instructions (AVX512-BF16 or AMX)", _read(measured_cpu_climbs(bf16_instructions=True))),
    ]
    gpus: dict[str, list[Climb]] = {}
    for climb in _read(load_reference()):
        gpus.setdefault(f"GPU: {climb.meta['device']}", []).append(climb)
    return [(name, climbs) for name, climbs in classes + sorted(gpus.items()) if climbs]


def _model(meta: dict) -> str:
    m = meta["base_config"]["model"]
    batch, context = meta["base_config"]["batch_size"], meta["base_config"]["context"]
    return f"`{meta['preset']}` ({m['n_layer']} blocks, width {m['n_embd']}, batch {batch} x {context})"


def _span(values: list[float | None], fmt: str = "{:.2f}x") -> str:
    values = sorted(v for v in values if v is not None)
    if not values:
        return "n/a"
    lo, hi = fmt.format(values[0]), fmt.format(values[-1])
    return lo if lo == hi else f"{lo.rstrip('x')}-{hi}"


def figure_climbs() -> list[tuple[str, list[RunResult]]]:
    """One climb per device class for the figure: the largest model's latest climb (the model sized to the device)."""
    out = []
    for name, climbs in device_classes():
        size = lambda c: c.meta["base_config"]["model"]["n_embd"] * c.meta["base_config"]["model"]["n_layer"]  # noqa: E731
        best = max(climbs, key=lambda c: (size(c), c.meta["date"]))
        out.append((f"{name.split(' (')[0]}, preset {best.meta['preset']}", best.results))
    return out


def _expect_table() -> list[str]:
    rows = [
        "| device | model | climbs | `= optimised here` / naive fp32 (speed) | fastest kept rung | less memory: "
        "optimised loop | less memory: leanest loop |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, climbs in device_classes():
        for preset in dict.fromkeys(c.meta["preset"] for c in climbs):
            same = [c for c in climbs if c.meta["preset"] == preset]
            rows.append(
                f"| {name} | {_model(same[0].meta)} | {len(same)} "
                f"| {_span([c.optimised_factor() for c in same])} | {_span([c.fastest_kept() for c in same])} "
                f"| {_span([c.memory_saved(c.optimised()) for c in same])} "
                f"| {_span([c.memory_saved(c.leanest()) for c in same])} |"
            )
    rows.append(
        f"| **the course's promise** (made for a GPU) | | | ~{PROMISE:g}x | ~{PROMISE:g}x | ~{PROMISE:g}x | "
        f"~{PROMISE:g}x |"
    )
    return rows


def notebook_times() -> list[dict]:
    """The shipped notebook run times (`.ci/learner-budget`), one dict per run, oldest first."""
    files = sorted(NOTEBOOK_TIMES.glob("*.json")) if NOTEBOOK_TIMES.exists() else []
    return [dict(json.loads(f.read_text()), file=f) for f in files]


def _times_section() -> list[str]:
    runs = [run for f in notebook_times() for run in f["runs"]]
    if not runs:
        return ["No notebook run times are shipped: `.ci/learner-budget` measures them on your machine.", ""]
    out = [
        "Each notebook run top to bottom at the learner's size, exercises unsolved, torch.compile's cache empty, one "
        "after another with nothing else running (`.ci/learner-budget`). Seconds:",
        "",
        "| notebook | " + " | ".join(r["name"] for r in runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    for nb in sorted({nb for r in runs for nb in r["seconds"]}):
        cells = [
            f"{r['seconds'].get(nb, '')}" + (f" ({r['notes'][nb]})" if nb in r.get("notes", {}) else "") for r in runs
        ]
        out.append(f"| {nb} | " + " | ".join(cells) + " |")
    out.append("")
    for f in notebook_times():
        rel = f["file"].relative_to(DATA_DIR).as_posix()
        details = "; ".join(
            f"{r['device']} [{r['cpu']}]: torch {r['torch']}, {r['date']}, commit {r['commit']}" for r in f["runs"]
        )
        out += [f"From `data/{rel}` ({details}). {f['note']}", ""]
    return out


def _climb_section(climb: Climb) -> list[str]:
    meta = climb.meta
    rel = climb.path.relative_to(DATA_DIR).as_posix()
    where = f"; CUDA {meta['cuda']}" if meta.get("cuda") else ""
    cpu = f" [{meta['cpu']}]" if meta.get("cpu") else ""
    out = [
        f"#### {meta['device']}, `{meta['preset']}`, {meta['date'][:10]} ({climb.path.stem})",
        "",
        f"`data/{rel}`: {meta['device']}{cpu}, torch {meta['torch']}{where}, {meta['date']}, commit "
        f"{meta.get('commit') or 'n/a'}; model {_model(meta)}; made by `python -m course_lib ladder --preset "
        f"{meta['preset']}{' --fixed' if meta.get('fixed') else ''} --json FILE`.",
        "",
        "| rung | kept | speed-up over naive fp32 | tokens/s | peak GiB |",
        "|---|---|---|---|---|",
    ]
    speed = ladder_speedups(climb.results)
    for i, r in enumerate(climb.results):
        kept = "yes" if r.ok and (r.ladder or {}).get("kept", True) else ("no" if r.ok else r.status)
        tps = f"{r.tokens_per_s:,.0f}" if r.ok and r.tokens_per_s else "n/a"
        peak = f"{r.peak_gib:.3f}" if r.ok and r.peak_gib else "not measured"
        rate = f"{speed[i]:.2f}x" if i in speed else "n/a"
        out.append(f"| {r.label} | {kept} | {rate} | {tps} | {peak} |")
    return out + [""]


NOTEBOOKS_RUN = sorted(REFERENCE_DIR.glob("*.ipynb")) if REFERENCE_DIR.exists() else []  # executed, outputs kept


def _where(path: Path) -> str:
    """ ": device, torch, date" of a shipped JSON file that says them (at its top, in its provenance or its first
    run's), else ""."""
    try:
        meta = json.loads(path.read_text()) if path.suffix == ".json" else {}
    except ValueError:
        meta = {}
    if not isinstance(meta, dict):
        return ""
    runs = meta.get("results") if isinstance(meta.get("results"), list) else []
    first_run = runs[0].get("provenance", {}) if runs and isinstance(runs[0], dict) else {}
    where = {**first_run, **meta.get("provenance", {}), **{k: v for k, v in meta.items() if k != "provenance"}}
    if not where.get("device"):
        return ""
    return f": {where['device']}, torch {where.get('torch', 'n/a')}, {str(where.get('date', ''))[:10]}"


def _checks_section() -> list[str]:
    out = [f"- `data/{f.relative_to(DATA_DIR).as_posix()}`: executed, its outputs kept" for f in NOTEBOOKS_RUN]
    for f in sorted(CHECKS_DIR.iterdir()) if CHECKS_DIR.exists() else []:
        out.append(f"- `data/{f.relative_to(DATA_DIR).as_posix()}`{_where(f)}")
    return out


def page() -> str:
    """docs/results.md, generated."""
    lines = [
        "# Results",
        "",
        f"<!-- generated by `{COMMAND}` from data/: change the data or the generator, not this file -->",
        "",
        "Every number on this page is read from a file in `data/`, which says the device, its instruction sets, the "
        "torch version, the date and the commit it was measured at. Your own machine's numbers come from running the "
        "course: `python -m course_lib ladder` climbs the same ladder there.",
        "",
        "## What to expect",
        "",
        "Speed-ups are over naive fp32 on the same device, timed in pairs ([method.md](method.md)); "
        "\"less memory\" is naive fp32's peak over the loop's. A range spans the device's shipped climbs.",
        "",
        *_expect_table(),
        "",
        "![Speed and memory by rung](climbs.png)",
        "",
        "## Notebook run times",
        "",
        *_times_section(),
        "## Every shipped climb",
        "",
    ]
    for name, climbs in device_classes():
        lines += [f"### {name}", ""]
        for climb in climbs:
            lines += _climb_section(climb)
    others = [c for c in _read(measured_cpus()) if c.path not in {x.path for _, cs in device_classes() for x in cs}]
    if others:
        lines += ["### CPUs with their kernels held to another instruction set", ""]
        for climb in others:
            lines += _climb_section(climb)
    lines += ["## Other shipped measurements", "", *_checks_section(), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def figure_source() -> str:
    """What the figure was drawn from, stored in the PNG (its "Source" text): the drawing code's hash and each climb's
    file with its content's, so that a test can tell a figure drawn from other data or code without comparing pixels
    (which differ between matplotlib versions)."""
    parts = []
    for name, climbs in device_classes():
        for climb in climbs:
            digest = hashlib.sha256(climb.path.read_bytes()).hexdigest()[:16]
            parts.append(f"data/{climb.path.relative_to(DATA_DIR).as_posix()} sha256:{digest}")
    drawing = hashlib.sha256((inspect.getsource(plot_climbs) + inspect.getsource(figure_png)).encode()).hexdigest()
    return f"{COMMAND} (drawing code sha256:{drawing[:16]}); " + "; ".join(parts)


def figure_png() -> bytes:
    fig = plot_climbs(figure_climbs(), promise=PROMISE)
    fig.suptitle("The ladder climbed on three kinds of device (each its own naive fp32 = 1)", fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, facecolor="white", metadata={"Source": figure_source(), "Software": None})
    return buf.getvalue()


def png_source(png: Path = FIGURE) -> str | None:
    """The "Source" text stored in a PNG written by figure_png."""
    from PIL import Image

    with Image.open(png) as im:
        return im.text.get("Source")


def stale() -> list[Path]:
    """The generated files that are missing or differ from what the data gives now."""
    out = []
    if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != page():
        out.append(PAGE)
    if not FIGURE.exists() or png_source() != figure_source():
        out.append(FIGURE)
    return out


def write() -> list[Path]:
    """Rewrite the stale files; the ones rewritten."""
    done = stale()
    for path in done:
        content = page().encode() if path == PAGE else figure_png()
        write_atomic(path, lambda tmp: tmp.write_bytes(content), strict=True)
    return done


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--check"]:
        old = stale()
        for path in old:
            print(f"{path.relative_to(ROOT)} is out of date: run `{COMMAND}`", file=sys.stderr)
        return 1 if old else 0
    if argv:
        print(f"usage: {COMMAND} [--check]", file=sys.stderr)
        return 2
    done = write()
    print("rewritten: " + ", ".join(str(p.relative_to(ROOT)) for p in done) if done else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
