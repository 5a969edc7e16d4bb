"""Issue 21 on the agent's execution path: compressed cuts, a peer that breaks the encoding,
and two stages working on different frames at once."""
from __future__ import annotations

import dataclasses
import queue
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from edge_agent.executor import Executor
from edge_agent.testing import FogSigner, tiny_chain
from runtime import activations, codec, relay
from runtime.messages import Activation, Envelope, InferenceResult
from runtime.relay import Sealer
from runtime.security import Identity, TrustStore, Verifier, sha256_hex
from runtime.topics import Topics, parse

T = Topics("s1")
REPLY = T.reply("client-1")
CHAIN = tiny_chain()
FOG = FogSigner("fog-s1", "s1")
IDS = {d: Identity.generate(d) for d in ("d0", "d1")}
KEYS = {d: i.public_key_bytes for d, i in IDS.items()}


class Bus:
    """Frames are opened as the next hop would (``open_relay``), results checked as the fog would."""

    def __init__(self, forward: Callable[[Activation], None] | None = None) -> None:
        self.sent: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.results = Verifier(TrustStore(KEYS))
        self.forward = forward
        self.raw: list[bytes] = []

    def publish(self, topic: str, payload: bytes) -> None:
        p = parse(topic)
        if p.leaf == "ACT":
            self.raw.append(payload)
            act = relay.open_relay(payload, FOG.public_key, p.name, time.time(), sender=p.sender)
            if self.forward is not None:
                self.forward(act)
                return
            self.sent.put((topic, act))
            return
        env = codec.decode(payload)
        assert isinstance(env, Envelope)
        self.sent.put((topic, self.results.verify_only(env)))


def _executor(dev: str, bus: Bus, **kw: Any) -> Executor:
    return Executor(dev, T, bus.publish, Sealer(IDS[dev]), intra_op_threads=1, **kw)


def _load(ex: Executor, index: int, flops: float | None = None) -> None:
    art = CHAIN.parts[index]
    ex.load(("wl", 1, 0, index), sha256_hex(art), art, 1000, flops)


def _act(rid: str, x: np.ndarray, wire: str) -> Activation:
    act = CHAIN.activation(rid, x, [("d0", 0), ("d1", 1)], REPLY)
    route = (dataclasses.replace(act.route[0], wire=wire), act.route[1])
    return FOG.ticketed(dataclasses.replace(act, route=route), KEYS)


def test_int8_cut_travels_compressed_and_decodes_at_the_next_hop() -> None:
    bus0, bus1 = Bus(), Bus()
    e0, e1 = _executor("d0", bus0), _executor("d1", bus1)
    _load(e0, 0)
    _load(e1, 1)
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    e0.submit(_act("r1", x, "int8c"))
    _, fwd = bus0.sent.get(timeout=5)
    assert fwd.tensors["\0q\0h"].dtype == np.int8 and "h" not in fwd.tensors
    e1.submit(fwd)
    _, res = bus1.sent.get(timeout=5)
    assert isinstance(res, InferenceResult) and res.ok, res
    ref = CHAIN.reference(x)
    assert np.linalg.norm(res.tensors["y"] - ref) <= 0.03 * np.linalg.norm(ref)
    e0.stop()
    e1.stop()


def _forged(tensors: dict[str, np.ndarray], wire: str) -> bytes:
    """What a previous hop that does not follow the encoding sends (signed with its real key)."""
    act = dataclasses.replace(_act("r2", np.ones((1, 8), np.float32), wire), hop=1, tensors=tensors)
    return relay.seal(IDS["d0"], act)


def test_a_peer_breaking_the_cuts_encoding_gets_an_error_not_a_crash() -> None:
    bus1 = Bus()
    e1 = _executor("d1", bus1)
    _load(e1, 1)
    good = activations.encode({"h": np.ones((1, 16), np.float32)}, "int8c")
    cases = [
        (activations.encode({"h": np.ones((1, 16), np.float32)}, "float16"), "int8c",
         "float16 on a int8c cut"),
        ({**good, "\0s\0h": np.zeros(16, np.float32)}, "int8c", "scale not finite"),
        ({"\0q\0h": good["\0q\0h"]}, "int8c", "without its scale"),
        (good, "float32", "int8 on a float32 cut"),
        ({"\0x\0h": np.ones(3, np.float32)}, "int8c", "unknown encoded tensor"),
    ]
    for tensors, wire, why in cases:
        act = relay.open_relay(_forged(tensors, wire), FOG.public_key, "d1", time.time())
        e1.submit(act)
        _, res = bus1.sent.get(timeout=5)
        assert isinstance(res, InferenceResult) and not res.ok
        assert "bad activation" in res.error and why in res.error, res.error
    # and the partition still serves a well-formed frame afterwards
    act = relay.open_relay(_forged(good, "int8c"), FOG.public_key, "d1", time.time())
    e1.submit(act)
    _, res = bus1.sent.get(timeout=5)
    assert res.ok
    assert e1.statuses()[0].errors == len(cases)
    e1.stop()


@pytest.mark.integration
@pytest.mark.serial  # asserts pipelined wall time (< 0.9 s against 1.2 s serial): a timing
def test_two_stages_work_on_different_frames_at_once() -> None:
    """Simulated devices of 50 ms a stage: 12 frames take ~13 stage times pipelined, not 24."""
    stage_s = 0.05
    bus1 = Bus()
    e1 = _executor("d1", bus1, device_flops=1.0)
    bus0 = Bus(forward=e1.submit)
    e0 = _executor("d0", bus0, device_flops=1.0)
    _load(e0, 0, flops=stage_s)
    _load(e1, 1, flops=stage_s)
    n = 12
    t0 = time.monotonic()
    for i in range(n):
        e0.submit(_act(f"r{i}", np.ones((1, 8), np.float32), ""))
    got = [bus1.sent.get(timeout=10)[1] for _ in range(n)]
    elapsed = time.monotonic() - t0
    assert all(r.ok for r in got)
    assert [r.request_id for r in got] == [f"r{i}" for i in range(n)]  # one worker a stage: in order
    assert elapsed < 0.75 * 2 * n * stage_s, elapsed  # serial would be 1.2 s; pipelined ~0.65 s
    e0.stop()
    e1.stop()
