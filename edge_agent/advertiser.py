"""The advertiser core: builds DeviceBirth / DeviceState and decides when a state is due.

Pure: time is a parameter, and the shell publishes what this returns. A state
is due every ``state_interval_s`` and at once on a significant change: the
battery fell by ``battery_points`` since the last advert, free memory moved
by ``memory_fraction``, the set of partitions (or their health) changed,
throttling started or stopped, or the link became (un)metered.
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.messages import DeviceBirth, DeviceState, PartitionStatus, Taint

from .readings import Capabilities, Reading

__all__ = ["AdvertPolicy", "Snapshot", "Advertiser", "build_birth"]

AGENT_VERSION = "0.1.0"


@dataclass(frozen=True, slots=True)
class AdvertPolicy:
    state_interval_s: float = 10.0
    battery_points: float = 0.05
    memory_fraction: float = 0.10


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a state advert says, as the shell observed it."""

    reading: Reading
    partitions: tuple[PartitionStatus, ...] = ()
    uplink_bps: float | None = None
    rtt_s: float | None = None
    flwr_node_id: int | None = None


def _partition_set(parts: tuple[PartitionStatus, ...]) -> frozenset[tuple[str, int, int, int, str, str]]:
    return frozenset((p.workload, p.version, p.replica, p.index, p.sha256, p.health) for p in parts)


def change_reason(prev: Snapshot, cur: Snapshot, policy: AdvertPolicy) -> str | None:
    """The significant change between two snapshots, as a fixed phrase, or None."""
    a, b = prev.reading, cur.reading
    if _partition_set(prev.partitions) != _partition_set(cur.partitions):
        return "partitions changed"
    if a.throttled != b.throttled:
        return "throttling changed"
    if (a.battery_level is None) != (b.battery_level is None):
        return "power source changed"
    if (a.battery_level is not None and b.battery_level is not None
            and a.battery_level - b.battery_level >= policy.battery_points - 1e-9):
        return "battery dropped"
    if a.charging != b.charging:
        return "charging changed"
    if a.metered != b.metered:
        return "metered changed"
    base = max(a.free_memory_bytes, 1)
    if abs(b.free_memory_bytes - a.free_memory_bytes) >= policy.memory_fraction * base:
        return "free memory changed"
    return None


class Advertiser:
    """Decides when to publish state; ``tick(snapshot, now)`` returns the reason or None."""

    def __init__(self, device_id: str, policy: AdvertPolicy | None = None) -> None:
        self.device_id = device_id
        self.policy = policy or AdvertPolicy()
        self._last: Snapshot | None = None
        self._last_at: float | None = None
        self.sent = 0

    def reset(self) -> None:
        """Forget the last advert (after a birth the next tick sends a state)."""
        self._last = None
        self._last_at = None

    def tick(self, snap: Snapshot, now: float) -> str | None:
        """Reason a state is due now (and record it as sent), else None."""
        if self._last is None or self._last_at is None:
            reason: str | None = "first"
        elif now - self._last_at >= self.policy.state_interval_s:
            reason = "interval"
        else:
            reason = change_reason(self._last, snap, self.policy)
        if reason is not None:
            self._last, self._last_at = snap, now
            self.sent += 1
        return reason

    def next_due(self, now: float) -> float:
        """Monotonic time of the next periodic state."""
        if self._last_at is None:
            return now
        return self._last_at + self.policy.state_interval_s

    def state(self, snap: Snapshot, epoch: int, seq: int) -> DeviceState:
        r = snap.reading
        return DeviceState(
            device_id=self.device_id, epoch=epoch, seq=seq,
            free_memory_bytes=max(0, int(r.free_memory_bytes)),
            battery_level=r.battery_level, charging=r.charging,
            power_w=None if r.power_w is None else float(r.power_w),
            cpu_load=float(r.cpu_load),
            temperature_c=None if r.temperature_c is None else float(r.temperature_c),
            throttled=r.throttled, metered=r.metered,
            uplink_bps=None if snap.uplink_bps is None else float(snap.uplink_bps),
            rtt_s=None if snap.rtt_s is None else float(snap.rtt_s),
            partitions=snap.partitions, flwr_node_id=snap.flwr_node_id)


def build_birth(device_id: str, site: str, caps: Capabilities, public_key: bytes, *, epoch: int, seq: int,
                labels: dict[str, str], taints: tuple[Taint, ...], state_interval_s: float) -> DeviceBirth:
    """The birth certificate: capabilities, labels (probe labels overridden by the operator's), taints, key."""
    merged = {**caps.labels, **labels}
    merged.setdefault("site", site)
    return DeviceBirth.of(
        caps, device_id=device_id, epoch=epoch, seq=seq, site=site, public_key=public_key,
        labels=merged, taints=(*caps.taints, *taints), state_interval_s=float(state_interval_s),
        simulated=caps.simulated, agent_version=AGENT_VERSION)
