"""MQTT -> file bridge for fog brokers' fleet summaries (read by the ServerApp for selection).

The ServerApp runs in a process Flower spawns, so the coordinator shell keeps
the latest ``FleetSummary`` per fog broker as a file in the checkpoint
directory; the ServerApp reads them at the start of every round.
"""
from __future__ import annotations

import logging
from pathlib import Path

from runtime import codec
from runtime.errors import DecodeError
from runtime.messages import Envelope, FleetSummary
from runtime.topics import Topics

from .store import atomic_write

__all__ = ["SummaryBridge", "accept"]

log = logging.getLogger(__name__)


def accept(payload: bytes) -> FleetSummary | None:
    """A FleetSummary, bare or as the payload of an envelope; None for anything else."""
    try:
        msg = codec.decode(payload)
        if isinstance(msg, Envelope):
            msg = codec.decode(msg.payload)
    except DecodeError as exc:
        log.debug("dropping undecodable summary: %s", exc)
        return None
    return msg if isinstance(msg, FleetSummary) else None


class SummaryBridge:
    def __init__(self, mqtt: str, site: str, out_dir: Path) -> None:
        from runtime.mqtt import MqttClient, parse_hostport

        host, port = parse_hostport(mqtt)
        self.out_dir = out_dir
        self.topic = Topics(site).summary()
        self.client = MqttClient(f"coordinator-summaries-{site}", host, port)
        self.dropped = 0

    def _on(self, inbound: object) -> None:  # runs on the MQTT adapter's worker thread
        summary = accept(getattr(inbound, "payload"))
        if summary is None:
            self.dropped += 1
            return
        atomic_write(self.out_dir / f"{summary.fog_id}.summary", codec.encode(summary), sync_dir=False)

    def start(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.client.subscribe(self.topic, self._on)
        self.client.start()

    def stop(self) -> None:
        self.client.stop()
