"""The fog broker process shell: MQTT, SQLite, artifacts and the clock around the pure cores.

Threads and who owns what:

* paho's network thread: only enqueues (``runtime.mqtt``).
* the MQTT worker thread (``MqttClient``'s): parses a device topic and hands
  the message to its verify shard (a device always maps to the same shard).
* verify shards (``verify_workers``, default 2): batch their queue, check
  envelopes (Ed25519, replay window, timestamp; TOFU enrollment of new
  devices) in a worker process each (``verify_processes``) or in the thread,
  and hand plain messages to the owner inbox. Signature checks are the bulk
  of advert ingest, so they run outside the process that owns the cores.
* the artifact thread: splits, hashes and signs partitions and publishes Deploys.
* the owner thread: holds the registry, the controller, the router and the
  store. It pumps the inbox, runs the cores, executes their commands
  (build and sign artifacts, publish), and runs the timers (liveness,
  reconcile, fleet summary).
"""
from __future__ import annotations

import base64
import json
import logging
import math
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from runtime import codec
from runtime.errors import DecodeError, LocalViolation, RemoteViolation, SecurityError
from runtime.messages import (
    ModelRelease,
    CommandAck, ControlReply, ControlRequest, Deploy, DeviceBirth, DeviceDeath, DeviceState, Envelope,
    FleetSummary, FogState, InferenceRequest, InferenceResult, Rebirth, Undeploy,
)
from runtime.mqtt import Inbound, MqttClient, Will
from runtime.security import (
    NO_SESSION, UNKNOWN_SENDER, ArtifactSignature, Identity, SessionKeyPair, Signer, TrustStore, Verifier,
    sign_session_offer, verify_artifact,
)
from runtime.topics import ACK, BIRTH, DEATH, STATE, Topics, parse

from ._verify_pool import looks_mac, open_session
from .artifacts import ArtifactBuilder
from .controller import Controller, ControllerConfig, DeployPartition, Persist, UndeployPartition
from .placement.model import Quota, SpecError, Workload
from .registry import DeviceJoined, DeviceLost, Registry, RegistryConfig, RequestRebirth
from .router import ReplyClient, Router, SendActivation
from .store import StoredAssignment, Store

__all__ = ["ServiceConfig", "FogService", "default_schedule"]

log = logging.getLogger("fog_broker.service")

_STOP = object()
_PING = "__fog_self_ping__"


def default_schedule() -> Callable[..., Any]:
    """The placement scheduler (``fog_broker.placement.schedule``)."""
    from . import placement
    fn = getattr(placement, "schedule", None)
    if fn is None:
        from .placement.scheduler import schedule as fn
    return fn  # type: ignore[no-any-return]


@dataclass
class ServiceConfig:
    data_dir: Path
    site: str = "default"
    fog_id: str = ""
    mqtt_host: str = "127.0.0.1"
    mqtt_port: int = 1883
    state_interval_s: float = 10.0     # the default until a birth says otherwise
    tick_s: float = 0.05
    reconcile_interval_s: float = 0.5
    summary_interval_s: float = 3.0
    startup_wait_s: float | None = None  # None: one state interval
    strict_enrollment: bool = False
    strict_operators: bool = False
    battery_floor: float = 0.3
    keepalive: int = 5
    verify_workers: int = 2
    verify_processes: bool = False     # verify in worker processes (one per shard) instead of threads
    controller: ControllerConfig = field(default_factory=ControllerConfig)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if not self.fog_id:
            self.fog_id = f"fog-{self.site}"


@dataclass
class _Shard:
    """One verify shard: its queue, its verifier (threads) or worker process, its own counters."""

    queue: "queue.Queue[Any]"
    verifier: Verifier
    worker: Any = None
    counters: Counter[str] = field(default_factory=Counter)
    accepted: int = 0


class FogService:
    """One fog broker: ``start()``, then ``stop()``; ``snapshot_status()`` from any thread."""

    def __init__(self, config: ServiceConfig, *, schedule: Callable[..., Any] | None = None) -> None:
        self.config = c = config
        c.data_dir.mkdir(parents=True, exist_ok=True)
        self.topics = Topics(c.site)
        self.identity = Identity.load_or_create(c.fog_id, c.data_dir / "fog.key")
        self.store = Store(c.data_dir / "fog.db")
        self.epoch = self.store.next_epoch()
        self.signer = Signer(self.identity, self.epoch)
        # This run's X25519 key (never stored), offered in the signed FogState: devices derive
        # per-connection HMAC keys with it for their state adverts (docs/protocol.md, Trust).
        self.session = SessionKeyPair()
        self._session_sig = sign_session_offer(self.identity, c.site, self.epoch, self.session.public_bytes)
        self.devices_trust = TrustStore(path=c.data_dir / "devices.json")
        self._enroll_lock = threading.Lock()
        # Verify shards: a device always maps to the same shard, so its replay window lives there.
        self._shards = [_Shard(queue.Queue(maxsize=100_000), Verifier(self.devices_trust, sessions=True))
                        for _ in range(max(1, c.verify_workers))]
        if c.verify_processes:
            from ._verify_pool import VerifyWorker
            keys = {n: k for n in self._trusted_names() if (k := self.devices_trust.key_bytes(n)) is not None}
            for sh in self._shards:
                sh.worker = VerifyWorker(keys)
        self.operators_trust = TrustStore(path=c.data_dir / "operators.json")
        # Coordinators that sign model releases: pinned on first use, like devices.
        self.coordinators_trust = TrustStore(path=c.data_dir / "coordinators.json")
        self._releases_path = c.data_dir / "releases.json"
        self.releases: dict[str, dict[str, Any]] = (
            json.loads(self._releases_path.read_text()) if self._releases_path.exists() else {})
        self.op_verifier = Verifier(self.operators_trust)
        self.registry = Registry(RegistryConfig(default_interval_s=c.state_interval_s,
                                                battery_floor=c.battery_floor))
        self.controller = Controller(schedule or default_schedule(), c.controller,
                                     command_prefix=f"{c.fog_id}.{self.epoch}")
        self.router = Router(self.topics.reply(c.fog_id))
        self.artifacts = ArtifactBuilder(self.identity, c.data_dir / "models")
        self.counters: Counter[str] = Counter()
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=200_000)
        self.mqtt = MqttClient(c.fog_id, c.mqtt_host, c.mqtt_port, keepalive=c.keepalive,
                               will=Will(self.topics.fog_state(), codec.encode(self._fog_state(False)),
                                         qos=1, retain=True),
                               inbox_size=100_000, max_queued=100_000)
        self._owner = threading.Thread(target=self._run, name="fog-owner", daemon=True)
        # Artifact building (ONNX split, hash, sign) runs here, never on the owner thread.
        self._builds: queue.Queue[Any] = queue.Queue()
        self._builder = threading.Thread(target=self._build_loop, name="fog-artifacts", daemon=True)
        self._sign_lock = threading.Lock()
        self._subscribed = threading.Event()
        self._stopped = threading.Event()
        self._status_lock = threading.Lock()
        self._status: dict[str, Any] = {}
        self._started_mono = time.monotonic()
        self._last_reconcile = -math.inf
        self._last_summary = -math.inf
        self._dirty = True
        self._partitions_seen: dict[str, tuple[Any, ...]] = {}
        self._load_desired()

    # ------------------------------------------------------------ lifecycle

    def _fog_state(self, online: bool) -> FogState:
        return FogState(self.config.fog_id, self.config.site, online, self.epoch,
                        self.identity.public_key_bytes, time.time(), self.session.public_bytes, self._session_sig)

    def _load_desired(self) -> None:
        now = time.monotonic()
        self.controller.set_quotas({t: Quota(m) for t, m in self.store.quotas().items()})
        for sw in self.store.workloads():
            try:
                spec = self._workload_from(sw.spec, sw.profile)
            except RemoteViolation as exc:
                log.error("stored workload %s is invalid, skipped: %s", sw.name, exc)
                continue
            self.controller.set_workload(spec, sw.version)
        from .controller import Assignment
        stored = [Assignment((a.workload, a.version, a.replica, a.index), a.device, a.first, a.last,
                             sha256=a.sha256) for a in self.store.assignments()]
        if self.controller.workloads:
            wait = self.config.startup_wait_s
            self.controller.config = ControllerConfig(**{
                **{k: getattr(self.controller.config, k) for k in self.controller.config.__dataclass_fields__},
                "startup_wait_s": wait if wait is not None else self.config.state_interval_s})
            self.controller.start_after_restart(now, stored)
            log.info("restart: %d workloads, %d stored assignments; waiting for devices",
                     len(self.controller.workloads), len(stored))

    def start(self, connect_timeout: float = 10.0) -> "FogService":
        t = self.topics
        for leaf in (BIRTH, STATE, DEATH, ACK):
            # States are periodic and superseded by the next one (liveness allows 3 misses):
            # QoS 0 delivery saves a PUBACK round per advert. Births, deaths and acks stay QoS 1.
            self.mqtt.subscribe(t.all_devices(leaf), self._on_device, qos=0 if leaf == STATE else 1)
        self.mqtt.subscribe(t.infer(), self._on_other)
        self.mqtt.subscribe(t.control(), self._on_other)
        self.mqtt.subscribe(t.release(), self._on_other)
        self.mqtt.subscribe(t.reply(self.config.fog_id), self._on_other)
        self.mqtt.on_connected.append(self._on_connected)
        self._owner.start()
        self._builder.start()
        for i, shard in enumerate(self._shards):
            threading.Thread(target=self._verify_loop, args=(shard,), name=f"fog-verify-{i}", daemon=True).start()
        self.mqtt.start()
        if not self.mqtt.wait_connected(connect_timeout):
            self.stop()
            raise LocalViolation(f"cannot connect to MQTT at {self.config.mqtt_host}:{self.config.mqtt_port}")
        # Subscriptions are made in order on connect; once a ping to our reply topic (the last one)
        # comes back, every subscription is active and no request sent from now on is lost.
        deadline = time.monotonic() + connect_timeout
        while not self._subscribed.is_set() and time.monotonic() < deadline:
            self.mqtt.publish(self.topics.reply(self.config.fog_id),
                              codec.encode(InferenceResult(_PING, False)))
            self._subscribed.wait(0.2)
        return self

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            if self.mqtt.connected:
                self.mqtt.publish(self.topics.fog_state(), codec.encode(self._fog_state(False)),
                                  retain=True).wait(2.0)
        finally:
            self.mqtt.stop()
            self._builds.put(_STOP)
            for shard in self._shards:
                shard.queue.put(_STOP)
            self.inbox.put(_STOP)
            if threading.current_thread() is not self._owner and self._owner.is_alive():
                self._owner.join(timeout=5)
            self.store.close()

    def _on_connected(self) -> None:  # MQTT worker thread
        self.mqtt.publish(self.topics.fog_state(), codec.encode(self._fog_state(True)), retain=True)
        self._put(("rebirth_all", "fog broker (re)connected"))

    # ------------------------------------------------------------ ingest (MQTT worker thread)

    def _put(self, item: Any) -> None:
        try:
            self.inbox.put_nowait(item)
        except queue.Full:
            self.counters["inbox_overflow"] += 1

    def _on_device(self, m: Inbound) -> None:
        """MQTT worker: route a device message to its verify shard (per-device order is kept)."""
        try:
            pt = parse(m.topic)
        except RemoteViolation:
            self.counters["bad_topic"] += 1
            return
        shard = self._shards[hash(pt.name) % len(self._shards)]
        try:
            shard.queue.put_nowait((m, pt))
        except queue.Full:
            self.counters["verify_overflow"] += 1

    def _verify_loop(self, shard: "_Shard") -> None:
        """A verify shard: batches its queue; checks run here (threads) or in its worker process."""
        while True:
            item = shard.queue.get()
            batch = [item]
            while len(batch) < 512:
                try:
                    batch.append(shard.queue.get_nowait())
                except queue.Empty:
                    break
            stop = _STOP in batch
            batch = [it for it in batch if it is not _STOP]
            out: list[tuple[str, Any, float]] = []
            try:
                if shard.worker is not None:
                    self._ingest_remote(shard, batch, out)
                else:
                    for m, pt in batch:
                        self._ingest(shard, m, pt, out)
            except Exception:  # noqa: BLE001 - never lose the shard to one batch; logged loudly
                shard.counters["internal_errors"] += 1
                log.exception("ingest failed for a batch of %d", len(batch))
            if out:
                self._put(("batch", out))
            if stop:
                if shard.worker is not None:
                    shard.worker.close()
                return

    def _death(self, shard: "_Shard", m: Inbound, pt: Any, out: list[tuple[str, Any, float]]) -> None:
        try:
            msg = codec.decode(m.payload)
        except DecodeError as exc:
            shard.counters["rejected:malformed"] += 1
            log.debug("bad death on %s: %s", m.topic, exc)
            return
        if not isinstance(msg, DeviceDeath) or msg.device_id != pt.name:
            shard.counters["rejected:topic mismatch"] += 1
            return
        out.append(("advert", msg, m.received_at))

    def _accept(self, shard: "_Shard", m: Inbound, pt: Any, sender: str, msg: Any,
                out: list[tuple[str, Any, float]]) -> None:
        """Checks after a valid signature: topic, sender and kind agree; a birth carries the pinned key."""
        device_id = getattr(msg, "device_id", None)
        if sender != pt.name or device_id != pt.name:
            shard.counters["rejected:topic mismatch"] += 1
            log.warning("%s: sender %r / device %r do not match the topic", m.topic, sender, device_id)
            return
        if pt.leaf == BIRTH and isinstance(msg, DeviceBirth):
            if msg.public_key != self.devices_trust.key_bytes(pt.name):
                shard.counters["rejected:key mismatch"] += 1
                log.warning("%s: birth announces a key other than the pinned one; refused", pt.name)
                return
        elif not ((pt.leaf == STATE and isinstance(msg, DeviceState))
                  or (pt.leaf == ACK and isinstance(msg, CommandAck))):
            shard.counters["rejected:wrong kind"] += 1
            return
        shard.counters[f"in:{pt.leaf}"] += 1
        out.append(("ack" if pt.leaf == ACK else "advert", msg, m.received_at))

    def _rejected(self, shard: "_Shard", m: Inbound, pt: Any, reason: str, detail: str,
                  out: list[tuple[str, Any, float]]) -> None:
        shard.counters[f"rejected:{reason}"] += 1
        log.debug("rejected %s: %s", m.topic, detail)
        if reason in (UNKNOWN_SENDER, NO_SESSION) and pt.leaf != BIRTH:
            out.append(("rebirth", pt.name, m.received_at))

    def _ingest(self, shard: "_Shard", m: Inbound, pt: Any, out: list[tuple[str, Any, float]]) -> None:
        if pt.leaf == DEATH:
            self._death(shard, m, pt, out)
            return
        wall = time.time()
        if pt.leaf == BIRTH and pt.name not in self.devices_trust and not self._enroll(shard, m, pt.name, wall):
            return
        self._open_here(shard, m, pt, wall, out)

    def _open_here(self, shard: "_Shard", m: Inbound, pt: Any, wall: float,
                   out: list[tuple[str, Any, float]]) -> None:
        """Full check in this thread: signature or session MAC, timestamp, replay window, decode."""
        try:
            env, msg = shard.verifier.open(m.payload, wall)
        except SecurityError as exc:
            self._rejected(shard, m, pt, exc.reason, str(exc), out)
            return
        self._verified(shard, m, pt, env, msg, out)

    def _verified(self, shard: "_Shard", m: Inbound, pt: Any, env: Envelope, msg: Any,
                  out: list[tuple[str, Any, float]]) -> None:
        if pt.leaf == BIRTH:
            note = open_session(shard.verifier, self.session, env, msg)
            if note:
                shard.counters[note] += 1
        self._accept(shard, m, pt, env.sender, msg, out)

    def _ingest_remote(self, shard: "_Shard", batch: list[tuple[Inbound, Any]],
                       out: list[tuple[str, Any, float]]) -> None:
        """Stateless checks (Ed25519 or session MAC, then decode) in the worker; stateful ones here.

        The batch goes to the worker in one message; results are admitted (timestamp, replay
        window) here in arrival order, and births (re)key sessions here, so each device's window
        and session key live in exactly one place and its order is kept. A MAC item carries the
        session key of the topic's device; the worker refuses it for any other sender or epoch.
        """
        assert shard.worker is not None
        items: list[tuple[Any, ...]] = []
        plan: list[tuple[Inbound, Any, float, bool]] = []
        rekeyed: set[str] = set()  # devices with a birth earlier in this batch: their session may change
        for m, pt in batch:
            if pt.leaf == DEATH:
                self._death(shard, m, pt, out)
                continue
            wall = time.time()
            if pt.leaf == BIRTH and pt.name not in self.devices_trust:
                if not self._enroll(shard, m, pt.name, wall):
                    continue
                items.append(("enroll", pt.name, self.devices_trust.key_bytes(pt.name)))
            # looks_mac is a routing hint only: a frame that lies about its tag fails in either place.
            remote = True
            if not looks_mac(m.payload):
                items.append(("verify", m.payload))
            elif pt.name not in rekeyed and (sess := shard.verifier.session(pt.name)) is not None:
                items.append(("mac", m.payload, pt.name, sess[0], sess[1]))
            else:
                remote = False  # no session (or a birth before it in this batch): checked here, in order
            if pt.leaf == BIRTH:
                rekeyed.add(pt.name)
            plan.append((m, pt, wall, remote))
        results = iter(shard.worker.run(items) if items else ())
        for m, pt, wall, remote in plan:
            if not remote:
                self._open_here(shard, m, pt, wall, out)
                continue
            r = next(results)
            if r[0] != "ok":
                self._rejected(shard, m, pt, r[1], r[2], out)
                continue
            env, msg = r[1], r[2]
            try:
                shard.verifier.admit(env, wall)
            except SecurityError as exc:
                self._rejected(shard, m, pt, exc.reason, str(exc), out)
                continue
            shard.accepted += 1
            self._verified(shard, m, pt, env, msg, out)

    def _enroll(self, shard: "_Shard", m: Inbound, name: str, wall: float) -> bool:
        """TOFU: the first birth of an unknown device pins the key it carries (self-signed)."""
        if self.config.strict_enrollment:
            shard.counters["rejected:not enrolled"] += 1
            log.warning("birth from %s refused: not enrolled (strict enrollment)", name)
            return False
        try:
            env = codec.decode(m.payload)
            if not isinstance(env, Envelope):
                raise DecodeError("not an envelope")
            birth = codec.decode(env.payload)
            if not isinstance(birth, DeviceBirth) or birth.device_id != name or env.sender != name:
                raise DecodeError("not a birth of this device")
            Verifier(TrustStore({name: birth.public_key})).open(m.payload, wall)
        except (DecodeError, SecurityError) as exc:
            shard.counters["rejected:enrollment"] += 1
            log.warning("birth from %s refused: %s", name, exc)
            return False
        with self._enroll_lock:  # shards enroll concurrently; the trust file is rewritten whole
            if name not in self.devices_trust:
                self.devices_trust.enroll(name, birth.public_key)
                shard.counters["enrolled"] += 1
                log.info("enrolled device %s (key %s)", name, birth.public_key.hex()[:16])
        return True

    def _on_other(self, m: Inbound) -> None:
        try:
            msg = codec.decode(m.payload)
        except DecodeError as exc:
            self.counters["rejected:malformed"] += 1
            log.debug("bad payload on %s: %s", m.topic, exc)
            return
        self._put(("other", m.topic, msg, m.received_at))

    # ------------------------------------------------------------ owner thread

    def _run(self) -> None:
        next_tick = time.monotonic()
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
                try:
                    self._dispatch(item)
                except RemoteViolation as exc:
                    self.counters["remote_errors"] += 1
                    log.warning("dropped input: %s", exc)
                except Exception:  # noqa: BLE001 - the loop must survive our own bugs too; logged loudly
                    self.counters["internal_errors"] += 1
                    log.exception("owner loop failed on %r", item[0] if isinstance(item, tuple) else item)
                batch += 1
                if batch >= 500:
                    break
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    item = None
            now = time.monotonic()
            if now >= next_tick or self._dirty:
                try:
                    self._tick(now)
                except Exception:  # noqa: BLE001
                    self.counters["internal_errors"] += 1
                    log.exception("tick failed")
                next_tick = now + self.config.tick_s

    def _dispatch(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "batch":
            for sub in item[1]:
                self._dispatch(sub)
        elif kind == "advert":
            msg, at = item[1], item[2]
            self._handle_registry(self.registry.handle(msg, at), at)
            if isinstance(msg, DeviceState):
                parts = tuple((p.workload, p.version, p.replica, p.index, p.health) for p in msg.partitions)
                if self._partitions_seen.get(msg.device_id) != parts:
                    self._partitions_seen[msg.device_id] = parts
                    self._dirty = True
        elif kind == "ack":
            msg, at = item[1], item[2]
            self._execute(self.controller.ack(msg.command_id, msg.device_id, msg.ok, msg.reason, at))
            if not msg.ok:
                log.warning("NACK from %s for %s: %s", msg.device_id, msg.command_id, msg.reason)
            self._dirty = True
        elif kind == "built":
            self.controller.note_sha(item[1], item[2])
            self._persist(item[1][0])
        elif kind == "selfnack":
            cmd = item[1]
            self._execute(self.controller.ack(cmd.command_id, cmd.device, False, item[2], time.monotonic()))
            self._dirty = True
        elif kind == "rebirth":
            self._handle_registry(self.registry.ask_rebirth(item[1], item[2], "unknown sender"), item[2])
        elif kind == "rebirth_all":
            self._publish_signed(self.topics.rebirth(), Rebirth("", item[1]))
        elif kind == "other":
            self._handle_other(item[1], item[2], item[3])
        elif kind == "call":
            fn, box = item[1], item[2]
            try:
                box.append(("ok", fn()))
            except Exception as exc:  # noqa: BLE001 - returned to the calling thread
                box.append(("error", exc))

    def _handle_registry(self, cmds: list[Any], now: float) -> None:
        for cmd in cmds:
            if isinstance(cmd, RequestRebirth):
                self.counters["rebirths_asked"] += 1
                self._publish_signed(self.topics.device(cmd.device_id, "CMD"),
                                     Rebirth(cmd.device_id, cmd.reason))
            elif isinstance(cmd, DeviceLost):
                log.warning("device %s lost (%s)", cmd.device_id, cmd.reason)
                self.counters["devices_lost"] += 1
                self.controller.device_lost(cmd.device_id, now)
                self._dirty = True
                self._reconcile(now)  # re-place at once: detection -> deploy without waiting a tick
                self._router_cmds(self.router.device_lost(cmd.device_id, self._chains_of(), now, time.time()))
            elif isinstance(cmd, DeviceJoined):
                log.info("device %s joined (epoch %d%s)", cmd.device_id, cmd.epoch,
                         ", rejoin" if cmd.rejoin else "")
                self.controller.device_joined(cmd.device_id)
                self._dirty = True

    def _tick(self, now: float) -> None:
        self._handle_registry(self.registry.tick(now), now)
        if self._dirty or now - self._last_reconcile >= self.config.reconcile_interval_s \
                or self.controller.next_deadline() <= now:
            self._reconcile(now)
        if self.router.next_deadline() <= now:
            self._router_cmds(self.router.tick(now, self._chains_of(), time.time()))
        if now - self._last_summary >= self.config.summary_interval_s:
            self._last_summary = now
            self._publish_summary()
            self._refresh_status(now)

    def _reconcile(self, now: float) -> None:
        self._dirty = False
        self._last_reconcile = now
        reported = self.registry.reported()
        fleet = self.registry.fleet(self.controller.reserved(reported))
        was_ready = self.controller.ready
        cmds = self.controller.reconcile(fleet, reported, now)
        if self.controller.ready and not was_ready:
            phases = Counter(a.phase.value for a in self.controller.assignments.values())
            log.info("ready after %.2f s: heard %d devices; assignments %s", now - self._started_mono,
                     len(reported), dict(phases))
            log.debug("reported at ready: %s", {d: [(p.workload, p.version, p.replica, p.index, p.health)
                                                     for p in ps] for d, ps in reported.items()})
        self._execute(cmds)

    def _chains_of(self) -> dict[str, Any]:
        return {w: self.controller.chains(w) for w in self.router.workloads_in_flight()}

    # ------------------------------------------------------------ commands

    def _publish_signed(self, topic: str, msg: Any) -> None:
        with self._sign_lock:  # one (epoch, seq) sequence shared by the owner and the builder
            self.mqtt.publish(topic, self.signer.seal_bytes(msg, time.time()))

    def _execute(self, cmds: list[Any]) -> None:
        persist: set[str] = set()
        for cmd in cmds:
            if isinstance(cmd, DeployPartition):
                self._deploy(cmd)
            elif isinstance(cmd, UndeployPartition):
                self.counters["undeploys_sent"] += 1
                self._publish_signed(self.topics.device(cmd.device, "CMD"),
                                     Undeploy(cmd.command_id, cmd.workload, cmd.version, cmd.replica, cmd.index))
            elif isinstance(cmd, Persist):
                persist.add(cmd.workload)
        for name in persist:
            self._persist(name)

    def _deploy(self, cmd: DeployPartition) -> None:
        """Owner thread: hand the deploy to the artifact thread (split + sign + publish)."""
        entry = self.controller.workloads.get(cmd.workload)
        if entry is None or entry.spec.model is None or entry.spec.profile is None:
            return
        memory = int(math.ceil(entry.spec.profile.memory_of(cmd.first, cmd.last)))
        self._builds.put((cmd, entry.spec.model, memory))

    def _build_loop(self) -> None:
        try:  # warm up: the first deploy after a failure should not wait for imports
            import models.cuts  # noqa: F401
            import models.partition  # noqa: F401
            import models.zoo  # noqa: F401
        except Exception:  # noqa: BLE001
            log.exception("models package failed to import; deploys will fail")
        while True:
            item = self._builds.get()
            if item is _STOP:
                return
            cmd, ref, memory = item
            try:
                self._build_and_send(cmd, ref, memory)
            except Exception as exc:  # noqa: BLE001 - a model we cannot split: NACK ourselves
                log.error("cannot build partition %s [%d, %d]: %s", cmd.workload, cmd.first, cmd.last, exc)
                self._put(("selfnack", cmd, f"artifact build failed: {exc}"[:300]))

    def _build_and_send(self, cmd: DeployPartition, ref: str, memory: int) -> None:
        key = (cmd.workload, cmd.version, cmd.replica, cmd.index)
        built = self.artifacts.build(ref, cmd.first, cmd.last)
        self._put(("built", key, built.sha256))
        sig = self.artifacts.sign(built, cmd.workload, cmd.version, cmd.replica, cmd.index)
        msg = Deploy(cmd.command_id, cmd.workload, cmd.version, cmd.replica, cmd.index, built.sha256,
                     built.onnx_bytes, sig.signature, sig.signer, memory, built.inputs, built.outputs,
                     {k: str(v) for k, v in sig.metadata.items()})
        self.counters["deploys_sent"] += 1
        log.info("deploy %s v%d r%d p%d [%d-%d] -> %s (attempt %d)", cmd.workload, cmd.version, cmd.replica,
                 cmd.index, cmd.first, cmd.last, cmd.device, cmd.attempt)
        self._publish_signed(self.topics.device(cmd.device, "CMD"), msg)

    def _persist(self, name: str) -> None:
        rows = [StoredAssignment(a.key[0], a.key[1], a.key[2], a.key[3], a.first, a.last, a.device, a.sha256)
                for a in self.controller.assignments_of(name)]
        self.store.replace_assignments(name, rows)

    def _router_cmds(self, cmds: list[Any]) -> None:
        for cmd in cmds:
            if isinstance(cmd, SendActivation):
                self.mqtt.publish(self.topics.device(cmd.device, "ACT"), codec.encode(cmd.activation))
            elif isinstance(cmd, ReplyClient):
                if not cmd.reply_to.startswith(self.topics.base + "/reply/") or "#" in cmd.reply_to \
                        or "+" in cmd.reply_to:
                    self.counters["rejected:reply_to"] += 1
                    continue
                self.mqtt.publish(cmd.reply_to, codec.encode(cmd.result))

    # ------------------------------------------------------------ data plane and control

    def _handle_other(self, topic: str, msg: Any, at: float) -> None:
        if topic == self.topics.infer():
            if not isinstance(msg, InferenceRequest):
                self.counters["rejected:wrong kind"] += 1
                return
            entry = self.controller.workloads.get(msg.workload)
            why = ""
            if entry is None:
                why = "unknown workload"
            elif entry.reasons:
                why = "; ".join(f"{k}: {v}" for k, v in entry.reasons.items())
            elif entry.status != "running":
                why = f"status {entry.status}"
            self._router_cmds(self.router.submit(msg, self.controller.chains(msg.workload), at, time.time(), why))
        elif topic == self.topics.reply(self.config.fog_id):
            if isinstance(msg, InferenceResult) and msg.request_id == _PING:
                self._subscribed.set()
            elif isinstance(msg, InferenceResult):
                self._router_cmds(self.router.result(msg, self.controller.chains(
                    self._workload_of(msg.request_id)), at, time.time()))
        elif topic == self.topics.control():
            self._control(msg, at)
        elif topic == self.topics.release():
            self._release(msg, at)

    def _release(self, msg: Any, at: float) -> None:
        """A signed new model version from the coordinator: keep it, roll workloads that follow it.

        A workload follows a release by naming ``model: "release:NAME"``; each newer
        release of NAME becomes a new version of that workload (gang re-placement).
        """
        if not isinstance(msg, ModelRelease):
            self.counters["rejected:wrong kind"] += 1
            return
        pinned = self.coordinators_trust.key_bytes(msg.signer)
        try:
            key = pinned if pinned is not None else bytes.fromhex(msg.metadata.get("public_key", ""))
            verify_artifact(key, msg.artifact, ArtifactSignature(msg.sha256, msg.signer, msg.signature,
                                                                 dict(msg.metadata)))
        except (ValueError, SecurityError) as exc:
            self.counters["rejected:release"] += 1
            log.warning("model release %s v%s refused: %s", msg.workload[:64], msg.version, exc)
            return
        if pinned is None:
            self.coordinators_trust.enroll(msg.signer, key)
            log.info("enrolled coordinator %s", msg.signer)
        known = self.releases.get(msg.workload)
        if known is not None and known["version"] >= msg.version:
            self.counters["release:stale"] += 1
            return
        ref = self.artifacts.store_blob(msg.artifact)
        self.releases[msg.workload] = {"version": msg.version, "model": ref, "signer": msg.signer,
                                       "metadata": {k: v for k, v in msg.metadata.items() if k != "public_key"}}
        tmp = self._releases_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.releases, indent=1))
        tmp.replace(self._releases_path)
        self.counters["releases"] += 1
        log.info("model release %s v%d accepted (%s)", msg.workload, msg.version, ref[:17])
        followers = [sw.spec for sw in self.store.workloads() if sw.spec.get("model") == f"release:{msg.workload}"]
        if followers:
            self._control_deploy({"workloads": followers}, at)

    def _workload_of(self, attempt_id: str) -> str:
        p = self.router._pending.get(attempt_id)  # noqa: SLF001 - same package, owner thread
        return p.request.workload if p is not None else ""

    def _control(self, msg: Any, at: float) -> None:
        signed_by = ""
        if isinstance(msg, Envelope):
            wall = time.time()
            if msg.sender not in self.operators_trust:
                if self.config.strict_operators:
                    self.counters["rejected:operator"] += 1
                    log.warning("control request from unknown operator %s refused", msg.sender[:64])
                    return
                inner = codec.decode(msg.payload)
                key = getattr(inner, "body", b"")
                try:
                    pub = bytes.fromhex(json.loads(key or b"{}").get("operator_key", ""))
                    Verifier(TrustStore({msg.sender: pub})).check(msg, wall)
                except (ValueError, SecurityError, AttributeError) as exc:
                    self.counters["rejected:operator"] += 1
                    log.warning("control request from %s refused: %s", msg.sender[:64], exc)
                    return
                self.operators_trust.enroll(msg.sender, pub)
                log.info("enrolled operator %s", msg.sender)
            try:
                inner = self.op_verifier.check(msg, wall)
            except SecurityError as exc:
                self.counters[f"rejected:{exc.reason}"] += 1
                log.warning("control envelope refused: %s", exc)
                return
            msg, signed_by = inner, msg.sender
        if not isinstance(msg, ControlRequest):
            self.counters["rejected:wrong kind"] += 1
            return
        if not msg.reply_to.startswith(self.topics.base + "/reply/"):
            self.counters["rejected:reply_to"] += 1
            return
        try:
            if msg.action == "status":
                body: Any = self.status(at)
            elif not signed_by:
                raise RemoteViolation(f"action {msg.action!r} needs a signed request (operator key)")
            elif msg.action == "deploy":
                body = self._control_deploy(json.loads(msg.body or b"{}"), at)
            elif msg.action == "delete":
                body = self._control_delete(json.loads(msg.body or b"{}"))
            else:
                raise RemoteViolation(f"unknown action {msg.action!r}: status, deploy, delete")
            reply = ControlReply(msg.request_id, True, json.dumps(body, default=_json_default).encode())
        except (RemoteViolation, ValueError, KeyError, TypeError) as exc:
            reply = ControlReply(msg.request_id, False, b"", str(exc)[:2000])
        self.mqtt.publish(msg.reply_to, codec.encode(reply))

    def _workload_from(self, d: Mapping[str, Any], profile: Mapping[str, Any] | None) -> Workload:
        d = dict(d)
        model = d.get("model")
        if isinstance(model, str) and model.startswith("release:"):
            rel = self.releases.get(model[len("release:"):])
            if rel is None:
                raise RemoteViolation(f"no release of {model[8:]!r} has reached this fog broker yet")
            d["model"] = rel["model"]
            profile = None  # the stored profile may be of an older release: profile the current one
        w = Workload.from_dict(d)
        if w.model is not None and profile is None:
            profile = self.artifacts.profile(w.model)
        if profile is not None and w.profile is None:
            from .placement.model import ChainProfile
            w = Workload(**{**{f: getattr(w, f) for f in w.__dataclass_fields__},
                            "profile": ChainProfile.from_dict(dict(profile))})
        return w

    def _control_deploy(self, body: Mapping[str, Any], at: float) -> dict[str, Any]:
        blobs = body.get("blobs") or {}
        for sha, b64 in blobs.items():
            ref = self.artifacts.store_blob(base64.b64decode(b64))
            if ref != f"file:{sha}":
                raise RemoteViolation(f"uploaded model does not hash to {sha[:12]}")
        items = body.get("workloads")
        if items is None:
            items = [body.get("workload", body)]
        if not isinstance(items, list) or not items:
            raise SpecError("deploy needs a workload or {'workloads': [...]}")
        parsed = []
        for d in items:
            if not isinstance(d, dict):
                raise SpecError("each workload must be an object")
            if "model" not in d:
                raise SpecError(f"workload {d.get('name')!r}: the fog broker needs 'model' (zoo:NAME or "
                                "an ONNX file) to build partitions")
            w = self._workload_from(d, None)
            assert w.profile is not None
            parsed.append((d, w))
        quotas = body.get("quotas") or {}
        qs = {str(t): Quota.from_dict(q, f"quotas.{t}") for t, q in quotas.items()}
        out = []
        for d, w in parsed:
            version = self.store.put_workload(d, w.profile.to_dict() if w.profile else None, time.time())
            self._execute(self.controller.set_workload(w, version))
            out.append({"name": w.name, "version": version, "segments": len(w.profile.segments) if w.profile else 0})
        if qs:
            self.store.put_quotas({t: q.memory_bytes for t, q in qs.items()})
            self.controller.set_quotas({t: Quota(m) for t, m in self.store.quotas().items()})
        self._dirty = True
        return {"deployed": out}

    def _control_delete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        name = str(body.get("name", ""))
        if name not in self.controller.workloads:
            raise RemoteViolation(f"no workload named {name!r}")
        self._execute(self.controller.remove_workload(name))
        self.store.delete_workload(name)
        return {"deleted": name}

    # ------------------------------------------------------------ status and summary

    def _publish_summary(self) -> None:
        summary = FleetSummary(self.config.fog_id, self.config.site, time.time(), self.registry.summaries())
        self.mqtt.publish(self.topics.summary(), codec.encode(summary), retain=True)

    def status(self, now: float | None = None) -> dict[str, Any]:
        """Everything ``fogline status`` shows (owner thread)."""
        now = time.monotonic() if now is None else now
        devices = []
        for did in sorted(self.registry.devices):
            rec = self.registry.devices[did]
            b, st = rec.birth, rec.state
            devices.append({
                "id": did, "alive": rec.alive, "status": rec.status.value, "epoch": rec.epoch,
                "last_seen_s": round(now - rec.last_seen, 3) if math.isfinite(rec.last_seen) else None,
                "lost_reason": rec.lost_reason or None,
                "labels": dict(b.labels) if b else {},
                "taints": [f"{t.key}={t.value}:{t.effect}" for t in b.taints] if b else [],
                "memory_bytes": b.memory_bytes if b else None,
                "free_memory_bytes": st.free_memory_bytes if st else None,
                "battery_level": st.battery_level if st else None,
                "charging": st.charging if st else None,
                "partitions": [f"{p.workload}/v{p.version}/r{p.replica}/p{p.index}:{p.health}"
                               for p in rec.partitions()],
            })
        workloads = []
        for name in sorted(self.controller.workloads):
            e = self.controller.workloads[name]
            assigned = self.controller.assignments_of(name)
            reps: dict[int, list[dict[str, Any]]] = {}
            for a in assigned:
                reps.setdefault(a.replica, []).append({
                    "index": a.index, "segments": [a.first, a.last], "device": a.device,
                    "phase": a.phase.value, "attempts": a.attempts, "reason": a.reason or None})
            costs = {i: r for i, r in enumerate(e.replicas)}
            workloads.append({
                "name": name, "version": e.version, "status": e.status, "tenant": e.spec.tenant,
                "priority": e.spec.priority, "replicas": e.spec.replicas,
                "healthy_replicas": len(self.controller.chains(name)),
                "model": e.spec.model,
                "segments": len(e.spec.profile.segments) if e.spec.profile else None,
                "placement": [{"replica": r, "partitions": parts,
                               "latency_s": costs[r].latency_s if r in costs else None,
                               "energy_j": costs[r].energy_j if r in costs else None}
                              for r, parts in sorted(reps.items())],
                "reasons": dict(e.reasons),
                "evicted": name in self.controller.evicted,
            })
        counts = self.registry.counts()
        return {
            "fog_id": self.config.fog_id, "site": self.config.site, "epoch": self.epoch,
            "uptime_s": round(now - self._started_mono, 3), "ready": self.controller.ready,
            "devices": devices, "workloads": workloads,
            "metrics": {**{k: round(v, 4) for k, v in self.controller.metrics.items()},
                        "devices_live": counts["live"], "devices_suspect": counts["suspect"],
                        "devices_dead": counts["dead"]},
            "quotas": {t: q.memory_bytes for t, q in self.controller.quotas.items()},
            "releases": {n: {**r["metadata"], "version": r["version"], "signer": r["signer"], "model": r["model"]}
                         for n, r in self.releases.items()},
            "counters": {**dict(self.counters), **dict(self.ingest_counts()), **{f"controller.{k}": v for k, v in self.controller.counters.items()},
                         **{f"router.{k}": v for k, v in self.router.counters.items()},
                         "registry.stale": self.registry.stale,
                         "verifier.accepted": self.verified(),
                         **{f"verifier.{k}": v for k, v in self.rejections().items()}},
            "recoveries_s": [round(x, 4) for x in self.controller.recoveries[-50:]],
        }

    def _trusted_names(self) -> list[str]:
        path = self.config.data_dir / "devices.json"
        return sorted(json.loads(path.read_text())) if path.exists() else []

    def verified(self) -> int:
        return sum(sh.verifier.accepted + sh.accepted for sh in self._shards)

    def rejections(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for sh in self._shards:
            total.update({k[len("rejected:"):]: v for k, v in sh.counters.items() if k.startswith("rejected:")})
        return total

    def ingest_counts(self) -> Counter[str]:
        """Per-shard counters summed (each shard counts alone: no lost updates between threads)."""
        total: Counter[str] = Counter()
        for sh in self._shards:
            total.update(sh.counters)
        return total

    def _refresh_status(self, now: float) -> None:
        st = self.status(now)
        with self._status_lock:
            self._status = st

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the owner thread and return its result (tests, benchmarks)."""
        box: list[tuple[str, Any]] = []
        self.inbox.put(("call", fn, box))
        deadline = time.monotonic() + timeout
        while not box:
            if time.monotonic() > deadline:
                raise TimeoutError("owner thread did not answer")
            time.sleep(0.005)
        kind, value = box[0]
        if kind == "error":
            raise value
        return value


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)
