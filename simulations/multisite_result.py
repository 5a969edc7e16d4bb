"""What a multi-site run reports: one record per site and one for the run (plain JSON via ``summary``)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MultiSiteResult", "SiteReport"]


@dataclass(frozen=True, slots=True)
class SiteReport:
    """One site at the end of a run: its churn and repairs, its link's summaries, its release timeline."""

    site: str
    devices: int
    crashes: int
    placements: int          # partition deploys sent (initial plan, repairs, switches)
    repairs: int
    events: int
    workloads_running: int
    workloads: int
    availability_min: float | None
    summaries: dict[str, int]
    cuts: tuple[dict[str, Any], ...]
    release: dict[str, Any]


@dataclass(frozen=True, slots=True)
class MultiSiteResult:
    """A whole run; ``summary`` aggregates the sites (spread of placements and repairs, summaries, cuts)."""

    name: str
    sites: tuple[SiteReport, ...]
    sim_s: float
    wall_s: float
    cpu_s: float             # this process's CPU time: what the run costs on a shared machine
    site_events: int
    coordinator_events: int
    adverts: int
    peak_rss_mb: float
    rollout: dict[str, Any] | None
    coordinator: dict[str, int]
    notes: tuple[tuple[float, str, str], ...]

    @property
    def events(self) -> int:
        return self.site_events + self.coordinator_events

    def summary(self) -> dict[str, Any]:
        def spread(xs: Sequence[float]) -> dict[str, float]:
            s = sorted(xs)
            return {"total": sum(s), "min": s[0], "p50": s[len(s) // 2], "max": s[-1]} if s else {}

        sums = Counter[str]()
        for r in self.sites:
            sums.update(r.summaries)
        cuts = [{"site": r.site, **c} for r in self.sites for c in r.cuts]
        avail = [r.availability_min for r in self.sites if r.availability_min is not None]
        return {
            "scenario": self.name, "sites": len(self.sites), "devices": sum(r.devices for r in self.sites),
            "devices_per_site": self.sites[0].devices if self.sites else 0,
            "workloads_per_site": self.sites[0].workloads if self.sites else 0,
            "sim_hours": round(self.sim_s / 3600, 3), "wall_s": round(self.wall_s, 3), "cpu_s": round(self.cpu_s, 3),
            "events": self.events, "site_events": self.site_events, "coordinator_events": self.coordinator_events,
            "events_per_wall_s": round(self.events / self.wall_s, 1) if self.wall_s else None,
            "events_per_cpu_s": round(self.events / self.cpu_s, 1) if self.cpu_s else None,
            "adverts": self.adverts, "adverts_per_wall_s": round(self.adverts / self.wall_s) if self.wall_s else None,
            "adverts_per_cpu_s": round(self.adverts / self.cpu_s) if self.cpu_s else None,
            "peak_rss_mb": round(self.peak_rss_mb, 1),
            "crashes": sum(r.crashes for r in self.sites),
            "placements_per_site": spread([r.placements for r in self.sites]),
            "repairs_per_site": spread([r.repairs for r in self.sites]),
            "workloads_running": sum(r.workloads_running for r in self.sites),
            "workloads": sum(r.workloads for r in self.sites),
            "availability_min": round(min(avail), 5) if avail else None,
            "summaries": dict(sorted(sums.items())), "cuts": cuts,
            "rollout": self.rollout, "coordinator": dict(sorted(self.coordinator.items())),
            "per_site": [{"site": r.site, "crashes": r.crashes, "placements": r.placements, "repairs": r.repairs,
                          "events": r.events, "running": f"{r.workloads_running}/{r.workloads}",
                          "summaries": r.summaries, **({"release": r.release} if r.release else {})}
                         for r in self.sites],
        }
