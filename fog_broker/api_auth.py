"""Who may call the fog's HTTP API: bearer API tokens and client certificates, decided purely.

An API token needs no state on the fog: an identity the site issued
(``fogline operators add NAME --role app``) signs its own token with the
Ed25519 key in its credentials dir (``fogline api-token``), and the fog
verifies it with the key it pinned for that name in ``trust.db``. Revoking the
identity revokes every token it ever minted. Format::

    fgt1.<base64url(claims JSON)>.<base64url(Ed25519 signature)>

where the claims are ``{"sub": NAME, "site": SITE, "aud": FOG_ID, "iat": S,
"exp": S, "nonce": HEX}`` (integer Unix seconds) and the signature covers
``fogline-api-token-v1.`` followed by the encoded claims, a domain no other
Fogline signature uses. Lifetimes are capped at ``MAX_TTL_S``.

A client certificate counts when the site CA issued it (the TLS layer checks
that), its CN names an identity of the site that is not revoked, its serial is
that identity's current one (a re-issued identity's old certificate is dead)
and its OU is that identity's role. Either way the role must hold the
``infer`` right, or the one the endpoint names (``trust.CONTROL_RIGHTS``). Pure: no I/O, no clock (``now``
is passed in), no randomness (``nonce`` is passed in).
"""
from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .trust import TrustError, check_name, may_control

__all__ = ["TOKEN_PREFIX", "MAX_TTL_S", "MAX_TOKEN_CHARS", "Claims", "Principal", "Record", "mint_token",
           "parse_token", "verify_token", "cert_principal", "authorize"]

TOKEN_PREFIX = "fgt1"
_DOMAIN = b"fogline-api-token-v1."
MAX_TTL_S = 30 * 86400          # a leaked token is useful for at most this long
MAX_TOKEN_CHARS = 2048
CLOCK_SKEW_S = 60               # a token "issued" this far in our future is still taken


class Record(Protocol):
    """What the fog knows of an identity (``trust_db.IdentityRecord``)."""

    @property
    def name(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def signing_key(self) -> bytes: ...
    @property
    def serial(self) -> int: ...
    @property
    def revoked(self) -> bool: ...


class _Signer(Protocol):
    @property
    def name(self) -> str: ...
    def sign(self, data: bytes) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Claims:
    sub: str
    site: str
    aud: str
    iat: int
    exp: int
    nonce: str


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: its identity name, role, and how it proved itself."""

    name: str
    role: str
    via: str            # "token" | "certificate"
    expires_at: float = float("inf")


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _b64d(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mint_token(signer: _Signer, site: str, fog_id: str, now: float, ttl_s: float, nonce: bytes) -> str:
    """A token for ``signer`` (an ``Identity``) valid ``ttl_s`` seconds at fog ``fog_id`` of ``site``."""
    if not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"a token lives between 1 s and {MAX_TTL_S // 86400} days")
    iat = int(now)
    claims = {"sub": signer.name, "site": site, "aud": fog_id, "iat": iat, "exp": iat + max(1, int(ttl_s)),
              "nonce": nonce.hex()}
    body = _b64e(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode())
    return f"{TOKEN_PREFIX}.{body}.{_b64e(signer.sign(_DOMAIN + body.encode()))}"


def parse_token(text: str) -> tuple[Claims, bytes, bytes]:
    """(claims, signed bytes, signature) of a well-formed token; ``TrustError(401)`` otherwise.
    Nothing is verified here: the claims say whose key to verify with."""
    bad = TrustError(401, "not a Fogline API token (expected fgt1.<claims>.<signature>; "
                          "mint one with `fogline api-token`)")
    if not isinstance(text, str) or len(text) > MAX_TOKEN_CHARS:
        raise bad
    parts = text.strip().split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise bad
    try:
        raw = json.loads(_b64d(parts[1]))
        sig = _b64d(parts[2])
        claims = Claims(str(raw["sub"]), str(raw["site"]), str(raw["aud"]), int(raw["iat"]), int(raw["exp"]),
                        str(raw.get("nonce", "")))
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeDecodeError):
        raise bad from None
    if not isinstance(raw.get("iat"), int) or not isinstance(raw.get("exp"), int) or len(sig) != 64:
        raise bad
    check_name(claims.sub, "token subject")
    return claims, _DOMAIN + parts[1].encode(), sig


def verify_token(text: str, lookup: Callable[[str], Record | None], *, site: str, fog_id: str,
                 now: float, right: str = "infer") -> Principal:
    """The principal a bearer token proves, or ``TrustError`` (401: not a valid token for this fog;
    403: a valid token of an identity that is revoked or lacks ``right``)."""
    claims, signed, sig = parse_token(text)
    rec = lookup(claims.sub)
    if rec is None:
        raise TrustError(401, f"token of {claims.sub!r}, who is not an identity of this site")
    try:
        Ed25519PublicKey.from_public_bytes(rec.signing_key).verify(sig, signed)
    except (InvalidSignature, ValueError):
        raise TrustError(401, f"token signature does not verify with the key pinned for {claims.sub!r}") from None
    if claims.site != site or claims.aud != fog_id:
        raise TrustError(401, f"token is for fog {claims.aud!r} of site {claims.site!r}, not {fog_id!r}")
    if claims.exp - claims.iat > MAX_TTL_S:
        raise TrustError(401, f"token lifetime exceeds {MAX_TTL_S // 86400} days")
    if claims.iat > now + CLOCK_SKEW_S:
        raise TrustError(401, "token issued in the future (check the clocks)")
    if now >= claims.exp:
        raise TrustError(401, "token expired; mint a new one with `fogline api-token`")
    return authorize(rec, "token", float(claims.exp), right)


def cert_principal(cn: str, ou: str, serial: int, lookup: Callable[[str], Record | None],
                   right: str = "infer") -> Principal:
    """The principal a site-CA client certificate proves (CN, OU, serial), or ``TrustError(403)``."""
    rec = lookup(cn)
    if rec is None:
        raise TrustError(403, f"certificate of {cn[:64]!r}, who is not an operator, coordinator or app of this site")
    if rec.serial != serial:
        raise TrustError(403, f"certificate of {cn!r} was superseded or revoked")
    if ou != rec.role:
        raise TrustError(403, f"certificate of {cn!r} names role {ou[:32]!r}, not {rec.role!r}")
    return authorize(rec, "certificate", right=right)


def authorize(rec: Record, via: str, expires_at: float = float("inf"), right: str = "infer") -> Principal:
    """The same rule as MQTT: not revoked, and the role holds ``right`` (``trust.CONTROL_RIGHTS``)."""
    if rec.revoked:
        raise TrustError(403, f"identity {rec.name!r} was revoked")
    if not may_control(rec.role, right):
        raise TrustError(403, f"{rec.name} ({rec.role}) may not {right}")
    return Principal(rec.name, rec.role, via, expires_at)
