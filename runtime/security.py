"""Key files, the persisted trust store, the replay state file and fresh keys: the I/O around ``runtime.verify``.

``runtime.verify`` holds the logic (signatures, envelopes, replay windows, session MACs, artifact
signatures) and is pure; this module adds what touches files, the log or entropy, and re-exports
the pure names so callers import one module. ``Identity`` (``verify.KeyPair``), ``TrustStore``
and ``Verifier`` (``verify.EnvelopeVerifier``) here are the pure classes plus their persistence:
a key file (mode 0600), a JSON trust store, and the replay state
file (``state_path``) that keeps replay protection across restarts.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from . import codec, verify
from .errors import LocalViolation, SecurityError
from .files import atomic_write
from .verify import (
    BAD_SIGNATURE,
    MAC_KINDS,
    MAC_LEN,
    MALFORMED,
    NO_SESSION,
    OUTSIDE_WINDOW,
    OVERSIZED,
    REASONS,
    REPLAYED,
    STALE_EPOCH,
    UNKNOWN_SENDER,
    ArtifactSignature,
    Signer,
    derive_session_key,
    fingerprint,
    mac_tag,
    sha256_hex,
    sign_artifact,
    sign_session_offer,
    verify_artifact,
    verify_session_offer,
)

__all__ = [
    "Identity", "fingerprint", "Signer", "TrustStore", "Verifier", "REASONS",
    "ArtifactSignature", "sign_artifact", "verify_artifact", "sha256_hex", "SecurityError",
    "SessionKeyPair", "derive_session_key", "mac_tag", "sign_session_offer", "verify_session_offer",
    "MAC_LEN", "MAC_KINDS", "NO_SESSION", "OVERSIZED", "MALFORMED", "UNKNOWN_SENDER", "BAD_SIGNATURE",
    "STALE_EPOCH", "REPLAYED", "OUTSIDE_WINDOW",
]

log = logging.getLogger(__name__)

_I = TypeVar("_I", bound="Identity")


class Identity(verify.KeyPair):
    """A named Ed25519 key pair, with its key file and fresh keys (signing is ``verify.KeyPair``)."""

    __slots__ = ()

    @classmethod
    def generate(cls: type[_I], name: str) -> _I:
        return cls(name, Ed25519PrivateKey.generate())

    def save(self, path: str | Path) -> None:
        """Write the private key (PEM, PKCS8) readable by the owner only."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())
        atomic_write(path, pem, mode=0o600)

    @classmethod
    def load(cls: type[_I], name: str, path: str | Path) -> _I:
        path = Path(path)
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise LocalViolation(f"{path} is readable by others (mode {mode:o}); chmod 600 it")
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise LocalViolation(f"{path} is not an Ed25519 key")
        return cls(name, key)

    @classmethod
    def load_or_create(cls: type[_I], name: str, path: str | Path) -> _I:
        path = Path(path)
        if path.exists():
            return cls.load(name, path)
        ident = cls.generate(name)
        ident.save(path)
        return ident


class TrustStore(verify.TrustStore):
    """Enrolled public keys by sender name; with ``path``, persisted as JSON on every change."""

    def __init__(self, keys: Mapping[str, bytes] | None = None, path: str | Path | None = None) -> None:
        super().__init__()
        self.path = Path(path) if path else None
        if self.path and self.path.exists():
            for name, hexkey in json.loads(self.path.read_text()).items():
                self._put(name, bytes.fromhex(hexkey))
        for name, key in (keys or {}).items():
            self._put(name, key)

    def enroll(self, name: str, key: bytes) -> None:
        super().enroll(name, key)
        self._persist()

    def remove(self, name: str) -> bool:
        """Forget ``name`` (a revoked identity); True if it was known."""
        if not super().remove(name):
            return False
        self._persist()
        return True

    def _persist(self) -> None:
        if self.path:
            atomic_write(self.path, json.dumps({n: k.hex() for n, k in sorted(self._raw.items())}, indent=1))


_STATE_VERSION = 1


def _load_marks(path: Path) -> dict[str, tuple[int, int]]:
    """Read replay high-water marks; a missing file is empty, an unreadable one is refused."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise LocalViolation(f"cannot read replay state {path}: {exc}") from None
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("version") != _STATE_VERSION:
            raise ValueError(f"expected version {_STATE_VERSION}")
        marks: dict[str, tuple[int, int]] = {}
        for sender, mark in data["marks"].items():
            if not (isinstance(mark, list) and len(mark) == 2
                    and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in mark)):
                raise ValueError(f"bad mark for {sender[:64]!r}")
            marks[sender] = (mark[0], mark[1])
        return marks
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LocalViolation(
            f"replay state {path} is corrupt ({str(exc)[:80]}); refusing to start, since an empty state would "
            f"accept a replay of any command sealed in the last timestamp window; delete the file only after "
            f"this process has been down longer than that window") from None


class Verifier(verify.EnvelopeVerifier):
    """``verify.EnvelopeVerifier`` whose replay marks, with ``state_path``, survive restarts.

    Each sender's (epoch, highest seq) is loaded here and rewritten (tmp file, fsync,
    ``os.replace``) whenever it advances, so after a restart every seq at or below the
    mark is refused as replayed and an older epoch as stale. That is one small
    synchronous write per advance, meant for rare traffic (an agent's commands); the
    fog's advert ingest (thousands per second, and devices reconnect with a new epoch
    anyway) does not use it. A write that fails is logged and counted in
    ``persist_errors``; the envelope is still accepted (the in-memory window protects
    until a restart). A corrupt state file raises ``LocalViolation``: the file is only
    ever replaced whole, so corruption means tampering or a failing disk, and starting
    empty would reopen the replay hole.
    """

    def __init__(self, trust: verify.TrustStore, *, max_skew_s: float = 30.0,
                 max_size: int = codec.DEFAULT_MAX_SIZE, window: int = 64, sessions: bool = False,
                 state_path: str | Path | None = None) -> None:
        self.persist_errors = 0
        self.state_path = Path(state_path) if state_path is not None else None
        marks = _load_marks(self.state_path) if self.state_path is not None else None
        super().__init__(trust, max_skew_s=max_skew_s, max_size=max_size, window=window,
                         sessions=sessions, marks=marks)

    def _advanced(self) -> None:
        if self.state_path is not None:
            self._save()

    def _save(self) -> None:
        """Atomically rewrite the replay state file with every sender's (epoch, highest seq)."""
        path = self.state_path
        if path is None:
            return
        text = json.dumps({"version": _STATE_VERSION, "marks": self.marks()})
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(text.encode())
                f.flush()
                os.fsync(f.fileno())  # the mark must outlive a power cut, not just a crash
            os.replace(tmp, path)
        except OSError as exc:
            self.persist_errors += 1
            log.error("replay state not saved to %s (%s); a restart could accept a replay", path, exc)
            try:
                tmp.unlink()
            except OSError:
                pass


class SessionKeyPair:
    """An X25519 key pair for one fog run (fog side) or one birth (device side); never stored."""

    __slots__ = ("_key", "public_bytes")

    def __init__(self, private: bytes | None = None) -> None:
        """A fresh key pair, or the one of ``private`` (handing a fog's pair to its own verify workers)."""
        self._key = X25519PrivateKey.from_private_bytes(private) if private else X25519PrivateKey.generate()
        self.public_bytes = self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def private_bytes(self) -> bytes:
        return self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption())

    def derive(self, peer_public: bytes, device: str, epoch: int, device_pub: bytes, fog_pub: bytes) -> bytes:
        return derive_session_key(self._key, peer_public, device, epoch, device_pub, fog_pub)
