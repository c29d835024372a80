"""Keep freed memory in the process (a CPU's): a step reuses what the steps before it freed instead of the kernel
zeroing fresh pages (course_lib.cpu_allocator); a GPU's caching allocator already does this.
No ladder rung: `no_rung` says why."""

from __future__ import annotations

from .. import cpu_allocator
from ..config import TrainConfig
from .declaration import SPEED, Support, Technique


def apply(cfg: TrainConfig) -> None:
    """The process's allocator set as `cfg` asks, on a CPU where glibc runs (train.Trainer calls it)."""
    if not cpu_allocator.unavailable(cfg.device):
        cpu_allocator.keep_freed(cfg.keep_freed_memory)


def probe(device) -> Support:
    why = cpu_allocator.unavailable(device)
    return Support(not why, why or "glibc's malloc keeps freed memory for reuse")


TECHNIQUE = Technique(
    "keep_freed_memory",
    "keep freed memory (CPU)",
    False,
    help="a CPU step reuses the memory the step before it freed, instead of the kernel zeroing fresh pages for it (the "
    "whole process's setting: runs after it in this kernel no longer get glibc's own rule; notebook 02)",
    aims=(SPEED,),
    probe=probe,
    memory_note="not in the estimate: the tensors are the same; the process holds its peak between steps",
    no_rung=(
        "it is the process's setting, and the ladder's paired steps share one process, where glibc's own rule cannot "
        "be had back once it is changed; notebook 02 times it in fresh processes"
    ),
)
