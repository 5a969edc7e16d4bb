"""Artifact cache: LRU by bytes, pinned entries, corruption is a miss, survives restart."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from edge_agent.cache import ArtifactCache


def blob(i: int, size: int = 1000) -> tuple[str, bytes]:
    data = bytes([i]) * size
    return hashlib.sha256(data).hexdigest(), data


def test_lru_eviction_by_bytes(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path, max_bytes=3000)
    items = [blob(i) for i in range(4)]
    for sha, data in items[:3]:
        assert c.put(sha, data)
    assert c.get(items[0][0]) == items[0][1]  # 0 is now most recent
    assert c.put(*items[3])
    assert items[1][0] not in c and items[0][0] in c and c.total_bytes == 3000
    assert c.evictions == 1


def test_pinned_entries_stay(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path, max_bytes=2000)
    a, b, d = blob(1), blob(2), blob(3)
    c.put(*a)
    c.put(*b)
    c.pin(a[0])
    c.pin(b[0])
    assert not c.put(*d)  # nothing evictable
    c.unpin(a[0])
    assert c.put(*d) and a[0] not in c and b[0] in c


def test_too_big_and_wrong_hash(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path, max_bytes=100)
    assert not c.put(*blob(1, 101))
    with pytest.raises(ValueError):
        c.put("0" * 64, b"abc")


def test_corrupt_file_is_a_miss_and_restart_keeps_entries(tmp_path: Path) -> None:
    c = ArtifactCache(tmp_path, max_bytes=10_000)
    a, b = blob(1), blob(2)
    c.put(*a)
    c.put(*b)
    (tmp_path / f"{a[0]}.onnx").write_bytes(b"tampered")
    (tmp_path / "junk.tmp").write_bytes(b"x")
    c2 = ArtifactCache(tmp_path, max_bytes=10_000)
    assert c2.get(a[0]) is None and a[0] not in c2
    assert c2.get(b[0]) == b[1]
    assert not (tmp_path / "junk.tmp").exists()
    assert c2.get("not-a-sha") is None
