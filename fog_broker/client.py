"""Python client of a fog broker: ``FogClient(credentials=DIR).infer(...)``, ``.deploy(...)``, ``.status()``.

It speaks the protocol of docs/protocol.md and docs/security.md over MQTT with
an identity the site issued (``fogline operators add``; the first operator's is
``FOGDIR/credentials/admin``): TLS with its certificate, every request an
envelope sealed with its signing key, answers on its own ``reply/{name}``
topic accepted only when sealed by the fog key pinned in its ``fog.json``.
One connection per identity: the broker binds the client id to the
certificate, so a second client with the same credentials takes the session over.
"""
from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from runtime import codec
from runtime.credentials import Credentials, load_credentials
from runtime.errors import DecodeError, FoglineError, LocalViolation, SecurityError
from runtime.messages import (
    ControlReply,
    ControlRequest,
    FogState,
    InferenceRequest,
    InferenceResult,
)
from runtime.mqtt import Inbound, MqttClient, parse_hostport
from runtime.net import require_loopback
from runtime.security import Signer, TrustStore, Verifier, sha256_hex
from runtime.topics import Topics

from .artifacts import MODEL_SCHEMES
from .control import refusal_id

__all__ = ["FogClient", "InferenceError", "Overloaded", "ControlError", "KeyMismatch", "load_workloads_file"]

_MAX_WAIT_S = 120.0  # the router's longest deadline: what a request without a timeout may wait


class InferenceError(FoglineError):
    """The fog broker answered a request with an error (the message says which stage failed)."""


class Overloaded(InferenceError, ConnectionRefusedError):
    """The fog refused the request at once: no replica chain could answer it within its deadline.

    A ``ConnectionRefusedError`` (what retrying code catches); ``retry_after`` is the fog's guess, in
    seconds, of when the same request could be admitted. Nothing ran: sending it again is safe.
    """

    def __init__(self, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "overloaded"


def raise_for(res: InferenceResult) -> None:
    """An error answer as the exception a caller catches: ``Overloaded`` for a refusal, else
    ``InferenceError``."""
    if res.ok:
        return
    if res.failure == "overloaded":
        raise Overloaded(res.error, res.retry_after_s)
    raise InferenceError(res.error)


def _timeout(timeout: float | None) -> float:
    """A request's deadline as sent: None -> 0.0 (the workload's ``slo_s``, else the fog's default)."""
    if timeout is None:
        return 0.0
    t = float(timeout)
    if not (t > 0 and t < float("inf")):
        raise LocalViolation(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return t


class ControlError(FoglineError):
    pass


class KeyMismatch(LocalViolation):
    """The fog answers, but not under the key pinned in the credentials (another site's, or re-keyed)."""


def load_workloads_file(path: str | Path) -> dict[str, Any]:
    """Read WORKLOAD.json (one workload or {"workloads": [...]}) and attach local ONNX files as blobs."""
    path = Path(path)
    doc = json.loads(path.read_text())
    return prepare_deploy(doc, path.parent)


def prepare_deploy(doc: Mapping[str, Any], base_dir: str | Path = ".") -> dict[str, Any]:
    items = doc.get("workloads") if isinstance(doc, Mapping) and "workloads" in doc else [doc]
    if not isinstance(items, list):
        raise LocalViolation("'workloads' must be a list")
    blobs: dict[str, str] = {}
    out = []
    for w in items:
        w = dict(w)
        model = w.get("model")
        if isinstance(model, str) and not model.startswith(MODEL_SCHEMES):
            mp = Path(model)
            if not mp.is_absolute():
                mp = Path(base_dir) / mp
            try:
                data = mp.read_bytes()
            except OSError as exc:
                raise LocalViolation(f"workload {w.get('name')!r}: cannot read model {str(mp)!r} "
                                     f"({exc.strerror}); use a path, or {', '.join(MODEL_SCHEMES)}NAME") from None
            sha = sha256_hex(data)
            blobs[sha] = base64.b64encode(data).decode()
            w["model"] = f"file:{sha}"
        out.append(w)
    body: dict[str, Any] = {"workloads": out}
    if isinstance(doc, Mapping) and doc.get("quotas"):
        body["quotas"] = doc["quotas"]
    if blobs:
        body["blobs"] = blobs
    return body


class FogClient:
    """A connection to one site's MQTT broker, addressing its fog broker with one issued identity."""

    def __init__(self, host: str | None = None, port: int | None = None, *,
                 credentials: Credentials | str | Path | None = None, insecure: bool = False,
                 connect_timeout: float = 5.0, hello_timeout: float | None = None) -> None:
        self.creds = credentials if isinstance(credentials, Credentials) else load_credentials(credentials)
        fog = self.creds.fog
        if host is None or port is None:
            if not fog.mqtt:
                raise LocalViolation(f"{self.creds.dir}/fog.json names no MQTT address; pass --broker HOST:PORT")
            h, p = parse_hostport(fog.mqtt)
            host, port = host or h, port or p
        tls = None
        if insecure:
            require_loopback(host, "--insecure")
        else:
            tls = self.creds.tls_for(fog.fog_id)  # the broker certificate names the fog id, whatever IP we dial
        self.client_id = self.creds.name
        self.site = fog.site
        self.topics = Topics(fog.site)
        self.reply_topic = self.topics.reply(self.client_id)
        # A fresh epoch per client: the fog's replay window never sees an old (epoch, seq).
        self._signer = Signer(self.creds.signing, time.time_ns() // 1_000_000)
        self._sign_lock = threading.Lock()
        self._fog = Verifier(TrustStore({fog.fog_id: fog.public_key}))
        self.rejected = 0  # answers not sealed by the pinned fog key (dropped)
        self._waiters: dict[str, tuple[threading.Event, list[Any]]] = {}
        self._lock = threading.Lock()
        self._state: FogState | None = None
        self._mqtt = MqttClient(self.client_id, host, port, keepalive=10, tls=tls)
        self._mqtt.subscribe(self.topics.fog_state(), self._on_state)
        self._mqtt.subscribe(self.reply_topic, self._on_reply)
        self._mqtt.start()
        try:
            self._mqtt.wait_connected(connect_timeout, strict=True)
            self.hello = self._hello(hello_timeout if hello_timeout is not None else max(connect_timeout, 10.0))
        except LocalViolation:
            self._mqtt.stop()
            raise

    def close(self) -> None:
        self._mqtt.stop()

    def __enter__(self) -> FogClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def fog_online(self) -> bool:
        return self._state is not None and self._state.online

    # ------------------------------------------------------------ handlers (MQTT worker thread)

    def _open(self, payload: bytes) -> Any:
        """A message sealed by the pinned fog key, or None (counted)."""
        try:
            env = codec.decode_envelope(payload)
            if env.sender != self.creds.fog.fog_id:
                raise SecurityError("unknown sender", env.sender[:64])
            return self._fog.verify_only(env)
        except (DecodeError, SecurityError):
            self.rejected += 1
            return None

    def _on_state(self, m: Inbound) -> None:
        msg = self._open(m.payload)
        if isinstance(msg, FogState) and msg.site == self.site:
            self._state = msg

    def _on_reply(self, m: Inbound) -> None:
        msg = self._open(m.payload)
        rid = getattr(msg, "request_id", None)
        with self._lock:
            # a refusal of a request the fog could not read names our envelope (refusal_id), not the id
            w = self._waiters.get(rid) if isinstance(rid, str) else None
        if w is not None and not w[1]:
            w[1].append(msg)
            w[0].set()

    def _seal(self, msg: Any) -> tuple[bytes, str]:
        """The sealed request and the id a refusal of it would carry."""
        with self._sign_lock:
            env = self._signer.seal(msg, time.time())
        return codec.encode(env), refusal_id(env)

    def _await(self, rid: str, sealed: tuple[bytes, str], topic: str, timeout: float) -> Any:
        return self._collect(self._post(rid, sealed, topic), timeout)

    def _post(self, rid: str, sealed: tuple[bytes, str], topic: str
              ) -> tuple[str, str, threading.Event, list[Any]]:
        """Register the answer's waiter, then publish: the answer cannot arrive unheard."""
        payload, refused = sealed
        ev: threading.Event = threading.Event()
        box: list[Any] = []
        with self._lock:
            self._waiters[rid] = self._waiters[refused] = (ev, box)
        try:
            self._mqtt.publish(topic, payload)
        except BaseException:
            self._forget(rid, refused)
            raise
        return rid, refused, ev, box

    def _forget(self, rid: str, refused: str) -> None:
        with self._lock:
            self._waiters.pop(rid, None)
            self._waiters.pop(refused, None)

    def _collect(self, posted: tuple[str, str, threading.Event, list[Any]], timeout: float) -> Any:
        rid, refused, ev, box = posted
        try:
            if not ev.wait(timeout):
                raise TimeoutError(f"no answer from the fog broker within {timeout:g} s")
            return box[0]
        finally:
            self._forget(rid, refused)

    def _hello(self, timeout: float) -> dict[str, Any]:
        """Say hello until the fog answers: it proves both directions work for this identity.

        An identity issued a moment ago is not in the broker's ACL until the fog reloads it (under
        a second), and a request sent before that is dropped without a word; so repeat an
        idempotent request rather than send real work into the void.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.control("hello", timeout=min(0.5, max(0.05, deadline - time.monotonic())))  # type: ignore[no-any-return]
            except TimeoutError:
                if time.monotonic() >= deadline:
                    fog = self.creds.fog
                    if self.rejected:
                        raise KeyMismatch(f"{self.rejected} answer(s) on {self.site}'s topics are not sealed by the "
                                          f"fog key pinned in {self.creds.dir}/fog.json ({fog.fog_id} "
                                          f"{fog.public_key.hex()[:16]}...): credentials of another site, or a "
                                          "re-keyed fog") from None
                    raise LocalViolation(f"no answer from fog {fog.fog_id} as {self.client_id} within "
                                         f"{timeout:g} s (is it running? was this identity revoked?)") from None
            except ControlError as exc:
                raise LocalViolation(f"fog {self.creds.fog.fog_id} refused {self.client_id}: {exc}") from None

    # ------------------------------------------------------------ other topics (coordinators)

    def watch(self, topic: str, handler: Callable[[Inbound], None], max_bytes: int) -> None:
        """Subscribe this connection to another topic its identity may read (e.g. the fog's summary)."""
        self._mqtt.subscribe(topic, handler, max_bytes=max_bytes)

    def send(self, topic: str, payload: bytes, timeout: float) -> bool:
        """Publish at QoS 1, never retained; True once the broker acknowledged it (e.g. a release)."""
        return self._mqtt.publish(topic, payload, qos=1, retain=False).wait(timeout)

    # ------------------------------------------------------------ control

    def control(self, action: str, body: Mapping[str, Any] | None = None, *, timeout: float = 30.0) -> Any:
        rid = uuid.uuid4().hex
        req = ControlRequest(rid, action, self.reply_topic, json.dumps(dict(body or {})).encode())
        reply = self._await(rid, self._seal(req), self.topics.control(self.client_id), timeout)
        if not isinstance(reply, ControlReply):
            raise ControlError(f"unexpected answer {type(reply).__name__}")
        if not reply.ok:
            raise ControlError(reply.error)
        return json.loads(reply.body or b"null")

    def status(self, timeout: float = 10.0, *, offset: int = 0, limit: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"offset": offset}
        if limit is not None:
            body["limit"] = limit
        return self.control("status", body, timeout=timeout)  # type: ignore[no-any-return]

    def deploy(self, spec: Mapping[str, Any], *, base_dir: str | Path = ".", timeout: float = 60.0) -> Any:
        """Submit one workload dict or {"workloads": [...], "quotas": {...}}; local ONNX paths are uploaded."""
        return self.control("deploy", prepare_deploy(spec, base_dir), timeout=timeout)

    def delete(self, name: str, timeout: float = 30.0) -> Any:
        return self.control("delete", {"name": name}, timeout=timeout)

    def wait_running(self, name: str, timeout: float = 30.0, replicas: int | None = None) -> dict[str, Any]:
        """Poll status until the workload runs (all replicas healthy, or ``replicas`` of them).

        One status call that outlives its own timeout (a busy fog: agents enrolling, an ACL being
        test-loaded) is "not yet", not a failure: ``timeout`` bounds the whole wait."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                st = self.status(limit=0, timeout=max(0.1, min(10.0, deadline - time.monotonic())))
            except TimeoutError:
                continue  # the call itself waited its timeout
            for w in st["workloads"]:
                if w["name"] == name:
                    last = w
                    want = replicas if replicas is not None else w["replicas"]
                    if w["healthy_replicas"] >= want:
                        return last
            time.sleep(0.1)
        raise TimeoutError(f"workload {name} not running after {timeout:g} s: {last}")

    # ------------------------------------------------------------ inference

    def infer_result(self, workload: str, tensors: Mapping[str, np.ndarray], timeout: float | None = None, *,
                     stream: str = "") -> InferenceResult:
        """One request's ``InferenceResult`` (ok or the fog's error; no exception for either).

        ``timeout``: its deadline in seconds (None: the workload's ``slo_s``, else 5 s); ``stream``:
        answers of requests naming the same stream come back in the order they were sent.
        """
        t = _timeout(timeout)
        rid = uuid.uuid4().hex
        req = InferenceRequest(rid, workload, self.reply_topic,
                               {k: np.ascontiguousarray(v) for k, v in tensors.items()}, t, stream)
        res = self._await(rid, self._seal(req), self.topics.infer(self.client_id), (t or _MAX_WAIT_S) + 2.0)
        if isinstance(res, ControlReply) and not res.ok:
            raise InferenceError(res.error)
        if not isinstance(res, InferenceResult):
            raise InferenceError(f"unexpected answer {type(res).__name__}")
        return res

    def _post_infer(self, workload: str, tensors: Mapping[str, np.ndarray], timeout: float
                    ) -> tuple[str, str, threading.Event, list[Any]]:
        rid = uuid.uuid4().hex
        req = InferenceRequest(rid, workload, self.reply_topic,
                               {k: np.ascontiguousarray(v) for k, v in tensors.items()}, _timeout(timeout))
        return self._post(rid, self._seal(req), self.topics.infer(self.client_id))

    def stream_results(self, workload: str, frames: Iterable[Mapping[str, np.ndarray]], *,
                       window: int = 8, timeout: float = 5.0) -> Iterator[InferenceResult]:
        """Every frame's ``InferenceResult``, in the frames' order, with up to ``window`` in flight.

        Keeps a pipelined chain full (stage i on frame n+1 while stage i+1 is on frame n) while
        bounding what waits anywhere: a new frame is sent only once the oldest is answered, so a
        slow chain slows the sender (backpressure) instead of growing queues. ``timeout`` is each
        request's budget from when it was sent. Stopping the iteration early forgets the frames
        still in flight (their answers are dropped).
        """
        if window < 1:
            raise LocalViolation(f"window must be >= 1, got {window}")
        pending: deque[tuple[tuple[str, str, threading.Event, list[Any]], float]] = deque()

        def oldest() -> InferenceResult:
            posted, sent = pending.popleft()
            res = self._collect(posted, max(0.0, sent + timeout + 2.0 - time.monotonic()))
            if isinstance(res, ControlReply) and not res.ok:
                raise InferenceError(res.error)
            if not isinstance(res, InferenceResult):
                raise InferenceError(f"unexpected answer {type(res).__name__}")
            return res

        try:
            for frame in frames:
                if len(pending) >= window:
                    yield oldest()
                pending.append((self._post_infer(workload, frame, timeout), time.monotonic()))
            while pending:
                yield oldest()
        finally:
            for posted, _ in pending:
                self._forget(posted[0], posted[1])

    def stream(self, workload: str, frames: Iterable[Mapping[str, np.ndarray]], *,
               window: int = 8, timeout: float = 5.0) -> Iterator[dict[str, np.ndarray]]:
        """Each frame's output tensors, in order, ``window`` requests in flight; raise InferenceError
        on the first frame the fog could not answer (``stream_results`` to see every outcome)."""
        for res in self.stream_results(workload, frames, window=window, timeout=timeout):
            raise_for(res)
            yield {k: np.array(v) for k, v in res.tensors.items()}

    def infer_many(self, workload: str, frames: Iterable[Mapping[str, np.ndarray]], *,
                   window: int = 8, timeout: float = 5.0) -> list[dict[str, np.ndarray]]:
        """``stream`` collected into a list."""
        return list(self.stream(workload, frames, window=window, timeout=timeout))

    def infer(self, workload: str, tensors: Mapping[str, np.ndarray],
              timeout: float | None = None) -> dict[str, np.ndarray]:
        """Run one inference through the partition chain; raise ``Overloaded`` when the fog refused it
        (no chain could answer within ``timeout``, or the workload's ``slo_s``), else InferenceError
        with the fog's reason."""
        res = self.infer_result(workload, tensors, timeout)
        raise_for(res)
        return {k: np.array(v) for k, v in res.tensors.items()}
