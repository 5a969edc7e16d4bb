"""The MQTT topic namespace, modelled on Sparkplug B (see docs/protocol.md).

One module builds and parses every topic so no package writes its own
string formatting. Layout: ``fogline/v1/{site}/...``; every site name, device
id and client id in a topic is an identifier of ``runtime.ids`` (checked here, in
both directions), so a topic level never holds ``/``, ``+``, ``#`` or a newline.

Topics name their sender: every topic an identity other than the fog writes ends in (or
holds) that identity's own id, and the broker's ACL lets each identity write only topics
with its own id (``runtime.broker.acl_for``). The fog keys every budget, quarantine and
log line by that id (``ParsedTopic.sender``), never by a name inside the payload:
``fog/CTL/{sender}``, ``fog/INFER/{sender}``, ``reply/{fog}/{device}`` (a hop's result),
``dev/{dst}/ACT/{src}`` (an activation), ``cloud/RELEASE/{coordinator}`` (a model release),
``dev/{id}/BIRTH|STATE|DEATH|ACK``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import LocalViolation, RemoteViolation
from .ids import check_id, is_id

__all__ = ["ROOT", "Topics", "ParsedTopic", "parse"]

ROOT = "fogline/v1"

# Device-published leaves
BIRTH, STATE, DEATH, ACK = "BIRTH", "STATE", "DEATH", "ACK"
# Device-consumed leaves
CMD, ACT = "CMD", "ACT"
DEVICE_LEAVES = frozenset({BIRTH, STATE, DEATH, ACK, CMD, ACT})
OWN_LEAVES = frozenset({BIRTH, STATE, DEATH, ACK})  # written by the device the topic names
# Fog leaves whose topics end in their sender's id
CTL, INFER = "CTL", "INFER"
SENT_BY = frozenset({CTL, INFER})
# The cloud leaf whose topic ends in its sender's id (a coordinator)
RELEASE = "RELEASE"


@dataclass(frozen=True, slots=True)
class ParsedTopic:
    site: str
    scope: str  # "dev" | "fog" | "reply" | "cloud"
    name: str  # device id, client id, or "" for fog-wide topics
    leaf: str
    sender: str = ""  # the id of the identity the ACL lets write this topic ("": the fog)


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

    def infer(self, sender: str) -> str:
        """Inference requests of ``sender`` (only it may write here; ``+``: all of them)."""
        return f"{self.base}/fog/INFER/{_level(sender, 'client id', '+')}"

    def control(self, sender: str) -> str:
        """Control requests of ``sender`` (only it may write here; ``+``: all of them)."""
        return f"{self.base}/fog/CTL/{_level(sender, 'client id', '+')}"

    def summary(self) -> str:
        """Retained FleetSummary for the coordinator."""
        return f"{self.base}/fog/SUMMARY"

    def release(self, sender: str) -> str:
        """Model releases ``sender`` (a coordinator) publishes (only it may write here; ``+``: all of them).

        Under the publisher's own id so the fog's release budget and a quarantine for flooding key
        on the identity the broker authenticated (the release's signer may be another key)."""
        return f"{self.base}/cloud/{RELEASE}/{_level(sender, 'client id', '+')}"

    # devices
    def device(self, device_id: str, leaf: str) -> str:
        if leaf == ACT:
            raise LocalViolation("an activation topic names its sender: use Topics.activation(dst, src)")
        return f"{self.base}/dev/{_level(device_id, 'device id', '+')}/{leaf}"

    def activation(self, device_id: str, sender: str) -> str:
        """Activations for ``device_id`` from ``sender`` (a device, or the fog for hop 0)."""
        return f"{self.base}/dev/{_level(device_id, 'device id', '+')}/{ACT}/{_level(sender, 'sender id', '+')}"

    def device_prefix(self, device_id: str) -> str:
        return f"{self.base}/dev/{_level(device_id, 'device id', '+')}/#"

    def all_devices(self, leaf: str) -> str:
        return f"{self.base}/dev/+/{leaf}"

    def reply(self, client_id: str) -> str:
        """The fog's answers to ``client_id`` (only the fog writes here)."""
        return f"{self.base}/reply/{_level(client_id, 'client id', '+', '#')}"

    def result(self, client_id: str, sender: str) -> str:
        """Results ``sender`` (a device's last hop) sends to ``client_id`` (the fog), under its own id."""
        return f"{self.base}/reply/{check_id(client_id, 'client id')}/{_level(sender, 'sender id', '+')}"


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
    if len(parts) == 6 and (scope == "reply" or (scope == "fog" and parts[4] in SENT_BY)
                            or (scope == "cloud" and parts[4] == RELEASE)) and not is_id(parts[5]):
        raise RemoteViolation(f"sender outside the id grammar: {topic[:80]!r}")
    if scope == "dev" and len(parts) == 6 and parts[5] in OWN_LEAVES:
        return ParsedTopic(site, scope, parts[4], parts[5], parts[4])
    if scope == "dev" and len(parts) == 6 and parts[5] == CMD:
        return ParsedTopic(site, scope, parts[4], parts[5])
    if scope == "dev" and len(parts) == 7 and parts[5] == ACT and is_id(parts[6]):
        return ParsedTopic(site, scope, parts[4], ACT, parts[6])
    if scope == "fog" and len(parts) == 6 and parts[4] in SENT_BY:
        return ParsedTopic(site, scope, "", parts[4], parts[5])
    if scope == "cloud" and len(parts) == 6 and parts[4] == RELEASE:
        return ParsedTopic(site, scope, "", RELEASE, parts[5])
    if scope in ("fog", "cloud") and len(parts) == 5 and parts[4] not in SENT_BY and parts[4] != RELEASE:
        return ParsedTopic(site, scope, "", parts[4])
    if scope == "reply" and len(parts) == 5:
        return ParsedTopic(site, scope, parts[4], "")
    if scope == "reply" and len(parts) == 6:
        return ParsedTopic(site, scope, parts[4], "", parts[5])
    raise RemoteViolation(f"unknown topic {topic[:80]!r}")
