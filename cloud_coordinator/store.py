"""Replicated, checksummed, atomic checkpoint files: the thin I/O shell over ``policy``.

Each replica directory holds pairs ``ckpt-00000007.bin`` (msgpack payload,
numpy arrays as an ext type) and ``ckpt-00000007.json`` (manifest: round,
size, sha256, config hash, Ed25519 signature). Both are written temp file ->
fsync -> rename -> fsync(dir), payload first, so a manifest never names a
payload that is not fully on disk; a failed write (ENOSPC, EIO) removes its
temp file, and a save that misses its quorum removes what it wrote, so no
half-written checkpoint stays behind. A checkpoint counts only if its payload
hashes to the manifest's sha256 and the signature holds under the trusted key,
and a resume takes only a round whose identical payload verifies in a quorum
of replicas: one truncated, bit-flipped or forged replica never wins.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from runtime.errors import DecodeError, FoglineError, LocalViolation, RemoteViolation, SecurityError
from runtime.files import atomic_write as _atomic_write
from runtime.security import ArtifactSignature, Identity, sign_artifact, verify_artifact

from .policy import CheckpointPolicy, ReplicaEntry, choose_resume, to_prune
from .settings import REPORT_FILE

__all__ = ["Checkpoint", "SaveReport", "ScanReport", "CheckpointStore", "QuorumError",
           "pack", "unpack", "atomic_write", "REPORT_FILE"]

log = logging.getLogger(__name__)

FORMAT = 1
_EXT_NDARRAY = 7
_EXT_BIGINT = 8
_NAME = re.compile(r"^ckpt-(\d{8})\.json$")


class QuorumError(FoglineError):
    """Fewer replicas than the quorum took a checkpoint: the round is not durable."""


# ---------------------------------------------------------------- payload codec


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise LocalViolation(f"cannot checkpoint arrays of dtype {obj.dtype}")
        arr = np.ascontiguousarray(obj)
        return msgpack.ExtType(_EXT_NDARRAY, msgpack.packb([arr.dtype.str, list(arr.shape)]) + arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, int):  # beyond 64 bits, e.g. a PCG64 generator state
        return msgpack.ExtType(_EXT_BIGINT, str(obj).encode())
    if isinstance(obj, tuple):
        return list(obj)
    raise LocalViolation(f"cannot checkpoint a {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_BIGINT:
        return int(data.decode())
    if code != _EXT_NDARRAY:
        raise DecodeError(f"unknown ext type {code}")
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    dtype_s, shape = unpacker.unpack()
    head = unpacker.tell()
    dtype = np.dtype(dtype_s)
    if dtype.kind not in "biuf":
        raise DecodeError(f"dtype {dtype_s!r} not allowed")
    return np.frombuffer(data, dtype=dtype, offset=head).reshape(shape).copy()


def pack(obj: Any) -> bytes:
    """msgpack with numpy arrays (dtype, shape, raw bytes): no pickle."""
    data: bytes = msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=False)
    return data


def unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except DecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed payload is one error type
        raise DecodeError(f"undecodable checkpoint payload ({type(exc).__name__})") from None


# ---------------------------------------------------------------- values


@dataclass(frozen=True, slots=True, eq=False)
class Checkpoint:
    """The coordinator's durable state after a round: enough to continue bit for bit."""

    server_round: int
    weights: tuple[np.ndarray, ...]
    config_hash: str
    aggregator_state: dict[str, Any] = field(default_factory=dict)
    rng_state: dict[str, Any] = field(default_factory=dict)
    history: tuple[dict[str, Any], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    names: tuple[str, ...] = ()  # the ArrayRecord's keys, in order (empty: a plain list of arrays)

    def to_payload(self) -> bytes:
        return pack({"format": FORMAT, "round": self.server_round, "weights": list(self.weights),
                     "config_hash": self.config_hash, "aggregator_state": self.aggregator_state,
                     "rng_state": self.rng_state, "history": list(self.history), "extra": self.extra,
                     "names": list(self.names)})

    @classmethod
    def from_payload(cls, data: bytes) -> Checkpoint:
        d = unpack(data)
        try:
            if d["format"] != FORMAT:
                raise DecodeError(f"checkpoint format {d['format']} not supported")
            names = tuple(str(n) for n in d.get("names") or ())
            weights = tuple(d["weights"])
            if names and len(names) != len(weights):
                raise DecodeError("checkpoint names do not match its arrays")
            return cls(int(d["round"]), weights, str(d["config_hash"]),
                       dict(d["aggregator_state"] or {}), dict(d["rng_state"] or {}),
                       tuple(d["history"]), dict(d.get("extra") or {}), names)
        except (KeyError, TypeError, ValueError) as exc:
            raise DecodeError(f"malformed checkpoint: {exc}") from None


@dataclass(frozen=True, slots=True)
class SaveReport:
    server_round: int
    written: tuple[int, ...]
    failed: dict[int, str]
    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ScanReport:
    entries: tuple[ReplicaEntry, ...]

    @property
    def skipped(self) -> tuple[ReplicaEntry, ...]:
        return tuple(e for e in self.entries if not e.ok)


# ---------------------------------------------------------------- files


def atomic_write(path: Path, data: bytes, *, sync_dir: bool = True, mode: int = 0o644) -> None:
    """``runtime.files.atomic_write``, durable by default (a checkpoint must survive a power cut)."""
    _atomic_write(path, data, mode=mode, sync_dir=sync_dir)


class CheckpointStore:
    """Checkpoints in several directories (replicas); a save needs ``quorum`` of them, and so does a resume.

    With an ``identity`` every checkpoint is signed and, unless another ``trusted_key``
    is given, only checkpoints signed by it are resumed from.
    """

    def __init__(self, dirs: Sequence[str | Path], policy: CheckpointPolicy | None = None, *,
                 identity: Identity | None = None, trusted_key: bytes | None = None) -> None:
        if not dirs:
            raise LocalViolation("a checkpoint store needs at least one directory")
        self.dirs = tuple(Path(d) for d in dirs)
        if len({p.resolve() for p in self.dirs}) != len(self.dirs):
            raise LocalViolation("checkpoint replicas must be distinct directories")
        self.policy = policy or CheckpointPolicy()
        self.quorum = self.policy.quorum_for(len(self.dirs))
        self.identity = identity
        self.trusted_key = trusted_key if trusted_key is not None else (
            identity.public_key_bytes if identity else None)
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _names(server_round: int) -> tuple[str, str]:
        stem = f"ckpt-{server_round:08d}"
        return stem + ".bin", stem + ".json"

    def save(self, ckpt: Checkpoint) -> SaveReport:
        """Write to every replica; raise ``QuorumError`` if fewer than ``quorum`` succeeded."""
        t0 = time.perf_counter()
        payload = ckpt.to_payload()
        sha = hashlib.sha256(payload).hexdigest()
        manifest: dict[str, Any] = {"format": FORMAT, "round": ckpt.server_round, "size": len(payload),
                                    "sha256": sha, "config_hash": ckpt.config_hash,
                                    "created": time.time()}
        if self.identity is not None:
            sig = sign_artifact(self.identity, payload,
                                {"round": ckpt.server_round, "config_hash": ckpt.config_hash})
            manifest["signature"] = sig.to_dict()
        bin_name, json_name = self._names(ckpt.server_round)
        mbytes = json.dumps(manifest, sort_keys=True, indent=1).encode()
        written: list[int] = []
        failed: dict[int, str] = {}
        for i, d in enumerate(self.dirs):
            try:
                d.mkdir(parents=True, exist_ok=True)
                # the model's weights are the coordinator's alone (they were world-readable)
                atomic_write(d / bin_name, payload, sync_dir=False, mode=0o600)
                atomic_write(d / json_name, mbytes, mode=0o600)
                written.append(i)
            except OSError as exc:
                failed[i] = f"{type(exc).__name__}: {exc.strerror or exc}"
                log.warning("checkpoint round %d: replica %s failed: %s", ckpt.server_round, d, failed[i])
                self._remove(d, ckpt.server_round)  # a payload whose manifest failed
        if len(written) < self.quorum:
            for i in written:  # not durable: leave no checkpoint a resume could half-trust
                self._remove(self.dirs[i], ckpt.server_round)
            detail = "; ".join(f"{self.dirs[i]}: {why}" for i, why in failed.items())
            raise QuorumError(f"checkpoint of round {ckpt.server_round} reached {len(written)} of the "
                              f"{self.quorum} replicas it needs ({detail})")
        for i in written:
            self._prune(self.dirs[i])
        return SaveReport(ckpt.server_round, tuple(written), failed, len(payload),
                          time.perf_counter() - t0)

    def rounds_in(self, d: Path) -> list[int]:
        """Rounds with a checkpoint file in replica directory ``d`` (unverified), oldest first."""
        try:
            return sorted(int(m.group(1)) for p in d.iterdir() if (m := _NAME.match(p.name)))
        except OSError:
            return []

    def _remove(self, d: Path, server_round: int) -> None:
        for name in reversed(self._names(server_round)):  # manifest first: never a manifest without payload
            try:
                (d / name).unlink()
            except OSError:
                pass

    def _prune(self, d: Path) -> None:
        for r in to_prune(self.rounds_in(d), self.policy.keep):
            self._remove(d, r)
        for stray in d.glob(".ckpt-*.tmp-*"):
            try:
                stray.unlink()
            except OSError:
                pass

    def verify(self, i: int, server_round: int) -> tuple[ReplicaEntry, bytes | None]:
        """Replica ``i``'s checkpoint of ``server_round`` checked as a resume checks it (entry, payload or None)."""
        d = self.dirs[i]
        bin_name, json_name = self._names(server_round)

        def bad(reason: str, chash: str = "") -> tuple[ReplicaEntry, None]:
            return ReplicaEntry(i, server_round, chash, False, reason), None

        try:
            m = json.loads((d / json_name).read_bytes())
            chash, sha, size = str(m["config_hash"]), str(m["sha256"]), int(m["size"])
            if int(m["round"]) != server_round:
                return bad("manifest round mismatch", chash)
        except (OSError, ValueError, KeyError, TypeError):
            return bad("manifest unreadable")
        try:
            payload = (d / bin_name).read_bytes()
        except OSError:
            return bad("payload missing", chash)
        if len(payload) != size:
            return bad("payload truncated" if len(payload) < size else "payload size mismatch", chash)
        if hashlib.sha256(payload).hexdigest() != sha:
            return bad("checksum mismatch", chash)
        if self.trusted_key is not None:
            if "signature" not in m:
                return bad("unsigned", chash)
            try:
                sig = ArtifactSignature.from_dict(m["signature"])
                if sig.metadata != {"round": server_round, "config_hash": chash}:
                    return bad("signed for another round", chash)
                verify_artifact(self.trusted_key, payload, sig)
            except (SecurityError, RemoteViolation, TypeError):
                return bad("bad signature", chash)
        return ReplicaEntry(i, server_round, chash, True, sha256=sha), payload

    def scan(self) -> ScanReport:
        """Verify every checkpoint in every replica (reads and hashes each payload)."""
        entries = [self.verify(i, r)[0] for i, d in enumerate(self.dirs) for r in self.rounds_in(d)]
        return ScanReport(tuple(entries))

    def load_latest(self, config_hash: str | None = None) -> tuple[Checkpoint | None, ScanReport]:
        """The newest checkpoint verified in a quorum of replicas, and what was skipped on the way."""
        report = self.scan()
        entries = list(report.entries)
        while (best := choose_resume(entries, config_hash, self.quorum)) is not None:
            entry, payload = self.verify(best.replica, best.server_round)
            if payload is not None and entry.sha256 == best.sha256:
                try:
                    return Checkpoint.from_payload(payload), report
                except DecodeError as exc:
                    log.warning("checkpoint %s in %s: %s", best.server_round, self.dirs[best.replica], exc)
            entries = [e for e in entries if (e.server_round, e.sha256) != (best.server_round, best.sha256)]
        return None, report
