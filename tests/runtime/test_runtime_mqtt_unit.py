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
