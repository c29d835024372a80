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


def run_ladder_leaving_out(base: C.TrainConfig, leave_out: dict[str, str], steps: int | None = None,
                           progress: Callable[[str], None] | None = None) -> list[RunResult]:
    """The ladder with some rungs left out by choice (a test budget, a technique you want to see the ladder without).

    Each rung named in `leave_out` comes back 'skipped' with the reason given for it, and the climb goes on from the
    rung below it, as it does for a rung the device cannot run: every later rung runs without that technique, and its
    note says so. A name that is not a rung of the ladder raises ValueError (a typo must not silently run everything)."""
    names = [r.name for r in C.LADDER]
    unknown = [n for n in leave_out if n not in names]
    if unknown:
        raise ValueError(f"not rungs of the ladder: {unknown}; the rungs are {names}")
    if steps is not None:
        base = dataclasses.replace(base, steps=steps)
    prov = provenance(device_name(base.device))
    results, cfg, without = [], C.naive(base), []
    for rung in C.LADDER:
        if rung.name in leave_out:
            results.append(RunResult(label=rung.name, status="skipped", config={}, provenance=prov, reason=leave_out[rung.name]))
            without.append(rung.name)
            continue
        try:
            cfg = rung.apply(cfg)
        except C.ConfigError as e:  # the device cannot run it: skip, keep climbing from the last valid config
            results.append(RunResult(label=rung.name, status="skipped", config={}, provenance=prov, reason=str(e)))
            without.append(rung.name)
            continue
        if progress:
            progress(rung.name)
        result = run(cfg, rung.name, callback=_step_printer(rung.name, cfg.steps) if progress else None)
        result.reason = result.reason or rung.what_changed + (f" [climbing without: {', '.join(without)}]" if without else "")
        results.append(result)
    return results
