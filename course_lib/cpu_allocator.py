"""Where a CPU tensor's memory comes from, and the one switch the course sets on it (techniques.keep_freed_memory).

PyTorch keeps no cache of CPU memory (on a GPU its caching allocator does): a CPU tensor's bytes come from the C
library's malloc and go back with free. glibc's malloc gives a block larger than its mmap threshold a mapping of its
own, unmapped again at free, and it hands the top of its heap back to the kernel once more than its trim threshold
lies free there. Both thresholds start at 128 KiB and rise with what a program frees, up to 32 and 64 MiB. A training
step's activations are such blocks: each step gets them back as fresh pages, and the kernel zeroes every 4 KiB page at
its first touch (a minor page fault). `keep_freed(True)` raises both thresholds past any tensor the course makes, so a
step reuses the memory the step before it freed.

At the bottom of the package: the training loop sets it (course_lib.techniques), the notebooks count page faults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
KEEP = 1 << 30  # both thresholds while freed memory is kept: 1 GiB, past any block the course's presets free
# glibc's own rule moves each threshold up to the largest block a program has freed, at most these: where a training
# loop's thresholds stand after its first steps. They are what "not kept" means once keep_freed(True) has been called,
# since glibc's rule, once mallopt has set a threshold, stays off for the life of the process.
GLIBC_MMAP_MAX, GLIBC_TRIM_MAX = 32 << 20, 64 << 20

_state = {"keep": None}  # None: never set in this process (glibc's own rule)


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc, or None where the C library is another (macOS, Windows, musl): mallopt's thresholds are glibc's."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def unavailable() -> str:
    """Why freed memory cannot be kept here, or "" where it can."""
    if _libc() is None:
        return (
            f"the switch is glibc's malloc (Linux); this is {platform.system()} "
            f"{platform.libc_ver()[0] or 'without glibc'}: a preloaded jemalloc or tcmalloc does the same"
        )
    return ""


def keep_freed(keep: bool) -> None:
    """Keep freed memory in the process (True), or hand it back as glibc does by default (False). Process-wide: every
    later allocation follows it, until changed. False where it was never set changes nothing."""
    libc = _libc()
    if libc is None or _state["keep"] == keep or (not keep and _state["keep"] is None):
        return
    mmap, trim = (KEEP, KEEP) if keep else (GLIBC_MMAP_MAX, GLIBC_TRIM_MAX)
    if not (libc.mallopt(M_MMAP_THRESHOLD, mmap) and libc.mallopt(M_TRIM_THRESHOLD, trim)):
        # a glibc older than 2.26 refuses a threshold above 32 MiB: the largest it takes
        libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, KEEP if keep else GLIBC_TRIM_MAX)
    _state["keep"] = keep


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
