"""Reference results measured on GPUs and shipped with the course in data/reference/ (JSON written by
`python -m course_lib ladder --json`). Each file says its device, torch version and date. Installed, they are
package data: `data.DATA_DIR` finds them in an editable install, `pip install .` and a wheel alike."""

from __future__ import annotations

from pathlib import Path

from .capabilities import KERNEL_CAPS
from .data import DATA_DIR, MEASURED_DIR  # MEASURED_DIR: ladders the course's authors measured on CPUs
from .ladder import OPTIMISED
from .results import RunResult, load_results
from .techniques import AUTOCAST_RUNG

REFERENCE_DIR = DATA_DIR / "reference"
CHECKS_DIR = REFERENCE_DIR / "checks"  # what else ran on a GPU: logs, the doctor's report, sweeps (`.ci/gpu`)


def reference_files(folder: Path | None = None) -> list[Path]:
    folder = REFERENCE_DIR if folder is None else folder
    return sorted(folder.glob("*.json")) if folder.exists() else []


def load_reference(preset: str | None = None, folder: Path | None = None) -> list[tuple[Path, list[RunResult], dict]]:
    """Every shipped reference run (optionally only those of one preset) in `folder` (default: data/reference/):
    (file, results, metadata)."""
    out = []
    for f in reference_files(folder):
        results, meta = load_results(f)
        if preset is None or meta.get("preset") == preset:
            out.append((f, results, meta))
    return out


def measured_cpus(preset: str | None = None) -> list[tuple[Path, list[RunResult], dict]]:
    """The CPU ladders shipped in data/measured/ (`ladder --json`; `cpu` in the metadata names the CPU's instruction
    sets): what a CPU other than the learner's showed, labelled with its device, torch version and date."""
    return load_reference(preset, MEASURED_DIR)


def measured_cpu_climbs(bf16_instructions: bool, preset: str = "cpu") -> list[tuple[Path, list[RunResult], dict]]:
    """The shipped climbs (measured_cpus) of CPUs with bf16 instructions, or of CPUs without them (AVX2 only), each
    as the CPU is: a climb with its kernels held to another instruction set (capabilities.KERNEL_CAPS, named in its
    `cpu` metadata) shows that CPU's kernels, not that CPU, and is left out."""
    out = []
    for path, results, meta in measured_cpus(preset):
        cpu = meta.get("cpu") or ""
        if cpu and not any(k in cpu for k in KERNEL_CAPS) and ("BF16" in cpu) == bf16_instructions:
            out.append((path, results, meta))
    return out


def other_cpu_lines(fast_16bit: str | None, preset: str = "cpu") -> list[str]:
    """What the other kind of CPU showed, for a learner whose CPU's fast 16-bit format is `fast_16bit`
    (`Capabilities.fast_16bit()[0]`): one line per shipped climb of a CPU with bf16 instructions where this one has
    none (an fp16-only CPU included), of one without them where this one has them; its device, instruction sets, torch
    and date, its 16-bit rung's verdict and its optimised loop, labelled as not measured here."""
    with_bf16 = fast_16bit != "bf16"
    lines = []
    for path, shipped, meta in measured_cpu_climbs(bf16_instructions=with_bf16, preset=preset):
        sixteen = next((r for r in shipped if r.label == AUTOCAST_RUNG and r.ok), None)
        top = next((r for r in shipped if r.label == OPTIMISED), None)
        if sixteen is not None and top is not None:
            verdict = sixteen.ladder.get("why", "").replace(" here:", " there:")  # its device note spoke of that CPU
            lines.append(
                f"A CPU {'with' if with_bf16 else 'without'} bf16 instructions, for comparison (shipped with the "
                f"course, not measured here): {meta['device']} [{meta['cpu']}], torch {meta['torch']}, "
                f"{meta['date'][:10]}, preset {meta['preset']}: its 16-bit rung ({sixteen.config.get('precision')}) "
                f"{verdict}; its optimised loop {top.ladder['factor']:.2f}x naive ({path.name})."
            )
    return lines


def batch_sweeps(folder: Path | None = None) -> list[tuple[Path, list[RunResult], dict]]:
    """GPU runs of one loop at several batch sizes and compile modes (`bash .ci/gpu mfu` writes each sweep as
    checks/<preset>-mfu-<gpu>-<time>.json): (file, results, metadata), each result with its device, torch and date."""
    folder = CHECKS_DIR if folder is None else folder
    return [(f, *load_results(f)) for f in sorted(folder.glob("*-mfu-*.json"))] if folder.exists() else []


def describe_missing() -> str:
    return (
        "No GPU reference results are shipped yet: they are measured on a real GPU with "
        "`python -m course_lib ladder --preset reference --json data/reference/<device>.json` and committed with "
        "the device name, torch version and date. None are invented."
    )
