"""Every trust decision of a site, in one module that is easy to audit.

Pure: no I/O, no clock (``now`` is wall-clock seconds passed in), no
randomness (callers pass secrets in). The shells (``trust_db`` for storage,
``enrolment`` for HTTPS, ``service`` for MQTT) ask this module and do what
it says. The model is Kubernetes' TLS bootstrap: a short-lived bootstrap
token authenticates a device's first request, an operator (or the token's
``auto_approve``) approves it, and from then on the device holds a
certificate that lets it touch only its own topics. Keys are never learned
from a message.
"""
from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from runtime.errors import RemoteViolation
from runtime.ids import id_problem
from runtime.messages import BIRTH_RANGES, DeviceBirth

__all__ = [
    "TOKEN_PREFIX", "ROLES", "CONTROL_RIGHTS", "Token", "DeviceRecord", "EnrolRequest", "EnrolDecision",
    "TrustError", "parse_token", "format_token", "token_hash", "check_token", "decide_enrolment", "check_name",
    "may_control", "bound_birth", "death_applies", "ReleaseDecision", "decide_release", "deploy_ref_allowed",
    "BirthLimits", "approve", "revoke",
]

TOKEN_PREFIX = "fgl1"
_TOKEN_RE = re.compile(r"fgl1\.([a-z0-9]{6})\.([a-z0-9]{16})\.([0-9a-f]{64})")

ROLES = ("device", "fog", "operator", "coordinator", "app", "monitor")
DeviceState_ = Literal["pending", "approved", "revoked"]

# What each role may ask of the fog: control actions over fog/CTL, "infer" over fog/INFER.
CONTROL_RIGHTS: Mapping[str, frozenset[str]] = {
    "operator": frozenset({"hello", "status", "deploy", "delete", "infer"}),
    "coordinator": frozenset({"hello", "status", "infer"}),
    "app": frozenset({"hello", "infer"}),
    "monitor": frozenset({"hello", "status"}),  # read-only: Prometheus, the site page, dashboards
}


class TrustError(RemoteViolation):
    """A request the trust rules refuse; ``status`` is the HTTP-style code the shell answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def check_name(name: str, what: str = "name") -> str:
    """Identity names become certificate CNs, MQTT usernames, topic levels and ACL lines: the one
    grammar of ``runtime.ids`` (whole-string match: a trailing newline is not a name)."""
    problem = id_problem(name, what)
    if problem:
        raise TrustError(400, problem)
    return name


# ------------------------------------------------------------------ tokens


@dataclass(frozen=True, slots=True)
class Token:
    """A bootstrap token as stored: the secret only as its SHA-256."""

    id: str
    secret_sha256: str
    expires_at: float
    uses_left: int
    auto_approve: bool = False
    created_at: float = 0.0
    description: str = ""


def token_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def format_token(token_id: str, secret: str, ca_fingerprint: str) -> str:
    return f"{TOKEN_PREFIX}.{token_id}.{secret}.{ca_fingerprint}"


def parse_token(text: str) -> tuple[str, str, str]:
    """``fgl1.<id>.<secret>.<ca-sha256>`` -> (id, secret, ca fingerprint); a TrustError otherwise."""
    m = _TOKEN_RE.fullmatch(text.strip())
    if m is None:
        raise TrustError(400, "not a Fogline bootstrap token (expected fgl1.<id>.<secret>.<ca-sha256>)")
    return m.group(1), m.group(2), m.group(3)


def check_token(token: Token | None, secret: str) -> Token:
    """The first check of every enrolment request, before its body is even read: a caller
    without a valid token learns nothing else (not which names or devices exist)."""
    if token is None or not hmac.compare_digest(token.secret_sha256, token_hash(secret)):
        raise TrustError(401, "token rejected: unknown token or wrong secret")
    return token


# ------------------------------------------------------------------ enrolment


@dataclass(frozen=True, slots=True)
class DeviceRecord:
    """A device the site knows: how it enrolled, its keys, and where its approval stands."""

    device_id: str
    state: DeviceState_
    signing_key: bytes          # Ed25519 public key that signs its adverts
    tls_key_sha256: str         # SHA-256 of the CSR's public key (DER): the TLS identity
    token_id: str
    requested_at: float
    csr_pem: bytes = b""
    cert_pem: bytes = b""
    serial: int = 0
    decided_at: float = 0.0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class EnrolRequest:
    device_id: str
    token_id: str
    secret: str
    signing_key: bytes
    tls_key_sha256: str
    csr_pem: bytes


@dataclass(frozen=True, slots=True)
class EnrolDecision:
    """What the shell does: answer ``status``; store ``record``; spend one use of ``token``."""

    status: int                  # 200 approved (cert ready or to issue), 202 pending
    record: DeviceRecord
    issue_certificate: bool = False
    spend_token: bool = False


def decide_enrolment(req: EnrolRequest, token: Token | None, existing: DeviceRecord | None,
                     now: float) -> EnrolDecision:
    """The bootstrap rule: a valid token creates a pending (or auto-approved) device, once.

    A repeat of the same request (same keys) is idempotent and costs no token use, so an agent
    can poll while an operator decides. Another key under a known id is refused: ids are not
    first-come-first-served after enrolment.
    """
    token = check_token(token, req.secret)
    check_name(req.device_id, "device id")
    if len(req.signing_key) != 32:
        raise TrustError(400, "signing_key must be an Ed25519 public key (32 bytes)")
    if existing is not None:
        if existing.state == "revoked":
            raise TrustError(403, f"device {req.device_id} was revoked; an operator must remove it first")
        if existing.signing_key != req.signing_key or existing.tls_key_sha256 != req.tls_key_sha256:
            raise TrustError(403, f"device {req.device_id} is already enrolled with another key")
        if existing.token_id != token.id:
            raise TrustError(403, f"device {req.device_id} enrolled with another token")
        if existing.state == "approved":
            return EnrolDecision(200, existing, issue_certificate=not existing.cert_pem)
        return EnrolDecision(202, existing)
    if now >= token.expires_at:
        raise TrustError(401, "token rejected: expired")
    if token.uses_left <= 0:
        raise TrustError(401, "token rejected: no uses left")
    state: DeviceState_ = "approved" if token.auto_approve else "pending"
    rec = DeviceRecord(req.device_id, state, req.signing_key, req.tls_key_sha256, token.id, now,
                       csr_pem=req.csr_pem, decided_at=now if token.auto_approve else 0.0,
                       reason="auto-approved by token" if token.auto_approve else "")
    return EnrolDecision(200 if token.auto_approve else 202, rec, issue_certificate=token.auto_approve,
                         spend_token=True)


def approve(rec: DeviceRecord, now: float) -> DeviceRecord:
    if rec.state == "revoked":
        raise TrustError(403, f"device {rec.device_id} is revoked; it must enrol again with a new token")
    return replace(rec, state="approved", decided_at=now, reason="approved by an operator")


def revoke(rec: DeviceRecord, now: float, reason: str = "") -> DeviceRecord:
    return replace(rec, state="revoked", decided_at=now, reason=reason or "revoked by an operator")


# ------------------------------------------------------------------ what a verified peer may do


def may_control(role: str, action: str) -> bool:
    return action in CONTROL_RIGHTS.get(role, frozenset())


def _plausible(name: str) -> float:
    cap = BIRTH_RANGES[name].plausible
    assert cap is not None, name
    return cap


@dataclass(frozen=True, slots=True)
class BirthLimits:
    """Bounds on what a device may claim about itself (a claim is data the device controls)."""

    # the plausibility caps of runtime.messages.BIRTH_RANGES, the one table of device figures
    max_state_interval_s: float = float(_plausible("state_interval_s"))
    max_flops: float = float(_plausible("flops"))
    max_memory_bytes: int = int(_plausible("memory_bytes"))
    max_bps: float = float(_plausible("uplink_bps"))


def bound_birth(birth: DeviceBirth, limits: BirthLimits = BirthLimits()) -> tuple[DeviceBirth, tuple[str, ...]]:
    """Clamp a birth's self-declared figures; return the flags for claims that were out of bounds.

    ``state_interval_s`` decides how long a silent device counts as alive, so it is capped; a
    capacity beyond any real device is clamped and flagged (``fogline status`` shows the flags).
    """
    flags: list[str] = []
    changes: dict[str, Any] = {}  # field -> clamped value, of that field's own type (float or int)

    def clamp(field: str, value: float, hi: float, lo: float = 0.0) -> None:
        if not math.isfinite(value) or value > hi or value < lo:
            flags.append(f"implausible {field}")
            changes[field] = type(getattr(birth, field))(min(max(value if math.isfinite(value) else hi, lo), hi))

    clamp("state_interval_s", birth.state_interval_s, limits.max_state_interval_s, 0.1)
    clamp("flops", birth.flops, limits.max_flops)
    clamp("memory_bytes", birth.memory_bytes, limits.max_memory_bytes)
    clamp("uplink_bps", birth.uplink_bps, limits.max_bps)
    clamp("downlink_bps", birth.downlink_bps, limits.max_bps)
    for name, r in BIRTH_RANGES.items():  # any other capped figure (a new device field): its cap
        if r.plausible is not None and name not in _LIMITED:
            clamp(name, getattr(birth, name), r.plausible, r.lo)
    return (replace(birth, **changes) if changes else birth), tuple(flags)


#: The figures ``BirthLimits`` caps (configurable); other capped ones use the table's cap.
_LIMITED = frozenset({"state_interval_s", "flops", "memory_bytes", "uplink_bps", "downlink_bps"})


def death_applies(current_epoch: int, death_epoch: int) -> bool:
    """Sparkplug's rule: a death counts only for the connection (epoch) of the current birth."""
    return current_epoch >= 0 and death_epoch == current_epoch


# ------------------------------------------------------------------ releases and deploys


@dataclass(frozen=True, slots=True)
class ReleaseDecision:
    accept: bool
    reason: str = ""


def decide_release(name: str, version: int, signer: str, pinned: Mapping[str, bytes],
                   bound_signer: str | None, known_version: int | None) -> ReleaseDecision:
    """A release is taken only from a pinned coordinator, for names it owns, and only forward."""
    if signer not in pinned:
        return ReleaseDecision(False, "signer is not a pinned coordinator")
    if bound_signer is not None and bound_signer != signer:
        return ReleaseDecision(False, f"release {name!r} belongs to another coordinator")
    if known_version is not None and version <= known_version:
        return ReleaseDecision(False, "stale")
    return ReleaseDecision(True)


def deploy_ref_allowed(model: str, uploaded: frozenset[str] = frozenset()) -> bool:
    """A remote deploy may name a zoo model, a release, or bytes it uploaded: never a host path."""
    if model.startswith(("zoo:", "release:")):
        return True
    return model.startswith("file:") and model[len("file:"):] in uploaded
