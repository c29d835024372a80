"""Notebook 09: choosing what to run: the fastest measured configuration that fits a memory limit, and the largest
batch the memory model says fits a device."""

from __future__ import annotations

import dataclasses

from .. import memory_formula as M
from ..config import TrainConfig, reference_preset
from .core import Case, Exercise, Mistake


def choose_config(candidates: list[dict], limit_bytes: int) -> str | None:
    """The reference. candidates: measured runs, each {"label", "status", "tokens_per_s", "peak_bytes"} (peak_bytes
    None when the run's memory was not measured). The label of the fastest run that finished ("ok") and whose measured
    peak is at most `limit_bytes`; None when none does. A run whose peak is unknown is not known to fit."""
    fits = [
        c for c in candidates if c["status"] == "ok" and c["peak_bytes"] is not None and c["peak_bytes"] <= limit_bytes
    ]
    return max(fits, key=lambda c: c["tokens_per_s"])["label"] if fits else None


def _run(label, tokens_per_s, peak_mib, status="ok"):
    return {
        "label": label,
        "status": status,
        "tokens_per_s": tokens_per_s,
        "peak_bytes": None if peak_mib is None else int(peak_mib * 2**20),
    }


def _cases() -> list[Case]:
    ladder = [
        _run("naive fp32", 1000.0, 900),
        _run("+ sdpa", 1300.0, 700),
        _run("+ compile", 1700.0, 690),
        _run("+ checkpointing", 1500.0, 300),
        _run("+ chunked loss", 1550.0, 250),
    ]
    return [
        Case("a generous limit: the fastest of all", (ladder, 1000 * 2**20)),
        Case("a tight limit: the fastest of those that fit", (ladder, 400 * 2**20)),
        Case("a limit met exactly", (ladder, 250 * 2**20)),
        Case("a run stopped before its memory step", ([*ladder, _run("+ bf16 (stopped)", 1600.0, None)], 400 * 2**20)),
        Case("a run that ran out of memory", ([_run("batch 64", 3000.0, 200, status="oom"), *ladder], 1000 * 2**20)),
        Case("nothing fits", (ladder, 100 * 2**20)),
    ]


def _ignore_memory(candidates, limit_bytes):
    ok = [c for c in candidates if c["status"] == "ok"]
    return max(ok, key=lambda c: c["tokens_per_s"])["label"] if ok else None


def _leanest(candidates, limit_bytes):
    fits = [
        c for c in candidates if c["status"] == "ok" and c["peak_bytes"] is not None and c["peak_bytes"] <= limit_bytes
    ]
    return min(fits, key=lambda c: c["peak_bytes"])["label"] if fits else None


def _unknown_fits(candidates, limit_bytes):
    fits = [c for c in candidates if c["status"] == "ok" and (c["peak_bytes"] or 0) <= limit_bytes]
    return max(fits, key=lambda c: c["tokens_per_s"])["label"] if fits else None


def _strict(candidates, limit_bytes):
    fits = [
        c for c in candidates if c["status"] == "ok" and c["peak_bytes"] is not None and c["peak_bytes"] < limit_bytes
    ]
    return max(fits, key=lambda c: c["tokens_per_s"])["label"] if fits else None


def _status_ignored(candidates, limit_bytes):
    fits = [c for c in candidates if c["peak_bytes"] is not None and c["peak_bytes"] <= limit_bytes]
    return max(fits, key=lambda c: c["tokens_per_s"])["label"] if fits else None


CHOOSE = Exercise(
    name="choose_config",
    notebook="09",
    title="The fastest configuration that fits",
    reference=choose_config,
    cases=_cases,
    mistakes=(
        Mistake(
            "memory ignored",
            _ignore_memory,
            "The fastest run is no use if it does not fit: keep only the runs whose measured peak is at most the "
            "limit, then take the fastest of those.",
        ),
        Mistake(
            "the leanest, not the fastest",
            _leanest,
            "Among the runs that fit, the least memory buys nothing more: take the one with the most tokens/s.",
        ),
        Mistake(
            "at most means at most",
            _strict,
            "A peak equal to the limit fits: compare with <=, not <.",
        ),
        Mistake(
            "an unmeasured peak taken as fitting",
            _unknown_fits,
            "A run stopped before its memory was measured (peak None) is not known to fit: leave it out rather than "
            "count its peak as 0.",
        ),
        Mistake(
            "a failed run chosen",
            _status_ignored,
            "A run that ran out of memory, diverged or was skipped has no speed to trust: keep only status 'ok'.",
        ),
    ),
    describe=lambda case, expected, got: f"you chose {got!r}, the reference {expected!r}",
)


def largest_batch(cfg: TrainConfig, device_gib: float) -> int:
    """The reference: the largest batch_size whose predicted peak (memory_formula.will_it_fit, its 10% margin kept)
    fits a device of `device_gib` GiB, 0 when batch 1 does not. The peak grows with the batch, so a bisection between
    a batch that fits and one that does not finds it in about log2(4096) = 12 estimates."""
    return M.max_batch_that_fits(cfg, device_gib)


def _batch_cases() -> list[Case]:
    ref = reference_preset("cpu")
    return [
        Case("the reference model on a 24 GiB card", (ref, 24.0)),
        Case("the reference model on a 4 GiB laptop GPU", (ref, 4.0)),
        Case(
            "with SDPA and full checkpointing, 16 GiB",
            (dataclasses.replace(ref.with_model(attention="sdpa"), activation_checkpointing="full"), 16.0),
        ),
        Case("not even one sequence fits", (ref, 0.01)),
    ]


def _fits(cfg, device_gib, batch, margin=0.1):
    est = M.estimate(dataclasses.replace(cfg, batch_size=batch, grad_accum_steps=1))
    return est.verdict(device_gib, margin) == "fits"


def _doubling(cfg, device_gib):
    b = 0
    while _fits(cfg, device_gib, 2 * b or 1):
        b = 2 * b or 1
    return b


def _first_that_does_not(cfg, device_gib):
    b = largest_batch(cfg, device_gib)
    return b + 1


def _no_margin(cfg, device_gib):
    lo, hi = 0, 4096
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(cfg, device_gib, mid, margin=0.0) else (lo, mid)
    return lo


BATCH = Exercise(
    name="largest_batch",
    notebook="09",
    title="The largest batch that fits",
    reference=largest_batch,
    cases=_batch_cases,
    mistakes=(
        Mistake(
            "doubling only",
            _doubling,
            "Doubling finds the largest power of two that fits; the largest batch is usually between it and twice "
            "it: bisect between a batch that fits and one that does not.",
        ),
        Mistake(
            "the margin left out",
            _no_margin,
            "will_it_fit keeps 10% of the device for what the formula does not count (the CUDA context, the "
            "allocator's fragmentation, workspaces): a batch that only fits without it does not fit.",
        ),
        Mistake(
            "one past the end",
            _first_that_does_not,
            "That is the first batch that does not fit: when the search ends, answer the last batch that fitted.",
        ),
    ),
    rtol=0.0,
    atol=0.0,
    describe=lambda case, expected, got: f"your batch is {got}, the reference's {expected} ({got - expected:+d})",
)
