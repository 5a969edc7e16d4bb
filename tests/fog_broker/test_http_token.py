"""API tokens and certificate principals (``fog_broker.api_auth``): pure, table-driven."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, replace
from typing import Any

import pytest

from fog_broker.api_auth import (
    MAX_TTL_S,
    Principal,
    cert_principal,
    mint_token,
    parse_token,
    verify_token,
)
from fog_broker.trust import TrustError
from runtime.security import Identity

NOW = 1_800_000_000.0
APP = Identity.from_seed("app1", b"app1")
OTHER = Identity.from_seed("app1", b"someone else")


@dataclass(frozen=True)
class Rec:
    name: str
    role: str
    signing_key: bytes
    serial: int = 42
    revoked: bool = False


RECORDS = {"app1": Rec("app1", "app", APP.public_key_bytes),
           "ops": Rec("ops", "operator", Identity.from_seed("ops", b"ops").public_key_bytes),
           "gone": Rec("gone", "app", Identity.from_seed("gone", b"gone").public_key_bytes, revoked=True),
           "dev": Rec("dev", "device", Identity.from_seed("dev", b"dev").public_key_bytes)}


def _tok(ident: Identity = APP, *, site: str = "s", fog: str = "fog-s", now: float = NOW, ttl: float = 3600) -> str:
    return mint_token(ident, site, fog, now, ttl, b"\x01" * 8)


def _verify(token: str, records: dict[str, Any] = RECORDS, now: float = NOW) -> Principal:
    return verify_token(token, records.get, site="s", fog_id="fog-s", now=now)


def test_a_minted_token_verifies_with_the_pinned_key() -> None:
    p = _verify(_tok())
    assert p == Principal("app1", "app", "token", NOW + 3600)
    claims, _, _ = parse_token(_tok())
    assert (claims.sub, claims.site, claims.aud, claims.exp - claims.iat) == ("app1", "s", "fog-s", 3600)


def _tamper(token: str, **changes: Any) -> str:
    prefix, body, sig = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims.update(changes)
    new = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{prefix}.{new}.{sig}"


@pytest.mark.parametrize("token, now, status, words", [
    ("", NOW, 401, "not a Fogline API token"),
    ("fgl1.abcdef.0123456789abcdef.00", NOW, 401, "not a Fogline API token"),  # a bootstrap token
    ("fgt1.e30.AAAA", NOW, 401, "not a Fogline API token"),
    ("fgt1." + "A" * 3000 + ".x", NOW, 401, "not a Fogline API token"),
    (_tok(OTHER), NOW, 401, "does not verify"),                       # same name, another key
    (_tamper(_tok(), exp=int(NOW) + 10**6), NOW, 401, "does not verify"),
    (_tamper(_tok(), sub="ops"), NOW, 401, "does not verify"),
    (_tok(Identity.from_seed("nobody", b"n")), NOW, 401, "not an identity of this site"),
    (_tok(site="other"), NOW, 401, "not 'fog-s'"),
    (_tok(fog="fog-other"), NOW, 401, "fog-other"),
    (_tok(), NOW + 3600, 401, "expired"),
    (_tok(now=NOW + 3600), NOW, 401, "in the future"),
    (_tok(Identity.from_seed("gone", b"gone")), NOW, 403, "revoked"),
    (_tok(Identity.from_seed("dev", b"dev")), NOW, 403, "may not infer"),
])
def test_refused_tokens(token: str, now: float, status: int, words: str) -> None:
    with pytest.raises(TrustError) as e:
        _verify(token, now=now)
    assert e.value.status == status and words in str(e.value), str(e.value)


def test_clock_skew_and_lifetime_limits() -> None:
    assert _verify(_tok(now=NOW + 30)).name == "app1"  # a client clock a little ahead
    with pytest.raises(ValueError):
        _tok(ttl=MAX_TTL_S + 1)
    with pytest.raises(ValueError):
        _tok(ttl=0)


def test_revoking_or_rekeying_the_identity_kills_its_tokens() -> None:
    token = _tok()
    with pytest.raises(TrustError) as e:
        _verify(token, {**RECORDS, "app1": replace(RECORDS["app1"], revoked=True)})
    assert e.value.status == 403
    with pytest.raises(TrustError) as e:  # re-issued under the same name: new key
        _verify(token, {**RECORDS, "app1": replace(RECORDS["app1"], signing_key=OTHER.public_key_bytes)})
    assert e.value.status == 401


@pytest.mark.parametrize("cn, ou, serial, status, words", [
    ("app1", "app", 42, 0, ""),
    ("ops", "operator", 42, 0, ""),
    ("w0", "device", 7, 403, "not an operator, coordinator or app"),
    ("app1", "app", 41, 403, "superseded or revoked"),
    ("app1", "operator", 42, 403, "names role 'operator'"),
    ("gone", "app", 42, 403, "revoked"),
])
def test_certificate_principals(cn: str, ou: str, serial: int, status: int, words: str) -> None:
    if status == 0:
        assert cert_principal(cn, ou, serial, RECORDS.get) == Principal(cn, ou, "certificate")
        return
    with pytest.raises(TrustError) as e:
        cert_principal(cn, ou, serial, RECORDS.get)
    assert e.value.status == status and words in str(e.value)


def test_other_rights_for_other_endpoints() -> None:
    """An app may infer but not read the site's status (the site page needs 'status')."""
    ops = Identity.from_seed("ops", b"ops")
    assert verify_token(_tok(ops), RECORDS.get, site="s", fog_id="fog-s", now=NOW, right="status").name == "ops"
    with pytest.raises(TrustError) as e:
        verify_token(_tok(), RECORDS.get, site="s", fog_id="fog-s", now=NOW, right="status")
    assert e.value.status == 403 and "may not status" in str(e.value)
    with pytest.raises(TrustError):
        cert_principal("app1", "app", 42, RECORDS.get, right="deploy")
