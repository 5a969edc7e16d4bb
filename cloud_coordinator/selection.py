"""Energy-aware client selection from fog brokers' fleet summaries (pure).

Only devices that can afford a round train: alive, battery above a floor or
charging, not thermally throttled, not on a metered link, and (optionally)
judged fit by their fog broker. Every device gets a reason, selected or not,
as a fixed phrase so reasons can be counted ("3 battery below floor").

``SelectionPolicy.cross_device()`` is the rule of production cross-device FL
(Gboard, Apple's on-device training): a device trains only while it is charging,
on an unmetered link, idle and not throttled, so a round never costs its owner
battery, data or a hot, slow phone.

The coordinator picks one by name (``fogline coordinator --selection``, run-config key
``selection``): ``battery-floor`` (the default: the floor applies to a discharging device's charge,
a charging one is eligible at any level) or ``cross-device``; ``policy_named`` builds it.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.errors import LocalViolation
from runtime.messages import DeviceSummary, FleetSummary

__all__ = ["SelectionPolicy", "Selection", "select_clients", "explain", "explain_devices", "selection_line", "SELECTED",
           "REASONS", "RULES", "DEFAULT_RULE", "policy_named"]

SELECTED = "selected"
DEAD = "not alive"
STALE = "stale summary"
LOW_BATTERY = "battery below floor"
THROTTLED = "throttled"
METERED = "metered link"
FOG_UNFIT = "fog says unfit"
SAMPLED_OUT = "sampled out"
NOT_CHARGING = "on battery, not charging"
BUSY = "not idle"
REASONS = (SELECTED, DEAD, STALE, LOW_BATTERY, THROTTLED, METERED, FOG_UNFIT, SAMPLED_OUT, NOT_CHARGING,
           BUSY)
DEFAULT_RULE = "battery-floor"
RULES = (DEFAULT_RULE, "cross-device")  # the names a coordinator takes (--selection, run config "selection")


class Sampler(Protocol):
    def sample(self, population: list[str], k: int) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class SelectionPolicy:
    """Thresholds of fitness; ``max_clients`` caps a round (sampled with the given rng)."""

    battery_floor: float = 0.3
    allow_metered: bool = False
    allow_throttled: bool = False
    trust_fog_verdict: bool = False
    max_age_s: float = 60.0
    max_clients: int | None = None
    require_charging: bool = False  # a battery device trains only on its charger
    max_cpu_load: float | None = None  # idle: load per core at most this (None: any load)

    def __post_init__(self) -> None:
        if not 0.0 <= self.battery_floor <= 1.0:
            raise LocalViolation("battery_floor must be in [0, 1]")
        if self.max_clients is not None and self.max_clients < 1:
            raise LocalViolation("max_clients must be >= 1")
        if self.max_cpu_load is not None and not self.max_cpu_load >= 0.0:
            raise LocalViolation("max_cpu_load must be >= 0")

    @classmethod
    def cross_device(cls, battery_floor: float = 0.3, max_cpu_load: float = 0.5,
                     max_clients: int | None = None) -> SelectionPolicy:
        """Production cross-device FL: charging (or mains), unmetered, idle, not throttled."""
        return cls(battery_floor=battery_floor, require_charging=True, max_cpu_load=max_cpu_load,
                   max_clients=max_clients)


def policy_named(name: str, battery_floor: float = 0.3) -> SelectionPolicy:
    """The policy a coordinator setting names; an unknown name is one line, never a default."""
    if name == "cross-device":
        return SelectionPolicy.cross_device(battery_floor=battery_floor)
    if name == DEFAULT_RULE:
        return SelectionPolicy(battery_floor=battery_floor)
    raise LocalViolation(f"selection must be one of {', '.join(RULES)}, got {name!r}")


@dataclass(frozen=True, slots=True)
class Selection:
    """Chosen device ids (sorted), a reason for every device, and known Flower node ids."""

    selected: tuple[str, ...]
    reasons: Mapping[str, str]
    node_ids: Mapping[str, int] = field(default_factory=dict)

    @property
    def nodes(self) -> frozenset[int]:
        return frozenset(self.node_ids[d] for d in self.selected if d in self.node_ids)


def _verdict(d: DeviceSummary, policy: SelectionPolicy) -> str:
    if not d.alive:
        return DEAD
    if d.throttled and not policy.allow_throttled:
        return THROTTLED
    if d.metered and not policy.allow_metered:
        return METERED
    if d.battery_level is not None and not d.charging and d.battery_level < policy.battery_floor:
        return LOW_BATTERY
    if policy.require_charging and d.battery_level is not None and not d.charging:
        return NOT_CHARGING
    if policy.max_cpu_load is not None and d.cpu_load is not None and d.cpu_load > policy.max_cpu_load:
        return BUSY
    if policy.trust_fog_verdict and not d.fit_for_training:
        return FOG_UNFIT
    return SELECTED


def select_clients(summaries: Iterable[FleetSummary], now: float, policy: SelectionPolicy,
                   rng: Sampler) -> Selection:
    """Pick the devices fit to train; ``now`` and summary timestamps share one clock.

    Reports are keyed by site and device: a device reported by several fog brokers of its site
    counts once, from the newest summary, and one site's summary never overrides another's on a
    device of the same id (a site could otherwise set aside, or put forward, any device by naming
    it in a newer summary). An id that more than one site reports is judged per site under
    ``SITE/ID``, so it matches no device the coordinator knows by its bare id: no site alone
    decides for it, and like a device no fog reports on it is not excluded.
    """
    newest: dict[tuple[str, str], tuple[float, DeviceSummary]] = {}
    for s in summaries:
        for d in s.devices:
            key = (s.site, d.device_id)
            if key not in newest or s.timestamp > newest[key][0]:
                newest[key] = (s.timestamp, d)
    sites = Counter(dev for _, dev in newest)
    reasons: dict[str, str] = {}
    node_ids: dict[str, int] = {}
    for (site, device), (ts, d) in sorted(newest.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        dev = device if sites[device] == 1 else f"{site}/{device}"
        reasons[dev] = STALE if now - ts > policy.max_age_s else _verdict(d, policy)
        if d.flwr_node_id is not None:
            node_ids[dev] = d.flwr_node_id
    fit = sorted(dev for dev, why in reasons.items() if why == SELECTED)
    if policy.max_clients is not None and len(fit) > policy.max_clients:
        keep = set(rng.sample(fit, policy.max_clients))
        for dev in fit:
            if dev not in keep:
                reasons[dev] = SAMPLED_OUT
        fit = sorted(keep)
    return Selection(tuple(fit), reasons, node_ids)


def explain(sel: Selection) -> str:
    """'2/5 devices selected: 2 battery below floor, 1 metered link' (counts, no ids)."""
    counts = Counter(why for why in sel.reasons.values() if why != SELECTED)
    tail = ", ".join(f"{n} {why}" for why, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    head = f"{len(sel.selected)}/{len(sel.reasons)} devices selected"
    return f"{head}: {tail}" if tail else head


def explain_devices(sel: Selection) -> str:
    """Every device and why it was or was not selected: 'a: selected; b: metered link'."""
    return "; ".join(f"{dev}: {why}" for dev, why in sorted(sel.reasons.items()))


def selection_line(sel: Mapping[str, Any]) -> str:
    """'selection (cross-device): a: selected; b: metered link' from a round's report entry."""
    devices = sel.get("devices") or {}
    return f"selection ({sel.get('rule') or DEFAULT_RULE}): " + (
        "; ".join(f"{d}: {why}" for d, why in sorted(devices.items())) or "no device reported")
