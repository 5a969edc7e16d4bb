"""What ``fogline status`` shows: the site core's snapshot and the shell's own facts, as one JSON document.

Any thread may build it: the site's part is a frozen ``SiteSnapshot`` (``fog_broker.snapshot``);
the rest is the process's (identity, enrolment, ingest and control counters, recent events).
Devices are paginated (``offset``/``limit``): a site of thousands of devices answers in bounded
time and bytes, and ``devices_total`` says how many there are. Everything else is small.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from .snapshot import SiteSnapshot, thaw

if TYPE_CHECKING:
    from .port import FogPort

__all__ = ["site_status", "DEFAULT_DEVICE_PAGE", "MAX_DEVICE_PAGE"]

DEFAULT_DEVICE_PAGE = 1000
MAX_DEVICE_PAGE = 5000


def site_status(svc: FogPort, now: float, snap: SiteSnapshot, *, offset: int = 0,
                limit: int | None = None) -> dict[str, Any]:
    """The status document; devices sorted by id, ``limit`` of them from ``offset``."""
    limit = DEFAULT_DEVICE_PAGE if limit is None else max(0, min(int(limit), MAX_DEVICE_PAGE))
    offset = max(0, int(offset))
    pending = {d.device_id: d.state for d in svc.site.db.devices() if d.state != "approved"}
    counts = snap.device_counts
    counters: Counter[str] = Counter(snap.counters)
    counters.update(svc.ingest.counts())
    counters.update({f"control.{k}": v for k, v in svc.control.counters.items()})
    counters.update(snap.core_counters)
    counters.update({f"verifier.{k}": v for k, v in svc.ingest.rejections().items()})
    counters["verifier.accepted"] = svc.ingest.verified()
    return {
        "fog_id": svc.config.fog_id, "site": svc.config.site, "epoch": svc.epoch,
        "secure": svc.config.tls is not None,
        "uptime_s": round(now - svc.started_mono, 3), "ready": snap.ready,
        "devices": [thaw(d) for d in snap.devices[offset:offset + limit]],
        "devices_total": len(snap.devices), "devices_offset": offset,
        "enrolment": {"pending": sorted(d for d, s in pending.items() if s == "pending"),
                      "revoked": sorted(d for d, s in pending.items() if s == "revoked")},
        "workloads": [thaw(w.doc) for w in snap.workloads],
        "metrics": {**{k: round(v, 4) for k, v in snap.metrics.items()},
                    "devices_live": counts["live"], "devices_suspect": counts["suspect"],
                    "devices_dead": counts["dead"]},
        "quotas": dict(snap.quotas),
        "releases": thaw(snap.releases),
        # senders over their budget (ingest.py, control.py): quarantined ones with the reason
        "limits": {"devices": svc.ingest.limits(now), "control": svc.control.limits(now)},
        "counters": dict(sorted(counters.items())),
        "recoveries_s": [round(x, 4) for x in snap.recoveries_s[-50:]],
        "events": list(svc.events)[-50:],  # oldest first: device lost / back, partition recovered
    }
