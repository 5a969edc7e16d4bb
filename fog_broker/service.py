"""The fog broker process shell: MQTT, SQLite, artifacts and the clock around the pure cores.

Jobs live in their own modules; this one wires them and owns the loop:

* ``ingest``: device adverts -> verified messages (verify shards, worker processes);
* ``control``: operator requests on ``fog/CTL`` (pinned identities, role rights);
* ``releases``: coordinator model releases (pinned signers, bound names);
* ``status``: the ``fogline status`` document;
* ``trust`` (pure) decides, ``site`` / ``trust_db`` store: enrolled devices and
  identities are re-read whenever ``trust.db`` changes (an approval or a
  revocation from ``fogline devices`` takes effect within ``trust_poll_s``).

Threads and who owns what: paho's network thread only enqueues; the MQTT
worker routes device messages to ingest and decodes the rest; the artifact
thread splits, hashes and signs partitions; the owner thread holds the site
core (registry, controller, router) and the store, pumps the inbox (typed
items, each a core event or a job for the shell), runs the core and carries
out its commands, and the timers (liveness, reconcile, summary, time). The
front ends get this object as a ``FogPort`` (``port.py``): they read the
site's frozen ``SiteSnapshot``, which the owner builds when one is asked for,
so status, metrics and the HTTP API never wait in the inbox; control requests
(``status`` included) have their own lane ahead of it (``control_lane``).

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
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime import codec, relay
from runtime.errors import DecodeError, LocalViolation, RemoteViolation, SecurityError
from runtime.messages import (
    Activation,
    Deploy,
    Envelope,
    FleetSummary,
    FogState,
    InferenceRequest,
    InferenceResult,
    ModelRelease,
    Rebirth,
    RouteTicket,
    TimeHint,
    Undeploy,
)
from runtime.mqtt import Inbound, MqttClient, TlsConfig, Will
from runtime.security import SessionKeyPair, Signer, TrustStore, Verifier, sign_session_offer
from runtime.topics import ACK, BIRTH, CTL, DEATH, INFER, STATE, Topics

from . import wires
from .artifacts import ArtifactBuilder
from .control import MAX_REQUEST_BYTES, RELEASE, RELEASE_TOPIC, ControlPlane, misaddressed
from .controller import ControllerConfig, DeployPartition, Persist, UndeployPartition
from .ingest import DEVICE_SHARE, RESULT, Heard, HeardBatch, Ingest
from .placement.model import Quota
from .ratelimit import Copies, acl_shut_out
from .router import ReplyClient, RouterConfig, SendActivation
from .site import Site
from .site_core import (
    Advert,
    AdvertRejected,
    AskRebirth,
    BuildFailed,
    Built,
    ClaimFlags,
    DeviceRemoved,
    FollowRelease,
    Infer,
    LogNote,
    OwnerPaused,
    ReleaseAccepted,
    Restore,
    Result,
    RouteUntrusted,
    SiteCore,
    SiteCoreConfig,
    SiteEvent,
    SiteSnapshot,
    WiresMeasured,
)
from .status import site_status
from .store import ReleaseBook, Store, StoredAssignment

__all__ = ["ServiceConfig", "FogService", "default_schedule", "MAX_CONTROL_BYTES"]

log = logging.getLogger("fog_broker.service")

_STOP = object()
_RELEASE = RELEASE
_PING = "__fog_self_ping__"
#: a gap between two ticks this much longer than ``tick_s`` is a stall of the owner, credited to
#: the devices' liveness deadlines (site_core.OwnerPaused)
_PAUSE_CREDIT_S = 1.0
_LOCAL = "local:"  # reply_to of requests from this process (never an MQTT topic: no '/')
MAX_CONTROL_BYTES = MAX_REQUEST_BYTES
MAX_ADVERT_BYTES = 64 * 1024


# ------------------------------------------------------------------ the owner's inbox (typed items)
# Core events (Built, BuildFailed, WiresMeasured from the artifact thread; ingest's Heard batches)
# go to the site core as they are; these are the shell's own jobs.

@dataclass(frozen=True, slots=True)
class _Wake:
    """A live or control item is waiting in its lane (the owner blocks on the inbox)."""


@dataclass(frozen=True, slots=True)
class _Other:
    """A decoded control request, inference request, hop result or release, to authenticate."""
    kind: str
    msg: Any
    at: float


@dataclass(frozen=True, slots=True)
class _LocalInfer:
    """A request from a front end of this process (the HTTP API)."""
    request: InferenceRequest
    at: float


@dataclass(frozen=True, slots=True)
class _Call:
    fn: Callable[[], Any]
    future: Future[Any]


@dataclass(frozen=True, slots=True)
class _SyncTrust:
    """trust.db changed in another thread of this process: re-read it."""


@dataclass(frozen=True, slots=True)
class _RebirthAll:
    """The fog (re)connected: every device is asked for a fresh birth."""
    reason: str


_WAKE = _Wake()


def default_schedule() -> Callable[..., Any]:
    """The placement scheduler (``fog_broker.placement.schedule``)."""
    from . import placement
    fn: Callable[..., Any] | None = getattr(placement, "schedule", None)
    if fn is None:
        from .placement.scheduler import schedule
        fn = schedule
    return fn


@dataclass
class ServiceConfig:
    data_dir: Path
    site: str = "default"
    fog_id: str = ""
    mqtt_host: str = "127.0.0.1"
    mqtt_port: int = 1883
    tls: TlsConfig | None = None       # the fog's TLS client identity; None: plain MQTT (--insecure)
    state_interval_s: float = 10.0     # the default until a birth says otherwise
    tick_s: float = 0.05
    reconcile_interval_s: float = 0.5
    summary_interval_s: float = 3.0
    time_hint_s: float = 5.0
    trust_poll_s: float = 0.5
    startup_wait_s: float | None = None  # None: one state interval
    battery_floor: float = 0.3
    keepalive: int = 5
    verify_workers: int = 2
    verify_processes: bool = False     # verify in worker processes (one per shard) instead of threads
    max_rebirths_per_s: float = 200.0  # all devices together: a flood cannot make the fog a flood
    fair_share: bool = True            # per-sender budgets at ingest and on fog/CTL (off: benchmarks)
    # fog/CTL requests (status, deploy) are taken ahead of the inbox (budgeted per sender upstream);
    # off: they wait behind inference requests and results, as before issue 31 (benchmarks)
    control_lane: bool = True
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)  # spread=False, admit=False: the old router

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if not self.fog_id:
            self.fog_id = f"fog-{self.site}"


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
        self._session_sig = sign_session_offer(self.identity, c.site, self.epoch, self.session.public_bytes)
        # Recent faults and recoveries, wall-clock stamped, for the status document and the site page.
        self.events: deque[dict[str, Any]] = deque(maxlen=200)
        self._was_ready = False
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=200_000)
        # The devices' verified liveness traffic (adverts, births, deaths, acks): taken ahead of the
        # inbox, so a queue of control, inference or results never delays a device's states.
        self._live: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Control requests (status, deploy): taken ahead of the inbox too, after the devices' traffic.
        self._control_lane: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # The newest snapshot of the site for other threads (``snapshot``), and whether one is wanted.
        self._snap: SiteSnapshot | None = None
        self._snap_seen = -math.inf  # when the owner last published it (monotonic): current as of then
        self._snap_seq = 0           # publications so far: a waiter waits for the next one
        self._snap_cond = threading.Condition()
        self._snap_wanted = False
        # Inputs the owner thread refused after their check (bad signature, replayed, no right):
        # charged to their topic's sender by the MQTT worker, which owns the budgets.
        self._charges: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        # MQTT worker: a second copy of a signed input is dropped unchecked (the last 128 per known sender)
        self._copies = Copies(per_sender=128, max_senders=4096)
        self._local: dict[str, Future[InferenceResult]] = {}  # in-process requests awaiting the router
        # Trust: enrolled devices (ingest, results), operators (control), coordinators (releases).
        self.device_keys = TrustStore()
        self.ingest = Ingest(self.device_keys, self.session, self._put_live, shards=c.verify_workers,
                             processes=c.verify_processes, max_advert_bytes=MAX_ADVERT_BYTES,
                             share=DEVICE_SHARE if c.fair_share else None)
        self.results = Verifier(self.device_keys, max_size=codec.DEFAULT_MAX_SIZE)
        self.control = ControlPlane(self)
        if not c.fair_share:
            self.control.share = None
        self.releases = ReleaseBook(c.data_dir / "releases.json")  # persisted; the core keeps the state
        self.coordinators: dict[str, bytes] = {}
        self._on_acl, self._on_crl = on_acl, on_crl
        self._trust_version = -1
        self._acl = ""  # the text the broker has (push_acl, under _acl_lock)
        self._acl_lock = threading.Lock()
        self._shut: frozenset[str] = frozenset()  # senders quarantined for flooding: no writes in the ACL
        self._crl = b""
        self._last_trust_poll = -math.inf
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
        self._state_payload = self.signer.seal_bytes(self._fog_state(True), time.time())
        self._will_payload = self.signer.seal_bytes(self._fog_state(False), time.time())
        self.mqtt = MqttClient(c.fog_id, c.mqtt_host, c.mqtt_port, keepalive=c.keepalive, tls=c.tls,
                               will=Will(self.topics.fog_state(), self._will_payload, qos=1, retain=True),
                               inbox_size=100_000, max_queued=100_000, max_payload=MAX_CONTROL_BYTES)
        self._prefix_ctl = self.topics.control("+")[:-2]
        self._prefix_infer = self.topics.infer("+")[:-2]
        self._prefix_result = self.topics.result(c.fog_id, "+")[:-2]
        self._owner = threading.Thread(target=self._run, name="fog-owner", daemon=True)
        # Artifact building (ONNX split, hash, sign) runs here, never on the owner thread.
        self._builds: queue.Queue[Any] = queue.Queue()
        self._builder = threading.Thread(target=self._build_loop, name="fog-artifacts", daemon=True)
        self._subscribed = threading.Event()
        self._stopped = threading.Event()
        self.started_mono = time.monotonic()
        self._last_summary = -math.inf
        self._last_time_hint = -math.inf
        self._sync_trust(time.monotonic())
        self._load_desired()

    # ------------------------------------------------------------ lifecycle

    def _fog_state(self, online: bool) -> FogState:
        return FogState(self.config.fog_id, self.config.site, online, self.epoch,
                        self.identity.public_key_bytes, time.time(), self.session.public_bytes, self._session_sig)

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
        t = self.topics
        for leaf in (BIRTH, STATE, DEATH, ACK):
            # States are periodic and superseded by the next one (liveness allows 3 misses):
            # QoS 0 delivery saves a PUBACK round per advert. Births, deaths and acks stay QoS 1.
            self.mqtt.subscribe(t.all_devices(leaf), self.ingest.on_device, qos=0 if leaf == STATE else 1,
                                max_bytes=MAX_ADVERT_BYTES)
        self.mqtt.subscribe(t.fog_state(), self._on_fog_state, max_bytes=MAX_ADVERT_BYTES)
        self.mqtt.subscribe(t.infer("+"), self._on_other)
        self.mqtt.subscribe(t.control("+"), self._on_other, max_bytes=MAX_CONTROL_BYTES)
        self.mqtt.subscribe(t.release(), self._on_other, max_bytes=MAX_CONTROL_BYTES)
        self.mqtt.subscribe(t.result(self.config.fog_id, "+"), self._on_other)
        self.mqtt.on_connected.append(self._on_connected)
        self.ingest.start()
        self._owner.start()
        self._builder.start()
        self.mqtt.start()
        if not self.mqtt.wait_connected(connect_timeout):
            why = self.mqtt.last_error or "no answer"
            self.stop()
            raise LocalViolation(f"cannot connect to MQTT at {self.config.mqtt_host}:{self.config.mqtt_port}: {why}")
        # Subscriptions are made in order on connect; once a ping to our reply topic (the last one)
        # comes back, every subscription is active and no request sent from now on is lost.
        deadline = time.monotonic() + connect_timeout
        while not self._subscribed.is_set() and time.monotonic() < deadline:
            self.publish_signed(self.topics.result(self.config.fog_id, self.config.fog_id),
                                InferenceResult(_PING, False))
            self._subscribed.wait(0.2)
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
            self._builds.put(_STOP)
            self.ingest.stop()
            self.inbox.put(_STOP)
            if threading.current_thread() is not self._owner and self._owner.is_alive():
                self._owner.join(timeout=5)
            self.store.close()
            self.site.close()

    def _on_connected(self) -> None:  # MQTT worker thread
        self.mqtt.publish(self.topics.fog_state(), self._state_payload, retain=True)
        self._put(_RebirthAll("fog broker (re)connected"))

    def _on_fog_state(self, m: Inbound) -> None:  # MQTT worker thread
        """Our retained STATE is ours alone: anything else that appears there is replaced at once."""
        if self._stopped.is_set() or m.payload in (self._state_payload, self._will_payload):
            return
        self.counters["fog_state_reasserted"] += 1
        log.warning("something else was published on %s; re-asserting this fog's sealed state", m.topic)
        self.mqtt.publish(self.topics.fog_state(), self._state_payload, retain=True)

    # ------------------------------------------------------------ trust (owner thread)

    def sync_trust(self) -> None:
        """Re-read trust.db now if it changed (owner thread)."""
        self._sync_trust(time.monotonic())

    def trust_changed(self) -> None:
        """Another thread of this process changed trust.db (an enrolment): sync soon (any thread)."""
        self._put(_SyncTrust())

    def _sync_trust(self, now: float) -> None:
        """Re-read trust.db when it changed: devices, operators, coordinators, ACL and CRL."""
        self._last_trust_poll = now
        version = self.site.db.version()
        if version == self._trust_version:
            return
        self._trust_version = version
        devices = self.site.db.devices()
        approved = {d.device_id: d.signing_key for d in devices if d.state == "approved"}
        for name in self.device_keys.names():
            if approved.get(name) != self.device_keys.key_bytes(name):
                self.device_keys.remove(name)
                self.ingest.forget(name)
                self.results.forget(name)
                log.warning("device %s is no longer trusted (revoked or re-keyed): cut off", name)
                self.counters["devices_revoked"] += 1
                self.apply(DeviceRemoved(name, "revoked"), now)
        for name, key in approved.items():
            if self.device_keys.key_bytes(name) is None:
                self.device_keys.enroll(name, key)
        idents = [r for r in self.site.db.identities() if not r.revoked]
        self.control.set_identities({r.name: (r.role, r.signing_key) for r in idents})
        self.coordinators = {r.name: r.signing_key for r in idents if r.role == "coordinator"}
        # A change the broker did not take (its test load failed: a busy machine, no free port) is
        # tried again at the next poll: a device enrolled last must not wait for a later change.
        if not self.push_acl():
            self._trust_version = -1
        crl = self.site.crl_pem()
        if crl != self._crl:
            if self._on_crl is None or self._on_crl(crl) is not False:
                self._crl = crl
            else:
                self._trust_version = -1

    def push_acl(self) -> bool:
        """Hand the broker the site's ACL as trust.db has it now (any thread); False if it refused.

        The text is read and installed under one lock: two enrolments finishing together must not
        install their texts out of order, or the older one takes the newer device's rights away
        (it connects, its writes are dropped, and no later sync puts them back)."""
        with self._acl_lock:
            acl = acl_shut_out(self.site.acl(), self._shut)
            if acl == self._acl:
                return True
            if self._on_acl is not None and self._on_acl(acl) is False:
                return False
            self._acl = acl
            return True

    # ------------------------------------------------------------ MQTT worker thread

    def _put(self, item: Any) -> None:
        try:
            self.inbox.put_nowait(item)
        except queue.Full:
            self.counters["inbox_overflow"] += 1

    def _put_live(self, item: Any) -> None:
        """Verified device traffic (ingest's batches): the owner takes it ahead of the inbox (any thread).

        Bounded by the devices' budgets upstream (``ingest.DEVICE_SHARE``); the wake-up is dropped
        when the inbox is full, as then the owner is busy and looks at this lane between items."""
        if self._live.qsize() >= 200_000:
            self.counters["live_overflow"] += 1
            return
        self._live.put(item)
        try:
            self.inbox.put_nowait(_WAKE)
        except queue.Full:
            pass

    def _put_control(self, item: _Other) -> None:
        """A control request: the owner takes it ahead of the inbox (MQTT worker). Bounded by the
        senders' control budgets upstream (``control.CONTROL_SHARE``)."""
        self._control_lane.put(item)
        try:
            self.inbox.put_nowait(_WAKE)
        except queue.Full:
            pass  # the owner is busy and looks at this lane between items

    def _sender_of(self, topic: str) -> tuple[str, str]:
        """(kind, sender) of an input topic: the id is the topic's last level, which the ACL lets only
        that identity write; ("", "") for a topic that is not one of ours (the broker would not send it)."""
        base, _, sender = topic.rpartition("/")
        if base == self._prefix_ctl:
            return CTL, sender
        if base == self._prefix_infer:
            return INFER, sender
        if base == self._prefix_result:
            return RESULT, sender
        if topic == self.topics.release():
            return _RELEASE, ""
        return "", ""

    def _on_other(self, m: Inbound) -> None:
        """Control, releases, inference requests and results: charged to the topic's sender and decoded
        under tight budgets here, authenticated on the owner thread (which holds the keys and windows)."""
        topic = m.topic
        while not self._charges.empty():  # the one taker: not empty -> get_nowait succeeds
            self._charge(*self._charges.get_nowait(), m.received_at)
        kind, sender = self._sender_of(topic)
        if kind == _RELEASE and m.retain:
            # releases are never retained: a retained one would come back at every restart
            self.counters["release:retained"] += 1
            if m.payload:
                self.mqtt.publish(topic, b"", retain=True)  # clear it
            return
        if kind in (CTL, INFER):
            if not self.control.admit(sender, kind, m.received_at):
                return  # over its sender's budget: dropped before decode and signature check (control.py)
        elif kind == RESULT:
            if sender != self.config.fog_id and not self.ingest.admit_result(sender, m.received_at):
                return  # an unknown device, or over its budget (ingest.py)
        elif kind != _RELEASE:
            self.counters["rejected:bad topic"] += 1
            return
        elif not self.control.admit(RELEASE_TOPIC, kind, m.received_at):
            return  # the release topic's one budget (control.py): a flood is dropped before decode
        try:
            if kind == _RELEASE:
                msg: Any = codec.decode(m.payload, max_size=MAX_CONTROL_BYTES, max_objects=4096, max_arrays=0)
            else:
                msg = codec.decode_envelope(m.payload, max_size=MAX_CONTROL_BYTES if kind == CTL
                                            else codec.DEFAULT_MAX_SIZE)
        except DecodeError as exc:
            why = "unsigned" if str(exc).startswith("expected an envelope") else "malformed"
            self.counters[f"rejected:{why}"] += 1
            if kind != _RELEASE:
                self._charge(kind, sender, m.received_at)  # a failed check: counts towards a quarantine
            log.debug("%s payload on %s: %s", why, topic, exc)
            return
        if kind != _RELEASE and msg.sender != sender:
            # signed (or claiming to be) by someone other than who the broker let write this topic
            self._charge(kind, sender, m.received_at, "signer not topic")
            return
        if kind != _RELEASE and sender != self.config.fog_id and self._known(kind, sender) \
                and self._copies.seen(sender, msg.signature):
            self._charge(kind, sender, m.received_at, "replayed copy")  # a replay, however slow: no second check
            return
        if kind == CTL and self.config.control_lane:
            self._put_control(_Other(kind, msg, m.received_at))
            return
        self._put(_Other(kind, msg, m.received_at))

    def _known(self, kind: str, sender: str) -> bool:
        """An identity the fog issued or enrolled (only those get a memory of copies: bounded)."""
        return sender in (self.device_keys if kind == RESULT else self.control.keys)

    def _charge(self, kind: str, sender: str, now: float, why: str = "") -> None:
        """MQTT worker: one bad input on ``sender``'s topic, counted against ``sender`` as a drop."""
        if kind == RESULT:
            self.ingest.charge(sender, kind, now, why)
        else:
            self.control.charge(sender, kind, now, why)

    def refused(self, kind: str, sender: str) -> None:
        """Owner thread: an input on ``sender``'s topic failed its check; charge it (MQTT worker)."""
        self._charges.put((kind, sender))

    # ------------------------------------------------------------ owner thread

    def _run(self) -> None:
        next_tick = last_tick = time.monotonic()
        while True:
            timeout = max(0.0, next_tick - time.monotonic())
            try:
                item = self.inbox.get(timeout=timeout)
            except queue.Empty:
                item = None
            batch = 0
            while item is not None:
                if item is _STOP:
                    return
                live, ctl = self._live, self._control_lane
                while not live.empty():  # the one taker: not empty -> get_nowait succeeds
                    self._dispatch_safely(live.get_nowait())
                    batch += 1
                while not ctl.empty():
                    self._dispatch_safely(ctl.get_nowait())
                    batch += 1
                if self._snap_wanted:
                    self._publish_snapshot()
                if item is _WAKE:
                    item = self._next_item()
                    continue
                self._dispatch_safely(item)
                batch += 1
                if batch >= 500:
                    break
                item = self._next_item()
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
            if self._snap_wanted:
                self._publish_snapshot()

    def _next_item(self) -> Any:
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

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
            case _Other(kind, msg, at):
                self._handle_other(kind, msg, at)
            case _LocalInfer(request, at):
                self.submit_inference(request, at)
            case _Call(fn, fut):
                try:
                    fut.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - returned to the calling thread
                    fut.set_exception(exc)
            case _SyncTrust():
                self._sync_trust(time.monotonic())
            case _RebirthAll(reason):
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
                self._event(cmd.kind, cmd.device, cmd.reason)
            elif isinstance(cmd, LogNote):
                log.log(logging.INFO if cmd.level == "info" else logging.WARNING, "%s", cmd.text)
            elif isinstance(cmd, (SendActivation, ReplyClient)):
                self._router_cmds([cmd])
            elif isinstance(cmd, FollowRelease):
                self._follow_release(cmd)
            else:
                work.append(cmd)
        if work:
            self.execute(work)
        if self.controller.ready and not self._was_ready:
            self._was_ready = True
            phases = Counter(a.phase.value for a in self.controller.assignments.values())
            log.info("ready after %.2f s: heard %d devices; assignments %s", time.monotonic() - self.started_mono,
                     len(self.registry.reported()), dict(phases))

    def _event(self, kind: str, device: str, reason: str) -> None:
        self.events.append({"at": round(time.time(), 3), "kind": kind, "device": device, "reason": reason})

    def _tick(self, now: float) -> None:
        if now - self._last_trust_poll >= self.config.trust_poll_s:
            self._sync_trust(now)
        shut = self.ingest.shut_out(now) | self.control.shut_out(now)
        if shut != self._shut:
            self._quarantine_changed(shut, now)
        self._carry_out(self.core.tick(now, time.time()))
        if now - self._last_summary >= self.config.summary_interval_s:
            self._last_summary = now
            self._publish_summary()
        if now - self._last_time_hint >= self.config.time_hint_s:
            self._last_time_hint = now
            self.publish_signed(self.topics.time(), TimeHint(self.config.fog_id, time.time()))

    def _quarantine_changed(self, shut: frozenset[str], now: float) -> None:
        """A sender was quarantined for flooding (or let back): its writes leave (return to) the ACL."""
        for name in sorted(shut - self._shut):
            why = self.ingest.share.reason(name) if self.ingest.share is not None else ""
            why = why or (self.control.share.reason(name) if self.control.share is not None else "")
            log.warning("%s quarantined: %s; its writes are withheld at the broker", name, why)
            self._event("quarantined", name, why)
        self._shut = shut
        self._trust_version = -1  # re-push the ACL
        self._sync_trust(now)

    # ------------------------------------------------------------ commands

    def publish_signed(self, topic: str, msg: Any, *, retain: bool = False) -> None:
        with self._sign_lock:
            self.mqtt.publish(topic, self.signer.seal_bytes(msg, time.time()), retain=retain)

    def mark_dirty(self) -> None:
        self.core.mark_dirty()

    def apply(self, event: Any, now: float | None = None) -> None:
        """Hand one event to the site core and carry out what it decides (owner thread)."""
        self._carry_out(self.core.handle(event, time.monotonic() if now is None else now, time.time()))

    def execute(self, cmds: list[Any]) -> None:
        persist: set[str] = set()
        for cmd in cmds:
            if isinstance(cmd, DeployPartition):
                self._deploy(cmd)
            elif isinstance(cmd, UndeployPartition):
                self.counters["undeploys_sent"] += 1
                self.publish_signed(self.topics.device(cmd.device, "CMD"),
                                    Undeploy(cmd.command_id, cmd.workload, cmd.version, cmd.replica, cmd.index))
            elif isinstance(cmd, Persist):
                persist.add(cmd.workload)
        for name in persist:
            self._persist(name)

    def collect_blobs(self) -> None:
        """Delete uploaded/released model files no workload or release refers to any more."""
        keep = set(self.releases.refs())
        for e in self.controller.workloads.values():
            if e.spec.model:
                keep.add(e.spec.model)
        for sw in self.store.workloads():
            m = sw.spec.get("model")
            if isinstance(m, str):
                keep.add(m)
        gone = self.artifacts.collect(keep)
        if gone:
            self.counters["blobs_collected"] += gone

    def _deploy(self, cmd: DeployPartition) -> None:
        """Owner thread: hand the deploy to the artifact thread (split + sign + publish)."""
        entry = self.controller.workloads.get(cmd.workload)
        if entry is None or entry.spec.model is None or entry.spec.profile is None:
            return
        memory = math.ceil(entry.spec.profile.memory_of(cmd.first, cmd.last))
        self._builds.put((cmd, entry.spec.model, memory, entry.spec.input_shapes))
        job = wires.deploy_job(cmd, entry.spec, self.controller.assignments_of(cmd.workload),
                               self.artifacts, self._put)  # each cut's wire (issue 21)
        if job is not None:
            self._builds.put(job)

    def _build_loop(self) -> None:
        try:  # warm up: the first deploy after a failure should not wait for imports
            import models.cuts
            import models.partition
            import models.zoo  # noqa: F401
        except Exception:
            log.exception("models package failed to import; deploys will fail")
        while True:
            item = self._builds.get()
            if item is _STOP:
                return
            if callable(item):  # an activation-wire calibration (fog_broker.wires)
                item()
                continue
            cmd, ref, memory, shapes = item
            try:
                self._build_and_send(cmd, ref, memory, shapes)
            except Exception as exc:  # noqa: BLE001 - a model we cannot split: NACK ourselves
                log.error("cannot build partition %s [%d, %d]: %s", cmd.workload, cmd.first, cmd.last, exc)
                self._put(BuildFailed(cmd, f"artifact build failed: {exc}"[:300]))

    def _build_and_send(self, cmd: DeployPartition, ref: str, memory: int, shapes: Any) -> None:
        key = (cmd.workload, cmd.version, cmd.replica, cmd.index)
        built = self.artifacts.build(ref, cmd.first, cmd.last, shapes)
        self._put(Built(key, built.sha256))
        sig = self.artifacts.sign(built, cmd.workload, cmd.version, cmd.replica, cmd.index)
        msg = Deploy(cmd.command_id, cmd.workload, cmd.version, cmd.replica, cmd.index, built.sha256,
                     built.onnx_bytes, sig.signature, sig.signer, memory, built.inputs, built.outputs,
                     {k: str(v) for k, v in sig.metadata.items()})
        self.counters["deploys_sent"] += 1
        log.info("deploy %s v%d r%d p%d [%d-%d] -> %s (attempt %d)", cmd.workload, cmd.version, cmd.replica,
                 cmd.index, cmd.first, cmd.last, cmd.device, cmd.attempt)
        self.publish_signed(self.topics.device(cmd.device, "CMD"), msg)

    def _persist(self, name: str) -> None:
        rows = [StoredAssignment(a.key[0], a.key[1], a.key[2], a.key[3], a.first, a.last, a.device, a.sha256)
                for a in self.controller.persisted_of(name)]  # a switch's old partitions too
        self.store.replace_assignments(name, rows)

    # ------------------------------------------------------------ data plane

    def _router_cmds(self, cmds: list[Any]) -> None:
        for cmd in cmds:
            if isinstance(cmd, SendActivation):
                self._send_activation(cmd.activation)
            elif isinstance(cmd, ReplyClient):
                if cmd.reply_to.startswith(_LOCAL):
                    fut = self._local.pop(cmd.reply_to[len(_LOCAL):], None)
                    if fut is not None and not fut.done():
                        fut.set_result(cmd.result)
                else:
                    self.publish_signed(cmd.reply_to, cmd.result)

    def _send_activation(self, act: Activation) -> None:
        """Issue the attempt's route ticket, which vouches for hop 0's tensors too (``runtime.relay``)."""
        keys = [self.device_keys.key_bytes(h.device_id) for h in act.route]
        if any(k is None for k in keys):
            self.apply(RouteUntrusted(act, time.time()))
            return
        ticket = RouteTicket(self.config.fog_id, act.request_id, act.workload, act.route,
                             tuple(k for k in keys if k is not None), act.reply_to, act.deadline)
        frame = relay.issue(self.identity, ticket, act)
        self.mqtt.publish(self.topics.activation(act.route[0].device_id, self.config.fog_id), frame)

    def _handle_other(self, kind: str, msg: Any, at: float) -> None:
        if kind == RESULT:
            self._on_result(msg, at)
        elif kind == INFER:
            self._on_infer(msg, at)
        elif kind == CTL:
            self.control.handle(msg, at, msg.sender if isinstance(msg, Envelope) else "?")
        elif kind == _RELEASE:
            self._on_release(msg, at)

    def _on_result(self, env: Envelope, at: float) -> None:
        """A hop's answer, sealed by its device; the router checks the device is on the route."""
        if env.sender == self.config.fog_id:  # our own subscription ping (see start)
            try:
                ping = codec.decode(env.payload)
            except DecodeError:
                return
            if isinstance(ping, InferenceResult) and ping.request_id == _PING:
                self._subscribed.set()
            return
        try:
            res = self.results.verify_only(env)
        except SecurityError as exc:
            self.counters[f"rejected:result {exc.reason}"] += 1
            self.refused(RESULT, env.sender)
            return
        if not isinstance(res, InferenceResult):
            self.counters["rejected:wrong kind"] += 1
            return
        self.apply(Result(res, env.sender, time.time()), at)

    def _on_infer(self, env: Envelope, at: float) -> None:
        req = self.control.open_request(env, "infer", env.sender if isinstance(env, Envelope) else "?")
        if req is None:
            return
        why = misaddressed(req, InferenceRequest, self.topics.reply(env.sender))
        if why is not None:
            self.counters[f"rejected:{why}"] += 1
            return
        self.submit_inference(req, at)

    def submit_inference(self, req: InferenceRequest, at: float) -> None:
        """Route an authenticated request (owner thread); the answer goes to ``req.reply_to``."""
        self.apply(Infer(req, time.time()), at)

    def _on_release(self, msg: Any, at: float) -> None:
        """A signed new model version from a pinned coordinator: keep it, roll the workloads that follow it."""
        if not isinstance(msg, ModelRelease):
            self.counters["rejected:wrong kind"] += 1
            return
        why = self.releases.check(msg, self.coordinators)
        if why:
            self.counters[f"release:{why.split(' (')[0]}"] += 1
            log.warning("model release %s v%s from %s refused: %s", msg.workload[:64], msg.version,
                        msg.signer[:64], why)
            return
        try:
            ref = self.artifacts.store_blob(msg.artifact, expect_sha=msg.sha256)
        except RemoteViolation as exc:
            self.counters["release:bad model"] += 1
            log.warning("model release %s v%d refused: %s", msg.workload, msg.version, exc)
            return
        self.releases.accept(msg, ref)
        log.info("model release %s v%d from %s accepted (%s)", msg.workload, msg.version, msg.signer, ref[:17])
        self.apply(ReleaseAccepted(msg.workload, msg.version, ref, msg.signer, dict(msg.metadata)), at)

    def _follow_release(self, cmd: FollowRelease) -> None:
        """The core's rule: these workloads follow a release that has a new version; deploy their
        stored specs again (``release:NAME`` resolves to the new bytes, profiled anew)."""
        names = set(cmd.workloads)
        followers = [sw.spec for sw in self.store.workloads() if sw.name in names]
        if followers:
            self.control.deploy({"workloads": followers}, time.monotonic(), internal=True)

    # ------------------------------------------------------------ status and summary

    def _publish_summary(self) -> None:
        summary = FleetSummary(self.config.fog_id, self.config.site, time.time(), self.registry.summaries())
        self.publish_signed(self.topics.summary(), summary, retain=True)

    def status(self, now: float | None = None, *, snapshot: SiteSnapshot | None = None,
               max_age_s: float | None = None, **page: Any) -> dict[str, Any]:
        """Everything ``fogline status`` shows (any thread): of ``snapshot``, else of ``self.snapshot(max_age_s)``."""
        snap = snapshot if snapshot is not None else self.snapshot(max_age_s)
        return site_status(self, time.monotonic() if now is None else now, snap, **page)

    def snapshot(self, max_age_s: float | None = None, timeout: float = 5.0) -> SiteSnapshot:
        """The site as a frozen value. On the owner thread (or before it runs): built now if anything
        changed. Elsewhere: the newest one if it is at most ``max_age_s`` old, else the owner builds
        one between two inbox items and this waits for it (``TimeoutError`` after ``timeout``)."""
        owner = self._owner
        if threading.current_thread() is owner or not owner.is_alive():
            return self._publish_snapshot()
        asked = time.monotonic()
        with self._snap_cond:
            snap = self._snap
            if snap is not None and max_age_s is not None and asked - self._snap_seen <= max_age_s:
                return snap
            self._snap_wanted = True
            seq = self._snap_seq
        try:
            self.inbox.put_nowait(_WAKE)
        except queue.Full:
            pass  # the owner is busy: it looks for the request between items
        with self._snap_cond:
            if not self._snap_cond.wait_for(lambda: self._snap_seq > seq, timeout):
                raise TimeoutError("the fog broker's owner thread did not answer")
            assert self._snap is not None
            return self._snap

    def _publish_snapshot(self) -> SiteSnapshot:
        """Owner thread: the core's snapshot now, handed to the threads waiting for one."""
        now = time.monotonic()
        snap = self.core.snapshot(now)
        with self._snap_cond:
            self._snap_wanted = False
            self._snap, self._snap_seen = snap, now
            self._snap_seq += 1
            self._snap_cond.notify_all()
        return snap

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the owner thread and return its result (any thread)."""
        fut: Future[Any] = Future()
        self.inbox.put(_Call(fn, fut))
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
        rid = uuid.uuid4().hex
        fut: Future[InferenceResult] = Future()
        self._local[rid] = fut
        req = InferenceRequest(rid, workload, _LOCAL + rid, dict(tensors), float(timeout), stream)
        try:
            self.inbox.put_nowait(_LocalInfer(req, time.monotonic()))
        except queue.Full:
            self._local.pop(rid, None)
            fut.set_result(InferenceResult(rid, False, {}, "fog broker overloaded (inbox full)", failure="overloaded",
                                           retry_after_s=1.0))
        return fut

    def verified(self) -> int:
        return self.ingest.verified()

    def rejections(self) -> Mapping[str, int]:
        return self.ingest.rejections()
