"""Python client of a fog broker: ``FogClient(host, port).infer(...)``, ``.deploy(...)``, ``.status()``.

It speaks the protocol of docs/protocol.md over MQTT: control requests on
``fog/CTL`` (signed with the operator key for changes), inference requests on
``fog/INFER``, answers on its own ``reply/{client}`` topic. The site is found
from the retained fog ``STATE`` unless given.
"""
from __future__ import annotations

import base64
import getpass
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from runtime import codec
from runtime.errors import DecodeError, FoglineError, LocalViolation
from runtime.messages import ControlReply, ControlRequest, FogState, InferenceRequest, InferenceResult
from runtime.mqtt import Inbound, MqttClient
from runtime.security import Identity, Signer, sha256_hex
from runtime.topics import ROOT, Topics

from .artifacts import MODEL_SCHEMES

__all__ = ["FogClient", "InferenceError", "ControlError", "operator_identity", "load_workloads_file"]


class InferenceError(FoglineError):
    """The fog broker answered a request with an error (the message says which stage failed)."""


class ControlError(FoglineError):
    pass


def operator_identity(path: str | Path | None = None) -> Identity:
    """The operator key: ``path``, else $FOGLINE_OPERATOR_KEY, else ~/.fogline/operator.key (created)."""
    p = Path(path or os.environ.get("FOGLINE_OPERATOR_KEY") or Path.home() / ".fogline" / "operator.key")
    user = "".join(c for c in getpass.getuser() if c.isalnum() or c in "-_.") or "user"
    host = "".join(c for c in socket.gethostname() if c.isalnum() or c in "-_.") or "host"
    return Identity.load_or_create(f"op-{user}@{host}"[:120], p)


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
    """A connection to one site's MQTT broker, addressing its fog broker."""

    def __init__(self, host: str = "127.0.0.1", port: int = 1883, *, site: str | None = None,
                 key: str | Path | None = None, connect_timeout: float = 5.0) -> None:
        self.client_id = f"cli-{uuid.uuid4().hex[:12]}"
        self._mqtt = MqttClient(self.client_id, host, port, keepalive=10)
        self._waiters: dict[str, tuple[threading.Event, list[Any]]] = {}
        self._lock = threading.Lock()
        self._key_path = key
        self._identity: Identity | None = None
        self._signer: Signer | None = None
        self._states: dict[str, FogState] = {}
        self._state_event = threading.Event()
        self._mqtt.subscribe(f"{ROOT}/+/fog/STATE", self._on_state)
        self._mqtt.subscribe(f"{ROOT}/+/reply/{self.client_id}", self._on_reply)
        self._mqtt.start()
        if not self._mqtt.wait_connected(connect_timeout):
            self._mqtt.stop()
            raise LocalViolation(f"cannot connect to MQTT broker at {host}:{port}")
        if site is None:
            deadline = time.monotonic() + connect_timeout
            while time.monotonic() < deadline:
                online = [s for s in self._states.values() if s.online]
                if online:
                    site = online[0].site
                    break
                self._state_event.wait(0.05)
                self._state_event.clear()
            if site is None:
                self._mqtt.stop()
                raise LocalViolation(f"no online fog broker announced at {host}:{port} (pass site=)")
        self.site = site
        self.topics = Topics(site)
        self.reply_topic = self.topics.reply(self.client_id)

    def close(self) -> None:
        self._mqtt.stop()

    def __enter__(self) -> "FogClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ handlers (MQTT worker thread)

    def _on_state(self, m: Inbound) -> None:
        try:
            msg = codec.decode(m.payload)
        except DecodeError:
            return
        if isinstance(msg, FogState):
            self._states[msg.site] = msg
            self._state_event.set()

    def _on_reply(self, m: Inbound) -> None:
        try:
            msg = codec.decode(m.payload)
        except DecodeError:
            return
        rid = getattr(msg, "request_id", None)
        with self._lock:
            w = self._waiters.get(rid) if isinstance(rid, str) else None
        if w is not None:
            w[1].append(msg)
            w[0].set()

    def _await(self, rid: str, payload: bytes, topic: str, timeout: float, resend_s: float = 0.0) -> Any:
        """Publish and wait for the answer; ``resend_s`` re-publishes idempotent requests (a fog broker
        that is just (re)subscribing may miss the first copy)."""
        ev: threading.Event = threading.Event()
        box: list[Any] = []
        with self._lock:
            self._waiters[rid] = (ev, box)
        try:
            deadline = time.monotonic() + timeout
            while True:
                self._mqtt.publish(topic, payload)
                left = deadline - time.monotonic()
                if ev.wait(min(left, resend_s) if resend_s > 0 else left):
                    return box[0]
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no answer from the fog broker within {timeout:g} s")
        finally:
            with self._lock:
                self._waiters.pop(rid, None)

    # ------------------------------------------------------------ control

    def _signer_for(self) -> Signer:
        if self._signer is None:
            self._identity = operator_identity(self._key_path)
            # A fresh epoch per client: the fog's replay window never sees an old (epoch, seq).
            self._signer = Signer(self._identity, int(time.time() * 1000))
        return self._signer

    def control(self, action: str, body: Mapping[str, Any] | None = None, *, signed: bool = True,
                timeout: float = 30.0) -> Any:
        rid = uuid.uuid4().hex
        payload_body = dict(body or {})
        if signed:
            signer = self._signer_for()
            assert self._identity is not None
            payload_body["operator_key"] = self._identity.public_key_bytes.hex()
        req = ControlRequest(rid, action, self.reply_topic, json.dumps(payload_body).encode())
        data = self._signer_for().seal_bytes(req, time.time()) if signed else codec.encode(req)
        reply = self._await(rid, data, self.topics.control(), timeout, resend_s=0.0 if signed else 1.0)
        if not isinstance(reply, ControlReply):
            raise ControlError(f"unexpected answer {type(reply).__name__}")
        if not reply.ok:
            raise ControlError(reply.error)
        return json.loads(reply.body or b"null")

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        return self.control("status", signed=False, timeout=timeout)  # type: ignore[no-any-return]

    def deploy(self, spec: Mapping[str, Any], *, base_dir: str | Path = ".", timeout: float = 60.0) -> Any:
        """Submit one workload dict or {"workloads": [...], "quotas": {...}}; local ONNX paths are uploaded."""
        return self.control("deploy", prepare_deploy(spec, base_dir), timeout=timeout)

    def delete(self, name: str, timeout: float = 30.0) -> Any:
        return self.control("delete", {"name": name}, timeout=timeout)

    def wait_running(self, name: str, timeout: float = 30.0, replicas: int | None = None) -> dict[str, Any]:
        """Poll status until the workload runs (all replicas healthy, or ``replicas`` of them)."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            st = self.status()
            for w in st["workloads"]:
                if w["name"] == name:
                    last = w
                    want = replicas if replicas is not None else w["replicas"]
                    if w["healthy_replicas"] >= want:
                        return w
            time.sleep(0.1)
        raise TimeoutError(f"workload {name} not running after {timeout:g} s: {last}")

    # ------------------------------------------------------------ inference

    def infer_result(self, workload: str, tensors: Mapping[str, np.ndarray], timeout: float = 5.0) -> InferenceResult:
        rid = uuid.uuid4().hex
        req = InferenceRequest(rid, workload, self.reply_topic,
                               {k: np.ascontiguousarray(v) for k, v in tensors.items()}, float(timeout))
        res = self._await(rid, codec.encode(req), self.topics.infer(), timeout + 2.0)
        if not isinstance(res, InferenceResult):
            raise InferenceError(f"unexpected answer {type(res).__name__}")
        return res

    def infer(self, workload: str, tensors: Mapping[str, np.ndarray], timeout: float = 5.0) -> dict[str, np.ndarray]:
        """Run one inference through the partition chain; raise InferenceError with the fog's reason."""
        res = self.infer_result(workload, tensors, timeout)
        if not res.ok:
            raise InferenceError(res.error)
        return {k: np.array(v) for k, v in res.tensors.items()}
