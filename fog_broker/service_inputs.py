"""How inputs reach the fog's owner thread (``service.FogService``): its inbox and lanes, and the gate.

Inputs name their sender in the topic (``fog/CTL/{id}``, ``fog/INFER/{id}``, ``reply/{fog}/{device}``,
``cloud/RELEASE/{id}``)
and the broker's ACL lets only that identity write there; on the MQTT worker each input is charged
to that id's budget before any decode or signature check (``control``, ``ingest``), a payload signed
by anyone else is dropped and charged to the topic's id, and the decoded rest is queued for the
owner, which authenticates it. The owner takes the devices' verified liveness traffic from its own
lane ahead of control, and control ahead of the inbox (inference, results, releases, jobs).
"""
from __future__ import annotations

import logging
import queue
from typing import TYPE_CHECKING, Any

from runtime import codec
from runtime.errors import DecodeError
from runtime.mqtt import Inbound
from runtime.topics import CTL, INFER, RELEASE

from .ingest import RESULT
from .ratelimit import Copies
from .service_config import MAX_CONTROL_BYTES, WAKE, Other

if TYPE_CHECKING:
    from .service import FogService

__all__ = ["InputGate"]

log = logging.getLogger("fog_broker.service")


class InputGate:
    """The owner's inbox and its two lanes ahead of it, and the MQTT worker's checks before them."""

    def __init__(self, svc: FogService) -> None:
        self.svc = svc
        self.inbox: queue.Queue[Any] = queue.Queue(maxsize=200_000)
        # The devices' verified liveness traffic (adverts, births, deaths, acks): taken ahead of the
        # inbox, so a queue of control, inference or results never delays a device's states.
        self.live: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Control requests (status, deploy): taken ahead of the inbox too, after the devices' traffic.
        self.control_lane: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Inputs the owner thread refused after their check (bad signature, replayed, no right):
        # charged to their topic's sender by the MQTT worker, which owns the budgets.
        self._charges: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        # MQTT worker: a second copy of a signed input is dropped unchecked (the last 128 per known sender)
        self._copies = Copies(per_sender=128, max_senders=4096)
        t, fog_id = svc.topics, svc.config.fog_id
        self._prefix_ctl = t.control("+")[:-2]
        self._prefix_infer = t.infer("+")[:-2]
        self._prefix_result = t.result(fog_id, "+")[:-2]
        self._prefix_release = t.release("+")[:-2]

    # ------------------------------------------------------------ into the owner's queues (any thread)

    def put(self, item: Any) -> None:
        try:
            self.inbox.put_nowait(item)
        except queue.Full:
            self.svc.counters["inbox_overflow"] += 1

    def wake(self) -> None:
        """Tell the owner, blocked on the inbox, that a lane or a snapshot request waits."""
        try:
            self.inbox.put_nowait(WAKE)
        except queue.Full:
            pass  # the owner is busy and looks at the lanes between items

    def put_live(self, item: Any) -> None:
        """Verified device traffic (ingest's batches): the owner takes it ahead of the inbox (any thread).

        Bounded by the devices' budgets upstream (``ingest.DEVICE_SHARE``); the wake-up is dropped
        when the inbox is full, as then the owner is busy and looks at this lane between items."""
        if self.live.qsize() >= 200_000:
            self.svc.counters["live_overflow"] += 1
            return
        self.live.put(item)
        self.wake()

    def put_control(self, item: Other) -> None:
        """A control request: the owner takes it ahead of the inbox (MQTT worker). Bounded by the
        senders' control budgets upstream (``control.CONTROL_SHARE``)."""
        self.control_lane.put(item)
        self.wake()

    def next_item(self) -> Any:
        """Owner thread: the inbox's next item, or None."""
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    # ------------------------------------------------------------ MQTT worker thread

    def _sender_of(self, topic: str) -> tuple[str, str]:
        """(kind, sender) of an input topic: the id is the topic's last level, which the ACL lets only
        that identity write; ("", "") for a topic that is not one of ours (the broker would not send it)."""
        base, _, sender = topic.rpartition("/")
        if base == self._prefix_ctl:
            return CTL, sender
        if base == self._prefix_infer:
            return INFER, sender
        if base == self._prefix_result:
            return RESULT, sender
        if base == self._prefix_release:
            return RELEASE, sender
        return "", ""

    def on_other(self, m: Inbound) -> None:
        """Control, releases, inference requests and results: charged to the topic's sender and decoded
        under tight budgets here, authenticated on the owner thread (which holds the keys and windows)."""
        svc = self.svc
        topic = m.topic
        while not self._charges.empty():  # the one taker: not empty -> get_nowait succeeds
            self._charge(*self._charges.get_nowait(), m.received_at)
        kind, sender = self._sender_of(topic)
        if kind == RELEASE and m.retain:
            # releases are never retained: a retained one would come back at every restart
            svc.counters["release:retained"] += 1
            if m.payload:
                svc.mqtt.publish(topic, b"", retain=True)  # clear it
            return
        if kind in (CTL, INFER, RELEASE):
            if not svc.control.admit(sender, kind, m.received_at):
                return  # over its sender's budget: dropped before decode and signature check (control.py)
        elif kind == RESULT:
            if sender != svc.config.fog_id and not svc.ingest.admit_result(sender, m.received_at):
                return  # an unknown device, or over its budget (ingest.py)
        else:
            svc.counters["rejected:bad topic"] += 1
            return
        try:
            if kind == RELEASE:
                msg: Any = codec.decode(m.payload, max_size=MAX_CONTROL_BYTES, max_objects=4096, max_arrays=0)
            else:
                msg = codec.decode_envelope(m.payload, max_size=MAX_CONTROL_BYTES if kind == CTL
                                            else codec.DEFAULT_MAX_SIZE)
        except DecodeError as exc:
            why = "unsigned" if str(exc).startswith("expected an envelope") else "malformed"
            svc.counters[f"rejected:{why}"] += 1
            self._charge(kind, sender, m.received_at)  # a failed check: counts towards a quarantine
            log.debug("%s payload on %s: %s", why, topic, exc)
            return
        if kind != RELEASE and msg.sender != sender:
            # signed (or claiming to be) by someone other than who the broker let write this topic
            self._charge(kind, sender, m.received_at, "signer not topic")
            return
        if kind != RELEASE and sender != svc.config.fog_id and self._known(kind, sender) \
                and self._copies.seen(sender, msg.signature):
            self._charge(kind, sender, m.received_at, "replayed copy")  # a replay, however slow: no second check
            return
        if kind == CTL and svc.config.control_lane:
            self.put_control(Other(kind, msg, m.received_at))
            return
        self.put(Other(kind, msg, m.received_at, sender))

    def _known(self, kind: str, sender: str) -> bool:
        """An identity the fog issued or enrolled (only those get a memory of copies: bounded)."""
        return sender in (self.svc.device_keys if kind == RESULT else self.svc.control.keys)

    def _charge(self, kind: str, sender: str, now: float, why: str = "") -> None:
        """MQTT worker: one bad input on ``sender``'s topic, counted against ``sender`` as a drop."""
        if kind == RESULT:
            self.svc.ingest.charge(sender, kind, now, why)
        else:
            self.svc.control.charge(sender, kind, now, why)

    def refused(self, kind: str, sender: str) -> None:
        """Owner thread: an input on ``sender``'s topic failed its check; charge it (MQTT worker)."""
        self._charges.put((kind, sender))
