"""The HTTP API's connection table (pure): whom it admits, whom it sheds, whom it refuses."""
from __future__ import annotations

import pytest

from fog_broker.http_limits import ConnectionTable, HttpLimits
from runtime.errors import LocalViolation


def test_a_peer_at_its_cap_sheds_its_own_longest_idle_connection() -> None:
    t: ConnectionTable[str] = ConnectionTable(10, 2)
    assert t.open("a1", "A", 0.0).admit
    assert t.open("a2", "A", 1.0).admit
    t.busy("a1")                               # a1 handles a request: never shed
    adm = t.open("a3", "A", 2.0)
    assert adm.admit and adm.close == ("a2",)
    assert t.of_peer("A") == 2 and t.shed == 1
    t.busy("a3")
    adm = t.open("a4", "A", 3.0)               # every connection of A is busy: refuse the new one
    assert not adm.admit and "busy" in adm.reason and t.refused == 1
    assert t.open("b1", "B", 3.0).admit        # another peer is not affected


def test_a_full_table_sheds_from_the_peer_with_most_connections() -> None:
    t: ConnectionTable[str] = ConnectionTable(4, 3)
    for k, peer, now in [("x1", "X", 0.0), ("x2", "X", 1.0), ("x3", "X", 2.0), ("v1", "V", -5.0)]:
        assert t.open(k, peer, now).admit
    adm = t.open("v2", "V", 4.0)               # v1 is the longest idle, but X holds the most
    assert adm.admit and adm.close == ("x1",) and len(t) == 4


def test_idle_since_is_the_end_of_the_last_request() -> None:
    t: ConnectionTable[str] = ConnectionTable(10, 2)
    t.open("a1", "A", 0.0)
    t.open("a2", "A", 1.0)
    t.busy("a1")
    t.idle("a1", 5.0)                          # a keep-alive that just answered is newer than a2
    assert t.open("a3", "A", 6.0).close == ("a2",)
    t.closed("a1")
    t.closed("a1")                             # idempotent
    assert t.of_peer("A") == 1


def test_limits_are_checked() -> None:
    with pytest.raises(LocalViolation):
        HttpLimits(max_per_peer=0)
    with pytest.raises(LocalViolation):
        HttpLimits(max_connections=4, max_per_peer=5)
    with pytest.raises(LocalViolation):
        HttpLimits(header_timeout_s=0)
