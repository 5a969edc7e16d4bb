"""Read small text files under a root directory (``/`` live, a fixture tree in tests).

Every reader returns ``None`` instead of raising: a missing file, a driver
that answers EIO/ENODATA, or garbage all mean "this probe has no value".
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["read_text", "read_int", "read_float", "glob_dirs"]

_MAX = 64 * 1024


def _path(root: Path | str, rel: str) -> Path:
    return Path(root) / rel.lstrip("/")


def read_text(root: Path | str, rel: str) -> str | None:
    """File text without trailing whitespace or NULs (device-tree strings end in NUL)."""
    try:
        with open(_path(root, rel), "rb") as f:
            data = f.read(_MAX)
    except OSError:
        return None
    return data.decode("utf-8", "replace").strip().strip("\x00").strip()


def parse_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.split()[0]) if text.split() else None
    except ValueError:
        return None


def read_int(root: Path | str, rel: str) -> int | None:
    return parse_int(read_text(root, rel))


def read_float(root: Path | str, rel: str) -> float | None:
    text = read_text(root, rel)
    if not text:
        return None
    try:
        return float(text.split()[0])
    except ValueError:
        return None


def glob_dirs(root: Path | str, pattern: str) -> list[Path]:
    """Sorted matches of ``pattern`` (relative to root); never raises."""
    try:
        return sorted(Path(root).glob(pattern.lstrip("/")))
    except OSError:
        return []
