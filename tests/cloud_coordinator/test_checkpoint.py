"""Checkpoint store: atomic replicated writes, checksums, resume choice, retention."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cloud_coordinator.policy import CheckpointPolicy, ReplicaEntry, choose_resume, to_prune
from cloud_coordinator.store import Checkpoint, CheckpointStore, QuorumError, pack, unpack
from runtime.errors import DecodeError
from runtime.security import Identity


def _ckpt(r: int, chash: str = "h1") -> Checkpoint:
    rng = np.random.default_rng(r)
    return Checkpoint(r, (rng.normal(size=(3, 4)), rng.normal(size=4).astype(np.float32)), chash,
                      {"momentum": rng.normal(size=5), "count": r, 1: "int key"},
                      {"seed": 7, "bit_generator": {"state": {"state": 2**100 + r, "inc": 3}}},
                      ({"round": r, "acc": 0.5},))


def _same(a: Checkpoint, b: Checkpoint) -> None:
    assert a.server_round == b.server_round and a.config_hash == b.config_hash
    for x, y in zip(a.weights, b.weights, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert np.array_equal(a.aggregator_state["momentum"], b.aggregator_state["momentum"])
    assert b.aggregator_state[1] == "int key"
    assert a.rng_state == b.rng_state and list(a.history) == list(b.history)


def test_pack_roundtrip_and_garbage() -> None:
    obj = {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "b": [1.5, None, b"x"], "c": np.float64(2.0)}
    out = unpack(pack(obj))
    assert np.array_equal(out["a"], obj["a"]) and out["a"].dtype == np.int16 and out["c"] == 2.0
    with pytest.raises(DecodeError):
        unpack(b"\xc7\x05\x09junk!")
    with pytest.raises(DecodeError):
        Checkpoint.from_payload(pack({"format": 1}))


def test_save_then_load_latest(tmp_path: Path) -> None:
    store = CheckpointStore([tmp_path / "a", tmp_path / "b"])
    for r in (1, 2, 3):
        rep = store.save(_ckpt(r))
        assert rep.written == (0, 1) and rep.nbytes > 0
    got, report = store.load_latest("h1")
    assert got is not None and not report.skipped
    _same(_ckpt(3), got)
    files = list((tmp_path / "a").iterdir()) + list((tmp_path / "b").iterdir())
    assert files and all(f.stat().st_mode & 0o077 == 0 for f in files)  # the weights: the owner's only


def test_keeps_last_k_and_no_temp_files(tmp_path: Path) -> None:
    store = CheckpointStore([tmp_path / "a", tmp_path / "b"], CheckpointPolicy(keep=2))
    for r in range(1, 6):
        store.save(_ckpt(r))
    for d in ("a", "b"):
        names = sorted(p.name for p in (tmp_path / d).iterdir())
        assert names == ["ckpt-00000004.bin", "ckpt-00000004.json", "ckpt-00000005.bin", "ckpt-00000005.json"]


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.write_bytes(p.read_bytes()[:-10]), "payload truncated"),
    (lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 1]) + p.read_bytes()[1:]), "checksum mismatch"),
    (lambda p: p.unlink(), "payload missing"),
    (lambda p: p.with_suffix(".json").write_text("{not json"), "manifest unreadable"),
])
def test_corrupt_replica_skipped(tmp_path: Path, damage, reason: str) -> None:  # type: ignore[no-untyped-def]
    store = CheckpointStore([tmp_path / "a", tmp_path / "b", tmp_path / "c"])  # quorum 2 of 3
    store.save(_ckpt(1))
    store.save(_ckpt(2))
    damage(tmp_path / "a" / "ckpt-00000002.bin")
    got, report = store.load_latest("h1")
    assert got is not None and got.server_round == 2  # from replicas b and c
    assert [(e.replica, e.server_round, e.reason) for e in report.skipped] == [(0, 2, reason)]
    # with two replicas the quorum is both: one damaged copy means round 1, never a half-verified 2
    two = CheckpointStore([tmp_path / "a", tmp_path / "b"])
    assert two.load_latest("h1")[0].server_round == 1  # type: ignore[union-attr]


def test_both_replicas_corrupt_falls_back_to_older_round(tmp_path: Path) -> None:
    store = CheckpointStore([tmp_path / "a", tmp_path / "b"])
    store.save(_ckpt(1))
    store.save(_ckpt(2))
    for d in ("a", "b"):
        p = tmp_path / d / "ckpt-00000002.bin"
        p.write_bytes(p.read_bytes()[:20])
    got, report = store.load_latest("h1")
    assert got is not None and got.server_round == 1 and len(report.skipped) == 2


def test_other_config_not_resumed(tmp_path: Path) -> None:
    store = CheckpointStore([tmp_path / "a"], CheckpointPolicy(quorum=1))
    store.save(_ckpt(4, chash="other"))
    assert store.load_latest("h1")[0] is None
    assert store.load_latest(None)[0] is not None


def test_stray_temp_file_ignored_and_cleaned(tmp_path: Path) -> None:
    store = CheckpointStore([tmp_path / "a", tmp_path / "b"])
    store.save(_ckpt(1))
    (tmp_path / "a" / ".ckpt-00000002.bin.tmp-123").write_bytes(b"half")  # crash mid-write
    assert store.load_latest("h1")[0].server_round == 1  # type: ignore[union-attr]
    store.save(_ckpt(2))
    assert not list((tmp_path / "a").glob(".*tmp*"))


def test_quorum(tmp_path: Path) -> None:
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where a directory should be")
    store = CheckpointStore([tmp_path / "a", tmp_path / "b"])
    store.dirs = (tmp_path / "a", blocker / "sub")  # second replica unwritable
    with pytest.raises(QuorumError):
        store.save(_ckpt(1))
    assert not list((tmp_path / "a").glob("ckpt-*"))  # the lone copy was rolled back
    store3 = CheckpointStore([tmp_path / "c", tmp_path / "d", tmp_path / "e"])
    store3.dirs = (tmp_path / "c", tmp_path / "d", blocker / "sub")
    rep = store3.save(_ckpt(1))
    assert rep.written == (0, 1) and 2 in rep.failed


def test_signed_checkpoints(tmp_path: Path) -> None:
    ident = Identity.from_seed("coordinator", b"seed")
    store = CheckpointStore([tmp_path / "a"], identity=ident)
    store.save(_ckpt(1))
    assert store.load_latest("h1")[0] is not None
    other = CheckpointStore([tmp_path / "a"], trusted_key=Identity.from_seed("x", b"y").public_key_bytes)
    got, report = other.load_latest("h1")
    assert got is None and report.skipped[0].reason == "bad signature"
    unsigned = CheckpointStore([tmp_path / "u"])
    unsigned.save(_ckpt(1))
    strict = CheckpointStore([tmp_path / "u"], trusted_key=ident.public_key_bytes)
    assert strict.load_latest("h1")[1].skipped[0].reason == "unsigned"


@pytest.mark.parametrize("entries, quorum, want", [
    ([], 1, None),
    ([ReplicaEntry(0, 3, "h", False, "x"), ReplicaEntry(1, 2, "h", True)], 1, (1, 2)),
    ([ReplicaEntry(1, 3, "h", True), ReplicaEntry(0, 3, "h", True)], 1, (0, 3)),
    ([ReplicaEntry(0, 9, "other", True), ReplicaEntry(0, 1, "h", True)], 1, (0, 1)),
    # quorum 2: a round in one replica only (or with two different payloads) does not count
    ([ReplicaEntry(0, 5, "h", True, sha256="x"), ReplicaEntry(0, 4, "h", True, sha256="y"),
      ReplicaEntry(1, 4, "h", True, sha256="y")], 2, (0, 4)),
    ([ReplicaEntry(0, 5, "h", True, sha256="x"), ReplicaEntry(1, 5, "h", True, sha256="z")], 2, None),
])
def test_choose_resume(entries: list[ReplicaEntry], quorum: int, want: tuple[int, int] | None) -> None:
    got = choose_resume(entries, "h", quorum)
    assert (None if got is None else (got.replica, got.server_round)) == want


def test_quorum_larger_than_replicas_is_an_error(tmp_path: Path) -> None:
    from runtime.errors import LocalViolation

    with pytest.raises(LocalViolation, match="quorum 2 is larger than the 1 replica directory"):
        CheckpointStore([tmp_path / "a"], CheckpointPolicy(quorum=2))
    assert CheckpointStore([tmp_path / "a"]).quorum == 1  # default: a majority of what there is


def test_to_prune() -> None:
    assert to_prune([1, 2, 3, 4], 2) == [1, 2]
    assert to_prune([3], 2) == []
