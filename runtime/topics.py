"""The MQTT topic namespace, modelled on Sparkplug B (see docs/protocol.md).

One module builds and parses every topic so no package writes its own
string formatting. Layout: ``fogline/v1/{site}/...``; every site name, device
id and client id in a topic is an identifier of ``runtime.ids`` (checked here, in
both directions), so a topic level never holds ``/``, ``+``, ``#`` or a newline.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import RemoteViolation
from .ids import check_id, is_id

__all__ = ["ROOT", "Topics", "ParsedTopic", "parse"]

ROOT = "fogline/v1"

# Device-published leaves
BIRTH, STATE, DEATH, ACK = "BIRTH", "STATE", "DEATH", "ACK"
# Device-consumed leaves
CMD, ACT = "CMD", "ACT"
DEVICE_LEAVES = frozenset({BIRTH, STATE, DEATH, ACK, CMD, ACT})


@dataclass(frozen=True, slots=True)
class ParsedTopic:
    site: str
    scope: str  # "dev" | "fog" | "reply" | "cloud"
    name: str  # device id, client id, or "" for fog-wide topics
    leaf: str


@dataclass(frozen=True, slots=True)
class Topics:
    """Topic names of one site."""

    site: str

    def __post_init__(self) -> None:
        check_id(self.site, "site name")

    @property
    def base(self) -> str:
        return f"{ROOT}/{self.site}"

    # fog broker
    def fog_state(self) -> str:
        """Retained FogState; devices wait for online before their birth."""
        return f"{self.base}/fog/STATE"

    def rebirth(self) -> str:
        return f"{self.base}/fog/REBIRTH"

    def time(self) -> str:
        """The fog's sealed wall-clock hints (``TimeHint``), never retained."""
        return f"{self.base}/fog/TIME"

    def infer(self) -> str:
        return f"{self.base}/fog/INFER"

    def control(self) -> str:
        return f"{self.base}/fog/CTL"

    def summary(self) -> str:
        """Retained FleetSummary for the coordinator."""
        return f"{self.base}/fog/SUMMARY"

    def release(self) -> str:
        return f"{self.base}/cloud/RELEASE"

    # devices
    def device(self, device_id: str, leaf: str) -> str:
        return f"{self.base}/dev/{_level(device_id, 'device id', '+')}/{leaf}"

    def device_prefix(self, device_id: str) -> str:
        return f"{self.base}/dev/{_level(device_id, 'device id', '+')}/#"

    def all_devices(self, leaf: str) -> str:
        return f"{self.base}/dev/+/{leaf}"

    def reply(self, client_id: str) -> str:
        return f"{self.base}/reply/{_level(client_id, 'client id', '+', '#')}"


def _level(value: str, what: str, *wildcards: str) -> str:
    """An id as a topic level; a whole-level wildcard too when the builder may make a filter."""
    return value if value in wildcards else check_id(value, what)


def parse(topic: str) -> ParsedTopic:
    """Split a topic of this namespace; raise RemoteViolation for anything else."""
    parts = topic.split("/")
    if len(parts) < 5 or f"{parts[0]}/{parts[1]}" != ROOT:
        raise RemoteViolation(f"topic outside namespace: {topic[:80]!r}")
    if any(not p or "+" in p or "#" in p or "\x00" in p for p in parts[2:]):
        raise RemoteViolation(f"empty or wildcard topic level: {topic[:80]!r}")
    site, scope = parts[2], parts[3]
    if not is_id(site) or (scope in ("dev", "reply") and not is_id(parts[4])):
        raise RemoteViolation(f"site or id outside the id grammar: {topic[:80]!r}")
    if scope == "dev" and len(parts) == 6 and parts[5] in DEVICE_LEAVES:
        return ParsedTopic(site, scope, parts[4], parts[5])
    if scope in ("fog", "cloud") and len(parts) == 5:
        return ParsedTopic(site, scope, "", parts[4])
    if scope == "reply" and len(parts) == 5:
        return ParsedTopic(site, scope, parts[4], "")
    raise RemoteViolation(f"unknown topic {topic[:80]!r}")
