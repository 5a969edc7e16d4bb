"""The fog broker process shell: MQTT, SQLite, artifacts and the clock around the pure cores.

Jobs live in their own modules; this one wires them and owns the loop:

* ``ingest``: device adverts -> verified messages (verify shards, worker processes);
* ``control``: operator requests on ``fog/CTL`` (pinned identities, role rights);
* ``releases``: coordinator model releases (pinned signers, bound names);
* ``status``: the ``fogline status`` document;
* ``service_config``: the settings and the owner's inbox items;
* ``service_inputs``: the owner's inbox and lanes, and the MQTT worker's checks before them;
* ``service_data``: inference requests, results, releases and the router's commands;
* ``service_deploy``: the controller's commands and the artifact thread;
* ``service_trust``: ``trust`` (pure) decides, ``site`` / ``trust_db`` store: enrolled devices and
  identities are re-read whenever ``trust.db`` changes (an approval or a
  revocation from ``fogline devices`` takes effect within ``trust_poll_s``).

Threads and who owns what: paho's network thread only enqueues; the MQTT
worker routes device messages to ingest and decodes the rest; the artifact
thread splits, hashes and signs partitions; the owner thread holds the site
core (registry, controller, router) and the store, pumps the inbox (typed
items, each a core event or a job for the shell), runs the core and carries
out its commands, and the timers (liveness, reconcile, summary, time). The
collaborators above change their state only on the owner thread, as this
class does. The front ends get this object as a ``FogPort`` (``port.py``): they
read the site's frozen ``SiteSnapshot``, which the owner builds when one is
asked for, so status, metrics and the HTTP API never wait in the inbox; control
requests (``status`` included) have their own lane ahead of it (``control_lane``).

Inputs name their sender in the topic (``fog/CTL/{id}``, ``fog/INFER/{id}``,
``reply/{fog}/{device}``, ``dev/{id}/...``) and the broker's ACL lets only that
identity write there; on the MQTT worker each input is charged to that id's
budget before any decode or signature check (``control``, ``ingest``), a
payload signed by anyone else is dropped and charged to the topic's id, and
a sender that keeps flooding is quarantined (its writes leave the ACL). The
owner thread takes the devices' verified liveness traffic (adverts, acks) from
its own lane ahead of control, inference and results, so a flood of those
cannot get an honest device declared lost.

Everything the fog says is sealed with its key: its retained STATE (and the
offline Will, sealed at start for this epoch), commands, summaries, time
hints, results relayed to clients and the first hop of every activation.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from runtime import codec
from runtime.errors import LocalViolation, RemoteViolation
from runtime.messages import FleetSummary, FogState, InferenceResult, Rebirth, TimeHint
from runtime.mqtt import Inbound, MqttClient, Will
from runtime.security import SessionKeyPair, Signer, TrustStore, Verifier, sign_session_offer
from runtime.topics import ACK, BIRTH, DEATH, STATE, Topics

from .artifacts import ArtifactBuilder
from .control import ControlPlane
from .ingest import DEVICE_SHARE, Heard, HeardBatch, Ingest
from .placement.model import Quota
from .router import ReplyClient, SendActivation
from .service_config import (
    MAX_ADVERT_BYTES,
    MAX_CONTROL_BYTES,
    STOP,
    WAKE,
    Call,
    LocalInfer,
    Other,
    RebirthAll,
    ServiceConfig,
    SyncTrust,
    default_schedule,
)
from .service_data import PING, DataPlane
from .service_deploy import Deployer
from .service_inputs import InputGate
from .service_trust import TrustSync
from .site import Site
from .site_core import (
    Advert,
    AdvertRejected,
    AskRebirth,
    BuildFailed,
    Built,
    ClaimFlags,
    FollowRelease,
    LogNote,
    OwnerPaused,
    ReleaseAccepted,
    Restore,
    SiteCore,
    SiteCoreConfig,
    SiteEvent,
    SiteSnapshot,
    WiresMeasured,
)
from .status import site_status
from .store import ReleaseBook, Store

__all__ = ["ServiceConfig", "FogService", "default_schedule", "MAX_CONTROL_BYTES"]

log = logging.getLogger("fog_broker.service")

#: a gap between two ticks this much longer than ``tick_s`` is a stall of the owner, credited to
#: the devices' liveness deadlines (site_core.OwnerPaused)
_PAUSE_CREDIT_S = 1.0


class SnapshotBoard:
    """The newest snapshot of the site for other threads; the owner builds one when it is asked."""

    def __init__(self, core: SiteCore, wake: Callable[[], None]) -> None:
        self._core, self._wake = core, wake
        self._snap: SiteSnapshot | None = None
        self._seen = -math.inf  # when the owner last published it (monotonic): current as of then
        self._seq = 0           # publications so far: a waiter waits for the next one
        self._cond = threading.Condition()
        self.wanted = False     # a thread waits for one: the owner publishes between two inbox items

    def get(self, owner: threading.Thread, max_age_s: float | None, timeout: float) -> SiteSnapshot:
        """``FogService.snapshot``."""
        if threading.current_thread() is owner or not owner.is_alive():
            return self.publish()
        asked = time.monotonic()
        with self._cond:
            snap = self._snap
            if snap is not None and max_age_s is not None and asked - self._seen <= max_age_s:
                return snap
            self.wanted = True
            seq = self._seq
        self._wake()  # the owner is busy if the inbox is full: it looks for the request between items
        with self._cond:
            if not self._cond.wait_for(lambda: self._seq > seq, timeout):
                raise TimeoutError("the fog broker's owner thread did not answer")
            assert self._snap is not None
            return self._snap

    def publish(self) -> SiteSnapshot:
        """Owner thread: the core's snapshot now, handed to the threads waiting for one."""
        now = time.monotonic()
        snap = self._core.snapshot(now)
        with self._cond:
            self.wanted = False
            self._snap, self._seen = snap, now
            self._seq += 1
            self._cond.notify_all()
        return snap


class FogService:
    """One fog broker: ``start()``, then ``stop()``; ``call(fn)`` runs ``fn`` on the owner thread."""

    def __init__(self, config: ServiceConfig, *, site: Site | None = None, schedule: Callable[..., Any] | None = None,
                 on_acl: Callable[[str], bool | None] | None = None,
                 on_crl: Callable[[bytes], bool | None] | None = None) -> None:
        self.config = c = config
        c.data_dir.mkdir(parents=True, exist_ok=True)
        self.site = site or Site(c.data_dir, site=c.site, fog_id=c.fog_id)
        self.topics = Topics(c.site)
        self.identity = self.site.identity
        self.store = Store(c.data_dir / "fog.db")
        self.epoch = self.store.next_epoch()
        self.signer = Signer(self.identity, self.epoch)
        self._sign_lock = threading.Lock()  # one (epoch, seq) sequence shared by the owner and the builder
        # This run's X25519 key (never stored), offered in the signed FogState: devices derive
        # per-connection HMAC keys with it for their state adverts (docs/protocol.md, Trust).
        self.session = SessionKeyPair()
        session_sig = sign_session_offer(self.identity, c.site, self.epoch, self.session.public_bytes)
        # Recent faults and recoveries, wall-clock stamped, for the status document and the site page.
        self.events: deque[dict[str, Any]] = deque(maxlen=200)
        self._was_ready = False
        self.inputs = InputGate(self)  # the inbox, the lanes ahead of it, the MQTT worker's checks
        self.inbox = self.inputs.inbox
        # Trust: enrolled devices (ingest, results), operators (control), coordinators (releases).
        self.device_keys = TrustStore()
        self.ingest = Ingest(self.device_keys, self.session, self.inputs.put_live, shards=c.verify_workers,
                             processes=c.verify_processes, max_advert_bytes=MAX_ADVERT_BYTES,
                             share=DEVICE_SHARE if c.fair_share else None)
        self.results = Verifier(self.device_keys, max_size=codec.DEFAULT_MAX_SIZE)
        self.control = ControlPlane(self)
        if not c.fair_share:
            self.control.share = None
        self.releases = ReleaseBook(c.data_dir / "releases.json")  # persisted; the core keeps the state
        self.trust = TrustSync(self, on_acl, on_crl)
        # The site's decisions (registry, controller, router, calibration and the rules between
        # them) are one pure object; this class feeds it events and carries out its commands.
        self.core = SiteCore(schedule or default_schedule(), SiteCoreConfig(
            state_interval_s=c.state_interval_s, battery_floor=c.battery_floor,
            reconcile_interval_s=c.reconcile_interval_s, max_rebirths_per_s=c.max_rebirths_per_s,
            reply_topic=self.topics.reply(c.fog_id), controller=c.controller, router=c.router),
            command_prefix=f"{c.fog_id}.{self.epoch}")
        self.registry, self.controller, self.router = self.core.registry, self.core.controller, self.core.router
        self.calibration = self.core.calibration
        self.counters = self.core.counters  # one set of counters for the site, shell and core alike
        self.flags = self.core.flags       # device -> implausible claims in its birth
        self.artifacts = ArtifactBuilder(self.identity, c.data_dir / "models")
        self._snapshots = SnapshotBoard(self.core, self.inputs.wake)
        self.data = DataPlane(self)
        self.deployer = Deployer(self)  # owns the artifact thread
        self._state_payload, self._will_payload = (self.signer.seal_bytes(FogState(
            c.fog_id, c.site, online, self.epoch, self.identity.public_key_bytes, time.time(),
            self.session.public_bytes, session_sig), time.time()) for online in (True, False))
        self.mqtt = MqttClient(c.fog_id, c.mqtt_host, c.mqtt_port, keepalive=c.keepalive, tls=c.tls,
                               will=Will(self.topics.fog_state(), self._will_payload, qos=1, retain=True),
                               inbox_size=100_000, max_queued=100_000, max_payload=MAX_CONTROL_BYTES)
        self._owner = threading.Thread(target=self._run, name="fog-owner", daemon=True)
        self._stopped = threading.Event()
        self.started_mono = time.monotonic()
        self._last_summary = -math.inf
        self._last_time_hint = -math.inf
        self.trust.sync(time.monotonic())
        self._load_desired()

    # ------------------------------------------------------------ lifecycle

    def _load_desired(self) -> None:
        """A restart: the stored workloads, quotas, assignments and releases, as one event for the core."""
        from .controller import Assignment
        from .placement.model import Workload
        workloads = []
        for sw in self.store.workloads():
            extra = sorted(k for k in sw.spec if k not in Workload.FIELDS)
            if extra:  # stored before unknown fields were refused: keep serving it, say what is ignored
                log.warning("stored workload %s: ignoring unknown field(s) %s", sw.name, ", ".join(extra))
            try:
                spec = self.control.workload_from({k: v for k, v in sw.spec.items() if k in Workload.FIELDS},
                                                  sw.profile)
            except RemoteViolation as exc:
                log.error("stored workload %s is invalid, skipped: %s", sw.name, exc)
                continue
            workloads.append((spec, sw.version, str(sw.spec.get("model") or "")))
        stored = tuple(Assignment((a.workload, a.version, a.replica, a.index), a.device, a.first, a.last,
                                  sha256=a.sha256) for a in self.store.assignments())
        wait = self.config.startup_wait_s
        releases = tuple(ReleaseAccepted(n, int(r["version"]), str(r["model"]), str(r["signer"]),
                                         dict(r.get("metadata") or {}))
                         for n, r in self.releases.releases.items())
        self.apply(Restore(tuple(workloads), {t: Quota(m) for t, m in self.store.quotas().items()}, stored,
                           wait if wait is not None else self.config.state_interval_s, releases))
        if workloads:
            log.info("restart: %d workloads, %d stored assignments; waiting for devices",
                     len(self.controller.workloads), len(stored))

    def start(self, connect_timeout: float = 10.0) -> FogService:
        t, on_other = self.topics, self.inputs.on_other
        for leaf in (BIRTH, STATE, DEATH, ACK):
            # States are periodic and superseded by the next one (liveness allows 3 misses):
            # QoS 0 delivery saves a PUBACK round per advert. Births, deaths and acks stay QoS 1.
            self.mqtt.subscribe(t.all_devices(leaf), self.ingest.on_device, qos=0 if leaf == STATE else 1,
                                max_bytes=MAX_ADVERT_BYTES)
        self.mqtt.subscribe(t.fog_state(), self._on_fog_state, max_bytes=MAX_ADVERT_BYTES)
        self.mqtt.subscribe(t.infer("+"), on_other)
        self.mqtt.subscribe(t.control("+"), on_other, max_bytes=MAX_CONTROL_BYTES)
        self.mqtt.subscribe(t.release("+"), on_other, max_bytes=MAX_CONTROL_BYTES)
        self.mqtt.subscribe(t.result(self.config.fog_id, "+"), on_other)
        self.mqtt.on_connected.append(self._on_connected)
        self.ingest.start()
        self._owner.start()
        self.deployer.start()
        self.mqtt.start()
        if not self.mqtt.wait_connected(connect_timeout):
            why = self.mqtt.last_error or "no answer"
            self.stop()
            raise LocalViolation(f"cannot connect to MQTT at {self.config.mqtt_host}:{self.config.mqtt_port}: {why}")
        # Subscriptions are made in order on connect; once a ping to our reply topic (the last one)
        # comes back, every subscription is active and no request sent from now on is lost.
        deadline = time.monotonic() + connect_timeout
        while not self.data.subscribed.is_set() and time.monotonic() < deadline:
            self.publish_signed(self.topics.result(self.config.fog_id, self.config.fog_id),
                                InferenceResult(PING, False))
            self.data.subscribed.wait(0.2)
        return self

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            if self.mqtt.connected:
                self.mqtt.publish(self.topics.fog_state(), self._will_payload, retain=True).wait(2.0)
        finally:
            self.mqtt.stop()
            self.deployer.stop()
            self.ingest.stop()
            self.inbox.put(STOP)
            if threading.current_thread() is not self._owner and self._owner.is_alive():
                self._owner.join(timeout=5)
            self.store.close()
            self.site.close()

    def _on_connected(self) -> None:  # MQTT worker thread
        self.mqtt.publish(self.topics.fog_state(), self._state_payload, retain=True)
        self.inputs.put(RebirthAll("fog broker (re)connected"))

    def _on_fog_state(self, m: Inbound) -> None:  # MQTT worker thread
        """Our retained STATE is ours alone: anything else that appears there is replaced at once."""
        if self._stopped.is_set() or m.payload in (self._state_payload, self._will_payload):
            return
        self.counters["fog_state_reasserted"] += 1
        log.warning("something else was published on %s; re-asserting this fog's sealed state", m.topic)
        self.mqtt.publish(self.topics.fog_state(), self._state_payload, retain=True)

    # ------------------------------------------------------------ trust (service_trust)

    def sync_trust(self) -> None:
        """Re-read trust.db now if it changed (owner thread)."""
        self.trust.sync(time.monotonic())

    def trust_changed(self) -> None:
        """Another thread of this process changed trust.db (an enrolment): sync soon (any thread)."""
        self.inputs.put(SyncTrust())

    def push_acl(self) -> bool:
        """Hand the broker the site's ACL as trust.db has it now (any thread); False if it refused."""
        return self.trust.push_acl()

    def refused(self, kind: str, sender: str) -> None:
        """Owner thread: an input on ``sender``'s topic failed its check; charge it (MQTT worker)."""
        self.inputs.refused(kind, sender)

    # ------------------------------------------------------------ owner thread

    def _run(self) -> None:
        next_tick = last_tick = time.monotonic()
        inputs, snapshots = self.inputs, self._snapshots
        while True:
            timeout = max(0.0, next_tick - time.monotonic())
            try:
                item = self.inbox.get(timeout=timeout)
            except queue.Empty:
                item = None
            batch = 0
            while item is not None:
                if item is STOP:
                    return
                live, ctl = inputs.live, inputs.control_lane
                while not live.empty():  # the one taker: not empty -> get_nowait succeeds
                    self._dispatch_safely(live.get_nowait())
                    batch += 1
                while not ctl.empty():
                    self._dispatch_safely(ctl.get_nowait())
                    batch += 1
                if snapshots.wanted:
                    snapshots.publish()
                if item is WAKE:
                    item = inputs.next_item()
                    continue
                self._dispatch_safely(item)
                batch += 1
                if batch >= 500:
                    break
                item = inputs.next_item()
            now = time.monotonic()
            if now >= next_tick or self.core.dirty:
                if now - last_tick > self.config.tick_s + _PAUSE_CREDIT_S:
                    # this loop (or the whole process) stalled: the devices' silence was ours
                    self.counters["owner_paused"] += 1
                    self.apply(OwnerPaused(now - last_tick - self.config.tick_s), now)
                last_tick = now
                try:
                    self._tick(now)
                except Exception:
                    self.counters["internal_errors"] += 1
                    log.exception("tick failed")
                next_tick = now + self.config.tick_s
            if snapshots.wanted:
                snapshots.publish()

    def _dispatch_safely(self, item: Any) -> None:
        try:
            self._dispatch(item)
        except RemoteViolation as exc:
            self.counters["remote_errors"] += 1
            log.warning("dropped input: %s", exc)
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("owner loop failed on %s", type(item).__name__)

    def _dispatch(self, item: Any) -> None:
        match item:
            case HeardBatch(items):
                for heard in items:
                    self._heard(heard)
            case Heard():
                self._heard(item)
            case Built() | BuildFailed() | WiresMeasured():  # from the artifact thread
                self.apply(item)
            case Other(kind, msg, at, sender):
                self.data.handle(kind, msg, at, sender)
            case LocalInfer(request, at):
                self.data.submit(request, at)
            case Call(fn, fut):
                try:
                    fut.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - returned to the calling thread
                    fut.set_exception(exc)
            case SyncTrust():
                self.trust.sync(time.monotonic())
            case RebirthAll(reason):
                self.publish_signed(self.topics.rebirth(), Rebirth("", reason))
            case _:
                raise TypeError(f"unknown inbox item {type(item).__name__}")

    def _heard(self, heard: Heard) -> None:
        """A verified device input: to the core, unless its device was revoked while it was verified."""
        match heard.event:
            case Advert(msg) if msg.device_id not in self.device_keys:
                return
            case ClaimFlags(device_id) | AdvertRejected(device_id) if device_id not in self.device_keys:
                return
        self.apply(heard.event, heard.at)

    def _carry_out(self, cmds: list[Any]) -> None:
        """Do what the site core decided: publish, deploy, persist, answer clients, log."""
        work: list[Any] = []
        for cmd in cmds:
            if isinstance(cmd, AskRebirth):
                self.publish_signed(self.topics.device(cmd.device_id, "CMD"), Rebirth(cmd.device_id, cmd.reason))
            elif isinstance(cmd, SiteEvent):
                if cmd.kind in ("device lost", "advert rejected"):
                    log.warning("device %s %s (%s)", cmd.device, cmd.kind.split()[-1], cmd.reason)
                self.note_event(cmd.kind, cmd.device, cmd.reason)
            elif isinstance(cmd, LogNote):
                log.log(logging.INFO if cmd.level == "info" else logging.WARNING, "%s", cmd.text)
            elif isinstance(cmd, (SendActivation, ReplyClient)):
                self.data.router_cmds([cmd])
            elif isinstance(cmd, FollowRelease):
                self.data.follow_release(cmd)
            else:
                work.append(cmd)
        if work:
            self.deployer.execute(work)
        if self.controller.ready and not self._was_ready:
            self._was_ready = True
            phases = Counter(a.phase.value for a in self.controller.assignments.values())
            log.info("ready after %.2f s: heard %d devices; assignments %s", time.monotonic() - self.started_mono,
                     len(self.registry.reported()), dict(phases))

    def note_event(self, kind: str, device: str, reason: str) -> None:
        """A fault or recovery for the status document and the site page (owner thread)."""
        self.events.append({"at": round(time.time(), 3), "kind": kind, "device": device, "reason": reason})

    def _tick(self, now: float) -> None:
        self.trust.tick(now)
        self._carry_out(self.core.tick(now, time.time()))
        if now - self._last_summary >= self.config.summary_interval_s:
            self._last_summary = now
            summary = FleetSummary(self.config.fog_id, self.config.site, time.time(), self.registry.summaries())
            self.publish_signed(self.topics.summary(), summary, retain=True)
        if now - self._last_time_hint >= self.config.time_hint_s:
            self._last_time_hint = now
            self.publish_signed(self.topics.time(), TimeHint(self.config.fog_id, time.time()))

    # ------------------------------------------------------------ the port (port.py)

    def publish_signed(self, topic: str, msg: Any, *, retain: bool = False) -> None:
        with self._sign_lock:
            self.mqtt.publish(topic, self.signer.seal_bytes(msg, time.time()), retain=retain)

    def mark_dirty(self) -> None:
        self.core.mark_dirty()

    def apply(self, event: Any, now: float | None = None) -> None:
        """Hand one event to the site core and carry out what it decides (owner thread)."""
        self._carry_out(self.core.handle(event, time.monotonic() if now is None else now, time.time()))

    def collect_blobs(self) -> None:
        """Delete uploaded/released model files no workload or release refers to any more."""
        self.deployer.collect_blobs()

    def status(self, now: float | None = None, *, snapshot: SiteSnapshot | None = None,
               max_age_s: float | None = None, **page: Any) -> dict[str, Any]:
        """Everything ``fogline status`` shows (any thread): of ``snapshot``, else of ``self.snapshot(max_age_s)``."""
        snap = snapshot if snapshot is not None else self.snapshot(max_age_s)
        return site_status(self, time.monotonic() if now is None else now, snap, **page)

    def snapshot(self, max_age_s: float | None = None, timeout: float = 5.0) -> SiteSnapshot:
        """The site as a frozen value. On the owner thread (or before it runs): built now if anything
        changed. Elsewhere: the newest one if it is at most ``max_age_s`` old, else the owner builds
        one between two inbox items and this waits for it (``TimeoutError`` after ``timeout``)."""
        return self._snapshots.get(self._owner, max_age_s, timeout)

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the owner thread and return its result (any thread)."""
        fut: Future[Any] = Future()
        self.inbox.put(Call(fn, fut))
        try:
            return fut.result(timeout)
        except FutureTimeout:
            raise TimeoutError("the fog broker's owner thread did not answer") from None

    def infer(self, workload: str, tensors: Mapping[str, Any], timeout: float = 5.0,
              stream: str = "") -> Future[InferenceResult]:
        """Route one request from a front end in this process (the HTTP API); any thread.

        The same router, failover and result checks as a request over MQTT; the future gets the
        ``InferenceResult`` (ok or with the fog's reason). Refused at once when the inbox is full.
        ``timeout`` <= 0: the workload's ``slo_s``; ``stream``: answers of one stream in order.
        """
        return self.data.infer(workload, tensors, timeout, stream)

    def verified(self) -> int:
        return self.ingest.verified()

    def rejections(self) -> Mapping[str, int]:
        return self.ingest.rejections()
