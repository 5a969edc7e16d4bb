"""runtime._schema: annotations become checks at construction and builders at decode."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import numpy as np
import pytest

from runtime._schema import Record, from_wire, schema_of, to_wire
from runtime.errors import LocalViolation, RemoteViolation
from runtime.messages import (
    MESSAGE_TYPES,
    Activation,
    DeviceBirth,
    DeviceState,
    DeviceSummary,
    FleetSummary,
    Hop,
    PartitionStatus,
    Taint,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Sample(Record):
    name: str
    count: int
    ratio: float
    flag: bool
    blob: bytes
    maybe: float | None = None
    items: tuple[Hop, ...] = ()
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    arr: Optional[np.ndarray] = None  # noqa: UP045 - typing.Optional is read too, not only X | None


schema_of(Sample)
HOP = Hop("d", "w", 1, 0, 0)
GOOD: dict[str, Any] = dict(name="n", count=1, ratio=0.5, flag=True, blob=b"x")


@pytest.mark.parametrize("field,value", [
    ("name", b"n"), ("name", 1), ("count", True), ("count", 1.0), ("count", "1"), ("ratio", 1),
    ("ratio", "0.5"), ("flag", 1), ("blob", "x"), ("blob", bytearray(b"x")), ("maybe", 1),
    ("items", [HOP]), ("items", (HOP, "x")), ("items", ({"device_id": "d"},)), ("tags", {"a": 1}),
    ("tags", {1: "a"}), ("tags", [("a", "b")]), ("arr", [1, 2]),
])
def test_construction_checks_types(field: str, value: Any) -> None:
    with pytest.raises(RemoteViolation, match=field):
        Sample(**{**GOOD, field: value})


def test_wire_builders_coerce_what_msgpack_changes() -> None:
    wire = {**GOOD, "ratio": 1, "maybe": 2, "items": [to_wire(HOP)], "tags": {"a": "b"}, "unknown": [1]}
    s = from_wire(Sample, wire)
    assert s.ratio == 1.0 and isinstance(s.ratio, float) and isinstance(s.maybe, float)
    assert s.items == (HOP,) and s.tags == {"a": "b"}
    assert to_wire(s)["items"] == [to_wire(HOP)]


@pytest.mark.parametrize("wire,match", [
    ({**GOOD, "count": None}, "count"),
    ({k: v for k, v in GOOD.items() if k != "blob"}, "missing field 'blob'"),
    ({**GOOD, "items": [{"device_id": "d"}]}, "missing field"),
    ({**GOOD, "items": [5]}, "items"),
    ({**GOOD, "items": {"a": 1}}, "items"),
    ({**GOOD, "tags": ["a"]}, "tags"),
])
def test_wire_builders_reject(wire: dict[str, Any], match: str) -> None:
    with pytest.raises(RemoteViolation, match=match):
        from_wire(Sample, wire)


@pytest.mark.parametrize("annotation", [list[int], Union[int, str],  # noqa: UP007 - typing.Union, on purpose
                                        tuple[int, str], dict[int, str], set, object])
def test_unsupported_annotations_are_a_local_bug(annotation: Any) -> None:
    cls = dataclasses.make_dataclass("Bad", [("x", annotation)], bases=(Record,), frozen=True, slots=True)
    with pytest.raises(LocalViolation):
        schema_of(cls)


KEY = b"k" * 32


@pytest.mark.parametrize("build", [
    lambda: Taint("k", effect="Sometimes"),
    lambda: PartitionStatus("w", 1, 0, 0, "s" * 64, "sleeping"),
    lambda: DeviceState("d/1", 1, 1, 10),
    lambda: DeviceState("", 1, 1, 10),
    lambda: DeviceState("d" * 129, 1, 1, 10),
    lambda: DeviceState("d", 1, 1, -1),
    lambda: DeviceState("d", 1, 1, 10, battery_level=1.5),
    lambda: DeviceBirth("d", 0, 0, "s", b"short", 1.0, 1, 1.0, 1.0, 0.1, 1.0, 1.0),
    lambda: DeviceBirth("d", 0, 0, "s", KEY, float("nan"), 1, 1.0, 1.0, 0.1, 1.0, 1.0),
    lambda: Activation("r", "w", (HOP,), 1, "x", {}),
    lambda: Activation("r", "w", (), 0, "x", {}),
])
def test_validate_rules(build: Any) -> None:
    with pytest.raises(RemoteViolation):
        build()


def test_nested_records_round_trip_through_wire() -> None:
    fs = FleetSummary("fog-1", "s", 1.0, (DeviceSummary("d", True, battery_level=0.5),))
    assert from_wire(FleetSummary, to_wire(fs)) == fs


def test_every_message_class_is_frozen_and_slotted() -> None:
    for cls in MESSAGE_TYPES.values():
        params = cls.__dataclass_params__  # type: ignore[attr-defined]
        assert params.frozen, cls
        assert "__slots__" in cls.__dict__, cls
