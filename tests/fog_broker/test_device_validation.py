"""Issue 19: every number a device sends is finite and in range, checked once where bytes become
a message; and no record that slips past that check can stop the site's placement.

Before: ``tx_j_per_byte=-1`` (or NaN, ``rx_j_per_byte=-1e-3``, a state with ``rtt_s=-1``) decoded,
passed the clamp and ``Registry.handle``, and then ``Registry.fleet()`` raised at every reconcile,
stopping placement and repair for the whole site.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from fog_broker.placement import Fleet, Workload, schedule
from fog_broker.placement.model import Device
from fog_broker.placement.spec import SpecError
from fog_broker.registry import DeviceLost, DeviceStatus, Registry, capacity_flags
from fog_broker.trust import BirthLimits, bound_birth
from runtime import codec
from runtime.errors import DecodeError
from runtime.messages import (
    BIRTH_RANGES,
    PARTITION_RANGES,
    RESOURCE_RANGES,
    STATE_RANGES,
    DeviceBirth,
    DeviceState,
    OutOfRange,
    PartitionStatus,
)
from simulations.profiles import PROFILES, DeviceProfile

from placement_helpers import profile

KEY = bytes(32)


def birth(dev: str = "d1", epoch: int = 1, **kw: Any) -> DeviceBirth:
    args: dict[str, Any] = dict(device_id=dev, epoch=epoch, seq=1, site="s", public_key=KEY, flops=1e9,
                                memory_bytes=10_000_000, uplink_bps=1e8, downlink_bps=1e8, rtt_s=0.001,
                                power_active_w=5.0, power_idle_w=2.0, state_interval_s=10.0,
                                battery_capacity_wh=20.0)
    args.update(kw)
    return DeviceBirth(**args)


def state(dev: str = "d1", epoch: int = 1, **kw: Any) -> DeviceState:
    args: dict[str, Any] = dict(device_id=dev, epoch=epoch, seq=2, free_memory_bytes=9_000_000,
                                battery_level=0.9, power_w=3.0, temperature_c=40.0, uplink_bps=1e8,
                                rtt_s=0.001, flwr_node_id=7, clock_skew_s=0.1,
                                partitions=(PartitionStatus("w", 1, 0, 0, "a" * 64, "running"),))
    args.update(kw)
    return DeviceState(**args)


def forged(msg: Any, **bad: Any) -> bytes:
    """The wire bytes of ``msg`` with ``bad`` fields, as a device that skips our checks sends them."""
    for k, v in bad.items():
        object.__setattr__(msg, k, v)
    return codec.encode(msg)


def _bad_values(name: str, r: Any, is_int: bool) -> hs.SearchStrategy[Any]:
    below = [r.lo - 1] if is_int else [math.nextafter(r.lo, -math.inf), r.lo - 1.0, -1e300]
    if r.lo_open:
        below.append(int(r.lo) if is_int else float(r.lo))
    above = [r.hi + 1] if is_int else [r.hi * 2 + 1.0, 1e300]
    # msgpack carries integers in [-2**63, 2**64 - 1] only: beyond, no peer can send them
    values: list[Any] = [v for v in below + above if not is_int or -(1 << 63) <= v < (1 << 64)]
    if not is_int:
        values += [math.nan, math.inf, -math.inf]
    return hs.sampled_from(values)


def _case(ranges: Any, make: Any, int_fields: set[str]) -> hs.SearchStrategy[tuple[str, Any]]:
    return hs.sampled_from(sorted(ranges)).flatmap(
        lambda f: hs.tuples(hs.just(f), _bad_values(f, ranges[f], f in int_fields)))


def _ints(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if "int" in str(f.type) and "float" not in str(f.type)}


# ------------------------------------------------------------------ the wire check


@settings(max_examples=300, deadline=None)
@given(_case(BIRTH_RANGES, birth, _ints(DeviceBirth)))
def test_every_out_of_range_birth_figure_is_refused_at_decode(case: tuple[str, Any]) -> None:
    field, value = case
    with pytest.raises(DecodeError) as err:
        codec.decode(forged(birth(), **{field: value}))
    bad = err.value.out_of_range
    assert bad is not None and (bad.owner, bad.field) == ("DeviceBirth", field)
    assert repr(bad.value) == repr(value)


@settings(max_examples=300, deadline=None)
@given(_case(STATE_RANGES, state, _ints(DeviceState)))
def test_every_out_of_range_state_figure_is_refused_at_decode(case: tuple[str, Any]) -> None:
    field, value = case
    with pytest.raises(DecodeError) as err:
        codec.decode(forged(state(), **{field: value}))
    bad = err.value.out_of_range
    assert bad is not None and (bad.owner, bad.field) == ("DeviceState", field)


@settings(max_examples=200, deadline=None)
@given(_case(PARTITION_RANGES, None, _ints(PartitionStatus)))
def test_every_out_of_range_partition_figure_is_refused_at_decode(case: tuple[str, Any]) -> None:
    field, value = case
    p = PartitionStatus("w", 1, 0, 0, "a" * 64, "running")
    object.__setattr__(p, field, value)
    with pytest.raises(DecodeError) as err:
        codec.decode(forged(state(partitions=(p,))))
    bad = err.value.out_of_range
    assert bad is not None and (bad.owner, bad.field) == ("PartitionStatus", field)


def _good(r: Any, is_int: bool) -> hs.SearchStrategy[Any]:
    if is_int:
        return hs.integers(int(r.lo) + (1 if r.lo_open else 0), int(r.hi))
    return hs.floats(r.lo, r.hi, allow_nan=False, exclude_min=r.lo_open)


@settings(max_examples=200, deadline=None)
@given(hs.fixed_dictionaries({f: _good(r, f in _ints(DeviceBirth)) for f, r in BIRTH_RANGES.items()}))
def test_any_birth_inside_the_ranges_round_trips(values: dict[str, Any]) -> None:
    b = birth(**values)
    assert codec.decode(codec.encode(b)) == b


@pytest.mark.parametrize("field,value", [
    ("tx_j_per_byte", -1.0), ("tx_j_per_byte", math.nan), ("rx_j_per_byte", -1e-3),
    ("rx_j_per_byte", math.inf), ("battery_capacity_wh", -5.0), ("cpu_count", -3), ("uplink_bps", -5.0),
])
def test_the_reported_values_are_refused(field: str, value: Any) -> None:
    """The exact adverts of the report: each one names its field and value."""
    with pytest.raises(OutOfRange, match=field):
        birth(**{field: value})
    with pytest.raises(OutOfRange, match="rtt_s"):
        state(rtt_s=-1.0)


def test_one_table_feeds_the_clamp_the_model_and_the_profiles() -> None:
    lim = BirthLimits()
    assert lim.max_flops == BIRTH_RANGES["flops"].plausible
    assert lim.max_memory_bytes == BIRTH_RANGES["memory_bytes"].plausible
    assert lim.max_state_interval_s == BIRTH_RANGES["state_interval_s"].plausible
    # a claim within the protocol but beyond any real device: clamped and flagged, not refused
    b, flags = bound_birth(birth(flops=1e16))
    assert b.flops == lim.max_flops and flags == ("implausible flops",)
    with pytest.raises(SpecError, match="rtt_s"):
        Device(id="x", flops=1e9, memory_bytes=10**6, uplink_bps=1e8, downlink_bps=1e8, rtt_s=-1.0,
               power_active_w=0.0, power_idle_w=0.0)
    with pytest.raises(SpecError, match="flops"):
        Device(id="x", flops=math.inf, memory_bytes=10**6, uplink_bps=1e8, downlink_bps=1e8, rtt_s=0.0,
               power_active_w=0.0, power_idle_w=0.0)
    with pytest.raises(ValueError, match="tx_j_per_byte"):
        dataclasses.replace(PROFILES["pi4"], tx_j_per_byte=-1.0)
    assert all(isinstance(p, DeviceProfile) for p in PROFILES.values())  # every shipped profile fits
    assert set(RESOURCE_RANGES) <= set(BIRTH_RANGES)


# ------------------------------------------------------------------ defence in depth: the registry


def _wl(name: str, replicas: int = 1) -> Workload:
    return Workload(name=name, source="src", sink="src", profile=profile(3), replicas=replicas)


def _site() -> Registry:
    reg = Registry()
    for i, did in enumerate(("src", "a", "b", "c")):
        reg.handle(birth(did, labels={"power-domain": f"p{i}"}), 0.0)
        reg.handle(state(did, partitions=()), 0.1)
    return reg


@pytest.mark.parametrize("field,value", [
    ("power_active_w", -1.0), ("tx_j_per_byte", math.nan), ("rx_j_per_byte", -1e-3), ("downlink_bps", math.inf),
    ("flops", "not a number"), ("power_idle_w", None),
])
def test_a_record_broken_past_validation_is_set_aside_and_the_site_goes_on(field: str, value: Any) -> None:
    reg = _site()
    fleet = reg.fleet()
    assert {d.id for d in fleet.devices} == {"src", "a", "b", "c"}
    broken = reg.devices["b"].birth
    assert broken is not None
    object.__setattr__(broken, field, value)  # past every check, as a bug or a new path might
    reg.invalidate()
    fleet = reg.fleet()  # must not raise
    assert {d.id for d in fleet.devices} == {"src", "a", "c"}
    assert reg.devices["b"].set_aside and reg.set_aside >= 1
    plan = schedule(fleet, [_wl("w", replicas=2)])
    assert plan.result("w").placed
    assert all(p.device != "b" for r in plan.result("w").replicas for p in r.partitions)
    # even with a measurement to compare a broken claim with, nothing raises
    reg.note_measured("b", 1e9)
    object.__setattr__(broken, "flops", "not a number")
    reg.invalidate()
    assert {d.id for d in reg.fleet().devices} >= {"src", "a", "c"}
    # a state that breaks the record the same way (e.g. a bad rtt_s) is set aside too
    st = reg.devices["c"].state
    assert st is not None
    object.__setattr__(st, "rtt_s", -1.0)
    reg.invalidate()
    ids = {d.id for d in reg.fleet().devices}
    assert "c" not in ids and {"src", "a"} <= ids and reg.devices["c"].set_aside


def test_a_rejected_device_is_lost_shown_and_back_only_with_a_clean_birth() -> None:
    reg = _site()
    cmds = reg.reject("a", 1.0, "DeviceState.rtt_s=-1.0")
    assert [type(c) for c in cmds] == [DeviceLost]
    rec = reg.devices["a"]
    assert rec.status is DeviceStatus.DEAD and rec.rejected == "DeviceState.rtt_s=-1.0"
    dev = reg.fleet().get("a")
    assert dev is not None and not dev.alive
    plan = schedule(reg.fleet(), [_wl("w")])
    assert all(p.device != "a" for r in plan.result("w").replicas for p in r.partitions)
    # its states only ask for a birth; a clean birth brings it back and clears the rejection
    reg.handle(state("a", partitions=()), 5.0)
    assert not reg.devices["a"].alive
    reg.handle(birth("a", epoch=2), 6.0)
    assert reg.devices["a"].alive and not reg.devices["a"].rejected
    # a device rejected at its first advert is known, dead and shown
    assert reg.reject("new", 7.0, "DeviceBirth.cpu_count=-3") == []
    assert reg.devices["new"].status is DeviceStatus.DEAD and reg.devices["new"].rejected


# ------------------------------------------------------------------ issue 20 finding 5 (pure side)


def test_measured_compute_replaces_the_claim_and_a_far_higher_claim_is_flagged() -> None:
    reg = _site()
    reg.handle(birth("a", flops=4.9e14, labels={"power-domain": "p1"}), 1.0)
    assert reg.fleet().get("a").flops == 4.9e14  # type: ignore[union-attr]
    assert capacity_flags(reg.devices["a"]) == ()
    reg.note_measured("a", 2e9)
    dev = reg.fleet().get("a")
    assert dev is not None and dev.flops == 2e9 and not dev.verified
    assert capacity_flags(reg.devices["a"]) == ("flops claim far above measured",)
    # a clean birth whose claim agrees with the measurement clears it
    reg.handle(birth("a", epoch=2, flops=3e9, labels={"power-domain": "p1"}), 2.0)
    assert capacity_flags(reg.devices["a"]) == () and reg.fleet().get("a").verified  # type: ignore[union-attr]


def test_clamp_flags_hold_until_a_clean_birth() -> None:
    reg = _site()
    reg.note_claim_flags("a", ("implausible flops",))
    reg.handle(birth("a", epoch=2, flops=5e14), 1.0)
    assert not reg.fleet().get("a").verified  # type: ignore[union-attr]
    reg.note_claim_flags("a", ())
    reg.handle(birth("a", epoch=3), 2.0)
    assert reg.fleet().get("a").verified  # type: ignore[union-attr]


def test_fleet_is_still_one_object_while_nothing_changed() -> None:
    reg = _site()
    f1 = reg.fleet()
    assert reg.fleet() is f1
    assert isinstance(f1, Fleet)


# ------------------------------------------------------------------ the fog's intake, both verify modes


@pytest.mark.integration
@pytest.mark.parametrize("processes", [False, True], ids=["threads", "worker-processes"])
def test_ingest_names_the_device_field_and_value_of_a_refused_advert(processes: bool) -> None:
    import queue
    import time

    from fog_broker.ingest import Ingest
    from runtime.mqtt import Inbound
    from runtime.security import Identity, SessionKeyPair, Signer, TrustStore
    from runtime.topics import Topics

    ident = Identity.generate("dev-x")
    got: queue.Queue[Any] = queue.Queue()
    ing = Ingest(TrustStore({"dev-x": ident.public_key_bytes}), SessionKeyPair(), got.put, shards=1,
                 processes=processes)
    ing.start()
    try:
        signer, t = Signer(ident, 1), Topics("s")
        good = birth("dev-x", public_key=ident.public_key_bytes)
        bad = birth("dev-x", public_key=ident.public_key_bytes)
        object.__setattr__(bad, "tx_j_per_byte", -1.0)  # signed by the device, past our checks
        ing.on_device(Inbound(t.device("dev-x", "BIRTH"), signer.seal_bytes(good, time.time()), 1.0))
        ing.on_device(Inbound(t.device("dev-x", "BIRTH"), signer.seal_bytes(bad, time.time()), 2.0))
        from fog_broker.site_core import AdvertRejected, ClaimFlags
        seen: list[Any] = []
        deadline = time.monotonic() + 30
        while not any(isinstance(x, AdvertRejected) for x in seen) and time.monotonic() < deadline:
            try:
                item = got.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.extend(h.event for h in item.items)
        bad_items = [x for x in seen if isinstance(x, AdvertRejected)]
        # the field and the value as attributes, never text to parse back
        assert bad_items and (bad_items[0].device_id, bad_items[0].field, bad_items[0].value) == (
            "dev-x", "DeviceBirth.tx_j_per_byte", "-1.0")
        assert bad_items[0].text == "DeviceBirth.tx_j_per_byte=-1.0"
        assert ing.counts()["rejected:out of range"] == 1
        assert [type(x) for x in seen].count(ClaimFlags) == 1  # the clean birth's (empty) flags
    finally:
        ing.stop()


def test_out_of_range_keeps_its_fields_across_the_verify_pipe() -> None:
    """The verify processes send a refused payload's ``OutOfRange`` back pickled: fields intact."""
    import pickle

    bad = OutOfRange("DeviceBirth", "flops", math.inf, "not finite")
    back = pickle.loads(pickle.dumps(bad))
    assert (back.owner, back.field, back.value, back.why) == ("DeviceBirth", "flops", math.inf, "not finite")
    assert str(back) == str(bad)
