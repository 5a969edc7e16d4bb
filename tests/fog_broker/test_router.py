"""Inference router core: every accepted request ends in exactly one reply; failover once."""
from __future__ import annotations

import numpy as np

from fog_broker.router import ReplyClient, Router, RouterConfig, SendActivation
from runtime.messages import Hop, InferenceRequest, InferenceResult

X = {"x": np.zeros((1, 2), dtype=np.float32)}


def chain(replica: int, *devs: str) -> tuple[int, tuple[Hop, ...]]:
    return replica, tuple(Hop(d, "w", 1, replica, i) for i, d in enumerate(devs))


def req(rid: str = "r1", timeout: float = 4.0) -> InferenceRequest:
    return InferenceRequest(rid, "w", "fogline/v1/s/reply/cli", X, timeout)


C0, C1 = chain(0, "a", "b"), chain(1, "c", "d")


def test_no_chain_is_an_immediate_error() -> None:
    r = Router("fogline/v1/s/reply/fog")
    (cmd,) = r.submit(req(), [], 0.0, 100.0, "pending: quota")
    assert isinstance(cmd, ReplyClient) and not cmd.result.ok
    assert "no running replica" in cmd.result.error and "quota" in cmd.result.error
    assert len(r) == 0


def test_success_path_relays_the_result() -> None:
    r = Router("fogline/v1/s/reply/fog")
    (send,) = r.submit(req(), [C0, C1], 0.0, 100.0)
    assert isinstance(send, SendActivation) and send.device == "a"
    act = send.activation
    assert act.hop == 0 and act.reply_to == "fogline/v1/s/reply/fog" and act.deadline == 104.0
    (reply,) = r.result(InferenceResult(act.request_id, True, {"y": np.ones(1)}, device_id="b"), [C0, C1], 0.5, 100.5)
    assert isinstance(reply, ReplyClient) and reply.result.ok and reply.result.request_id == "r1"
    assert reply.reply_to == "fogline/v1/s/reply/cli"
    assert len(r) == 0 and list(r.latencies) == [0.5]


def test_error_fails_over_to_another_chain_once() -> None:
    r = Router("t")
    (s1,) = r.submit(req(), [C0, C1], 0.0, 0.0)
    (s2,) = r.result(InferenceResult(s1.activation.request_id, False, error="b: boom", device_id="b"),  # type: ignore[union-attr]
                     [C0, C1], 0.1, 0.1)
    assert isinstance(s2, SendActivation) and s2.device == "c"
    (reply,) = r.result(InferenceResult(s2.activation.request_id, False, error="d: bang"), [C0, C1], 0.2, 0.2)
    assert isinstance(reply, ReplyClient) and not reply.result.ok
    assert "boom" in reply.result.error and "bang" in reply.result.error
    assert r.counters["failed"] == 1


def test_timeout_fails_over_then_errors() -> None:
    r = Router("t")
    (s1,) = r.submit(req(timeout=4.0), [C0, C1], 0.0, 0.0)
    assert r.next_deadline() == 2.0  # half the budget, another chain exists
    assert r.tick(1.9, {"w": [C0, C1]}, 1.9) == []
    (s2,) = r.tick(2.0, {"w": [C0, C1]}, 2.0)
    assert isinstance(s2, SendActivation) and s2.device == "c"
    (reply,) = r.tick(4.0, {"w": [C0, C1]}, 4.0)
    assert isinstance(reply, ReplyClient) and "timed out" in reply.result.error
    # a late answer of the first attempt is dropped, not sent twice
    assert r.result(InferenceResult(s1.activation.request_id, True), [], 4.1, 4.1) == []  # type: ignore[union-attr]
    assert r.counters["late"] == 1


def test_device_loss_fails_over_in_flight_requests_at_once() -> None:
    r = Router("t")
    r.submit(req("r1"), [C0, C1], 0.0, 0.0)
    r.submit(req("r2"), [C1], 0.0, 0.0)
    cmds = r.device_lost("b", {"w": [C1]}, 0.3, 0.3)
    assert [(c.device, c.activation.request_id) for c in cmds if isinstance(c, SendActivation)] == [("c", "r1#2")]
    assert len(r) == 2


def test_duplicate_request_ids_are_ignored_and_overload_is_refused() -> None:
    r = Router("t", RouterConfig(max_pending=1))
    assert len(r.submit(req("r1"), [C0], 0.0, 0.0)) == 1
    assert r.submit(req("r1"), [C0], 0.0, 0.0) == []
    (reply,) = r.submit(req("r2"), [C0], 0.0, 0.0)
    assert isinstance(reply, ReplyClient) and "overloaded" in reply.result.error


def test_failures_carry_a_kind_for_programs() -> None:
    r = Router("fogline/v1/s/reply/fog", RouterConfig(max_pending=1))
    (unknown,) = r.submit(req("u"), [], 0.0, 100.0, "unknown workload")
    (pending,) = r.submit(req("p"), [], 0.0, 100.0, "fit: 0/3 devices fit")
    assert (unknown.result.failure, pending.result.failure) == ("unknown", "not ready")  # type: ignore[union-attr]
    r.submit(req("a"), [C0, C1], 0.0, 100.0)
    (busy,) = r.submit(req("b"), [C0, C1], 0.0, 100.0)
    assert busy.result.failure == "overloaded"  # type: ignore[union-attr]
    (retry,) = r.tick(2.1, {"w": [C0, C1]}, 102.1)  # the first chain timed out: the other one
    assert isinstance(retry, SendActivation)
    (late,) = r.tick(4.1, {"w": [C0, C1]}, 104.1)
    assert isinstance(late, ReplyClient) and late.result.failure == "timeout"
    r2 = Router("fogline/v1/s/reply/fog")
    (send,) = r2.submit(req("e"), [C0], 0.0, 100.0)
    (err,) = r2.result(InferenceResult(send.activation.request_id, False, {}, "b: run failed"), [C0], 0.1, 100.1,  # type: ignore[union-attr]
                       sender="b")
    assert isinstance(err, ReplyClient) and err.result.failure == "failed"
