"""Zero-install MQTT broker for machines without mosquitto: rumqttd, shipped in the ``iotcore`` wheel.

Chosen by measurement (``benchmarks/broker_fallback_bench.py``; figures in
the module docstring there and in the README): rumqttd (iotcore 0.4.0) speaks
MQTT 5, moved tens of thousands of QoS1 msg/s here and fires the Will both on
a dropped socket and on a hung client (keepalive expiry). amqtt 0.12.1 speaks
only MQTT 3.1.1 (our adapter is MQTT 5), tops out near 2k msg/s and never
fires the Will of a hung client, and it pins ``typer>=0.24``, which conflicts
with flwr 1.41.

Limits of the fallback, which is why it is used only with a loud warning:

* no persistence: sessions and queued QoS1 messages are lost when it restarts
  (mosquitto keeps them in ``mosquitto.db``), so ``data_dir`` holds only the
  generated config and the log;
* no TLS/ACL configuration from ``runtime.pki`` (plain TCP on the loopback);
* young project (iotcore 0.4.0), far less field time than mosquitto.

The broker runs in a child process (``python -m runtime.fallback_broker``)
because rumqttd has no shutdown API; the child exits when its stdin closes,
so it never outlives the parent.
"""
from __future__ import annotations

import importlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from .brokerproc import BrokerProcess, free_port, wait_port
from .errors import LocalViolation

__all__ = ["FallbackBroker", "start_fallback", "rumqttd_config", "available"]

log = logging.getLogger(__name__)

WARNING = ("USING THE FALLBACK MQTT BROKER (rumqttd from the 'iotcore' package) because mosquitto is "
           "not installed: no persistence across restarts, no TLS/ACL, less proven. Install the "
           "Debian package 'mosquitto' for anything but a trial.")


def available() -> bool:
    try:
        importlib.import_module("iotcore.iotcore")  # the compiled broker, not just the package
    except ImportError:
        return False
    return True


def rumqttd_config(host: str, port: int, *, max_payload: int = 16 * 1024 * 1024,
                   connection_timeout_ms: int = 60_000) -> str:
    """A rumqttd TOML config with one MQTT 5 listener (the iotcore keyword API gives MQTT 3.1.1)."""
    return "\n".join([
        "id = 0",
        "",
        "[router]",
        "id = 0",
        "max_connections = 10010",
        "max_outgoing_packet_count = 200",
        "max_segment_size = 104857600",
        "max_segment_count = 10",
        "",
        "[v5.1]",
        'name = "fogline-v5"',
        f'listen = "{host}:{port}"',
        "next_connection_delay_ms = 1",
        "    [v5.1.connections]",
        f"    connection_timeout_ms = {connection_timeout_ms}",
        f"    max_payload_size = {max_payload}",
        "    max_inflight_count = 100",
        "",
    ])


class FallbackBroker(BrokerProcess):
    """A supervised rumqttd child process; same surface as ``MosquittoBroker``."""

    def __init__(self, data_dir: Path, port: int = 0, host: str = "127.0.0.1") -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.conf_path = self.data_dir / "rumqttd.toml"
        self.log_path = self.data_dir / "rumqttd.log"

    def start(self, timeout: float = 10.0) -> FallbackBroker:
        if not available():
            raise LocalViolation("no MQTT broker: install the Debian package 'mosquitto' "
                                 "(or the 'iotcore' package for the fallback broker)")
        log.warning(WARNING)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.conf_path.write_text(rumqttd_config(self.host, self.port))
        with open(self.log_path, "ab") as log_file:
            # stdin is a pipe we never write: the child exits when it closes (we died)
            self.proc = subprocess.Popen([sys.executable, "-m", "runtime.fallback_broker", str(self.conf_path)],
                                         stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        if not wait_port(self.host, self.port, timeout):
            self.stop()
            raise LocalViolation(f"fallback broker did not open port {self.port}; see {self.log_path}")
        return self

    def _exited(self) -> None:  # the child exits when its stdin closes: close it
        if self.proc is not None and self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()


def start_fallback(data_dir: Path, port: int, host: str = "127.0.0.1") -> FallbackBroker:
    """Start the embedded broker (logs a loud WARNING: see the module docstring)."""
    return FallbackBroker(Path(data_dir), port, host).start()


def _serve(config_path: str) -> None:
    """Child process: run rumqttd until the parent closes our stdin or signals us."""
    import threading

    from iotcore.iotcore import IotCoreBroker

    logging.getLogger("rumqttd").setLevel(logging.CRITICAL)  # it logs every packet at ERROR

    def exit_with_parent() -> None:
        try:
            sys.stdin.buffer.read()
        finally:
            os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    IotCoreBroker(config_path=config_path).run_forever()


if __name__ == "__main__":
    _serve(sys.argv[1])
