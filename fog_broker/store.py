"""What a fog broker keeps across restarts: its desired state in SQLite and the model releases it follows.

``Store``: workloads (versioned), quotas, assignments, counters. One connection,
used by the service's owner thread only. Writes are single transactions; WAL
mode so a kill -9 never leaves a torn database.

``ReleaseBook``: model releases signed by a pinned coordinator, bound to it,
only forward (``release:NAME`` workloads run the newest accepted release of
NAME). The decision is ``fog_broker.trust.decide_release``; the book checks the
artifact signature and keeps ``releases.json`` (atomically); the bytes are the
artifact store's. The site core keeps the same releases as state
(``ReleaseAccepted``) and switches the workloads that follow one.
"""
from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import SecurityError
from runtime.files import atomic_write
from runtime.messages import ModelRelease
from runtime.security import ArtifactSignature, verify_artifact

from .trust import decide_release

__all__ = ["Store", "StoredWorkload", "StoredAssignment", "ReleaseBook"]

log = logging.getLogger("fog_broker.store")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS workloads (
    name TEXT PRIMARY KEY,
    version INTEGER NOT NULL,
    spec TEXT NOT NULL,
    profile TEXT,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS quotas (
    tenant TEXT PRIMARY KEY,
    memory_bytes REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS assignments (
    workload TEXT NOT NULL,
    version INTEGER NOT NULL,
    replica INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    first INTEGER NOT NULL,
    last INTEGER NOT NULL,
    device TEXT NOT NULL,
    sha256 TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (workload, version, replica, idx)
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


@dataclass(frozen=True, slots=True)
class StoredWorkload:
    name: str
    version: int
    spec: dict[str, Any]
    profile: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class StoredAssignment:
    workload: str
    version: int
    replica: int
    index: int
    first: int
    last: int
    device: str
    sha256: str


class Store:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    # ------------------------------------------------------------ meta

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else default

    def set_meta(self, key: str, value: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    def next_epoch(self) -> int:
        """Increment and return the fog's connect epoch (commands of a new run are never stale)."""
        epoch = int(self.get_meta("epoch", "0") or 0) + 1
        self.set_meta("epoch", str(epoch))
        return epoch

    # ------------------------------------------------------------ workloads

    def put_workload(self, spec: dict[str, Any], profile: dict[str, Any] | None, now: float, *,
                     new_model: bool = False) -> int:
        """Store a workload spec; a changed spec gets the next version, an identical one keeps its own
        unless ``new_model``: the same text resolving to other model bytes (``release:NAME``)."""
        name = spec["name"]
        text = json.dumps(spec, sort_keys=True)
        ptext = json.dumps(profile, sort_keys=True) if profile is not None else None
        row = self._db.execute("SELECT version, spec, profile FROM workloads WHERE name=?", (name,)).fetchone()
        if row is not None and row[1] == text and row[2] == ptext and not new_model:
            return int(row[0])
        version = int(row[0]) + 1 if row is not None else 1
        self._db.execute("INSERT OR REPLACE INTO workloads(name, version, spec, profile, updated) "
                         "VALUES (?, ?, ?, ?, ?)", (name, version, text, ptext, now))
        return version

    def delete_workload(self, name: str) -> bool:
        with self._db:
            cur = self._db.execute("DELETE FROM workloads WHERE name=?", (name,))
            self._db.execute("DELETE FROM assignments WHERE workload=?", (name,))
        return cur.rowcount > 0

    def workloads(self) -> list[StoredWorkload]:
        rows = self._db.execute("SELECT name, version, spec, profile FROM workloads ORDER BY name").fetchall()
        return [StoredWorkload(n, int(v), json.loads(s), json.loads(p) if p else None) for n, v, s, p in rows]

    # ------------------------------------------------------------ quotas

    def put_quotas(self, quotas: dict[str, float]) -> None:
        with self._db:
            for tenant, mem in quotas.items():
                self._db.execute("INSERT OR REPLACE INTO quotas(tenant, memory_bytes) VALUES (?, ?)",
                                 (tenant, float(mem)))

    def quotas(self) -> dict[str, float]:
        return {t: float(m) for t, m in self._db.execute("SELECT tenant, memory_bytes FROM quotas")}

    # ------------------------------------------------------------ assignments

    def replace_assignments(self, workload: str, rows: Iterable[StoredAssignment]) -> None:
        with self._db:
            self._db.execute("DELETE FROM assignments WHERE workload=?", (workload,))
            self._db.executemany(
                "INSERT INTO assignments(workload, version, replica, idx, first, last, device, sha256) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(r.workload, r.version, r.replica, r.index, r.first, r.last, r.device, r.sha256)
                 for r in rows])

    def assignments(self) -> list[StoredAssignment]:
        rows = self._db.execute("SELECT workload, version, replica, idx, first, last, device, sha256 "
                                "FROM assignments ORDER BY workload, version, replica, idx").fetchall()
        return [StoredAssignment(*r) for r in rows]


class ReleaseBook:
    """The accepted releases by name: {version, model ref, signer, metadata}; persisted atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.releases: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:
            log.error("%s is unreadable; starting with no releases", path)
            self.releases = {}

    def check(self, msg: ModelRelease, pinned: Mapping[str, bytes]) -> str:
        """'' when ``msg`` should be accepted, else the counted reason it is not."""
        known = self.releases.get(msg.workload)
        verdict = decide_release(msg.workload, msg.version, msg.signer, pinned,
                                 known["signer"] if known else None, known["version"] if known else None)
        if not verdict.accept:
            return verdict.reason
        try:
            verify_artifact(pinned[msg.signer], msg.artifact,
                            ArtifactSignature(msg.sha256, msg.signer, msg.signature, dict(msg.metadata)))
        except SecurityError as exc:
            return f"bad signature ({exc.reason})"
        # The signature covers the metadata, not the message's own name and version fields: a
        # captured release resent as v999999999, or under another name, must not pass as one.
        if msg.metadata.get("workload") != msg.workload or msg.metadata.get("version") != str(msg.version):
            return "relabelled (name or version differ from the signed ones)"
        return ""

    def accept(self, msg: ModelRelease, ref: str) -> None:
        self.releases[msg.workload] = {"version": msg.version, "model": ref, "signer": msg.signer,
                                       "metadata": {k: v for k, v in msg.metadata.items() if k != "public_key"}}
        atomic_write(self.path, json.dumps(self.releases, indent=1))

    def get(self, name: str) -> dict[str, Any] | None:
        return self.releases.get(name)

    def refs(self) -> set[str]:
        return {r["model"] for r in self.releases.values()}

    def view(self) -> dict[str, Any]:
        return {n: {**r["metadata"], "version": r["version"], "signer": r["signer"], "model": r["model"]}
                for n, r in self.releases.items()}
