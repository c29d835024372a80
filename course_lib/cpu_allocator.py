"""Where a CPU tensor's memory comes from, and the one switch the course sets on it (techniques.keep_freed_memory).

PyTorch keeps no cache of CPU memory (on a GPU its caching allocator does): a CPU tensor's bytes come from the C
library's malloc and go back with free. glibc's malloc gives a block larger than its mmap threshold a mapping of its
own, unmapped again at free, and it hands the top of its heap back to the kernel once more than its trim threshold
lies free there. Both thresholds start at 128 KiB; glibc's own rule raises them to the largest mapped block a program
has freed, at most 32 and 64 MiB. So a step's blocks above 32 MiB (the cpu preset's 64 MiB logits and their gradient),
and what its frees leave at the heap's top, go back to the kernel, and the next step gets them as fresh pages that the
kernel maps and zeroes at their first touch, one page fault per page (4 KiB, or 2 MiB where transparent huge pages
back them). `keep_freed(True)` turns off both (mallopt: no block of the main heap gets a mapping of its own, the heap is
never trimmed; a thread's arena still maps a block too large for its heap), so a step reuses the memory the steps before
it freed. The heap settles over a few steps after the switch (what else is allocated in between splits the freed
blocks), so its page faults fall to none only then: notebook 02 counts them on your machine.

At the bottom of the package: the training loop sets it (course_lib.techniques), the notebooks and `profile` count page
faults.
"""

from __future__ import annotations

import ctypes
import functools

import torch

# mallopt's parameters (malloc.h) and glibc's defaults for them
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
GLIBC_MMAP_MAX_COUNT = 65536  # M_MMAP_MAX's default: how many blocks may have mappings of their own
# Where glibc's own rule takes the two thresholds at most. After a mallopt that rule stays off for the life of the
# process, so once freed memory has been kept, "not kept" is these: not what glibc's rule would have reached (for the
# cpu preset's naive step, whose largest freed block of 32 MiB or less is 16 MiB, it stops at 16 and 32 MiB), which is
# why the switch is timed in fresh processes (course_lib.lessons.fresh_processes), not step for step in one.
GLIBC_MMAP_THRESHOLD_MAX, GLIBC_TRIM_THRESHOLD_MAX = 32 << 20, 64 << 20
NEVER = -1  # M_TRIM_THRESHOLD -1: never trim the heap (man mallopt)

_state = {"keep": None}  # None: never set in this process (glibc's own rule)


# (the exported script has this function, rendered from here: techniques.keep_freed_memory.export)
def is_glibc() -> bool:
    """Whether this process's C library is glibc, whose mallopt keeps freed memory."""
    import os

    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or no such name (macOS, musl)
        return False


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc, or None where the C library is another (macOS, Windows, musl)."""
    return ctypes.CDLL("libc.so.6") if is_glibc() else None


def unavailable(device: str | torch.device = "cpu", here: bool = True) -> str:
    """Why freed memory cannot be kept for a run on `device`, or "" where it can: the one check the capabilities, the
    loop, the exported script, `profile` and the notebooks ask. `here=False`: for a script that will run elsewhere,
    only the device counts (the script checks its own C library)."""
    if torch.device(device).type != "cpu":
        return "nothing to do on a GPU: PyTorch's caching allocator already keeps freed GPU memory for reuse"
    if here and _libc() is None:
        return (
            "the switch is glibc's malloc (Linux), and this system's C library is another: a preloaded jemalloc or "
            "tcmalloc keeps freed memory instead"
        )
    return ""


def keep_freed(keep: bool) -> None:
    """Keep freed memory in the process (True), or stop keeping it (False: glibc's thresholds at the largest its own
    rule reaches, and what the heap holds free handed back to the kernel now). Not glibc's own rule again: that cannot
    be had back, and the heap's free blocks stay in it to be reused, so compare the two in fresh processes
    (course_lib.lessons.fresh_processes). Process-wide: every later allocation follows it, until changed. False where
    it was never set changes nothing. A no-op without glibc."""
    libc = _libc()
    if libc is None or _state["keep"] == keep or (not keep and _state["keep"] is None):
        return
    if keep:
        libc.mallopt(M_MMAP_MAX, 0)
        libc.mallopt(M_TRIM_THRESHOLD, NEVER)
    else:
        libc.mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX_COUNT)
        libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD_MAX)
        libc.malloc_trim(0)
    _state["keep"] = keep


def not_glibcs_own_rule(device: str | torch.device, keep: bool) -> str:
    """Why a run on `device` that does not keep freed memory is not timed as glibc runs it by default, or "": this
    process kept freed memory earlier (a panel's or a notebook's run), and glibc's own rule cannot be had back."""
    if keep or _state["keep"] is None or unavailable(device):
        return ""
    return (
        "this process kept freed memory in an earlier run, and glibc's own rule for handing it back cannot be had "
        "back: this run was timed with glibc's largest thresholds instead (restart the kernel to time it as glibc "
        "runs it)"
    )


def keeping() -> bool:
    """Whether freed memory is being kept now (keep_freed(True) was the last call)."""
    return bool(_state["keep"])


def give_back() -> None:
    """Hand the free memory the heap holds back to the kernel now (between runs: a run must not start with another
    one's memory held, nor count on it)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def page_faults() -> int | None:
    """Minor page faults of this process so far: pages the kernel mapped in (and zeroed) at their first touch. None
    where the operating system does not count them for Python (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
