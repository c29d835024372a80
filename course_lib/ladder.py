"""Run the ladder of techniques, naive fp32 to everything on, and report each rung beside the naive one."""
from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from . import config as C
from .measure import device_name
from .results import RunResult, provenance, table_rows, text_table
from .train import run


def run_ladder(base: C.TrainConfig, steps: int | None = None, progress: Callable[[str], None] | None = None,
               rungs: list[str] | None = None, leave_out: dict[str, str] | None = None,
               options: dict[str, object] | None = None) -> list[RunResult]:
    """Every rung in order (config.ladder_configs), each one run of the course's loop.

    A rung the device cannot run, or one left out by choice (`leave_out` {rung name: why}: a test budget, a
    technique you want to see the ladder without), is 'skipped' with the reason, and every later rung climbs
    without it and says so; an out-of-memory rung is 'oom'; the ladder goes on either way. `rungs` measures only
    the rungs named (the others are climbed, not run). `options` {technique: value} changes what a technique's
    rung sets (activation_checkpointing="selective")."""
    if steps is not None:
        base = dataclasses.replace(base, steps=steps)
    prov = provenance(device_name(base.device))
    results, without = [], []
    for rung, cfg in C.ladder_configs(base, options, leave_out):
        if isinstance(cfg, C.ConfigError):
            results.append(RunResult(label=rung.name, status="skipped", config={}, provenance=prov, reason=str(cfg)))
            without.append(rung.name)
            continue
        if rungs is not None and rung.name not in rungs:
            continue
        if progress:
            progress(rung.name)
        result = run(cfg, rung.name, callback=_step_printer(rung.name, cfg.steps) if progress else None)
        result.reason = result.reason or rung.what_changed + (f" [climbing without: {', '.join(without)}]" if without else "")
        results.append(result)
    return results


def _step_printer(name: str, total: int):
    def callback(step: int, _r) -> None:
        done = step + 1
        bar = "#" * (20 * done // total)
        sys.stderr.write(f"\r  {name:<18} [{bar:<20}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return callback


def ladder_table(results: list[RunResult]) -> str:
    return text_table(table_rows(results))
