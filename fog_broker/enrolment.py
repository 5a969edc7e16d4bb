"""The enrolment endpoint: HTTPS for devices that hold a bootstrap token and no certificate yet.

A thin adapter: it parses and bounds the request, asks ``fog_broker.trust``
what to do and stores the outcome through ``fog_broker.site``. The server
certificate is the broker's (signed by the site CA); the agent fetches the CA
from ``/v1/ca`` and checks it against the fingerprint in its token before
sending anything secret, so first contact is authenticated both ways. See
docs/security.md for the wire contract.
"""
from __future__ import annotations

import hashlib
import json
import logging
import ssl
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

from .ratelimit import RateLimit
from .site import Site
from .trust import EnrolRequest, TrustError, check_name, decide_enrolment

__all__ = ["EnrolmentServer", "MAX_BODY"]

log = logging.getLogger("fog_broker.enrolment")

MAX_BODY = 16 * 1024
_RATE_PER_S = 50.0     # requests per second per client address (burst 200): a fleet behind one NAT enrols at once
_BURST = 200.0
_MAX_CLIENTS = 10_000  # rate-limit table bound


class _Limiter:
    """A token bucket per client address (``RateLimit``), bounded in number."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, RateLimit] = {}

    def allow(self, addr: str, now: float) -> bool:
        with self._lock:
            bucket = self._buckets.get(addr)
            if bucket is None:
                if len(self._buckets) >= _MAX_CLIENTS:
                    self._buckets.clear()
                bucket = self._buckets[addr] = RateLimit(_RATE_PER_S, _BURST)
            return bucket.take(now)


def _csr_facts(csr_pem: bytes) -> tuple[str, str]:
    """(CN, SHA-256 of the public key DER) of a CSR whose self-signature holds; TrustError otherwise."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import NameOID
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
        if not csr.is_signature_valid:
            raise ValueError("bad self-signature")
        cns = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        cn = str(cns[0].value) if cns else ""
        der = csr.public_key().public_bytes(serialization.Encoding.DER,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    except (ValueError, TypeError) as exc:
        raise TrustError(400, f"bad CSR: {exc}") from None
    return cn, hashlib.sha256(der).hexdigest()


class EnrolmentServer:
    """``start()`` serves /v1/ca and /v1/enroll on a thread; ``on_change`` runs after each enrolment."""

    def __init__(self, site: Site, host: str, port: int, tls_dir: Path,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.site = site
        self.on_change = on_change
        self.counters: Counter[str] = Counter()
        self._limiter = _Limiter()
        self._lock = threading.Lock()  # enrolments one at a time: token uses are spent exactly once
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(tls_dir / "broker.pem"), str(tls_dir / "broker.key"))
        handler = _handler_for(self)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="fog-enrol", daemon=True)

    def start(self) -> "EnrolmentServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------ request handling (handler threads)

    def enrol(self, auth: str, body: bytes, now: float) -> tuple[int, dict[str, Any]]:
        if not auth.startswith("Bearer "):
            raise TrustError(401, "missing 'Authorization: Bearer <token id>.<secret>'")
        tid, _, secret = auth[len("Bearer "):].strip().partition(".")
        try:
            req = json.loads(body)
            device_id = check_name(str(req["device_id"]), "device id")
            csr_pem = str(req["csr"]).encode()
            signing_key = bytes.fromhex(str(req["signing_key"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise TrustError(400, f"bad enrolment request: {type(exc).__name__} {exc}"[:200]) from None
        cn, tls_sha = _csr_facts(csr_pem)
        if cn != device_id:
            raise TrustError(400, f"the CSR's CN {cn[:64]!r} is not the device id {device_id!r}")
        if device_id == self.site.fog_id or self.site.db.identity(device_id) is not None:
            raise TrustError(403, f"{device_id!r} is the name of another identity of this site")
        with self._lock:
            decision = decide_enrolment(EnrolRequest(device_id, tid, secret, signing_key, tls_sha, csr_pem),
                                        self.site.db.token(tid), self.site.db.device(device_id), now)
            rec = decision.record
            if decision.issue_certificate:
                rec = self.site.issue_device(rec)
            if decision.spend_token:
                if not self.site.db.enrol(rec, tid):
                    raise TrustError(401, "token rejected: no uses left")
                self.counters["enrolled" if rec.state == "approved" else "pending"] += 1
                log.info("device %s enrolled with token %s (%s)", device_id, tid, rec.state)
            elif rec is not decision.record:
                self.site.db.put_device(rec)
        if decision.spend_token or decision.issue_certificate:
            self.on_change()
        if rec.state == "approved" and rec.cert_pem:
            return 200, {"status": "approved", "certificate": rec.cert_pem.decode(),
                         "ca": self.site.ca.ca_pem.decode(), "fog": self.site.fog_json()}
        return 202, {"status": "pending", "retry_after_s": 2,
                     "message": f"waiting for approval: on the fog run `fogline devices approve {device_id} "
                                "--data-dir FOGDIR`"}


def _handler_for(server: EnrolmentServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "fogline-enrol/1"
        timeout = 10  # a slow client cannot hold a thread for long

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.client_address[0], *args)

        def _send(self, code: int, body: dict[str, Any] | bytes, ctype: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _limited(self) -> bool:
            if server._limiter.allow(self.client_address[0], time.monotonic()):
                return False
            server.counters["rejected:rate"] += 1
            self._send(429, {"error": "too many requests; slow down", "retry_after_s": 1})
            return True

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self._limited():
                return
            if self.path == "/v1/ca":
                self._send(200, server.site.ca.ca_pem, "application/x-pem-file")
            else:
                self._send(404, {"error": "not found: GET /v1/ca, POST /v1/enroll"})

        def do_POST(self) -> None:  # noqa: N802
            if self._limited():
                return
            if self.path != "/v1/enroll":
                self._send(404, {"error": "not found: POST /v1/enroll"})
                return
            try:
                length = int(self.headers.get("Content-Length", "-1"))
            except ValueError:
                length = -1
            if length < 0 or length > MAX_BODY:
                server.counters["rejected:size"] += 1
                self._send(413, {"error": f"enrolment requests are at most {MAX_BODY} bytes with a Content-Length"})
                return
            body = self.rfile.read(length)
            try:
                code, answer = server.enrol(self.headers.get("Authorization", ""), body, time.time())
            except TrustError as exc:
                server.counters[f"rejected:{exc.status}"] += 1
                log.warning("enrolment from %s refused: %s", self.client_address[0], exc)
                self._send(exc.status, {"error": str(exc)})
                return
            except Exception as exc:  # noqa: BLE001 - one request must never kill the server
                server.counters["internal_errors"] += 1
                log.exception("enrolment failed")
                self._send(500, {"error": f"internal error: {type(exc).__name__}"})
                return
            self._send(code, answer)

    return Handler

