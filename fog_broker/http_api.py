"""``fogline broker --http PORT``: the Open Inference Protocol (KServe v2 REST) at the fog.

A thin adapter on its own asyncio loop thread (aiohttp): it authenticates the
caller (``api_auth``), parses and checks the request (``oip``), and hands the
tensors to ``FogService.infer`` -- the same router, failover and result checks
as a request over MQTT -- then encodes the answer. What it knows of the
workloads is the site core's frozen snapshot (``svc.snapshot``: the owner
thread builds one between two inbox items when asked), refreshed in the
background at most every ``refresh_s`` and at once when a request names a
workload the snapshot does not know or finds not ready.

Endpoints (docs/http.md): ``GET /v2/health/live`` and ``/v2/health/ready``
(no credentials: probes), and with credentials ``GET /v2``,
``GET /v2/models/{name}[/versions/{v}]``, ``.../ready``,
``POST .../infer``, ``POST /v2/repository/index``. TLS with the fog's broker
certificate (site CA) always, except ``insecure`` (plain HTTP, loopback only);
callers present a site-CA client certificate or ``Authorization: Bearer
<fgt1 token>``, in both cases an identity with the ``infer`` right. Other endpoints
(the site page, metrics) join the same server with ``extend``, and the same authentication
(``principal(request, right)``).
"""
from __future__ import annotations

import asyncio
import logging
import math
import ssl
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime import codec
from runtime.errors import LocalViolation
from runtime.net import is_loopback

from . import oip
from .api_auth import Principal, authorize, cert_principal, verify_token
from .http_limits import ConnectionTable, HttpLimits
from .trust import TrustError

if TYPE_CHECKING:
    from aiohttp import web

    from .port import FogPort
    from .snapshot import SiteSnapshot, WorkloadRow

__all__ = ["HttpApi", "AIOHTTP_MISSING", "require_aiohttp", "MAX_BODY", "MAX_TENSOR_BYTES", "HttpLimits"]

log = logging.getLogger("fog_broker.http")

AIOHTTP_MISSING = ("--http needs aiohttp, which is not installed: pip install 'fogline[fog]' "
                   "(or pip install 'aiohttp>=3.9')")
# An activation frame (tensors + route ticket) must decode on the device (runtime.relay: codec's
# DEFAULT_MAX_SIZE); the body may be larger, as JSON numbers take several bytes per element.
MAX_TENSOR_BYTES = codec.DEFAULT_MAX_SIZE - (256 << 10)
MAX_BODY = 64 * 1024 * 1024
_INLINE_BYTES = 256 << 10          # JSON above this (a request's, outputs as numbers) is parsed / encoded off the loop
_TOKEN_CACHE = 10_000
_TRUST_POLL_S = 0.5               # the owner thread re-reads trust.db this often too
_LINGER_S = 1.0                   # after an early answer (413, 408), unread body bytes are drained this long
_TLS_SHUTDOWN_S = 2.0             # a peer that never answers our TLS close_notify holds its socket this long


def require_aiohttp() -> None:
    """``LocalViolation`` (one line) when aiohttp cannot be imported."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise LocalViolation(AIOHTTP_MISSING) from None


def _workloads(snap: SiteSnapshot) -> dict[str, WorkloadRow]:
    return {w.name: w for w in snap.workloads}


_FAILURE_STATUS = {"unknown": 404, "not ready": 503, "overloaded": 503, "timeout": 504, "failed": 500}


def _result_error(name: str, res: Any, past_deadline: bool = False) -> oip.ProtocolError:
    """The router's failure kind -> the protocol's status (the error text stays the router's). A request
    that failed once its deadline had passed timed out (504), whichever hop noticed it first (a device
    refuses an activation whose deadline passed: "failed")."""
    if past_deadline and res.failure in ("failed", "timeout", ""):
        return oip.ProtocolError(504, f"inference timed out: {res.error}")
    if res.failure == "overloaded" or (not res.failure and "overloaded" in res.error):
        return oip.ProtocolError(503, res.error, max(1, math.ceil(res.retry_after_s)))  # whole seconds
    status = _FAILURE_STATUS.get(res.failure, 500)
    if status == 404:
        return oip.ProtocolError(404, f"unknown model {name!r}")
    if res.failure == "not ready":
        return oip.ProtocolError(503, f"model {name!r} is not ready: {res.error}")
    if res.failure == "timeout":
        return oip.ProtocolError(504, f"inference timed out: {res.error}")
    return oip.ProtocolError(status, res.error if status == 503 else f"inference failed: {res.error}")


class _Identities:
    """trust.db's identities as seen by this thread: re-read when ``TrustDB.version()`` moves."""

    def __init__(self, svc: FogPort) -> None:
        self.db = svc.site.db
        self.version = -1
        self.records: dict[str, Any] = {}
        self.checked = -math.inf

    def refresh(self, now: float, force: bool = False) -> None:
        if not force and now - self.checked < _TRUST_POLL_S:
            return
        self.checked = now
        v = self.db.version()
        if v != self.version:
            self.records = {r.name: r for r in self.db.identities()}
            self.version = v

    def lookup(self, name: str) -> Any:
        now = time.monotonic()
        self.refresh(now)
        rec = self.records.get(name)
        if rec is None:  # issued a moment ago? A version check is one PRAGMA; a re-read only if it moved
            self.refresh(now, force=True)
            rec = self.records.get(name)
        return rec


class HttpApi:
    """The Open Inference Protocol server of one ``FogService``: ``start()``, then ``stop()``."""

    def __init__(self, svc: FogPort, host: str, port: int, *, tls_dir: Path | None,
                 default_timeout_s: float = 5.0, max_body: int = MAX_BODY, refresh_s: float = 0.25,
                 limits: HttpLimits | None = None) -> None:
        require_aiohttp()
        if tls_dir is None and not is_loopback(host):
            raise LocalViolation(f"plain HTTP (--insecure) is refused on {host}: only on a loopback address; "
                                 "without --insecure the API is served over TLS with the site CA")
        self.svc = svc
        self.host = host
        self.port = port
        self.tls_dir = Path(tls_dir) if tls_dir is not None else None
        self.default_timeout_s = default_timeout_s
        self.max_body = max_body
        self.refresh_s = refresh_s
        self.shutdown_timeout_s = min(10.0, default_timeout_s + 1.0)
        self.counters: Counter[str] = Counter()
        self.limits = limits or HttpLimits()
        self._conns: ConnectionTable[Any] = ConnectionTable(self.limits.max_connections, self.limits.max_per_peer)
        self._listener: asyncio.Server | None = None
        self._ids = _Identities(svc)
        self._tokens: dict[str, tuple[str, bytes, Principal]] = {}  # token -> (name, key, principal)
        self._workloads: dict[str, WorkloadRow] = {}
        self._fog_ready = False
        self._snap_at = -math.inf          # when the snapshot in use was asked for (monotonic)
        self._refreshing: asyncio.Task[None] | None = None
        self._refresh_asked = -math.inf    # when the refresh in flight was asked for
        self._specs: dict[tuple[Any, ...], oip.ModelSpec] = {}
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="fog-http-call")  # snapshots, io_spec
        self._codec_pool = ThreadPoolExecutor(2, thread_name_prefix="fog-http-codec")  # large bodies
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: Any = None
        self._thread: threading.Thread | None = None
        self._version = _fogline_version()
        self._extensions: list[Callable[[Any, HttpApi], None]] = []

    def extend(self, register: Callable[[web.Application, HttpApi], None]) -> None:
        """Add routes (the site page, metrics) before ``start()``: ``register(app, api)`` is called with
        the aiohttp application. Handlers run on this server's loop; they authenticate with
        ``api.principal(request, right)`` and read the fog with ``await api.off_loop(api.svc.snapshot)``; a
        ``TrustError`` or ``oip.ProtocolError`` they raise is answered as ``{"error": ...}``."""
        if self._runner is not None:
            raise LocalViolation("HttpApi.extend() after start()")
        self._extensions.append(register)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on this server's thread pool (a snapshot the owner thread is building, a file
        read) without blocking this loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def owner_call(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        """``svc.call(fn)`` (``fn`` runs on the fog's owner thread) without blocking this loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.svc.call, fn, timeout)

    @property
    def scheme(self) -> str:
        return "http" if self.tls_dir is None else "https"

    # ------------------------------------------------------------ lifecycle

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.tls_dir is None:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.tls_dir / "broker.pem"), str(self.tls_dir / "broker.key"))
        # Client certificates are optional (a bearer token also authenticates), but one that is
        # presented must chain to the site CA; who it names is decided per request (api_auth).
        ctx.load_verify_locations(cadata=self.svc.site.ca.ca_pem.decode())
        ctx.verify_mode = ssl.CERT_OPTIONAL
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def start(self, timeout: float = 15.0) -> HttpApi:
        ctx = self.ssl_context()
        started = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()
        self._loop = loop

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve(ctx))
            except BaseException as exc:  # noqa: BLE001 - reported to start()'s caller
                failure.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="fog-http", daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            raise LocalViolation(f"the HTTP API did not start on {self.host}:{self.port} within {timeout:g} s")
        if failure:
            exc = failure[0]
            raise LocalViolation(f"cannot serve HTTP on {self.host}:{self.port}: "
                                 f"{getattr(exc, 'strerror', None) or exc}")
        if self.tls_dir is None:
            log.warning("INSECURE: the inference API is plain HTTP on %s:%d (loopback only; callers still "
                        "need an API token)", self.host, self.port)
        log.info("Open Inference Protocol on %s://%s:%d/v2", self.scheme, self.host, self.port)
        return self

    async def _serve(self, ctx: ssl.SSLContext | None) -> None:
        from aiohttp import web
        app = web.Application(client_max_size=self.max_body, middlewares=[self._error_middleware()])
        r = app.router
        r.add_get("/v2/health/live", self._live)
        r.add_get("/v2/health/ready", self._ready)
        r.add_get("/v2", self._server_metadata)
        r.add_get("/v2/", self._server_metadata)
        for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            r.add_get(base, self._model_metadata)
            r.add_get(base + "/ready", self._model_ready)
            r.add_post(base + "/infer", self._infer)
        r.add_post("/v2/repository/index", self._index)
        for register in self._extensions:
            register(app, self)
        # On stop, requests in flight get up to shutdown_timeout_s to be answered (the router answers
        # every accepted request within its timeout); the fog service stops after this server.
        # Slow clients (docs/http.md, "Limits"): the TLS handshake and then each request head must
        # arrive within header_timeout_s (aiohttp's keep-alive timer also runs from a connection's
        # start, and closes it while it still waits for a complete head); bodies are read raw and
        # inflated here, within the body budget (auto_decompress off: aiohttp would inflate on this
        # loop, and keep inflating an unread body after the answer); connections are capped per
        # peer and in total (ConnectionTable).
        lim = self.limits
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=self.shutdown_timeout_s, auto_decompress=False,
                                     keepalive_timeout=lim.header_timeout_s, lingering_time=_LINGER_S)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        self._install_limits(server)
        self._listener = await asyncio.get_running_loop().create_server(
            server, self.host, self.port, ssl=ctx, backlog=1024,
            ssl_handshake_timeout=lim.header_timeout_s if ctx is not None else None,
            ssl_shutdown_timeout=_TLS_SHUTDOWN_S if ctx is not None else None)
        socks = self._listener.sockets
        if socks:  # the port bound (PORT 0: any free one)
            self.port = int(socks[0].getsockname()[1])

    def _install_limits(self, server: Any) -> None:
        """Hook aiohttp's ``Server.connection_made``/``connection_lost`` (called by each connection's
        protocol once its TLS handshake is done) to the connection table: admit, shed, refuse."""
        made, lost = server.connection_made, server.connection_lost
        table = self._conns

        def connection_made(handler: Any, transport: Any) -> None:
            made(handler, transport)
            peer = transport.get_extra_info("peername")
            adm = table.open(handler, str(peer[0]) if isinstance(peer, tuple) and peer else "?", time.monotonic())
            for victim in adm.close:
                self.counters["connections shed"] += 1
                _abort(victim)
            if not adm.admit:
                self.counters["connections refused"] += 1
                log.debug("HTTP connection refused: %s", adm.reason)
                transport.abort()

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            table.closed(handler)
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None or self._thread is None:
            return
        if self._runner is not None and loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(self.shutdown_timeout_s + 2.0)
            except Exception as exc:  # noqa: BLE001 - stopping: nothing more to do than say so
                log.warning("HTTP API shutdown: %s", exc)
        if loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        self._thread.join(5.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._codec_pool.shutdown(wait=False, cancel_futures=True)

    async def _shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()  # no new connections; those open are answered and closed by cleanup()
        await self._runner.cleanup()

    # ------------------------------------------------------------ errors and authentication

    @staticmethod
    def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
        from aiohttp import web
        return web.Response(status=status, body=oip.error_body(message), content_type="application/json",
                            headers=headers)

    def _error_middleware(self) -> Callable[..., Awaitable[Any]]:
        """Every refusal as the protocol's error object, with its status; our own bugs as a logged 500."""
        from aiohttp import web

        @web.middleware
        async def errors(request: web.Request, handler: Callable[..., Awaitable[Any]]) -> Any:
            conn = request.protocol
            self._conns.busy(conn)   # a connection with a request in progress is never shed
            try:
                return await handler(request)
            except oip.ProtocolError as exc:
                self.counters[str(exc.status)] += 1
                headers = {"Retry-After": str(exc.retry_after)} if exc.status == 503 else None
                if exc.status >= 500:
                    log.info("%s %s -> %d %s", request.method, request.path, exc.status, exc.message)
                resp = self._error(exc.status, exc.message, headers)
                if exc.status in (408, 413, 415):  # the rest of the body is not wanted: close after it
                    resp.force_close()
                return resp
            except TrustError as exc:
                self.counters[str(exc.status)] += 1
                headers = {"WWW-Authenticate": 'Bearer realm="fogline"'} if exc.status == 401 else None
                return self._error(exc.status, str(exc), headers)
            except web.HTTPException as exc:  # routing (404, 405) and body limits (413)
                self.counters[str(exc.status)] += 1
                if exc.status == 413:
                    return self._error(413, f"request body larger than {self.max_body} bytes")
                return self._error(exc.status, exc.reason, {"Allow": exc.headers["Allow"]}
                                   if "Allow" in exc.headers else None)
            except TimeoutError as exc:  # the owner thread did not answer a snapshot in time
                self.counters["503"] += 1
                return self._error(503, f"fog broker busy: {exc}", {"Retry-After": "1"})
            except Exception:
                self.counters["500"] += 1
                log.exception("HTTP %s %s failed", request.method, request.path)
                return self._error(500, "internal error in the fog broker's HTTP API (logged)")
            finally:
                self._conns.idle(conn, time.monotonic())
        return errors

    async def _body(self, request: web.Request) -> bytes:
        """The request body, inflated per its Content-Encoding: at most ``max_body`` bytes on the wire and
        once inflated (413), all of it within ``body_timeout_s`` (408); inflating runs off this loop."""
        from aiohttp import web
        enc = request.headers.get("Content-Encoding", "identity")
        if enc.strip().lower() not in oip.ENCODINGS:
            raise oip.ProtocolError(415, f"Content-Encoding {enc[:40]!r} is not supported: send gzip, deflate "
                                         "or an uncompressed body")
        if request.content_length is not None and request.content_length > self.max_body:
            raise oip.ProtocolError(413, f"request body larger than {self.max_body} bytes")
        budget = self.limits.body_timeout_s
        try:
            raw = await asyncio.wait_for(request.read(), budget)
        except TimeoutError:
            raise oip.ProtocolError(408, f"the request body did not arrive within {budget:g} s") from None
        except web.HTTPRequestEntityTooLarge:
            raise oip.ProtocolError(413, f"request body larger than {self.max_body} bytes") from None
        if enc.strip().lower() in ("", "identity"):
            return raw
        return await asyncio.get_running_loop().run_in_executor(self._codec_pool, oip.inflate, raw, enc,
                                                                self.max_body)

    def principal(self, request: web.Request, right: str = "infer") -> Principal:
        """Who is calling, holding ``right``: a bearer token, else a client certificate; ``TrustError``
        otherwise (401 no or bad credentials, 403 revoked or without the right), which the server
        answers as ``{"error": ...}``. For handlers added with ``extend`` too."""
        auth = request.headers.get("Authorization")
        if auth is not None:
            scheme, _, cred = auth.strip().partition(" ")
            if scheme.lower() != "bearer" or not cred.strip():
                raise TrustError(401, "Authorization must be 'Bearer <token>' (fogline api-token)")
            return self._token(cred.strip(), right)
        cert = request.transport.get_extra_info("peercert") if request.transport is not None else None
        if cert:
            fields = {k: v for rdn in cert.get("subject", ()) for k, v in rdn}
            return cert_principal(str(fields.get("commonName", "")), str(fields.get("organizationalUnitName", "")),
                                  int(str(cert.get("serialNumber", "0")), 16), self._ids.lookup, right)
        raise TrustError(401, "no credentials: present a client certificate issued by the site CA or "
                              "'Authorization: Bearer <token>' (fogline api-token --credentials DIR)")

    def _token(self, token: str, right: str) -> Principal:
        now = time.time()
        hit = self._tokens.get(token)
        if hit is not None:
            name, key, p = hit
            rec = self._ids.lookup(name)
            if rec is not None and rec.signing_key == key and now < p.expires_at:
                return authorize(rec, "token", p.expires_at, right)  # revocation and role, every time
            self._tokens.pop(token, None)
        cfg = self.svc.config
        p = verify_token(token, self._ids.lookup, site=cfg.site, fog_id=cfg.fog_id, now=now, right=right)
        if len(self._tokens) >= _TOKEN_CACHE:
            self._tokens.clear()
        rec = self._ids.lookup(p.name)
        self._tokens[token] = (p.name, rec.signing_key, p)
        return p

    # ------------------------------------------------------------ workloads

    async def _refresh(self, asked: float) -> None:
        snap = await self.off_loop(self.svc.snapshot, 0.0)
        if asked >= self._snap_at:  # never replace a newer snapshot by an older one that finished later
            self._workloads, self._fog_ready, self._snap_at = _workloads(snap), snap.ready, asked

    def _start_refresh(self) -> asyncio.Task[None]:
        self._refresh_asked = time.monotonic()
        self._refreshing = task = asyncio.ensure_future(self._refresh(self._refresh_asked))
        task.add_done_callback(_log_failure)
        return task

    async def _fresh(self, max_age: float = 0.0) -> None:
        """A snapshot asked for at most ``max_age`` s before this call (0: after it began); joins a
        refresh in flight that is recent enough, so a burst of callers costs one owner-thread call."""
        began = time.monotonic()
        if max_age > 0 and began - self._snap_at <= max_age:
            return
        task = self._refreshing
        if task is None or task.done() or self._refresh_asked < began - max_age:
            task = self._start_refresh()
        await asyncio.shield(task)

    def _touch(self) -> None:
        """Refresh in the background when the snapshot is old; the request goes on with it."""
        if time.monotonic() - self._snap_at > self.refresh_s and (self._refreshing is None or self._refreshing.done()):
            self._start_refresh()

    async def _workload(self, name: str, version: str | None) -> WorkloadRow:
        w = self._workloads.get(name)
        if w is None:
            await self._fresh()
            w = self._workloads.get(name)
            if w is None:
                raise oip.ProtocolError(404, f"unknown model {name!r}: no workload of that name is placed "
                                             "by this fog broker")
        else:
            self._touch()
        if version is not None and version != str(w.version):
            raise oip.ProtocolError(404, f"model {name!r} version {version[:20]!r} is not served "
                                         f"(current: {w.version})")
        return w

    async def _ready_workload(self, w: WorkloadRow) -> WorkloadRow:
        if not w.ready:
            await self._fresh()
            w = self._workloads.get(w.name, w)
        return w

    async def _spec(self, w: WorkloadRow) -> oip.ModelSpec:
        key = (w.name, w.version, w.model, w.input_shapes)
        spec = self._specs.get(key)
        if spec is None:
            if w.model is None:
                raise oip.ProtocolError(400, f"workload {w.name!r} has no ONNX model (a profile-only workload)")
            io = await asyncio.get_running_loop().run_in_executor(self._pool, self.svc.artifacts.io_spec, w.model)
            spec = oip.ModelSpec.from_io(w.name, str(w.version), io, dict(w.input_shapes))
            if len(self._specs) > 1000:
                self._specs.clear()
            self._specs[key] = spec
        return spec

    # ------------------------------------------------------------ handlers

    async def _live(self, request: web.Request) -> web.Response:
        from aiohttp import web
        return web.Response(status=200)

    async def _ready(self, request: web.Request) -> web.Response:
        from aiohttp import web
        await self._fresh(self.refresh_s)  # no credentials needed: probes get a snapshot <= refresh_s old
        waiting = sum(1 for w in self._workloads.values() if not w.ready)
        if not self._fog_ready:
            return self._error(400, "the fog broker is still waiting for its devices after a start")
        if waiting:
            return self._error(400, f"{waiting} of {len(self._workloads)} models are not ready")
        return web.Response(status=200)

    async def _server_metadata(self, request: web.Request) -> web.Response:
        from aiohttp import web
        self.principal(request)
        cfg = self.svc.config
        return web.json_response({"name": "fogline", "version": self._version, "extensions": list(oip.EXTENSIONS),
                                  "fog_id": cfg.fog_id, "site": cfg.site})

    async def _model_metadata(self, request: web.Request) -> web.Response:
        from aiohttp import web
        self.principal(request)
        w = await self._workload(request.match_info["name"], request.match_info.get("version"))
        return web.json_response((await self._spec(w)).metadata())

    async def _model_ready(self, request: web.Request) -> web.Response:
        from aiohttp import web
        self.principal(request)
        w = await self._ready_workload(
            await self._workload(request.match_info["name"], request.match_info.get("version")))
        if not w.ready:
            return self._error(400, f"model {w.name!r} is not ready: {w.why_not_ready()}")
        return web.Response(status=200)

    async def _index(self, request: web.Request) -> web.Response:
        from aiohttp import web
        self.principal(request)
        await self._fresh()
        rows = [{"name": w.name, "version": str(w.version), "state": "READY" if w.ready else "UNAVAILABLE",
                 "reason": "" if w.ready else w.why_not_ready()} for w in sorted(self._workloads.values(),
                                                                                 key=lambda x: x.name)]
        return web.json_response(rows)

    async def _infer(self, request: web.Request) -> web.Response:
        from aiohttp import web
        who = self.principal(request)
        name = request.match_info["name"]
        w = await self._workload(name, request.match_info.get("version"))
        spec = await self._spec(w)
        body = await self._body(request)
        hl = request.headers.get("Inference-Header-Content-Length")
        try:
            header_length = int(hl) if hl is not None else None
        except ValueError:
            raise oip.ProtocolError(400, "Inference-Header-Content-Length must be an integer") from None
        # parsing costs what the JSON part holds: binary tensors are views of the body, and a hop to
        # the codec pool and back costs more than they do (a 1.2 MB binary frame: ~1 ms under load)
        json_part = header_length if header_length is not None and 0 < header_length <= len(body) else len(body)
        if json_part > _INLINE_BYTES:
            req = await asyncio.get_running_loop().run_in_executor(self._codec_pool, oip.parse_infer, body,
                                                                   header_length)
        else:
            req = oip.parse_infer(body, header_length)
        oip.check_inputs(req, spec, MAX_TENSOR_BYTES)
        w = await self._ready_workload(w)
        if not w.ready:
            raise oip.ProtocolError(503, f"model {name!r} is not ready: {w.why_not_ready()}")
        timeout = req.timeout_s or w.slo_s or self.default_timeout_s
        stream = req.parameters.get("stream")  # answers of one caller's stream in the order sent
        stream = f"{who.name}\0{stream}"[:256] if isinstance(stream, str) and stream else ""
        began = time.monotonic()
        try:
            res = await asyncio.wait_for(asyncio.wrap_future(self.svc.infer(name, req.inputs, timeout, stream)),
                                         timeout + 5.0)
        except asyncio.TimeoutError:
            raise oip.ProtocolError(504, f"no answer from the fog broker's router within {timeout + 5.0:g} s") \
                from None
        if not res.ok:
            raise _result_error(name, res, time.monotonic() - began >= timeout)
        self.counters["200"] += 1
        order = [t.name for t in spec.outputs]
        if oip.json_bytes(req, res.tensors) > _INLINE_BYTES:
            out, hlen = await asyncio.get_running_loop().run_in_executor(
                self._codec_pool, oip.encode_response, name, str(w.version), req, res.tensors, order,
                {"replica": res.replica})
        else:
            out, hlen = oip.encode_response(name, str(w.version), req, res.tensors, order, {"replica": res.replica})
        if hlen is None:
            return web.Response(body=out, content_type="application/json")
        return web.Response(body=out, content_type="application/octet-stream",
                            headers={"Inference-Header-Content-Length": str(hlen)})


def _abort(handler: Any) -> None:
    """Close a connection at once (no TLS goodbye a slow peer could stall)."""
    t = getattr(handler, "transport", None)
    if t is not None:
        t.abort()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("workload snapshot failed: %s", task.exception())


def _fogline_version() -> str:
    try:
        from importlib.metadata import version
        return version("fogline")
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source checkout)
        return "0"
