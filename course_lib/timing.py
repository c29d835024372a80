"""Timing, the same way on any device: synchronise before reading the clock, leave warm-up steps out, quote the median.
The bottom of measurement (course_lib.measure re-exports it), so that capabilities can time a matmul with it."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch


def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued work, so that a clock read afterwards times it."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


class StepTimer:
    """Wall time of each step, with the device synchronised before the clock is read."""

    def __init__(self, device: str | torch.device):
        self.device = device
        self.times: list[float] = []

    @contextlib.contextmanager
    def step(self):
        synchronize(self.device)
        t0 = time.perf_counter()
        yield
        synchronize(self.device)
        self.times.append(time.perf_counter() - t0)


def time_fn(fn, device="cpu", repeats: int = 5, warmup: int = 1, min_time_s: float = 0.0, max_repeats=None) -> float:
    """Median wall time of fn() in seconds, after `warmup` calls: `repeats` timed calls, or more (up to
    `max_repeats`) until `min_time_s` has passed, each timed by a StepTimer."""
    for _ in range(warmup):
        fn()
    timer, start = StepTimer(device), time.perf_counter()
    while len(timer.times) < max(1, repeats) or (
        time.perf_counter() - start < min_time_s and len(timer.times) < (max_repeats or repeats)
    ):
        with timer.step():
            fn()
    return statistics.median(timer.times)


def median_excluding(times: list[float], excluded: set[int]) -> float:
    kept = [t for i, t in enumerate(times) if i not in excluded]
    if not kept:
        raise ValueError("no timed steps left after warm-up: raise steps above timing_warmup")
    return statistics.median(kept)
