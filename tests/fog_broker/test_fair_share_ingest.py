"""The ingest adapter of the fair share: budgets before the verify queue, live lane before bulk."""
from __future__ import annotations

import threading
from typing import Any

from fog_broker.ingest import Ingest, _Lanes
from fog_broker.ratelimit import Budget, SharePolicy
from runtime.mqtt import Inbound
from runtime.security import Identity, SessionKeyPair, TrustStore
from runtime.topics import Topics, parse

T = Topics("s")


def test_lanes_give_live_items_first_and_stay_bounded() -> None:
    lanes = _Lanes(3)
    for i in range(3):
        assert lanes.put(("bulk", i), live=False)
    assert not lanes.put(("bulk", 3), live=False)  # full: refused, counted by the caller
    for i in range(2):
        assert lanes.put(("live", i))
    assert lanes.take(3) == [("live", 0), ("live", 1), ("bulk", 0)]
    assert lanes.take(10) == [("bulk", 1), ("bulk", 2)]
    assert lanes.put("stop", force=True)
    assert lanes.take(10) == ["stop"]


def test_take_blocks_until_an_item_arrives_in_either_lane() -> None:
    lanes = _Lanes(10)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.extend(lanes.take(5)))
    t.start()
    t.join(0.1)
    assert t.is_alive() and not got
    lanes.put("x", live=False)
    t.join(5)
    assert got == ["x"]


def _ingest(policy: SharePolicy | None) -> Ingest:
    trust = TrustStore({"dev-a": Identity.generate("dev-a").public_key_bytes,
                        "evil": Identity.generate("evil").public_key_bytes})
    return Ingest(trust, SessionKeyPair(), lambda item: None, shards=1, share=policy)


POLICY = SharePolicy(limits={"STATE": Budget(1.0, 5.0)}, live={"STATE": Budget(1.0, 2.0)}, quarantine_failures=10)


def test_a_flooder_is_dropped_and_counted_before_the_verify_queue() -> None:
    ing = _ingest(POLICY)
    for k in range(100):
        ing.on_device(Inbound(T.device("evil", "STATE"), b"junk", 100.0 + k * 1e-3))
    ing.on_device(Inbound(T.device("dev-a", "STATE"), b"junk", 100.2))
    ing.on_device(Inbound(T.device("stranger", "STATE"), b"junk", 100.2))
    c = ing.counts()
    # over its budget: throttled, not quarantined (nothing failed a check yet)
    assert c["limited:STATE"] == 95 and c["limited:quarantined"] == 0 and c["rejected:unknown sender"] == 1
    queued = ing._shards[0].lanes.take(1000)
    # evil's first 2 in its live share, 3 more as bulk; dev-a's one state is live, so ahead of evil's bulk
    assert [(pt.name, m.received_at) for m, pt in queued][:3] == [("evil", 100.0), ("evil", 100.001),
                                                                  ("dev-a", 100.2)]
    assert len(queued) == 6
    lim = ing.limits(101.0)
    assert lim["quarantined"] == {} and lim["dropped"] == {"evil": 95}


def test_frames_failing_their_checks_quarantine_their_sender_only() -> None:
    """Junk (malformed, bad signatures) checked on a shard thread is charged to its topic's device."""
    ing = _ingest(POLICY)
    out: list[Any] = []
    shard = ing._shards[0]
    for k in range(12):
        m = Inbound(T.device("evil", "STATE"), b"junk%d" % k, 100.0 + k)
        ing._local(shard, m, parse(m.topic), out)
    ing.on_device(Inbound(T.device("dev-a", "STATE"), b"x", 112.0))  # the MQTT worker charges them
    assert ing.shut_out(112.0) == {"evil"}
    assert ing.limits(112.0)["quarantined"]["evil"]["reason"].startswith("flooding: 10 STATE failed checks")
    ing.on_device(Inbound(T.device("evil", "STATE"), b"junk", 112.0))
    assert ing.counts()["limited:quarantined"] == 1
    ing.forget("evil")
    assert ing.limits(113.0)["quarantined"] == {}


def test_honest_failures_never_count_towards_a_quarantine() -> None:
    """A clock outside the window or a lost session (either side restarted) asks for a rebirth."""
    from runtime.security import NO_SESSION, OUTSIDE_WINDOW
    ing = _ingest(POLICY)
    shard = ing._shards[0]
    m = Inbound(T.device("dev-a", "STATE"), b"x", 1.0)
    for _ in range(50):
        for reason in (OUTSIDE_WINDOW, NO_SESSION):
            ing._rejected(shard, m, parse(m.topic), reason, "", [])
    ing.on_device(Inbound(T.device("dev-a", "STATE"), b"x", 2.0))
    assert ing.shut_out(2.0) == frozenset() and ing.limits(2.0).get("failed") == {}


def test_limits_off_queues_everything() -> None:
    ing = _ingest(None)
    for _ in range(100):
        ing.on_device(Inbound(T.device("evil", "STATE"), b"junk", 100.0))
    assert not any(k.startswith("limited:") for k in ing.counts())
    assert len(ing._shards[0].lanes.take(1000)) == 100
    assert ing.limits(0.0) == {} and ing.shut_out(0.0) == frozenset()
