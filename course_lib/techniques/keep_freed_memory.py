"""Keep freed memory in the process (a CPU's): a step reuses the memory the step before it freed, instead of the
kernel mapping and zeroing fresh pages for every large activation (course_lib.cpu_allocator says why it happens).
On a GPU, PyTorch's caching allocator already does this, so the technique is a CPU's only.

It is the process's setting, not the loop's: the loop sets it at the start of each step (`apply`), so that two loops
timed in alternation each run under their own. Its effect shows only from the second step after a switch (the first
maps the pages again), so the ladder times such a pair two steps at a time (`Technique.process_wide`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import cpu_allocator
from ..codegen import Code
from ..config import TrainConfig
from .declaration import SPEED, Technique


def apply(cfg: TrainConfig, begin_step: Callable[[], None]) -> Callable[[], None]:
    """What the loop calls before each optimizer step: the process's allocator set as `cfg` asks (on a CPU), then
    `begin_step` (compile's, where it replays CUDA graphs)."""
    if torch.device(cfg.device).type != "cpu" or cpu_allocator.unavailable():
        return begin_step
    keep = cfg.keep_freed_memory

    def start() -> None:
        cpu_allocator.keep_freed(keep)
        begin_step()

    return start


def export(cfg: TrainConfig) -> Code:
    if not cfg.keep_freed_memory:
        return Code()
    return Code(
        imports=("import ctypes",),
        setup=(
            "# Keep freed memory in the process (glibc's malloc, a CPU's): large blocks come from the heap instead of\n"
            "# mappings of their own, and the heap keeps what is freed, so a step reuses the pages the step before it\n"
            "# freed instead of the kernel mapping and zeroing them again (a page fault per 4 KiB).\n"
            'libc = ctypes.CDLL("libc.so.6")\n'
            f"libc.mallopt({cpu_allocator.M_MMAP_THRESHOLD}, {cpu_allocator.KEEP})  # M_MMAP_THRESHOLD: 1 GiB\n"
            f"libc.mallopt({cpu_allocator.M_TRIM_THRESHOLD}, {cpu_allocator.KEEP})  # M_TRIM_THRESHOLD: 1 GiB"
        ),
    )


TECHNIQUE = Technique(
    "keep_freed_memory",
    "keep freed memory (CPU)",
    False,
    help="a CPU step reuses the memory the step before it freed, instead of the kernel zeroing fresh pages for it",
    export=export,
    rungs=(
        (
            "+ keep freed memory",
            True,
            "glibc's malloc keeps freed memory in the process: no page faults for a step's activations",
        ),
    ),
    aims=(SPEED,),
    process_wide=True,
    memory_note="not in the estimate: the tensors are the same; the process holds its peak between steps",
)
