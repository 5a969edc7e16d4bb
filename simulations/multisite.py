"""Many sites under one simulated coordinator, on the discrete-event engine.

Each site is its own ``FleetSim`` (its own registry, scheduler and
controller, as a fog broker runs them) with its own device churn; the
coordinator reaches it over a WAN link (``wan.WanLink``) that scenario events
cut and restore. The coordinator does what ``cloud_coordinator.siteservice``
does, with the real pure ``RolloutBook`` deciding: it polls each site's status
(fast for the site a rollout waits on), feeds ``Seen``/``Lost``/``ProbeDone``
to the book and carries out its ``Publish``/``Probe``/``Restore`` commands.
A fog here accepts a release the way ``fog_broker`` does (only increasing
versions; ``release:NAME`` workloads switch to the new bytes as a new workload
version, make-before-break in the real controller).

Sites never talk to each other, so they run conservatively: a site is only
advanced up to the time of the next coordinator event that involves it, and
between those it processes its own events in one batch. The coordinator's
events are few (polls, summaries, rollout ticks); the sites' are many. A run
is deterministic for a scenario's seed.
"""
from __future__ import annotations

import heapq
import itertools
import resource
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from cloud_coordinator.rollout import (
    TERMINAL,
    Command,
    Lost,
    NewRelease,
    Note,
    Probe,
    ProbeDone,
    ProbeSample,
    Publish,
    Restore,
    Restored,
    RolloutBook,
    RolloutClock,
    Seen,
    Step,
    awaited_site,
    held_site,
    model_ref,
    site_view,
)

from .des import SimResult
from .multisite_result import MultiSiteResult, SiteReport
from .scenario import Scenario, ScenarioError
from .sim_site import SimSite, build_site, release_sha
from .sites_config import MultiSiteConfig, ReleasePlan, ScenarioEvent, parse_sites, site_names

__all__ = [
    "MultiSiteResult",
    "MultiSiteSim",
    "SimSite",
    "SiteReport",
    "build_site",
    "release_sha",
    "run_multisite",
]


class MultiSiteSim:
    """The coordinator's loop over simulated time; see the module docstring."""

    def __init__(self, scenario: Scenario, config: MultiSiteConfig, *, clock: Callable[[], float],
                 duration_s: float | None = None) -> None:
        self.scenario, self.config, self._clock = scenario, config, clock
        self.duration = duration_s or scenario.duration_s
        self.sites = {n: build_site(scenario, i, n, clock=clock, duration_s=self.duration)
                      for i, n in enumerate(config.names)}
        for s in self.sites.values():
            s.link.max_queued = config.max_queued
        self.book = RolloutBook(config.names, config.canary, config.policy)
        self.book_clock = RolloutClock(config.policy.outage_grace_s)
        self.shas: dict[tuple[str, int], str] = {}
        self.counters: Counter[str] = Counter()
        self.notes: list[tuple[float, str, str]] = []
        self.published_at: dict[int, dict[str, float]] = {}   # version -> site -> first Publish
        self.finished_at: float | None = None
        self.started_at: float | None = None
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._poll_token: dict[str, int] = dict.fromkeys(self.sites, 0)
        self._poll_due: dict[str, float] = {}
        self._fast: set[str] = set()
        self._ticking = False
        self.events = 0

    def _now(self, t: float) -> float:
        """The book's time, as ``SiteService`` gives it: standing still while the canary under check is cut off."""
        site = held_site(self.book)
        return self.book_clock.now(t, site is not None and site in self.sites and not self.sites[site].link.up)

    def _push(self, t: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def _site(self, name: str, now: float) -> SimSite:
        """The site brought up to ``now`` (every one of its events at or before it processed)."""
        s = self.sites[name]
        s.sim.advance(now)
        return s

    def _poll_at(self, name: str, t: float) -> None:
        self._poll_token[name] += 1
        self._poll_due[name] = t
        self._push(t, "poll", (name, self._poll_token[name]))

    # ------------------------------------------------------------ run

    def run(self) -> MultiSiteResult:
        cfg, n = self.config, self.config.count
        wall0, cpu0 = self._clock(), time.process_time()
        for s in self.sites.values():
            s.sim.start()
        for i, name in enumerate(self.sites):
            self._poll_at(name, cfg.poll_s * (i + 1) / n)  # staggered, as independent links would be
            self._push(cfg.summary_interval_s * (i + 1) / n, "summary", name)
        for ev in cfg.events:
            self._push(ev.at_s, "event", ev)
        names = sorted({r for s in self.sites.values() for r in s.follows.values()})
        for rel in names:  # what every site runs at the start: adopted as rolled out
            self.shas[(rel, 1)] = release_sha(rel, 1)
            self.book.handle(NewRelease(rel, 1, self.shas[(rel, 1)], f"{rel}-v1.release", published=True), 0.0)
        if cfg.release is not None:
            self._push(cfg.release.at_s, "release", cfg.release)
        heap = self._heap
        while heap and heap[0][0] <= self.duration:
            t, _, kind, payload = heapq.heappop(heap)
            self.events += 1
            getattr(self, f"_on_{kind}")(t, payload)
            if self.book.busy or self._fast:
                self._after(t)
        for s in self.sites.values():
            s.sim.advance(self.duration)
        results = {name: s.sim.finish() for name, s in self.sites.items()}
        wall = self._clock() - wall0
        return MultiSiteResult(
            name=self.scenario.name, sites=tuple(self._report(self.sites[k], r) for k, r in results.items()),
            sim_s=self.duration, wall_s=wall, cpu_s=time.process_time() - cpu0,
            site_events=sum(r.events for r in results.values()),
            coordinator_events=self.events, adverts=sum(r.adverts for r in results.values()),
            peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            rollout=self._rollout_report(), coordinator=dict(self.counters), notes=tuple(self.notes))

    # ------------------------------------------------------------ coordinator events

    def _on_poll(self, t: float, payload: tuple[str, int]) -> None:
        name, token = payload
        if token != self._poll_token[name]:
            return  # superseded by a sooner poll
        s = self._site(name, t)
        self.counters["polls"] += 1
        if s.link.up:
            fast = name in self._fast
            view = site_view(s.status(with_devices=fast))
            self._execute(self.book.handle(Seen(name, view), self._now(t)), t)
        else:
            self.counters["polls_lost"] += 1
            self._execute(self.book.handle(Lost(name, "no status answer: WAN link cut"), self._now(t)), t)
        if self._poll_due.get(name) == t and self._poll_token[name] == token:
            self._poll_at(name, t + (self.config.fast_poll_s if name in self._fast else self.config.poll_s))

    def _on_summary(self, t: float, name: str) -> None:
        s = self._site(name, t)
        s.link.send(s.summary(t))
        self._push(t + self.config.summary_interval_s, "summary", name)

    def _on_event(self, t: float, ev: ScenarioEvent) -> None:
        for name in ev.sites:
            s = self._site(name, t)
            repairs = s.sim.controller.counters["repairs"]
            if ev.kind == "cut":
                if s.link.cut(t, repairs):
                    self.notes.append((t, "warning", f"WAN link of {name} cut"))
            elif ev.kind == "restore":
                drained = s.link.restore(t, repairs)
                if s.link.cuts and s.link.cuts[-1].restored_at == t:
                    self.notes.append((t, "info", f"WAN link of {name} restored: {len(drained)} summaries drained"))
                    self._poll_at(name, t)  # a reconnecting link polls at once
            elif ev.kind == "crash":
                s.sim.inject(t, partial(s.sim.mass_failure, fraction=ev.fraction))

    def _on_release(self, t: float, plan: ReleasePlan) -> None:
        self.shas[(plan.name, plan.version)] = release_sha(plan.name, plan.version)
        self.started_at = t
        self._execute(self.book.handle(NewRelease(plan.name, plan.version, self.shas[(plan.name, plan.version)],
                                                  f"{plan.name}-v{plan.version}.release"), self._now(t)), t)

    def _on_probe(self, t: float, cmd: Probe) -> None:
        s = self._site(cmd.site, t)
        self._execute(self.book.handle(ProbeDone(cmd.name, cmd.version, self._samples(s, cmd)), self._now(t)), t)

    def _on_tick(self, t: float, _: Any) -> None:
        self._ticking = False
        self._execute(self.book.tick(self._now(t)), t)

    def _after(self, t: float) -> None:
        """Keep the book ticking while it is busy and the site it waits on polled fast (``SiteService``)."""
        if self.book.busy and not self._ticking:
            self._ticking = True
            self._push(t + self.config.tick_s, "tick")
        r = self.book.active
        awaited = awaited_site(self.book)
        want: set[str] = {awaited} if awaited is not None else set()
        for name in want - self._fast:
            soon = t if r is not None and r.step is Step.BASELINE else t + self.config.fast_poll_s
            if self._poll_due.get(name, float("inf")) > soon:
                self._poll_at(name, soon)
        self._fast = want
        if self.started_at is not None and self.finished_at is None and self.config.release is not None:
            rel = self.book.find(self.config.release.name, self.config.release.version)
            if rel is not None and rel.step in TERMINAL:
                self.finished_at = t

    # ------------------------------------------------------------ the book's commands

    def _execute(self, cmds: Sequence[Command], t: float) -> None:
        for cmd in cmds:
            if isinstance(cmd, Note):
                self.notes.append((round(t, 3), cmd.level, cmd.text))
            elif isinstance(cmd, Publish):
                self.counters["publishes"] += 1
                self.published_at.setdefault(cmd.version, {}).setdefault(cmd.site, t)
                s = self._site(cmd.site, t)
                if not s.link.up:
                    self.counters["publishes_unsent"] += 1  # not retained: the book republishes
                    continue
                ref = model_ref(self.shas[(cmd.name, cmd.version)])
                lat = self.config.wan_latency_s
                s.sim.inject(t + lat, partial(s.accept, cmd.name, cmd.version, ref))
                if self._poll_due.get(cmd.site, float("inf")) > t + 2 * lat:
                    self._poll_at(cmd.site, t + 2 * lat)  # the link polls once the broker acked the send
            elif isinstance(cmd, Probe):
                self.counters["probes"] += 1
                self._push(t + self.config.probe_s, "probe", cmd)
            elif isinstance(cmd, Restore):
                # the outbox gets the previous model's bytes as a new, higher version (``SiteService``)
                self.counters["restores"] += 1
                restores = cmd.candidates[0]
                as_version = max(v for (n, v) in self.shas if n == cmd.name) + 1
                self.shas[(cmd.name, as_version)] = self.shas[(cmd.name, restores)]
                self._execute(self.book.handle(Restored(cmd.name, cmd.version, as_version, restores), self._now(t)), t)

    def _samples(self, s: SimSite, cmd: Probe) -> tuple[ProbeSample, ...]:
        """The held-out batch through the canary: answered when a chain serves; the scenario says how it
        compares (``canary_check``) — the simulation has no tensors, the verdict is the real ``judge_probe``."""
        p, plan = self.config.policy, self.config.release
        check = plan.canary_check if plan is not None and cmd.version == plan.version else "pass"
        ctl = s.sim.controller
        out = []
        for w in cmd.workloads:
            e = ctl.workloads.get(w)
            pred = min((r.latency_s for r in e.replicas if r.latency_s is not None), default=0.01) if e else 0.01
            serving = bool(ctl.chains(w))
            for k in range(p.probe_requests):
                if not s.link.up:
                    out.append(ProbeSample(w, False, "not sent: the site went away or the probe ran out of time"))
                elif not serving:
                    out.append(ProbeSample(w, False, f"workload {w}: no healthy chain"))
                else:
                    lat = pred * (1.0 + 0.2 * k / p.probe_requests)
                    if check == "latency":
                        lat = 2 * (p.latency_factor * pred + p.latency_slack_s)
                    out.append(ProbeSample(w, True, "", "output 'y' differs (max |err| 0.25)"
                                           if check == "outputs" else "", lat))
        return tuple(out)

    # ------------------------------------------------------------ report

    def _report(self, s: SimSite, r: SimResult) -> SiteReport:
        link = s.link
        cuts = tuple({"cut_at_s": c.cut_at, "restored_at_s": c.restored_at, "queued": c.queued,
                      "drained": c.drained, "repairs_while_cut": c.repairs_after - c.repairs_before
                      if c.restored_at is not None else None} for c in link.cuts)
        rel: dict[str, Any] = {}
        for version in sorted(set(s.accepted_at) | {v for v, m in self.published_at.items() if s.name in m}):
            rel[f"v{version}"] = {"published_s": _r(self.published_at.get(version, {}).get(s.name)),
                                  "accepted_s": _r(s.accepted_at.get(version)),
                                  "switched_s": _r(s.switched_at.get(version))}
        avail = list(r.availability.values())
        return SiteReport(
            site=s.name, devices=len(s.sim.devices), crashes=r.crashes, placements=r.counters.get("deploys", 0),
            repairs=r.counters.get("repairs", 0), events=r.events,
            workloads_running=sum(1 for v in r.workload_status.values() if v == "running"),
            workloads=len(r.workload_status), availability_min=min(avail) if avail else None,
            summaries={"sent": link.sent, "delivered": link.delivered, "queued": link.queued,
                       "drained": link.drained, "dropped": link.dropped, "waiting": len(link.outbox)},
            cuts=cuts, release=rel)

    def _rollout_report(self) -> dict[str, Any] | None:
        plan = self.config.release
        if plan is None:
            return None
        r = self.book.find(plan.name, plan.version)
        if r is None:
            return {"release": f"{plan.name} v{plan.version}", "step": "not started"}
        timeline = []
        for name in [r.canary, *r.order] if r.canary else []:
            s = self.sites[name]
            timeline.append({"site": name, "state": r.sites[name].state if name in r.sites else "waiting",
                             "published_s": _r(self.published_at.get(plan.version, {}).get(name)),
                             "accepted_s": _r(s.accepted_at.get(plan.version)),
                             "switched_s": _r(s.switched_at.get(plan.version))})
        switched = [x["switched_s"] for x in timeline if x["switched_s"] is not None]
        accepted = [x["accepted_s"] for x in timeline if x["accepted_s"] is not None]
        return {"release": r.label, "canary": r.canary, "canary_check": plan.canary_check, "step": r.step.value,
                "reason": r.reason, "cause": r.cause, "checks": list(r.checks), "rollback": r.rollback,
                "released_at_s": plan.at_s, "finished_at_s": _r(self.finished_at),
                "sites_accepted": len(accepted), "sites_switched": len(switched),
                "last_accepted_s": max(accepted) if accepted else None,
                "last_switched_s": max(switched) if switched else None, "timeline": timeline}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def run_multisite(scenario: Scenario, *, clock: Callable[[], float], duration_s: float | None = None,
                  sites: int | None = None) -> MultiSiteResult:
    """Run a scenario with a ``[sites]`` table; ``sites`` overrides its count (a smaller run for a quick
    look: events keep only the sites it has, and an event left with none is dropped)."""
    if not scenario.sites:
        raise ScenarioError(f"scenario {scenario.name} has no [sites] table")
    raw = dict(scenario.sites)
    if sites is not None:
        raw["count"] = sites
        names = set(site_names(sites))
        kept = []
        for e in raw.get("events") or []:
            if isinstance(e, dict) and isinstance(e.get("sites"), list):
                e = {**e, "sites": [x for x in e["sites"] if x in names]}
                if not e["sites"]:
                    continue
            kept.append(e)
        raw["events"] = kept
    return MultiSiteSim(scenario, parse_sites(raw), clock=clock, duration_s=duration_s).run()
