"""The course's cache folder: what it measures or derives once per machine (matmul peaks, the tokenized corpus).

Every entry is named or keyed by what it was computed from, so it is never read stale; deleting the folder is always
safe (the next run measures or computes again)."""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path
from typing import Callable


def cache_dir() -> Path:
    """$COURSE_CACHE_DIR, else course_lib/ in $XDG_CACHE_HOME or ~/.cache, else (no home folder: a container's user
    with no entry in the password file) course_lib-cache/ in the temporary folder."""
    if chosen := os.environ.get("COURSE_CACHE_DIR"):
        return Path(chosen)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "course_lib"
    try:
        return Path.home() / ".cache" / "course_lib"
    except (RuntimeError, KeyError):  # Path.home() with no $HOME and no password entry
        return Path(tempfile.gettempdir()) / "course_lib-cache"


def _new_partial(path: Path) -> Path:
    """An empty file of this process's own beside `path` (a random name, created exclusively: no two processes share
    one, even on a home folder several machines mount), with the permissions a new file gets here: mode 0666 under
    the umask and any default ACL, applied by the system (mkstemp's 0600 would make a shared script private)."""
    while True:
        partial = path.with_name(f"{path.name}.{secrets.token_hex(4)}.partial")
        try:
            os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return partial
        except FileExistsError:
            continue


def write_atomic(path: Path, write: Callable[[Path], None], strict: bool = False) -> None:
    """write(partial) fills a file of its own beside `path` (_new_partial), which then replaces `path` in one step:
    a process reading at the same time (another torchrun rank) sees the old state or the whole file, never half of it,
    and a write that fails (a full disk) leaves the old file as it was. A cache that cannot be written (a read-only
    or full disk, no home folder) is skipped: the value is computed again next time. `strict` (a result, not a cache)
    raises the error instead."""
    partial = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = _new_partial(path)
        write(partial)
        with contextlib.suppress(OSError):  # a file replaced keeps its permissions (where the system lets us say so)
            partial.chmod(path.stat().st_mode & 0o777)
        os.replace(partial, path)
    except BaseException as e:  # OSError, torch.save's RuntimeError, or an interrupt (Ctrl-C, SIGTERM) mid-write
        if partial is not None:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
        if strict or not isinstance(e, Exception):  # a cache is never worth a failed run; an interrupt goes on up
            raise
