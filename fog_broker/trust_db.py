"""The site's trust records in SQLite (``FOGDIR/trust.db``): tokens, devices, other identities.

Several processes use it at once: the running ``fogline broker`` (enrolment
server, ingest) and the admin commands (``fogline token create``,
``fogline devices approve``, ``fogline operators add``) against the same
data dir. WAL mode and short transactions make that safe; ``version()``
changes whenever any connection commits, so the broker notices an approval
without a side channel. Decisions are made in ``fog_broker.trust``.
"""
from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .trust import DeviceRecord, Token

__all__ = ["TrustDB", "IdentityRecord", "TRUST_DB"]

TRUST_DB = "trust.db"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tokens (
    id TEXT PRIMARY KEY, secret_sha256 TEXT NOT NULL, expires_at REAL NOT NULL,
    uses_left INTEGER NOT NULL, auto_approve INTEGER NOT NULL, created_at REAL NOT NULL,
    description TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS devices (
    device_id TEXT PRIMARY KEY, state TEXT NOT NULL, signing_key BLOB NOT NULL,
    tls_key_sha256 TEXT NOT NULL, token_id TEXT NOT NULL, requested_at REAL NOT NULL,
    csr_pem BLOB NOT NULL, cert_pem BLOB NOT NULL, serial TEXT NOT NULL,
    decided_at REAL NOT NULL, reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS identities (
    name TEXT PRIMARY KEY, role TEXT NOT NULL, signing_key BLOB NOT NULL,
    serial TEXT NOT NULL, created_at REAL NOT NULL, revoked INTEGER NOT NULL DEFAULT 0
);
"""


@dataclass(frozen=True, slots=True)
class IdentityRecord:
    """An operator, coordinator or app: its role and the Ed25519 key its requests are signed with."""

    name: str
    role: str
    signing_key: bytes
    serial: int
    created_at: float
    revoked: bool = False


class TrustDB:
    """Thread-safe (one lock) access to ``trust.db``; every write is one transaction."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, timeout=10.0,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        for f in (self.path, *(self.path.with_name(self.path.name + x) for x in ("-wal", "-shm"))):
            if f.exists():  # the WAL holds the same rows: never readable by others, whatever the umask
                f.chmod(0o600)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def version(self) -> int:
        """Changes whenever another connection commits (SQLite's data_version) or we write."""
        with self._lock:
            return int(self._db.execute("PRAGMA data_version").fetchone()[0]) + self._writes

    _writes = 0

    def _write(self, sql: str, args: tuple[object, ...]) -> None:
        with self._lock:
            self._db.execute(sql, args)
            self._writes += 1

    # ------------------------------------------------------------ tokens

    def put_token(self, t: Token) -> None:
        self._write("INSERT OR REPLACE INTO tokens VALUES (?,?,?,?,?,?,?)",
                    (t.id, t.secret_sha256, t.expires_at, t.uses_left, int(t.auto_approve), t.created_at,
                     t.description))

    def token(self, token_id: str) -> Token | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM tokens WHERE id=?", (token_id,)).fetchone()
        return None if row is None else Token(row[0], row[1], row[2], row[3], bool(row[4]), row[5], row[6])

    def tokens(self) -> list[Token]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM tokens ORDER BY created_at").fetchall()
        return [Token(r[0], r[1], r[2], r[3], bool(r[4]), r[5], r[6]) for r in rows]

    def delete_token(self, token_id: str) -> bool:
        with self._lock:
            n = self._db.execute("DELETE FROM tokens WHERE id=?", (token_id,)).rowcount
            self._writes += 1
        return bool(n)

    def enrol(self, rec: DeviceRecord, spend_token: str | None) -> bool:
        """Store a new device and spend one token use in one transaction; False if the token ran out."""
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                if spend_token is not None:
                    n = db.execute("UPDATE tokens SET uses_left = uses_left - 1 WHERE id=? AND uses_left > 0",
                                   (spend_token,)).rowcount
                    if n != 1:
                        db.execute("ROLLBACK")
                        return False
                db.execute("INSERT OR REPLACE INTO devices VALUES (?,?,?,?,?,?,?,?,?,?,?)", _device_row(rec))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            self._writes += 1
        return True

    # ------------------------------------------------------------ devices

    def put_device(self, rec: DeviceRecord) -> None:
        self._write("INSERT OR REPLACE INTO devices VALUES (?,?,?,?,?,?,?,?,?,?,?)", _device_row(rec))

    def device(self, device_id: str) -> DeviceRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM devices WHERE device_id=?", (device_id,)).fetchone()
        return None if row is None else _device(row)

    def devices(self) -> list[DeviceRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM devices ORDER BY device_id").fetchall()
        return [_device(r) for r in rows]

    def delete_device(self, device_id: str) -> bool:
        with self._lock:
            n = self._db.execute("DELETE FROM devices WHERE device_id=?", (device_id,)).rowcount
            self._writes += 1
        return bool(n)

    # ------------------------------------------------------------ operators, coordinators, apps

    def put_identity(self, rec: IdentityRecord) -> None:
        self._write("INSERT OR REPLACE INTO identities VALUES (?,?,?,?,?,?)",
                    (rec.name, rec.role, rec.signing_key, str(rec.serial), rec.created_at, int(rec.revoked)))

    def identities(self) -> list[IdentityRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM identities ORDER BY name").fetchall()
        return [IdentityRecord(r[0], r[1], bytes(r[2]), int(r[3]), r[4], bool(r[5])) for r in rows]

    def identity(self, name: str) -> IdentityRecord | None:
        return next((r for r in self.identities() if r.name == name), None)


def _device_row(rec: DeviceRecord) -> tuple[object, ...]:
    return (rec.device_id, rec.state, rec.signing_key, rec.tls_key_sha256, rec.token_id, rec.requested_at,
            rec.csr_pem, rec.cert_pem, str(rec.serial), rec.decided_at, rec.reason)


def _device(r: tuple[Any, ...]) -> DeviceRecord:
    """A ``devices`` row (sqlite gives untyped values) as its record."""
    return DeviceRecord(str(r[0]), r[1], bytes(r[2]), str(r[3]), str(r[4]), float(r[5]),
                        bytes(r[6]), bytes(r[7]), int(str(r[8])), float(r[9]), str(r[10]))
