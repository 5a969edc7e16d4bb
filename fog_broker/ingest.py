"""Advert ingest: device messages from MQTT to verified, bounded messages for the owner thread.

Threads: the MQTT worker routes each device message to its verify shard (a
device always maps to the same shard, so its replay window lives in one
place and its order is kept); each shard batches its queue and checks
envelopes in its worker process (Ed25519 is the bulk of ingest) or in the
thread. Only enrolled, approved devices are verified at all: anything from
an unknown sender is counted and dropped, creating no record and sending
nothing back (a flood of strangers costs a dictionary lookup each).

Fair share: before a message is queued (so before any decode or signature
check) its sender's budget for its kind is taken (``DEVICE_SHARE``); over it,
the message is dropped and counted (``limited:KIND``): a busy honest device is
throttled, never quarantined. A sender whose frames keep failing their checks
(bad signature, replayed, malformed, someone else's: ``FAILED``) is quarantined
for a while (``limited:quarantined``; the reason in ``fogline status``).
Within budget, births, deaths, acks and the states a device needs to stay
alive go in each shard's live lane, which is always drained before the bulk lane
(a device's states beyond its liveness share).

A device's results (``reply/{fog}/{device}``, ``admit_result``) are charged to the
same sender, under their own budget: a device replaying a result is throttled
and then quarantined like one replaying its adverts, and its results never
take its (or anyone's) liveness share. Every budget is keyed by the device id
the topic carries, which the broker's ACL lets only that device write.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime import codec
from runtime.errors import DecodeError, OutOfRange, RemoteViolation, SecurityError
from runtime.messages import (
    CommandAck,
    DeviceBirth,
    DeviceDeath,
    DeviceState,
    Envelope,
)
from runtime.mqtt import Inbound
from runtime.security import (
    BAD_SIGNATURE,
    MALFORMED,
    NO_SESSION,
    OUTSIDE_WINDOW,
    OVERSIZED,
    REPLAYED,
    SessionKeyPair,
    TrustStore,
    Verifier,
)
from runtime.topics import ACK, BIRTH, DEATH, STATE, parse

from ._verify_pool import looks_mac, open_session
from .ratelimit import LIVE, OVER, QUARANTINED, Budget, FairShare, LogLimit, SharePolicy
from .site_core import Ack, Advert, AdvertRejected, ClaimFlags, Event, SessionMissing
from .trust import bound_birth

__all__ = ["DEVICE_SHARE", "FAILED", "RESULT", "STOP", "Heard", "HeardBatch", "Ingest"]

log = logging.getLogger("fog_broker.ingest")

STOP = object()


@dataclass(frozen=True, slots=True)
class Heard:
    """A verified device input for the site core and when it arrived (monotonic, the MQTT worker's)."""
    event: Event
    at: float


@dataclass(frozen=True, slots=True)
class HeardBatch:
    """One shard's verified inputs, in the order they arrived: the owner thread's liveness lane."""
    items: tuple[Heard, ...]


Out = list[Heard]

RESULT = "RESULT"  # a hop's answer on reply/{fog}/{device} (the data plane)

# Per device: an agent sends a state per interval (>= 0.5 s) or on a significant change, a birth
# per connection or rebirth request, one death, an ack per command, a result per request it ends.
# The budgets are several times that; the live share (4 states/s, bursts of 10) covers every
# honest device, and a device past a budget is only throttled. 100 failed checks within 10 s
# (an honest device fails none, bar a few QoS 1 duplicates after a reconnect) quarantine it.
DEVICE_SHARE = SharePolicy(
    limits={BIRTH: Budget(2.0, 10.0), DEATH: Budget(2.0, 10.0), STATE: Budget(20.0, 50.0),
            ACK: Budget(100.0, 500.0), RESULT: Budget(1000.0, 2000.0)},
    live={STATE: Budget(4.0, 10.0)},
    quarantine_failures=100, window_s=10.0, quarantine_s=60.0)
# Check failures that only a sender breaking the protocol produces: these count towards its
# quarantine. Not a clock outside the window or a session the fog lost (an honest device after a
# restart of either side: it is asked for a rebirth), nor a stale epoch (its frames still in flight).
FAILED = frozenset({BAD_SIGNATURE, MALFORMED, OVERSIZED, REPLAYED, "topic mismatch", "wrong kind",
                    "key mismatch"})
_BULK_POLL_S = 0.05  # an idle shard looks at its bulk lane this often


class _Lanes:
    """A shard's intake: two bounded FIFO lanes; ``take`` drains the live lane before the bulk one.

    One taker. The live lane is a ``queue.SimpleQueue`` (C: the common case costs the MQTT worker
    next to nothing) and the taker sleeps on it; bulk items wait at most ``_BULK_POLL_S`` more.
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._live: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._bulk: deque[Any] = deque()

    def put(self, item: Any, live: bool = True, force: bool = False) -> bool:
        """Queue ``item``; False (not queued) when its lane is full, unless ``force``."""
        if live:
            if self._live.qsize() >= self.maxsize and not force:
                return False
            self._live.put(item)
            return True
        if len(self._bulk) >= self.maxsize and not force:
            return False
        self._bulk.append(item)
        return True

    def __len__(self) -> int:
        return self._live.qsize() + len(self._bulk)

    def take(self, n: int) -> list[Any]:
        """Up to ``n`` items (at least one), live ones first; blocks until there is one."""
        live, bulk = self._live, self._bulk
        out: list[Any] = []
        while not out:
            if not bulk:
                try:
                    out.append(live.get(timeout=_BULK_POLL_S))
                except queue.Empty:
                    continue
            while len(out) < n and not live.empty():  # the one taker: not empty -> get_nowait succeeds
                out.append(live.get_nowait())
            while len(out) < n and bulk:
                out.append(bulk.popleft())
        return out


@dataclass
class _Shard:
    """One verify shard: its lanes, its verifier (threads) or worker process, its own counters."""

    lanes: _Lanes
    verifier: Verifier
    worker: Any = None
    counters: Counter[str] = field(default_factory=Counter)
    logs: LogLimit = field(default_factory=LogLimit)  # the shard thread's lines about refused frames
    accepted: int = 0
    sent_keys: dict[str, bytes] = field(default_factory=dict)  # keys the worker process holds


class Ingest:
    """The verify shards; ``on_device`` is the MQTT handler, ``emit`` receives verified batches."""

    def __init__(self, trust: TrustStore, session: SessionKeyPair, emit: Callable[[Any], None], *,
                 shards: int = 2, processes: bool = False, max_advert_bytes: int = 64 * 1024,
                 share: SharePolicy | None = DEVICE_SHARE) -> None:
        self.trust = trust
        self.session = session
        self.emit = emit
        self.max_advert_bytes = max_advert_bytes
        self.counters: Counter[str] = Counter()  # MQTT worker thread only
        self.share = FairShare(share) if share is not None else None  # None: no limits (benchmarks)
        # (device, kind) of frames that failed a check on a shard thread: charged on the MQTT worker
        self._failed: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._logs = LogLimit()  # MQTT worker: lines about dropped floods, per device
        self._shards = [_Shard(_Lanes(100_000),
                               Verifier(trust, sessions=True, max_size=max_advert_bytes))
                        for _ in range(max(1, shards))]
        if processes:
            from ._verify_pool import VerifyWorker
            for sh in self._shards:
                sh.worker = VerifyWorker({}, max_size=max_advert_bytes)

    def start(self) -> None:
        for i, shard in enumerate(self._shards):
            threading.Thread(target=self._loop, args=(shard,), name=f"fog-verify-{i}", daemon=True).start()

    def stop(self) -> None:
        for shard in self._shards:
            shard.lanes.put(STOP, force=True)

    def forget(self, device_id: str) -> None:
        """A revoked device: drop its session and replay window (its key is gone from ``trust``)."""
        for sh in self._shards:
            sh.lanes.put(("forget", device_id), force=True)
        if self.share is not None:
            self.share.forget(device_id)  # one atomic dict pop; admit runs on the MQTT worker

    # ------------------------------------------------------------ MQTT worker thread

    def on_device(self, m: Inbound) -> None:
        """Route a device message to its shard; strangers, oversized frames and floods stop here."""
        try:
            pt = parse(m.topic)
        except RemoteViolation:
            self.counters["rejected:bad topic"] += 1
            return
        if len(m.payload) > self.max_advert_bytes:
            self.counters["rejected:oversized"] += 1
            return
        if pt.name not in self.trust:
            self.counters["rejected:unknown sender"] += 1
            return
        if not self._failed.empty():
            self._charge_failed(m.received_at)
        lane = LIVE if self.share is None else self.share.admit(pt.name, pt.leaf, m.received_at)
        if lane in (OVER, QUARANTINED):
            self._limited(pt.name, pt.leaf, lane, m.received_at)
            return
        shard = self._shards[hash(pt.name) % len(self._shards)]
        if not shard.lanes.put((m, pt), lane == LIVE):
            self.counters["verify_overflow"] += 1

    def admit_result(self, device_id: str, now: float) -> bool:
        """MQTT worker, before any decode: may a result on ``device_id``'s topic be queued?"""
        if device_id not in self.trust:
            self.counters["rejected:unknown sender"] += 1
            return False
        if not self._failed.empty():
            self._charge_failed(now)
        verdict = LIVE if self.share is None else self.share.admit(device_id, RESULT, now)
        if verdict in (OVER, QUARANTINED):
            self._limited(device_id, RESULT, verdict, now)
            return False
        return True

    def charge(self, device_id: str, kind: str, now: float, why: str = "") -> None:
        """MQTT worker: a bad ``kind`` frame on ``device_id``'s topic (``why``: signed by someone else, a
        replayed copy; "": refused after its check), counted against ``device_id`` (who the broker
        authenticated) as a drop; the unchecked ones are counted and logged rate-limited."""
        if self.share is not None and device_id in self.trust:
            self.share.charge(device_id, kind, now)
        if not why:
            return
        self.counters[f"rejected:{why}"] += 1
        if self._logs.allow(device_id, now):
            held = self._logs.suppressed(device_id)
            log.warning("%s: %s dropped unchecked: %s%s", device_id, kind, why,
                        f" ({held} more since the last line)" if held else "")

    def _charge_failed(self, now: float) -> None:
        """MQTT worker: charge the shards' failed checks to their senders (the one taker)."""
        while not self._failed.empty():
            device_id, kind = self._failed.get_nowait()
            if self.share is not None and device_id in self.trust:
                self.share.charge(device_id, kind, now)

    def _fail(self, shard: _Shard, pt: Any, reason: str) -> None:
        """A shard thread: one frame on ``pt.name``'s topic failed its check (counted; charged when
        only a sender breaking the protocol fails it that way)."""
        shard.counters[f"rejected:{reason}"] += 1
        if reason in FAILED and self.share is not None:
            self._failed.put((pt.name, pt.leaf))

    def _limited(self, device_id: str, kind: str, verdict: str, now: float) -> None:
        self.counters[f"limited:{kind}" if verdict == OVER else "limited:quarantined"] += 1
        if self._logs.allow(device_id, now):
            held = self._logs.suppressed(device_id)
            log.warning("%s: %s %s, dropped unchecked%s", device_id, kind, verdict,
                        f" ({held} more since the last line)" if held else "")

    # ------------------------------------------------------------ shard threads

    def _loop(self, shard: _Shard) -> None:
        while True:
            batch = shard.lanes.take(512)
            stop = STOP in batch
            work = []
            for it in batch:
                if it is STOP:
                    continue
                if it[0] == "forget":
                    shard.verifier.forget(it[1])
                    shard.verifier.drop_session(it[1])
                    shard.sent_keys.pop(it[1], None)
                    continue
                work.append(it)
            out: Out = []
            try:
                if shard.worker is not None:
                    self._remote(shard, work, out)
                else:
                    for m, pt in work:
                        self._local(shard, m, pt, out)
            except Exception:
                shard.counters["internal_errors"] += 1
                log.exception("ingest failed for a batch of %d", len(work))
            if out:
                self.emit(HeardBatch(tuple(out)))
            if stop:
                if shard.worker is not None:
                    shard.worker.close()
                return

    def _death(self, shard: _Shard, m: Inbound, pt: Any, out: Out) -> None:
        """A device's Will: signed when it connected, so only the signature and the epoch count."""
        try:
            env = codec.decode(m.payload, max_size=self.max_advert_bytes)
            if not isinstance(env, Envelope):
                raise DecodeError("a death must be a signed envelope")
            msg = shard.verifier.verify_only(env)
        except (DecodeError, SecurityError) as exc:
            self._fail(shard, pt, getattr(exc, "reason", MALFORMED))
            log.debug("bad death on %s: %s", m.topic, exc)
            return
        if not isinstance(msg, DeviceDeath) or msg.device_id != pt.name or env.sender != pt.name:
            self._fail(shard, pt, "topic mismatch")
            return
        shard.counters["in:DEATH"] += 1
        out.append(Heard(Advert(msg), m.received_at))

    def _accept(self, shard: _Shard, m: Inbound, pt: Any, sender: str, msg: Any, out: Out) -> None:
        """Checks after a valid signature: topic, sender and kind agree; a birth carries the pinned key."""
        device_id = getattr(msg, "device_id", None)
        if sender != pt.name or device_id != pt.name:
            self._fail(shard, pt, "topic mismatch")
            if shard.logs.allow(pt.name, m.received_at):
                log.warning("%s: sender %r / device %r do not match the topic", m.topic, sender, device_id)
            return
        if pt.leaf == BIRTH and isinstance(msg, DeviceBirth):
            if msg.public_key != self.trust.key_bytes(pt.name):
                self._fail(shard, pt, "key mismatch")
                if shard.logs.allow(pt.name, m.received_at):
                    log.warning("%s: birth announces a key other than the enrolled one; refused", pt.name)
                return
            msg, flags = bound_birth(msg)
            if flags:
                shard.counters["flagged:capacity"] += 1
                log.warning("%s: birth claims out of bounds (%s); clamped", pt.name, ", ".join(flags))
            # every birth: a clean one clears earlier flags
            out.append(Heard(ClaimFlags(pt.name, tuple(flags)), m.received_at))
        elif not ((pt.leaf == STATE and isinstance(msg, DeviceState))
                  or (pt.leaf == ACK and isinstance(msg, CommandAck))):
            self._fail(shard, pt, "wrong kind")
            return
        shard.counters[f"in:{pt.leaf}"] += 1
        out.append(Heard(Ack(msg.device_id, msg.command_id, msg.ok, msg.reason) if pt.leaf == ACK
                         else Advert(msg), m.received_at))

    def _rejected(self, shard: _Shard, m: Inbound, pt: Any, reason: str, detail: str, out: Out,
                  bad: OutOfRange | None = None) -> None:
        """``bad``: the one figure a signed payload was refused for (``SecurityError.out_of_range``)."""
        if bad is not None and pt.leaf in (BIRTH, STATE):
            # Signed by the device itself (only a payload is decoded after its signature): its own
            # advert carries a figure outside runtime.messages' ranges. The device is shown as
            # rejected with the field and value and holds nothing until a clean birth.
            shard.counters["rejected:out of range"] += 1
            if shard.logs.allow(pt.name, m.received_at):
                log.warning("%s: %s refused, %s=%r out of range", pt.name, bad.owner, bad.field, bad.value)
            out.append(Heard(AdvertRejected(pt.name, f"{bad.owner}.{bad.field}", repr(bad.value)), m.received_at))
            return
        self._fail(shard, pt, reason)
        log.debug("rejected %s: %s", m.topic, detail)
        if (reason == NO_SESSION and pt.leaf != BIRTH) or reason == OUTSIDE_WINDOW:
            # an enrolled device we lost the session of, or whose clock is off (it corrects it from
            # our time hints): ask for a fresh birth, rate-limited by the registry and the service
            out.append(Heard(SessionMissing(pt.name), m.received_at))

    def _local(self, shard: _Shard, m: Inbound, pt: Any, out: Out) -> None:
        if pt.leaf == DEATH:
            self._death(shard, m, pt, out)
            return
        self._open_here(shard, m, pt, time.time(), out)

    def _open_here(self, shard: _Shard, m: Inbound, pt: Any, wall: float, out: Out) -> None:
        """Full check in this thread: signature or session MAC, timestamp, replay window, decode."""
        try:
            env, msg = shard.verifier.open(m.payload, wall)
        except SecurityError as exc:
            self._rejected(shard, m, pt, exc.reason, str(exc), out, exc.out_of_range)
            return
        self._verified(shard, m, pt, env, msg, out)

    def _verified(self, shard: _Shard, m: Inbound, pt: Any, env: Envelope, msg: Any, out: Out) -> None:
        if pt.leaf == BIRTH:
            note = open_session(shard.verifier, self.session, env, msg)
            if note:
                shard.counters[note] += 1
        self._accept(shard, m, pt, env.sender, msg, out)

    def _remote(self, shard: _Shard, batch: list[tuple[Inbound, Any]], out: Out) -> None:
        """Stateless checks (Ed25519 or session MAC, then decode) in the worker; stateful ones here.

        The batch goes to the worker in one message; results are admitted (timestamp, replay
        window) here in arrival order, and births (re)key sessions here, so each device's window
        and session key live in exactly one place and its order is kept.
        """
        assert shard.worker is not None
        items: list[tuple[Any, ...]] = []
        plan: list[tuple[Inbound, Any, float, bool]] = []
        rekeyed: set[str] = set()  # devices with a birth earlier in this batch: their session may change
        for m, pt in batch:
            if pt.leaf == DEATH:
                self._death(shard, m, pt, out)
                continue
            key = self.trust.key_bytes(pt.name)
            if key is None:  # revoked since it was routed here
                shard.counters["rejected:unknown sender"] += 1
                continue
            if shard.sent_keys.get(pt.name) != key:
                items.append(("enroll", pt.name, key))
                shard.sent_keys[pt.name] = key
            wall = time.time()
            remote = True
            if not looks_mac(m.payload):  # a routing hint only: a frame that lies fails either way
                items.append(("verify", m.payload))
            elif pt.name not in rekeyed and (sess := shard.verifier.session(pt.name)) is not None:
                items.append(("mac", m.payload, pt.name, sess[0], sess[1]))
            else:
                remote = False  # no session (or a birth before it in this batch): checked here, in order
            if pt.leaf == BIRTH:
                rekeyed.add(pt.name)
            plan.append((m, pt, wall, remote))
        results = iter(shard.worker.run(items) if items else ())
        for m, pt, wall, remote in plan:
            if not remote:
                self._open_here(shard, m, pt, wall, out)
                continue
            r = next(results)
            if r[0] != "ok":
                self._rejected(shard, m, pt, r[1], r[2], out, r[3])
                continue
            env, msg = r[1], r[2]
            try:
                shard.verifier.admit(env, wall)
            except SecurityError as exc:
                self._rejected(shard, m, pt, exc.reason, str(exc), out, exc.out_of_range)
                continue
            shard.accepted += 1
            self._verified(shard, m, pt, env, msg, out)

    # ------------------------------------------------------------ counters (any thread)

    def verified(self) -> int:
        return sum(sh.verifier.accepted + sh.accepted for sh in self._shards)

    def rejections(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for c in [self.counters] + [sh.counters for sh in self._shards]:
            total.update({k[len("rejected:"):]: v for k, v in c.items() if k.startswith("rejected:")})
        return total

    def limits(self, now: float) -> dict[str, Any]:
        """Senders quarantined (and why) and the top senders by drops, for ``fogline status``."""
        return self.share.view(now) if self.share is not None else {}

    def shut_out(self, now: float) -> frozenset[str]:
        return self.share.shut_out(now) if self.share is not None else frozenset()

    def counts(self) -> Counter[str]:
        """Per-shard counters summed (each shard counts alone: no lost updates between threads)."""
        total: Counter[str] = Counter(self.counters)
        for sh in self._shards:
            total.update(sh.counters)
        return total
