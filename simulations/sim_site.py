"""One fog's site in the multi-site simulation: its ``FleetSim``, WAN link and model releases.

The fog side of a release is ``fog_broker``'s own rule, in the site core it
drives (``SiteCore`` and its ``ReleaseAccepted`` event): a release is kept
only when its version is newer than the one listed (else counted as a
refusal), and the workloads that follow it (``model = "release:NAME"``)
switch to the new bytes as a new workload version, make-before-break in the
real controller.
"""
from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from cloud_coordinator.rollout import model_ref
from fog_broker.placement import Workload
from fog_broker.site_core import FollowRelease, ReleaseAccepted, SetWorkload

from .des import FleetSim, SimConfig, make_fleet
from .scenario import Scenario, ScenarioError
from .wan import SiteSummary, WanLink

__all__ = ["SimSite", "build_site", "release_sha"]


def release_sha(name: str, version: int) -> str:
    """The (made-up) sha256 of a release's bytes: distinct per version, stable across runs."""
    return hashlib.sha256(f"{name}:v{version}".encode()).hexdigest()


@dataclass(slots=True)
class SimSite:
    """One fog's site: its FleetSim, its WAN link, the releases it accepted and the workloads following them."""

    name: str
    sim: FleetSim
    link: WanLink
    specs: dict[str, Workload]                 # workload -> its current spec (``model``: the bytes it runs)
    versions: dict[str, int] = field(default_factory=dict)               # workload -> its version here
    refusals: Counter[str] = field(default_factory=Counter)              # "release:<reason>"
    accepted_at: dict[int, float] = field(default_factory=dict)          # release version -> when listed
    switched_at: dict[int, float] = field(default_factory=dict)          # ... when all its followers run it
    before: dict[int, dict[str, int]] = field(default_factory=dict)      # ... followers' versions before it

    @property
    def follows(self) -> dict[str, str]:
        """Workload -> the release it follows (the site core's)."""
        return self.sim.core.follows

    @property
    def releases(self) -> dict[str, tuple[int, str]]:
        """Release name -> (version, model ref), as the site core keeps them."""
        return {n: (int(r["version"]), str(r["model"])) for n, r in self.sim.core.releases.items()}

    def accept(self, name: str, version: int, ref: str, now: float) -> list[Any]:
        """A release arrives (as ``FogService._on_release``): the site core keeps it if newer and names
        the workloads that follow it (``FollowRelease``); they switch to its bytes here."""
        core = self.sim.core
        out = core.handle(ReleaseAccepted(name, version, ref, "coordinator"), now)
        if self.releases.get(name) != (version, ref):
            self.refusals["release:stale"] += 1
            return []
        self.accepted_at.setdefault(version, now)
        named = next((c.workloads for c in out if isinstance(c, FollowRelease)), ())
        followers = [w for w in named if self.specs[w].model != ref]
        self.before[version] = {w: self.versions[w] for w in followers}
        cmds: list[Any] = []
        for w in followers:
            self.versions[w] += 1  # other bytes under the same spec text: a new workload version
            self.specs[w] = replace(self.specs[w], model=ref)
            cmds.extend(core.handle(SetWorkload(self.specs[w], self.versions[w], f"release:{name}"), now))
        if followers:
            self.sim.watchers.append(partial(self._switched, version, ref))
        else:
            self.switched_at[version] = now  # nothing here runs it, or everything already does
        return cmds

    def _switched(self, version: int, ref: str, now: float) -> bool:
        """After each reconcile while a release is new here: do all its followers run it yet?

        Switched = the workload runs ``ref`` as a version newer than before, every replica healthy,
        and its switch is over (no old partition left on a device): what ``WorkloadView.switched_to``
        asks of a status, read from the controller at the event that completed it.
        """
        cur = next((v for v, r in self.releases.values() if r == ref), None)
        if cur != version:
            return True  # superseded here before it switched: stop watching
        ctl = self.sim.controller
        for w, before in self.before[version].items():
            e = ctl.workloads.get(w)
            if e is None or e.spec.model != ref or e.version == before or e.status != "running" \
                    or w in ctl.switches or ctl.healthy_replicas(w) < max(1, e.spec.replicas):
                return False
        self.switched_at[version] = now
        return True

    def status(self, with_devices: bool) -> dict[str, Any]:
        """The parts of ``fogline status`` a rollout reads (``site_view`` parses it as it parses a fog's).

        Devices only on a fast poll, as ``SiteLink`` asks for none (``limit=0``) otherwise.
        """
        ctl = self.sim.controller
        wls = []
        for n in sorted(ctl.workloads):
            e = ctl.workloads[n]
            pred = min((r.latency_s for r in e.replicas if r.latency_s is not None), default=None)
            wls.append({"name": n, "model": e.spec.model, "version": e.version, "status": e.status,
                        "healthy_replicas": ctl.healthy_replicas(n), "replicas": e.spec.replicas,
                        "switch": ctl.switch_view(n) if n in ctl.switches else None,
                        "latency": {"predicted_s": pred}, "reasons": dict(e.reasons)})
        devices = []
        if with_devices:
            for parts in self.sim.registry.reported().values():
                if parts:
                    devices.append({"partitions": [f"{p.workload}/v{p.version}/r{p.replica}/p{p.index}:{p.health}"
                                                   for p in parts]})
        return {"releases": {n: {"version": v, "model": ref} for n, (v, ref) in self.releases.items()},
                "workloads": wls, "devices": devices, "counters": dict(self.refusals)}

    def summary(self, now: float) -> SiteSummary:
        ctl = self.sim.controller
        alive = sum(1 for d in self.sim.devices.values() if d.alive)
        running = sum(1 for e in ctl.workloads.values() if e.status == "running")
        return SiteSummary(self.name, now, alive, len(ctl.workloads), running, ctl.counters["repairs"])


def build_site(scenario: Scenario, index: int, name: str, *, clock: Callable[[], float],
               duration_s: float | None = None) -> SimSite:
    """Site ``index`` of a scenario: its fleet and workloads, seeded apart from every other site's."""
    seed = scenario.seed * 1000 + index
    devices = make_fleet(scenario.devices, random.Random(seed), scenario.mix or None,
                         power_domains=scenario.power_domains)
    for dev in devices:
        dev.labels["site"] = name
    specs: dict[str, Workload] = {}
    follows: dict[str, str] = {}
    releases: dict[str, tuple[int, str]] = {}
    for w in scenario.workloads:
        d = dict(w)
        model = d.pop("model", None)
        spec = Workload.from_dict(d, f"workload {d.get('name')}")
        if isinstance(model, str) and model.startswith("release:"):
            rel = model[len("release:"):]
            releases[rel] = (1, model_ref(release_sha(rel, 1)))  # every site starts on v1
            follows[spec.name] = rel
            spec = replace(spec, model=releases[rel][1])
        elif model is not None:
            raise ScenarioError(f"workload {spec.name}.model: only release:NAME is simulated, got {model!r}")
        specs[spec.name] = spec
    cfg = SimConfig(duration_s=duration_s or scenario.duration_s, state_interval_s=scenario.state_interval_s,
                    failure=scenario.failure, hang_fraction=scenario.hang_fraction, seed=seed)
    sim = FleetSim(devices, list(specs.values()), cfg, clock=clock, follows=follows)
    for rel, (version, ref) in releases.items():  # every site starts on v1, its followers on it already
        sim.core.handle(ReleaseAccepted(rel, version, ref, "coordinator"), 0.0)
    return SimSite(name, sim, WanLink(name), specs, dict.fromkeys(specs, 1))
