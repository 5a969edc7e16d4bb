"""The one device record: what a device is made of, with the ranges every figure must lie in.

``DeviceResources`` is declared once here and is the base of every other view of a device: the
agent's probe result (``edge_agent.readings.Capabilities``), the wire birth
(``runtime.messages.DeviceBirth``, whose fields stay flat on the wire), the simulated device
models (``edge_agent.profiles.DeviceProfile``) and the scheduler's ``Device``
(``fog_broker.placement.model``, which adds only what the fog knows now: id, battery level,
liveness, flags). A new device figure is one field (with a default, so older peers still
decode) and one ``RESOURCE_RANGES`` entry here.

Every figure is finite and inside its documented range: a record that is not raises
``OutOfRange`` at construction, naming the field and the value, so a bad advert is refused where
bytes become a message and a probe that reads nonsense fails naming the figure.
"""
from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ._schema import Record, schema_of
from .errors import OutOfRange, RemoteViolation

__all__ = [
    "Range", "RESOURCE_RANGES", "OutOfRange", "range_problem", "check_ranges",
    "Taint", "DeviceResources", "resource_fields",
]


@dataclass(frozen=True, slots=True)
class Range:
    """``lo <= v <= hi`` (``lo < v`` when ``lo_open``), finite; ``unit`` for messages and docs."""

    lo: float
    hi: float
    unit: str = ""
    lo_open: bool = False
    plausible: float | None = None  # claims above it are clamped and flagged, not rejected

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)):  # check_ranges relies on it
            raise ValueError(f"a range's bounds must be finite, not [{self.lo}, {self.hi}]")

    def problem(self, v: float | int) -> str | None:
        """None when ``v`` lies in the range, else what is wrong (one phrase)."""
        if isinstance(v, float) and not math.isfinite(v):
            return "not finite"
        if v > self.hi or v < self.lo or (self.lo_open and v == self.lo):
            unit = f" {self.unit}" if self.unit else ""
            return f"allowed {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]{unit}"
        return None


#: A device's static resources (the COST_MODEL.md device fields), one entry per numeric field of
#: ``DeviceResources``. ``plausible`` is a softer cap: a claim above it is within the protocol but
#: beyond any real device, so the fog clamps it and flags the device instead of rejecting it.
RESOURCE_RANGES: Mapping[str, Range] = MappingProxyType({
    # rates start at 1 (a FLOP, a bit per second): below that no device exists, and 1/rate
    # would overflow the scheduler's float64 costs (0 FLOPs x inf s/FLOP is NaN, not 0)
    "flops": Range(1.0, 1e18, "FLOP/s", plausible=5e14),  # AGX Orin int8 ~2.75e14
    "memory_bytes": Range(0, 1 << 60, "bytes", plausible=1 << 40),
    "uplink_bps": Range(1.0, 1e13, "bit/s", plausible=1e11),
    "downlink_bps": Range(1.0, 1e13, "bit/s", plausible=1e11),
    "rtt_s": Range(0.0, 3600.0, "s"),
    "power_active_w": Range(0.0, 1e5, "W"),
    "power_idle_w": Range(0.0, 1e5, "W"),
    "tx_j_per_byte": Range(0.0, 1.0, "J/byte"),  # Wi-Fi is ~4e-7
    "rx_j_per_byte": Range(0.0, 1.0, "J/byte"),
    "battery_capacity_wh": Range(0.0, 1e6, "Wh", lo_open=True),
    "cpu_count": Range(1, 1 << 16),
})

def range_problem(ranges: Mapping[str, Range], field: str, value: float | int | None) -> str | None:
    """What is wrong with ``value`` for ``field`` (None: fine, or unset, or not a ranged field)."""
    r = ranges.get(field)
    return None if r is None or value is None else r.problem(value)


_Bounds = tuple[tuple[str, float, float, bool, Range], ...]
_BOUNDS: dict[int, tuple[Mapping[str, Range], _Bounds]] = {}


def _bounds(ranges: Mapping[str, Range]) -> _Bounds:
    """``ranges`` as flat tuples, built once per table: every advert is checked (the hot path)."""
    hit = _BOUNDS.get(id(ranges))
    if hit is None or hit[0] is not ranges:
        hit = (ranges, tuple((n, r.lo, r.hi, r.lo_open, r) for n, r in ranges.items()))
        _BOUNDS[id(ranges)] = hit
    return hit[1]


def check_ranges(obj: object, ranges: Mapping[str, Range]) -> None:
    """Raise ``OutOfRange`` for the first field of ``obj`` outside its range."""
    for name, lo, hi, lo_open, r in _bounds(ranges):
        v = getattr(obj, name)
        # every bound is finite, so a value inside them is finite too (NaN compares False)
        if v is None or ((lo < v <= hi) if lo_open else (lo <= v <= hi)):
            continue
        why = r.problem(v)
        if why is not None:
            raise OutOfRange(type(obj).__name__, name, v, why)


@dataclass(frozen=True, slots=True)
class Taint(Record):
    """A device repels workloads that do not tolerate ``key=value:effect``."""

    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def validate(self) -> None:
        if self.effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise RemoteViolation(f"unknown taint effect {self.effect!r}")


schema_of(Taint)

_FLOATS: dict[type, tuple[str, ...]] = {}


def _float_fields(cls: type) -> tuple[str, ...]:
    """The fields of ``cls`` typed ``float`` (or ``float | None``), computed once per class."""
    names = _FLOATS.get(cls)
    if names is None:
        hints = typing.get_type_hints(cls)
        names = tuple(f.name for f in cls._fields  # type: ignore[attr-defined]
                      if hints[f.name] is float or hints[f.name] == (float | None))
        _FLOATS[cls] = names
    return names


@dataclass(frozen=True, slots=True)
class DeviceResources(Record):
    """A device's static resources; names and units follow COST_MODEL.md, ranges RESOURCE_RANGES.

    New fields need a default (an older peer's birth lacks them) and, when numeric, a range.
    """

    flops: float  # FLOP/s, effective for onnxruntime
    memory_bytes: int  # memory free for partitions
    uplink_bps: float
    downlink_bps: float
    rtt_s: float
    power_active_w: float
    power_idle_w: float
    tx_j_per_byte: float = 0.0
    rx_j_per_byte: float = 0.0
    battery_capacity_wh: float | None = None  # None: mains powered
    labels: dict[str, str] = field(default_factory=dict, hash=False)
    taints: tuple[Taint, ...] = ()
    accelerators: tuple[str, ...] = ()
    providers: tuple[str, ...] = ()  # onnxruntime execution providers, best first
    cpu_count: int = 1

    def __post_init__(self) -> None:
        # an int where a float is meant (a probe's ``rtt_s=0``) is that float, not a type error
        for name in _float_fields(type(self)):
            v = getattr(self, name)
            if type(v) is int:
                object.__setattr__(self, name, float(v))
        Record.__post_init__(self)

    def validate(self) -> None:
        check_ranges(self, RESOURCE_RANGES)

    @property
    def battery_powered(self) -> bool:
        return self.battery_capacity_wh is not None

    def resource_kwargs(self) -> dict[str, Any]:
        """The device record's fields by name, to build another view of the same device."""
        return {name: getattr(self, name) for name in resource_fields()}

    def resources(self) -> DeviceResources:
        """Just the device record (a birth, capabilities or profile carry more)."""
        if type(self) is DeviceResources:
            return self
        kw = self.resource_kwargs()
        kw["labels"] = dict(kw["labels"])
        return DeviceResources(**kw)


schema_of(DeviceResources)


def resource_fields() -> tuple[str, ...]:
    """The field names of ``DeviceResources``, in order."""
    return tuple(f.name for f in DeviceResources._fields)
