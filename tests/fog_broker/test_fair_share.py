"""The fair-share core: budgets per (identity, kind), the liveness lane, the quarantine rule.

The rule (issue 29): traffic past a budget is throttled and counted, never quarantined (a
quarantine withholds a sender's writes, its liveness too, so a busy honest device would be
declared lost); only failed checks (``charge``) quarantine.
"""
from __future__ import annotations

import pytest

from fog_broker.ratelimit import BULK, LIVE, OVER, QUARANTINED, Budget, FairShare, SharePolicy

POLICY = SharePolicy(limits={"STATE": Budget(10.0, 5.0), "BIRTH": Budget(1.0, 2.0)},
                     live={"STATE": Budget(1.0, 2.0)}, quarantine_failures=20, window_s=10.0, quarantine_s=60.0)


def run(share: FairShare, sends: list[tuple[str, str, float]]) -> list[str]:
    return [share.admit(who, kind, now) for who, kind, now in sends]


@pytest.mark.parametrize("name, sends, want", [
    ("a burst: live share first, then bulk, then dropped",
     [("a", "STATE", 0.0)] * 6, [LIVE, LIVE, BULK, BULK, BULK, OVER]),
    ("a kind with no live share is always live within its budget",
     [("a", "BIRTH", 0.0)] * 3, [LIVE, LIVE, OVER]),
    ("a kind not in the policy is not limited",
     [("a", "ACK", 0.0)] * 50, [LIVE] * 50),
    ("budgets refill with time",
     [("a", "BIRTH", 0.0), ("a", "BIRTH", 0.0), ("a", "BIRTH", 0.0), ("a", "BIRTH", 1.0)], [LIVE, LIVE, OVER, LIVE]),
    ("one state a second stays live forever",
     [("a", "STATE", float(t)) for t in range(100)], [LIVE] * 100),
    ("kinds have separate budgets",
     [("a", "BIRTH", 0.0)] * 2 + [("a", "STATE", 0.0)] * 2, [LIVE] * 4),
    ("identities have separate budgets",
     [("a", "BIRTH", 0.0)] * 3 + [("b", "BIRTH", 0.0)] * 2, [LIVE, LIVE, OVER, LIVE, LIVE]),
])
def test_budgets(name: str, sends: list[tuple[str, str, float]], want: list[str]) -> None:
    assert run(FairShare(POLICY), sends) == want, name


def test_a_fast_honest_sender_is_throttled_never_quarantined() -> None:
    """Before: 20 drops within 10 s quarantined a sender, however valid its messages."""
    share = FairShare(POLICY)
    for i in range(100_000):  # 10,000 a second for 10 s, against a budget of 10 a second
        share.admit("busy", "STATE", i * 1e-4)
    assert not share.quarantined("busy", 10.0) and share.shut_out(10.0) == frozenset()
    assert share.admit("busy", "STATE", 11.0) in (LIVE, BULK)  # its budget refilled: served again
    v = share.view(11.0)
    assert v["quarantined"] == {} and v["quarantines"] == 0 and v["dropped"]["busy"] > 99_000


def test_a_flooder_failing_checks_is_quarantined_the_others_are_not() -> None:
    share = FairShare(POLICY)
    for i in range(3000):  # only what is within budget gets checked (and fails)
        if share.admit("evil", "STATE", i * 0.001) in (LIVE, BULK):
            share.charge("evil", "STATE", i * 0.001)  # e.g. a bad signature
        if i % 1000 == 0:  # one a second: within the live share
            assert share.admit("good", "STATE", i * 0.001) == LIVE
    assert share.quarantined("evil", 3.0) and not share.quarantined("good", 3.0)
    # while quarantined even an in-budget kind is refused; the others are untouched
    assert share.admit("evil", "BIRTH", 30.0) == QUARANTINED
    assert share.admit("good", "BIRTH", 30.0) == LIVE
    v = share.view(30.0)
    assert list(v["quarantined"]) == ["evil"] and v["quarantines"] == 1
    q = v["quarantined"]["evil"]
    assert q["reason"].startswith("flooding: 20 STATE failed checks") and 0 < q["remaining_s"] <= 60
    assert v["failed"]["evil"] >= 10 and "good" not in v["dropped"] and "good" not in v["failed"]


def test_excess_counts_only_once_a_sender_keeps_failing_checks() -> None:
    """A fast flood is mostly unchecked (over budget): after ``suspect_failures`` failed checks its
    excess counts too; a sender with fewer (a few QoS 1 duplicates) is only throttled."""
    p = SharePolicy(limits={"STATE": Budget(10.0, 5.0)}, quarantine_failures=50, suspect_failures=10)
    few, many = FairShare(p), FairShare(p)
    for share, fails in ((few, 9), (many, 10)):
        for _ in range(fails):
            share.charge("d", "STATE", 0.0)
        for i in range(1000):
            share.admit("d", "STATE", 0.001 * i)
    assert not few.quarantined("d", 1.0) and few.view(1.0)["dropped"]["d"] > 900
    assert many.quarantined("d", 1.0)


def test_quarantine_ends_and_a_fresh_budget_serves_again() -> None:
    share = FairShare(POLICY)
    for _ in range(30):
        share.charge("evil", "STATE", 0.0)
    assert share.admit("evil", "STATE", 59.9) == QUARANTINED
    assert share.admit("evil", "STATE", 60.5) == LIVE
    assert share.view(60.5)["quarantined"] == {}


def test_slow_failures_never_quarantine() -> None:
    """Failures spread thinner than the rule (under 20 in any 10 s) are counted, not quarantined."""
    share = FairShare(POLICY)
    for t in range(200):
        share.charge("a", "BIRTH", float(t))  # one a second
    assert not share.quarantined("a", 200.0) and share.view(200.0)["failed"]["a"] == 200


def test_memory_is_bounded_and_forget_resets() -> None:
    p = SharePolicy(limits={"STATE": Budget(1.0, 1.0)}, max_identities=100)
    share = FairShare(p)
    for i in range(1000):
        share.admit(f"d{i}", "STATE", 0.0)
    assert len(share._senders) == 100
    assert share.admit("d999", "STATE", 0.0) == OVER
    share.forget("d999")
    assert share.admit("d999", "STATE", 0.0) == LIVE


@pytest.mark.parametrize("rate, burst", [(0.0, 1.0), (1.0, 0.5), (-1.0, 5.0)])
def test_bad_budgets_are_refused(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        Budget(rate, burst)


def test_a_charge_counts_as_a_failure_and_quarantines() -> None:
    """A payload signed by someone other than its topic's id is charged to the topic's id."""
    share = FairShare(SharePolicy(limits={"CTL": Budget(10.0, 10.0)}, quarantine_failures=3, window_s=10.0,
                                  quarantine_s=60.0))
    assert [share.charge("evil", "CTL", 0.0) for _ in range(3)] == [False, False, True]
    assert share.admit("evil", "CTL", 1.0) == QUARANTINED and share.admit("admin", "CTL", 1.0) == LIVE
    assert share.shut_out(1.0) == {"evil"} and share.reason("evil").startswith("flooding: 3 CTL failed checks")


def test_log_lines_are_limited_per_key() -> None:
    from runtime.ratelimit import LogLimit
    logs = LogLimit(rate=1.0, burst=2.0)
    assert [logs.allow("a", 0.0) for _ in range(5)] == [True, True, False, False, False]
    assert logs.allow("b", 0.0)  # another key has its own lines
    assert logs.suppressed("a") == 3 and logs.suppressed("a") == 0
    assert logs.allow("a", 1.0)


def test_limits_are_exported_as_metrics() -> None:
    """Pure: drops by kind and by sender, and who is quarantined, from one snapshot."""
    from fog_broker.metrics import families
    share = FairShare(POLICY)
    for _ in range(30):
        share.admit("evil", "STATE", 0.0)
    for _ in range(20):
        share.charge("evil", "STATE", 0.0)
    snap = {
        "status": {"fog_id": "f", "site": "s", "epoch": 1, "metrics": {}, "workloads": [],
                   "counters": {"control.limited:over budget": 3},
                   "limits": {"devices": share.view(1.0), "control": FairShare(POLICY).view(1.0)}},
        "service": {}, "ingest": {"limited:STATE": 20, "limited:quarantined": 5},
        "recoveries_s": [], "in_flight": 0, "latency": {}, "identities": [],
    }
    got = {(s.name, frozenset(s.labels.items())): s.value for fam in families(snap) for s in fam.samples}
    assert got[("fogline_fog_adverts_limited_total", frozenset({("kind", "STATE")}))] == 20
    assert got[("fogline_fog_adverts_limited_total", frozenset({("kind", "quarantined")}))] == 5
    assert got[("fogline_fog_adverts_limited_total", frozenset({("kind", "BIRTH")}))] == 0
    assert got[("fogline_fog_control_limited_total", frozenset({("reason", "over budget")}))] == 3
    assert got[("fogline_fog_sender_drops_total", frozenset({("source", "devices"), ("identity", "evil")}))] == 25
    assert got[("fogline_fog_quarantined", frozenset({("source", "devices"), ("identity", "evil")}))] == 1


def test_a_quarantined_sender_keeps_its_reads_and_loses_its_writes_in_the_acl() -> None:
    from fog_broker.ratelimit import acl_shut_out
    from runtime.broker import acl_for, check_acl
    acl = acl_for("s", "fog-s", {"evil": "device", "good": "device", "app": "app"})
    assert acl_shut_out(acl, frozenset()) == acl
    out = acl_shut_out(acl, {"evil", "app", "nobody"})
    check_acl(out)  # still an ACL mosquitto takes

    def rights(text: str, user: str) -> list[str]:
        sections = text.split("\n\n")
        sec = next(s for s in sections if s.startswith(f"user {user}\n"))
        return [ln for ln in sec.splitlines() if ln.startswith("topic ")]
    assert rights(out, "good") == rights(acl, "good")
    assert rights(out, "fog-s") == rights(acl, "fog-s")
    for user in ("evil", "app"):
        assert rights(out, user) == [r for r in rights(acl, user) if r.startswith("topic read ")]
        assert rights(out, user)  # reads stay: it is told nothing, and sees the fog's STATE
    share = FairShare(POLICY)
    for _ in range(30):
        share.charge("evil", "STATE", 0.0)
    assert share.shut_out(1.0) == {"evil"} and share.shut_out(61.0) == frozenset()
    assert share.reason("evil").startswith("flooding: ") and share.reason("nobody") == ""


def test_a_second_copy_of_a_signature_is_a_replay_per_sender_and_bounded() -> None:
    from runtime.ratelimit import Copies
    c = Copies(per_sender=2, max_senders=2)
    assert [c.seen("a", b"s1"), c.seen("a", b"s1"), c.seen("b", b"s1")] == [False, True, False]
    c.seen("a", b"s2")
    c.seen("a", b"s3")  # the oldest of a's (s1) is forgotten
    assert not c.seen("a", b"s1")
    c.seen("c", b"x")   # a third sender: the oldest sender's memory goes
    assert len(c._seen) == 2
