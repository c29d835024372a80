"""Keep freed memory in the process (a CPU's): a step reuses the memory the step before it freed, instead of the
kernel mapping and zeroing fresh pages for every large activation (course_lib.cpu_allocator says why it happens).
On a GPU, PyTorch's caching allocator already does this, so the technique is a CPU's only.

It is the process's setting, not the loop's: the loop sets it at the start of each step (`apply`), so that two loops
timed in alternation each run under their own. Its effect shows only once the heap has settled, a few steps after a
switch, so the ladder times such a pair with untimed steps after each switch (`Technique.process_wide`,
course_lib.ladder.SETTLE_STEPS).
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
    if cpu_allocator.unavailable(cfg.device):
        return begin_step
    keep = cfg.keep_freed_memory

    def start() -> None:
        cpu_allocator.keep_freed(keep)
        begin_step()

    return start


def export(cfg: TrainConfig) -> Code:
    """The script's lines: the same mallopt calls as cpu_allocator.keep_freed(True), where glibc runs the script (its
    device a CPU: on a GPU there is nothing to do)."""
    if not cfg.keep_freed_memory or torch.device(cfg.device).type != "cpu":
        return Code()
    A = cpu_allocator
    return Code(
        imports=("import ctypes", "import os"),
        setup=(
            "# Keep freed memory in the process (glibc's malloc): no block gets a mapping of its own and the heap is\n"
            "# never trimmed, so a step reuses the pages the steps before it freed instead of the kernel mapping and\n"
            "# zeroing them again (a page fault per page). Elsewhere a preloaded jemalloc does it.\n"
            "try:\n"
            '    glibc = os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")\n'
            "except (AttributeError, ValueError, OSError):  # no confstr (Windows), or no such name (macOS, musl)\n"
            "    glibc = False\n"
            "if glibc:\n"
            '    libc = ctypes.CDLL("libc.so.6")\n'
            f"    libc.mallopt({A.M_MMAP_MAX}, 0)  # M_MMAP_MAX: no block gets a mapping of its own\n"
            f"    libc.mallopt({A.M_TRIM_THRESHOLD}, {A.NEVER})  # M_TRIM_THRESHOLD: never hand the heap's top back"
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
