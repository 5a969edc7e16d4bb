"""Energy-aware client selection: table of device states -> selected or why not."""
from __future__ import annotations

import random

import pytest

from cloud_coordinator.selection import (
    DEAD,
    FOG_UNFIT,
    LOW_BATTERY,
    METERED,
    SAMPLED_OUT,
    SELECTED,
    STALE,
    THROTTLED,
    SelectionPolicy,
    explain,
    select_clients,
)
from runtime.errors import LocalViolation
from runtime.messages import DeviceSummary, FleetSummary


def _fleet(*devs: DeviceSummary, ts: float = 100.0, fog: str = "fog-a") -> FleetSummary:
    return FleetSummary(fog, "site-a", ts, tuple(devs))


@pytest.mark.parametrize("dev, policy, want", [
    (DeviceSummary("d", True), SelectionPolicy(), SELECTED),                       # mains powered
    (DeviceSummary("d", False), SelectionPolicy(), DEAD),
    (DeviceSummary("d", True, battery_level=0.9), SelectionPolicy(), SELECTED),
    (DeviceSummary("d", True, battery_level=0.1), SelectionPolicy(), LOW_BATTERY),
    (DeviceSummary("d", True, battery_level=0.1, charging=True), SelectionPolicy(), SELECTED),
    (DeviceSummary("d", True, battery_level=0.1), SelectionPolicy(battery_floor=0.05), SELECTED),
    (DeviceSummary("d", True, throttled=True), SelectionPolicy(), THROTTLED),
    (DeviceSummary("d", True, throttled=True), SelectionPolicy(allow_throttled=True), SELECTED),
    (DeviceSummary("d", True, metered=True), SelectionPolicy(), METERED),
    (DeviceSummary("d", True, metered=True), SelectionPolicy(allow_metered=True), SELECTED),
    (DeviceSummary("d", True, fit_for_training=False), SelectionPolicy(trust_fog_verdict=True), FOG_UNFIT),
    (DeviceSummary("d", True, fit_for_training=True), SelectionPolicy(trust_fog_verdict=True), SELECTED),
])
def test_verdicts(dev: DeviceSummary, policy: SelectionPolicy, want: str) -> None:
    sel = select_clients([_fleet(dev)], 100.0, policy, random.Random(0))
    assert sel.reasons == {"d": want}
    assert sel.selected == (("d",) if want == SELECTED else ())


def test_stale_and_newest_summary_wins() -> None:
    old = _fleet(DeviceSummary("a", True, battery_level=0.9), DeviceSummary("b", True), ts=10.0, fog="f1")
    new = _fleet(DeviceSummary("a", True, battery_level=0.05), ts=95.0, fog="f2")
    sel = select_clients([old, new], 100.0, SelectionPolicy(max_age_s=30.0), random.Random(0))
    assert sel.reasons == {"a": LOW_BATTERY, "b": STALE}


def test_node_ids_and_sampling_is_seeded() -> None:
    devs = [DeviceSummary(f"d{i}", True, flwr_node_id=100 + i) for i in range(6)]
    pol = SelectionPolicy(max_clients=3)
    a = select_clients([_fleet(*devs)], 100.0, pol, random.Random(42))
    b = select_clients([_fleet(*devs)], 100.0, pol, random.Random(42))
    assert a == b and len(a.selected) == 3 and list(a.selected) == sorted(a.selected)
    assert sum(1 for w in a.reasons.values() if w == SAMPLED_OUT) == 3
    assert a.nodes == frozenset(100 + int(d[1:]) for d in a.selected)
    assert explain(a) == "3/6 devices selected: 3 sampled out"


def test_explain_counts_reasons() -> None:
    devs = [DeviceSummary("a", True, battery_level=0.1), DeviceSummary("b", True, battery_level=0.2),
            DeviceSummary("c", True, metered=True), DeviceSummary("d", True)]
    sel = select_clients([_fleet(*devs)], 100.0, SelectionPolicy(), random.Random(0))
    assert explain(sel) == "1/4 devices selected: 2 battery below floor, 1 metered link"


def test_policy_validation() -> None:
    with pytest.raises(LocalViolation):
        SelectionPolicy(battery_floor=2.0)
    with pytest.raises(LocalViolation):
        SelectionPolicy(max_clients=0)


def test_summaries_handoff_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The fog link stores verified envelopes under hashed names; the ServerApp re-verifies them."""
    from cloud_coordinator.summaries import open_summary, read_summaries, store_summary
    from runtime import codec
    from runtime.security import Identity, Signer

    s = _fleet(DeviceSummary("a", True, flwr_node_id=5))
    key = Identity.from_seed(s.fog_id, b"k")
    env = Signer(key, epoch=1).seal_bytes(s, 100.0)
    got = open_summary(env, s.fog_id, key.public_key_bytes, s.site)
    assert not isinstance(got, str) and got[1] == s
    assert open_summary(codec.encode(s), s.fog_id, key.public_key_bytes, s.site) == "malformed"
    assert open_summary(env, "../x", key.public_key_bytes, s.site) == "invalid fog id"
    assert store_summary(tmp_path, *got) == ""
    assert read_summaries(tmp_path, {s.fog_id: key.public_key_bytes}, {s.fog_id: s.site}) == [s]
    assert read_summaries(tmp_path / "missing", {s.fog_id: key.public_key_bytes}, {}) == []
