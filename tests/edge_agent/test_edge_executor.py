"""Executor with real onnxruntime sessions and a fake bus (no broker)."""
from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from edge_agent.executor import Executor, LoadError, valid_reply_topic
from edge_agent.testing import FogSigner, tiny_chain
from runtime import codec, relay
from runtime.messages import Activation, Envelope, InferenceResult
from runtime.relay import Sealer
from runtime.security import Identity, TrustStore, Verifier, sha256_hex
from runtime.topics import Topics, parse

from waiting import wait_for

T = Topics("s1")
REPLY = T.reply("client-1")
CHAIN = tiny_chain()
FOG = FogSigner("fog-s1", "s1")
IDS = {d: Identity.generate(d) for d in ("d0", "d1", "other")}
KEYS = {d: i.public_key_bytes for d, i in IDS.items()}


class FakeBus:
    """What an executor publishes, checked as its receivers would: frames by the next hop, results by the fog."""

    def __init__(self) -> None:
        self.sent: queue.Queue[tuple[str, object]] = queue.Queue()
        self.results = Verifier(TrustStore(KEYS))

    def publish(self, topic: str, payload: bytes) -> None:
        p = parse(topic)
        if p.leaf == "ACT":
            msg: object = relay.open_relay(payload, FOG.public_key, p.name, time.time())
        else:
            env = codec.decode(payload)
            assert isinstance(env, Envelope)
            msg = self.results.verify_only(env)
        self.sent.put((topic, msg))

    def next(self, timeout: float = 5.0) -> tuple[str, object]:
        return self.sent.get(timeout=timeout)


def make(dev: str = "d0", **kw: object) -> tuple[Executor, FakeBus]:
    bus = FakeBus()
    return Executor(dev, T, bus.publish, Sealer(IDS[dev]), intra_op_threads=1, **kw), bus  # type: ignore[arg-type]


def load(ex: Executor, index: int) -> None:
    art = CHAIN.parts[index]
    ex.load(("wl", 1, 0, index), sha256_hex(art), art, 1000)


def test_chain_over_two_executors_matches_monolith() -> None:
    e0, bus0 = make("d0")
    e1, bus1 = make("d1")
    load(e0, 0)
    load(e1, 1)
    x = np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)
    e0.submit(CHAIN.activation("r1", x, [("d0", 0), ("d1", 1)], REPLY, fog=FOG, keys=KEYS))
    topic, fwd = bus0.next()
    assert topic == T.activation("d1", "d0") and isinstance(fwd, Activation) and fwd.hop == 1
    e1.submit(fwd)
    topic, res = bus1.next()
    assert topic == T.result("client-1", "d1") and isinstance(res, InferenceResult) and res.ok, res
    np.testing.assert_allclose(res.tensors["y"], CHAIN.reference(x), rtol=1e-5, atol=1e-5)
    st = e1.statuses()[0]
    assert st.served == 1 and st.health == "running" and st.p50_s > 0
    e0.stop()
    e1.stop()


def test_two_partitions_on_one_device_skip_the_broker() -> None:
    ex, bus = make("d0")
    load(ex, 0)
    load(ex, 1)
    x = np.ones((1, 8), np.float32)
    ex.submit(CHAIN.activation("r1", x, [("d0", 0), ("d0", 1)], REPLY))
    topic, res = bus.next()
    assert topic == T.result("client-1", "d0") and res.ok  # type: ignore[attr-defined]
    ex.stop()


@pytest.mark.parametrize("route, tensors, deadline, error", [
    ([("d0", 1)], {"x": np.ones((1, 8), np.float32)}, 0.0, "not deployed"),
    ([("other", 0)], {"x": np.ones((1, 8), np.float32)}, 0.0, "misrouted"),
    ([("d0", 0)], {"z": np.ones((1, 8), np.float32)}, 0.0, "missing input tensor 'x'"),
    ([("d0", 0)], {"x": np.ones((1, 3), np.float32)}, 0.0, "run failed"),
    ([("d0", 0)], {"x": np.ones((1, 8), np.float64)}, 0.0, "run failed"),
    ([("d0", 0)], {"x": np.ones((1, 8), np.float32)}, 1.0, "deadline exceeded"),
])
def test_failures_become_error_replies(route, tensors, deadline, error) -> None:  # type: ignore[no-untyped-def]
    ex, bus = make("d0")
    load(ex, 0)
    hops = CHAIN.activation("r", np.ones((1, 8), np.float32), route, REPLY)
    ex.submit(Activation("r", "wl", hops.route, 0, REPLY, tensors, deadline))
    topic, res = bus.next()
    assert topic == T.result("client-1", "d0") and isinstance(res, InferenceResult)
    assert not res.ok and error in res.error and res.device_id == "d0"
    ex.stop()


def test_full_queue_answers_overloaded_at_once() -> None:
    ex, bus = make("d0", queue_size=1)
    x = np.ones((1, 8), np.float32)
    # no partition loaded -> no worker threads yet: the queue fills
    for i in range(3):
        ex.submit(CHAIN.activation(f"r{i}", x, [("d0", 0)], REPLY))
    errors = [bus.next(1.0)[1] for _ in range(2)]
    assert all("overloaded" in r.error for r in errors)  # type: ignore[attr-defined]
    assert ex.rejected_overload == 2


@pytest.mark.integration
def test_reply_only_to_reply_topics_of_the_site() -> None:
    assert valid_reply_topic(T.reply("c"), T)
    assert not valid_reply_topic(Topics("other").reply("c"), T)
    assert not valid_reply_topic(T.device("d1", "CMD"), T)
    assert not valid_reply_topic("anything/else", T)
    ex, bus = make("d0")
    load(ex, 0)
    ex.submit(CHAIN.activation("r", np.ones((1, 8), np.float32), [("d0", 0)], T.fog_state()))
    wait_for(lambda: ex.undeliverable, 5, "the activation counted undeliverable", interval=0.01)
    assert ex.undeliverable == 1 and bus.sent.empty()
    ex.stop()


def test_bad_artifact_raises_load_error() -> None:
    ex, _ = make()
    with pytest.raises(LoadError):
        ex.load(("wl", 1, 0, 0), "0" * 64, b"definitely not onnx", 10)
    assert ex.statuses() == ()


@pytest.mark.integration
def test_simulated_compute_delay_follows_the_flops_model() -> None:
    from edge_agent.agent import partition_flops

    flops = partition_flops(CHAIN.parts[0])
    assert flops == 2 * 8 * 16 + 16 + 16  # MatMul + Add + Relu for one sample
    ex, bus = make("d0", device_flops=flops / 0.1)  # 0.1 s per sample on this "device"
    art = CHAIN.parts[0]
    ex.load(("wl", 1, 0, 0), sha256_hex(art), art, 1000, flops)
    ex.submit(CHAIN.activation("r", np.ones((2, 8), np.float32), [("d0", 0)], REPLY))
    _, res = bus.next()
    assert res.ok and res.latency_s == pytest.approx(0.2, rel=0.05)  # type: ignore[attr-defined]
    assert ex.statuses()[0].p50_s == pytest.approx(0.2, rel=0.05)
    ex.stop()


@pytest.mark.integration  # the simulated device sleeps its compute time on the executor's thread
def test_work_whose_deadline_passed_in_the_queue_is_dropped_before_compute() -> None:
    ex, bus = make("d0")
    load(ex, 0)
    part = ex.get(("wl", 1, 0, 0))
    assert part is not None
    part.flops, ex.device_flops = 1.0, 2.5  # a simulated device: each run takes 0.4 s
    x = np.ones((1, 8), np.float32)
    now = time.time()
    acts = [CHAIN.activation(rid, x, [("d0", 0)], REPLY) for rid in ("slow", "expires", "fine")]
    for act, deadline in zip(acts, (now + 30, now + 0.2, now + 30)):
        ex.submit(Activation(act.request_id, "wl", act.route, 0, REPLY, act.tensors, deadline))
    results = {r.request_id: r for r in (bus.next(10.0)[1] for _ in range(3))}  # type: ignore[attr-defined]
    assert results["slow"].ok and results["fine"].ok  # type: ignore[attr-defined]
    assert "deadline exceeded before compute" in results["expires"].error  # type: ignore[attr-defined]
    assert part.served == 2 and ex.expired == 1 and part.errors == 0  # queued behind "slow", never run
    ex.stop()
