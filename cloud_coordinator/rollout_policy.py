"""How a staged rollout waits and judges (pure): ``RolloutPolicy``, read from ``[rollout]`` in SITES.toml,
``--rollout-set KEY=VALUE`` or a mapping, every bound checked at construction. ``rollout`` drives it."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from runtime.errors import LocalViolation

__all__ = ["RolloutPolicy"]


@dataclass(frozen=True, slots=True)
class RolloutPolicy:
    """Bounded waits and the canary's pass marks."""

    baseline_timeout_s: float = 30.0   # the canary's first status before anything is published
    accept_timeout_s: float = 30.0     # the canary lists the new version
    serve_timeout_s: float = 120.0     # its workloads run the new version
    probe_timeout_s: float = 60.0      # the held-out batch is answered
    site_timeout_s: float = 30.0       # each other site lists the new version
    rollback_timeout_s: float = 60.0   # the canary lists the rollback version
    publish_retry_s: float = 10.0      # republish (not retained: a fog that was away missed it)
    outage_grace_s: float = 3600.0     # a cut of the awaited site holds the clock this long per outage (RolloutClock)
    latency_factor: float = 3.0        # p50 may be this many times the plan's prediction ...
    latency_slack_s: float = 0.05      # ... plus this (the MQTT hops a cost model leaves out)
    rtol: float = 1e-4                 # outputs against the coordinator's own onnxruntime run (fp32)
    atol: float = 1e-5
    require_serving: bool = False      # a canary that serves no workload of the release fails the check
    allow_unchecked_canary: bool = False  # ... goes on unchecked (default: it holds until one serves it)
    probe_requests: int = 8            # held-out requests per workload (adapter)
    holdout: str = ""                  # .npz of held-out inputs (adapter; default: seeded random inputs)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_s") and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise LocalViolation(f"rollout setting {f.name} must be a number of seconds >= 0, not {v!r}")
        if not self.latency_factor >= 1.0:
            raise LocalViolation(f"rollout setting latency_factor must be >= 1, not {self.latency_factor!r}")
        if not (self.rtol >= 0 and self.atol >= 0):
            raise LocalViolation("rollout settings rtol and atol must be >= 0")
        if self.probe_requests < 1:
            raise LocalViolation("rollout setting probe_requests must be >= 1")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], base: RolloutPolicy | None = None) -> RolloutPolicy:
        """``base`` (default settings) with the keys of ``d``; one-line ``LocalViolation`` on a bad key or value."""
        known = {f.name: f for f in fields(cls)}
        kw: dict[str, Any] = {f: getattr(base or cls(), f) for f in known}
        for key, raw in d.items():
            k = str(key).replace("-", "_")
            if k not in known:
                raise LocalViolation(f"unknown rollout setting {key!r} (known: {', '.join(sorted(known))})")
            cur = kw[k]
            try:
                if isinstance(cur, bool):
                    v: Any = raw if isinstance(raw, bool) else {"true": True, "false": False}[str(raw).lower()]
                elif isinstance(cur, int):
                    v = int(raw)
                elif isinstance(cur, float):
                    v = float(raw)
                else:
                    v = str(raw)
            except (KeyError, TypeError, ValueError):
                raise LocalViolation(f"rollout setting {key}: {raw!r} is not a {type(cur).__name__}") from None
            kw[k] = v
        return cls(**kw)

    @classmethod
    def from_pairs(cls, pairs: Iterable[str], base: RolloutPolicy | None = None) -> RolloutPolicy:
        """From ``key=value`` strings (``--rollout-set``)."""
        d: dict[str, str] = {}
        for p in pairs:
            k, sep, v = p.partition("=")
            if not sep or not k:
                raise LocalViolation(f"--rollout-set {p!r}: expected KEY=VALUE")
            d[k.strip()] = v.strip()
        return cls.from_mapping(d, base)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
