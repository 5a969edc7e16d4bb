"""Dynamic batching (issue 33): the pure policy, and the executor batching real onnxruntime runs."""
from __future__ import annotations

import queue

import numpy as np
import pytest

from edge_agent import batching
from edge_agent.batching import BatchCost, BatchPolicy
from edge_agent.executor import Executor
from edge_agent.testing import tiny_chain
from runtime import codec
from runtime.messages import Activation, Envelope, InferenceResult
from runtime.relay import Sealer
from runtime.security import Identity, TrustStore, Verifier, sha256_hex
from runtime.topics import Topics


class Bus:
    """Results as the fog reads them: verified against d0's key, in publish order."""

    def __init__(self, ident: Identity) -> None:
        self.sent: queue.Queue[object] = queue.Queue()
        self.results = Verifier(TrustStore({"d0": ident.public_key_bytes}))

    def publish(self, topic: str, payload: bytes) -> None:
        env = codec.decode(payload)
        assert isinstance(env, Envelope) and topic == T.result("client-1", "d0")
        self.sent.put(self.results.verify_only(env))

    def next(self) -> InferenceResult:
        r = self.sent.get(timeout=10)
        assert isinstance(r, InferenceResult)
        return r

T = Topics("s1")
REPLY = T.reply("client-1")
CHAIN = tiny_chain()


# ------------------------------------------------------------------ policy (pure)


def test_policy_is_off_by_default_and_checks_its_bounds() -> None:
    assert not BatchPolicy().enabled and BatchPolicy(max_batch=8).enabled
    with pytest.raises(ValueError, match="max_batch"):
        BatchPolicy(max_batch=0)
    with pytest.raises(ValueError, match="max_wait_s"):
        BatchPolicy(max_batch=2, max_wait_s=-0.1)


def test_wait_is_bounded_by_max_wait_size_and_the_earliest_deadline() -> None:
    p = BatchPolicy(max_batch=4, max_wait_s=0.010)
    assert batching.wait_more_s(p, 1, 0.0, 0.0, 100.0, 0.001, 1.0) == pytest.approx(0.010)
    assert batching.wait_more_s(p, 1, 0.004, 0.0, 100.0, 0.001, 1.0) == pytest.approx(0.006)
    assert batching.wait_more_s(p, 4, 0.0, 0.0, 100.0, 0.001, 1.0) == 0.0  # full
    # deadline 100.005, a batch of 2 at slope 1 takes 2 ms: 3 ms left to wait
    assert batching.wait_more_s(p, 1, 0.0, 100.005, 100.0, 0.001, 1.0) == pytest.approx(0.003)
    assert batching.wait_more_s(p, 1, 0.0, 100.001, 100.0, 0.001, 1.0) == 0.0  # no time to wait at all
    assert batching.wait_more_s(BatchPolicy(), 1, 0.0, 0.0, 100.0, 0.001, 1.0) == 0.0  # off


def test_batch_cost_and_drain_follow_the_slope() -> None:
    assert batching.batch_cost_s(0.1, 8, 1.0) == pytest.approx(0.8)
    assert batching.batch_cost_s(0.1, 8, 0.1) == pytest.approx(0.17)
    # 10 queued, batches of 4: 4 + 4 + 2
    assert batching.drain_s(0.1, 10, 4, 0.0) == pytest.approx(0.3)
    assert batching.drain_s(0.1, 10, 1, 0.5) == pytest.approx(1.0)  # no batching: one at a time
    assert batching.drain_s(0.1, 0, 4, 0.0) == 0.0


def test_signature_tells_stackable_feeds() -> None:
    a = {"x": np.ones((1, 8), np.float32)}
    assert batching.signature(a, ("x",)) == batching.signature({"x": np.zeros((3, 8), np.float32)}, ("x",))
    assert batching.signature(a, ("x",)) != batching.signature({"x": np.ones((1, 9), np.float32)}, ("x",))
    assert batching.signature(a, ("x",)) != batching.signature({"x": np.ones((1, 8), np.float64)}, ("x",))
    assert batching.signature({"x": np.float32(1.0)}, ("x",)) is None


def test_batch_cost_learns_the_slope() -> None:
    c = BatchCost(prior=1.0, alpha=1.0)
    assert c.slope == 1.0  # nothing measured: no gain assumed
    c.add(4, 0.2)
    assert c.slope == 1.0  # no single-frame time yet to compare with
    c.add(1, 0.1)
    c.add(4, 0.13)  # 4 frames in 1.3x one frame's time
    assert c.slope == pytest.approx(0.1)
    c.add(4, float("nan"))
    assert c.slope == pytest.approx(0.1)


# ------------------------------------------------------------------ executor (real onnxruntime)


def test_queued_frames_run_as_batches_and_answer_each_frame_in_order() -> None:
    ident = Identity.generate("d0")
    bus = Bus(ident)
    ex = Executor("d0", T, bus.publish, Sealer(ident), intra_op_threads=1,
                  batch=BatchPolicy(max_batch=4, max_wait_s=0.0))
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(6)]
    hops = CHAIN.activation("r", xs[0], [("d0", 0)], REPLY).route
    for i, x in enumerate(xs):  # no partition yet -> no worker: all six wait in the queue
        ex.submit(Activation(f"r{i}", "wl", hops, 0, REPLY, {"x": x}))
    ex.load(("wl", 1, 0, 0), sha256_hex(CHAIN.full), CHAIN.full, 1000)  # the whole model, one stage
    got = [bus.next() for _ in xs]
    assert [r.request_id for r in got] == [f"r{i}" for i in range(6)]
    for x, r in zip(xs, got):
        assert isinstance(r, InferenceResult) and r.ok, r
        assert r.tensors["y"].shape == (1, 4)
        np.testing.assert_allclose(r.tensors["y"], CHAIN.reference(x), rtol=1e-5, atol=1e-5)
    assert (ex.batches, ex.batched_frames) == (2, 6)  # [r0-r3], then [r4, r5]
    assert ex.statuses()[0].served == 6
    ex.stop()


def test_a_frame_that_breaks_its_batch_is_answered_alone() -> None:
    ident = Identity.generate("d0")
    bus = Bus(ident)
    ex = Executor("d0", T, bus.publish, Sealer(ident), intra_op_threads=1,
                  batch=BatchPolicy(max_batch=8, max_wait_s=0.0))
    hops = CHAIN.activation("r", np.ones((1, 8), np.float32), [("d0", 0)], REPLY).route
    feeds = [np.ones((1, 8), np.float32), np.ones((1, 3), np.float32), np.full((1, 8), 2, np.float32)]
    for i, x in enumerate(feeds):
        ex.submit(Activation(f"r{i}", "wl", hops, 0, REPLY, {"x": x}))
    ex.load(("wl", 1, 0, 0), sha256_hex(CHAIN.parts[0]), CHAIN.parts[0], 1000)
    got = {r.request_id: r for r in (bus.next() for _ in feeds)}
    assert got["r0"].ok and got["r2"].ok and not got["r1"].ok and "run failed" in got["r1"].error
    assert ex.batches == 1 and ex.batched_frames == 2  # r0 and r2 together; r1 had another shape
    ex.stop()
