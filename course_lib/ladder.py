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
               rungs: list[str] | None = None) -> list[RunResult]:
    """Every rung in order. A rung the device cannot run is 'skipped' with the reason; an out-of-memory rung
    is 'oom'; the ladder goes on either way."""
    results = []
    if steps is not None:
        base = dataclasses.replace(base, steps=steps)
    for rung, cfg in C.ladder_configs(base):
        if rungs is not None and rung.name not in rungs:
            continue
        if isinstance(cfg, C.ConfigError):
            results.append(RunResult(label=rung.name, status="skipped", config={}, provenance=provenance(device_name(base.device)), reason=str(cfg)))
            continue
        if progress:
            progress(rung.name)
        result = run(cfg, rung.name, callback=_step_printer(rung.name, cfg.steps) if progress else None)
        result.reason = result.reason or rung.what_changed
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
