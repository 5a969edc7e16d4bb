"""Model-based test of one site: hypothesis drives ``SiteCore`` with random, partly hostile, events.

Devices are born (some with NaN, inf, negative or huge figures), advertise, ack deploys,
die and come back on new or stale epochs; workloads come and go; time moves. After every
step the site must hold its invariants: nothing raised, every partition that is deploying
or running sits on a live device with a valid description that fits it (memory, selectors,
taints, power-domain anti-affinity, whole gangs), every pending workload says why, and a
device whose description is invalid never holds a partition.
"""
from __future__ import annotations

import itertools
import math
from collections import defaultdict

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fog_broker.controller import DeployPartition, Phase, UndeployPartition
from fog_broker.placement.model import ChainProfile, Segment, Toleration, Workload
from fog_broker.placement.scheduler import schedule
from fog_broker.site_core import Ack, Advert, RemoveWorkload, SetWorkload, SiteCore, SiteCoreConfig
from runtime.errors import RemoteViolation
from runtime.messages import DeviceBirth, DeviceDeath, DeviceState, PartitionStatus, Taint

MB = 1_000_000
DEVICES = [f"d{i}" for i in range(6)]
HOSTILE = [math.nan, math.inf, -math.inf, -1.0, -1e-3, 0.0, 1e300, -5.0]
NUMERIC = ["flops", "memory_bytes", "uplink_bps", "downlink_bps", "rtt_s", "power_active_w", "power_idle_w",
           "tx_j_per_byte", "rx_j_per_byte", "battery_capacity_wh", "cpu_count", "state_interval_s"]
STATE_NUMERIC = ["free_memory_bytes", "battery_level", "power_w", "cpu_load", "temperature_c", "uplink_bps",
                 "rtt_s"]


def _profile(n: int, param: float) -> ChainProfile:
    return ChainProfile("m", 1000.0, tuple(Segment(f"s{i}", 1e8, param, 1 * MB, 1000.0) for i in range(n)))


def _valid(msg: object) -> bool:
    try:
        msg.validate()  # type: ignore[attr-defined]
    except (RemoteViolation, ValueError, TypeError, OverflowError):
        return False
    return True


class SiteMachine(RuleBasedStateMachine):
    @initialize(hardware=st.lists(st.tuples(st.sampled_from([20 * MB, 60 * MB, 200 * MB]), st.integers(0, 2),
                                            st.booleans(), st.booleans()),
                                  min_size=len(DEVICES), max_size=len(DEVICES)))
    def start(self, hardware: list[tuple[int, int, bool, bool]]) -> None:
        self.core = SiteCore(schedule, SiteCoreConfig(state_interval_s=1.0, max_rebirths_per_s=math.inf))
        self.now = 0.0
        self.epoch: dict[str, int] = defaultdict(int)
        self.alive: dict[str, bool] = {}
        self.births: dict[str, DeviceBirth] = {}
        self.running: dict[str, dict[tuple[str, int, int, int], PartitionStatus]] = defaultdict(dict)
        self.inflight: list[DeployPartition] = []
        self.versions: dict[str, int] = {}
        self.hardware = dict(zip(DEVICES, hardware, strict=True))
        for dev in DEVICES:  # a healthy site to start from: hostile events perturb it
            self.birth(dev, *self.hardware[dev][:3], None, self.hardware[dev][3], True)
            self.state(dev, None, False, True)

    # ------------------------------------------------------------ helpers

    def _apply(self, cmds: list[object]) -> None:
        for c in cmds:
            if isinstance(c, DeployPartition):
                self.inflight.append(c)
            elif isinstance(c, UndeployPartition):
                self.running[c.device].pop((c.workload, c.version, c.replica, c.index), None)

    def _handle(self, event: object) -> None:
        self._apply(self.core.handle(event, self.now))  # type: ignore[arg-type]

    # ------------------------------------------------------------ devices

    @rule(dev=st.sampled_from(DEVICES), hostile=st.none() | st.tuples(st.sampled_from(NUMERIC),
                                                                      st.sampled_from(HOSTILE)),
          validate=st.booleans())
    def rebirth(self, dev: str, hostile: tuple[str, float] | None, validate: bool) -> None:
        """The same board on a new connection (its hardware does not change), perhaps lying about a figure."""
        mem, domain, tainted, gpu = self.hardware[dev]
        self.birth(dev, mem, domain, tainted, hostile, gpu, validate)

    def birth(self, dev: str, mem: int, domain: int, tainted: bool, hostile: tuple[str, float] | None,
              gpu: bool, validate: bool) -> None:
        self.epoch[dev] += 1
        kw: dict[str, object] = dict(
            device_id=dev, epoch=self.epoch[dev], seq=1, site="s", public_key=b"k" * 32, flops=1e10,
            memory_bytes=mem, uplink_bps=1e8, downlink_bps=1e8, rtt_s=1e-3, power_active_w=5.0,
            power_idle_w=1.0, tx_j_per_byte=1e-8, rx_j_per_byte=1e-8, state_interval_s=1.0,
            labels={"power-domain": f"pd{domain}", "gpu": "yes" if gpu else "no"},
            taints=(Taint("dedicated", "cam"),) if tainted else ())
        if hostile is not None:
            name, value = hostile
            kw[name] = int(value) if name in ("memory_bytes", "cpu_count") and math.isfinite(value) else value
        try:
            msg = DeviceBirth(**kw)  # type: ignore[arg-type]
        except (RemoteViolation, ValueError, TypeError, OverflowError):
            return  # refused where bytes become a message
        if validate and not _valid(msg):
            return  # refused where bytes become a message: the core never sees it
        self.births[dev] = msg
        self.alive[dev] = True
        self.running[dev].clear()
        self._handle(Advert(msg))

    @rule(dev=st.sampled_from(DEVICES), hostile=st.none() | st.tuples(st.sampled_from(STATE_NUMERIC),
                                                                      st.sampled_from(HOSTILE)),
          stale=st.booleans(), validate=st.booleans())
    def state(self, dev: str, hostile: tuple[str, float] | None, stale: bool, validate: bool) -> None:
        if dev not in self.births:
            return
        b = self.births[dev]
        kw: dict[str, object] = dict(device_id=dev, epoch=self.epoch[dev] - (1 if stale else 0), seq=2,
                                     free_memory_bytes=int(max(0.0, float(b.memory_bytes) if
                                                               math.isfinite(b.memory_bytes) else 0.0) // 2),
                                     partitions=tuple(self.running[dev].values()))
        if hostile is not None:
            name, value = hostile
            kw[name] = int(value) if name == "free_memory_bytes" and math.isfinite(value) else value
        try:
            msg = DeviceState(**kw)  # type: ignore[arg-type]
        except (RemoteViolation, ValueError, TypeError, OverflowError):
            return
        if validate and not _valid(msg):
            return
        self._handle(Advert(msg))

    @rule(dev=st.sampled_from(DEVICES), stale=st.booleans())
    def death(self, dev: str, stale: bool) -> None:
        if dev not in self.births:
            return
        self._handle(Advert(DeviceDeath(dev, self.epoch[dev] - (1 if stale else 0))))
        if not stale:
            self.alive[dev] = False
            self.running[dev].clear()

    @precondition(lambda self: bool(self.inflight))
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        cmd = self.inflight.pop(data.draw(st.integers(0, len(self.inflight) - 1)))
        ok = data.draw(st.booleans()) and self.alive.get(cmd.device, False)
        if ok:
            key = (cmd.workload, cmd.version, cmd.replica, cmd.index)
            self.running[cmd.device][key] = PartitionStatus(*key, sha256="0" * 64, health="running")
        self._handle(Ack(cmd.device, cmd.command_id, ok, "" if ok else "no room"))

    # ------------------------------------------------------------ workloads and time

    @rule(name=st.sampled_from(["a", "b", "c"]), segs=st.integers(1, 4), param=st.sampled_from([5 * MB, 30 * MB]),
          replicas=st.integers(1, 2), gpu=st.booleans(), tolerate=st.booleans(), min_parts=st.integers(1, 2))
    def deploy(self, name: str, segs: int, param: int, replicas: int, gpu: bool, tolerate: bool,
               min_parts: int) -> None:
        w = Workload(name=name, source="d0", sink="d0", replicas=replicas, profile=_profile(segs, param),
                     selectors=(("gpu", "yes"),) if gpu else (), min_partitions=min(min_parts, segs),
                     tolerations=(Toleration("dedicated"),) if tolerate else ())
        self.versions[name] = self.versions.get(name, 0) + 1
        self._handle(SetWorkload(w, self.versions[name]))

    @rule(name=st.sampled_from(["a", "b", "c"]))
    def undeploy(self, name: str) -> None:
        if name in self.core.controller.workloads:
            self._handle(RemoveWorkload(name))

    @rule(dt=st.sampled_from([0.05, 0.5, 2.0, 6.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._apply(self.core.tick(self.now, 1e9 + self.now))

    # ------------------------------------------------------------ invariants

    @invariant()
    def placed_partitions_are_sound(self) -> None:
        if not hasattr(self, "core"):
            return
        ctl, reg = self.core.controller, self.core.registry
        used: dict[str, float] = defaultdict(float)
        domains: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
        for a in ctl.assignments.values():
            if a.phase not in (Phase.DEPLOYING, Phase.RUNNING):
                continue
            rec = reg.get(a.device)
            assert rec is not None and rec.alive, f"{a.key} on {a.device}, which is not alive"
            birth = self.births.get(a.device)
            assert birth is not None and _valid(birth), f"{a.key} on {a.device}, whose birth is invalid"
            entry = ctl.workloads[a.key[0]]
            spec = entry.spec
            assert spec.profile is not None
            used[a.device] += spec.profile.memory_of(a.first, a.last)
            event(f"partition {a.phase.value}")
            labels = dict(birth.labels)
            for k, v in spec.selectors:
                assert labels.get(k) == v, f"{a.key} on {a.device} ignores selector {k}={v}"
            for t in birth.taints:
                if t.effect == "NoSchedule":
                    assert any(tol.tolerates(t) for tol in spec.tolerations), f"{a.key} on tainted {a.device}"
            domains[a.key[0]][a.key[2]].add(labels.get("power-domain", a.device))
        for dev, mem in used.items():
            assert mem <= float(self.births[dev].memory_bytes) + 1e-6, f"{dev} holds {mem} > its memory"
        for w, reps in domains.items():
            seen: set[str] = set()
            for r, doms in reps.items():
                assert not (doms & seen), f"{w}: replica {r} shares a power domain with another replica"
                seen |= doms

    @invariant()
    def gangs_whole_and_pending_explained(self) -> None:
        if not hasattr(self, "core"):
            return
        ctl = self.core.controller
        for name, entry in ctl.workloads.items():
            if entry.status == "pending" and not self.core.dirty:  # planned at least once since set
                assert entry.reasons, f"{name} is pending without a reason"
            nseg = len(entry.spec.profile.segments) if entry.spec.profile else 0
            by_rep: dict[int, list[tuple[int, int]]] = defaultdict(list)
            for a in ctl.assignments.values():
                if a.key[0] == name and a.key[1] == entry.version:
                    by_rep[a.key[2]].append((a.first, a.last))
            for r, spans in by_rep.items():
                spans.sort()
                assert spans[0][0] == 0 and spans[-1][1] == nseg - 1, f"{name} r{r}: gang not whole {spans}"
                assert all(b[0] == a[1] + 1 for a, b in itertools.pairwise(spans)), f"{name} r{r}: gap {spans}"


SiteMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestSiteCore = SiteMachine.TestCase
