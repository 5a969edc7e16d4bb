"""The router under many streams (issue 32): every replica serves, admission against the deadline,
retries only within it, expired work never sent, ordered streams; ``now`` is advanced by hand."""
from __future__ import annotations

import numpy as np
import pytest

from fog_broker.router import ReplyClient, Router, RouterConfig, SendActivation
from runtime.messages import Hop, InferenceRequest, InferenceResult

X = {"x": np.zeros((1, 2), dtype=np.float32)}
STAGE = 0.1  # measured seconds of every stage


def chain(replica: int, *devs: str) -> tuple[int, tuple[Hop, ...]]:
    return replica, tuple(Hop(d, "w", 1, replica, i) for i, d in enumerate(devs))


C0, C1 = chain(0, "a", "b"), chain(1, "c", "d")
CHAINS = [C0, C1]


def req(rid: str, timeout: float = 1.0, stream: str = "") -> InferenceRequest:
    return InferenceRequest(rid, "w", "fogline/v1/s/reply/cli", X, timeout, stream)


def measured(config: RouterConfig | None = None) -> Router:
    r = Router("fog", config)
    for rep in (0, 1):
        for i in (0, 1):
            r.note_stage(("w", 1, rep, i), STAGE)
    return r


def sends(cmds: list[object]) -> list[SendActivation]:
    return [c for c in cmds if isinstance(c, SendActivation)]


def answer(r: Router, send: SendActivation, now: float, ok: bool = True) -> list[object]:
    act = send.activation
    last = act.route[-1].device_id
    res = InferenceResult(act.request_id, ok, {"y": np.ones(1)} if ok else {}, "" if ok else f"{last}: boom", last)
    return list(r.result(res, CHAINS, now, 100.0 + now, sender=last))


def test_requests_spread_over_every_replica_chain() -> None:
    r = measured()
    devs = [sends(r.submit(req(f"r{i}"), CHAINS, 0.0, 100.0))[0].device for i in range(6)]
    assert devs.count("a") == 3 and devs.count("c") == 3  # equal chains: alternately


def test_spreading_follows_predicted_completion_not_turns() -> None:
    r = measured()
    r.note_stage(("w", 1, 1, 1), 3 * STAGE)  # replica 1's second stage is three times slower
    devs = [sends(r.submit(req(f"r{i}", timeout=5.0), CHAINS, 0.0, 100.0))[0].device for i in range(8)]
    assert devs.count("a") > devs.count("c") >= 1


def test_unmeasured_chains_spread_by_outstanding_requests() -> None:
    r = Router("fog")
    devs = [sends(r.submit(req(f"r{i}"), CHAINS, 0.0, 100.0))[0].device for i in range(4)]
    assert sorted(devs) == ["a", "a", "c", "c"]


def test_primary_only_baseline_uses_the_first_chain() -> None:
    r = measured(RouterConfig(spread=False, admit=False))
    devs = {sends(r.submit(req(f"r{i}"), CHAINS, 0.0, 100.0))[0].device for i in range(30)}
    assert devs == {"a"}  # and nothing is refused however long the queue


def test_what_cannot_finish_in_time_is_refused_at_once_with_retry_after() -> None:
    r = measured()
    admitted, refused = [], []
    for i in range(40):
        (cmd,) = r.submit(req(f"r{i}", timeout=1.0), CHAINS, 0.0, 100.0)
        (admitted if isinstance(cmd, SendActivation) else refused).append(cmd)
    # each chain holds what it finishes within 1 s at 0.1 s a stage: queue x 0.1 + 0.2 <= 1.0
    assert 2 * 7 <= len(admitted) <= 2 * 9
    first = refused[0]
    assert isinstance(first, ReplyClient) and first.result.failure == "overloaded"
    assert "deadline" in first.result.error and first.result.retry_after_s > 0
    assert r.counters["shed"] == len(refused)
    # a longer deadline is admitted on the same queues
    assert sends(r.submit(req("long", timeout=3.0), CHAINS, 0.0, 100.0))


def test_admission_frees_up_as_answers_come_back() -> None:
    r = measured()
    out = [r.submit(req(f"r{i}"), CHAINS, 0.0, 100.0)[0] for i in range(30)]
    admitted = [c for c in out if isinstance(c, SendActivation)]
    assert isinstance(r.submit(req("x"), CHAINS, 0.0, 100.0)[0], ReplyClient)
    for i, s in enumerate(admitted[:4]):
        answer(r, s, 0.1 * (i + 1))
    assert sends(r.submit(req("y"), CHAINS, 0.5, 100.5))


def test_a_request_without_timeout_takes_the_workload_slo() -> None:
    r = measured()
    r.set_slo("w", 0.25)
    (s,) = r.submit(req("a", timeout=0.0), CHAINS, 0.0, 100.0)
    assert isinstance(s, SendActivation) and s.activation.deadline == pytest.approx(100.25)
    r.submit(req("b", timeout=0.0), CHAINS, 0.0, 100.0)
    (refused,) = r.submit(req("c", timeout=0.0), CHAINS, 0.0, 100.0)  # 0.1 queued + 0.2 > 0.25
    assert isinstance(refused, ReplyClient) and refused.result.failure == "overloaded"


def test_hard_bound_per_chain_while_nothing_is_measured() -> None:
    r = Router("fog", RouterConfig(max_outstanding=2))
    cmds = [r.submit(req(f"r{i}"), CHAINS, 0.0, 100.0)[0] for i in range(5)]
    assert [isinstance(c, SendActivation) for c in cmds] == [True] * 4 + [False]
    assert cmds[-1].result.failure == "overloaded"  # type: ignore[union-attr]


def test_failure_retries_on_another_chain_only_if_the_deadline_allows() -> None:
    r = measured()
    (s,) = r.submit(req("r", timeout=1.0), CHAINS, 0.0, 100.0)
    (again,) = answer(r, s, 0.2, ok=False)  # 0.2 + 0.2 on the other chain <= 1.0
    assert isinstance(again, SendActivation) and again.device == "c"
    r2 = measured()
    (s2,) = r2.submit(req("r", timeout=1.0), CHAINS, 0.0, 100.0)
    (final,) = answer(r2, s2, 0.9, ok=False)  # 0.9 + 0.2 > 1.0: no retry, the error now
    assert isinstance(final, ReplyClient) and not final.result.ok and r2.counters["retries"] == 0


def test_device_loss_retries_within_the_deadline_and_each_request_is_answered_once() -> None:
    r = measured()
    first = [sends(r.submit(req(f"r{i}"), CHAINS, 0.0, 100.0))[0] for i in range(4)]
    lost = r.device_lost("b", {"w": [C1]}, 0.05, 100.05)
    moved = sends(lost)
    assert {m.device for m in moved} == {"c"} and len(moved) == sum(1 for s in first if s.device == "a")
    replies = []
    for s in [s for s in first if s.device == "c"] + moved:
        replies += [c for c in answer(r, s, 0.9) if isinstance(c, ReplyClient)]
    assert sorted(c.result.request_id for c in replies) == ["r0", "r1", "r2", "r3"]
    assert len(r) == 0
    # a late answer of a lost attempt is dropped, not a second reply
    assert answer(r, next(s for s in first if s.device == "a"), 0.95) == []


def test_an_attempt_that_may_still_make_it_keeps_its_chain_until_the_deadline() -> None:
    r = measured()
    (s,) = r.submit(req("r", timeout=1.0), CHAINS, 0.0, 100.0)
    # its share (prediction + half the slack) passes, but the other chain cannot finish in time
    # either once more is queued there: no duplicate, it keeps waiting
    for i in range(7):
        r.submit(req(f"x{i}"), [C1], 0.0, 100.0)
    assert r.tick(0.7, {"w": CHAINS}, 100.7) == []
    (reply,) = answer(r, s, 0.95)
    assert isinstance(reply, ReplyClient) and reply.result.ok
    assert r.counters["in_deadline"] == 1


def test_expired_requests_are_answered_as_timeouts_and_never_sent() -> None:
    r = measured()
    (s,) = r.submit(req("r", timeout=0.5), [C0], 0.0, 100.0)
    (reply,) = r.tick(0.5, {"w": [C0]}, 100.5)
    assert isinstance(reply, ReplyClient) and reply.result.failure == "timeout"
    assert s.activation.deadline == pytest.approx(100.5)  # the devices drop it past this, uncomputed
    r2 = measured()
    assert sends(r2.submit(req("r", timeout=0.5), CHAINS, 0.0, 100.0))
    cmds = r2.device_lost("a", {"w": CHAINS}, 0.6, 100.6)  # failed after its deadline: not re-sent
    assert not sends(cmds) and cmds[0].result.failure == "timeout"  # type: ignore[union-attr]


def test_ordered_stream_answers_come_back_in_order() -> None:
    r = measured()
    s = [sends(r.submit(req(f"f{i}", stream="cam1"), CHAINS, 0.0, 100.0))[0] for i in range(4)]
    assert {x.device for x in s} == {"a", "c"}  # still spread
    other = sends(r.submit(req("u"), CHAINS, 0.0, 100.0))[0]
    assert answer(r, s[1], 0.3) == []        # f1 waits for f0
    assert answer(r, s[3], 0.4) == []
    (u,) = answer(r, other, 0.45)            # not in a stream: at once
    assert isinstance(u, ReplyClient) and u.result.request_id == "u"
    out = answer(r, s[0], 0.5)
    assert [c.result.request_id for c in out] == ["f0", "f1"]  # type: ignore[attr-defined]
    out = answer(r, s[2], 0.6, ok=False)     # an error takes its turn too (retried first)
    retry = sends(out)
    assert retry and answer(r, retry[0], 0.8) and not r._held  # f2 then f3 released


def test_stats_give_offered_goodput_shed_and_utilization() -> None:
    r = measured()
    out = [r.submit(req(f"r{i}"), CHAINS, 0.0, 100.0)[0] for i in range(30)]
    for i, s in enumerate(c for c in out if isinstance(c, SendActivation)):
        answer(r, s, 0.1 * (i + 1))
    st = r.stats("w", CHAINS, 2.0, window_s=2.0)
    assert st.offered_rps == pytest.approx(15.0)
    assert st.shed_rps == pytest.approx(r.counters["shed"] / 2.0) and st.shed_rps > 0
    assert 0 < st.goodput_rps <= st.offered_rps and st.chains == 2 and 0 < st.utilization <= 1.0


def test_a_chain_whose_answers_vary_is_admitted_with_a_margin() -> None:
    def admitted(jitter: float) -> int:
        r = measured()
        for k in range(40):  # answers at idle: 0.2 s of stages, 0.05 s overhead, +- jitter
            (s,) = r.submit(req(f"w{k}", timeout=5.0), [C0], 10.0 * k, 100.0)
            answer(r, s, 10.0 * k + 0.25 + (jitter if k % 2 else -jitter))  # type: ignore[arg-type]
        now = 1000.0
        return sum(isinstance(r.submit(req(f"r{i}"), [C0], now, 100.0)[0], SendActivation) for i in range(20))
    steady, jittery = admitted(0.0), admitted(0.1)
    assert steady == 8 and 2 <= jittery < steady  # n x 0.1 queued + 0.25 <= 1; fewer with 2 x dev to spare


def test_in_process_front_ends_order_a_stream_across_their_per_request_reply_ids() -> None:
    r = measured()
    local = [InferenceRequest(f"f{i}", "w", f"local:{i}", X, 1.0, "app\0cam1") for i in range(2)]
    s0, s1 = (sends(r.submit(q, CHAINS, 0.0, 100.0))[0] for q in local)
    assert answer(r, s1, 0.3) == []
    out = answer(r, s0, 0.4)
    assert [(c.reply_to, c.result.request_id) for c in out] == [("local:0", "f0"), ("local:1", "f1")]  # type: ignore[attr-defined]


def test_a_chain_not_yet_timed_takes_what_the_timed_ones_cannot_finish() -> None:
    r = Router("fog")
    for i in (0, 1):
        r.note_stage(("w", 1, 0, i), STAGE)  # replica 1 was just placed: no stage time yet
    devs = [sends(r.submit(req(f"r{i}"), CHAINS, 0.0, 100.0))[0].device for i in range(12)]
    assert devs[:9] == ["a"] * 9 and set(devs[9:]) == {"c"}  # chain 0 full for a 1 s deadline (n x 0.1 + 0.2)


def test_a_deadline_no_chain_meets_even_idle_is_a_timeout_not_overload() -> None:
    """Retrying later would not help: the failure is a timeout (OIP 504) with no Retry-After, and it
    is not counted as shed load (the autoscaler must not add chains for it). An idle chain takes one
    such request a second anyway (the probe that unlearns a wrong prediction)."""
    r = measured()
    assert sends(r.submit(req("p", timeout=0.05), [C0], 0.0, 100.0))  # an idle chain's probe (below)
    (res,) = r.submit(req("a", timeout=0.05), [C0], 0.0, 100.0)  # the chain takes 0.2 s unloaded
    assert isinstance(res, ReplyClient) and res.result.failure == "timeout"
    assert res.result.retry_after_s == 0 and "cannot be met" in res.result.error
    assert r.stats("w", [C0], 0.1).shed_rps == 0.0 and r.counters["impossible"] == 1
    assert sends(r.submit(req("b", timeout=1.0), [C1], 0.0, 100.0))  # a deadline it can meet is admitted


def test_a_chain_refusing_on_what_it_learned_takes_an_idle_probe_and_unlearns_it() -> None:
    """A first answer slowed by a pause teaches a chain a big overhead; answers alone can correct it,
    so an idle chain takes one request a second whatever its prediction, and serves again after."""
    r = measured()
    (s,) = sends(r.submit(req("slow", timeout=2.0), [C0], 0.0, 100.0))
    answer(r, s, 1.5)  # 1.5 s for 0.2 s of stages: 1.3 s learned as overhead
    (probe,) = sends(r.submit(req("x", timeout=1.0), [C0], 1.6, 101.6))  # idle: taken anyway
    (refused,) = r.submit(req("y", timeout=1.0), [C0], 1.61, 101.61)
    assert isinstance(refused, ReplyClient)  # not idle now: refused on the prediction
    answer(r, probe, 1.85)  # the probe answers in 0.25 s
    admitted_at = None
    for k in range(30):  # idle probes a second apart, each answered in 0.25 s, until one that is no probe fits
        t = 3.0 + 1.5 * k
        first = sends(r.submit(req(f"p{k}", timeout=1.0), [C0], t, 100.0 + t))  # idle: admitted either way
        second = sends(r.submit(req(f"q{k}", timeout=1.0), [C0], t, 100.0 + t))  # busy: only on its prediction
        for g in first + second:
            answer(r, g, t + 0.25)
        if second:
            admitted_at = t
            break
    assert r.counters["probes"] >= 1
    assert admitted_at is not None  # the chain serves on its prediction again


def test_stages_that_batch_drain_their_queues_faster_and_admit_more() -> None:
    plain, batched = measured(), measured()
    for rep in (0, 1):
        for i in (0, 1):
            batched.note_batch(("w", 1, rep, i), 8, 0.1)  # 8 frames in 1.7x one frame's time
    counts = []
    for r in (plain, batched):
        cmds = [r.submit(req(f"r{i}", timeout=1.0), CHAINS, 0.0, 100.0)[0] for i in range(80)]
        counts.append(sum(isinstance(c, SendActivation) for c in cmds))
    assert counts[0] <= 2 * 9 < 2 * 20 <= counts[1]  # the same 1 s deadline, queues drained 8 at a time
    batched.note_batch(("w", 1, 0, 0), 1, 0.1)  # the stage stopped batching: forgotten
    assert ("w", 1, 0, 0) not in batched.model.stage_batch
    batched.forget_workload("w")
    assert not batched.model.stage_batch
