"""One site's connection for the coordinator: status, held-out requests, summaries and releases on one identity.

The broker binds a client id to its certificate, so everything the
coordinator does at a site goes over one MQTT connection: a ``FogClient``
(``fogline status``'s protocol: sealed requests, answers accepted only under
the fog key pinned in ``fog.json``) that also carries the summary
subscription and the release publishes. A thread per site owns it: it
(re)connects with backoff, polls ``status``, and runs the commands the
service hands it (publish, probe); it reports to the service's queue as
rollout events (``Seen``, ``Lost``, ``ProbeDone``). It never decides anything.

Site autonomy (docs/sites.md): a site that answered once and then stops
answering (a WAN cut, the coordinator's host asleep) is *cut off*, not
failed: ``cut_since`` says since when, which the service uses to stop the
rollout clock, and the link sends no status requests while its connection is
down (paho would queue them and deliver a burst of stale ones later). The
connection itself reconnects on its own; the fog's retained summary and the
QoS 1 releases queued in it arrive when the link returns. A held-out batch
cut short by the link reports ``ProbeCut`` instead of failed requests: the
service runs it again when the site is back.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fog_broker.client import FogClient, InferenceError, KeyMismatch
from runtime.errors import FoglineError, LocalViolation
from runtime.topics import Topics

from .canary import held_out_batch, reference_outputs
from .release import ReleaseError
from .rollout import Lost, ProbeDone, ProbeSample, RolloutPolicy, Seen, compare_outputs, site_view
from .sites import SiteEndpoint
from .summaries import MAX_SUMMARY_BYTES, SummaryInbox

__all__ = ["SiteClient", "SiteLink", "KeyMismatch", "SendRelease", "RunProbe", "ProbeCut"]

log = logging.getLogger("fogline.sites")


class SiteClient(FogClient):
    """``FogClient`` as the coordinator uses it: one site identity's connection, and whether it is up."""

    @property
    def connected(self) -> bool:
        """The MQTT connection is up (paho reconnects by itself when it is not)."""
        return self._mqtt.connected

    @property
    def link_error(self) -> str:
        """Why the connection is down, one line ('' if unknown)."""
        return self._mqtt.last_error or ""


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


@dataclass(frozen=True, slots=True)
class ProbeCut:
    """The held-out batch was cut short by the link (not answered is not a verdict): run it again later."""

    site: str
    name: str
    version: int


_STOP = object()


class SiteLink:
    """The thread that owns one site's ``SiteClient``."""

    def __init__(self, site: SiteEndpoint, summaries_dir: Path, events: queue.Queue[Any], *, insecure: bool = False,
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
        # monotonic time the site stopped answering after it had answered (a cut), else None (read by the service)
        self.cut_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"site-{site.name}", daemon=True)

    def start(self) -> SiteLink:
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

    def _lost(self, error: str, *, cut: bool = False) -> None:
        """Report the site unreachable; ``cut``: it answered before and the link (not the site's answer) failed."""
        error = " ".join(error.split())[:300]
        if cut and self.info.get("last_contact_at") is not None and self.cut_since is None:
            self.cut_since = time.monotonic()
        self.info = {**self.info, "reachable": False, "error": error}
        self.events.put(Lost(self.site.name, error))

    def _cut_line(self, what: str) -> str:
        """The one line `fogline sites status` shows for a site that stopped answering after it had answered."""
        at = self.info.get("last_contact_at")
        if at is None:
            return what
        since = time.strftime("%H:%M:%S UTC", time.gmtime(at))
        return f"cut off: {what}; last answer at {since}; the site runs on its own, its news waits for the link"

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
            # One failed command or poll is that command's failure: the link thread keeps the site watched
            # (a dead thread would leave a rollout waiting on a site nobody polls any more).
            if cmd is not None:
                try:
                    self._do(cmd)
                except Exception:
                    log.exception("site %s: %s failed", self.site.name, type(cmd).__name__)
                continue
            if self.client is not None and (time.monotonic() >= next_poll or self.poll_now.is_set()):
                self.poll_now.clear()
                try:
                    self._poll()
                except Exception as exc:
                    log.exception("site %s: status poll failed", self.site.name)
                    self._lost(f"status poll failed: {type(exc).__name__}: {exc}")
                next_poll = time.monotonic() + (self.fast_poll_s if self.fast else self.poll_s)

    def _poll(self) -> None:
        assert self.client is not None
        if not self.client.connected:  # paho reconnects by itself; a request now would only be queued and go stale
            why = self.client.link_error or "connection lost"
            self._lost(self._cut_line(f"no MQTT connection to {self.site.address} ({why})"), cut=True)
            return
        try:
            st = self.client.status(timeout=self.request_timeout_s, limit=None if self.fast else 0)
            view = site_view(st)
        except TimeoutError as exc:
            self._lost(self._cut_line(f"no status answer: {exc}"), cut=True)
            return
        except (FoglineError, ValueError, TypeError, KeyError) as exc:
            self._lost(f"status refused or unreadable: {exc}")
            return
        metrics = st.get("metrics") or {}
        self.cut_since = None
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
            # QoS 1: a copy the broker has not acknowledged stays queued in the connection and is sent again
            # when it reconnects (and the rollout republishes), so a cut delays a release, it does not lose it
            if self.client.send(self.topics.release(self.site.creds.name), cmd.frame, timeout=self.request_timeout_s):
                log.info("site %s: sent %s v%d", self.site.name, cmd.name, cmd.version)
                self.poll_now.set()
            else:
                log.info("site %s: %s v%d queued until the link returns", self.site.name, cmd.name, cmd.version)
                self._lost(self._cut_line(f"the broker did not acknowledge {cmd.name} v{cmd.version}"), cut=True)
        elif isinstance(cmd, RunProbe):
            samples = self._probe(cmd)
            if samples is None:
                self._lost(self._cut_line(f"the held-out batch of {cmd.name} v{cmd.version} went unanswered"),
                           cut=True)
                log.info("site %s: the held-out batch of %s v%d was cut short by the link; it runs again when "
                         "the site is back", self.site.name, cmd.name, cmd.version)
                self.events.put(ProbeCut(self.site.name, cmd.name, cmd.version))
            else:
                self.events.put(ProbeDone(cmd.name, cmd.version, tuple(samples)))
            self.poll_now.set()

    def _answers(self) -> bool:
        """Whether the site still answers a status request: an unanswered inference is a verdict only then."""
        if self.client is None or not self.client.connected:
            return False
        try:
            self.client.status(timeout=self.request_timeout_s, limit=0)
        except TimeoutError:
            return False
        except (FoglineError, ValueError, TypeError, KeyError):
            return True  # it answered (a refusal is the site's word, not the link's)
        return True

    def _probe(self, cmd: RunProbe) -> list[ProbeSample] | None:
        """The samples, or None when the link went down under the batch (no verdict on the release)."""
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
                if not self.client.connected:
                    return None
                try:
                    res = self.client.infer_result(w, req, timeout=self.request_timeout_s)
                except TimeoutError as exc:
                    if not self._answers():
                        return None
                    out.append(ProbeSample(w, False, str(exc).splitlines()[0][:200] or "TimeoutError"))
                    continue
                except (InferenceError, FoglineError) as exc:
                    out.append(ProbeSample(w, False, str(exc).splitlines()[0][:200] if str(exc) else
                                           type(exc).__name__))
                    continue
                if not res.ok:
                    out.append(ProbeSample(w, False, res.error[:200] or res.failure or "failed"))
                    continue
                got = dict(res.tensors)
                out.append(ProbeSample(w, True, "", compare_outputs(ref, got, p.rtol, p.atol), float(res.latency_s)))
        return out
