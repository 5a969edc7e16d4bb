"""Writing files so that a crash, a full disk or a reader never sees half of one (one place for it)."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["atomic_write"]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes | str, *, mode: int = 0o644, sync_dir: bool = False) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one.

    The temp file is created with ``mode`` (0o600 for secrets: never readable by others, not
    even for a moment), fsynced, then renamed; with ``sync_dir`` the rename is made durable too.
    On any failure (ENOSPC, EIO, ...) the temp file is removed before the error propagates.
    """
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # whatever the umask
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    if sync_dir:
        _fsync_dir(path.parent)
