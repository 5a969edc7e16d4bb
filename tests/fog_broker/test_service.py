"""The fog service shell against mosquitto with a hand-written fake device (runtime pieces only).

Covers the trust edges the end-to-end tests do not reach: TOFU enrollment, a
pinned key, forged / replayed / mismatched envelopes, rebirth of unknown
devices, unsigned control changes, the fleet summary and the Will.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from runtime import codec
from runtime.broker import MosquittoBroker, find_mosquitto
from runtime.messages import (
    ControlReply, ControlRequest, Deploy, DeviceBirth, DeviceDeath, DeviceState, Envelope, FleetSummary,
    FogState, Rebirth,
)
from runtime.mqtt import Inbound, MqttClient
from runtime.security import Identity, Signer
from runtime.topics import Topics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
if find_mosquitto() is None:  # pragma: no cover
    pytest.skip("mosquitto not installed", allow_module_level=True)

SITE = "svc"
T = Topics(SITE)


@pytest.fixture(scope="module")
def broker(mosquitto_module: MosquittoBroker) -> MosquittoBroker:
    return mosquitto_module


@pytest.fixture
def fog(broker: MosquittoBroker, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    from fog_broker.service import FogService, ServiceConfig
    procs = getattr(request, "param", False)
    svc = FogService(ServiceConfig(data_dir=tmp_path / "fog", site=SITE, mqtt_port=broker.port,
                                   state_interval_s=1.0, summary_interval_s=0.2,
                                   verify_processes=procs)).start()
    yield svc
    svc.stop()


class FakeDevice:
    """The device side of the protocol, minimal: birth, states, acks; records what it receives."""

    def __init__(self, port: int, dev_id: str, *, identity: Identity | None = None, epoch: int = 1) -> None:
        self.id = dev_id
        self.identity = identity or Identity.generate(dev_id)
        self.signer = Signer(self.identity, epoch)
        self.epoch = epoch
        self.got: list[Any] = []
        self.event = threading.Event()
        self.client = MqttClient(f"fake-{dev_id}-{time.time_ns()}", "127.0.0.1", port)
        self.client.subscribe(T.device(dev_id, "CMD"), self._on)
        self.client.subscribe(T.rebirth(), self._on)
        self.client.start()
        assert self.client.wait_connected(5)
        time.sleep(0.1)

    def _on(self, m: Inbound) -> None:
        env = codec.decode(m.payload)
        assert isinstance(env, Envelope)
        self.got.append(codec.decode(env.payload))
        self.event.set()

    def send(self, leaf: str, msg: Any, *, raw: bytes | None = None) -> bytes:
        data = raw if raw is not None else self.signer.seal_bytes(msg, time.time())
        self.client.publish(T.device(self.id, leaf), data).wait(2)
        return data

    def birth(self, **kw: Any) -> bytes:
        b = DeviceBirth(self.id, self.epoch, 0, SITE, kw.pop("public_key", self.identity.public_key_bytes), 1e9,
                        10_000_000, 1e8, 1e8, 0.001, 5.0, 2.0, state_interval_s=1.0, **kw)
        return self.send("BIRTH", b)

    def state(self, **kw: Any) -> bytes:
        return self.send("STATE", DeviceState(self.id, self.epoch, 0, 9_000_000, **kw))

    def close(self) -> None:
        self.client.stop()


def wait_for(pred: Any, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError("condition not met")


def record(svc: Any, dev: str) -> Any:
    return svc.call(lambda: svc.registry.get(dev))


@pytest.mark.parametrize("fog", [False, True], indirect=True, ids=["threads", "processes"])
def test_tofu_enrollment_then_pinned_key(fog: Any, broker: MosquittoBroker) -> None:
    d = FakeDevice(broker.port, "dev-a")
    d.birth()
    wait_for(lambda: (r := record(fog, "dev-a")) is not None and r.alive)
    assert "dev-a" in fog.devices_trust
    d.state(battery_level=0.5)
    wait_for(lambda: record(fog, "dev-a").state is not None)
    # an impostor with another key for the same id is refused
    evil = FakeDevice(broker.port, "dev-a", epoch=5)
    evil.birth()
    wait_for(lambda: fog.rejections().get("bad signature", 0) >= 1)
    assert record(fog, "dev-a").epoch == 1
    # a birth signed by the pinned key but announcing another key is refused too
    d.birth(public_key=Identity.generate("x").public_key_bytes)
    wait_for(lambda: fog.rejections().get("key mismatch", 0) >= 1)
    d.close()
    evil.close()


def test_replay_and_topic_mismatch_are_rejected(fog: Any, broker: MosquittoBroker) -> None:
    d = FakeDevice(broker.port, "dev-b")
    d.birth()
    wait_for(lambda: (r := record(fog, "dev-b")) is not None and r.alive)
    data = d.state()
    d.send("STATE", None, raw=data)  # the same envelope again
    wait_for(lambda: fog.rejections().get("replayed", 0) >= 1)
    # a valid envelope of dev-b published on dev-c's topic
    other = d.signer.seal_bytes(DeviceState("dev-b", 1, 0, 1), time.time())
    d.client.publish(T.device("dev-c", "STATE"), other).wait(2)
    wait_for(lambda: fog.rejections().get("unknown sender", 0) + fog.rejections().get("topic mismatch", 0) >= 1)
    d.client.publish(T.device("dev-b", "STATE"), b"garbage").wait(2)
    wait_for(lambda: fog.rejections().get("malformed", 0) >= 1)
    assert record(fog, "dev-b").alive
    d.close()


def test_unknown_device_state_gets_a_rebirth_and_death_marks_dead(fog: Any, broker: MosquittoBroker) -> None:
    d = FakeDevice(broker.port, "dev-c")
    d.birth()
    wait_for(lambda: (r := record(fog, "dev-c")) is not None and r.alive)
    fog.call(lambda: fog.registry.forget("dev-c"))  # as if the fog had never heard its birth
    d.event.clear()
    d.got.clear()
    d.state()
    wait_for(lambda: any(isinstance(m, Rebirth) and m.device_id == "dev-c" for m in d.got))
    d.birth()
    wait_for(lambda: (r := record(fog, "dev-c")) is not None and r.alive)
    # a late Will of an older connection is ignored; the current one kills
    d.client.publish(T.device("dev-c", "DEATH"), codec.encode(DeviceDeath("dev-c", 0))).wait(2)
    time.sleep(0.2)
    assert record(fog, "dev-c").alive
    d.client.publish(T.device("dev-c", "DEATH"), codec.encode(DeviceDeath("dev-c", 1))).wait(2)
    wait_for(lambda: not record(fog, "dev-c").alive)
    d.close()


def test_fog_state_summary_and_unsigned_control(fog: Any, broker: MosquittoBroker) -> None:
    got: dict[str, Any] = {}
    ev = threading.Event()

    def on(m: Inbound) -> None:
        msg = codec.decode(m.payload)
        got[type(msg).__name__] = msg
        ev.set()
    c = MqttClient(f"obs-{time.time_ns()}", "127.0.0.1", broker.port)
    c.subscribe(T.fog_state(), on)
    c.subscribe(T.summary(), on)
    c.subscribe(T.reply("obs"), on)
    c.start()
    assert c.wait_connected(5)
    d = FakeDevice(broker.port, "dev-d")
    d.birth(battery_capacity_wh=10.0)
    d.state(battery_level=0.9)
    wait_for(lambda: isinstance(got.get("FleetSummary"), FleetSummary)
             and any(x.device_id == "dev-d" for x in got["FleetSummary"].devices))
    fs = got["FogState"]
    assert isinstance(fs, FogState) and fs.online and fs.public_key == fog.identity.public_key_bytes
    summ = next(x for x in got["FleetSummary"].devices if x.device_id == "dev-d")
    assert summ.fit_for_training and summ.battery_level == 0.9
    # a bare (unsigned) deploy is refused with a reason; a bare status is answered
    c.publish(T.control(), codec.encode(ControlRequest("r1", "deploy", T.reply("obs"), b"{}"))).wait(2)
    wait_for(lambda: isinstance(got.get("ControlReply"), ControlReply))
    rep = got.pop("ControlReply")
    assert not rep.ok and "signed" in rep.error
    c.publish(T.control(), codec.encode(ControlRequest("r2", "status", T.reply("obs")))).wait(2)
    wait_for(lambda: isinstance(got.get("ControlReply"), ControlReply))
    assert got["ControlReply"].ok
    c.stop()
    d.close()


def test_deploy_reaches_a_fake_device_and_its_ack_runs_it(fog: Any, broker: MosquittoBroker,
                                                          tmp_path: Path) -> None:
    from fog_broker.client import FogClient
    from runtime.messages import CommandAck
    from runtime.security import ArtifactSignature, verify_artifact
    os.environ["FOGLINE_OPERATOR_KEY"] = str(tmp_path / "op.key")
    d = FakeDevice(broker.port, "dev-e")
    d.birth()
    d.state()
    wait_for(lambda: (r := record(fog, "dev-e")) is not None and r.alive)
    with FogClient("127.0.0.1", broker.port, site=SITE) as c:
        c.deploy({"name": "m", "model": "zoo:mlp", "source": "dev-e", "sink": "dev-e"})
        dep = wait_for(lambda: next((m for m in d.got if isinstance(m, Deploy)), None), 10)
        verify_artifact(fog.identity.public_key_bytes, dep.artifact,
                        ArtifactSignature(dep.sha256, dep.signer, dep.signature, dict(dep.metadata)))
        assert dep.metadata == {"workload": "m", "version": "1", "replica": "0", "index": "0"}
        d.send("ACK", CommandAck(dep.command_id, "dev-e", True))
        w = c.wait_running("m", 5)
        assert w["placement"][0]["partitions"][0]["device"] == "dev-e"
    d.close()
