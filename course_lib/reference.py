"""Results measured on GPUs (data/reference/, written by `python -m course_lib ladder --json`) and CPUs
(data/measured/), shipped with the course as package data, each file with its device, torch version and date."""

from __future__ import annotations

from pathlib import Path

from .capabilities import KERNEL_CAPS
from .data import DATA_DIR, MEASURED_DIR
from .ladder import OPTIMISED
from .results import RunResult, load_results
from .techniques import AUTOCAST_RUNG

REFERENCE_DIR = DATA_DIR / "reference"
CHECKS_DIR = REFERENCE_DIR / "checks"  # what else ran on a GPU: logs, the doctor's report, sweeps (`.ci/gpu`)

Shipped = list[tuple[Path, list[RunResult], dict]]  # (file, results, metadata)


def _load(folder: Path, pattern: str = "*.json") -> Shipped:
    return [(f, *load_results(f)) for f in sorted(folder.glob(pattern))] if folder.exists() else []


def load_reference(preset: str | None = None, folder: Path | None = None) -> Shipped:
    """Every shipped run in `folder` (default: data/reference/), optionally only those of one preset."""
    found = _load(REFERENCE_DIR if folder is None else folder)
    return [(f, results, meta) for f, results, meta in found if preset is None or meta.get("preset") == preset]


def measured_cpus(preset: str | None = None) -> Shipped:
    """The CPU ladders in data/measured/ (`cpu` in the metadata names the CPU's instruction sets)."""
    return load_reference(preset, MEASURED_DIR)


def measured_cpu_climbs(bf16_instructions: bool, preset: str = "cpu") -> Shipped:
    """The shipped climbs of CPUs with bf16 instructions, or without them, each as the CPU is: one with its kernels
    held to another instruction set (capabilities.KERNEL_CAPS in its `cpu`) shows those kernels, so is left out."""
    return [
        (path, results, meta)
        for path, results, meta in measured_cpus(preset)
        if (cpu := meta.get("cpu")) and not any(k in cpu for k in KERNEL_CAPS) and ("BF16" in cpu) == bf16_instructions
    ]


def other_cpu_lines(fast_16bit: str | None, preset: str = "cpu") -> list[str]:
    """For a CPU whose fast 16-bit format is `fast_16bit`, one line per shipped climb of the other kind (with bf16
    instructions where this one has none, without them where it has): its device, 16-bit verdict and optimised loop."""
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


def batch_sweeps(folder: Path | None = None) -> Shipped:
    """GPU runs of one loop at several batch sizes and compile modes (`bash .ci/gpu mfu` writes each as
    checks/<preset>-mfu-<gpu>-<time>.json)."""
    return _load(CHECKS_DIR if folder is None else folder, "*-mfu-*.json")


def describe_missing() -> str:
    return (
        "No GPU reference results are shipped yet: they are measured on a real GPU with "
        "`python -m course_lib ladder --preset reference --json data/reference/<device>.json` and committed with "
        "the device name, torch version and date. None are invented."
    )
