"""An enrolment client that does not follow our protocol: raw HTTPS requests to a fog's /v1/enroll.

The agent (``edge_agent.enrol``) refuses to send what an attacker sends (ids
outside the grammar, RSA keys, requests without a valid token); these helpers
send it anyway, to the real endpoint of a ``LocalSite``.
"""
from __future__ import annotations

import http.client
import json
import ssl
import warnings
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from runtime.mqtt import parse_hostport
from runtime.security import Identity

__all__ = ["csr_for", "post_enrol", "bearer"]


def csr_for(cn: str, *, key_type: str = "ec") -> tuple[bytes, bytes]:
    """(key PEM, CSR PEM) for any CN, newline included; ``key_type`` "ec" (P-256) or "rsa"."""
    key: Any = ec.generate_private_key(ec.SECP256R1()) if key_type == "ec" else rsa.generate_private_key(65537, 2048)
    with warnings.catch_warnings():  # a CN over 64 characters: an attacker is not held to the limit
        warnings.simplefilter("ignore", UserWarning)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn, _validate=False)])
    csr = x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, hashes.SHA256())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return pem, csr.public_bytes(serialization.Encoding.PEM)


def bearer(token: str) -> str:
    """The Authorization header value of a ``fgl1.<id>.<secret>.<ca>`` token."""
    _, tid, secret, _ = token.split(".")
    return f"Bearer {tid}.{secret}"


def post_enrol(enroll: str, device_id: str, csr_pem: bytes, auth: str | None,
               signing_key: bytes | None = None, timeout: float = 10.0) -> tuple[int, dict[str, Any]]:
    """POST /v1/enroll as given (TLS unverified: an attacker does not care); (status, JSON answer)."""
    host, port = parse_hostport(enroll)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    key = signing_key if signing_key is not None else Identity.generate("x").public_key_bytes
    body = json.dumps({"device_id": device_id, "csr": csr_pem.decode(), "signing_key": key.hex()}).encode()
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = auth
    conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=timeout)
    try:
        conn.request("POST", "/v1/enroll", body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read(1 << 20)
    finally:
        conn.close()
    try:
        answer = json.loads(data)
    except ValueError:
        answer = {"raw": data.decode("utf-8", "replace")}
    return resp.status, answer
