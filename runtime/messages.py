"""Every message the tiers exchange, as frozen dataclasses that check themselves.

Each top-level message has a wire ``KIND`` and a ``VERSION``. Decoding
tolerates unknown fields (a newer peer may add some) and fills defaults for
missing optional ones, so versions can roll out device by device. Records
(``Taint``, ``Hop``, ...) are nested values without a kind of their own.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

import numpy as np

from ._schema import R, Record, schema_of
from .devices import (
    RESOURCE_RANGES,
    DeviceResources,
    OutOfRange,
    Range,
    Taint,
    check_ranges,
    range_problem,
)
from .errors import RemoteViolation

__all__ = [
    "Message", "MESSAGE_TYPES", "message",
    "Taint", "PartitionStatus", "Hop", "DeviceSummary",
    "DeviceBirth", "DeviceState", "DeviceDeath", "FogState", "Rebirth",
    "Deploy", "Undeploy", "CommandAck",
    "InferenceRequest", "Activation", "RouteTicket", "Relay", "Tensors", "InferenceResult", "TimeHint",
    "FleetSummary", "ControlRequest", "ControlReply", "ModelRelease", "Envelope",
    "Range", "RESOURCE_RANGES", "BIRTH_RANGES", "STATE_RANGES", "PARTITION_RANGES", "OutOfRange",
    "range_problem", "check_ranges",
]

PROTOCOL_VERSION = 1
MAX_ID_LEN = 128


class Message(Record):
    """A top-level message: has a wire kind and a version."""

    __slots__ = ()
    KIND: ClassVar[str]
    VERSION: ClassVar[int] = PROTOCOL_VERSION


MESSAGE_TYPES: dict[str, type[Message]] = {}


def message(cls: type[R]) -> type[R]:
    """Register a message class under its KIND and compile its schema."""
    schema_of(cls)
    if issubclass(cls, Message):
        if cls.KIND in MESSAGE_TYPES:
            raise RuntimeError(f"duplicate message kind {cls.KIND}")
        MESSAGE_TYPES[cls.KIND] = cls
    return cls


def _check_id(value: str, what: str) -> None:
    if not value or len(value) > MAX_ID_LEN or any(c in value for c in "/+#\x00"):
        raise RemoteViolation(f"invalid {what} {value[:40]!r}: 1-{MAX_ID_LEN} chars, no '/', '+', '#'")


def _check_nonneg(**values: float | int | None) -> None:
    for name, v in values.items():
        if v is not None and (v != v or v < 0):  # v != v catches NaN
            raise RemoteViolation(f"{name} must be >= 0, got {v}")


# ---------------------------------------------------------------- ranges
#
# Every number a device says about itself, with the range it must lie in. The device's static
# resources and their ranges are declared once, in ``runtime.devices`` (``DeviceResources``,
# ``RESOURCE_RANGES``); the birth adds its own figures below, states and partitions theirs. The
# wire check (``validate``, run when bytes become a message), the placement model's ``Device``,
# the fog's plausibility clamp (``fog_broker.trust.bound_birth``), the agent's ``Capabilities``
# and the simulated ``DeviceProfile`` all read these tables.

_I64 = (1 << 63) - 1

BIRTH_RANGES: Mapping[str, Range] = MappingProxyType({
    "epoch": Range(0, _I64), "seq": Range(0, _I64), **RESOURCE_RANGES,
    "state_interval_s": Range(0.0, 1e6, "s", plausible=60.0),
})
STATE_RANGES: Mapping[str, Range] = MappingProxyType({
    "epoch": Range(0, _I64), "seq": Range(0, _I64),
    "free_memory_bytes": Range(0, 1 << 60, "bytes"),
    "battery_level": Range(0.0, 1.0),
    "power_w": Range(0.0, 1e5, "W"),
    "cpu_load": Range(0.0, 1e6),
    "temperature_c": Range(-273.15, 1e4, "C"),
    "uplink_bps": Range(0.0, 1e13, "bit/s"),  # 0: not measured yet
    "rtt_s": Range(0.0, 3600.0, "s"),
    "flwr_node_id": Range(0, (1 << 64) - 1),
    "clock_skew_s": Range(-1e10, 1e10, "s"),  # a Pi without an RTC may start in 1970
})
PARTITION_RANGES: Mapping[str, Range] = MappingProxyType({
    "version": Range(0, _I64), "replica": Range(0, _I64), "index": Range(0, _I64),
    "p50_s": Range(0.0, 86400.0, "s"), "p99_s": Range(0.0, 86400.0, "s"),
    "calib_s": Range(0.0, 86400.0, "s"), "max_batch": Range(1, 1024), "batch_slope": Range(0.0, 1.5),
    "joules_per_inference": Range(0.0, 1e6, "J"),
    "served": Range(0, _I64), "errors": Range(0, _I64),
})


# ---------------------------------------------------------------- records


@message
@dataclass(frozen=True, slots=True)
class PartitionStatus(Record):
    """What a device reports about one partition it runs, like a pod status."""

    workload: str
    version: int
    replica: int
    index: int
    sha256: str
    health: str  # "running" | "loading" | "failed"
    p50_s: float = 0.0
    p99_s: float = 0.0
    served: int = 0
    errors: int = 0
    # one request's compute, timed on this device when the partition was loaded (its calibration):
    # the fog turns it into measured segment times for the device's class
    calib_s: float = 0.0
    # the board's energy for one request, from its rails around a batch at load (energy_measured),
    # else power_active_w x calib_s (COST_MODEL.md); 0.0: not known
    joules_per_inference: float = 0.0
    energy_measured: bool = False
    # dynamic batching (issue 33): frames this stage runs as one batch at most (1: no batching) and
    # the measured cost slope of a batch, cost(n) = one frame's x (1 + slope (n - 1)); the router
    # predicts a queue's drain with them
    max_batch: int = 1
    batch_slope: float = 1.0

    def validate(self) -> None:
        if self.health not in ("running", "loading", "failed"):
            raise RemoteViolation(f"unknown partition health {self.health!r}")
        check_ranges(self, PARTITION_RANGES)


@message
@dataclass(frozen=True, slots=True)
class Hop(Record):
    """One stage of an inference route: which device runs which partition."""

    device_id: str
    workload: str
    version: int
    replica: int
    index: int
    #: How this hop's output crosses the cut to the next hop (``runtime.activations``); "" = float32.
    wire: str = ""

    def validate(self) -> None:
        if self.wire not in ("", "float32", "float16", "int8", "int8c"):
            raise RemoteViolation(f"unknown activation wire {self.wire[:20]!r}")


@message
@dataclass(frozen=True, slots=True)
class DeviceSummary(Record):
    """A device as the coordinator needs it for client selection."""

    device_id: str
    alive: bool
    battery_level: float | None = None
    charging: bool = False
    throttled: bool = False
    metered: bool = False
    power_w: float | None = None
    fit_for_training: bool = False
    reason: str = ""
    flwr_node_id: int | None = None
    cpu_load: float | None = None  # the device's last advert (None: not known); "idle" for selection


# --------------------------------------------------------------- adverts


@dataclass(frozen=True)
class _BirthHead(Message):
    """Who is born: the fields a birth puts before the device's resources (positional order)."""

    __slots__ = ()
    device_id: str
    epoch: int
    seq: int
    site: str
    public_key: bytes


@message
@dataclass(frozen=True, slots=True)
class DeviceBirth(DeviceResources, _BirthHead):
    """Full description of a device, sent once per connection (Sparkplug NBIRTH).

    Its resource fields (``flops`` ... ``cpu_count``) are those of ``runtime.devices.
    DeviceResources``, inherited, so they stay flat on the wire and a new device field is a
    birth field without a change here.
    """

    KIND: ClassVar[str] = "dev.birth"
    state_interval_s: float = 10.0
    simulated: bool = False
    agent_version: str = ""
    # Session MAC offer (docs/protocol.md, Trust): the device's X25519 key for this birth and the
    # fog's X25519 key it was combined with; empty: this device signs every state advert.
    session_key: bytes = b""
    fog_session_key: bytes = b""

    def __post_init__(self) -> None:
        # a message's types are exact (the decoder already makes wire ints floats): no coercion
        Record.__post_init__(self)

    def validate(self) -> None:
        _check_id(self.device_id, "device_id")
        check_ranges(self, BIRTH_RANGES)
        if len(self.public_key) != 32:
            raise RemoteViolation("public_key must be 32 bytes (Ed25519)")

    @classmethod
    def of(cls, resources: DeviceResources, **birth: object) -> DeviceBirth:
        """The birth advertising ``resources``; ``birth`` holds the other fields (id, epoch ...)
        and may override resource fields (e.g. the operator's ``labels``)."""
        return cls(**{**resources.resource_kwargs(), **birth})


@message
@dataclass(frozen=True, slots=True)
class DeviceState(Message):
    """Periodic changing figures of a device (Sparkplug NDATA)."""

    KIND: ClassVar[str] = "dev.state"
    device_id: str
    epoch: int
    seq: int
    free_memory_bytes: int
    battery_level: float | None = None  # 0..1, None = mains powered
    charging: bool = False
    power_w: float | None = None
    cpu_load: float = 0.0
    temperature_c: float | None = None
    throttled: bool = False
    metered: bool = False
    uplink_bps: float | None = None
    rtt_s: float | None = None
    partitions: tuple[PartitionStatus, ...] = ()
    flwr_node_id: int | None = None
    # fog clock minus this device's clock, from the fog's signed time hints (None: no hint yet);
    # a Pi without an RTC shows its skew here instead of failing freshness checks in silence
    clock_skew_s: float | None = None

    def validate(self) -> None:
        _check_id(self.device_id, "device_id")
        check_ranges(self, STATE_RANGES)


@message
@dataclass(frozen=True, slots=True)
class DeviceDeath(Message):
    """The MQTT Will of a device connection; ``epoch`` names the connection that died."""

    KIND: ClassVar[str] = "dev.death"
    device_id: str
    epoch: int

    def validate(self) -> None:
        _check_id(self.device_id, "device_id")


@message
@dataclass(frozen=True, slots=True)
class FogState(Message):
    """Retained online/offline state of a fog broker (Sparkplug primary host STATE)."""

    KIND: ClassVar[str] = "fog.state"
    fog_id: str
    site: str
    online: bool
    epoch: int
    public_key: bytes = b""
    timestamp: float = 0.0
    # The fog's X25519 key for this run and its Ed25519 signature (runtime.security.sign_session_offer).
    session_key: bytes = b""
    session_sig: bytes = b""


@message
@dataclass(frozen=True, slots=True)
class Rebirth(Message):
    """Ask devices to publish their birth again (all when ``device_id`` is empty)."""

    KIND: ClassVar[str] = "fog.rebirth"
    device_id: str = ""
    reason: str = ""


# -------------------------------------------------------------- commands


@message
@dataclass(frozen=True, slots=True)
class Deploy(Message):
    """Run a partition artifact; the artifact signature is checked before loading."""

    KIND: ClassVar[str] = "cmd.deploy"
    command_id: str
    workload: str
    version: int
    replica: int
    index: int
    sha256: str
    artifact: bytes
    signature: bytes
    signer: str
    memory_bytes: int
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        _check_nonneg(memory_bytes=self.memory_bytes, version=self.version, replica=self.replica,
                      index=self.index)
        if len(self.sha256) != 64:
            raise RemoteViolation("sha256 must be 64 hex characters")


@message
@dataclass(frozen=True, slots=True)
class Undeploy(Message):
    KIND: ClassVar[str] = "cmd.undeploy"
    command_id: str
    workload: str
    version: int
    replica: int
    index: int


@message
@dataclass(frozen=True, slots=True)
class CommandAck(Message):
    """ACK or NACK of a command, with the reason a person can act on."""

    KIND: ClassVar[str] = "cmd.ack"
    command_id: str
    device_id: str
    ok: bool
    reason: str = ""


# -------------------------------------------------------------- inference


@message
@dataclass(frozen=True, slots=True)
class InferenceRequest(Message):
    """A client's request to the fog broker's router."""

    KIND: ClassVar[str] = "inf.request"
    request_id: str
    workload: str
    reply_to: str
    tensors: dict[str, np.ndarray]
    timeout_s: float = 5.0  # <= 0: the workload's slo_s (else the fog's default)
    #: answers of requests naming the same stream come back in the order they were sent ("": any order)
    stream: str = ""

    def validate(self) -> None:
        if not math.isfinite(self.timeout_s):
            raise RemoteViolation("timeout_s must be finite")
        if len(self.stream) > 256:
            raise RemoteViolation("stream name longer than 256 characters")


@message
@dataclass(frozen=True, slots=True)
class Activation(Message):
    """Named tensors travelling along a source-routed partition chain."""

    KIND: ClassVar[str] = "inf.activation"
    request_id: str
    workload: str
    route: tuple[Hop, ...]
    hop: int
    reply_to: str
    tensors: dict[str, np.ndarray]
    deadline: float = 0.0  # wall-clock seconds; 0 means none
    # The fog-signed route this activation travels (``runtime.relay``): forwarded unchanged.
    ticket: bytes = b""
    ticket_sig: bytes = b""
    keys: tuple[bytes, ...] = ()  # each hop's device key, from the verified ticket

    def validate(self) -> None:
        if not 0 <= self.hop < len(self.route):
            raise RemoteViolation(f"hop {self.hop} outside a route of {len(self.route)}")


@message
@dataclass(frozen=True, slots=True)
class RouteTicket(Message):
    """The fog's word on one inference attempt's route, signed once and carried by every hop.

    ``keys[i]`` is the Ed25519 key of ``route[i].device_id``: a hop accepts an activation only
    sealed by the previous hop's key named here (or, for hop 0, by the fog itself).
    ``inputs_sha256`` (when set) is the SHA-256 of hop 0's encoded ``Tensors``: the ticket's
    signature then vouches for hop 0's frame too, which needs no signature of its own.
    """

    KIND: ClassVar[str] = "inf.ticket"
    fog_id: str
    request_id: str
    workload: str
    route: tuple[Hop, ...]
    keys: tuple[bytes, ...]
    reply_to: str
    deadline: float = 0.0
    inputs_sha256: bytes = b""

    def validate(self) -> None:
        if any(len(k) != 32 for k in self.keys):
            raise RemoteViolation("route keys must be Ed25519 public keys (32 bytes)")
        if self.inputs_sha256 and len(self.inputs_sha256) != 32:
            raise RemoteViolation("inputs_sha256 must be a SHA-256 digest (32 bytes)")


@message
@dataclass(frozen=True, slots=True)
class Relay(Message):
    """An activation on the wire (``runtime.relay``): checked before its tensors are decoded.

    ``ticket`` is an encoded ``RouteTicket`` and ``ticket_sig`` the fog's signature of it;
    ``tensors`` an encoded ``Tensors``; ``signature`` is the sender's over all of it.
    """

    KIND: ClassVar[str] = "inf.relay"
    hop: int
    sender: str
    ticket: bytes
    ticket_sig: bytes
    tensors: bytes
    signature: bytes

    def validate(self) -> None:
        _check_nonneg(hop=self.hop)


@message
@dataclass(frozen=True, slots=True)
class Tensors(Message):
    """Named tensors, encoded on their own so a relay can be checked before they are decoded."""

    KIND: ClassVar[str] = "inf.tensors"
    tensors: dict[str, np.ndarray]


@message
@dataclass(frozen=True, slots=True)
class InferenceResult(Message):
    """Output tensors, or an error naming the stage that failed."""

    KIND: ClassVar[str] = "inf.result"
    request_id: str
    ok: bool
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    error: str = ""
    device_id: str = ""
    replica: int = 0
    latency_s: float = 0.0
    # why it failed, for programs (the error text is for people): "unknown" workload, "not ready"
    # (pending, no running chain), "overloaded", "timeout", "failed" (a stage answered an error)
    failure: str = ""
    #: an "overloaded" refusal: seconds after which the same request could be admitted (0: unknown)
    retry_after_s: float = 0.0

    def validate(self) -> None:
        if not (math.isfinite(self.retry_after_s) and self.retry_after_s >= 0):
            raise RemoteViolation("retry_after_s must be a finite number >= 0")
        if self.failure not in FAILURES:
            raise RemoteViolation(f"unknown failure kind {self.failure[:40]!r}")


FAILURES = frozenset({"", "unknown", "not ready", "overloaded", "timeout", "failed"})


# -------------------------------------------------------------- fog <-> cloud, control


@message
@dataclass(frozen=True, slots=True)
class FleetSummary(Message):
    """What a fog broker tells the coordinator about its devices, every few seconds."""

    KIND: ClassVar[str] = "fog.summary"
    fog_id: str
    site: str
    timestamp: float
    devices: tuple[DeviceSummary, ...] = ()


@message
@dataclass(frozen=True, slots=True)
class ControlRequest(Message):
    """An operator request to a fog broker (deploy, delete, status); body is JSON."""

    KIND: ClassVar[str] = "ctl.request"
    request_id: str
    action: str
    reply_to: str
    body: bytes = b""


@message
@dataclass(frozen=True, slots=True)
class ControlReply(Message):
    KIND: ClassVar[str] = "ctl.reply"
    request_id: str
    ok: bool
    body: bytes = b""
    error: str = ""


@message
@dataclass(frozen=True, slots=True)
class TimeHint(Message):
    """The fog's wall clock, sealed and published every few seconds on ``fog/TIME``.

    A device without a real-time clock compares it with its own and reports the skew; the
    envelope's (epoch, seq) only moves forward, so an old hint cannot be replayed to it.
    """

    KIND: ClassVar[str] = "fog.time"
    fog_id: str
    wall: float


@message
@dataclass(frozen=True, slots=True)
class ModelRelease(Message):
    """A signed new model version, published by the coordinator to fog brokers."""

    KIND: ClassVar[str] = "cloud.release"
    workload: str
    version: int
    sha256: str
    artifact: bytes
    signature: bytes
    signer: str
    metadata: dict[str, str] = field(default_factory=dict)


@message
@dataclass(frozen=True, slots=True)
class Envelope(Message):
    """A signed wrapper: who sent ``payload``, on which connection, in which order, when."""

    KIND: ClassVar[str] = "env"
    sender: str
    epoch: int
    seq: int
    timestamp: float
    payload: bytes
    signature: bytes

    def validate(self) -> None:
        _check_nonneg(epoch=self.epoch, seq=self.seq)
