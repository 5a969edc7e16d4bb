"""Plain data of placement: devices, workloads, chain profiles, and their JSON.

Every class is a frozen, slotted dataclass that checks itself at construction;
``from_dict`` turns a malformed document into ``SpecError`` (a ``ValueError``)
naming the field, so the CLI can print one line and the broker can drop the input.
The JSON shapes are those of ``COST_MODEL.md``. Plans live in ``plan.py``; ``SpecError`` and the
field readers in ``spec.py``.
"""
from __future__ import annotations

import math
from collections.abc import Container, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

from runtime.chain_profile import segment_dict
from runtime.devices import (
    RESOURCE_RANGES,
    DeviceResources,
    OutOfRange,
    Taint,
    check_ranges,
    resource_fields,
)
from runtime.errors import RemoteViolation

from .spec import (
    SpecError,
    _bool,
    _input_shapes,
    _int,
    _list,
    _num,
    _obj,
    _req,
    _segment_times,
    _str,
    _strict,
    _strmap,
    _strs,
)

__all__ = [
    "Taint", "Toleration", "Battery", "Device", "Fleet", "Segment",
    "ChainProfile", "Workload", "Quota", "parse_workloads", "NO_SCHEDULE_EFFECTS",
    "Autoscale", "CLASS_KEY", "class_key", "class_label", "measured_times",
]

#: Taint effects that forbid placement (``PreferNoSchedule`` only scores, and we do not score it).
NO_SCHEDULE_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


#: Segment times measured for a device class are keyed ``class:NAME``. ``:`` is in no identifier
#: (``runtime.ids``), so a class key never names a device and a device id never names a class: a
#: device labelled ``device-class=<another device's id>`` reads and writes nobody's times but its own.
CLASS_KEY = "class:"


def class_key(device_class: str) -> str:
    """The segment-times key of a device class (``class:NAME``); '' for no class."""
    return CLASS_KEY + device_class if device_class else ""


def class_label(labels: Mapping[str, str], known: Container[str] = ()) -> str:
    """A device's class: its ``device-class`` label, else ``device-model`` (e.g. ``pi4``); '' when
    it has neither, or when the label is one of the ``known`` device ids (a class never names a
    device: that label once filed a liar's times under its victim's id)."""
    cls = labels.get("device-class") or labels.get("device-model") or ""
    return "" if cls in known else cls


def measured_times(table: Mapping[str, Any], device_id: str, device_class: str) -> Any:
    """The one lookup of measured segment times: the device's own (its id), else its class's
    (``class:NAME``), else a plain key equal to its class (how operators wrote class times, and
    still may: the fog refuses a class label that names a known device); None when none."""
    hit = table.get(device_id)
    if hit is None and device_class:
        hit = table.get(CLASS_KEY + device_class)
        if hit is None:
            hit = table.get(device_class)
    return hit


# --- fleet ----------------------------------------------------------------------------------


def _taint(d: Any, where: str) -> Taint:
    """A FLEET.json taint as the one ``Taint`` record (runtime.devices), its effect checked there."""
    d = _obj(d, where)
    try:
        return Taint(_str(_req(d, "key", where), f"{where}.key"),
                     _str(d.get("value", ""), f"{where}.value", empty_ok=True),
                     _str(d.get("effect", "NoSchedule"), f"{where}.effect"))
    except SpecError:
        raise
    except RemoteViolation as e:
        raise SpecError(f"{where}: {e}") from None


def _taint_dict(t: Taint) -> dict[str, str]:
    return {"key": t.key, "value": t.value, "effect": t.effect}


@dataclass(frozen=True, slots=True)
class Toleration:
    """Tolerates taints with this key; an empty value or effect matches any (Kubernetes ``Exists``)."""

    key: str
    value: str = ""
    effect: str = ""

    def tolerates(self, t: Taint) -> bool:
        return (self.key == t.key and (not self.value or self.value == t.value)
                and (not self.effect or self.effect == t.effect))

    @classmethod
    def from_dict(cls, d: Any, where: str = "toleration") -> Toleration:
        d = _obj(d, where)
        return cls(_str(_req(d, "key", where), f"{where}.key"),
                   _str(d.get("value", "") or "", f"{where}.value", empty_ok=True),
                   _str(d.get("effect", "") or "", f"{where}.effect", empty_ok=True))

    def to_dict(self) -> dict[str, str]:
        return {"key": self.key, "value": self.value, "effect": self.effect}


@dataclass(frozen=True, slots=True)
class Battery:
    """``level`` is the charge fraction in [0, 1]; ``charging`` (optional in JSON) lifts the energy floor."""

    capacity_wh: float
    level: float
    charging: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.level <= 1.0:
            raise SpecError(f"battery level must be in [0, 1], got {self.level!r}")

    @classmethod
    def from_dict(cls, d: Any, where: str = "battery") -> Battery:
        d = _obj(d, where)
        charging = d.get("charging", False)
        if not isinstance(charging, bool):
            raise SpecError(f"{where}.charging: expected a boolean, got {charging!r}")
        return cls(_num(_req(d, "capacity_wh", where), f"{where}.capacity_wh"),
                   _num(_req(d, "level", where), f"{where}.level"), charging)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"capacity_wh": self.capacity_wh, "level": self.level}
        if self.charging:
            out["charging"] = True
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Device(DeviceResources):
    """One edge machine as the reference cost model sees it (units in COST_MODEL.md): the one
    device record (``runtime.devices.DeviceResources``, its figures replaced by what the fog
    measured) and what the fog knows of the device now. Keyword-only, so no figure is declared
    twice and a new record field is a scheduler field without a change here."""

    id: str
    battery_level: float = 1.0  # the charge fraction in [0, 1]; meaningful with a capacity
    charging: bool = False
    alive: bool = True
    #: False while the device's capacity claims are flagged (out of bounds, or far above what
    #: its own calibration measured): it may then hold no workload's first (or only) replica.
    verified: bool = True
    #: False until the fog has measured the device's compute (a calibration of its own): its
    #: claim alone leads nothing while a measured device can (the scheduler's ``VerifiedLead``).
    measured: bool = True
    #: True while the device reports thermal throttling (its state's ``throttled``): it takes no
    #: partition, and what it runs is re-placed (the scheduler's ``NotThrottled``).
    throttled: bool = False
    #: ``battery_capacity_wh``, ``battery_level`` and ``charging`` together (None: mains powered),
    #: built once here because the cost model reads it per candidate.
    battery: Battery | None = field(init=False, default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # No per-field type walk (a fleet rebuild makes one per device): free memory computed as
        # a float is whole bytes, labels given as pairs are a dict, and ranges fail in one line.
        if not self.id:
            raise SpecError("device id must be non-empty")
        mem: object = self.memory_bytes
        if type(mem) is float and math.isfinite(mem):  # down (floor: -0.001 stays out of range)
            object.__setattr__(self, "memory_bytes", math.floor(mem))
        labels: Any = self.labels
        if type(labels) is not dict:  # given as pairs: the device's own dict
            object.__setattr__(self, "labels", dict(labels))
        if type(self.taints) is not tuple:
            object.__setattr__(self, "taints", tuple(self.taints))
        if type(self.providers) is not tuple:
            object.__setattr__(self, "providers", tuple(self.providers))
        try:
            check_ranges(self, RESOURCE_RANGES)  # runtime's one table of device figures
        except OutOfRange as e:
            raise SpecError(f"device {self.id}: {e.field}={e.value!r} ({e.why})") from None
        if None in _required_figures(self):  # check_ranges reads None as unset
            missing = [n for n in _REQUIRED if getattr(self, n) is None]
            raise SpecError(f"device {self.id}: {missing[0]} is required")
        cap = self.battery_capacity_wh
        if cap is not None:
            object.__setattr__(self, "battery", Battery(cap, self.battery_level, self.charging))

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)

    @property
    def device_class(self) -> str:
        """What measured segment times are keyed by besides the id: the ``device-class``
        label, else ``device-model`` (e.g. ``pi4``); '' when the device has neither."""
        return class_label(self.labels)

    @property
    def power_domain(self) -> str:
        """The anti-affinity domain; an unlabelled device is a domain of its own."""
        return self.labels.get("power-domain") or f"device:{self.id}"

    @classmethod
    def from_resources(cls, device_id: str, res: DeviceResources, *, flops: float | None = None,
                       memory_bytes: float | None = None, uplink_bps: float | None = None,
                       rtt_s: float | None = None, battery_level: float = 1.0,
                       charging: bool = False, alive: bool = True, verified: bool = True,
                       power_active_w: float | None = None, throttled: bool = False,
                       measured: bool = True) -> Device:
        """The scheduler's view of a device record (a birth, a profile): the one conversion.

        The fog's better knowledge replaces claims: measured ``flops``, free ``memory_bytes``,
        the state's ``uplink_bps``, ``rtt_s`` and battery, the rails' measured ``power_active_w``.
        Every other record figure is copied by name, so a new one needs no change here.
        """
        v = list(_record_figures(res))  # positional, in the record's order: a fleet rebuild
        v[_LABELS] = dict(v[_LABELS])  # calls this per device; the device's own labels
        if flops is not None:
            v[_FLOPS] = flops
        if memory_bytes is not None:
            v[_MEMORY] = memory_bytes
        if uplink_bps is not None:
            v[_UPLINK] = uplink_bps
        if rtt_s is not None:
            v[_RTT] = rtt_s
        if power_active_w is not None:
            v[_POWER] = power_active_w
        return cls(*v, id=device_id, battery_level=min(max(battery_level, 0.0), 1.0),
                   charging=charging, alive=alive, verified=verified, throttled=throttled,
                   measured=measured)

    @classmethod
    def from_dict(cls, d: Any, where: str = "device") -> Device:
        d = _obj(d, where)
        did = _str(_req(d, "id", where), f"{where}.id")
        w = f"device {did}"
        alive = d.get("alive", True)
        if not isinstance(alive, bool):
            raise SpecError(f"{w}.alive: expected a boolean, got {alive!r}")
        batt = d.get("battery")
        figures: dict[str, float | int] = {}  # the record's figures, by name
        for name in _FLEET_FIGURES:
            r, v = RESOURCE_RANGES[name], d.get(name, _FLEET_DEFAULTS.get(name))
            v = _req(d, name, w) if v is None else v
            figures[name] = (_int(v, f"{w}.{name}", minimum=int(r.lo)) if name in _INT_FIGURES
                             else _num(v, f"{w}.{name}", minimum=r.lo, positive=r.lo_open))
        battery = None if batt is None else Battery.from_dict(batt, f"{w}.battery")
        return cls(
            id=did, **figures,  # type: ignore[arg-type]
            labels=dict(_strmap(d.get("labels", {}) or {}, f"{w}.labels")),
            taints=tuple(_taint(t, f"{w}.taints[{i}]")
                         for i, t in enumerate(_list(d.get("taints", []) or [], f"{w}.taints"))),
            battery_capacity_wh=None if battery is None else battery.capacity_wh,
            battery_level=1.0 if battery is None else battery.level,
            charging=battery is not None and battery.charging,
            alive=alive,
            providers=_strs(d.get("providers", []) or [], f"{w}.providers"),
            accelerators=_strs(d.get("accelerators", []) or [], f"{w}.accelerators"),
            verified=_bool(d.get("verified", True), f"{w}.verified"),
            measured=_bool(d.get("measured", True), f"{w}.measured"),
            throttled=_bool(d.get("throttled", False), f"{w}.throttled"),
        )

    def to_dict(self) -> dict[str, Any]:
        out = self._base_dict()
        if self.providers:
            out["providers"] = list(self.providers)
        if self.accelerators:
            out["accelerators"] = list(self.accelerators)
        if not self.verified:
            out["verified"] = False
        if not self.measured:
            out["measured"] = False
        if self.throttled:
            out["throttled"] = True
        return out

    def _base_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "labels": dict(self.labels),
            "taints": [_taint_dict(t) for t in self.taints],
            **{name: getattr(self, name) for name in _FLEET_FIGURES},
            "battery": None if self.battery is None else self.battery.to_dict(),
            "alive": self.alive,
        }


_RECORD_FIELDS = resource_fields()
_record_figures = attrgetter(*_RECORD_FIELDS)  # the record's fields in order, in one call
_REQUIRED = tuple(f.name for f in fields(DeviceResources)
                  if f.name in RESOURCE_RANGES and f.default is not None)
_required_figures = attrgetter(*_REQUIRED)
_LABELS, _FLOPS, _MEMORY, _UPLINK, _RTT, _POWER = map(_RECORD_FIELDS.index, (
    "labels", "flops", "memory_bytes", "uplink_bps", "rtt_s", "power_active_w"))
#: The device-record figures a FLEET.json device carries by name (the capacity is in its
#: ``battery``); the record's defaults, and 0 for the figures FLEET.json has always defaulted.
_FLEET_FIGURES = tuple(n for n in RESOURCE_RANGES if n != "battery_capacity_wh")
_FLEET_DEFAULTS = {**{f.name: f.default for f in fields(DeviceResources)
                      if f.name in RESOURCE_RANGES and isinstance(f.default, (int, float))},
                   "rtt_s": 0.0, "power_active_w": 0.0, "power_idle_w": 0.0}
_INT_FIGURES = frozenset(n for n in _FLEET_FIGURES
                         if n != "memory_bytes" and DeviceResources.__annotations__[n] == "int")


@dataclass(frozen=True, slots=True)
class Fleet:
    """A snapshot of a site's devices; ids are unique."""

    devices: tuple[Device, ...]
    index: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)
    #: Derived data of this immutable snapshot (e.g. numpy columns), built on first use.
    cache: dict[Hashable, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        idx: dict[str, int] = {}
        for i, dev in enumerate(self.devices):
            if dev.id in idx:
                raise SpecError(f"duplicate device id '{dev.id}'")
            idx[dev.id] = i
        object.__setattr__(self, "index", idx)

    def get(self, device_id: str) -> Device | None:
        i = self.index.get(device_id)
        return None if i is None else self.devices[i]

    @classmethod
    def from_dict(cls, d: Any) -> Fleet:
        d = _obj(d, "fleet")
        devs = _list(_req(d, "devices", "fleet"), "fleet.devices")
        return cls(tuple(Device.from_dict(x, f"fleet.devices[{i}]") for i, x in enumerate(devs)))

    def to_dict(self) -> dict[str, Any]:
        return {"devices": [dev.to_dict() for dev in self.devices]}


# --- workloads ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Segment:
    """The graph between two consecutive valid cut points."""

    name: str
    flops: float
    param_bytes: float
    activation_bytes: float
    out_bytes: float

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Segment:
        d = _obj(d, where)
        return cls(_str(d.get("name", where), f"{where}.name"),
                   _num(_req(d, "flops", where), f"{where}.flops"),
                   _num(_req(d, "param_bytes", where), f"{where}.param_bytes"),
                   _num(_req(d, "activation_bytes", where), f"{where}.activation_bytes"),
                   _num(_req(d, "out_bytes", where), f"{where}.out_bytes"))

    def to_dict(self) -> dict[str, Any]:
        return segment_dict(self)


@dataclass(frozen=True, slots=True)
class ChainProfile:
    """A model as a sequence of segments; a partition is a contiguous range of them."""

    model: str
    input_bytes: float
    segments: tuple[Segment, ...]
    #: Measured seconds per segment, keyed by device id or device class; they replace
    #: ``flops / device.flops`` on the devices they name (COST_MODEL.md).
    segment_times: tuple[tuple[str, tuple[float, ...]], ...] = ()
    #: Bytes on the wire per float32 byte at each cut (the answer stays float32): 0.5 when the
    #: cuts travel as float16, 0.25 as int8 (``Workload.cut_wire``). Transfers are charged so.
    wire_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not self.segments:
            raise SpecError(f"profile '{self.model}': no segments")
        if not 0 < self.wire_ratio <= 1:
            raise SpecError(f"profile '{self.model}': wire_ratio must be in (0, 1]")
        for key, times in self.segment_times:
            if len(times) != len(self.segments) or any(
                    not (t >= 0 and math.isfinite(t)) for t in times):
                raise SpecError(f"profile '{self.model}': segment times for '{key}' need "
                                f"{len(self.segments)} finite seconds >= 0")

    def times_for(self, device: Device) -> tuple[float, ...] | None:
        """Measured segment seconds on ``device`` (by id, then by class), or None."""
        if not self.segment_times:
            return None
        hit: tuple[float, ...] | None = measured_times(dict(self.segment_times), device.id,
                                                       device.device_class)
        return hit

    def cut_bytes(self, i: int) -> float:
        """Bytes segment ``i``'s output puts on a link: on the cuts' wire; the answer float32."""
        b = self.segments[i].out_bytes
        return b if i == len(self.segments) - 1 else b * self.wire_ratio

    def compute_s(self, first: int, last: int, device: Device) -> float:
        """Compute time of segments ``first..last`` on ``device``: measured, else FLOPs."""
        times = self.times_for(device)
        if times is not None:
            return sum(times[first:last + 1])
        return sum(s.flops for s in self.segments[first:last + 1]) / device.flops

    def with_times(self, times: Mapping[str, Sequence[float]] |
                   Sequence[tuple[str, Sequence[float]]]) -> ChainProfile:
        """A copy with measured segment times added (a key already there is replaced)."""
        items = times.items() if isinstance(times, Mapping) else times
        merged = dict(self.segment_times)
        merged.update((str(k), tuple(float(t) for t in v)) for k, v in items)
        return ChainProfile(self.model, self.input_bytes, self.segments,
                            tuple(sorted(merged.items())), self.wire_ratio)

    def memory_of(self, first: int, last: int) -> float:
        """``param_bytes(p) + peak_activation_bytes(p)`` for segments ``first..last`` inclusive."""
        segs = self.segments[first:last + 1]
        return sum(s.param_bytes for s in segs) + max(s.activation_bytes for s in segs)

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> ChainProfile:
        d = _obj(d, where)
        segs = _list(_req(d, "segments", where), f"{where}.segments")
        return cls(_str(d.get("model", "model"), f"{where}.model"),
                   _num(_req(d, "input_bytes", where), f"{where}.input_bytes"),
                   tuple(Segment.from_dict(s, f"{where}.segments[{i}]") for i, s in enumerate(segs)),
                   _segment_times(d.get("segment_times_s", {}) or {}, len(segs),
                                  f"{where}.segment_times_s"))

    @classmethod
    def coerce(cls, obj: Any) -> ChainProfile:
        """Accept what ``models.cuts.chain_profile`` returns: ours, a dict, or an attribute object."""
        if isinstance(obj, ChainProfile):
            return obj
        if isinstance(obj, Mapping):
            return cls.from_dict(obj)
        if hasattr(obj, "to_dict"):
            return cls.from_dict(obj.to_dict())
        try:
            return cls.from_dict({
                "model": str(getattr(obj, "model", "model")),
                "input_bytes": obj.input_bytes,
                "segments": [s if isinstance(s, Mapping) else {
                    "name": str(getattr(s, "name", f"s{i}")), "flops": s.flops,
                    "param_bytes": s.param_bytes, "activation_bytes": s.activation_bytes,
                    "out_bytes": s.out_bytes} for i, s in enumerate(obj.segments)],
            })
        except AttributeError as exc:
            raise SpecError(f"not a chain profile: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "input_bytes": self.input_bytes,
                               "segments": [s.to_dict() for s in self.segments]}
        if self.segment_times:
            out["segment_times_s"] = {k: list(v) for k, v in self.segment_times}
        return out


@dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's cap on the memory of all its placed partitions (all replicas)."""

    memory_bytes: float

    @classmethod
    def from_dict(cls, d: Any, where: str = "quota") -> Quota:
        d = _obj(d, where)
        return cls(_num(_req(d, "memory_bytes", where), f"{where}.memory_bytes"))

    def to_dict(self) -> dict[str, Any]:
        return {"memory_bytes": self.memory_bytes}


@dataclass(frozen=True, slots=True)
class Autoscale:
    """A replica range instead of a fixed ``replicas``: the site's autoscaler moves within it."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_utilization: float = 0.7

    FIELDS = ("min_replicas", "max_replicas", "target_utilization")

    @classmethod
    def from_dict(cls, d: Any, where: str = "autoscale") -> Autoscale:
        d = _obj(d, where)
        _strict(d, cls.FIELDS, where)
        mn = _int(_req(d, "min_replicas", where), f"{where}.min_replicas", minimum=1)
        mx = _int(_req(d, "max_replicas", where), f"{where}.max_replicas", minimum=1)
        if mx < mn:
            raise SpecError(f"{where}.max_replicas: must be >= min_replicas ({mn}), got {mx}")
        t = _num(d.get("target_utilization", 0.7), f"{where}.target_utilization", positive=True)
        if t > 1.0:
            raise SpecError(f"{where}.target_utilization: must be in (0, 1], got {t!r}")
        return cls(mn, mx, t)

    def to_dict(self) -> dict[str, Any]:
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "target_utilization": self.target_utilization}


#: Wire bytes per float32 byte (``runtime.activations``; int8's scales are a few bytes a channel).
_WIRE_RATIO = {"float32": 1.0, "float16": 0.5, "int8": 0.25}


@dataclass(frozen=True, slots=True)
class Workload:
    """A model to serve. ``profile`` is None until the shell resolved ``model`` (an ONNX path)."""

    name: str
    source: str
    sink: str
    tenant: str = "default"
    priority: int = 0
    replicas: int = 1
    objective: str = "latency"
    selectors: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Toleration, ...] = ()
    max_partitions: int | None = None
    profile: ChainProfile | None = None
    model: str | None = None
    #: The chain uses at least this many partitions (memory headroom, pipelining); default 1.
    min_partitions: int = 1
    #: Whole input shapes for a ``model`` with dynamic dimensions: ``(("x", (1, 3, 48, 320)),)``.
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: Accelerator selector: run only on devices offering one of these execution providers.
    providers: tuple[str, ...] = ()
    #: Measured segment seconds for a ``model`` workload, attached to its profile once profiled.
    segment_times: tuple[tuple[str, tuple[float, ...]], ...] = ()
    #: End-to-end latency bound (s) for the latency and throughput objectives; None: none.
    max_latency_s: float | None = None
    #: Accuracy bound on compressed activations at the cuts (``runtime.activations``):
    #: relative L2 error per cut, and/or top-1 agreement on the fog's calibration batch.
    max_activation_error: float | None = None
    min_top1_agreement: float | None = None
    #: Each request's deadline (s) when it carries none: the router admits against it (issue 32).
    slo_s: float | None = None
    #: A replica range instead of ``replicas`` (``replicas`` holds ``min_replicas``; the autoscaler moves within it).
    autoscale: Autoscale | None = None
    #: The rate (requests/s) the workload must serve: the site asks for enough replica chains for it.
    rate_fps: float | None = None

    #: Every field a workload object may have; anything else is refused (``_strict``).
    FIELDS = ("name", "source", "sink", "tenant", "priority", "replicas", "objective", "selectors",
              "tolerations", "max_partitions", "profile", "model", "min_partitions", "input_shapes",
              "providers", "segment_times_s", "max_latency_s", "max_activation_error", "min_top1_agreement",
              "slo_s", "autoscale", "rate_fps")

    def with_profile(self, profile: ChainProfile) -> Workload:
        """This workload with ``profile`` (its own measured segment times merged in)."""
        from dataclasses import replace

        if self.segment_times:
            n = len(profile.segments)
            for key, times in self.segment_times:
                if len(times) != n:
                    raise SpecError(f"workload {self.name}: segment_times_s.{key} has "
                                    f"{len(times)} times, the model's chain {n} segments")
            profile = profile.with_times(self.segment_times)
        return replace(self, profile=profile)

    @property
    def cut_wire(self) -> str:
        """The wire the scheduler charges at the cuts, before the fog's calibration picks one
        (``fog_broker.wires``): int8 under a top-1 bound or a relative error bound >= 1e-2,
        float16 under one >= 2**-11 (float16's rounding), else float32."""
        err, top1 = self.max_activation_error, self.min_top1_agreement
        if err is not None and err < 2.0 ** -11:
            return "float32"
        if top1 is not None or (err is not None and err >= 1e-2):
            return "int8"
        return "float16" if err is not None else "float32"

    def __post_init__(self) -> None:
        if self.objective not in ("latency", "energy", "throughput"):
            raise SpecError(f"workload {self.name}: objective must be 'latency', 'energy' or "
                            f"'throughput', got {self.objective!r}")
        b = self.max_latency_s
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float))
                              or not math.isfinite(b) or b <= 0):
            raise SpecError(f"workload {self.name}: max_latency_s must be a number > 0, "
                            f"got {b!r}")
        for fname, lo, hi in (("max_activation_error", 0.0, math.inf),
                              ("min_top1_agreement", 0.0, 1.0)):
            v = getattr(self, fname)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not lo < v <= hi):
                raise SpecError(f"workload {self.name}: {fname} must be a number in "
                                f"({lo:g}, {hi:g}], got {v!r}")
        if b is not None and self.objective == "energy":
            raise SpecError(f"workload {self.name}: max_latency_s applies to the latency and "
                            f"throughput objectives, not energy")
        if self.replicas < 1:
            raise SpecError(f"workload {self.name}: replicas must be >= 1")
        for fname in ("slo_s", "rate_fps"):
            v = getattr(self, fname)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v <= 0):
                raise SpecError(f"workload {self.name}: {fname} must be a number > 0, got {v!r}")
        if self.max_partitions is not None and self.max_partitions < 1:
            raise SpecError(f"workload {self.name}: max_partitions must be >= 1")
        mn = self.min_partitions
        if isinstance(mn, bool) or not isinstance(mn, int) or mn < 1:
            raise SpecError(f"workload {self.name}: min_partitions must be an integer >= 1, "
                            f"got {mn!r}")
        if self.max_partitions is not None and mn > self.max_partitions:
            raise SpecError(f"workload {self.name}: min_partitions {mn} > max_partitions "
                            f"{self.max_partitions}")
        if self.profile is not None and mn > len(self.profile.segments):
            raise SpecError(f"workload {self.name}: min_partitions {mn} > the "
                            f"{len(self.profile.segments)} segments of model "
                            f"'{self.profile.model}'")
        if self.profile is None and self.model is None:
            raise SpecError(f"workload {self.name}: needs exactly one of 'model' or 'profile'")
        ratio = _WIRE_RATIO[self.cut_wire]
        if self.profile is not None and self.profile.wire_ratio != ratio:
            from dataclasses import replace  # frozen: the profile charges this workload's wire
            object.__setattr__(self, "profile", replace(self.profile, wire_ratio=ratio))

    @classmethod
    def from_dict(cls, d: Any, where: str = "workload") -> Workload:
        d = _obj(d, where)
        name = _str(_req(d, "name", where), f"{where}.name")
        w = f"workload {name}"
        if ("model" in d) == ("profile" in d):
            raise SpecError(f"{w}: needs exactly one of 'model' or 'profile'")
        _strict(d, cls.FIELDS, w)
        if "replicas" in d and "autoscale" in d:
            raise SpecError(f"{w}.autoscale: give either 'replicas' or 'autoscale', not both")
        auto = None if d.get("autoscale") is None else Autoscale.from_dict(d["autoscale"], f"{w}.autoscale")
        mp = d.get("max_partitions")
        return cls(
            name=name,
            source=_str(_req(d, "source", w), f"{w}.source"),
            sink=_str(_req(d, "sink", w), f"{w}.sink"),
            tenant=_str(d.get("tenant", "default"), f"{w}.tenant"),
            priority=_int(d.get("priority", 0), f"{w}.priority"),
            replicas=auto.min_replicas if auto is not None else
            _int(d.get("replicas", 1), f"{w}.replicas", minimum=1),
            objective=_str(d.get("objective", "latency"), f"{w}.objective"),
            selectors=_strmap(d.get("selectors", {}) or {}, f"{w}.selectors"),
            tolerations=tuple(Toleration.from_dict(t, f"{w}.tolerations[{i}]") for i, t in
                              enumerate(_list(d.get("tolerations", []) or [], f"{w}.tolerations"))),
            max_partitions=None if mp is None else _int(mp, f"{w}.max_partitions", minimum=1),
            profile=ChainProfile.from_dict(d["profile"], f"{w}.profile") if "profile" in d else None,
            model=_str(d["model"], f"{w}.model") if "model" in d else None,
            min_partitions=_int(d.get("min_partitions", 1), f"{w}.min_partitions", minimum=1),
            input_shapes=_input_shapes(d.get("input_shapes", {}) or {}, f"{w}.input_shapes"),
            providers=_strs(d.get("providers", []) or [], f"{w}.providers"),
            max_latency_s=None if d.get("max_latency_s") is None else
            _num(d["max_latency_s"], f"{w}.max_latency_s", positive=True),
            max_activation_error=None if d.get("max_activation_error") is None else
            _num(d["max_activation_error"], f"{w}.max_activation_error", positive=True),
            min_top1_agreement=None if d.get("min_top1_agreement") is None else
            _num(d["min_top1_agreement"], f"{w}.min_top1_agreement", positive=True),
            slo_s=None if d.get("slo_s") is None else _num(d["slo_s"], f"{w}.slo_s", positive=True),
            autoscale=auto,
            rate_fps=None if d.get("rate_fps") is None else _num(d["rate_fps"], f"{w}.rate_fps", positive=True),
        )._with_times(d.get("segment_times_s"), w)

    def _with_times(self, raw: Any, where: str) -> Workload:
        if raw is None:
            return self
        from dataclasses import replace

        n = len(self.profile.segments) if self.profile is not None else None
        times = _segment_times(raw, n, f"{where}.segment_times_s")
        if self.profile is not None:
            return replace(self, profile=self.profile.with_times(times))
        return replace(self, segment_times=times)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "tenant": self.tenant, "priority": self.priority,
            "replicas": self.replicas, "objective": self.objective,
            "source": self.source, "sink": self.sink, "selectors": dict(self.selectors),
            "tolerations": [t.to_dict() for t in self.tolerations],
        }
        if self.max_partitions is not None:
            out["max_partitions"] = self.max_partitions
        if self.min_partitions != 1:
            out["min_partitions"] = self.min_partitions
        if self.input_shapes:
            out["input_shapes"] = {k: list(v) for k, v in self.input_shapes}
        if self.providers:
            out["providers"] = list(self.providers)
        if self.segment_times:
            out["segment_times_s"] = {k: list(v) for k, v in self.segment_times}
        if self.max_latency_s is not None:
            out["max_latency_s"] = self.max_latency_s
        for fname in ("max_activation_error", "min_top1_agreement", "slo_s", "rate_fps"):
            if getattr(self, fname) is not None:
                out[fname] = getattr(self, fname)
        if self.autoscale is not None:
            del out["replicas"]
            out["autoscale"] = self.autoscale.to_dict()
        if self.profile is not None:
            out["profile"] = self.profile.to_dict()
        else:
            out["model"] = self.model
        return out


def parse_workloads(d: Any) -> tuple[tuple[Workload, ...], dict[str, Quota]]:
    """Read a WORKLOADS.json document: the workloads and the optional per-tenant quotas."""
    d = _obj(d, "workloads file")
    _strict(d, ("workloads", "quotas"), "workloads file")
    items = _list(_req(d, "workloads", "workloads file"), "workloads")
    wls = tuple(Workload.from_dict(x, f"workloads[{i}]") for i, x in enumerate(items))
    names = [w.name for w in wls]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise SpecError(f"duplicate workload name(s): {', '.join(dup)}")
    quotas = {str(t): Quota.from_dict(q, f"quotas.{t}")
              for t, q in _obj(d.get("quotas", {}) or {}, "quotas").items()}
    return wls, quotas
