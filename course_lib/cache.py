"""The course's cache folder: what it measures or derives once per machine (matmul peaks, the tokenized corpus).

Every entry is named or keyed by what it was computed from, so it is never read stale; deleting the folder is always
safe (the next run measures or computes again)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable


def cache_dir() -> Path:
    """$COURSE_CACHE_DIR, else course_lib/ in $XDG_CACHE_HOME or ~/.cache (Path.home() raises where there is no home
    folder: callers treat that as no cache)."""
    if chosen := os.environ.get("COURSE_CACHE_DIR"):
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "course_lib"


def _mode_for(path: Path) -> int:
    """The permissions `path` has, or a new file's under this process's umask (rw-r--r-- under the usual 022)."""
    with contextlib.suppress(OSError):
        return path.stat().st_mode & 0o777
    umask = os.umask(0)  # only readable by setting it: set back at once
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path: Path, write: Callable[[Path], None], strict: bool = False) -> None:
    """write(partial) fills a file of its own beside `path` (named by tempfile: no two processes share one, even on a
    home folder several machines mount), which then replaces `path` in one step: a process reading at the same time
    (another torchrun rank) sees the old state or the whole file, never half of it, and a write that fails (a full
    disk) leaves the old file as it was. A cache that cannot be written (a read-only or full disk, no home folder) is
    skipped: the value is computed again next time. `strict` (a result, not a cache) raises the error instead."""
    partial = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".partial")
        os.close(fd)
        partial = Path(name)
        partial.chmod(_mode_for(path))  # mkstemp's 0600 would make a shared script or result private
        write(partial)
        os.replace(partial, path)
    except Exception:  # noqa: BLE001 - OSError, or torch.save's RuntimeError: a cache is never worth a failed run
        if partial is not None:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
        if strict:
            raise
