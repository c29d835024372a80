"""A CPU run refused before it starts (`run_checked`) where the memory formula (course_lib.memory_formula) says its
step would not fit in the memory free: past that, Linux would kill the process."""

from __future__ import annotations

import os

import torch

from . import measure
from .config import TrainConfig
from .memory_formula import estimate


def check_cpu_memory(cfg: TrainConfig) -> None:
    """On a CPU, a MemoryError (reported as "oom") before anything is allocated where the formula puts a step's peak
    above what is free: past that, Linux kills the process, and the notebook's kernel with it."""
    if torch.device(cfg.device).type != "cpu" or (free := measure.available_cpu_memory()) is None:
        return
    free //= int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's processes on this machine share what is free
    try:
        need = estimate(cfg).peak_bytes
    except Exception:  # noqa: BLE001 - a config the formula does not model: the allocator is left to say
        return
    if need > free:
        raise MemoryError(
            f"a step needs about {need / measure.GiB:,.1f} GiB (notebook 02's formula), {free / measure.GiB:,.1f} GiB "
            "are free here: not started (the system would kill the process); lower batch_size or context, or add "
            "grad_accum_steps"
        )


def run_checked(cfg: TrainConfig, label: str = "run", **kwargs):
    """train.run, refused first (an "oom" result) where check_cpu_memory says the step would not fit."""
    from .train import catching_oom, run

    def attempt():
        check_cpu_memory(cfg)
        return run(cfg, label, **kwargs)

    return catching_oom(attempt, cfg, label)
