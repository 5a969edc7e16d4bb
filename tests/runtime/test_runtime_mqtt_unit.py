"""runtime.mqtt pieces that need no broker; broker-backed tests live in tests/integration/."""
from __future__ import annotations

import pytest

from runtime.mqtt import MqttClient, parse_hostport


@pytest.mark.parametrize("text,want", [
    ("127.0.0.1:1884", ("127.0.0.1", 1884)),
    ("broker", ("broker", 1883)),
    ("localhost:0", ("localhost", 0)),
])
def test_parse_hostport(text: str, want: tuple[str, int]) -> None:
    assert parse_hostport(text) == want


def test_parse_hostport_rejects_bad_port() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_hostport("host:http")


def test_stop_before_start_is_a_no_op() -> None:
    c = MqttClient("never-started", "127.0.0.1", 1)
    c.stop()
    c.stop()
    assert not c.connected


@pytest.mark.integration
def test_wait_on_a_publish_made_while_offline_times_out_false() -> None:
    """A QoS 1 publish on a connection paho knows is down (rc MQTT_ERR_NO_CONN, kept queued) is 'not
    acknowledged' at the timeout: paho raises from is_published() for it, which once killed the
    coordinator's link thread of a site whose WAN link was cut (benchmarks/sites_scale_bench.py)."""
    import paho.mqtt.client as paho

    from runtime.mqtt import PublishHandle

    info = paho.MQTTMessageInfo(1)
    info.rc = paho.MQTT_ERR_NO_CONN
    assert PublishHandle(info).wait(0.05) is False


def test_a_direct_subscription_runs_on_the_network_thread_and_others_queue() -> None:
    """Issue 32: the data plane's frames skip the worker's queue; everything else still queues."""
    from types import SimpleNamespace

    c = MqttClient("unit", "127.0.0.1", 1)
    direct: list[str] = []
    queued: list[str] = []
    c.subscribe("s/dev/a/ACT/+", lambda m: direct.append(m.topic), direct=True)
    c.subscribe("s/dev/a/CMD", lambda m: queued.append(m.topic))

    def broken(m: object) -> None:
        raise RuntimeError("handler bug")

    c.subscribe("s/dev/a/BAD/+", broken, direct=True)
    for topic in ("s/dev/a/ACT/b", "s/dev/a/CMD", "s/dev/a/BAD/x"):
        c._on_message(c._client, None, SimpleNamespace(topic=topic, payload=b"x", retain=False))  # type: ignore[arg-type]
    assert direct == ["s/dev/a/ACT/b"] and queued == []  # the worker (not started) has not run
    assert c._inbox.qsize() == 1 and c.counters.handler_errors == 1  # a failing handler is counted, not raised
