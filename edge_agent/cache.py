"""Partition artifacts on disk, named by sha256, bounded in bytes, evicted least recently used.

Files are written atomically (tmp + rename) and re-hashed on read, so a torn
or tampered file is a cache miss, never a wrong model. Pinned entries (the
artifacts of running partitions) are never evicted.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

from runtime.security import sha256_hex

__all__ = ["ArtifactCache"]

log = logging.getLogger(__name__)


def _valid_sha(sha: str) -> bool:
    return len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)


class ArtifactCache:
    def __init__(self, directory: str | Path, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._sizes: OrderedDict[str, int] = OrderedDict()  # oldest use first
        self._pinned: set[str] = set()
        self.hits = self.misses = self.evictions = 0
        entries = []
        for p in self.dir.glob("*.onnx"):
            try:
                st = p.stat()
            except OSError:
                continue
            if _valid_sha(p.stem):
                entries.append((st.st_mtime, p.stem, st.st_size))
        for _, sha, size in sorted(entries):
            self._sizes[sha] = size
        for p in self.dir.glob("*.tmp"):
            p.unlink(missing_ok=True)

    @property
    def total_bytes(self) -> int:
        return sum(self._sizes.values())

    def __contains__(self, sha: object) -> bool:
        return sha in self._sizes

    def _path(self, sha: str) -> Path:
        return self.dir / f"{sha}.onnx"

    def get(self, sha: str) -> bytes | None:
        """The artifact, or None (missing, unreadable, or its bytes no longer match the name)."""
        if not _valid_sha(sha) or sha not in self._sizes:
            self.misses += 1
            return None
        try:
            data = self._path(sha).read_bytes()
        except OSError:
            data = b""
        if sha256_hex(data) != sha:
            log.warning("cache entry %s is corrupt; dropping it", sha[:12])
            self._drop(sha)
            self.misses += 1
            return None
        self._sizes.move_to_end(sha)
        try:
            os.utime(self._path(sha))
        except OSError:
            pass
        self.hits += 1
        return data

    def put(self, sha: str, data: bytes) -> bool:
        """Store verified bytes; False when they cannot fit even after evicting unpinned entries."""
        if not _valid_sha(sha) or sha256_hex(data) != sha:
            raise ValueError("cache.put needs bytes that hash to the given sha256")
        if sha in self._sizes:
            self._sizes.move_to_end(sha)
            return True
        if len(data) > self.max_bytes:
            return False
        self._evict(self.max_bytes - len(data))
        if self.total_bytes + len(data) > self.max_bytes:
            return False
        tmp = self.dir / f"{sha}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(sha))
        except OSError as exc:
            log.warning("cannot cache artifact %s: %s", sha[:12], exc)
            tmp.unlink(missing_ok=True)
            return False
        self._sizes[sha] = len(data)
        return True

    def pin(self, sha: str) -> None:
        self._pinned.add(sha)

    def unpin(self, sha: str) -> None:
        self._pinned.discard(sha)

    def _evict(self, budget: int) -> None:
        for sha in list(self._sizes):
            if self.total_bytes <= budget:
                return
            if sha not in self._pinned:
                self._drop(sha)
                self.evictions += 1

    def _drop(self, sha: str) -> None:
        self._sizes.pop(sha, None)
        self._path(sha).unlink(missing_ok=True)
