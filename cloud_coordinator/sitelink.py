"""One site's connection for the coordinator: status, held-out requests, summaries and releases on one identity.

The broker binds a client id to its certificate, so everything the
coordinator does at a site goes over one MQTT connection: a ``FogClient``
(``fogline status``'s protocol: sealed requests, answers accepted only under
the fog key pinned in ``fog.json``) that also carries the summary
subscription and the release publishes. A thread per site owns it: it
(re)connects with backoff, polls ``status``, and runs the commands the
service hands it (publish, probe); it reports to the service's queue as
rollout events (``Seen``, ``Lost``, ``ProbeDone``). It never decides anything.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fog_broker.client import FogClient, InferenceError, KeyMismatch
from runtime.errors import FoglineError, LocalViolation
from runtime.topics import Topics

from .canary import held_out_batch, reference_outputs
from .release import ReleaseError
from .rollout import Lost, ProbeDone, ProbeSample, RolloutPolicy, Seen, compare_outputs, site_view
from .sites import Site
from .summaries import MAX_SUMMARY_BYTES, SummaryInbox

__all__ = ["SiteClient", "SiteLink", "KeyMismatch", "SendRelease", "RunProbe"]

log = logging.getLogger("fogline.sites")


class SiteClient(FogClient):
    """``FogClient`` as the coordinator uses it: one site identity's connection (kept for the name)."""


@dataclass(frozen=True, slots=True)
class SendRelease:
    name: str
    version: int
    frame: bytes   # the encoded ModelRelease, signed for this site


@dataclass(frozen=True, slots=True)
class RunProbe:
    name: str
    version: int
    workloads: tuple[str, ...]
    blob: bytes
    policy: RolloutPolicy


_STOP = object()


class SiteLink:
    """The thread that owns one site's ``SiteClient``."""

    def __init__(self, site: Site, summaries_dir: Path, events: "queue.Queue[Any]", *, insecure: bool = False,
                 poll_s: float = 5.0, fast_poll_s: float = 0.5, connect_timeout_s: float = 5.0,
                 request_timeout_s: float = 5.0) -> None:
        self.site = site
        self.events = events
        self.insecure = insecure
        self.poll_s, self.fast_poll_s = poll_s, fast_poll_s
        self.connect_timeout_s, self.request_timeout_s = connect_timeout_s, request_timeout_s
        self.topics = Topics(site.creds.fog.site)
        self.summaries = SummaryInbox(site.creds.fog, summaries_dir)
        self.client: SiteClient | None = None
        self.fast = False            # set by the service while a rollout needs this site's news
        self.poll_now = threading.Event()
        self.commands: queue.Queue[Any] = queue.Queue()
        # what `fogline sites status` shows (read by the service thread; replaced whole)
        self.info: dict[str, Any] = {"reachable": False, "error": "not connected yet", "last_contact_at": None}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"site-{site.name}", daemon=True)

    def start(self) -> "SiteLink":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.commands.put(_STOP)
        if self._thread.ident is not None:
            self._thread.join(timeout)
        if self.client is not None:
            self.client.close()
            self.client = None

    def submit(self, cmd: SendRelease | RunProbe) -> None:
        self.commands.put(cmd)

    # ------------------------------------------------------------ the thread

    def _lost(self, error: str) -> None:
        error = " ".join(error.split())[:300]
        self.info = {**self.info, "reachable": False, "error": error}
        self.events.put(Lost(self.site.name, error))

    def _connect(self) -> bool:
        s = self.site
        try:
            c = SiteClient(s.host, s.port, credentials=s.creds, insecure=self.insecure,
                           connect_timeout=self.connect_timeout_s, hello_timeout=self.connect_timeout_s)
        except LocalViolation as exc:
            self._lost(str(exc))
            return False
        c.watch(self.topics.summary(), self.summaries.on_summary, MAX_SUMMARY_BYTES)
        self.client = c
        log.info("site %s: connected to %s as %s", s.name, s.address, s.creds.name)
        return True

    def _run(self) -> None:
        backoff, next_connect, next_poll = 0.5, 0.0, 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if self.client is None and now >= next_connect:
                if self._connect():
                    backoff, next_poll = 0.5, 0.0
                else:
                    next_connect, backoff = now + backoff, min(backoff * 2, 15.0)
            due = next_poll if self.client is not None else next_connect
            wait = 0.0 if self.poll_now.is_set() else min(max(0.0, due - now), 0.5)
            try:
                cmd = self.commands.get(timeout=wait)
            except queue.Empty:
                cmd = None
            if cmd is _STOP:
                break
            if cmd is not None:
                self._do(cmd)
                continue
            if self.client is not None and (time.monotonic() >= next_poll or self.poll_now.is_set()):
                self.poll_now.clear()
                self._poll()
                next_poll = time.monotonic() + (self.fast_poll_s if self.fast else self.poll_s)

    def _poll(self) -> None:
        assert self.client is not None
        try:
            st = self.client.status(timeout=self.request_timeout_s, limit=None if self.fast else 0)
            view = site_view(st)
        except TimeoutError as exc:
            self._lost(f"no status answer: {exc}")
            return
        except (FoglineError, ValueError, TypeError, KeyError) as exc:
            self._lost(f"status refused or unreadable: {exc}")
            return
        metrics = st.get("metrics") or {}
        self.info = {"reachable": True, "error": None, "last_contact_at": time.time(),
                     "fog_id": st.get("fog_id"), "fog_site": st.get("site"),
                     "devices_live": metrics.get("devices_live"), "devices_total": st.get("devices_total"),
                     "releases": {n: v for n, (v, _) in view.releases.items()},
                     "workloads": [{"name": w.name, "model": w.model[:17], "status": w.status,
                                    "healthy": w.healthy, "replicas": w.replicas} for w in view.workloads],
                     "summaries": {"accepted": self.summaries.accepted, "refused": dict(self.summaries.refused)}}
        self.events.put(Seen(self.site.name, view))

    def _do(self, cmd: Any) -> None:
        if isinstance(cmd, SendRelease):
            if self.client is None:
                log.info("site %s: %s v%d not sent (not connected); the rollout retries", self.site.name, cmd.name,
                         cmd.version)
                return
            if self.client.send(self.topics.release(), cmd.frame, timeout=self.request_timeout_s):
                log.info("site %s: sent %s v%d", self.site.name, cmd.name, cmd.version)
                self.poll_now.set()
            else:
                self._lost(f"the broker did not acknowledge {cmd.name} v{cmd.version}")
        elif isinstance(cmd, RunProbe):
            self.events.put(ProbeDone(cmd.name, cmd.version, tuple(self._probe(cmd))))
            self.poll_now.set()

    def _probe(self, cmd: RunProbe) -> list[ProbeSample]:
        p = cmd.policy
        try:
            batch = held_out_batch(cmd.blob, p.probe_requests, p.holdout, seed=cmd.version)
            want = reference_outputs(cmd.blob, batch)
        except ReleaseError as exc:
            return [ProbeSample(w, False, f"coordinator side: {exc}") for w in cmd.workloads]
        out = []
        deadline = time.monotonic() + p.probe_timeout_s
        for w in cmd.workloads:
            for req, ref in zip(batch, want):
                if self.client is None or time.monotonic() > deadline:
                    out.append(ProbeSample(w, False, "not sent: the site went away or the probe ran out of time"))
                    continue
                try:
                    res = self.client.infer_result(w, req, timeout=self.request_timeout_s)
                except (InferenceError, TimeoutError, FoglineError) as exc:
                    out.append(ProbeSample(w, False, str(exc).splitlines()[0][:200] if str(exc) else
                                           type(exc).__name__))
                    continue
                if not res.ok:
                    out.append(ProbeSample(w, False, res.error[:200] or res.failure or "failed"))
                    continue
                got = {k: v for k, v in res.tensors.items()}
                out.append(ProbeSample(w, True, "", compare_outputs(ref, got, p.rtol, p.atol), float(res.latency_s)))
        return out
