"""The course's cache folder (matmul peaks, the tokenized corpus: each entry named by what it was computed from, so
never stale; deleting it is always safe), and write_atomic, through which every file the course writes goes."""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path
from typing import Callable


def cache_dir() -> Path:
    """$COURSE_CACHE_DIR, else course_lib/ in $XDG_CACHE_HOME or ~/.cache, else (no home folder) in the temp folder."""
    if chosen := os.environ.get("COURSE_CACHE_DIR"):
        return Path(chosen)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "course_lib"
    try:
        return Path.home() / ".cache" / "course_lib"
    except (RuntimeError, KeyError):  # no $HOME and no password entry (a container's user)
        return Path(tempfile.gettempdir()) / "course_lib-cache"


def _new_partial(path: Path) -> Path:
    """An empty file of this process's own beside `path`: a random name created exclusively (no two processes share
    it), mode 0666 under the umask like any new file (mkstemp's 0600 would make a shared script private)."""
    while True:
        partial = path.with_name(f"{path.name}.{secrets.token_hex(4)}.partial")
        with contextlib.suppress(FileExistsError):
            os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return partial


def write_atomic(path: Path, write: Callable[[Path], None], strict: bool = False) -> None:
    """write(partial) fills a file beside `path` that then replaces it in one step: a reader (another rank) sees the
    old file or the whole new one, and a failed write leaves the old one. A cache that cannot be written is skipped
    (computed again next time); `strict` (a result, not a cache) raises instead."""
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
