"""Scenarios as TOML files: fleet, workloads, faults, federated rounds, duration.

One file drives either engine (discrete-event here, real processes in the
demo), so an experiment is a reviewable text file rather than code.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from runtime.errors import RemoteViolation

from .churn import FailureModel

__all__ = ["Scenario", "load_scenario", "BUILTIN"]

BUILTIN = Path(__file__).parent / "scenarios"


class ScenarioError(RemoteViolation):
    """A scenario file that cannot be run; the message names the field."""


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    seed: int
    duration_s: float
    state_interval_s: float
    devices: int
    mix: dict[str, float]
    power_domains: int
    failure: FailureModel | None
    hang_fraction: float
    workloads: list[dict[str, Any]]
    federated: dict[str, Any] = field(default_factory=dict)
    #: ``[sites]``: run ``fleet`` once per site under one coordinator (``simulations.multisite``).
    sites: dict[str, Any] = field(default_factory=dict)

    def rng(self) -> random.Random:
        return random.Random(self.seed)


def _get(d: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ..., where: str = "") -> Any:
    if key not in d:
        if default is ...:
            raise ScenarioError(f"{where}{key}: missing")
        return default
    v = d[key]
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
        raise ScenarioError(f"{where}{key}: expected {getattr(kind, '__name__', kind)}, got {v!r}")
    return v


def _expand_workloads(raw: list[dict[str, Any]], devices: int) -> list[dict[str, Any]]:
    """``count = N`` repeats a workload with source/sink spread over the fleet."""
    out = []
    for i, w in enumerate(raw):
        if not isinstance(w, dict):
            raise ScenarioError(f"workloads[{i}]: expected a table")
        count = int(w.get("count", 1))
        for k in range(count):
            item = {key: v for key, v in w.items() if key != "count"}
            if count > 1:
                item["name"] = f"{w['name']}-{k}"
            for end in ("source", "sink"):
                if item.get(end) == "spread":
                    off = 0 if end == "source" else 1
                    item[end] = f"dev-{(k * 7 + off) % devices:05d}"
            item.setdefault("tenant", "default")
            item.setdefault("priority", 0)
            item.setdefault("replicas", 1)
            item.setdefault("objective", "latency")
            item.setdefault("selectors", {})
            item.setdefault("tolerations", [])
            out.append(item)
    return out


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    if not p.exists() and (BUILTIN / f"{p.name}.toml").exists():
        p = BUILTIN / f"{p.name}.toml"
    try:
        doc = tomllib.loads(p.read_text())
    except FileNotFoundError:
        names = ", ".join(sorted(x.stem for x in BUILTIN.glob("*.toml")))
        raise ScenarioError(f"no scenario {str(path)!r} (built in: {names})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{p}: invalid TOML: {exc}") from None
    fleet = _get(doc, "fleet", dict, where="")
    devices = _get(fleet, "devices", int, where="fleet.")
    if devices < 1:
        raise ScenarioError("fleet.devices: must be >= 1")
    fail = doc.get("failures")
    failure = None
    if fail:
        failure = FailureModel(float(_get(fail, "mtbf_s", (int, float), where="failures.")),
                               float(_get(fail, "mttr_s", (int, float), 60.0, where="failures.")))
    return Scenario(
        name=_get(doc, "name", str, p.stem), seed=_get(doc, "seed", int, 0),
        duration_s=float(_get(doc, "duration_s", (int, float), 3600.0)),
        state_interval_s=float(_get(doc, "state_interval_s", (int, float), 10.0)),
        devices=devices, mix={k: float(v) for k, v in _get(fleet, "mix", dict, {}, where="fleet.").items()},
        power_domains=_get(fleet, "power_domains", int, 8, where="fleet."),
        failure=failure, hang_fraction=float(fail.get("hang_fraction", 0.0)) if fail else 0.0,
        workloads=_expand_workloads(_get(doc, "workloads", list, [], where=""), devices),
        federated=dict(doc.get("federated", {})),
        sites=dict(_get(doc, "sites", dict, {}, where="")),
    )
