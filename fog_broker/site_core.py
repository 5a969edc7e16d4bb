"""One site's decisions as one pure object: events in, commands out (the h11 style).

``SiteCore`` composes the fog's pure cores — the registry (who is alive), the
controller (what runs where), the router (requests in flight), the calibration
book (measured segment times) and the rebirth budget — and owns the glue
between them that used to live in the process shell: a lost device is re-placed
at once and its requests fail over, a join or a changed partition set marks the
plan dirty, a state that carries load timings updates the workload's costs, and a
stage whose measured time stays far above the plan's sets its device aside so the
stage is re-placed (``slow_stages``).

The fog broker's ``FogService`` feeds it verified events from MQTT, HTTP and its
timers and carries out what it returns; the discrete-event simulation drives the
very same object, so the two cannot drift. ``snapshot(now)`` is what status,
metrics, the HTTP API, control and the site page read (``fog_broker.snapshot``):
a frozen value, built on the thread that drives the core, safe on any other.
Releases a fog accepted are kept here too, with the rule that switches the
workloads following them. Nothing here does I/O or reads a clock.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from runtime.messages import (
    Activation,
    DeviceState,
    InferenceRequest,
    InferenceResult,
    PartitionStatus,
)

from .autoscale import AutoscaleConfig, Autoscaler, Load, replicas_for_rate
from .calibration import CalibrationBook, throughput
from .claim_check import ClaimCheck, ClaimCheckConfig
from .controller import (
    Assignment,
    Controller,
    ControllerConfig,
    DeployPartition,
    PartKey,
    Persist,
    ScheduleFn,
    UndeployPartition,
)
from .placement.model import Fleet, Quota, Workload
from .ratelimit import RateLimit
from .registry import (
    DeviceJoined,
    DeviceLost,
    Registry,
    RegistryConfig,
    RequestRebirth,
    ThrottleChanged,
)
from .router import ReplyClient, Router, RouterConfig, SendActivation
from .slow_stages import SlowStageConfig, SlowStages, StageSample, planned_stage_s
from .snapshot import SiteSnapshot, build, counter_copy, freeze

__all__ = [
    "SiteCoreConfig", "SiteCore", "SiteSnapshot",
    # events
    "Advert", "AdvertRejected", "ClaimFlags", "Ack", "Built", "BuildFailed", "SessionMissing", "DeviceRemoved",
    "SetWorkload", "RemoveWorkload", "SetQuotas", "Infer", "Result", "RouteUntrusted", "Restore",
    "WiresMeasured", "ReleaseAccepted", "OwnerPaused", "Event", "Command",
    # commands (the controller's and the router's are re-exported as they are)
    "AskRebirth", "SiteEvent", "LogNote", "FollowRelease", "DeployPartition", "UndeployPartition", "Persist",
    "SendActivation", "ReplyClient",
]


# ------------------------------------------------------------------ events (in)

@dataclass(frozen=True, slots=True)
class Advert:
    """A verified birth, state or death of an enrolled device."""
    msg: Any


@dataclass(frozen=True, slots=True)
class AdvertRejected:
    """An enrolled device's authenticated advert failed validation: ``field`` (``DeviceBirth.rtt_s``)
    had ``value`` (as the device sent it), outside the message's range."""
    device_id: str
    field: str
    value: str

    @property
    def text(self) -> str:
        """``DeviceBirth.rtt_s=-1.0``: the device record's ``rejected``, the site event's reason."""
        return f"{self.field}={self.value}"


@dataclass(frozen=True, slots=True)
class ClaimFlags:
    """The fog's clamp flags for the birth about to be handled (empty: a clean birth)."""
    device_id: str
    flags: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Ack:
    device_id: str
    command_id: str
    ok: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Built:
    """The artifact of a deploy was built: its hash is what the device must report."""
    key: PartKey
    sha256: str


@dataclass(frozen=True, slots=True)
class BuildFailed:
    """The fog could not build a deploy's artifact: a NACK of its own."""
    cmd: DeployPartition
    reason: str


@dataclass(frozen=True, slots=True)
class SessionMissing:
    """A device's state could not be opened (no session for this epoch): ask it to be born again."""
    device_id: str


@dataclass(frozen=True, slots=True)
class DeviceRemoved:
    """The device is no longer trusted (revoked or re-keyed)."""
    device_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class SetWorkload:
    """Deploy (or re-deploy) a workload; ``follows``: the release it runs (``release:NAME``), if any."""
    spec: Workload
    version: int
    follows: str = ""


@dataclass(frozen=True, slots=True)
class RemoveWorkload:
    name: str


@dataclass(frozen=True, slots=True)
class SetQuotas:
    quotas: Mapping[str, Quota]


@dataclass(frozen=True, slots=True)
class Infer:
    """An authenticated inference request; ``wall`` is the fog's wall clock for the route's deadline."""
    request: InferenceRequest
    wall: float


@dataclass(frozen=True, slots=True)
class Result:
    """A hop's verified answer; ``sender`` is the device that sealed it."""
    result: InferenceResult
    sender: str
    wall: float


@dataclass(frozen=True, slots=True)
class RouteUntrusted:
    """An activation could not be sent: a device of its route is no longer trusted."""
    activation: Activation
    wall: float


@dataclass(frozen=True, slots=True)
class OwnerPaused:
    """The shell's owner thread did not look at the inbox for ``seconds`` (a long step, a starved
    process): silence from devices over that time is the fog's own, not theirs, so liveness
    deadlines move by it instead of a busy fog declaring healthy devices lost and re-placing them
    (it did, 130 ms after a device's rejoin, when a restarted fog's loop stalled for 4 s)."""
    seconds: float


@dataclass(frozen=True, slots=True)
class ReleaseAccepted:
    """A model release passed the shell's checks (pinned signer, signature, newer) and its bytes are
    stored as ``ref``."""
    name: str
    version: int
    ref: str
    signer: str
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Restore:
    """A restart: the stored workloads (spec, version, release followed), quotas and assignments.

    Stored assignments are adopted unconfirmed; placing waits ``startup_wait_s`` for the devices."""
    workloads: tuple[tuple[Workload, int, str], ...]
    quotas: Mapping[str, Quota]
    assignments: tuple[Assignment, ...]
    startup_wait_s: float
    releases: tuple[ReleaseAccepted, ...] = ()


@dataclass(frozen=True, slots=True)
class WiresMeasured:
    """The fog calibrated the activation wires of one chain (``fog_broker.wires``)."""
    chain: tuple[str, int, int]          # (workload, version, replica)
    wires: tuple[str, ...]
    report: Mapping[str, Any]


Event = (Advert | AdvertRejected | ClaimFlags | Ack | Built | BuildFailed | SessionMissing | DeviceRemoved
         | SetWorkload | RemoveWorkload | SetQuotas | Infer | Result | RouteUntrusted | Restore | WiresMeasured
         | ReleaseAccepted | OwnerPaused)


# ------------------------------------------------------------------ commands (out)

@dataclass(frozen=True, slots=True)
class AskRebirth:
    """Publish a Rebirth to one device (already within the rebirth budget)."""
    device_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class LogNote:
    """A line for the operator's log only (not the site's event list)."""
    text: str
    level: str = "warning"


@dataclass(frozen=True, slots=True)
class SiteEvent:
    """Something a person watching the site wants to see (device lost / back, partition recovered)."""
    kind: str
    device: str
    reason: str


@dataclass(frozen=True, slots=True)
class FollowRelease:
    """Re-deploy these workloads: each follows ``release`` and it has a new version (the shell resolves
    the bytes and profiles them; a simulation switches the model ref)."""
    release: str
    version: int
    ref: str
    workloads: tuple[str, ...]


Command = (AskRebirth | SiteEvent | LogNote | FollowRelease | DeployPartition | UndeployPartition | Persist
           | SendActivation | ReplyClient)


@dataclass(frozen=True, slots=True)
class SiteCoreConfig:
    state_interval_s: float = 10.0       # the default until a birth says otherwise
    battery_floor: float = 0.3
    reconcile_interval_s: float = 0.5
    max_rebirths_per_s: float = 200.0    # all devices together: a flood cannot make the fog a flood
    reply_topic: str = ""                # the fog's own reply topic (the router's hop answers)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    slow_stages: SlowStageConfig = field(default_factory=SlowStageConfig)
    claims: ClaimCheckConfig = field(default_factory=ClaimCheckConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    max_rate_replicas: int = 16          # a ``rate_fps`` without ``autoscale`` asks for at most this many


class SiteCore:
    """Registry, controller, router and calibration of one site, and the rules between them."""

    def __init__(self, schedule: ScheduleFn, config: SiteCoreConfig | None = None, *,
                 command_prefix: str = "c") -> None:
        self.config = c = config or SiteCoreConfig()
        self.registry = Registry(RegistryConfig(default_interval_s=c.state_interval_s,
                                                battery_floor=c.battery_floor))
        self.controller = Controller(schedule, c.controller, command_prefix=command_prefix)
        self.router = Router(c.reply_topic, c.router)
        self.autoscaler = Autoscaler(c.autoscale)
        self._next_autoscale = -math.inf
        self.calibration = CalibrationBook()
        self.slow_stages = SlowStages(c.slow_stages)  # devices set aside for a stage slower than the plan
        self.claims = ClaimCheck(c.claims)  # devices' reported timings against the router's round trips
        self.counters: Counter[str] = Counter()
        self.flags: dict[str, tuple[str, ...]] = {}  # device -> implausible claims in its birth
        self._rebirths = RateLimit(c.max_rebirths_per_s, c.max_rebirths_per_s)
        self._partitions_seen: dict[str, tuple[Any, ...]] = {}
        self._recoveries_seen = 0
        self._last_reconcile = -math.inf
        self._wall_offset = 0.0  # wall minus monotonic, as the last tick saw it
        self.dirty = True
        # releases accepted: name -> {version, model, signer, metadata}; workload -> release it follows
        self.releases: dict[str, dict[str, Any]] = {}
        self.follows: dict[str, str] = {}
        self.generation = 0  # events and ticks handled: a snapshot of an older one is stale
        self._snapshot: SiteSnapshot | None = None

    # ------------------------------------------------------------ the interface

    def snapshot(self, now: float, max_age_s: float = 0.0) -> SiteSnapshot:
        """The site as a frozen value (call it on the thread that drives the core). Rebuilt when an
        event or a tick came since the last one, unless that one is at most ``max_age_s`` old."""
        snap = self._snapshot
        if snap is None or (snap.generation != self.generation and now - snap.at > max_age_s):
            releases = {n: {**r["metadata"], "version": r["version"], "signer": r["signer"], "model": r["model"]}
                        for n, r in self.releases.items()}
            snap = self._snapshot = build(self, now, self.generation, releases)
        else:  # the shell counts here too, between events: its counters are always as of now
            counters = counter_copy(self.counters)
            if counters != snap.counters:
                snap = self._snapshot = replace(snap, counters=freeze(counters))
        return snap

    def mark_dirty(self) -> None:
        """Something outside the core changed what the plan depends on: re-plan at the next tick."""
        self.dirty = True

    def handle(self, event: Event, now: float, wall: float | None = None) -> list[Command]:
        """One event at monotonic time ``now`` (``wall``: the wall clock then, for the deadlines of
        requests that fail over; default: the offset the last ``tick`` saw); returns what the shell
        must carry out, in order."""
        out: list[Command] = []
        if wall is None:
            wall = now + self._wall_offset
        self.generation += 1
        match event:
            case Advert(msg):
                self._advert(msg, now, out, wall)
            case ClaimFlags(device_id, flags):
                self.flags[device_id] = tuple(flags)
                if self.registry.note_claim_flags(device_id, tuple(flags)):
                    self.controller.request_plan()  # a flagged device holds no first replica: move it
            case AdvertRejected(device_id):
                out.append(SiteEvent("advert rejected", device_id, event.text))
                self._registry(self.registry.reject(device_id, now, event.text), now, out, wall)
                self.dirty = True
            case Ack(device_id, command_id, ok, reason):
                out += self.controller.ack(command_id, device_id, ok, reason, now)
                if not ok:
                    out.append(LogNote(f"NACK from {device_id} for {command_id}: {reason}"))
                self.dirty = True
            case Built(key, sha256):
                self.controller.note_sha(key, sha256)
                out.append(Persist(key[0]))
            case BuildFailed(cmd, reason):
                out += self.controller.ack(cmd.command_id, cmd.device, False, reason, now)
                self.dirty = True
            case SessionMissing(device_id):
                self._registry(self.registry.ask_rebirth(device_id, now, "no session"), now, out, wall)
            case DeviceRemoved(device_id, reason):
                self.flags.pop(device_id, None)
                self._partitions_seen.pop(device_id, None)
                self.slow_stages.forget(device_id)
                self.claims.forget(device_id)
                self.calibration.forget_device(device_id)
                self._registry(self.registry.remove(device_id, now, reason), now, out, wall)
            case SetWorkload(spec, version, follows):
                out += self._set_workload(spec, version, follows)
            case RemoveWorkload(name):
                self.autoscaler.forget(name)
                out += self.controller.remove_workload(name)
                self.calibration.forget(name)
                self.claims.forget_workload(name)
                self.router.forget_workload(name)
                self.follows.pop(name, None)
                self.dirty = True
            case SetQuotas(quotas):
                self.controller.set_quotas(dict(quotas))
                self.dirty = True
            case Infer(request, req_wall):
                out += self._submit(request, now, req_wall)
            case Result(result, sender, res_wall):
                out += self._result(result, sender, now, res_wall)
            case RouteUntrusted(act, act_wall):
                out += self.router.result(
                    InferenceResult(act.request_id, False, {}, "a device of the route is no longer trusted"),
                    self.controller.chains(act.workload), now, act_wall)
            case Restore():
                out += self._restore(event, now)
            case WiresMeasured(chain, wires, report):
                self.router.set_wires(chain, wires, dict(report))
            case ReleaseAccepted():
                out += self._release(event)
            case OwnerPaused(seconds):
                self.registry.credit_pause(seconds)
        return out

    def tick(self, now: float, wall: float) -> list[Command]:
        """Timers: liveness, re-planning, request deadlines, and what recovered since the last tick."""
        out: list[Command] = []
        self.generation += 1
        self._wall_offset = wall - now
        rec = self.controller.recoveries  # appended by reconcile and by acks: look once a tick
        for took in rec[self._recoveries_seen:]:
            out.append(SiteEvent("recovered", "", f"a lost partition runs again {took * 1000:.0f} ms after its loss"))
        self._recoveries_seen = len(rec)
        for dev in self.slow_stages.tick(now):  # its hold ended: it may take partitions again
            out.append(SiteEvent("device usable again", dev, "set aside for a slow stage; the hold ended"))
            self.controller.device_joined(dev)
            self.dirty = True
        out += self.liveness(now, wall)
        if self.dirty or now - self._last_reconcile >= self.config.reconcile_interval_s \
                or self.controller.next_deadline() <= now:
            out += self.reconcile(now)
        if self.router.next_deadline() <= now:
            out += self.router.tick(now, self._chains_in_flight(), wall)
        if now >= self._next_autoscale:
            self._next_autoscale = now + self.config.autoscale.interval_s
            out += self.autoscale(now)
        return out

    def autoscale(self, now: float) -> list[Command]:
        """One autoscaling pass: each workload with ``autoscale`` or ``rate_fps`` gets the replica
        chains its measured load (or stated rate) needs, through the controller (``scale``)."""
        out: list[Command] = []
        for name, entry in self.controller.workloads.items():
            w = entry.spec
            if w.autoscale is None and w.rate_fps is None:
                continue
            chains = self.controller.chains(name)
            current = self.controller.wanted_replicas(name)
            floor = 0
            if w.rate_fps is not None:
                floor = replicas_for_rate(w.rate_fps, self.chain_seconds(name))
            if w.autoscale is None:  # a stated rate alone: enough chains for it, never fewer than asked
                n = min(max(w.replicas, floor), max(w.replicas, self.config.max_rate_replicas))
                if n != current and self.controller.scale(name, n, now):
                    out.append(SiteEvent("scaled", name, f"rate_fps {w.rate_fps:g}: {current} -> {n} replicas"))
                    self.dirty = True
                continue
            a = w.autoscale
            st = self.router.stats(name, chains, now, window_s=self.config.autoscale.window_s)
            load = Load(st.offered_rps, st.shed_rps, st.goodput_rps, self.router.bottleneck_s(name, chains),
                        st.chains, st.outstanding)
            d = self.autoscaler.decide(name, load, current, a.min_replicas, a.max_replicas,
                                       a.target_utilization, now, floor=floor)
            if d is not None and self.controller.scale(name, d.replicas, now):
                out.append(SiteEvent("scaled", name, d.reason))
                self.counters["scale_ups" if d.replicas > d.current else "scale_downs"] += 1
                self.dirty = True
        return out

    def chain_seconds(self, name: str) -> float:
        """One chain's seconds per request of ``name``: the measured slowest stage, else the plan's
        (its bottleneck for throughput objectives, else its whole latency: never optimistic)."""
        b = self.router.bottleneck_s(name, self.controller.chains(name))
        if b > 0:
            return b
        entry = self.controller.workloads.get(name)
        if entry is None or not entry.replicas:
            return 0.0
        r = entry.replicas[0]
        return r.bottleneck_s if r.bottleneck_s > 0 else r.latency_s

    def liveness(self, now: float, wall: float | None = None) -> list[Command]:
        """Missed adverts: suspects asked to rebirth, the dead re-placed (the registry's timers alone)."""
        out: list[Command] = []
        if wall is None:
            wall = now + self._wall_offset
        self._registry(self.registry.tick(now), now, out, wall)
        return out

    def reconcile(self, now: float, fleet: Fleet | None = None,
                  reported: Mapping[str, Sequence[PartitionStatus]] | None = None) -> list[Command]:
        """Desired against reported now. A caller that keeps its own fleet snapshot (the DES) passes it."""
        self.dirty = False
        self._last_reconcile = now
        self.counters["reconciles"] += 1
        if reported is None:
            reported = self.registry.reported()
        if fleet is None:
            fleet = self.registry.fleet(self.controller.reserved(reported))
        aside = self.slow_stages.set_aside
        if aside:  # the scheduler's NotThrottled keeps them empty: what they run is re-placed
            fleet = Fleet(tuple(replace(d, throttled=True) if d.id in aside else d for d in fleet.devices))
        return list(self.controller.reconcile(fleet, reported, now))

    # ------------------------------------------------------------ rules between the cores

    def _set_workload(self, spec: Workload, version: int, follows: str) -> list[Command]:
        out: list[Command] = list(self.controller.set_workload(spec, version))
        self.router.set_slo(spec.name, spec.slo_s)
        if follows.startswith("release:"):
            self.follows[spec.name] = follows[len("release:"):]
        else:
            self.follows.pop(spec.name, None)
        self.dirty = True
        return out

    def _restore(self, r: Restore, now: float) -> list[Command]:
        """A restart: what was deployed, as the store kept it; devices are waited for before placing."""
        self.controller.set_quotas(dict(r.quotas))
        for rel in r.releases:
            self._keep_release(rel)
        for spec, version, follows in r.workloads:
            self._set_workload(spec, version, follows)  # nothing is sent until the devices are heard
        if self.controller.workloads:
            self.controller.config = replace(self.controller.config, startup_wait_s=r.startup_wait_s)
            self.controller.start_after_restart(now, r.assignments)
        return []

    def _keep_release(self, r: ReleaseAccepted) -> None:
        self.releases[r.name] = {"version": r.version, "model": r.ref, "signer": r.signer,
                                 "metadata": {k: v for k, v in r.metadata.items() if k != "public_key"}}

    def _release(self, r: ReleaseAccepted) -> list[Command]:
        """Keep the newest release of each name; the workloads that follow it switch to it (only
        forward: an older or equal version changes nothing)."""
        known = self.releases.get(r.name)
        if known is not None and known["version"] >= r.version:
            self.counters["release:stale"] += 1
            return []
        self._keep_release(r)
        self.counters["releases"] += 1
        followers = tuple(sorted(w for w, rel in self.follows.items() if rel == r.name))
        return [FollowRelease(r.name, r.version, r.ref, followers)] if followers else []

    def _advert(self, msg: Any, now: float, out: list[Command], wall: float) -> None:
        self._registry(self.registry.handle(msg, now), now, out, wall)
        if isinstance(msg, DeviceState):
            parts = tuple((p.workload, p.version, p.replica, p.index, p.health, p.calib_s > 0)
                          for p in msg.partitions)  # a first-request calibration counts too
            if self._partitions_seen.get(msg.device_id) != parts:
                self._partitions_seen[msg.device_id] = parts
                self.dirty = True
                self._calibrate(msg)
            self._check_stages(msg, now, out)
            self._stage_times(msg)

    def _registry(self, cmds: Sequence[Any], now: float, out: list[Command], wall: float) -> None:
        for cmd in cmds:
            if isinstance(cmd, RequestRebirth):
                if not self._rebirths.take(now):
                    self.counters["rebirths_limited"] += 1
                    continue
                self.counters["rebirths_asked"] += 1
                self.counters[f"rebirth:{cmd.reason}"] += 1  # why, in status: each reason is a fixed phrase
                out.append(AskRebirth(cmd.device_id, cmd.reason))
            elif isinstance(cmd, DeviceLost):
                self.counters["devices_lost"] += 1
                out.append(SiteEvent("device lost", cmd.device_id, cmd.reason))
                self.controller.device_lost(cmd.device_id, now)
                self._partitions_seen.pop(cmd.device_id, None)
                self.slow_stages.lost(cmd.device_id)
                out += self.reconcile(now)  # re-place at once: detection -> deploy without waiting a tick
                out += self.router.device_lost(cmd.device_id, self._chains_in_flight(), now, wall)
            elif isinstance(cmd, DeviceJoined):
                out.append(LogNote(f"device {cmd.device_id} joined (epoch {cmd.epoch}"
                                   f"{', rejoin' if cmd.rejoin else ''})", "info"))
                if cmd.rejoin and cmd.new_epoch:  # back on a new connection (a rebirth lost nothing)
                    out.append(SiteEvent("device back", cmd.device_id, f"epoch {cmd.epoch}"))
                rec = self.registry.devices.get(cmd.device_id)
                memory = float(rec.birth.memory_bytes) if rec is not None and rec.birth is not None else None
                self.dirty = True
                if self.controller.device_joined(cmd.device_id, memory, now):
                    out += self.reconcile(now)  # what no longer fits is re-placed at once
            elif isinstance(cmd, ThrottleChanged):
                out.append(SiteEvent("device throttled" if cmd.throttled else "device unthrottled",
                                     cmd.device_id, "thermal throttling reported"
                                     if cmd.throttled else "throttling ended"))
                if cmd.throttled:
                    self.controller.request_plan()  # it takes no partition: move what it runs
                else:
                    self.controller.device_joined(cmd.device_id)  # usable again: place what pends
                self.dirty = True

    def _calibrate(self, st: DeviceState) -> None:
        """Partition timings a device measured at load -> the workload's measured segment times."""
        cls = self.registry.device_class(st.device_id)  # times go under the id, never a label
        for p in st.partitions:
            entry = self.controller.workloads.get(p.workload)
            a = self.controller.assignments.get((p.workload, p.version, p.replica, p.index))
            if (p.calib_s <= 0 or entry is None or entry.version != p.version or entry.spec.profile is None
                    or a is None or a.device != st.device_id):
                continue
            if self.registry.note_measured(st.device_id, throughput(entry.spec.profile, a.first, a.last, p.calib_s)):
                self.controller.request_plan()  # its claim is far above what it measured: see capacity_flags
            times = self.calibration.note(p.workload, p.version, st.device_id, cls, entry.spec.profile,
                                          a.first, a.last, p.calib_s)
            if not times:
                continue
            self.controller.update_costs(p.workload, entry.spec.profile.with_times(times))
            self.counters["calibrations_applied"] += 1

    def _stage_times(self, st: DeviceState) -> None:
        """Each running stage's measured compute (its p50 once it served, else its calibration at
        load) -> the router, which predicts completion times and admits against deadlines with them."""
        for p in st.partitions:
            if p.health != "running":
                continue
            key = (p.workload, p.version, p.replica, p.index)
            a = self.controller.assignments.get(key)
            if a is None or a.device != st.device_id:
                continue
            self.router.note_stage(key, p.p50_s if p.served > 0 and p.p50_s > 0 else p.calib_s)
            self.router.note_batch(key, p.max_batch, p.batch_slope)

    def _check_stages(self, st: DeviceState, now: float, out: list[Command]) -> None:
        """Each running stage's measured p50 against the plan's time: a device whose stage stays
        slow (throttling the board did not report) is set aside and the plan runs again."""
        samples = []
        for p in st.partitions:
            key = (p.workload, p.version, p.replica, p.index)
            entry = self.controller.workloads.get(p.workload)
            a = self.controller.assignments.get(key)
            if (p.health != "running" or entry is None or entry.spec.profile is None or a is None
                    or a.device != st.device_id):
                continue
            planned = planned_stage_s(dict(entry.spec.profile.segment_times), st.device_id,
                                      a.first, a.last, p.calib_s)
            samples.append(StageSample(key, p.served, p.p50_s, planned))
        verdict = self.slow_stages.observe(st.device_id, samples, now)
        if verdict is not None:
            self.counters["stages_slow"] += 1
            out.append(SiteEvent("stage slow", verdict.device, verdict.reason))
            self.controller.request_plan()  # it takes no partition now: move what it runs
            self.dirty = True

    def _chains_in_flight(self) -> dict[str, Any]:
        return {w: self.controller.chains(w) for w in self.router.workloads_in_flight()}

    def _submit(self, req: InferenceRequest, now: float, wall: float) -> list[Command]:
        entry = self.controller.workloads.get(req.workload)
        why = ""
        if entry is None:
            why = "unknown workload"
        elif entry.reasons:
            why = "; ".join(f"{k}: {v}" for k, v in entry.reasons.items())
        elif entry.status != "running":
            why = f"status {entry.status}"
        return list(self.router.submit(req, self.controller.chains(req.workload), now, wall, why))

    def _result(self, res: InferenceResult, sender: str, now: float, wall: float) -> list[Command]:
        workload = self.router.workload_of(res.request_id)
        out: list[Command] = list(self.router.result(res, self.controller.chains(workload), now, wall,
                                                     sender=sender))
        self._check_claims(out)
        return out

    def _check_claims(self, out: list[Command]) -> None:
        """The router's timed answers against the stage times their devices report: a device whose
        reports the round trips refute is flagged (no first replica) and measured by the fog instead."""
        while self.router.observed:
            workload, (replica, route), seconds, claimed, at = self.router.observed.popleft()
            if not route:
                continue
            v = self.claims.observe(workload, route[0].version, replica, [h.device_id for h in route], seconds,
                                    claimed, at)
            if v is None:
                continue
            self.counters["timings_refuted"] += 1
            out.append(SiteEvent("timings refuted", v.device, v.reason))
            out.append(LogNote(f"device {v.device}: {v.reason}"))
            entry = self.controller.workloads.get(workload)
            first = self.controller.assignments.get((workload, v.version, replica, route[0].index))
            last = self.controller.assignments.get((workload, v.version, replica, route[-1].index))
            profile = entry.spec.profile if entry is not None and entry.version == v.version else None
            flops = 0.0
            if profile is not None and first is not None and last is not None:
                flops = throughput(profile, first.first, last.last, v.observed_s)
                times = self.calibration.refute(workload, v.version, v.device, profile, first.first, last.last,
                                                v.observed_s)
                if times:
                    self.controller.update_costs(workload, profile.with_times(times))
            self.registry.note_refuted(v.device, flops)
            self.controller.request_plan()  # flagged: it holds no first replica; its costs moved
            self.dirty = True
