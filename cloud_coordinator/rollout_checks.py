"""What a rollout reads of a site, and how it judges the canary (pure).

``site_view`` parses a fog's ``status`` answer into the parts a rollout reads (``SiteView``: releases,
workloads and the fog's refusal counters; a fog is a peer, so nothing is assumed); ``compare_outputs``
and ``judge_probe`` decide whether the canary's answers to the held-out batch equal the coordinator's
own run and came within the predicted latency. ``rollout`` steps on these.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .rollout_policy import RolloutPolicy

__all__ = ["WorkloadView", "SiteView", "site_view", "ProbeSample", "compare_outputs", "judge_probe"]


@dataclass(frozen=True, slots=True)
class WorkloadView:
    name: str
    model: str
    version: int
    status: str
    healthy: int
    replicas: int
    predicted_s: float | None = None
    reasons: str = ""
    device_versions: tuple[int, ...] = ()   # versions of its partitions the devices report
    switching: str = ""                     # a version switch the fog reports in progress ('' = none)

    def switched_to(self, ref: str, before: int | None) -> str:
        """'' when it serves ``ref`` on every replica with a redeployed version, else what it still lacks."""
        if self.model != ref:
            return "still on the previous model"
        if before is not None and self.version == before:
            return f"not redeployed (still its v{before})"
        if self.status != "running":
            return f"{self.status}{': ' + self.reasons if self.reasons else ''}"
        if self.healthy < max(1, self.replicas):
            return f"{self.healthy}/{self.replicas} replicas healthy"
        if self.switching:
            return self.switching
        old = sorted({v for v in self.device_versions if v != self.version})
        if old:
            return f"devices still run its v{old[0]}"
        return ""


@dataclass(frozen=True, slots=True)
class SiteView:
    """The parts of a fog's status a rollout reads."""

    releases: Mapping[str, tuple[int, str]] = field(default_factory=dict)   # name -> (version, model ref)
    workloads: tuple[WorkloadView, ...] = ()
    refusals: Mapping[str, int] = field(default_factory=dict)              # "release:<reason>" counters

    def workload(self, name: str) -> WorkloadView | None:
        return next((w for w in self.workloads if w.name == name), None)


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def site_view(status: Mapping[str, Any]) -> SiteView:
    """Parse a ``status`` answer; ``ValueError`` when it is not one (a fog is a peer: nothing is assumed)."""
    if not isinstance(status, Mapping):
        raise ValueError("status is not an object")
    rels: dict[str, tuple[int, str]] = {}
    for name, r in dict(status.get("releases") or {}).items():
        if isinstance(r, Mapping) and isinstance(r.get("version"), int):
            rels[str(name)] = (int(r["version"]), str(r.get("model", "")))
    by_wl: dict[str, list[int]] = {}
    for d in status.get("devices") or ():
        for p in (d.get("partitions") or ()) if isinstance(d, Mapping) else ():
            parts = str(p).split("/")
            if len(parts) >= 2 and parts[1][:1] == "v" and parts[1][1:].isdigit():
                by_wl.setdefault(parts[0], []).append(int(parts[1][1:]))
    wls = []
    for w in status.get("workloads") or ():
        if not isinstance(w, Mapping) or not isinstance(w.get("name"), str):
            continue
        lat: Mapping[str, Any] = w["latency"] if isinstance(w.get("latency"), Mapping) else {}
        reasons: Mapping[str, Any] = w["reasons"] if isinstance(w.get("reasons"), Mapping) else {}
        sw = w.get("switch")   # make-before-break: old partitions still serve or drain
        switching = (f"switch v{sw.get('from_version')} -> v{sw.get('to_version')} in progress"
                     if isinstance(sw, Mapping) else "")
        wls.append(WorkloadView(
            w["name"], str(w.get("model") or ""), int(w.get("version") or 0), str(w.get("status") or ""),
            int(w.get("healthy_replicas") or 0), int(w.get("replicas") or 1), _num(lat.get("predicted_s")),
            "; ".join(f"{k}: {v}" for k, v in reasons.items())[:300], tuple(by_wl.get(w["name"], ())),
            switching))
    counters: Mapping[str, Any] = status["counters"] if isinstance(status.get("counters"), Mapping) else {}
    refusals = {str(k): int(v) for k, v in counters.items()
                if str(k).startswith("release:") and isinstance(v, int)}
    return SiteView(rels, tuple(wls), refusals)


@dataclass(frozen=True, slots=True)
class ProbeSample:
    """One held-out request through the canary: answered or not, equal or not, and the fog's latency."""

    workload: str
    ok: bool
    error: str = ""
    mismatch: str = ""      # '' when every output equals the coordinator's run
    latency_s: float = 0.0  # receive -> answer at the fog (what ``measured_p50_s`` is made of)


def compare_outputs(want: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray], rtol: float, atol: float) -> str:
    """'' when every output of the reference run is in ``got`` and equal within tolerance, else why not."""
    for name, w in want.items():
        g = got.get(name)
        if g is None:
            return f"output {name!r} missing"
        w, g = np.asarray(w), np.asarray(g)
        if w.shape != g.shape:
            return f"output {name!r} has shape {list(g.shape)}, not {list(w.shape)}"
        if w.dtype.kind in "fc" or g.dtype.kind in "fc":
            a, b = w.astype(np.float64), g.astype(np.float64)
            if not np.allclose(b, a, rtol=rtol, atol=atol, equal_nan=True):
                with np.errstate(invalid="ignore"):
                    err = float(np.nanmax(np.abs(b - a))) if a.size else 0.0
                return f"output {name!r} differs (max |err| {err:.3g})"
        elif not np.array_equal(w, g):
            return f"output {name!r} differs"
    return ""


def judge_probe(samples: Sequence[ProbeSample], predicted: Mapping[str, float | None],
                policy: RolloutPolicy) -> tuple[bool, str]:
    """Whether the canary passed, and one line saying why (or what it measured)."""
    n = len(samples)
    if n == 0:
        return False, "no held-out request could be sent"
    failed = [s for s in samples if not s.ok]
    if failed:
        return False, f"{len(failed)}/{n} held-out requests failed ({failed[0].workload}: {failed[0].error})"
    wrong = [s for s in samples if s.mismatch]
    if wrong:
        return False, (f"{len(wrong)}/{n} held-out outputs differ from the coordinator's run "
                       f"({wrong[0].workload}: {wrong[0].mismatch})")
    parts = []
    for wl in sorted({s.workload for s in samples}):
        lat = sorted(s.latency_s for s in samples if s.workload == wl)
        p50 = lat[len(lat) // 2]
        pred = predicted.get(wl)
        if pred is not None and pred > 0:
            bound = policy.latency_factor * pred + policy.latency_slack_s
            if p50 > bound:
                return False, (f"{wl}: p50 latency {p50 * 1e3:.1f} ms is over {policy.latency_factor:g} x the "
                               f"predicted {pred * 1e3:.1f} ms + {policy.latency_slack_s * 1e3:.0f} ms")
            parts.append(f"{wl} p50 {p50 * 1e3:.1f} ms (predicted {pred * 1e3:.1f} ms)")
        else:
            parts.append(f"{wl} p50 {p50 * 1e3:.1f} ms (no prediction)")
    return True, f"held-out batch: {n}/{n} answered, outputs equal; " + ", ".join(parts)
