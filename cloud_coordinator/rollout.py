"""Staged release rollout across sites (pure): canary first, checked, then the others in order.

A release (name, version, sha256) goes through these steps, one rollout at a
time (a newer queued release of the same name supersedes an older one that
has not started):

============  ==================================================================  =========================
step          waits for                                                           then
============  ==================================================================  =========================
``baseline``  a status of the canary (what it runs now: the release's previous   ``canary`` (publish there)
              model and the workloads that follow it)
``canary``    the canary's status to list the new version (``releases``)           ``switch``
``switch``    every workload that ran the previous model to run the new one       ``probe``
              (model, a new workload version, all replicas healthy, no device
              still reporting the old version)
``probe``     the adapter's held-out batch through the canary: every request      ``rolling``
              answered, outputs equal to the coordinator's own run, p50 latency
              within ``latency_factor`` x predicted + ``latency_slack_s``
``rolling``   each other site in order to list the new version (bounded wait      ``done``
              per site; a site that does not confirm is recorded and skipped)
``rollback``  the canary to list the previous model published as a new version   ``rolled back``
============  ==================================================================  =========================

A canary where no workload runs the release (a first release) has nothing to
check: ``switch`` holds, saying so in ``waiting_for``, until a workload there
runs the new bytes (then it is checked like any other) or ``serve_timeout_s``;
only ``allow_unchecked_canary`` lets it go on unchecked, and says so in its checks.
Any failed or timed-out canary check goes to ``rollback``. Fogs accept only
increasing versions of a name, so a rollback republishes the previous
model's bytes under a new, higher version (the adapter writes that file:
``Restore`` -> ``Restored``). A rollout stops as ``failed`` (nothing rolled
back) when the canary refused the release, never answered before it was
published, or there is no earlier release to go back to; as ``unchanged``
(nothing published, nothing rolled back) when the canary already runs the
release's bytes under an earlier version: the same model is not a new one.

Time is a parameter (``now``, monotonic seconds); every wait is bounded by
``RolloutPolicy``. The book round-trips through JSON, and ``resume(now)``
restarts the current step's wait after a coordinator restart. What the book waits and judges by
(``rollout_policy``), what it reads of a site and how it judges the canary (``rollout_checks``) and what it
hears and asks for (``rollout_events``) live beside it; this module re-exports them.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from runtime.errors import LocalViolation

from .rollout_checks import (
    ProbeSample,
    SiteView,
    WorkloadView,
    compare_outputs,
    judge_probe,
    site_view,
)
from .rollout_events import (
    Command,
    Event,
    Lost,
    NewRelease,
    Note,
    Probe,
    ProbeDone,
    Publish,
    Restore,
    Restored,
    RestoreFailed,
    Seen,
)
from .rollout_policy import RolloutPolicy

__all__ = [
    "Step", "TERMINAL", "RolloutPolicy", "WorkloadView", "SiteView", "site_view", "ProbeSample", "compare_outputs",
    "judge_probe", "NewRelease", "Seen", "Lost", "ProbeDone", "Restored", "RestoreFailed", "Publish", "Probe",
    "Restore", "Note", "SiteStep", "Rollout", "RolloutBook", "model_ref", "ROLLBACK_KEY", "RESTORES_KEY",
    "RolloutClock", "awaited_site", "held_site", "OUTAGE_GRACE_S",
]

ROLLBACK_KEY = "rollback-of"   # release metadata of a rollback: the version it undoes
RESTORES_KEY = "restores"      # ... and the version whose bytes it carries
_KEEP_FINISHED = 100           # finished rollouts kept in the book (the newest)


class Step(Enum):
    QUEUED = "queued"
    BASELINE = "baseline"
    CANARY = "canary"
    SWITCH = "switch"
    PROBE = "probe"
    ROLLING = "rolling"
    ROLLBACK = "rollback"
    DONE = "done"
    ROLLED_BACK = "rolled back"
    FAILED = "failed"
    SUPERSEDED = "superseded"
    UNCHANGED = "unchanged"  # the canary already runs these bytes: nothing new to release, nothing to roll back


TERMINAL = frozenset({Step.DONE, Step.ROLLED_BACK, Step.FAILED, Step.SUPERSEDED, Step.UNCHANGED})


def model_ref(sha256: str) -> str:
    """How a fog names the stored bytes of a release (``releases[NAME].model``, a workload's ``model``)."""
    return f"file:{sha256}"


# ------------------------------------------------------------------ state


@dataclass(slots=True)
class SiteStep:
    """One site within a rollout: waiting, published, accepted, refused, timeout, catching up or skipped."""

    state: str = "waiting"
    detail: str = ""
    refusals: dict[str, int] | None = None   # the site's refusal counters before we published
    since: float = 0.0                       # (not persisted: restarted by resume)
    last_publish: float = -math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "detail": self.detail, "refusals": self.refusals}


@dataclass(slots=True)
class Rollout:
    name: str
    version: int
    sha256: str
    file: str
    step: Step = Step.QUEUED
    canary: str = ""
    order: list[str] = field(default_factory=list)     # the other sites, in rollout order
    sites: dict[str, SiteStep] = field(default_factory=dict)
    reason: str = ""                                   # why it stopped (or what it could not do)
    cause: str = ""                                    # the failed check behind a rollback
    checks: list[str] = field(default_factory=list)    # what passed, one line each
    baseline: dict[str, Any] | None = None             # {"version", "model", "followers": {wl: ver}, "refusals"}
    rollback: dict[str, int] | None = None             # {"restores", "as_version"}
    next_site: int = 0
    waiting_for: str = ""                              # what the current step still waits for
    since: float = 0.0
    last_publish: float = -math.inf

    @property
    def ref(self) -> str:
        return model_ref(self.sha256)

    @property
    def label(self) -> str:
        return f"{self.name} v{self.version}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "sha256": self.sha256, "file": self.file,
                "step": self.step.value, "canary": self.canary, "order": list(self.order),
                "sites": {s: st.to_dict() for s, st in self.sites.items()}, "reason": self.reason,
                "cause": self.cause, "checks": list(self.checks), "baseline": self.baseline,
                "rollback": self.rollback, "next_site": self.next_site, "waiting_for": self.waiting_for}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Rollout:
        r = cls(str(d["name"]), int(d["version"]), str(d["sha256"]), str(d["file"]), Step(d["step"]),
                str(d.get("canary", "")), [str(s) for s in d.get("order", [])])
        for s, st in dict(d.get("sites") or {}).items():
            r.sites[str(s)] = SiteStep(str(st.get("state", "waiting")), str(st.get("detail", "")),
                                       dict(st["refusals"]) if st.get("refusals") is not None else None)
        r.reason, r.cause = str(d.get("reason", "")), str(d.get("cause", ""))
        r.checks = [str(c) for c in d.get("checks", [])]
        r.baseline = dict(d["baseline"]) if d.get("baseline") is not None else None
        r.rollback = {k: int(v) for k, v in dict(d["rollback"]).items()} if d.get("rollback") else None
        r.next_site, r.waiting_for = int(d.get("next_site", 0)), str(d.get("waiting_for", ""))
        return r


def _grown(before: Mapping[str, int] | None, after: Mapping[str, int]) -> str:
    """The refusal reason whose counter grew since ``before`` ('' if none, or no baseline).

    "stale" is never ours: a fog refuses a version as stale only when it lists that version
    or a newer one, which the caller sees first; it is a duplicate of some earlier publish.
    """
    if before is None:
        return ""
    for k in sorted(after):
        why = k.split(":", 1)[1] if ":" in k else k
        if why not in ("stale", "retained") and after[k] > int(before.get(k, 0)):
            return why
    return ""


class RolloutBook:
    """Every release's rollout, one active at a time; ``handle(event, now)``/``tick(now)`` return commands."""

    def __init__(self, sites: Sequence[str], canary: str, policy: RolloutPolicy | None = None) -> None:
        if not sites:
            raise LocalViolation("a rollout needs at least one site")
        if canary not in sites:
            raise LocalViolation(f"unknown canary site {canary!r} (sites: {', '.join(sites)})")
        self.sites = list(sites)
        self.canary = canary
        self.policy = policy or RolloutPolicy()
        self.rollouts: list[Rollout] = []
        self.good: dict[str, int] = {}        # name -> the newest version that completed a rollout
        self.seen: set[str] = set()           # outbox files already taken in
        self.views: dict[str, SiteView] = {}
        self.errors: dict[str, str] = {}
        self.dirty = False

    # -------------------------------------------------------------- queries

    @property
    def active(self) -> Rollout | None:
        return next((r for r in self.rollouts if r.step not in TERMINAL and r.step is not Step.QUEUED), None)

    @property
    def busy(self) -> bool:
        """A rollout runs or waits to run."""
        return any(r.step not in TERMINAL for r in self.rollouts)

    def find(self, name: str, version: int) -> Rollout | None:
        return next((r for r in self.rollouts if r.name == name and r.version == version), None)

    # -------------------------------------------------------------- persistence

    def to_json(self) -> dict[str, Any]:
        return {"format": 1, "canary": self.canary, "sites": self.sites, "good": dict(sorted(self.good.items())),
                "seen": sorted(self.seen), "rollouts": [r.to_dict() for r in self.rollouts]}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], sites: Sequence[str], canary: str,
                  policy: RolloutPolicy | None = None) -> RolloutBook:
        """The persisted book under the current site table; ``ValueError`` if it is not one."""
        if not isinstance(doc, Mapping) or doc.get("format") != 1:
            raise ValueError("not a rollout book (format 1)")
        book = cls(sites, canary, policy)
        try:
            book.good = {str(k): int(v) for k, v in dict(doc.get("good") or {}).items()}
            book.seen = {str(f) for f in doc.get("seen") or ()}
            book.rollouts = [Rollout.from_dict(d) for d in doc.get("rollouts") or ()]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed rollout ({type(exc).__name__}: {exc})") from None
        return book

    def resume(self, now: float) -> list[Command]:
        """After a restart: the current step waits afresh, publishes are repeated, a probe is re-run."""
        r = self.active
        if r is None:
            return self._start_next(now)
        out: list[Command] = [Note(f"{r.label}: resuming the rollout at step {r.step.value}")]
        r.since, r.last_publish = now, -math.inf
        for st in r.sites.values():
            st.since, st.last_publish = now, -math.inf
        if r.canary not in self.sites:
            return out + self._stop(r, Step.FAILED, f"canary {r.canary} is no longer a configured site", now)
        if r.step is Step.PROBE:
            out.append(Probe(r.canary, r.name, r.version, tuple(sorted(r.baseline["followers"]))
                             if r.baseline else ()))
        elif r.step is Step.ROLLBACK and r.rollback is None:
            out.extend(self._restore_cmd(r, now))
        return out + self.tick(now)

    # -------------------------------------------------------------- events

    def handle(self, ev: Event, now: float) -> list[Command]:
        out = self._handle(ev, now)
        if self.active is None and not isinstance(ev, (NewRelease, Lost)):
            out += self._start_next(now)
        return out

    def _handle(self, ev: Event, now: float) -> list[Command]:
        if isinstance(ev, NewRelease):
            return self._new(ev, now)
        if isinstance(ev, Lost):
            self.errors[ev.site] = ev.error
            return []
        if isinstance(ev, Seen):
            self.views[ev.site] = ev.view
            self.errors.pop(ev.site, None)
            return self._catch_up(ev.site, ev.view, now) + self._seen(ev.site, ev.view, now)
        r = self.active
        if r is None or (ev.name, ev.version) != (r.name, r.version):
            return []  # about a rollout that already moved on (a late probe, a restore after a restart)
        if isinstance(ev, ProbeDone) and r.step is Step.PROBE:
            return self._probed(r, ev.samples, now)
        if isinstance(ev, Restored) and r.step is Step.ROLLBACK and r.rollback is None:
            r.rollback = {"restores": ev.restores, "as_version": ev.as_version}
            r.since, r.last_publish = now, now
            seen = self.views.get(r.canary)
            r.sites[r.canary].refusals = dict(seen.refusals) if seen is not None else None
            r.waiting_for = f"canary {r.canary} to list v{ev.as_version}"
            self.dirty = True
            return [Note(f"{r.label}: rolling back canary {r.canary} to v{ev.restores}'s model as "
                         f"v{ev.as_version}", "warning"), Publish(r.canary, r.name, ev.as_version)]
        if isinstance(ev, RestoreFailed) and r.step is Step.ROLLBACK and r.rollback is None:
            return self._stop(r, Step.FAILED, f"{r.cause}; cannot roll back ({ev.reason}): canary {r.canary} "
                                               f"keeps v{r.version}", now)
        return []

    def tick(self, now: float) -> list[Command]:
        """Timeouts and republishing; starts the next queued rollout when none runs."""
        r = self.active
        if r is None:
            return self._start_next(now)
        p = self.policy
        waited = now - r.since
        err = self._err(r.canary)
        out: list[Command] = []
        if r.step is Step.BASELINE and waited > p.baseline_timeout_s:
            out = self._stop(r, Step.FAILED, f"canary {r.canary} did not answer within {p.baseline_timeout_s:g} s"
                                             f"{err}; {r.label} was not released anywhere", now)
        elif r.step is Step.CANARY:
            if waited > p.accept_timeout_s:
                out = self._rollback(r, f"canary {r.canary} did not list {r.label} within {p.accept_timeout_s:g} s"
                                        f"{err}", now)
            else:
                out = self._republish(r, r.canary, r.version, now)
        elif r.step is Step.SWITCH and waited > p.serve_timeout_s:
            out = self._rollback(r, f"canary {r.canary} does not serve {r.label} after {p.serve_timeout_s:g} s "
                                    f"({r.waiting_for or 'no status'}){err}", now)
        elif r.step is Step.PROBE and waited > p.probe_timeout_s:
            held = bool(r.baseline and r.baseline.get("probe_samples"))
            out = self._rollback(r, f"canary {r.canary}: {r.waiting_for} after {p.probe_timeout_s:g} s{err}" if held
                                 else f"canary {r.canary}: the held-out batch was not answered within "
                                      f"{p.probe_timeout_s:g} s{err}", now)
        elif r.step is Step.ROLLING:
            site = r.order[r.next_site]
            st = r.sites[site]
            if now - st.since > p.site_timeout_s:
                st.state, st.detail = "timeout", f"did not list v{r.version} within {p.site_timeout_s:g} s" \
                                                 f"{self._err(site)}"
                self.dirty = True
                out = [Note(f"{r.label}: site {site} {st.detail}; going on", "warning")]
                r.next_site += 1
                out += self._advance(r, now)
            else:
                out = self._republish(r, site, r.version, now, st)
        elif r.step is Step.ROLLBACK:
            limit = p.rollback_timeout_s
            if waited > limit:
                what = (f"the rollback to v{r.rollback['restores']}'s model (v{r.rollback['as_version']}) was not "
                        f"confirmed within {limit:g} s{err}" if r.rollback else
                        f"the rollback release was not written within {limit:g} s")
                out = self._stop(r, Step.FAILED, f"{r.cause}; {what}: canary {r.canary} may still run "
                                                 f"v{r.version}", now)
            elif r.rollback is not None:
                out = self._republish(r, r.canary, r.rollback["as_version"], now)
        if self.active is None:
            out += self._start_next(now)
        return out

    # -------------------------------------------------------------- steps

    def _err(self, site: str) -> str:
        e = self.errors.get(site)
        return f" (last error: {e})" if e else ""

    def _new(self, ev: NewRelease, now: float) -> list[Command]:
        if ev.file in self.seen or self.find(ev.name, ev.version) is not None:
            self.seen.add(ev.file)
            return []
        self.seen.add(ev.file)
        self.dirty = True
        r = Rollout(ev.name, ev.version, ev.sha256, ev.file)
        self.rollouts.append(r)
        if ev.published:
            r.step, r.reason = Step.DONE, "published before staged rollouts"
            self.good[ev.name] = max(self.good.get(ev.name, 0), ev.version)
            return []
        newest = max((x.version for x in self.rollouts
                      if x.name == ev.name and x is not r and x.step not in (Step.QUEUED, Step.SUPERSEDED)),
                     default=0)
        if ev.version <= newest:
            r.step, r.reason = Step.SUPERSEDED, f"v{newest} of {ev.name} was rolled out already"
            return [Note(f"{r.label}: skipped: {r.reason}")]
        return [Note(f"{r.label}: queued for a staged rollout")] + (self._start_next(now) if self.active is None
                                                                     else [])

    def _start_next(self, now: float) -> list[Command]:
        queued = [r for r in self.rollouts if r.step is Step.QUEUED]
        if not queued or self.active is not None:
            return []
        name = queued[0].name
        mine = [r for r in queued if r.name == name]
        r = max(mine, key=lambda x: x.version)
        out: list[Command] = []
        for old in mine:
            if old is not r:
                old.step, old.reason = Step.SUPERSEDED, f"superseded by v{r.version} before it started"
                out.append(Note(f"{old.label}: {old.reason}"))
        r.canary = self.canary
        r.order = [s for s in self.sites if s != self.canary]
        r.sites = {s: SiteStep(since=now) for s in [self.canary, *r.order]}
        r.step, r.since, r.waiting_for = Step.BASELINE, now, f"a status of canary {self.canary}"
        self.dirty = True
        then = f", then {', '.join(r.order)}" if r.order else ""
        out.append(Note(f"{r.label}: staged rollout: canary {self.canary}{then}"))
        return out

    def _seen(self, site: str, view: SiteView, now: float) -> list[Command]:
        r = self.active
        if r is None:
            return []
        rel = view.releases.get(r.name)
        if site == r.canary:
            if r.step is Step.BASELINE:
                return self._baseline(r, view, now)
            if r.step is Step.CANARY:
                return self._canary(r, view, rel, now)
            if r.step is Step.SWITCH:
                return self._switch(r, view, now)
            if r.step is Step.PROBE and r.baseline and r.baseline.get("probe_samples"):
                return self._rejudge(r, view, now)
            if r.step is Step.ROLLBACK and r.rollback is not None:
                if rel is not None and rel[0] >= r.rollback["as_version"]:
                    return self._stop(r, Step.ROLLED_BACK, f"{r.cause}; rolled back: canary {r.canary} runs "
                                                           f"v{r.rollback['restores']}'s model again (as "
                                                           f"v{rel[0]})", now)
                why = _grown(r.sites[r.canary].refusals, view.refusals)
                if why:
                    return self._stop(r, Step.FAILED, f"{r.cause}; canary {r.canary} refused the rollback ({why}): "
                                                      f"it keeps v{r.version}", now)
        elif r.step is Step.ROLLING and r.order[r.next_site] == site:
            st = r.sites[site]
            if rel is not None and rel[0] >= r.version:
                st.state = "accepted"
                st.detail = "" if rel[0] == r.version else f"lists v{rel[0]}, newer"
                self.dirty = True
                r.next_site += 1
                return [Note(f"{r.label}: site {site} has it")] + self._advance(r, now)
            why = _grown(st.refusals, view.refusals)
            if why:
                st.state, st.detail = "refused", why
                self.dirty = True
                r.next_site += 1
                return [Note(f"{r.label}: site {site} refused it: {why}", "warning")] + self._advance(r, now)
        return []

    def _catch_up(self, site: str, view: SiteView, now: float) -> list[Command]:
        """A site that was away when a release went out (timed out, skipped) gets it once it answers again.

        Only releases whose rollout finished (``DONE``: checked at the canary) and only the newest
        of each name; republished every ``publish_retry_s`` until the site lists it.
        """
        out: list[Command] = []
        for r in self.rollouts:
            if r.step is not Step.DONE or self.good.get(r.name) != r.version:
                continue
            st = r.sites.get(site)
            if st is None or st.state not in ("timeout", "catching up"):
                continue
            rel = view.releases.get(r.name)
            if rel is not None and rel[0] >= r.version:
                st.state, st.detail = "accepted", "caught up after it was away"
                bad = [f"{s}: {r.sites[s].state} ({r.sites[s].detail})" for s in r.order
                       if r.sites[s].state != "accepted"]
                r.reason = f"not on {'; '.join(bad)}" if bad else ""   # what is still missing, not history
                self.dirty = True
                out.append(Note(f"{r.label}: site {site} caught up"))
            elif now - st.last_publish >= self.policy.publish_retry_s:
                if st.state != "catching up":
                    out.append(Note(f"{r.label}: site {site} answers again: publishing it there"))
                st.state, st.detail, st.last_publish = "catching up", "published when it answered again", now
                self.dirty = True
                out.append(Publish(site, r.name, r.version))
        return out

    def _baseline(self, r: Rollout, view: SiteView, now: float) -> list[Command]:
        rel = view.releases.get(r.name)
        if rel is not None and rel[0] > r.version:
            return self._stop(r, Step.FAILED, f"canary {r.canary} already lists {r.name} v{rel[0]}, newer than "
                                              f"v{r.version}; nothing was released", now)
        if rel is not None and rel[0] == r.version and rel[1] != r.ref:
            return self._stop(r, Step.FAILED, f"canary {r.canary} already lists {r.label} with other bytes; "
                                              f"release it as a version above {r.version}", now)
        if rel is not None and rel[0] < r.version and rel[1] == r.ref:
            return self._stop(r, Step.UNCHANGED, f"unchanged, not released: canary {r.canary} already runs these "
                                                 f"bytes as v{rel[0]}", now)
        followers: dict[str, int | None] = {}
        if rel is not None and rel[0] == r.version:
            # it has this very version already (a restart before the book was saved, or a hand release)
            followers = {w.name: None for w in view.workloads if w.model == r.ref}
        elif rel is not None:
            followers = {w.name: w.version for w in view.workloads if w.model == rel[1] and w.status == "running"}
        r.baseline = {"version": rel[0] if rel else None, "model": rel[1] if rel else None,
                      "followers": followers, "refusals": dict(view.refusals)}
        st = r.sites[r.canary]
        st.state, st.refusals, st.since, st.last_publish = "published", dict(view.refusals), now, now
        r.step, r.since, r.last_publish = Step.CANARY, now, now
        r.waiting_for = f"canary {r.canary} to list v{r.version}"
        self.dirty = True
        serves = f"; it serves {', '.join(sorted(followers))} from the release" if followers else ""
        prev = f" (it runs v{rel[0]}{serves})" if rel else " (its first release of the name)"
        return [Note(f"{r.label}: published to canary {r.canary}{prev}"), Publish(r.canary, r.name, r.version)]

    def _canary(self, r: Rollout, view: SiteView, rel: tuple[int, str] | None, now: float) -> list[Command]:
        st = r.sites[r.canary]
        if rel is not None and rel[0] == r.version:
            if rel[1] != r.ref:
                return self._stop(r, Step.FAILED, f"canary {r.canary} lists {r.label} with other bytes "
                                                  f"({rel[1][:17]}): released by someone else?", now)
            st.state = "accepted"
            r.checks.append(f"canary {r.canary} accepted v{r.version}")
            r.step, r.since = Step.SWITCH, now
            self.dirty = True
            return [Note(f"{r.label}: canary {r.canary} accepted it")] + self._switch(r, view, now)
        if rel is not None and rel[0] > r.version:
            return self._stop(r, Step.FAILED, f"canary {r.canary} lists {r.name} v{rel[0]}, newer than v{r.version} "
                                              "(released by someone else?)", now)
        why = _grown(st.refusals, view.refusals)
        if why:
            st.state, st.detail = "refused", why
            return self._stop(r, Step.FAILED, f"canary {r.canary} refused {r.label}: {why}", now)
        return []

    def _switch(self, r: Rollout, view: SiteView, now: float) -> list[Command]:
        base = r.baseline or {}
        followers: dict[str, int | None] = dict(base.get("followers") or {})
        gone = [w for w in followers if view.workload(w) is None]
        for w in gone:
            followers.pop(w)
            r.checks.append(f"workload {w} was deleted at canary {r.canary} during the rollout")
        if gone:
            base["followers"] = followers
            self.dirty = True
        if not followers:
            if self.policy.require_serving:
                return self._rollback(r, f"canary {r.canary} serves no workload from release:{r.name} (deploy one "
                                         "there, or set require_serving = false)", now)
            if self.policy.allow_unchecked_canary:
                r.checks.append(f"canary {r.canary} serves no workload from release:{r.name}: outputs and latency "
                                "not checked (allow_unchecked_canary = true)")
                return self._start_rolling(r, now)
            if not any(s != r.canary for s in self.sites):  # a hold would protect no other site
                r.checks.append(f"canary {r.canary} serves no workload from release:{r.name}: outputs and latency "
                                "not checked (it is the only site: there is no site to hold the release from)")
                return self._start_rolling(r, now)
            # Nothing to probe: hold here (serve_timeout_s bounds it) until a workload there runs these
            # very bytes (a release:NAME workload deployed once the canary listed the release), then check it.
            adopted: dict[str, int | None] = {w.name: None for w in view.workloads if w.model == r.ref}
            if not adopted:
                hold = (f"held: canary {r.canary} serves no workload from release:{r.name}, so outputs and "
                        "latency cannot be checked; deploy one there (or set allow_unchecked_canary = true)")
                if r.waiting_for != hold:
                    r.waiting_for = hold
                    self.dirty = True
                    return [Note(f"{r.label}: {hold}", "warning")]
                return []
            followers = adopted
            base["followers"] = followers
            r.baseline = base
            self.dirty = True
        missing = []
        for w, before in sorted(followers.items()):
            wv = view.workload(w)
            assert wv is not None
            why = wv.switched_to(r.ref, before)
            if why:
                missing.append(f"{w}: {why}")
        if missing:
            if "; ".join(missing) != r.waiting_for:
                r.waiting_for = "; ".join(missing)
                self.dirty = True
            return []
        r.checks.append(f"canary {r.canary} serves it: {', '.join(sorted(followers))}")
        r.step, r.since = Step.PROBE, now
        r.waiting_for = f"the held-out batch through canary {r.canary}"
        self.dirty = True
        return [Note(f"{r.label}: {', '.join(sorted(followers))} switched at canary {r.canary}; sending the "
                     "held-out batch"), Probe(r.canary, r.name, r.version, tuple(sorted(followers)))]

    def _probed(self, r: Rollout, samples: Sequence[ProbeSample], now: float) -> list[Command]:
        view = self.views.get(r.canary, SiteView())
        predicted = {w.name: w.predicted_s for w in view.workloads}
        ok, text = judge_probe(samples, predicted, self.policy)
        if not ok:
            return self._rollback(r, f"canary {r.canary}: {text}", now)
        blind = sorted({s.workload for s in samples if not predicted.get(s.workload)})
        if blind and not self.policy.allow_unchecked_canary:
            # Outputs passed, but latency cannot be judged without the plan's prediction: hold (probe_timeout_s
            # bounds it) until a status of the canary carries one, then judge these very samples.
            base = r.baseline if r.baseline is not None else {}
            base["probe_samples"] = [[s.workload, s.ok, s.error, s.mismatch, s.latency_s] for s in samples]
            r.baseline = base
            r.waiting_for = (f"held: canary {r.canary} has no latency prediction for {', '.join(blind)}, so its "
                             "latency cannot be checked; waiting for one (or set allow_unchecked_canary = true)")
            self.dirty = True
            return [Note(f"{r.label}: {r.waiting_for}", "warning")]
        if blind:
            text += " (latency not checked: allow_unchecked_canary = true)"
        r.checks.append(text)
        self.dirty = True
        return [Note(f"{r.label}: canary {r.canary} passed: {text}")] + self._start_rolling(r, now)

    def _rejudge(self, r: Rollout, view: SiteView, now: float) -> list[Command]:
        """A probe held for want of a latency prediction, judged again once the canary reports one."""
        assert r.baseline is not None
        samples = [ProbeSample(str(w), bool(ok), str(err), str(mis), float(lat))
                   for w, ok, err, mis, lat in r.baseline["probe_samples"]]
        have = {w.name for w in view.workloads if w.predicted_s}
        if not {s.workload for s in samples} <= have:
            return []
        del r.baseline["probe_samples"]
        return self._probed(r, samples, now)

    def _start_rolling(self, r: Rollout, now: float) -> list[Command]:
        r.step, r.since, r.next_site = Step.ROLLING, now, 0
        self.dirty = True
        return self._advance(r, now)

    def _advance(self, r: Rollout, now: float) -> list[Command]:
        while r.next_site < len(r.order):
            site = r.order[r.next_site]
            st = r.sites.setdefault(site, SiteStep())
            if site not in self.sites:
                st.state, st.detail = "skipped", "no longer a configured site"
                r.next_site += 1
                continue
            view = self.views.get(site)
            st.state, st.since, st.last_publish = "published", now, now
            st.refusals = dict(view.refusals) if view is not None else None
            r.since, r.waiting_for = now, f"site {site} to list v{r.version}"
            self.dirty = True
            return [Publish(site, r.name, r.version)]
        good = [r.canary] + [s for s in r.order if r.sites[s].state == "accepted"]
        bad = [f"{s}: {r.sites[s].state} ({r.sites[s].detail})" for s in r.order if r.sites[s].state != "accepted"]
        reason = f"not on {'; '.join(bad)}" if bad else ""
        out = self._stop(r, Step.DONE, reason, now)
        return out[:-1] + [Note(f"{r.label}: rolled out to {', '.join(good)}" + (f"; {reason}" if bad else ""),
                                "warning" if bad else "info")]

    def _rollback(self, r: Rollout, cause: str, now: float) -> list[Command]:
        r.cause, r.step, r.since, r.rollback = cause, Step.ROLLBACK, now, None
        r.waiting_for = "the rollback release"
        self.dirty = True
        cmds = self._restore_cmd(r, now)
        if not cmds:
            return self._stop(r, Step.FAILED, f"{cause}; no earlier release of {r.name} to roll back to: canary "
                                              f"{r.canary} keeps v{r.version}", now)
        return [Note(f"{r.label}: canary check failed: {cause}", "warning")] + cmds

    def _restore_cmd(self, r: Rollout, now: float) -> list[Command]:
        cands: list[int] = []
        prev = (r.baseline or {}).get("version")
        for v in (prev, self.good.get(r.name)):
            if v is not None and v != r.version and v not in cands:
                cands.append(int(v))
        return [Restore(r.name, r.version, tuple(cands))] if cands else []

    def _republish(self, r: Rollout, site: str, version: int, now: float, st: SiteStep | None = None) -> list[Command]:
        holder: Any = st if st is not None else r
        if now - holder.last_publish >= self.policy.publish_retry_s:
            holder.last_publish = now
            return [Publish(site, r.name, version)]
        return []

    def _stop(self, r: Rollout, step: Step, reason: str, now: float) -> list[Command]:
        r.step, r.reason, r.waiting_for = step, reason, ""
        if step is Step.DONE:
            self.good[r.name] = max(self.good.get(r.name, 0), r.version)
        self.dirty = True
        finished = [x for x in self.rollouts if x.step in TERMINAL]
        if len(finished) > _KEEP_FINISHED:
            drop = {id(x) for x in finished[:len(finished) - _KEEP_FINISHED]}
            self.rollouts = [x for x in self.rollouts if id(x) not in drop]
        level = "info" if step is Step.DONE else "warning"
        return [Note(f"{r.label}: {step.value}" + (f": {reason}" if reason else ""), level)]


# the longest cut a rollout waits out per outage (the default; a slots class has no class-level value)
OUTAGE_GRACE_S = RolloutPolicy().outage_grace_s


class RolloutClock:
    """The rollout book's ``now``: monotonic time less the time the awaited site was cut off.

    Each outage is left out up to ``grace_s`` (so every wait stays bounded: a site cut off for
    good times out ``grace_s`` later than it would have). Continuous and never decreasing, so
    the book's ``since``/``last_publish`` stamps stay comparable across a cut.
    """

    def __init__(self, grace_s: float = OUTAGE_GRACE_S) -> None:
        self.grace_s = grace_s
        self.left_out = 0.0              # outage time of closed outages not counted
        self._open: float | None = None  # when the current outage began

    def now(self, mono: float, cut: bool) -> float:
        """The book's time at monotonic ``mono``; ``cut``: the site the rollout waits on is cut off now."""
        if cut and self._open is None:
            self._open = mono
        elif not cut and self._open is not None:
            self.left_out += min(mono - self._open, self.grace_s)
            self._open = None
        held = min(mono - self._open, self.grace_s) if self._open is not None else 0.0
        return mono - self.left_out - held


def held_site(book: RolloutBook) -> str | None:
    """The site whose cut holds the rollout clock: the canary, while its check runs (nothing can go on
    without it). A site cut while the release rolls on to the others times out and is skipped; it
    catches up when it answers again (``RolloutBook._catch_up``), so one cut site never holds a fleet."""
    r = book.active
    return r.canary if r is not None and r.step is not Step.ROLLING else None


def awaited_site(book: RolloutBook) -> str | None:
    """The site the active rollout waits on (the canary, or the site it is rolling out to)."""
    r = book.active
    if r is None:
        return None
    return r.order[r.next_site] if r.step is Step.ROLLING and r.next_site < len(r.order) else r.canary
