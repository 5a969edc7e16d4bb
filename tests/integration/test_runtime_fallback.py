"""The zero-install fallback broker (rumqttd from the iotcore wheel) behind runtime.broker.start_broker."""
from __future__ import annotations

import logging
import queue
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import broker as broker_mod
from runtime.broker import free_port
from runtime.mqtt import Inbound, MqttClient, Will

pytest.importorskip("iotcore")
pytestmark = pytest.mark.integration

from runtime.fallback_broker import FallbackBroker, rumqttd_config  # noqa: E402


@pytest.fixture
def fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             caplog: pytest.LogCaptureFixture) -> Iterator[FallbackBroker]:
    monkeypatch.setattr(broker_mod, "find_mosquitto", lambda: None)
    with caplog.at_level(logging.WARNING, logger="runtime.fallback_broker"):
        b = broker_mod.start_broker(tmp_path / "fb", free_port())
    assert isinstance(b, FallbackBroker)
    try:
        yield b
    finally:
        b.kill()


def test_start_broker_falls_back_loudly(fallback: FallbackBroker, caplog: pytest.LogCaptureFixture) -> None:
    warnings = [r for r in caplog.get_records("setup") if r.levelno == logging.WARNING]
    assert any("FALLBACK MQTT BROKER" in r.getMessage() for r in warnings)
    assert fallback.alive() and fallback.address == f"127.0.0.1:{fallback.port}"
    assert (fallback.data_dir / "rumqttd.toml").read_text() == rumqttd_config("127.0.0.1", fallback.port)


def test_start_broker_without_fallback_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(broker_mod, "find_mosquitto", lambda: None)
    from runtime.errors import LocalViolation

    with pytest.raises(LocalViolation, match="mosquitto"):
        broker_mod.start_broker(tmp_path, allow_fallback=False)


def test_mqtt5_delivery_large_payload_and_will(fallback: FallbackBroker) -> None:
    q: queue.Queue[Inbound] = queue.Queue()
    made = []
    try:
        sub = MqttClient("fb-sub", fallback.host, fallback.port)
        sub.subscribe("fogline/v1/s1/#", q.put)
        victim = MqttClient("fb-victim", fallback.host, fallback.port,
                            will=Will("fogline/v1/s1/dev/v/DEATH", b"gone"))
        pub = MqttClient("fb-pub", fallback.host, fallback.port)
        made = [sub, victim, pub]
        for c in made:
            c.start()
            assert c.wait_connected(10)
        big = b"z" * (2 * 1024 * 1024)  # beyond rumqttd's 20 KiB default: our config raises it
        for _ in range(50):  # until the subscription is live
            pub.publish("fogline/v1/s1/fog/STATE", b"probe")
            try:
                if q.get(timeout=0.2).payload == b"probe":
                    break
            except queue.Empty:
                continue
        pub.publish("fogline/v1/s1/dev/v/ACT", big)
        got = q.get(timeout=5)
        while got.payload == b"probe":
            got = q.get(timeout=5)
        assert got.payload == big
        victim.stop(disconnect=False)
        got = q.get(timeout=5)
        while got.payload == b"probe":
            got = q.get(timeout=5)
        assert (got.topic, got.payload) == ("fogline/v1/s1/dev/v/DEATH", b"gone")
    finally:
        for c in made:
            c.stop()


def test_kill_and_stop_are_idempotent(tmp_path: Path) -> None:
    b = FallbackBroker(tmp_path, free_port()).start()
    b.kill()
    assert not b.alive()
    b.kill()
    b.stop()
