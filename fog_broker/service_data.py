"""The fog's data plane (``service.FogService``, owner thread unless said otherwise).

Authenticated inputs other than the devices' adverts: inference requests (over MQTT or from a
front end of this process), hop results, control requests and coordinator model releases; and
the router's commands: activations sent with a route ticket, answers relayed to their clients.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from runtime import codec, relay
from runtime.errors import DecodeError, RemoteViolation, SecurityError
from runtime.messages import (
    Activation,
    Envelope,
    InferenceRequest,
    InferenceResult,
    ModelRelease,
    RouteTicket,
)
from runtime.topics import CTL, INFER, RELEASE

from .control import misaddressed
from .ingest import RESULT
from .router import ReplyClient, SendActivation
from .service_config import LOCAL, LocalInfer
from .site_core import FollowRelease, Infer, ReleaseAccepted, Result, RouteUntrusted

if TYPE_CHECKING:
    from .service import FogService

__all__ = ["DataPlane", "PING"]

log = logging.getLogger("fog_broker.service")

PING = "__fog_self_ping__"  # the request id of the fog's own subscription ping (``FogService.start``)


class DataPlane:
    """Requests in, activations out, results back to whoever asked."""

    def __init__(self, svc: FogService) -> None:
        self.svc = svc
        self.subscribed = threading.Event()  # our ping came back: every subscription is active
        self._local: dict[str, Future[InferenceResult]] = {}  # in-process requests awaiting the router

    def router_cmds(self, cmds: list[Any]) -> None:
        for cmd in cmds:
            if isinstance(cmd, SendActivation):
                self._send_activation(cmd.activation)
            elif isinstance(cmd, ReplyClient):
                if cmd.reply_to.startswith(LOCAL):
                    fut = self._local.pop(cmd.reply_to[len(LOCAL):], None)
                    if fut is not None and not fut.done():
                        fut.set_result(cmd.result)
                else:
                    self.svc.publish_signed(cmd.reply_to, cmd.result)

    def _send_activation(self, act: Activation) -> None:
        """Issue the attempt's route ticket, which vouches for hop 0's tensors too (``runtime.relay``)."""
        svc = self.svc
        keys = [svc.device_keys.key_bytes(h.device_id) for h in act.route]
        if any(k is None for k in keys):
            svc.apply(RouteUntrusted(act, time.time()))
            return
        ticket = RouteTicket(svc.config.fog_id, act.request_id, act.workload, act.route,
                             tuple(k for k in keys if k is not None), act.reply_to, act.deadline)
        frame = relay.issue(svc.identity, ticket, act)
        svc.mqtt.publish(svc.topics.activation(act.route[0].device_id, svc.config.fog_id), frame)

    def handle(self, kind: str, msg: Any, at: float, sender: str = "") -> None:
        """An input decoded on the MQTT worker (``service_inputs``), authenticated here; ``sender``:
        its topic's id."""
        if kind == RESULT:
            self._on_result(msg, at)
        elif kind == INFER:
            self._on_infer(msg, at)
        elif kind == CTL:
            self.svc.control.handle(msg, at, msg.sender if isinstance(msg, Envelope) else "?")
        elif kind == RELEASE:
            self._on_release(msg, at, sender)

    def _on_result(self, env: Envelope, at: float) -> None:
        """A hop's answer, sealed by its device; the router checks the device is on the route."""
        svc = self.svc
        if env.sender == svc.config.fog_id:  # our own subscription ping (see start)
            try:
                ping = codec.decode(env.payload)
            except DecodeError:
                return
            if isinstance(ping, InferenceResult) and ping.request_id == PING:
                self.subscribed.set()
            return
        try:
            res = svc.results.verify_only(env)
        except SecurityError as exc:
            svc.counters[f"rejected:result {exc.reason}"] += 1
            svc.refused(RESULT, env.sender)
            return
        if not isinstance(res, InferenceResult):
            svc.counters["rejected:wrong kind"] += 1
            return
        svc.apply(Result(res, env.sender, time.time()), at)

    def _on_infer(self, env: Envelope, at: float) -> None:
        svc = self.svc
        req = svc.control.open_request(env, "infer", env.sender if isinstance(env, Envelope) else "?")
        if req is None:
            return
        why = misaddressed(req, InferenceRequest, svc.topics.reply(env.sender))
        if why is not None:
            svc.counters[f"rejected:{why}"] += 1
            return
        self.submit(req, at)

    def submit(self, req: InferenceRequest, at: float) -> None:
        """Route an authenticated request (owner thread); the answer goes to ``req.reply_to``."""
        self.svc.apply(Infer(req, time.time()), at)

    def _on_release(self, msg: Any, at: float, sender: str) -> None:
        """A signed new model version from a pinned coordinator: keep it, roll the workloads that follow it.

        Published on ``sender``'s topic (``cloud/RELEASE/{sender}``); the signer may be another pinned
        key (a release key), so a refusal is charged to ``sender``, who sent it, not to the signer."""
        svc = self.svc
        if not isinstance(msg, ModelRelease):
            svc.counters["rejected:wrong kind"] += 1
            svc.refused(RELEASE, sender)
            return
        why = svc.releases.check(msg, svc.trust.coordinators)
        if why:
            svc.counters[f"release:{why.split(' (')[0]}"] += 1
            if why != "stale":
                svc.refused(RELEASE, sender)  # a failed check; an old version again is only stale
            log.warning("model release %s v%s from %s (on %s's topic) refused: %s", msg.workload[:64], msg.version,
                        msg.signer[:64], sender, why)
            return
        try:
            ref = svc.artifacts.store_blob(msg.artifact, expect_sha=msg.sha256)
        except RemoteViolation as exc:
            svc.counters["release:bad model"] += 1
            svc.refused(RELEASE, sender)
            log.warning("model release %s v%d refused: %s", msg.workload, msg.version, exc)
            return
        svc.releases.accept(msg, ref)
        log.info("model release %s v%d from %s accepted (%s)", msg.workload, msg.version, msg.signer, ref[:17])
        svc.apply(ReleaseAccepted(msg.workload, msg.version, ref, msg.signer, dict(msg.metadata)), at)

    def follow_release(self, cmd: FollowRelease) -> None:
        """The core's rule: these workloads follow a release that has a new version; deploy their
        stored specs again (``release:NAME`` resolves to the new bytes, profiled anew)."""
        names = set(cmd.workloads)
        followers = [sw.spec for sw in self.svc.store.workloads() if sw.name in names]
        if followers:
            self.svc.control.deploy({"workloads": followers}, time.monotonic(), internal=True)

    def infer(self, workload: str, tensors: Mapping[str, Any], timeout: float = 5.0,
              stream: str = "") -> Future[InferenceResult]:
        """Route one request from a front end in this process (any thread): ``FogService.infer``."""
        rid = uuid.uuid4().hex
        fut: Future[InferenceResult] = Future()
        self._local[rid] = fut
        req = InferenceRequest(rid, workload, LOCAL + rid, dict(tensors), float(timeout), stream)
        try:
            self.svc.inputs.inbox.put_nowait(LocalInfer(req, time.monotonic()))
        except queue.Full:
            self._local.pop(rid, None)
            fut.set_result(InferenceResult(rid, False, {}, "fog broker overloaded (inbox full)", failure="overloaded",
                                           retry_after_s=1.0))
        return fut
