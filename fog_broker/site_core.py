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
very same object, so the two cannot drift. ``view()`` is what status, metrics,
the HTTP API and the site page read. Nothing here does I/O or reads a clock.
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
from .controller import (
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

__all__ = [
    "SiteCoreConfig", "SiteCore", "SiteView",
    # events
    "Advert", "AdvertRejected", "ClaimFlags", "Ack", "Built", "BuildFailed", "SessionMissing", "DeviceRemoved",
    "SetWorkload",
    "RemoveWorkload", "SetQuotas", "Infer", "Result", "RouteUntrusted", "Event", "Command",
    # commands (the controller's and the router's are re-exported as they are)
    "AskRebirth", "SiteEvent", "LogNote", "DeployPartition", "UndeployPartition", "Persist", "SendActivation",
    "ReplyClient",
]


# ------------------------------------------------------------------ events (in)

@dataclass(frozen=True, slots=True)
class Advert:
    """A verified birth, state or death of an enrolled device."""
    msg: Any


@dataclass(frozen=True, slots=True)
class AdvertRejected:
    """An enrolled device's authenticated advert failed validation (``why``: the field and value)."""
    device_id: str
    why: str


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
    spec: Workload
    version: int


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


Event = (Advert | AdvertRejected | ClaimFlags | Ack | Built | BuildFailed | SessionMissing | DeviceRemoved
         | SetWorkload | RemoveWorkload | SetQuotas | Infer | Result | RouteUntrusted)


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


Command = (AskRebirth | SiteEvent | LogNote | DeployPartition | UndeployPartition | Persist | SendActivation
           | ReplyClient)


@dataclass(frozen=True, slots=True)
class SiteCoreConfig:
    state_interval_s: float = 10.0       # the default until a birth says otherwise
    battery_floor: float = 0.3
    reconcile_interval_s: float = 0.5
    max_rebirths_per_s: float = 200.0    # all devices together: a flood cannot make the fog a flood
    reply_topic: str = ""                # the fog's own reply topic (the router's hop answers)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    slow_stages: SlowStageConfig = field(default_factory=SlowStageConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    max_rate_replicas: int = 16          # a ``rate_fps`` without ``autoscale`` asks for at most this many


class SiteView:
    """Read-only access to one site's state for status, metrics, the HTTP API and the site page.

    The view holds the cores, not copies: read it on the thread that drives the core.
    """

    __slots__ = ("_core",)

    def __init__(self, core: SiteCore) -> None:
        self._core = core

    @property
    def registry(self) -> Registry:
        return self._core.registry

    @property
    def controller(self) -> Controller:
        return self._core.controller

    @property
    def router(self) -> Router:
        return self._core.router

    @property
    def counters(self) -> Mapping[str, int]:
        return self._core.counters

    @property
    def flags(self) -> Mapping[str, tuple[str, ...]]:
        return self._core.flags

    @property
    def slow(self) -> Mapping[str, str]:
        """Devices set aside for a stage slower than the plan -> why."""
        return self._core.slow_stages.set_aside

    def chains(self, workload: str) -> list[Any]:
        return self._core.controller.chains(workload)


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
        self.counters: Counter[str] = Counter()
        self.flags: dict[str, tuple[str, ...]] = {}  # device -> implausible claims in its birth
        self._rebirths = RateLimit(c.max_rebirths_per_s, c.max_rebirths_per_s)
        self._partitions_seen: dict[str, tuple[Any, ...]] = {}
        self._recoveries_seen = 0
        self._last_reconcile = -math.inf
        self._wall_offset = 0.0  # wall minus monotonic, as the last tick saw it
        self.dirty = True
        self._view = SiteView(self)

    # ------------------------------------------------------------ the interface

    def view(self) -> SiteView:
        return self._view

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
        if isinstance(event, Advert):
            self._advert(event.msg, now, out, wall)
        elif isinstance(event, ClaimFlags):
            self.flags[event.device_id] = tuple(event.flags)
            if self.registry.note_claim_flags(event.device_id, tuple(event.flags)):
                self.controller.request_plan()  # a flagged device holds no first replica: move it
        elif isinstance(event, AdvertRejected):
            out.append(SiteEvent("advert rejected", event.device_id, event.why))
            self._registry(self.registry.reject(event.device_id, now, event.why), now, out, wall)
            self.dirty = True
        elif isinstance(event, Ack):
            out += self.controller.ack(event.command_id, event.device_id, event.ok, event.reason, now)
            if not event.ok:
                out.append(LogNote(f"NACK from {event.device_id} for {event.command_id}: {event.reason}"))
            self.dirty = True
        elif isinstance(event, Built):
            self.controller.note_sha(event.key, event.sha256)
            out.append(Persist(event.key[0]))
        elif isinstance(event, BuildFailed):
            out += self.controller.ack(event.cmd.command_id, event.cmd.device, False, event.reason, now)
            self.dirty = True
        elif isinstance(event, SessionMissing):
            self._registry(self.registry.ask_rebirth(event.device_id, now, "no session"), now, out, wall)
        elif isinstance(event, DeviceRemoved):
            self.flags.pop(event.device_id, None)
            self._partitions_seen.pop(event.device_id, None)
            self.slow_stages.forget(event.device_id)
            self._registry(self.registry.remove(event.device_id, now, event.reason), now, out, wall)
        elif isinstance(event, SetWorkload):
            out += self.controller.set_workload(event.spec, event.version)
            self.router.set_slo(event.spec.name, event.spec.slo_s)
            self.dirty = True
        elif isinstance(event, RemoveWorkload):
            self.autoscaler.forget(event.name)
            out += self.controller.remove_workload(event.name)
            self.calibration.forget(event.name)
            self.router.forget_workload(event.name)
            self.dirty = True
        elif isinstance(event, SetQuotas):
            self.controller.set_quotas(dict(event.quotas))
            self.dirty = True
        elif isinstance(event, Infer):
            out += self._submit(event.request, now, event.wall)
        elif isinstance(event, Result):
            out += self._result(event.result, event.sender, now, event.wall)
        elif isinstance(event, RouteUntrusted):
            act = event.activation
            out += self.router.result(
                InferenceResult(act.request_id, False, {}, "a device of the route is no longer trusted"),
                self.controller.chains(act.workload), now, event.wall)
        return out

    def tick(self, now: float, wall: float) -> list[Command]:
        """Timers: liveness, re-planning, request deadlines, and what recovered since the last tick."""
        out: list[Command] = []
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
                self.controller.device_joined(cmd.device_id)
                self.dirty = True
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
        return list(self.router.result(res, self.controller.chains(workload), now, wall, sender=sender))
