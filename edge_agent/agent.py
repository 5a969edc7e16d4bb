"""The agent shell: MQTT wiring, connect epochs, fog STATE, signed commands, adverts.

Trust (docs/security.md): the fog's Ed25519 key is pinned before the agent
starts, from ``fog.json`` (written by enrolment) or ``cfg.fog_key``; it is
never learned from a message. ``fog/STATE`` and commands count only as
envelopes sealed by that key; the command replay window is persisted in the
data dir (a command replayed after a restart is refused), and so is the
highest fog epoch seen (an old fog STATE cannot be replayed either). The
Will and the orderly-stop DEATH are envelopes sealed by this device.

Everything sealed that the agent receives is opened by its ``InboundGate`` (``gate.py``).

Threads: paho's network thread (enqueues only), the MqttClient worker
(``InboundGate.on_activation`` charges each activation to the device its topic names, ``dev/{us}/ACT/{src}``,
which the broker lets only ``src`` write, then decodes it and hands it to the
executor; forwards everything else), the agent loop (sole owner of the advertiser, the verifier, the
cache and the epoch: it handles control messages and probes on a timer),
and the executor's workers (started on the first deploy).

Epochs: each MQTT connection has its own connect epoch (persisted in the
data dir, Sparkplug's bdSeq). The Will carries it, so the fog broker can
ignore a late Will of an older connection. paho reconnects by itself with
the Will it holds, so right after each connect the agent installs the Will
for the *next* connection (epoch + 1), and adopts that epoch when the
reconnect happens.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from runtime.errors import LocalViolation, SecurityError
from runtime.files import atomic_write
from runtime.messages import (
    CommandAck,
    Deploy,
    DeviceDeath,
    Message,
    Rebirth,
    Taint,
    Undeploy,
)
from runtime.mqtt import Inbound, MqttClient, TlsConfig, Will
from runtime.relay import Sealer
from runtime.security import (
    Identity,
    SessionKeyPair,
    Signer,
    TrustStore,
    Verifier,
    fingerprint,
    verify_session_offer,
)
from runtime.topics import ACK, BIRTH, CMD, DEATH, STATE, Topics

from .acks import watcher
from .advertiser import Advertiser, AdvertPolicy, Snapshot, build_birth
from .batching import BatchPolicy
from .cache import ArtifactCache
from .commands import LOAD_FAILED, check_deploy
from .credentials import FOG_EPOCH_FILE, NOT_ENROLLED, REPLAY_FILE, FogInfo, load_fog_info
from .executor import Executor, LoadError
from .gate import InboundGate
from .lane import DataLane, lane_budget
from .readings import Capabilities, Reading
from .stats import LinkEstimator

__all__ = ["AgentConfig", "Agent", "Probe", "AgentPhase", "KEY_FILE", "load_identity"]

log = logging.getLogger(__name__)

KEY_FILE = "agent.key"
EPOCH_FILE = "epoch"
STATUS_FILE = "status.json"
MiB = 1024 * 1024


class Probe(Protocol):
    def capabilities(self) -> Capabilities: ...

    def read(self, now: float, busy_s: float = 0.0) -> Reading: ...


class AgentPhase(enum.Enum):
    CONNECTING = "connecting"
    WAIT_FOG = "waiting for fog"
    ONLINE = "online"
    STOPPED = "stopped"


@dataclass
class AgentConfig:
    device_id: str
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 1883
    site: str = "default"
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    state_interval_s: float = 10.0
    probe_interval_s: float = 1.0
    keepalive: int = 5
    fog_key: bytes | None = None  # None: the one in data_dir/fog.json (enrolment); required either way
    tls: TlsConfig | None = None  # None: plain MQTT (--insecure, loopback test brokers only)
    intra_op_threads: int = 0  # 0: onnxruntime decides
    workers: int = 1
    queue_size: int = 64
    cache_bytes: int = 256 * MiB
    max_command_bytes: int = 16 * MiB
    max_artifact_bytes: int = 16 * MiB
    slowdown: float = 1.0  # simulated devices: stretch measured compute
    model_compute: bool = False  # simulated devices: runs take at least partition flops / device flops
    # Dynamic batching (issue 33, edge_agent.batching): 1 = off; queued frames of one partition
    # run as one batch of up to max_batch, waiting at most max_batch_wait_s (and never past a deadline)
    max_batch: int = 1
    max_batch_wait_s: float = 0.002
    sim_batch_slope: float = 1.0  # simulated devices: a batch of n costs one's time x (1 + slope (n - 1))
    status_file: bool = True
    # Opt-in: authenticate state adverts with a session MAC when the fog offers one (docs/protocol.md).
    state_mac: bool = False


def load_identity(data_dir: Path, name: str) -> Identity:
    """The device key in ``data_dir`` (created, mode 600, on first use)."""
    return Identity.load_or_create(name, Path(data_dir) / KEY_FILE)


def partition_flops(artifact: bytes) -> float | None:
    """FLOPs of one sample through a partition (models.profile), or None when it cannot tell."""
    try:
        import warnings

        from models.graph import load_model
        from models.probe import analyze
        from models.profile import profile_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = load_model(artifact)
            if any(d.dim_param for vi in model.graph.input
                   for d in list(vi.type.tensor_type.shape.dim)[1:]):
                return None  # sizes beyond the batch are open: the executor sizes a real request
            dims = {d.dim_param: 1 for vi in model.graph.input for d in vi.type.tensor_type.shape.dim
                    if d.dim_param}  # one sample; the executor scales by the batch it sees
            return float(profile_model(analyze(model, dims=dims)).flops) or None
    except Exception:
        log.debug("cannot profile partition", exc_info=True)
        return None


def _write_atomic(path: Path, text: str) -> None:
    atomic_write(path, text)


class Agent:
    def __init__(self, cfg: AgentConfig, probe: Probe) -> None:
        self.cfg = cfg
        self.probe = probe
        self.data_dir = Path(cfg.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.device_id = cfg.device_id
        self.identity = load_identity(self.data_dir, cfg.device_id)
        self.topics = Topics(cfg.site)
        self.link = LinkEstimator()
        # data-plane publishes wait for room in a byte budget so STATE adverts do not queue behind
        # seconds of activations on a slow uplink (issue 21); one lock keeps publish order = ack order
        self.lane = DataLane(lambda: lane_budget(self.link.uplink_bps))
        self._publish_lock = threading.Lock()
        self.counters: collections.Counter[str] = collections.Counter()
        self._count_lock = threading.Lock()
        self.fog_info: FogInfo | None = load_fog_info(self.data_dir)
        fog_key = cfg.fog_key if cfg.fog_key is not None else (self.fog_info.public_key if self.fog_info else None)
        if fog_key is None or len(fog_key) != 32:
            raise LocalViolation(NOT_ENROLLED.format(dir=self.data_dir))
        self.fog_key: bytes = fog_key
        self.trust = TrustStore()
        if self.fog_info is not None and self.fog_info.public_key == fog_key:
            self.trust.enroll(self.fog_info.fog_id, fog_key)  # known before any junk name can fill the store
        self.verifier = Verifier(self.trust, max_size=cfg.max_command_bytes,
                                 state_path=self.data_dir / REPLAY_FILE)
        self.cache = ArtifactCache(self.data_dir / "artifacts", cfg.cache_bytes)
        self.gate = InboundGate(cfg.device_id, fog_key, self.trust, self.verifier,
                                max_bytes=cfg.max_command_bytes, fog_name=self._fog_name, count=self._count,
                                submit=lambda m: self.executor.submit_sealed(m))
        self.executor = Executor(cfg.device_id, self.topics, self._publish_data, Sealer(self.identity),
                                 intra_op_threads=cfg.intra_op_threads, workers=cfg.workers,
                                 queue_size=cfg.queue_size, slowdown=cfg.slowdown,
                                 batch=BatchPolicy(cfg.max_batch, cfg.max_batch_wait_s),
                                 sim_batch_slope=cfg.sim_batch_slope)
        self.caps = probe.capabilities()
        if cfg.model_compute:
            self.executor.device_flops = self.caps.flops
        # Joules per request: measured on the board's rails where the probe has them, else modelled.
        self.executor.power_active_w = self.caps.power_active_w
        self.executor.measure_energy = getattr(probe, "measure_energy", None)
        if hasattr(probe, "reserved"):
            probe.reserved = self.executor.reserved_memory  # simulated memory accounting
        self.advertiser = Advertiser(cfg.device_id, AdvertPolicy(cfg.state_interval_s))
        self.phase = AgentPhase.CONNECTING
        self.epoch = self._bump_epoch()
        self._next_epoch: int | None = None
        self._connections = 0
        # Each connection's DEATH is sealed when its Will is set (seq 1 of that epoch); the
        # connection's signer continues from there, so no later message reuses the Will's seq.
        self.signer, self._death = self._sealed_death(self.epoch)
        self._next_signer: Signer | None = None
        self._next_death = b""
        self._fog_epoch_seen = self._load_fog_epoch()
        self._fog_session: bytes | None = None  # the fog run's X25519 key (signed offer, checked)
        self._state_key: bytes | None = None    # this connection's session MAC key, set by a birth
        self._session_pair: tuple[tuple[int, bytes], SessionKeyPair] | None = None
        self.fog_id: str | None = None
        self.fog_epoch: int | None = None
        self._wait_fog_since, self._wait_fog_retry = 0.0, 2.0
        self.births = 0
        self.states = 0
        self._last_status = ""
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.client = MqttClient(cfg.device_id, cfg.host, cfg.port, keepalive=cfg.keepalive, tls=cfg.tls,
                                 will=self._will(self._death), max_payload=max(cfg.max_command_bytes + 1024,
                                                                               16 * MiB))
        t = self.topics
        self.client.subscribe(t.fog_state(), self._enqueue)
        self.client.subscribe(t.rebirth(), self._enqueue)
        self.client.subscribe(t.device(cfg.device_id, CMD), self._enqueue)
        self.client.subscribe(t.activation(cfg.device_id, "+"), self.gate.on_activation, direct=True)
        self.executor.opener = self.gate.open_activation
        self.client.subscribe(t.time(), self._enqueue)
        self.client.on_connected.append(lambda: self._inbox.put(("connected", None)))
        self.client.on_connected.append(self.lane.reset)  # the old connection's acks may never come
        self._thread = threading.Thread(target=self._loop, name=f"agent-{cfg.device_id}", daemon=True)
        self._stopped = threading.Event()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> Agent:
        self._thread.start()
        self.client.start()
        return self

    def stop(self, *, crash: bool = False, timeout: float = 2.0) -> None:
        """Stop; ``crash=True`` drops the socket so the broker publishes the Will."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if crash:
            self.client.stop(disconnect=False)  # as kill -9 would: the socket goes first, the Will fires
        self._inbox.put(("stop", None))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout)
        if not crash and self.client.connected:
            # an orderly disconnect suppresses the Will, so say DEATH ourselves (Sparkplug does)
            handle = self.client.publish(self.topics.device(self.device_id, DEATH), self._death, qos=1)
            handle.wait(min(timeout, 1.0))
        self.client.stop(disconnect=not crash)
        self.lane.close()
        self.executor.stop()
        self.phase = AgentPhase.STOPPED
        self._write_status(force=True)

    def wait_online(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.phase is AgentPhase.ONLINE:
                return True
            time.sleep(0.01)
        return self.phase is AgentPhase.ONLINE

    # ------------------------------------------------------------ persisted state

    def _bump_epoch(self) -> int:
        path = self.data_dir / EPOCH_FILE
        try:
            last = int(path.read_text().strip())
        except (OSError, ValueError):
            last = 0
        epoch = last + 1
        _write_atomic(path, f"{epoch}\n")
        return epoch

    def _load_fog_epoch(self) -> int | None:
        try:
            return int((self.data_dir / FOG_EPOCH_FILE).read_text().strip())
        except (OSError, ValueError):
            return None

    def _sealed_death(self, epoch: int) -> tuple[Signer, bytes]:
        """The signer of connection ``epoch`` and its DEATH, sealed now (docs/security.md: old by design)."""
        signer = Signer(self.identity, epoch)
        return signer, signer.seal_bytes(DeviceDeath(self.device_id, epoch), time.time())

    def _will(self, death: bytes) -> Will:
        return Will(self.topics.device(self.device_id, DEATH), death, qos=1)

    # ------------------------------------------------------------ MQTT worker thread

    def _enqueue(self, m: Inbound) -> None:
        self._inbox.put(("msg", m))

    def _fog_name(self) -> str | None:
        return self.fog_info.fog_id if self.fog_info is not None else self.fog_id

    def _count(self, what: str) -> None:
        with self._count_lock:
            self.counters[what] += 1

    # ------------------------------------------------------------ agent loop

    def _loop(self) -> None:
        next_probe = time.monotonic()
        while True:
            now = time.monotonic()
            wake = min(next_probe, self.advertiser.next_due(now)) if self.phase is AgentPhase.ONLINE else next_probe
            try:
                kind, value = self._inbox.get(timeout=max(0.0, wake - now))
            except queue.Empty:
                kind, value = "tick", None
            if kind == "stop":
                return
            now = time.monotonic()
            try:
                if kind == "connected":
                    self._on_connected()
                elif kind == "msg":
                    self._dispatch(value, now)
                if now >= next_probe or now >= self.advertiser.next_due(now):
                    next_probe = now + self.cfg.probe_interval_s
                    self._observe(now)
                    self._ask_fog_state_again(now)
            except Exception:
                self._count("handler error")
                log.exception("%s: agent loop error on %s", self.device_id, kind)

    def _ask_fog_state_again(self, now: float) -> None:
        """Still no usable fog STATE a while after connecting: subscribe again for the retained copy.

        Right after enrolment the broker may not know our ACL entry yet and hides the retained
        STATE from our first subscription; later (non-retained) traffic would never repeat it.
        """
        if self.phase is not AgentPhase.WAIT_FOG or not self.client.connected:
            return
        if now - self._wait_fog_since >= self._wait_fog_retry:
            self._wait_fog_since = now
            self._wait_fog_retry = min(self._wait_fog_retry * 2, 60.0)
            self._count("fog state asked again")
            self.client.resubscribe(self.topics.fog_state())

    def _on_connected(self) -> None:
        if self._connections and self._next_epoch is not None and self._next_signer is not None:
            self.epoch = self._next_epoch  # the Will installed after the previous connect
            self.signer, self._death = self._next_signer, self._next_death
        self._state_key = None  # bound to the old epoch; the next birth keys the new connection
        self._connections += 1
        self._next_epoch = self._bump_epoch()
        self._next_signer, self._next_death = self._sealed_death(self._next_epoch)
        self.client.set_will(self._will(self._next_death))
        self.phase = AgentPhase.WAIT_FOG
        self._wait_fog_since, self._wait_fog_retry = time.monotonic(), 2.0
        log.info("%s: connected (epoch %d); waiting for the fog STATE", self.device_id, self.epoch)

    def _dispatch(self, m: Inbound, now: float) -> None:
        t = self.topics
        if m.topic == t.fog_state():
            self._on_fog_state(m, now)
        elif m.topic == t.time():
            if self.gate.time_hint(m.payload) and self.phase is AgentPhase.ONLINE:
                self._birth(now)  # a birth sealed with the wrong clock may have been refused
        elif m.topic == t.rebirth() or m.topic == t.device(self.device_id, CMD):
            msg = self.gate.open_command(m.payload)
            if msg is not None:
                self._on_command(msg, now, m.topic == t.rebirth())

    def _on_fog_state(self, m: Inbound, now: float) -> None:
        """A sealed FogState: online for an epoch >= the last seen, offline only for the current one."""
        fs = self.gate.open_fog_state(m.payload)
        if fs is None:
            return
        if fs.site != self.cfg.site:
            self._count("fog state of another site")
            return
        if fs.public_key and fs.public_key != self.fog_key:
            self._count("fog key mismatch")  # sealed by the pinned key but naming another: a fog bug
            log.error("%s: fog %s names a key that differs from the pinned one; ignoring it", self.device_id,
                      fs.fog_id)
            return
        seen = self._fog_epoch_seen
        if not fs.online:
            if fs.epoch != seen:  # an old run's Will (or a replay of it) cannot park the device
                self._count("stale fog state")
                return
            if self.phase is AgentPhase.ONLINE:
                log.info("%s: fog %s went offline", self.device_id, fs.fog_id)
                self.phase = AgentPhase.WAIT_FOG
            return
        if seen is not None and fs.epoch < seen:
            self._count("stale fog state")
            log.warning("%s: fog STATE of epoch %d is older than epoch %d; ignoring it", self.device_id,
                        fs.epoch, seen)
            return
        if seen != fs.epoch:
            self._fog_epoch_seen = fs.epoch
            _write_atomic(self.data_dir / FOG_EPOCH_FILE, f"{fs.epoch}\n")
        self.fog_id = fs.fog_id
        offer = None
        if self.cfg.state_mac and fs.session_key:
            if verify_session_offer(self.fog_key, fs.session_sig, fs.fog_id, fs.site, fs.epoch, fs.session_key):
                offer = fs.session_key
            else:
                self._count("bad fog session offer")
                log.warning("%s: fog %s session key offer has a bad signature; signing states", self.device_id,
                            fs.fog_id)
        if offer != self._fog_session:
            self._fog_session, self._state_key = offer, None
        if self.phase is not AgentPhase.ONLINE or fs.epoch != self.fog_epoch:
            self.fog_epoch = fs.epoch
            self._birth(now)

    def _on_command(self, msg: Message, now: float, broadcast: bool) -> None:
        if isinstance(msg, Rebirth):
            if msg.device_id in ("", self.device_id):
                self._count("rebirth")
                if self.phase is AgentPhase.ONLINE:  # while the fog is offline, its return triggers the birth
                    self._birth(now)
            return
        if broadcast:
            self._count("unexpected broadcast command")
            return
        if isinstance(msg, Deploy):
            self._deploy(msg, now)
        elif isinstance(msg, Undeploy):
            self._undeploy(msg, now)
        else:
            self._count("unexpected command")
            log.warning("%s: unexpected command %s", self.device_id, msg.KIND)

    # ------------------------------------------------------------ commands

    def free_for_partitions(self, reading: Reading) -> int:
        return max(0, min(reading.free_memory_bytes, self.caps.memory_bytes - self.executor.reserved_memory()))

    def _deploy(self, d: Deploy, now: float) -> None:
        key = (d.workload, d.version, d.replica, d.index)
        existing = self.executor.get(key)
        if existing is not None and existing.sha256 == d.sha256:
            self._ack(d.command_id, True, "already running")
            return
        artifact = d.artifact or self.cache.get(d.sha256)
        free = self.free_for_partitions(self.probe.read(now, self.executor.busy_s))
        if existing is not None:
            free += existing.memory_bytes
        verdict = check_deploy(d, artifact, fog_key=self.fog_key, free_memory_bytes=free,
                               max_artifact_bytes=self.cfg.max_artifact_bytes)
        if not verdict.ok or artifact is None:
            self._count(f"nack: {verdict.reason}")
            log.warning("%s: deploy %s refused: %s", self.device_id, d.command_id, verdict.message)
            self._ack(d.command_id, False, verdict.message)
            return
        if not self.cache.put(d.sha256, artifact):
            log.warning("%s: artifact %s not cached (cache full of running partitions)", self.device_id,
                        d.sha256[:12])
        flops = partition_flops(artifact) if self.executor.device_flops else None
        try:
            self.executor.load(key, d.sha256, artifact, d.memory_bytes, flops)
        except LoadError as exc:
            self._count(f"nack: {LOAD_FAILED}")
            self._ack(d.command_id, False, f"{LOAD_FAILED}: {exc}")
            return
        self.cache.pin(d.sha256)
        if existing is not None:
            self.cache.unpin(existing.sha256)
        self._count("deployed")
        log.info("%s: running %s v%d r%d #%d", self.device_id, *key)
        self._ack(d.command_id, True)
        self._observe(now)

    def _undeploy(self, u: Undeploy, now: float) -> None:
        part = self.executor.unload((u.workload, u.version, u.replica, u.index))
        if part is not None:
            self.cache.unpin(part.sha256)
            self._count("undeployed")
        self._ack(u.command_id, True, "" if part is not None else "not deployed")
        self._observe(now)

    def _ack(self, command_id: str, ok: bool, reason: str = "") -> None:
        self._publish_signed(ACK, CommandAck(command_id, self.device_id, ok, reason[:300]))

    # ------------------------------------------------------------ adverts

    def _birth(self, now: float) -> None:
        birth = build_birth(self.device_id, self.cfg.site, self.caps, self.identity.public_key_bytes,
                            epoch=self.epoch, seq=self.signer.seq + 1, labels=self.cfg.labels,
                            taints=self.cfg.taints, state_interval_s=self.cfg.state_interval_s)
        key = None
        if self._fog_session is not None:  # offer a session: one X25519 key per (connection, fog run)
            # A rebirth on the same connection re-offers the same key, so the session key does not
            # change under state adverts still in flight (QoS 0 states may overtake a QoS 1 birth).
            if self._session_pair is None or self._session_pair[0] != (self.epoch, self._fog_session):
                self._session_pair = ((self.epoch, self._fog_session), SessionKeyPair())
            pair = self._session_pair[1]
            try:
                key = pair.derive(self._fog_session, self.device_id, self.epoch, pair.public_bytes,
                                  self._fog_session)
                birth = dataclasses.replace(birth, session_key=pair.public_bytes,
                                            fog_session_key=self._fog_session)
            except SecurityError as exc:
                self._count("bad fog session key")
                log.warning("%s: fog session key unusable (%s); signing states", self.device_id, exc)
        self._publish_signed(BIRTH, birth)
        self._state_key = key
        self.births += 1
        self.phase = AgentPhase.ONLINE
        self.advertiser.reset()
        log.info("%s: birth published (epoch %d, fog %s)", self.device_id, self.epoch, self.fog_id)
        self._observe(now)

    def _observe(self, now: float) -> None:
        reading = self.probe.read(now, self.executor.busy_s)
        if self.phase is AgentPhase.ONLINE:
            snap = Snapshot(reading, self.executor.statuses(), self.link.uplink_bps, self.link.rtt_s)
            reason = self.advertiser.tick(snap, now)
            if reason is not None:
                state = self.advertiser.state(snap, self.epoch, self.signer.seq + 1)
                if self.gate.measured_skew is not None:
                    state = dataclasses.replace(state, clock_skew_s=round(self.gate.measured_skew, 3))
                if self._state_key is not None:  # session MAC (the birth that keyed it was signed)
                    self._publish(self.topics.device(self.device_id, STATE),
                                  self.signer.seal_mac_bytes(state, self.gate.wall(), self._state_key))
                else:
                    self._publish_signed(STATE, state)
                self.states += 1
                log.debug("%s: state (%s)", self.device_id, reason)
        self._write_status()

    # ------------------------------------------------------------ publishing

    def _publish_signed(self, leaf: str, msg: Message) -> None:
        self._publish(self.topics.device(self.device_id, leaf), self.signer.seal_bytes(msg, self.gate.wall()))

    def _publish(self, topic: str, payload: bytes,
                 on_done: Callable[[bool], None] | None = None) -> bool:
        """Publish at QoS1 and time the ack; False when offline (then ``on_done`` never runs)."""
        with self._publish_lock:  # the ack watcher sees publishes in send order
            sent = time.monotonic()
            handle = self.client.publish(topic, payload, qos=1)
            if not self.client.connected:
                return False
            watcher().track(handle, len(payload), sent, self.link, on_done)
            return True

    def _publish_data(self, topic: str, payload: bytes) -> None:
        """A data-plane publish (forwarded activation, result): waits for room in the lane."""
        ticket = self.lane.acquire(len(payload))
        if not self._publish(topic, payload,
                             lambda acked: self.lane.release(ticket, given_up=not acked)):
            self.lane.release(ticket)

    # ------------------------------------------------------------ introspection

    def status(self) -> dict[str, Any]:
        ex = self.executor
        mc = self.client.counters
        return {
            "device_id": self.device_id, "site": self.cfg.site, "phase": self.phase.value,
            "epoch": self.epoch, "fog_id": self.fog_id, "fog_epoch": self.fog_epoch,
            "fog_key": fingerprint(self.fog_key), "tls": self.cfg.tls is not None,
            "births": self.births, "states": self.states, "pid": os.getpid(),
            "counters": dict(sorted(self.counters.items())),
            "verifier": {"accepted": self.verifier.accepted, "rejected": dict(self.verifier.rejected)},
            "executor": {"forwarded": ex.forwarded, "answered": ex.answered, "errors_replied": ex.errors_replied,
                         "rejected_overload": ex.rejected_overload, "undeliverable": ex.undeliverable,
                         "providers": list(ex.providers)},
            "partitions": [{"workload": p.workload, "version": p.version, "replica": p.replica, "index": p.index,
                            "health": p.health, "served": p.served, "errors": p.errors,
                            "p50_s": p.p50_s, "p99_s": p.p99_s, "calib_s": p.calib_s,
                            "joules_per_inference": p.joules_per_inference,
                            "energy_measured": p.energy_measured} for p in ex.statuses()],
            "link": {"uplink_bps": self.link.uplink_bps, "rtt_s": self.link.rtt_s},
            "lane": self.lane.status(),
            "mqtt": {"received": mc.received, "dropped_oversized": mc.dropped_oversized,
                     "dropped_overflow": mc.dropped_overflow, "connects": mc.connects,
                     "last_error": self.client.last_error},
            "cache": {"bytes": self.cache.total_bytes, "hits": self.cache.hits, "evictions": self.cache.evictions},
        }

    def _write_status(self, force: bool = False) -> None:
        if not self.cfg.status_file:
            return
        text = json.dumps(self.status(), indent=1, sort_keys=True)
        if text != self._last_status or force:
            self._last_status = text
            try:
                _write_atomic(self.data_dir / STATUS_FILE, text)
            except OSError:
                log.debug("cannot write status file", exc_info=True)
