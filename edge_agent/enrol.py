"""The device side of enrolment (docs/security.md, "Enrolment"): a bootstrap token in, TLS credentials out.

1. ``GET /v1/ca`` over unverified TLS; the CA's SHA-256 must be the one in the
   token, so a stranger on the LAN cannot pose as the fog.
2. ``POST /v1/enroll`` over TLS verified against that CA (hostname checked),
   with the token's secret, the CSR of a fresh TLS key and the device's
   Ed25519 public key; ``202`` means pending (poll with the same request),
   ``200`` carries the certificate, the CA and ``fog.json``.

Every failure is an ``EnrolError`` whose text is one line for the operator.
Credentials land in the data dir only on success, ``tls/`` last and in one
rename. The single exception: after the fog has answered "pending", the TLS
key and CSR of the request are kept in ``enrol-pending/`` so a restarted
agent re-sends the same request (the fog binds the device to that key);
they are removed on success and on a definite refusal.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import FoglineError

from .credentials import FOG_EPOCH_FILE, FOG_JSON, REPLAY_FILE, TLS_DIR, FogInfo, load_fog_info

__all__ = ["BootstrapToken", "EnrolError", "parse_token", "fetch_ca", "Enrolment", "enrol_all", "enrol_dirs",
           "PENDING_DIR", "approve_hint"]

PENDING_DIR = "enrol-pending"
MAX_ANSWER = 64 * 1024
_TOKEN_RE = re.compile(r"fgl1\.([a-z0-9]{6})\.([a-z0-9]{16})\.([0-9a-f]{64})")
_MIN_RETRY_S, _MAX_RETRY_S = 0.1, 60.0


class EnrolError(FoglineError):
    """Enrolment failed; ``str()`` is the one line to show the operator."""


@dataclass(frozen=True, slots=True)
class BootstrapToken:
    """``fgl1.<id>.<secret>.<ca-sha256>`` (docs/security.md, "Bootstrap tokens")."""

    id: str
    secret: str
    ca_sha256: str

    def __repr__(self) -> str:  # never log the secret
        return f"BootstrapToken(id={self.id!r}, ca_sha256={self.ca_sha256[:12]}...)"


def parse_token(text: str) -> BootstrapToken:
    m = _TOKEN_RE.fullmatch(text.strip())
    if m is None:
        raise EnrolError("not a Fogline bootstrap token (expected fgl1.<id>.<secret>.<ca-sha256>; "
                         "on the fog run `fogline token create --data-dir FOGDIR`)")
    return BootstrapToken(m.group(1), m.group(2), m.group(3))


def approve_hint(device_id: str) -> str:
    return f"waiting for approval: on the fog run `fogline devices approve {device_id} --data-dir FOGDIR`"


def _ca_fingerprint(ca_pem: bytes) -> str | None:
    from runtime.pki import fingerprint_of

    try:
        return fingerprint_of(ca_pem)
    except (ValueError, TypeError):
        return None


def _request(conn: http.client.HTTPSConnection, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, bytes, http.client.HTTPResponse]:
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read(MAX_ANSWER + 1)
    finally:
        conn.close()
    if len(data) > MAX_ANSWER:
        raise EnrolError(f"the fog's answer to {path} is larger than {MAX_ANSWER} bytes")
    return resp.status, data, resp


def fetch_ca(host: str, port: int, token: BootstrapToken, *, timeout: float = 10.0) -> bytes:
    """Step 1: the site CA, accepted only if its SHA-256 (DER) is the token's."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # unverified on purpose: the token's fingerprint authenticates the CA
    try:
        status, body, _ = _request(http.client.HTTPSConnection(host, port, context=ctx, timeout=timeout),
                                   "GET", "/v1/ca")
    except (OSError, http.client.HTTPException) as exc:
        raise EnrolError(f"cannot reach the fog's enrolment service at {host}:{port}: {_why(exc)}") from None
    if status != 200:
        raise EnrolError(f"the fog at {host}:{port} answered HTTP {status} to GET /v1/ca: {_error_of(body)}")
    if _ca_fingerprint(body) != token.ca_sha256:
        raise EnrolError(f"the fog at {host}:{port} does not present the CA in the token: refusing to enrol")
    return body


def _why(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate not valid for this address under the site CA ({exc.verify_message})"
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())[:200]


def _error_of(body: bytes) -> str:
    try:
        answer = json.loads(body)
        text = str(answer.get("error") or answer.get("message") or "") if isinstance(answer, dict) else ""
    except ValueError:
        text = ""
    text = text or body[:200].decode("utf-8", "replace")
    return " ".join(text.split())[:300] or "(no reason given)"


def _write_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(path, mode)


class Enrolment:
    """One device's enrolment request; ``poll()`` sends it once (step 2) and says what happened."""

    def __init__(self, data_dir: Path, device_id: str, signing_key: bytes, token: BootstrapToken, ca_pem: bytes,
                 host: str, port: int, *, timeout: float = 10.0) -> None:
        from runtime.pki import make_key_and_csr

        self.data_dir = Path(data_dir)
        self.device_id = device_id
        self.signing_key = signing_key
        self.token = token
        self.ca_pem = ca_pem
        self.host, self.port = host, port
        self.timeout = timeout
        self.pending = False  # the fog has answered 202 at least once
        self.fog: FogInfo | None = None
        pending = self.data_dir / PENDING_DIR
        try:  # the request a previous run left pending: the fog bound this device to its key
            self.key_pem, self.csr_pem = (pending / "key.pem").read_bytes(), (pending / "csr.pem").read_bytes()
        except OSError:
            self.key_pem, self.csr_pem = make_key_and_csr(device_id)

    def poll(self) -> float | None:
        """None: approved and stored. A float: pending, ask again after that many seconds. EnrolError: refused."""
        ctx = ssl.create_default_context(cadata=self.ca_pem.decode("ascii", "replace"))  # hostname checked
        body = json.dumps({"device_id": self.device_id, "csr": self.csr_pem.decode(),
                           "signing_key": self.signing_key.hex()}).encode()
        headers = {"Authorization": f"Bearer {self.token.id}.{self.token.secret}",
                   "Content-Type": "application/json"}
        where = f"{self.host}:{self.port}"
        try:
            status, data, resp = _request(http.client.HTTPSConnection(self.host, self.port, context=ctx,
                                                                      timeout=self.timeout),
                                          "POST", "/v1/enroll", body, headers)
        except (OSError, http.client.HTTPException) as exc:
            if self.pending and not isinstance(exc, ssl.SSLError):
                return 2.0  # the fog restarting while an operator decides: keep polling until the deadline
            raise EnrolError(f"cannot enrol at {where}: {_why(exc)}") from None
        if status == 200:
            self._store(data)
            return None
        if status in (202, 429):  # pending, or slow down: same request again later
            try:
                answer = json.loads(data)
                after = float(answer.get("retry_after_s", 2.0)) if isinstance(answer, dict) else 2.0
            except (ValueError, TypeError):
                after = float(resp.getheader("Retry-After", "2") or 2) if status == 429 else 2.0
            if status == 202:
                self._keep_pending()
            return min(max(after, _MIN_RETRY_S), _MAX_RETRY_S)
        reason = _error_of(data)
        self._forget_pending()
        if status == 401:
            raise EnrolError(reason if reason.startswith("token rejected") else f"token rejected: {reason}")
        if status == 403:
            raise EnrolError(f"the fog refuses device {self.device_id}: {reason}")
        if status == 400:
            raise EnrolError(f"the fog rejected the enrolment request: {reason}")
        if status == 413:
            raise EnrolError(f"the enrolment request is too large for the fog: {reason}")
        raise EnrolError(f"unexpected answer from the fog's enrolment service at {where}: HTTP {status}: {reason}")

    # ------------------------------------------------------------ files

    def _keep_pending(self) -> None:
        if self.pending:
            return
        self.pending = True
        pending = self.data_dir / PENDING_DIR
        if (pending / "csr.pem").exists():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.data_dir / (PENDING_DIR + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        _write_file(tmp / "key.pem", self.key_pem, 0o600)
        _write_file(tmp / "csr.pem", self.csr_pem, 0o600)
        os.replace(tmp, pending)

    def _forget_pending(self) -> None:
        shutil.rmtree(self.data_dir / PENDING_DIR, ignore_errors=True)

    def _store(self, data: bytes) -> None:
        fog = self._check_answer(data)
        d = self.data_dir
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / (TLS_DIR + ".new")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700)
        _write_file(tmp / "ca.pem", self.ca_pem)
        _write_file(tmp / "cert.pem", self._cert_pem)
        _write_file(tmp / "key.pem", self.key_pem, 0o600)
        try:
            before = load_fog_info(d)
        except FoglineError:
            before = None
        if before is None or before.public_key != fog.public_key:  # another fog: its epochs and seqs start anew
            for stale in (FOG_EPOCH_FILE, REPLAY_FILE):
                (d / stale).unlink(missing_ok=True)
        fog_tmp = d / (FOG_JSON + ".tmp")
        _write_file(fog_tmp, (json.dumps(fog.to_json(), indent=1) + "\n").encode())
        os.replace(fog_tmp, d / FOG_JSON)
        shutil.rmtree(d / TLS_DIR, ignore_errors=True)  # a leftover without cert.pem (never a complete one)
        os.replace(tmp, d / TLS_DIR)  # last: tls/cert.pem marks the device enrolled
        self._forget_pending()
        self.fog = fog

    def _check_answer(self, data: bytes) -> FogInfo:
        """The 200 answer: our certificate from the token's CA, and a usable fog.json."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.x509.oid import NameOID

        def bad(why: str) -> EnrolError:
            return EnrolError(f"the fog's enrolment answer is invalid: {why}")

        try:
            answer = json.loads(data)
            if not isinstance(answer, dict) or answer.get("status") != "approved":
                raise bad("status is not 'approved'")
            ca_pem = str(answer["ca"]).encode()
            cert_pem = str(answer["certificate"]).encode()
            fog = FogInfo.from_json(answer["fog"])
        except EnrolError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise bad(f"{type(exc).__name__} {exc}"[:200]) from None
        if _ca_fingerprint(ca_pem) != self.token.ca_sha256:
            raise bad("it carries another CA than the token's")
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
            ca = x509.load_pem_x509_certificate(self.ca_pem)
            cert.verify_directly_issued_by(ca)
            key = serialization.load_pem_private_key(self.key_pem, password=None)
        except (ValueError, TypeError) as exc:
            raise bad(f"the certificate is not issued by the site CA ({exc})"[:200]) from None
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if not cns or cns[0].value != self.device_id:
            raise bad(f"the certificate is not for {self.device_id}")
        spki = serialization.PublicFormat.SubjectPublicKeyInfo
        if (cert.public_key().public_bytes(serialization.Encoding.DER, spki)
                != key.public_key().public_bytes(serialization.Encoding.DER, spki)):
            raise bad("the certificate is for another key than this request's")
        self._cert_pem = cert_pem
        return FogInfo(fog.fog_id, fog.site, fog.public_key, fog.mqtt, fog.enroll or f"{self.host}:{self.port}")


def enrol_all(requests: list[Enrolment], timeout_s: float, *, notify: Callable[[str], None],
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Poll every request until all are approved and stored; EnrolError on the first refusal or the deadline."""
    deadline = clock() + timeout_s
    due = {id(r): clock() for r in requests}
    polled: set[int] = set()
    left = list(requests)
    told: set[str] = set()
    while left:
        left.sort(key=lambda r: due[id(r)])
        r = left[0]
        now = clock()
        if now >= deadline and id(r) in polled:
            pend = [x.device_id for x in left]
            raise EnrolError(f"still not approved after {timeout_s:g} s ({', '.join(pend[:3])}"
                             f"{', ...' if len(pend) > 3 else ''}): on the fog run `fogline devices approve "
                             f"{pend[0]} --data-dir FOGDIR`, then start the agent again")
        at = min(due[id(r)], deadline)  # one last try at the deadline
        if at > now:
            sleep(at - now)
        polled.add(id(r))
        after = r.poll()
        if after is None:
            left.pop(0)
            continue
        if r.pending and r.device_id not in told:
            told.add(r.device_id)
            notify(approve_hint(r.device_id))
        due[id(r)] = clock() + after


def enrol_dirs(token_text: str, devices: list[tuple[str, Path]], host: str, port: int, *, timeout_s: float = 600.0,
               notify: Callable[[str], None] = lambda line: None) -> list[Enrolment]:
    """Enrol every (device id, data dir) that is not enrolled yet with one token (the CA is fetched and
    checked once); returns the requests it made. ``EnrolError`` (one line) on any refusal."""
    from .agent import load_identity
    from .credentials import is_enrolled

    todo = [(i, Path(d)) for i, d in devices if not is_enrolled(Path(d))]
    if not todo:
        return []
    token = parse_token(token_text)
    ca_pem = fetch_ca(host, port, token)
    requests = []
    for device_id, d in todo:
        try:
            key = load_identity(d, device_id).public_key_bytes
        except (ValueError, OSError, FoglineError) as exc:
            raise EnrolError(f"{d}: unusable device key ({exc})") from None
        requests.append(Enrolment(d, device_id, key, token, ca_pem, host, port))
    enrol_all(requests, timeout_s, notify=notify)
    return requests
