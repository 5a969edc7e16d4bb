"""The fleet registry: a table-driven liveness state machine over device adverts.

Pure: no clock, no threads, no I/O. ``handle(advert, now)`` and ``tick(now)``
return commands for the shell (ask a device to rebirth, tell the controller a
device joined or was lost). Epochs follow Sparkplug's ``bdSeq``: any advert
whose connect epoch is older than the device's current one is a leftover of a
dead connection (typically a late Will) and is ignored, counted; a death counts
only for the current connection's epoch and never raises it.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from runtime.devices import RESOURCE_RANGES
from runtime.messages import DeviceBirth, DeviceDeath, DeviceState, DeviceSummary, PartitionStatus

from ..placement.model import Device, Fleet, class_label
from ..trust import death_applies

__all__ = [
    "DeviceStatus", "DeviceRecord", "RegistryConfig", "Registry", "TRANSITIONS",
    "RequestRebirth", "DeviceJoined", "DeviceLost", "Command", "training_fitness",
    "CLAIM_TOLERANCE", "CLAIM_ABOVE_MEASURED", "CLAIM_REFUTED", "capacity_flags", "ThrottleChanged",
    "measured_power",
]

#: A device claiming more than this many times the compute its own calibration measured is
#: flagged. Generous on purpose: a small partition's timing includes per-call overhead, and once
#: a measurement exists placement uses it instead of the claim anyway.
CLAIM_TOLERANCE = 50.0
CLAIM_ABOVE_MEASURED = "flops claim far above measured"
#: The router's observed round trips were far above the stage times the device reported
#: (``claim_check``): measured by the fog from then on, its own figures ignored.
CLAIM_REFUTED = "timings far below the router's observed times"


class DeviceStatus(enum.Enum):
    UNKNOWN = "unknown"
    LIVE = "live"
    SUSPECT = "suspect"
    DEAD = "dead"


class _Missed:
    """Pseudo-event: one state interval (and a half) without any advert."""


class _Expired:
    """Pseudo-event: the liveness deadline (``missed_intervals`` state intervals) passed."""


class _Action(enum.Enum):
    JOIN = "join"          # a (re)birth: record it, tell the controller
    REFRESH = "refresh"    # a state advert: update figures and last_seen
    REBIRTH = "rebirth"    # we lack the birth for this connection: ask for it
    LOSE = "lose"          # the device is gone: tell the controller
    SUSPECT = "suspect"
    IGNORE = "ignore"


S, A = DeviceStatus, _Action
#: (status, event type) -> (next status, action). Every transition of a device lives here.
TRANSITIONS: dict[tuple[DeviceStatus, type], tuple[DeviceStatus, _Action]] = {
    (S.UNKNOWN, DeviceBirth): (S.LIVE, A.JOIN),
    (S.LIVE, DeviceBirth): (S.LIVE, A.JOIN),
    (S.SUSPECT, DeviceBirth): (S.LIVE, A.JOIN),
    (S.DEAD, DeviceBirth): (S.LIVE, A.JOIN),
    (S.UNKNOWN, DeviceState): (S.UNKNOWN, A.REBIRTH),
    (S.LIVE, DeviceState): (S.LIVE, A.REFRESH),
    (S.SUSPECT, DeviceState): (S.LIVE, A.REFRESH),
    (S.DEAD, DeviceState): (S.DEAD, A.REBIRTH),
    (S.UNKNOWN, DeviceDeath): (S.UNKNOWN, A.IGNORE),
    (S.LIVE, DeviceDeath): (S.DEAD, A.LOSE),
    (S.SUSPECT, DeviceDeath): (S.DEAD, A.LOSE),
    (S.DEAD, DeviceDeath): (S.DEAD, A.IGNORE),
    (S.LIVE, _Missed): (S.SUSPECT, A.SUSPECT),
    (S.SUSPECT, _Expired): (S.DEAD, A.LOSE),
    (S.LIVE, _Expired): (S.DEAD, A.LOSE),
}
del S, A

Advert = DeviceBirth | DeviceState | DeviceDeath


# ------------------------------------------------------------------ commands


@dataclass(frozen=True, slots=True)
class RequestRebirth:
    """Publish ``Rebirth(device_id)``: we hear a device whose birth we do not have."""

    device_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class DeviceJoined:
    device_id: str
    epoch: int
    rejoin: bool  # it was known before (a reconnect or a restart of the device)
    new_epoch: bool = True  # False for a rebirth of the same connection (nothing was lost)


@dataclass(frozen=True, slots=True)
class DeviceLost:
    """The device and everything it ran are gone; ``reason`` is a fixed phrase."""

    device_id: str
    epoch: int
    reason: str  # "will" | "missed state adverts"
    last_seen: float


@dataclass(frozen=True, slots=True)
class ThrottleChanged:
    """The device's current connection started (or stopped) reporting thermal throttling.

    Throttled, it takes no partition and what it runs should move: plan again.
    """

    device_id: str
    throttled: bool


Command = RequestRebirth | DeviceJoined | DeviceLost | ThrottleChanged


# ------------------------------------------------------------------ records


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    missed_intervals: float = 3.0      # dead after this many state intervals without an advert
    suspect_intervals: float = 1.5     # suspect after this many
    default_interval_s: float = 10.0   # until a birth says otherwise
    rebirth_backoff_s: float = 2.0     # do not ask one device to rebirth more often than this
    battery_floor: float = 0.3         # federated training: battery above this, or charging


@dataclass(slots=True)
class DeviceRecord:
    """Everything the fog knows about one device; owned by the registry."""

    device_id: str
    status: DeviceStatus = DeviceStatus.UNKNOWN
    epoch: int = -1
    birth: DeviceBirth | None = None
    state: DeviceState | None = None
    last_seen: float = -math.inf
    since: float = 0.0
    lost_reason: str = ""
    rebirth_asked_at: float = -math.inf
    adverts: int = 0
    #: why the last advert of this device was refused (field and value); a clean birth clears it
    rejected: str = ""
    #: why the fleet view left this record out (it failed conversion); the next advert retries
    set_aside: str = ""
    #: the fog's clamp flags of the latest birth (claims beyond any real device)
    claim_flags: tuple[str, ...] = ()
    #: FLOP/s the device's own partition calibrations showed (best seen), None before any
    measured_flops: float | None = None
    #: the router refuted its reported timings (``claim_check``): flagged, its calibrations ignored
    refuted: bool = False
    #: W while computing, from the rails' joules per inference of its partitions (latest advert
    #: that had one); None: never measured, placement uses the birth's ``power_active_w``
    measured_power_w: float | None = None

    @property
    def alive(self) -> bool:
        return self.status in (DeviceStatus.LIVE, DeviceStatus.SUSPECT)

    @property
    def interval_s(self) -> float:
        return self.birth.state_interval_s if self.birth is not None and self.birth.state_interval_s > 0 else 0.0

    def partitions(self) -> tuple[PartitionStatus, ...]:
        """Partitions reported by the latest state advert of the current connection."""
        if self.state is None or self.state.epoch != self.epoch or not self.alive:
            return ()
        return self.state.partitions


def training_fitness(rec: DeviceRecord, battery_floor: float) -> tuple[bool, str]:
    """Fit for a federated round: alive, battery above the floor or charging, not throttled, not metered."""
    st = rec.state
    if not rec.alive:
        return False, "not alive"
    if st is None:
        return False, "no state advert yet"
    if st.throttled:
        return False, "throttled"
    if st.metered:
        return False, "metered link"
    if st.battery_level is not None and not st.charging and st.battery_level < battery_floor:
        return False, f"battery {st.battery_level:.0%} below floor {battery_floor:.0%}"
    if st.battery_level is None:
        return True, "mains powered"
    return True, "charging" if st.charging else f"battery {st.battery_level:.0%}"


def capacity_flags(rec: DeviceRecord) -> tuple[str, ...]:
    """The clamp's flags of the latest birth, plus one when the claim is far above the measurement.

    Empty (the device is verified) once a clean birth and the calibration agree.
    """
    b, m = rec.birth, rec.measured_flops
    flags = rec.claim_flags + ((CLAIM_REFUTED,) if rec.refuted else ())
    if b is not None and m is not None and not (isinstance(b.flops, (int, float))
                                                 and b.flops <= CLAIM_TOLERANCE * m):
        return flags + (CLAIM_ABOVE_MEASURED,)
    return flags


def measured_power(st: DeviceState) -> float | None:
    """Active power the board's rails showed for this advert's partitions (joules per inference
    over the calibration's seconds per inference); the highest if several, None if none measured.

    A figure outside ``power_active_w``'s range is no measurement (never a device set aside).
    """
    best: float | None = None
    for p in st.partitions:
        if not (p.energy_measured and p.calib_s > 0 and p.joules_per_inference > 0):
            continue
        w = p.joules_per_inference / p.calib_s
        if RESOURCE_RANGES["power_active_w"].problem(w) is None and (best is None or w > best):
            best = w
    return best


#: A state's ``uplink_bps`` beyond this (the birth clamp's cap) is taken at it: the wire range
#: admits 1e13, which once made one device every chain's favourite hop.
_MAX_UPLINK = float(RESOURCE_RANGES["uplink_bps"].plausible or 1e11)


def _throttled(rec: DeviceRecord) -> bool:
    st = rec.state
    return st is not None and st.epoch == rec.epoch and bool(st.throttled)


def _reporting(rec: DeviceRecord) -> bool:
    return rec.alive and rec.state is not None and rec.state.epoch == rec.epoch


def _raw_class(rec: DeviceRecord) -> str:
    return class_label(rec.birth.labels) if rec.birth is not None else ""


def _inputs(rec: DeviceRecord, reserved: float, class_refused: bool = False) -> tuple[object, ...]:
    """Everything ``_device`` reads of a record: equal inputs give an equal ``Device``."""
    b = rec.birth
    st = rec.state if rec.state is not None and rec.state.epoch == rec.epoch else None
    trust = (rec.measured_flops, not capacity_flags(rec), rec.measured_power_w, class_refused)
    if st is None:
        return (b, rec.alive, None, trust)
    return (b, rec.alive, (st.free_memory_bytes, st.battery_level, st.charging, st.uplink_bps, st.rtt_s,
                           reserved, bool(st.throttled)), trust)


def _device(did: str, inputs: tuple[object, ...]) -> Device:
    b, alive, figures, trust = inputs
    assert isinstance(b, DeviceBirth)
    measured: float | None = trust[0]  # type: ignore[index]
    verified: bool = trust[1]  # type: ignore[index]
    power: float | None = trust[2]  # type: ignore[index]
    class_refused: bool = trust[3]  # type: ignore[index]
    mem = float(b.memory_bytes)
    level, charging, throttled = 1.0, False, False
    uplink, rtt = b.uplink_bps, b.rtt_s
    if figures is not None:
        assert isinstance(figures, tuple)
        free, st_level, st_charging, st_uplink, st_rtt, reserved, throttled = figures
        mem = min(mem, float(free) + reserved)
        level, charging = (st_level if st_level is not None else 1.0), bool(st_charging)
        if st_uplink:  # the agent's estimate of its link, no further than any real link goes
            uplink = min(st_uplink, _MAX_UPLINK)
        if st_rtt is not None:
            rtt = st_rtt
    # Measured, not assumed: once the device's calibration exists it replaces the claim. No silent
    # repair of a bad figure (one once became 1 bit/s): the wire check keeps figures in range,
    # and a record that is not anyway is left out by ``fleet`` with its reason.
    dev = Device.from_resources(
        did, b, flops=measured, memory_bytes=max(mem, 0.0), uplink_bps=uplink, rtt_s=rtt,
        battery_level=level, charging=charging, alive=bool(alive), verified=bool(verified),
        power_active_w=power, throttled=bool(throttled), measured=measured is not None)
    if class_refused:  # its class label names a known device: it is of no class (``class_label``)
        dev = replace(dev, labels={k: v for k, v in dev.labels.items()
                                   if k not in ("device-class", "device-model")})
    return dev


class Registry:
    """Device records and their liveness; one owner thread drives it."""

    def __init__(self, config: RegistryConfig | None = None) -> None:
        self.config = config or RegistryConfig()
        self.devices: dict[str, DeviceRecord] = {}
        self.stale = 0          # adverts of an old connection, ignored
        self.rejected = 0       # adverts that failed validation (``reject``)
        self.set_aside = 0      # records the fleet view could not convert (left out, not raised)
        self.ignored = 0        # transitions with no effect (death of an unknown device, ...)
        self.accepted = 0
        # Incremental views: ``fleet()`` and ``reported()`` rebuild only the records touched since
        # their last call (a 10,000-device fleet is too big to rebuild per reconcile). Every
        # mutation of a record goes through ``_touch``; ``invalidate()`` drops the caches for a
        # caller that edits records by hand.
        self._fleet_dirty: set[str] = set()
        self._reported_dirty: set[str] = set()
        self._built: dict[str, tuple[tuple[object, ...], Device]] = {}  # id -> (inputs, Device)
        self._order: list[str] = []      # sorted ids of ``_built``
        self._row: dict[str, int] = {}   # id -> position in ``_order``
        self._list: list[Device] = []    # the devices of the next snapshot, in ``_order``
        self._fleet: Fleet | None = None
        self._last_reserved: dict[str, float] = {}
        self._reported: dict[str, tuple[PartitionStatus, ...]] | None = None
        self._labelled: dict[str, set[str]] = {}  # class label -> devices built with it
        self._label_of: dict[str, str] = {}       # device -> the class label it was built with

    # ------------------------------------------------------------ events

    def handle(self, advert: Advert, now: float) -> list[Command]:
        """Apply one verified advert received at monotonic ``now``."""
        rec = self.devices.get(advert.device_id)
        if rec is None:
            rec = self.devices[advert.device_id] = DeviceRecord(advert.device_id, since=now)
        if advert is not rec.state:
            # Re-delivery of the state object we hold changes nothing a view shows but the
            # status, which ``_set`` reports itself; anything else may change the record.
            self._touch(rec.device_id)
        if rec.status is not DeviceStatus.UNKNOWN and advert.epoch < rec.epoch:
            self.stale += 1
            return []
        if isinstance(advert, DeviceState) and advert.epoch > rec.epoch and rec.status is not DeviceStatus.UNKNOWN:
            # A new connection whose birth we missed (e.g. lost while we restarted).
            rec.state = advert
            return self._ask_rebirth(rec, now, "state from a connection without birth")
        if isinstance(advert, DeviceDeath) and not death_applies(rec.epoch, advert.epoch):
            # Sparkplug's rule: a death names the connection it ends; any other epoch is a leftover
            # (or a forgery of a future one) and must neither end nor advance the current connection
            self.stale += 1
            return []
        new, action = TRANSITIONS[(rec.status, type(advert))]
        self.accepted += 1
        rec.adverts += 1
        if action is _Action.JOIN:
            assert isinstance(advert, DeviceBirth)
            rejoin = rec.birth is not None
            new_epoch = advert.epoch != rec.epoch
            rec.birth, rec.epoch, rec.last_seen = advert, advert.epoch, now
            if rec.state is not None and rec.state.epoch != advert.epoch:
                rec.state = None
            rec.lost_reason = rec.rejected = ""
            self._set(rec, new, now)
            return [DeviceJoined(rec.device_id, rec.epoch, rejoin, new_epoch)]
        if action is _Action.REFRESH:
            assert isinstance(advert, DeviceState)
            was = _throttled(rec)
            rec.state, rec.last_seen = advert, now
            power = measured_power(advert)
            if power is not None:  # the latest measurement replaces the declared figure
                rec.measured_power_w = power
            self._set(rec, new, now)
            if bool(advert.throttled) != was:
                return [ThrottleChanged(rec.device_id, bool(advert.throttled))]
            return []
        if action is _Action.REBIRTH:
            assert isinstance(advert, DeviceState)
            if rec.state is None or advert.epoch >= rec.state.epoch:
                rec.state = advert  # kept until the birth of the same connection arrives
            return self._ask_rebirth(rec, now, "state from an unknown device" if rec.status is DeviceStatus.UNKNOWN
                                     else "state from a device marked dead")
        if action is _Action.LOSE:
            return self._lose(rec, new, now, "will")
        self.ignored += 1
        return []

    def tick(self, now: float) -> list[Command]:
        """Apply the liveness deadlines: suspect after 1.5 intervals, dead after 3."""
        out: list[Command] = []
        cfg = self.config
        for rec in self.devices.values():
            if not rec.alive:
                continue
            interval = rec.interval_s or cfg.default_interval_s
            silent = now - rec.last_seen
            if silent > cfg.missed_intervals * interval:
                new, _ = TRANSITIONS[(rec.status, _Expired)]
                out.extend(self._lose(rec, new, now, "missed state adverts"))
            elif rec.status is DeviceStatus.LIVE and silent > cfg.suspect_intervals * interval:
                new, _ = TRANSITIONS[(rec.status, _Missed)]
                self._set(rec, new, now)
        return out

    def credit_pause(self, seconds: float) -> None:
        """The observer was paused for ``seconds``: every live device's silence clock moves by it
        (a device that really died then is declared lost that much later, never sooner)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        for rec in self.devices.values():
            if rec.alive and math.isfinite(rec.last_seen):
                rec.last_seen += seconds

    def next_deadline(self) -> float:
        """The earliest ``now`` at which ``tick`` may change something (for the shell's timer)."""
        best = math.inf
        cfg = self.config
        for rec in self.devices.values():
            if rec.alive:
                interval = rec.interval_s or cfg.default_interval_s
                k = cfg.suspect_intervals if rec.status is DeviceStatus.LIVE else cfg.missed_intervals
                best = min(best, rec.last_seen + k * interval)
        return best

    def ask_rebirth(self, device_id: str, now: float, reason: str) -> list[Command]:
        """A device we cannot verify yet (not enrolled) is talking: ask it for a birth, rate-limited."""
        rec = self.devices.get(device_id)
        if rec is None:
            rec = self.devices[device_id] = DeviceRecord(device_id, since=now)
            self._touch(device_id)
        return self._ask_rebirth(rec, now, reason)

    def reject(self, device_id: str, now: float, why: str) -> list[Command]:
        """An authenticated advert of this device failed validation (``why``: field and value).

        The device is dead to placement until a clean birth: lost now if it was alive (what it
        ran is re-placed), and shown as rejected. Its later states only ask for that birth.
        """
        rec = self.devices.get(device_id)
        if rec is None:
            rec = self.devices[device_id] = DeviceRecord(device_id, since=now)
        self._touch(device_id)
        rec.rejected = why
        self.rejected += 1
        if rec.alive:
            return self._lose(rec, DeviceStatus.DEAD, now, "rejected advert")
        self._set(rec, DeviceStatus.DEAD, now)
        return []

    def note_claim_flags(self, device_id: str, flags: tuple[str, ...]) -> bool:
        """The fog's clamp flags for the birth about to be handled (empty: a clean birth).

        True when this newly flags the device (what it runs first should move: plan again).
        """
        rec = self.devices.get(device_id)
        if rec is None:
            rec = self.devices[device_id] = DeviceRecord(device_id)
        was = bool(capacity_flags(rec))
        if rec.claim_flags != tuple(flags):
            rec.claim_flags = tuple(flags)
            self._touch(device_id)
        return not was and bool(capacity_flags(rec))

    def note_measured(self, device_id: str, flops: float) -> bool:
        """FLOP/s a partition calibration of this device showed; the best one seen is kept.

        True when the measurement newly flags the device's claim (plan again, as above).
        """
        rec = self.devices.get(device_id)
        if rec is None or rec.refuted or not (flops > 0 and math.isfinite(flops)):
            return False  # refuted: its own figures are ignored (``note_refuted``)
        was = bool(capacity_flags(rec))
        if rec.measured_flops is None or flops > rec.measured_flops:
            rec.measured_flops = flops
            self._touch(device_id)
        return not was and bool(capacity_flags(rec))

    def note_refuted(self, device_id: str, flops: float) -> bool:
        """The router's round trips refuted this device's reported timings (``claim_check``): flagged,
        and ``flops`` (what the round trips showed; 0: nothing usable) is its measured compute from
        now on, which its own calibrations never raise. True when newly flagged (plan again)."""
        rec = self.devices.get(device_id)
        if rec is None:
            return False
        was = bool(capacity_flags(rec))
        rec.refuted = True
        if flops > 0 and math.isfinite(flops):
            rec.measured_flops = flops if rec.measured_flops is None else min(rec.measured_flops, flops)
        self._touch(device_id)
        return not was

    def forget(self, device_id: str) -> None:
        self.devices.pop(device_id, None)
        self._touch(device_id)

    def remove(self, device_id: str, now: float, reason: str) -> list[Command]:
        """Drop a device for good (revoked): lost now if it was alive, and no record kept."""
        rec = self.devices.get(device_id)
        if rec is None:
            return []
        out = self._lose(rec, DeviceStatus.DEAD, now, reason) if rec.alive else []
        self.forget(device_id)
        return out

    def invalidate(self) -> None:
        """Drop the cached views (after editing records other than through this class)."""
        self._built.clear()
        self._labelled, self._label_of = {}, {}
        self._order, self._row, self._list = [], {}, []
        self._fleet = None
        self._last_reserved = {}
        self._reported = None
        self._fleet_dirty = set(self.devices)
        self._reported_dirty.clear()

    # ------------------------------------------------------------ helpers

    def _touch(self, device_id: str) -> None:
        self._fleet_dirty.add(device_id)
        self._reported_dirty.add(device_id)

    def _set(self, rec: DeviceRecord, status: DeviceStatus, now: float) -> None:
        if rec.status is not status:
            rec.status = status
            rec.since = now
            self._touch(rec.device_id)

    def _ask_rebirth(self, rec: DeviceRecord, now: float, reason: str) -> list[Command]:
        if now - rec.rebirth_asked_at < self.config.rebirth_backoff_s:
            self.ignored += 1
            return []
        rec.rebirth_asked_at = now
        return [RequestRebirth(rec.device_id, reason)]

    def _lose(self, rec: DeviceRecord, status: DeviceStatus, now: float, reason: str) -> list[Command]:
        self._set(rec, status, now)
        rec.lost_reason = reason
        return [DeviceLost(rec.device_id, rec.epoch, reason, rec.last_seen)]

    # ------------------------------------------------------------ views

    def get(self, device_id: str) -> DeviceRecord | None:
        return self.devices.get(device_id)

    def alive_ids(self) -> list[str]:
        return sorted(d for d, r in self.devices.items() if r.alive)

    def reported(self) -> dict[str, tuple[PartitionStatus, ...]]:
        """Partitions each live device reports running (latest state of its current connection).

        A new dict per call, in the order of ``devices``; only touched records are re-read.
        """
        rep = self._reported
        if rep is None:
            rep = {d: r.partitions() for d, r in self.devices.items() if _reporting(r)}
        else:
            members = False
            for did in self._reported_dirty:
                rec = self.devices.get(did)
                if rec is not None and _reporting(rec):
                    members = members or did not in rep
                    rep[did] = rec.partitions()
                elif rep.pop(did, None) is not None:
                    members = True
            if members:  # back to the order of ``devices`` (a device keeps its place there)
                rep = {d: rep[d] for d in self.devices if d in rep}
        self._reported = rep
        self._reported_dirty.clear()
        return dict(rep)

    def fleet(self, reserved: Mapping[str, float] | None = None) -> Fleet:
        """The scheduler's snapshot: birth resources, latest state figures.

        ``memory_bytes`` is what the device can give partitions: its birth figure,
        lowered to the free memory it reports plus ``reserved`` (memory of the
        partitions we placed there, which ``current`` charges again).

        Incremental: a ``Device`` is rebuilt only when its inputs (birth, liveness, state
        figures, reserved memory) changed, and the same ``Fleet`` object (with its derived
        ``cache``) is returned while none did.
        """
        reserved = reserved or {}
        last = self._last_reserved
        check = self._fleet_dirty
        check.update(d for d, v in reserved.items() if last.get(d, 0.0) != v)
        check.update(d for d, v in last.items() if d not in reserved and v != 0.0)
        built = self._built
        changed = members = False
        changed_ids: list[str] = []
        for did in list(check):  # a device that came or went may be some device's class label
            check.update(self._labelled.get(did, ()))
        for did in check:
            rec = self.devices.get(did)
            old = built.get(did)
            self._unlabel(did)
            if rec is None or rec.birth is None:
                if old is not None:
                    del built[did]
                    changed = members = True
                continue
            try:
                raw = _raw_class(rec)
                if raw:
                    self._labelled.setdefault(raw, set()).add(did)
                    self._label_of[did] = raw
                key = _inputs(rec, float(reserved.get(did, 0.0)), bool(raw) and raw in self.devices)
                if old is not None and old[0] == key:
                    continue
                dev = _device(did, key)
            except (ValueError, TypeError, ArithmeticError, AssertionError) as exc:
                # One device's record must never stop the site's placement: leave it out, say why.
                rec.set_aside = f"{type(exc).__name__}: {exc}"[:200]
                self.set_aside += 1
                if old is not None:
                    del built[did]
                    changed = members = True
                continue
            rec.set_aside = ""
            built[did] = (key, dev)
            changed = True
            members = members or old is None
            changed_ids.append(did)
        check.clear()
        self._last_reserved = dict(reserved)
        if members:
            self._order = sorted(built)
            self._row = {d: i for i, d in enumerate(self._order)}
            self._list = [built[d][1] for d in self._order]
        elif changed:
            for did in changed_ids:
                self._list[self._row[did]] = built[did][1]
        if changed or self._fleet is None:
            self._fleet = Fleet(tuple(self._list))
        return self._fleet

    def _unlabel(self, did: str) -> None:
        raw = self._label_of.pop(did, "")
        ids = self._labelled.get(raw)
        if ids is not None:
            ids.discard(did)
            if not ids:
                del self._labelled[raw]

    def device_class(self, device_id: str) -> str:
        """The class the fog files ``device_id``'s measured times under besides its id: its
        birth's class label, '' for none or for a label that names a known device."""
        rec = self.devices.get(device_id)
        return class_label(rec.birth.labels, self.devices) if rec is not None and rec.birth is not None else ""

    def summaries(self) -> tuple[DeviceSummary, ...]:
        """Per-device summary for the coordinator's energy-aware client selection."""
        out = []
        for did in sorted(self.devices):
            rec = self.devices[did]
            if rec.birth is None:
                continue
            st = rec.state
            fit, reason = training_fitness(rec, self.config.battery_floor)
            out.append(DeviceSummary(
                device_id=did, alive=rec.alive,
                battery_level=st.battery_level if st is not None else None,
                charging=st.charging if st is not None else False,
                throttled=st.throttled if st is not None else False,
                metered=st.metered if st is not None else False,
                power_w=st.power_w if st is not None else None,
                fit_for_training=fit, reason=reason,
                flwr_node_id=st.flwr_node_id if st is not None else None,
                cpu_load=st.cpu_load if st is not None else None,
            ))
        return tuple(out)

    def counts(self) -> dict[str, int]:
        c = {s.value: 0 for s in DeviceStatus}
        for r in self.devices.values():
            c[r.status.value] += 1
        return c
