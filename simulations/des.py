"""Discrete-event fleet simulation over the real pure cores.

The fog broker's ``SiteCore`` (registry, scheduler, controller and the rules
between them) runs here exactly as in the ``fogline broker`` process; only MQTT
and the devices are replaced by events on a heap. Time is simulated (seconds), randomness comes from one
seeded ``random.Random``, so a run is deterministic for a seed and fleets of
10,000 devices run much faster than real time.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fog_broker.controller import ControllerConfig, DeployPartition, Phase, UndeployPartition
from fog_broker.placement import Workload, schedule
from fog_broker.site_core import Ack, Advert, SetWorkload, SiteCore, SiteCoreConfig
from runtime.messages import DeviceBirth, DeviceDeath, DeviceState, PartitionStatus

from .churn import FailureModel, SimBattery, drain, next_failure
from .profiles import PROFILES, DeviceProfile
from .scenario import Scenario

__all__ = ["SimDevice", "SimConfig", "SimResult", "FleetSim", "make_fleet", "run_scenario", "scaled"]

_KEY = b"\x00" * 32  # the simulation does not sign: identities are not under test here


@dataclass(slots=True)
class SimDevice:
    device_id: str
    profile: DeviceProfile
    labels: dict[str, str]
    alive: bool = True
    epoch: int = 0
    battery: SimBattery | None = None
    partitions: dict[tuple[str, int, int, int], PartitionStatus] = field(default_factory=dict)
    state: DeviceState | None = None  # cached until something changes (adverts are hot)
    seq: int = 0

    def birth(self) -> DeviceBirth:
        self.seq += 1
        # the profile is the device record itself: a new resource field reaches the fog with no edit here
        return DeviceBirth.of(self.profile, device_id=self.device_id, epoch=self.epoch, seq=self.seq,
                              site=self.labels.get("site", "sim"), public_key=_KEY, labels=dict(self.labels),
                              simulated=True)

    def state_advert(self, used_bytes: float) -> DeviceState:
        if self.state is None or self.state.epoch != self.epoch:
            self.seq += 1
            self.state = DeviceState(
                device_id=self.device_id, epoch=self.epoch, seq=self.seq,
                free_memory_bytes=max(0, int(self.profile.memory_bytes - used_bytes)),
                battery_level=self.battery.level if self.battery else None,
                charging=self.battery.charging if self.battery else False,
                partitions=tuple(self.partitions.values()))
        return self.state


@dataclass(frozen=True, slots=True)
class SimConfig:
    duration_s: float = 3600.0
    state_interval_s: float = 10.0
    deploy_delay_s: float = 0.2        # send -> ack (artifact transfer + session load)
    undeploy_delay_s: float = 0.05     # send -> unloaded (then advertised at once)
    will_delay_s: float = 0.05         # crash -> the broker publishes the Will
    hang_fraction: float = 0.0         # share of failures that hang (detected by deadline only)
    failure: FailureModel | None = None
    battery_interval_s: float = 60.0   # how often batteries are updated
    seed: int = 0
    #: Crash this share of the fleet at once at ``mass_failure_at_s`` (None: never), e.g. a
    #: power-domain outage; the most loaded host is always a victim, the rest come from their
    #: own seeded stream.
    mass_failure_at_s: float | None = None
    mass_failure_fraction: float = 0.1


@dataclass
class SimResult:
    sim_s: float
    wall_s: float
    events: int
    adverts: int
    crashes: int
    recoveries_s: list[float]
    deploy_latencies_s: list[float]
    schedule_calls: int
    schedule_wall_s: list[float]
    workload_status: dict[str, str]
    availability: dict[str, float]
    counters: dict[str, int]
    #: With ``SimConfig.mass_failure_at_s``: devices crashed, partitions and workloads hit,
    #: sim seconds from the crash until every hit workload ran all replicas elsewhere, and the
    #: wall time of the scheduler solves spent on it.
    mass_failure: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def pct(xs: Sequence[float], q: float) -> float | None:
            if not xs:
                return None
            s = sorted(xs)
            return s[min(len(s) - 1, int(q * len(s)))]

        return {
            "sim_hours": round(self.sim_s / 3600, 3), "wall_s": round(self.wall_s, 3),
            "sim_hours_per_wall_s": round(self.sim_s / 3600 / self.wall_s, 3) if self.wall_s else None,
            "events": self.events, "adverts": self.adverts, "crashes": self.crashes,
            "recovery_p50_s": pct(self.recoveries_s, 0.5), "recovery_p99_s": pct(self.recoveries_s, 0.99),
            "schedule_calls": self.schedule_calls,
            "schedule_p50_ms": (pct(self.schedule_wall_s, 0.5) or 0) * 1e3,
            "schedule_p99_ms": (pct(self.schedule_wall_s, 0.99) or 0) * 1e3,
            "availability": {k: round(v, 5) for k, v in self.availability.items()},
            "workload_status": self.workload_status, "counters": self.counters,
            **({"mass_failure": self.mass_failure} if self.mass_failure else {}),
        }


def make_fleet(n: int, rng: random.Random, mix: dict[str, float] | None = None,
               power_domains: int = 8, zones: int = 4) -> list[SimDevice]:
    """``n`` devices drawn from profiles with the given mix, spread over power domains."""
    mix = mix or {"pi4": 0.35, "pi5": 0.3, "orin-nano": 0.1, "jetson-nano": 0.1, "x86-gateway": 0.05,
                  "camera": 0.1}
    names = [k for k in mix if k in PROFILES]
    weights = [mix[k] for k in names]
    out = []
    for i in range(n):
        prof = PROFILES[rng.choices(names, weights)[0]]
        labels = {**prof.labels, "power-domain": f"pd-{i % power_domains}", "zone": f"z-{i % zones}",
                  "site": "sim"}
        battery = SimBattery(prof.battery_capacity_wh, prof.battery_level) if prof.battery_capacity_wh else None
        out.append(SimDevice(f"dev-{i:05d}", prof, labels, battery=battery))
    return out


class FleetSim:
    """Events on a heap; the registry and controller see what a fog broker would."""

    def __init__(self, devices: list[SimDevice], workloads: Sequence[Workload], config: SimConfig,
                 *, clock: Callable[[], float], follows: Mapping[str, str] | None = None) -> None:
        self.devices = {d.device_id: d for d in devices}
        self.follows = dict(follows or {})  # workload -> the release it follows (``release:NAME``)
        self.config = config
        self.rng = random.Random(config.seed)
        self._clock = clock  # wall clock, only to measure the cores (never read by them)
        self.schedule_wall: list[float] = []
        # The fog's own core: the rebirth budget is the only part a simulation has no use for.
        self.core = SiteCore(self._timed_schedule, SiteCoreConfig(
            state_interval_s=config.state_interval_s, max_rebirths_per_s=math.inf,
            controller=ControllerConfig(startup_wait_s=0.0)))
        self.registry = self.core.registry
        self.controller = self.core.controller
        self.workloads = list(workloads)
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self.events = self.adverts = self.crashes = 0
        self._up_since: dict[str, float] = {}
        self._up_total: dict[str, float] = {w.name: 0.0 for w in workloads}
        self._last_avail_t = 0.0
        self._up: dict[str, bool] = {}
        self._dirty = True
        self._fleet: Any = None
        self._reported: Any = None
        self.mass: dict[str, Any] = {}
        self._mass_hit: list[Any] = []  # the Assignment objects on the crashed devices
        self._mass_workloads: list[str] = []
        self._mass_solves = 0
        self._token = 0
        self._wall0 = 0.0
        self.now = 0.0
        #: Called with ``now`` after every reconcile until they return True (the multi-site engine
        #: times a version switch to the event that completed it).
        self.watchers: list[Callable[[float], bool]] = []

    def _timed_schedule(self, *args: Any, **kw: Any) -> Any:
        t0 = self._clock()
        plan = schedule(*args, **kw)
        self.schedule_wall.append(self._clock() - t0)
        return plan

    def _push(self, t: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    # ------------------------------------------------------------ device side

    def _used(self, dev: SimDevice) -> float:
        total = 0.0
        ctl = self.controller
        for key in dev.partitions:
            entry = ctl.workloads.get(key[0])
            a = ctl.assignments.get(key)
            spec = entry.spec if entry is not None else None
            if a is None and ctl.switches:  # an old version that still serves (or drains) during a switch
                sw = ctl.switches.get(key[0])
                a = sw.parts.get(key) if sw is not None else None
                spec = (sw.specs.get(key[1]) or sw.spec) if sw is not None else None
            if spec is not None and spec.profile is not None and a is not None:
                total += spec.profile.memory_of(a.first, a.last)
        return total

    def _apply(self, cmds: Sequence[Any], now: float) -> None:
        """The core's commands a simulated fleet acts on (rebirths, events and persistence need no device)."""
        for cmd in cmds:
            if isinstance(cmd, DeployPartition):
                self._push(now + self.config.deploy_delay_s, "deploy", cmd)
            elif isinstance(cmd, UndeployPartition):
                self._push(now + self.config.undeploy_delay_s, "undeploy", cmd)

    def _advert(self, dev: SimDevice, now: float) -> None:
        self.adverts += 1
        before = dev.state
        state = dev.state_advert(self._used(dev))
        if state is not before:
            self._dirty = True
        self._apply(self.core.handle(Advert(state), now), now)

    # ------------------------------------------------------------ run

    def _track_availability(self, now: float) -> None:
        dt = now - self._last_avail_t
        if dt > 0:
            for name, up in self._up.items():
                if up:
                    self._up_total[name] += dt
        self._last_avail_t = now

    def _reconcile(self, now: float) -> None:
        # The snapshot only changes when an advert carried new figures or liveness changed;
        # rebuilding it for every reconcile would dominate a 10,000-device run.
        if self._dirty or self._fleet is None:
            self._reported = self.registry.reported()
            self._fleet = self.registry.fleet(self.controller.reserved(self._reported))
            self._dirty = False
        self._apply(self.core.reconcile(now, self._fleet, self._reported), now)
        # After reconcile a status is current: running or degraded <=> at least one healthy chain.
        wl = self.controller.workloads
        self._up = {w.name: w.name in wl and wl[w.name].status in ("running", "degraded") for w in self.workloads}

    def start(self) -> None:
        """Births, first failures, the workloads and the periodic events, all at t = 0."""
        cfg = self.config
        self._wall0 = self._clock()
        for dev in self.devices.values():
            self._apply(self.core.handle(Advert(dev.birth()), 0.0), 0.0)
            if cfg.failure is not None:
                down, _ = next_failure(cfg.failure, 0.0, self.rng)
                if down < cfg.duration_s:
                    self._push(down, "crash", dev.device_id)
        for w in self.workloads:
            follows = f"release:{self.follows[w.name]}" if w.name in self.follows else ""
            self._apply(self.core.handle(SetWorkload(w, 1, follows), 0.0), 0.0)
        self._push(0.0, "reconcile", self._token)
        self._push(cfg.state_interval_s, "adverts")
        self._push(cfg.battery_interval_s, "battery")
        if cfg.mass_failure_at_s is not None:
            self._push(cfg.mass_failure_at_s, "mass_failure")

    def inject(self, at: float, action: Callable[[float], Any]) -> None:
        """Run ``action(now)`` at simulated time ``at`` (an input from outside the site: a release,
        a fault); it is followed by a reconcile, like any item of the broker's inbox."""
        self._push(at, "call", action)

    def advance(self, until: float) -> int:
        """Process every event at or before ``until`` (capped at the duration); returns how many."""
        until = min(until, self.config.duration_s)
        heap, n = self._heap, 0
        while heap and heap[0][0] <= until:
            self._step()
            n += 1
        return n

    def run(self) -> SimResult:
        self.start()
        self.advance(self.config.duration_s)
        return self.finish()

    def finish(self) -> SimResult:
        """The result at the end of the run (the duration, or the last event if the heap ran dry)."""
        now = self.config.duration_s if self._heap else self.now
        self._track_availability(now)
        wall = self._clock() - self._wall0
        return SimResult(
            sim_s=now, wall_s=wall, events=self.events, adverts=self.adverts, crashes=self.crashes,
            recoveries_s=list(self.controller.recoveries),
            deploy_latencies_s=list(self.controller.deploy_latencies),
            schedule_calls=len(self.schedule_wall), schedule_wall_s=list(self.schedule_wall),
            workload_status={n: e.status for n, e in self.controller.workloads.items()},
            availability={w: (t / now if now else 0.0) for w, t in self._up_total.items()},
            counters=dict(self.controller.counters), mass_failure=dict(self.mass))

    def _step(self) -> None:
        cfg = self.config
        now, _, kind, payload = heapq.heappop(self._heap)
        self.now = now
        self.events += 1
        self._track_availability(now)
        if kind == "adverts":
            core, n, out = self.core, 0, []
            for d in self.devices.values():  # _advert inlined: 1,000s of devices every interval
                if d.alive:
                    n += 1
                    state = d.state
                    if state is None or state.epoch != d.epoch:
                        state = d.state_advert(self._used(d))
                        self._dirty = True
                    out += core.handle(Advert(state), now)
            self.adverts += n
            self._apply(out, now)
            lost = core.liveness(now)
            if lost:
                self._dirty = True
                self._apply(lost, now)
            self._push(now + cfg.state_interval_s, "adverts")
        elif kind == "deploy":
            cmd = payload
            dev = self.devices.get(cmd.device)
            if dev is None or not dev.alive:
                return  # lost with the device: the controller's ack deadline handles it
            key = (cmd.workload, cmd.version, cmd.replica, cmd.index)
            dev.partitions[key] = PartitionStatus(cmd.workload, cmd.version, cmd.replica, cmd.index,
                                                  "0" * 64, "running")
            dev.state = None
            self._apply(self.core.handle(Ack(dev.device_id, cmd.command_id, True), now), now)
            self._advert(dev, now)  # a partition set change is a significant change
        elif kind == "undeploy":
            host = self.devices.get(payload.device)
            if host is None or not host.alive or host.partitions.pop(
                    (payload.workload, payload.version, payload.replica, payload.index), None) is None:
                return  # nothing changed on the device
            host.state = None
            self._advert(host, now)  # as an agent does: a partition set change is advertised at once
        elif kind == "crash":
            self._crash(self.devices[payload], now)
        elif kind == "will":
            dev_id, epoch = payload
            self._dirty = True
            self._apply(self.core.handle(Advert(DeviceDeath(dev_id, epoch)), now), now)
        elif kind == "recover":
            self._recover(self.devices[payload], now)
        elif kind == "battery":
            self._batteries(now)
            self._push(now + cfg.battery_interval_s, "battery")
        elif kind == "mass_failure":
            self._mass_failure(now, payload)
        elif kind == "call":
            self._dirty = True
            self._apply(payload(now) or (), now)
        if kind == "reconcile" and payload != self._token:
            return  # superseded by a later schedule
        # reconcile after every event, as the broker's owner thread does after each inbox item
        self._reconcile(now)
        if self._mass_hit:
            self._mass_check(now)
        if self.watchers:
            self.watchers = [w for w in self.watchers if not w(now)]
        deadline = min(self.controller.next_deadline(), now + self.controller.config.replan_interval_s)
        self._token += 1
        self._push(max(deadline, now + 0.01), "reconcile", self._token)

    def _crash(self, dev: SimDevice, now: float) -> None:
        if not dev.alive:
            return
        self.crashes += 1
        dev.alive = False
        dev.partitions.clear()
        dev.state = None
        if self.rng.random() >= self.config.hang_fraction:
            self._push(now + self.config.will_delay_s, "will", (dev.device_id, dev.epoch))
        if self.config.failure is not None:
            self._push(now + self.rng.expovariate(1.0 / self.config.failure.mttr_s), "recover", dev.device_id)

    def mass_failure(self, now: float, fraction: float) -> None:
        """Crash ``fraction`` of the fleet now (the busiest host among them) and time the repair."""
        self._mass_failure(now, fraction)

    def _mass_failure(self, now: float, fraction: float | None = None) -> None:
        cfg = self.config
        pick = random.Random(cfg.seed * 1_000_003 + 17)  # its own stream: the victims do not depend on history
        ids = sorted(self.devices)
        share = cfg.mass_failure_fraction if fraction is None else fraction
        count = min(len(ids), round(share * len(ids)))
        # The scheduler packs work onto the few best devices, so a uniform sample of 10 % usually
        # misses every host and measures nothing: the most loaded host is always among the victims
        # (a worst case for re-placement), the rest are drawn uniformly.
        load: dict[str, int] = {}
        for a in self.controller.assignments.values():
            load[a.device] = load.get(a.device, 0) + 1
        busiest = max(sorted(load), key=lambda d: load[d]) if load else None
        others = [d for d in ids if d != busiest]
        victims = set(pick.sample(others, max(0, count - (busiest is not None))))
        if busiest is not None and count:
            victims.add(busiest)
        # A workload whose source or sink died cannot run anywhere until that device returns:
        # that times the device's repair, not the re-placement, so those are counted apart.
        ends = {w.name for w in self.workloads if w.source in victims or w.sink in victims}
        self._mass_hit = [a for a in self.controller.assignments.values()
                          if a.device in victims and a.workload not in ends]
        hit_workloads = sorted({a.workload for a in self._mass_hit})
        self.mass = {"at_s": now, "devices": len(victims), "partitions_hit": len(self._mass_hit),
                     "workloads_hit": len(hit_workloads), "workloads_without_endpoint": len(ends),
                     "recovered_after_s": None,
                     "schedule_calls": 0, "schedule_wall_s": 0.0}
        self._mass_workloads = hit_workloads
        self._mass_solves = len(self.schedule_wall)
        crashes = self.crashes
        for did in ids:
            if did in victims:
                self._crash(self.devices[did], now)
        self.mass["devices_crashed"] = self.crashes - crashes  # some may have been down already
        if not self._mass_hit:
            self.mass["recovered_after_s"] = 0.0

    def _mass_check(self, now: float) -> None:
        """Recovered: every hit partition runs again, deployed after the failure (elsewhere, or in
        place when its device rebooted before it was declared dead), and every hit workload runs."""
        current, at = self.controller.assignments, self.mass["at_s"]
        for a in self._mass_hit:
            cur = current.get(a.key)
            if cur is not None and (cur.phase is not Phase.RUNNING or not cur.running_since >= at):
                return
        wl = self.controller.workloads
        if any(w in wl and wl[w].status != "running" for w in self._mass_workloads):
            return
        solves = self.schedule_wall[self._mass_solves:]
        self.mass.update(recovered_after_s=round(now - self.mass["at_s"], 3), schedule_calls=len(solves),
                         schedule_wall_s=round(sum(solves), 4))
        self._mass_hit = []

    def _recover(self, dev: SimDevice, now: float) -> None:
        dev.alive = True
        dev.epoch += 1
        dev.state = None
        if dev.battery is not None and dev.battery.dead:
            dev.battery = SimBattery(dev.battery.capacity_wh, 0.5, dev.battery.charge_w)
        self._dirty = True
        self._apply(self.core.handle(Advert(dev.birth()), now), now)
        if self.config.failure is not None:
            down, _ = next_failure(self.config.failure, now, self.rng)
            if down < self.config.duration_s:
                self._push(down, "crash", dev.device_id)

    def _batteries(self, now: float) -> None:
        dt = self.config.battery_interval_s
        for dev in self.devices.values():
            if dev.battery is None or not dev.alive:
                continue
            power = dev.profile.power_active_w if dev.partitions else dev.profile.power_idle_w
            before = dev.battery.level
            dev.battery = drain(dev.battery, power, dt)
            if abs(before - dev.battery.level) >= 0.05 or dev.battery.dead:
                dev.state = None
            if dev.battery.dead:
                self._crash(dev, now)  # battery death is a crash whose Will the broker sends


def scaled(scenario: Scenario, devices: int) -> Scenario:
    """The same scenario on ``devices`` devices: sources and sinks ``dev-N`` become ``dev-(N mod devices)``.

    For a spread workload (``dev-((7k + off) mod n)``) this is the scenario written for ``devices``
    whenever ``devices`` divides the original count.
    """
    def remap(end: Any) -> Any:
        if isinstance(end, str) and end.startswith("dev-") and end[4:].isdigit():
            return f"dev-{int(end[4:]) % devices:05d}"
        return end

    workloads = [{**w, "source": remap(w.get("source")), "sink": remap(w.get("sink"))} for w in scenario.workloads]
    return replace(scenario, devices=devices, workloads=workloads)


def run_scenario(scenario: Scenario, *, clock: Callable[[], float],
                 duration_s: float | None = None, mass_failure_at_s: float | None = None,
                 mass_failure_fraction: float = 0.1) -> SimResult:
    """Build the fleet and workloads of a scenario and run the discrete-event engine."""
    rng = scenario.rng()
    devices = make_fleet(scenario.devices, rng, scenario.mix or None, power_domains=scenario.power_domains)
    workloads = [Workload.from_dict(w, f"workload {w.get('name')}") for w in scenario.workloads]
    cfg = SimConfig(duration_s=duration_s or scenario.duration_s, state_interval_s=scenario.state_interval_s,
                    failure=scenario.failure, hang_fraction=scenario.hang_fraction, seed=scenario.seed,
                    mass_failure_at_s=mass_failure_at_s, mass_failure_fraction=mass_failure_fraction)
    return FleetSim(devices, workloads, cfg, clock=clock).run()
