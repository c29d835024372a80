"""Where a CPU tensor's memory comes from (glibc's malloc: PyTorch caches none on a CPU), and the one switch the
course sets on it. glibc gives a block above its mmap threshold (at most 32 MiB) a mapping of its own, unmapped at free,
and trims the heap's free top, so a step's large tensors come back as fresh pages the kernel maps and zeroes, a page
fault each; `keep_freed(True)` turns both off (mallopt). Notebook 02 counts the faults (in fresh processes)."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
GLIBC_MMAP_MAX_COUNT = 65536  # M_MMAP_MAX's default: how many blocks may have mappings of their own
# The most glibc's own rule raises the thresholds to: "not kept" once a mallopt has turned that rule off for good
GLIBC_MMAP_THRESHOLD_MAX, GLIBC_TRIM_THRESHOLD_MAX = 32 << 20, 64 << 20
NEVER = -1  # M_TRIM_THRESHOLD -1: never trim the heap (man mallopt)

_state = {"keep": None}  # None: never set in this process (glibc's own rule)


def is_glibc() -> bool:
    """Whether this process's C library is glibc, whose mallopt keeps freed memory."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or no such name (macOS, musl)
        return False


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL("libc.so.6") if is_glibc() else None


def unavailable(device: str | torch.device = "cpu") -> str:
    """Why freed memory cannot be kept for a run on `device`, or "" where it can (the one check everything asks)."""
    if torch.device(device).type != "cpu":
        return "nothing to do on a GPU: PyTorch's caching allocator already keeps freed GPU memory for reuse"
    if _libc() is None:
        return (
            "the switch is glibc's malloc (Linux), and this system's C library is another: a preloaded jemalloc or "
            "tcmalloc keeps freed memory instead"
        )
    return ""


def keep_freed(keep: bool) -> None:
    """Keep freed memory in the process (True), or stop (False: glibc's largest thresholds, the heap's free memory
    handed back now; glibc's own rule cannot be had back). Process-wide; a no-op without glibc or when unchanged."""
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
    """Why a run that does not keep freed memory is not timed as glibc runs it by default (this process kept it
    earlier), or ""."""
    if keep or _state["keep"] is None or unavailable(device):
        return ""
    return (
        "this process kept freed memory in an earlier run, and glibc's own rule for handing it back cannot be had "
        "back: timed with glibc's largest thresholds instead (restart the kernel to time it as glibc runs it)"
    )


def keeping() -> bool:
    """Whether freed memory is being kept now."""
    return bool(_state["keep"])


def give_back() -> None:
    """Hand the heap's free memory back to the kernel now (between runs: no run starts with another's memory held)."""
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)


def page_faults() -> int | None:
    """Minor page faults of this process so far (pages mapped and zeroed at first touch); None on Windows."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
