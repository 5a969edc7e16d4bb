"""The ``[sites]`` table of a scenario: how many sites, their WAN, link cuts, and a staged release.

Kept apart from the engine so a scenario error names its field before any
fleet is built, and so the multi-site run is described by one frozen record.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cloud_coordinator.rollout import RolloutPolicy
from runtime.errors import LocalViolation

from .scenario import ScenarioError

__all__ = ["CHECKS", "EVENT_KINDS", "MultiSiteConfig", "ReleasePlan", "ScenarioEvent", "parse_sites", "site_names"]

EVENT_KINDS = ("cut", "restore", "crash")
#: How the canary's held-out batch comes out: ``pass``, or the check it fails.
CHECKS = ("pass", "outputs", "latency")


def site_names(count: int) -> list[str]:
    return [f"site-{i:03d}" for i in range(count)]


@dataclass(frozen=True, slots=True)
class ScenarioEvent:
    """At ``at_s``: cut or restore the WAN link of ``sites``, or crash ``fraction`` of their devices at once."""

    at_s: float
    kind: str
    sites: tuple[str, ...]
    fraction: float = 0.1


@dataclass(frozen=True, slots=True)
class ReleasePlan:
    """A new ``version`` of the model ``name`` (sites start on v1) put in the outbox at ``at_s``."""

    name: str
    version: int
    at_s: float
    canary_check: str = "pass"


@dataclass(frozen=True, slots=True)
class MultiSiteConfig:
    count: int
    canary: str
    summary_interval_s: float = 60.0   # each fog's summary to the coordinator
    poll_s: float = 10.0               # the coordinator's status poll of a site (SiteLink.poll_s)
    fast_poll_s: float = 1.0           # ... of the site a rollout waits for (SiteLink.fast_poll_s)
    tick_s: float = 1.0                # the rollout book's timeouts and republishing
    wan_latency_s: float = 0.05        # one way, coordinator <-> fog
    probe_s: float = 2.0               # the held-out batch through the canary
    max_queued: int = 10_000           # summaries a cut site keeps (the oldest go first)
    events: tuple[ScenarioEvent, ...] = ()
    release: ReleasePlan | None = None
    policy: RolloutPolicy = field(default_factory=RolloutPolicy)

    @property
    def names(self) -> list[str]:
        return site_names(self.count)


def _num(d: Mapping[str, Any], key: str, default: float, where: str, *, positive: bool = True) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or \
            (positive and v == 0):
        raise ScenarioError(f"{where}{key}: expected a number {'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


_KEYS = {"count", "canary", "summary_interval_s", "poll_s", "fast_poll_s", "tick_s", "wan_latency_s", "probe_s",
         "max_queued", "events", "release", "rollout"}


def _known(d: Mapping[str, Any], keys: set[str], where: str) -> None:
    """A misspelt key would silently mean its default: name it instead."""
    extra = sorted(set(d) - keys)
    if extra:
        raise ScenarioError(f"{where}{extra[0]}: unknown key (known: {', '.join(sorted(keys))})")


def _event(i: int, e: Any, names: set[str]) -> ScenarioEvent:
    where = f"sites.events[{i}]."
    if not isinstance(e, Mapping):
        raise ScenarioError(f"sites.events[{i}]: expected a table")
    _known(e, {"at_s", "kind", "sites", "fraction"}, where)
    kind = e.get("kind")
    if kind not in EVENT_KINDS:
        raise ScenarioError(f"{where}kind: expected one of {', '.join(EVENT_KINDS)}, got {kind!r}")
    raw = e.get("sites")
    if not isinstance(raw, list) or not raw or not all(isinstance(s, str) for s in raw):
        raise ScenarioError(f"{where}sites: expected a list of site names")
    unknown = [s for s in raw if s not in names]
    if unknown:
        raise ScenarioError(f"{where}sites: unknown site {unknown[0]!r}")
    fraction = _num(e, "fraction", 0.1, where)
    if fraction > 1:
        raise ScenarioError(f"{where}fraction: must be <= 1")
    return ScenarioEvent(_num(e, "at_s", 0.0, where, positive=False), kind, tuple(raw), fraction)


def parse_sites(d: Mapping[str, Any]) -> MultiSiteConfig:
    """The ``[sites]`` table (``ScenarioError`` naming the field when it is wrong)."""
    count = d.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ScenarioError(f"sites.count: expected an integer >= 1, got {count!r}")
    _known(d, _KEYS, "sites.")
    names = site_names(count)
    canary = d.get("canary", names[0])
    if canary not in names:
        raise ScenarioError(f"sites.canary: {canary!r} is not one of site-000 .. {names[-1]}")
    events = tuple(sorted((_event(i, e, set(names)) for i, e in enumerate(d.get("events") or [])),
                          key=lambda e: e.at_s))
    release = None
    rel = d.get("release")
    if rel is not None:
        if not isinstance(rel, Mapping) or not isinstance(rel.get("name"), str):
            raise ScenarioError("sites.release.name: expected a string")
        _known(rel, {"name", "version", "at_s", "canary_check"}, "sites.release.")
        version = rel.get("version", 2)
        if isinstance(version, bool) or not isinstance(version, int) or version < 2:
            raise ScenarioError(f"sites.release.version: expected an integer >= 2 (sites run v1), got {version!r}")
        check = rel.get("canary_check", "pass")
        if check not in CHECKS:
            raise ScenarioError(f"sites.release.canary_check: expected one of {', '.join(CHECKS)}, got {check!r}")
        release = ReleasePlan(rel["name"], version, _num(rel, "at_s", 60.0, "sites.release.", positive=False), check)
    try:
        policy = RolloutPolicy.from_mapping(d.get("rollout") or {})
    except LocalViolation as exc:
        raise ScenarioError(f"sites.rollout: {exc}") from None
    max_queued = d.get("max_queued", 10_000)
    if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 0:
        raise ScenarioError(f"sites.max_queued: expected an integer >= 0, got {max_queued!r}")
    w = "sites."
    return MultiSiteConfig(
        count=count, canary=canary, summary_interval_s=_num(d, "summary_interval_s", 60.0, w),
        poll_s=_num(d, "poll_s", 10.0, w), fast_poll_s=_num(d, "fast_poll_s", 1.0, w),
        tick_s=_num(d, "tick_s", 1.0, w), wan_latency_s=_num(d, "wan_latency_s", 0.05, w, positive=False),
        probe_s=_num(d, "probe_s", 2.0, w, positive=False), max_queued=max_queued, events=events,
        release=release, policy=policy)
