"""Deploy a 2-partition model to two agent processes and serve; reject bad commands and keep serving."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_agent.testing import tiny_chain
from runtime import codec
from runtime.messages import CommandAck, Deploy, DeviceState, InferenceResult
from runtime.security import Identity, Signer

from _agent_harness import FogSide, kill, spawn_agent, wait_status

pytestmark = pytest.mark.integration

CHAIN = tiny_chain(seed=5)


@pytest.fixture
def fog(mosquitto) -> Iterator[FogSide]:  # type: ignore[no-untyped-def]
    side = FogSide(mosquitto)
    side.online()
    yield side
    side.close()


def _ack(fog: FogSide, dev: str, command_id: str) -> CommandAck:
    return fog.wait_leaf(dev, "ACK", timeout=15, cond=lambda m: m.command_id == command_id)


def _infer(fog: FogSide, route: list[tuple[str, int]], rid: str, x: np.ndarray) -> InferenceResult:
    act = CHAIN.activation(rid, x, route, fog.topics.reply("tester"))
    fog.send_activation(act)
    ev = fog.wait(lambda d, leaf, m: isinstance(m, InferenceResult) and m.request_id == rid, timeout=15)
    return ev[3]  # type: ignore[return-value]


def test_two_agents_serve_the_monolithic_output(mosquitto, fog: FogSide, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    procs = [spawn_agent(mosquitto, d, tmp_path / d, "--state-interval", "5", fog=fog.fog)
             for d in ("edge-0", "edge-1")]
    try:
        for d in ("edge-0", "edge-1"):
            fog.wait_leaf(d, "BIRTH", timeout=15)
        for i, d in enumerate(("edge-0", "edge-1")):
            fog.command(d, fog.fog.deploy(f"dep-{i}", CHAIN.parts[i], index=i, memory_bytes=10_000_000))
        for i, d in enumerate(("edge-0", "edge-1")):
            ack = _ack(fog, d, f"dep-{i}")
            assert ack.ok, ack.reason
            st: DeviceState = fog.wait_leaf(d, "STATE", timeout=5, cond=lambda m: len(m.partitions) == 1)
            assert st.partitions[0].health == "running" and st.partitions[0].index == i

        import onnxruntime as ort  # the monolithic model, run here

        mono = ort.InferenceSession(CHAIN.full, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(11)
        for k in range(3):
            x = rng.standard_normal((4, 8)).astype(np.float32)
            res = _infer(fog, [("edge-0", 0), ("edge-1", 1)], f"req-{k}", x)
            assert res.ok, res.error
            assert res.device_id == "edge-1"
            np.testing.assert_allclose(res.tensors["y"], mono.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)

        # a hop whose partition is gone answers an error instead of dropping the request
        fog.command("edge-1", fog.fog.undeploy("undep-1", index=1))
        assert _ack(fog, "edge-1", "undep-1").ok
        res = _infer(fog, [("edge-0", 0), ("edge-1", 1)], "req-gone", np.ones((1, 8), np.float32))
        assert not res.ok and "not deployed" in res.error and res.device_id == "edge-1"
        # state reports the served count and latency of the partition still running
        st = fog.wait_leaf("edge-0", "STATE", timeout=8, cond=lambda m: m.partitions and m.partitions[0].served >= 4)
        assert st.partitions[0].p50_s > 0 and st.partitions[0].p99_s >= st.partitions[0].p50_s
        assert st.rtt_s is not None and st.rtt_s < 0.5  # passive RTT estimate from PUBACKs
    finally:
        for p in procs:
            kill(p)


def test_bad_commands_rejected_counted_and_serving_continues(mosquitto, fog: FogSide, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    dev, data = "edge-x", tmp_path / "edge-x"
    proc = spawn_agent(mosquitto, dev, data, "--max-command-bytes", "200000", "--state-interval", "5", fog=fog.fog)
    try:
        fog.wait_leaf(dev, "BIRTH", timeout=15)
        good = fog.fog.deploy("good-1", CHAIN.parts[0], memory_bytes=1_000_000)
        sealed_good = fog.fog.seal(good)
        fog.raw(dev, sealed_good)
        assert _ack(fog, dev, "good-1").ok

        fog.raw(dev, b"\x00garbage that is no frame")                                   # malformed
        fog.raw(dev, codec.encode(fog.fog.deploy("bare", CHAIN.parts[0])))                # unsigned
        evil = Signer(Identity.generate(fog.fog.fog_id), epoch=99)                          # wrong key
        fog.raw(dev, evil.seal_bytes(fog.fog.deploy("forged", CHAIN.parts[0]), time.time()))
        fog.raw(dev, sealed_good)                                                           # replayed
        fog.raw(dev, fog.fog.seal(fog.fog.deploy("huge", CHAIN.parts[0] + b"\x00" * 250_000)))  # oversized
        fog.raw(dev, fog.fog.seal(fog.fog.undeploy("old"), now=time.time() - 120))           # stale clock
        # verified envelopes whose deploy is wrong: NACK with the reason
        tampered = fog.fog.deploy("tampered", CHAIN.parts[1], index=1)
        fog.command(dev, Deploy(**{**{f: getattr(tampered, f) for f in ("command_id", "workload", "version",
                                   "replica", "index", "sha256", "signature", "signer", "memory_bytes",
                                   "metadata")}, "artifact": CHAIN.parts[0]}))
        fog.command(dev, fog.fog.deploy("greedy", CHAIN.parts[1], index=1, memory_bytes=10**15))
        bad_sig = fog.fog.deploy("badsig", CHAIN.parts[1], index=1, signer=Identity.generate("x"))
        fog.command(dev, bad_sig)
        nacks = {c: _ack(fog, dev, c) for c in ("tampered", "greedy", "badsig")}
        assert not any(a.ok for a in nacks.values())
        assert nacks["tampered"].reason.startswith("hash mismatch")
        assert nacks["greedy"].reason.startswith("insufficient memory")
        assert nacks["badsig"].reason.startswith("bad artifact signature")

        st = wait_status(data, lambda s: sum(s.get("verifier", {}).get("rejected", {}).values()) >= 6
                         and s["counters"].get("nack: insufficient memory", 0) == 1)
        rej = st["verifier"]["rejected"]
        assert rej.get("malformed", 0) >= 2          # garbage + unsigned (not an envelope)
        assert rej.get("bad signature", 0) >= 1
        assert rej.get("replayed", 0) >= 1
        assert rej.get("oversized", 0) >= 1
        assert rej.get("timestamp outside window", 0) >= 1
        assert st["counters"]["nack: insufficient memory"] == 1
        assert proc.poll() is None

        # still serving, and a redeploy from the artifact cache needs no bytes on the wire
        res = _infer(fog, [(dev, 0)], "after", np.ones((1, 8), np.float32))
        assert res.ok and res.tensors["h"].shape == (1, 16)
        fog.command(dev, fog.fog.undeploy("u1"))
        assert _ack(fog, dev, "u1").ok
        fog.command(dev, fog.fog.deploy("cached", CHAIN.parts[0], memory_bytes=1_000_000, send_artifact=False))
        assert _ack(fog, dev, "cached").ok
        wait_status(data, lambda s: s["cache"]["hits"] >= 1)  # the ACK may overtake the status file
        # a malformed activation cannot be answered (no reply_to), but it is counted and survived
        fog.client.publish(fog.topics.activation(dev, fog.fog.fog_id), b"FGL\x01junk").wait(5)
        res = _infer(fog, [(dev, 0)], "after2", np.ones((1, 8), np.float32))
        assert res.ok
        assert wait_status(data, lambda s: s["counters"].get("rejected activation: malformed", 0) == 1)
    finally:
        kill(proc)
