"""What a client of a site holds: a credentials directory issued by the fog (docs/security.md).

Operators, coordinators and apps get one from ``fogline operators add NAME
--data-dir FOGDIR [--role ...]`` (the first operator's is written by
``fogline broker`` to ``FOGDIR/credentials/admin``). Layout::

    identity.json   {"name": ..., "role": "operator" | "coordinator" | "app"}
    ca.pem          the site CA: the broker's certificate is verified against it
    cert.pem        our TLS client certificate (CN = name, OU = role)
    key.pem         its private key (0600)
    signing.key     our Ed25519 key (0600): signs control requests and releases
    fog.json        the fog's id, site, pinned Ed25519 key and addresses

``FogInfo`` (``fog.json``) is the same record a device stores at enrolment.
Nothing here talks to the network; keys are read from files a person put
there, never from a message.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import LocalViolation
from .mqtt import TlsConfig
from .security import Identity

__all__ = ["FogInfo", "Credentials", "load_credentials", "default_credentials_dir", "CLIENT_ROLES",
           "FOG_JSON", "IDENTITY_JSON", "SIGNING_KEY", "CREDENTIALS_ENV"]

FOG_JSON = "fog.json"
IDENTITY_JSON = "identity.json"
SIGNING_KEY = "signing.key"
CREDENTIALS_ENV = "FOGLINE_CREDENTIALS"
CLIENT_ROLES = ("operator", "coordinator", "app", "monitor")


@dataclass(frozen=True, slots=True)
class FogInfo:
    """``fog.json``: the fog's identity and pinned Ed25519 key, and where to reach it."""

    fog_id: str
    site: str
    public_key: bytes
    mqtt: str = ""
    enroll: str = ""
    http: str = ""

    def __post_init__(self) -> None:
        if len(self.public_key) != 32:
            raise ValueError("public_key must be an Ed25519 public key (64 hex characters)")
        if not self.fog_id or not self.site:
            raise ValueError("fog_id and site must not be empty")

    @classmethod
    def from_json(cls, d: object) -> FogInfo:
        """Parse an enrolment answer's ``fog`` object or a stored fog.json; ValueError if unusable."""
        if not isinstance(d, dict):
            raise ValueError("expected a JSON object")
        try:
            return cls(str(d["fog_id"]), str(d["site"]), bytes.fromhex(str(d["public_key"])),
                       str(d.get("mqtt", "")), str(d.get("enroll", "")), str(d.get("http", "")))
        except KeyError as exc:
            raise ValueError(f"missing {exc}") from None

    def to_json(self) -> dict[str, str]:
        return {"fog_id": self.fog_id, "site": self.site, "public_key": self.public_key.hex(),
                "mqtt": self.mqtt, "enroll": self.enroll, "http": self.http}

    @classmethod
    def load(cls, path: str | Path) -> FogInfo | None:
        """The stored record, None when absent; LocalViolation when present but unusable."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise LocalViolation(f"cannot read {path}: {exc}") from None
        try:
            return cls.from_json(json.loads(text))
        except ValueError as exc:
            raise LocalViolation(f"{path} is unusable ({exc})") from None


@dataclass(frozen=True, slots=True)
class Credentials:
    """A loaded credentials directory: who we are to the site and whom we trust there."""

    dir: Path
    name: str
    role: str
    tls: TlsConfig
    signing: Identity
    fog: FogInfo

    def tls_for(self, server_hostname: str | None) -> TlsConfig:
        """The TLS identity, verifying the broker under ``server_hostname`` (None: the host dialled)."""
        return TlsConfig(self.tls.ca_file, self.tls.cert_file, self.tls.key_file, server_hostname)


def default_credentials_dir() -> Path:
    """``$FOGLINE_CREDENTIALS``, else ``~/.fogline/credentials``."""
    env = os.environ.get(CREDENTIALS_ENV)
    return Path(env) if env else Path.home() / ".fogline" / "credentials"


def load_credentials(directory: str | Path | None = None) -> Credentials:
    """Load a credentials directory; every problem is one ``LocalViolation`` line naming the fix."""
    d = Path(directory) if directory is not None else default_credentials_dir()
    hint = "(issue one on the fog: fogline operators add NAME --data-dir FOGDIR)"
    if not d.is_dir():
        raise LocalViolation(f"no credentials directory at {d} {hint}")
    try:
        ident = json.loads((d / IDENTITY_JSON).read_text())
        name, role = str(ident["name"]), str(ident["role"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LocalViolation(f"{d / IDENTITY_JSON} is missing or unusable ({exc}) {hint}") from None
    if role not in CLIENT_ROLES:
        raise LocalViolation(f"{d / IDENTITY_JSON}: role {role!r} is not one of {', '.join(CLIENT_ROLES)}")
    for f in ("ca.pem", "cert.pem", "key.pem", SIGNING_KEY, FOG_JSON):
        if not (d / f).is_file():
            raise LocalViolation(f"{d} lacks {f} {hint}")
    for secret in ("key.pem", SIGNING_KEY):
        mode = (d / secret).stat().st_mode & 0o777
        if mode & 0o077:
            raise LocalViolation(f"{d / secret} is readable by others (mode {mode:o}); chmod 600 it")
    fog = FogInfo.load(d / FOG_JSON)
    assert fog is not None
    return Credentials(d, name, role, TlsConfig(str(d / "ca.pem"), str(d / "cert.pem"), str(d / "key.pem")),
                       Identity.load(name, d / SIGNING_KEY), fog)
