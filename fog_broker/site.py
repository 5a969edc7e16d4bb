"""A site's trust anchors on disk: CA, broker certificate, credentials, tokens, the mosquitto ACL.

Used by the running ``fogline broker`` and by the admin commands (``token``,
``devices``, ``operators``) on the same data dir. Layout under FOGDIR::

    fog.key              the fog's Ed25519 identity (signs commands, states, summaries)
    trust.db             tokens, devices, operators/coordinators/apps (fog_broker.trust_db)
    site.json            {"site", "fog_id", "mqtt", "enroll"}: where clients connect
    pki/                 site CA (ca.key never leaves it), issued.json, revoked.json
    pki/broker/          ca.pem, broker.pem, broker.key, crl.pem: what mosquitto reads
    pki/fog/             the fog's own client credentials
    credentials/NAME/    credentials issued to operators, coordinators and apps
    mqtt/acl             the generated per-identity ACL
"""
from __future__ import annotations

import json
import os
import secrets
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.credentials import FOG_JSON, IDENTITY_JSON, SIGNING_KEY
from runtime.errors import LocalViolation
from runtime.files import atomic_write
from runtime.mqtt import TlsConfig
from runtime.pki import SiteCA, TlsBundle, cert_identity
from runtime.security import Identity

from .trust import (
    ROLES,
    DeviceRecord,
    Token,
    TrustError,
    approve,
    check_name,
    format_token,
    revoke,
    token_hash,
)
from .trust_db import TRUST_DB, IdentityRecord, TrustDB

__all__ = ["Site", "SiteInfo", "FOG_KEY", "SITE_JSON"]

FOG_KEY = "fog.key"
SITE_JSON = "site.json"
_ALNUM = string.ascii_lowercase + string.digits


@dataclass(frozen=True, slots=True)
class SiteInfo:
    site: str
    fog_id: str
    mqtt: str
    enroll: str
    http: str = ""


def _write_json(path: Path, data: Any, mode: int = 0o644) -> None:
    atomic_write(path, json.dumps(data, indent=1), mode=mode)


class Site:
    """One fog's data dir seen as a trust domain (see the module docstring for the layout)."""

    def __init__(self, data_dir: str | Path, site: str | None = None, fog_id: str | None = None) -> None:
        self.dir = Path(data_dir)
        if not self.dir.is_dir() and site is None:
            raise LocalViolation(f"{self.dir} is not a fog data dir (start `fogline broker --data-dir` first)")
        self.dir.mkdir(parents=True, exist_ok=True)
        info = self.info()
        self.site = site or (info.site if info else None) or "default"
        self.fog_id = fog_id or (info.fog_id if info else None) or f"fog-{self.site}"
        self.identity = Identity.load_or_create(self.fog_id, self.dir / FOG_KEY)
        self.ca = SiteCA.load_or_create(self.dir / "pki", self.site)
        self.db = TrustDB(self.dir / TRUST_DB)

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------ where the site is

    def info(self) -> SiteInfo | None:
        try:
            d = json.loads((self.dir / SITE_JSON).read_text())
            return SiteInfo(str(d["site"]), str(d["fog_id"]), str(d["mqtt"]), str(d["enroll"]), str(d.get("http", "")))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write_info(self, mqtt: str, enroll: str, http: str = "") -> None:
        _write_json(self.dir / SITE_JSON, {"site": self.site, "fog_id": self.fog_id, "mqtt": mqtt,
                                           "enroll": enroll, "http": http})

    def fog_json(self) -> dict[str, Any]:
        """What a client pins: the fog's id, site, key and addresses."""
        info = self.info()
        return {"fog_id": self.fog_id, "site": self.site, "public_key": self.identity.public_key_bytes.hex(),
                "mqtt": info.mqtt if info else "", "enroll": info.enroll if info else "",
                "http": info.http if info else ""}

    # ------------------------------------------------------------ broker-side files

    def broker_tls_dir(self, hosts: list[str], ips: list[str]) -> Path:
        """ca.pem, broker.pem, broker.key and crl.pem for mosquitto (server cert reissued on SAN change)."""
        out = self.dir / "pki" / "broker"
        out.mkdir(parents=True, exist_ok=True)
        self.ca.ensure_server_cert(out, hosts, ips)
        (out / "ca.pem").write_bytes(self.ca.ca_pem)
        self.ca.write_crl(out / "crl.pem")
        return out

    def fog_credentials(self) -> TlsBundle:
        """The fog's own TLS client identity (issued once)."""
        d = self.dir / "pki" / "fog"
        try:
            return TlsBundle.load(d)
        except LocalViolation:
            return self.ca.issue_bundle(d, self.fog_id, "fog")

    def session_closer(self, name: str, target: Path) -> TlsConfig:
        """TLS under ``name`` for the broker to close a revoked identity's live session with
        (``MosquittoBroker.close_sessions``): a certificate of a few minutes, in ``target``."""
        return self.ca.closer_bundle(target, name).tls(self.fog_id)

    def crl_pem(self) -> bytes:
        path = self.dir / "pki" / "crl.pem"
        self.ca.write_crl(path)
        return path.read_bytes()

    def acl_identities(self) -> dict[str, str]:
        """Who gets rights in mosquitto: the fog, approved devices, unrevoked operators/coordinators/apps."""
        ids = {self.fog_id: "fog"}
        for d in self.db.devices():
            if d.state == "approved":  # without a certificate of this CA it cannot connect anyway
                ids[d.device_id] = "device"
        for r in self.db.identities():
            if not r.revoked:
                ids[r.name] = r.role
        return ids

    def acl(self) -> str:
        """The mosquitto ACL for the identities of this site (``runtime.broker.acl_for``)."""
        from runtime.broker import acl_for
        return acl_for(self.site, self.fog_id, self.acl_identities())

    # ------------------------------------------------------------ tokens

    def create_token(self, now: float, ttl_s: float = 3600.0, uses: int = 1, auto_approve: bool = False,
                     description: str = "") -> str:
        if uses < 1 or not ttl_s > 0:
            raise LocalViolation("a token needs --uses >= 1 and a positive --ttl")
        tid = "".join(secrets.choice(_ALNUM) for _ in range(6))
        secret = "".join(secrets.choice(_ALNUM) for _ in range(16))
        self.db.put_token(Token(tid, token_hash(secret), now + ttl_s, uses, auto_approve, now, description))
        return format_token(tid, secret, self.ca.fingerprint)

    # ------------------------------------------------------------ devices

    def issue_device(self, rec: DeviceRecord) -> DeviceRecord:
        """Sign an approved device's CSR (its CN is the device id, its role 'device')."""
        from dataclasses import replace
        pem, serial = self.ca.issue_from_csr(rec.csr_pem, rec.device_id, "device")
        return replace(rec, cert_pem=pem, serial=serial)

    def approve_device(self, device_id: str, now: float) -> DeviceRecord:
        rec = self.db.device(device_id)
        if rec is None:
            raise LocalViolation(f"no device {device_id!r} has asked to enrol (fogline devices list)")
        try:
            rec = approve(rec, now)
        except TrustError as exc:
            raise LocalViolation(str(exc)) from None
        if rec.csr_pem and not rec.cert_pem:
            rec = self.issue_device(rec)
        self.db.put_device(rec)
        return rec

    def revoke_device(self, device_id: str, now: float, reason: str = "") -> DeviceRecord:
        rec = self.db.device(device_id)
        if rec is None:
            raise LocalViolation(f"no device {device_id!r} is enrolled (fogline devices list)")
        if rec.serial:
            self.ca.revoke(rec.serial, device_id, reason or "revoked by an operator")
        rec = revoke(rec, now, reason)
        self.db.put_device(rec)
        return rec

    def add_device(self, device_id: str, signing_key: bytes, now: float) -> DeviceRecord:
        """Pre-register a device's Ed25519 key by hand (``fogline devices add``), approved, without
        a TLS certificate: for a broker run with ``--insecure`` on loopback, or a device that will
        enrol later with a token (its enrolment must then present this same key)."""
        try:
            check_name(device_id, "device id")
        except TrustError as exc:
            raise LocalViolation(str(exc)) from None
        if len(signing_key) != 32:
            raise LocalViolation("the device key must be 64 hex characters (fogline agent key --data-dir DIR)")
        if device_id == self.fog_id or self.db.identity(device_id) is not None:
            raise LocalViolation(f"{device_id!r} is already the name of this fog or of another identity")
        prev = self.db.device(device_id)
        if prev is not None and prev.signing_key != signing_key:
            raise LocalViolation(f"device {device_id!r} is enrolled with another key; revoke it first")
        if prev is not None and prev.state == "revoked":
            raise LocalViolation(f"device {device_id!r} was revoked; remove it first (fogline devices remove)")
        rec = prev or DeviceRecord(device_id, "approved", signing_key, "", "manual", now, decided_at=now,
                                   reason="added by an operator")
        self.db.put_device(rec)
        return rec

    def remove_device(self, device_id: str) -> bool:
        """Forget a device record entirely (after a revocation, so the id can enrol afresh)."""
        rec = self.db.device(device_id)
        if rec is not None and rec.state == "approved":
            raise LocalViolation(f"device {device_id!r} is approved; revoke it before removing it")
        return self.db.delete_device(device_id)

    # ------------------------------------------------------------ operators, coordinators, apps

    def issue_credentials(self, name: str, role: str, out: Path | None, now: float) -> Path:
        """A credentials directory for NAME (TLS identity + signing key + fog.json); pins its key."""
        try:
            check_name(name, "name")
        except TrustError as exc:
            raise LocalViolation(str(exc)) from None
        if role not in ROLES or role in ("device", "fog"):
            raise LocalViolation(f"role must be operator, coordinator, app or monitor, not {role!r}")
        if name == self.fog_id or self.db.device(name) is not None:
            raise LocalViolation(f"{name!r} is already the name of this fog or of a device")
        prev = self.db.identity(name)
        if prev is not None and not prev.revoked:
            raise LocalViolation(f"{name!r} already has credentials ({prev.role}); pick another name")
        target = Path(out) if out is not None else self.dir / "credentials" / name
        target.mkdir(parents=True, exist_ok=True)
        os.chmod(target, 0o700)
        creds = self.ca.issue_bundle(target, name, role)
        signing = Identity.generate(name)
        signing.save(target / SIGNING_KEY)
        _write_json(target / FOG_JSON, self.fog_json())
        _write_json(target / IDENTITY_JSON, {"name": name, "role": role})
        _, _, serial = cert_identity(Path(creds.cert_file).read_bytes())
        self.db.put_identity(IdentityRecord(name, role, signing.public_key_bytes, serial, now))
        return target

    def revoke_identity(self, name: str, now: float) -> IdentityRecord:
        """Revoke an operator/coordinator/app: its certificate (CRL) and its signing key (trust.db)."""
        from dataclasses import replace
        rec = self.db.identity(name)
        if rec is None:
            raise LocalViolation(f"no identity {name!r} (fogline operators list)")
        if rec.serial:
            self.ca.revoke(rec.serial, name, "identity revoked by an operator")
        rec = replace(rec, revoked=True)
        self.db.put_identity(rec)
        return rec

    def pin_coordinator(self, name: str, key: bytes, now: float) -> None:
        """``fogline broker --coordinator-key NAME=HEX``: a release signer given out of band."""
        check_name(name, "coordinator name")
        if len(key) != 32:
            raise LocalViolation("--coordinator-key needs NAME=HEX with a 32-byte Ed25519 public key")
        prev = self.db.identity(name)
        if prev is not None and prev.signing_key == key and not prev.revoked:
            return
        self.db.put_identity(IdentityRecord(name, "coordinator", key, prev.serial if prev else 0, now))
