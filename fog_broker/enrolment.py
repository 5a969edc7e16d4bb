"""The enrolment endpoint: HTTPS for devices that hold a bootstrap token and no certificate yet.

A thin adapter: it parses and bounds the request, asks ``fog_broker.trust``
what to do and stores the outcome through ``fog_broker.site``. The server
certificate is the broker's (signed by the site CA); the agent fetches the CA
from ``/v1/ca`` and checks it against the fingerprint in its token before
sending anything secret, so first contact is authenticated both ways. See
docs/security.md for the wire contract.

The service faces the LAN before anyone is authenticated, so each connection is
a coroutine on one event loop, not a thread: the TLS handshake and the request
head must arrive within ``HEAD_TIMEOUT_S`` and the body within ``BODY_TIMEOUT_S``
whatever the pace of the bytes; a peer holds at most ``MAX_PER_PEER``
connections and the service ``MAX_CONNECTIONS``; past a cap the oldest
connection still sending its request is dropped (a real request takes
milliseconds, so only trickling ones are old). Requests run on a small pool.
The token is checked before anything else of a request is looked at.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .ratelimit import RateLimit
from .site import Site
from .trust import EnrolRequest, TrustError, check_name, check_token, decide_enrolment

__all__ = ["EnrolmentServer", "MAX_BODY", "MAX_HEAD", "HEAD_TIMEOUT_S", "BODY_TIMEOUT_S", "MAX_CONNECTIONS",
           "MAX_PER_PEER", "parse_head"]

log = logging.getLogger("fog_broker.enrolment")

MAX_BODY = 16 * 1024
MAX_HEAD = 8 * 1024         # request line + headers
HEAD_TIMEOUT_S = 10.0       # TLS handshake + request head, however slowly the bytes come
BODY_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 512       # open at once, all peers
MAX_PER_PEER = 64           # open at once from one address (a fleet behind one NAT enrols in a burst)
_WORKERS = 4                # enrolments are serialized anyway (one token use at a time)
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
    """(CN, SHA-256 of the public key DER) of an ECDSA P-256 CSR whose self-signature holds; a
    TrustError (400, with the reason) otherwise: the site CA signs P-256 keys only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
        key = csr.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
            kind = (key.curve.name if isinstance(key, ec.EllipticCurvePublicKey)
                    else type(key).__name__.strip("_").removesuffix("PublicKey"))
            raise TrustError(400, f"bad CSR: its key must be ECDSA P-256 (secp256r1), not {kind[:40]}")
        if not csr.is_signature_valid:
            raise ValueError("bad self-signature")
        cns = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        cn = str(cns[0].value) if cns else ""
        der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    except TrustError:
        raise
    except (ValueError, TypeError) as exc:
        raise TrustError(400, f"bad CSR: {type(exc).__name__} {exc}"[:200]) from None
    return cn, hashlib.sha256(der).hexdigest()


def parse_head(raw: bytes) -> tuple[str, str, dict[str, str]]:
    """(method, path, headers with lower-case names) of an HTTP/1.x request head; ValueError otherwise."""
    text = raw.decode("latin-1")
    line, _, rest = text.partition("\r\n")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError("not an HTTP/1.x request line")
    headers: dict[str, str] = {}
    for h in rest.split("\r\n"):
        if not h:
            continue
        name, sep, value = h.partition(":")
        if not sep or not name or name != name.strip():
            raise ValueError("malformed header line")
        key = name.lower()
        if key in headers and key in ("content-length", "authorization"):
            raise ValueError(f"repeated {name} header")
        headers[key] = value.strip()
    return parts[0], parts[1], headers


@dataclass(slots=True, eq=False)
class _Conn:
    """One open connection, as the event loop tracks it for the caps."""

    peer: str
    opened: float
    task: asyncio.Task[None] | None = None
    reading: bool = True          # still receiving its request: may be evicted
    transport: Any = field(default=None)


class EnrolmentServer:
    """``start()`` serves /v1/ca and /v1/enroll on an event-loop thread; ``on_change`` runs after each
    enrolment. The port is bound in the constructor (an error there is the caller's to report)."""

    def __init__(self, site: Site, host: str, port: int, tls_dir: Path,
                 on_change: Callable[[], None] = lambda: None, *, max_connections: int = MAX_CONNECTIONS,
                 max_per_peer: int = MAX_PER_PEER, head_timeout_s: float = HEAD_TIMEOUT_S,
                 body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.site = site
        self.on_change = on_change
        self.counters: Counter[str] = Counter()
        self.max_connections, self.max_per_peer = max_connections, max_per_peer
        self.head_timeout_s, self.body_timeout_s = head_timeout_s, body_timeout_s
        self._limiter = _Limiter()
        self._lock = threading.Lock()  # enrolments one at a time: token uses are spent exactly once
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(tls_dir / "broker.pem"), str(tls_dir / "broker.key"))
        self._ctx = ctx
        self._sock = socket.create_server((host, port), backlog=1024, reuse_port=False)
        self._sock.setblocking(False)
        self.port = int(self._sock.getsockname()[1])
        self._conns: dict[str, list[_Conn]] = {}  # peer -> its open connections, oldest first (loop only)
        self._open = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(_WORKERS, thread_name_prefix="fog-enrol-work")
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fog-enrol", daemon=True)

    def start(self) -> EnrolmentServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._shutdown)
            self._thread.join(10)
        else:
            self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def open_connections(self) -> int:
        return self._open

    # ------------------------------------------------------------ the event loop (one thread)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(
                self._serve, sock=self._sock, limit=MAX_HEAD))
            self._ready.set()
            self._loop.run_forever()
        finally:
            self._ready.set()
            self._loop.close()

    def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for conns in self._conns.values():
            for c in conns:
                if c.task is not None:
                    c.task.cancel()
        self._loop.call_later(0.2, self._loop.stop)

    def _admit(self, conn: _Conn) -> bool:
        """Count ``conn`` in, dropping the oldest still-reading connection of its peer (per-peer cap)
        or of anyone (total cap) to make room; False when nothing could be dropped."""
        mine = self._conns.get(conn.peer, [])
        if len(mine) >= self.max_per_peer and not self._evict(mine, "peer"):
            return False
        if self._open >= self.max_connections:
            oldest = min((c for cs in self._conns.values() for c in cs if c.reading), key=lambda c: c.opened,
                         default=None)
            if oldest is None or not self._evict([oldest], "total"):
                return False
        self._conns.setdefault(conn.peer, []).append(conn)  # after evicting: that may drop the peer's list
        self._open += 1
        return True

    def _evict(self, conns: list[_Conn], cap: str) -> bool:
        victim = next((c for c in conns if c.reading), None)
        if victim is None:
            return False
        self.counters[f"evicted:{cap}"] += 1
        self._forget(victim)
        if victim.transport is not None:
            victim.transport.abort()
        if victim.task is not None:
            victim.task.cancel()
        return True

    def _forget(self, conn: _Conn) -> None:
        conns = self._conns.get(conn.peer)
        if conns is not None and conn in conns:
            conns.remove(conn)
            self._open -= 1
            if not conns:
                del self._conns[conn.peer]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str((writer.get_extra_info("peername") or ("?",))[0])
        conn = _Conn(peer, time.monotonic(), asyncio.current_task(), transport=writer.transport)
        if not self._admit(conn):
            self.counters["rejected:connections"] += 1
            writer.transport.abort()
            return
        try:
            await self._exchange(conn, reader, writer)
            return
        except (asyncio.TimeoutError, TimeoutError):
            self.counters["rejected:slow"] += 1
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ssl.SSLError, OSError):
            self.counters["rejected:connection"] += 1
        except asyncio.CancelledError:
            pass  # evicted, or the server stops
        finally:
            self._forget(conn)
        writer.transport.abort()

    async def _exchange(self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(self.head_timeout_s):
            await writer.start_tls(self._ctx)
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError:
                self.counters["rejected:size"] += 1
                await self._answer(writer, 431, {"error": f"request head larger than {MAX_HEAD} bytes"})
                return
        try:
            method, path, headers = parse_head(head[:-4])
        except ValueError as exc:
            self.counters["rejected:400"] += 1
            await self._answer(writer, 400, {"error": f"bad request: {exc}"})
            return
        body = b""
        if method == "POST":
            try:
                length = int(headers.get("content-length", "-1"))
            except ValueError:
                length = -1
            if length < 0 or length > MAX_BODY:
                self.counters["rejected:size"] += 1
                await self._answer(writer, 413, {"error": f"enrolment requests are at most {MAX_BODY} bytes "
                                                          "with a Content-Length"})
                return
            async with asyncio.timeout(self.body_timeout_s):
                body = await reader.readexactly(length)
        conn.reading = False
        code, answer, ctype = await asyncio.get_running_loop().run_in_executor(
            self._pool, self._handle, method, path, headers.get("authorization", ""), body, conn.peer)
        await self._answer(writer, code, answer, ctype)

    async def _answer(self, writer: asyncio.StreamWriter, code: int, body: dict[str, Any] | bytes,
                      ctype: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        reason = _REASONS.get(code, "Error")
        head = (f"HTTP/1.1 {code} {reason}\r\nServer: fogline-enrol/2\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
        writer.write(head + data)
        try:
            async with asyncio.timeout(self.body_timeout_s):  # a peer that does not read cannot hold us
                await writer.drain()
                writer.close()
                await writer.wait_closed()
        finally:
            writer.transport.abort()  # a no-op once closed

    # ------------------------------------------------------------ request handling (worker threads)

    def _handle(self, method: str, path: str, auth: str, body: bytes,
                peer: str) -> tuple[int, dict[str, Any] | bytes, str]:
        """(status, body, content type) of one request; never raises."""
        js = "application/json"
        if not self._limiter.allow(peer, time.monotonic()):
            self.counters["rejected:rate"] += 1
            return 429, {"error": "too many requests; slow down", "retry_after_s": 1}, js
        if method == "GET" and path == "/v1/ca":
            return 200, self.site.ca.ca_pem, "application/x-pem-file"
        if method != "POST" or path != "/v1/enroll":
            return 404, {"error": "not found: GET /v1/ca, POST /v1/enroll"}, js
        try:
            code, answer = self.enrol(auth, body, time.time())
        except TrustError as exc:
            self.counters[f"rejected:{exc.status}"] += 1
            log.warning("enrolment from %s refused: %s", peer, exc)
            return exc.status, {"error": str(exc)}, js
        except Exception as exc:
            self.counters["internal_errors"] += 1
            log.exception("enrolment failed")
            return 500, {"error": f"internal error: {type(exc).__name__}"}, js
        return code, answer, js

    def enrol(self, auth: str, body: bytes, now: float) -> tuple[int, dict[str, Any]]:
        if not auth.startswith("Bearer "):
            raise TrustError(401, "missing 'Authorization: Bearer <token id>.<secret>'")
        tid, _, secret = auth[len("Bearer "):].strip().partition(".")
        # the token first: a caller without one learns nothing (not even which names are taken)
        check_token(self.site.db.token(tid) if tid else None, secret)
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
        with self._lock:
            decision = decide_enrolment(EnrolRequest(device_id, tid, secret, signing_key, tls_sha, csr_pem),
                                        self.site.db.token(tid), self.site.db.device(device_id), now)
            # only a caller whose token may still enrol a device learns that a name is taken
            if device_id == self.site.fog_id or self.site.db.identity(device_id) is not None:
                raise TrustError(403, f"{device_id!r} is the name of another identity of this site")
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


_REASONS = {200: "OK", 202: "Accepted", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            404: "Not Found", 413: "Content Too Large", 429: "Too Many Requests",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}
