"""The agent's receive side: every sealed thing it is sent is opened here against the pinned fog key.

Fog STATE, commands and time hints (agent loop) and activation frames (network and executor
threads) each pass one check here before the agent acts on them; the fog's clock, learned from
sealed time hints, is the one these checks (and the agent's seals) use. Separate from the agent
shell so the shell keeps the connection, adverts and commands (issue 31).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from runtime import codec, relay
from runtime.errors import DecodeError, RemoteViolation
from runtime.messages import Activation, Envelope, FogState, Message, TimeHint
from runtime.mqtt import Inbound
from runtime.ratelimit import OVER, QUARANTINED, Budget, FairShare, LogLimit, SharePolicy
from runtime.security import TrustStore, Verifier
from runtime.topics import ACT

__all__ = ["ACTIVATION_SHARE", "InboundGate"]

log = logging.getLogger("edge_agent.agent")  # the agent's lines, as before the split

# Per sending device: a request crosses each cut once, so an honest neighbour sends at most our
# serving rate; well above any device's. Past it frames are dropped before any check (throttled
# only); a sender with 100 frames failing their checks (forged, replayed) within 10 s is shut out
# for 60 s (the fog also sees it quarantined when it floods the fog; here only its frames to us stop).
ACTIVATION_SHARE = SharePolicy(limits={ACT: Budget(500.0, 1000.0)}, quarantine_failures=100, window_s=10.0,
                               quarantine_s=60.0, max_identities=4096)

_MAX_FOG_NAMES = 8
_SKEW_APPLY_S = 10.0  # smaller differences are delivery delays and NTP noise: our clock stands


class InboundGate:
    def __init__(self, device_id: str, fog_key: bytes, trust: TrustStore, verifier: Verifier, *,
                 max_bytes: int, fog_name: Callable[[], str | None], count: Callable[[str], None],
                 submit: Callable[[Inbound], None]) -> None:
        self.device_id = device_id
        self.fog_key = fog_key
        self.trust = trust
        self.verifier = verifier
        self.max_bytes = max_bytes
        self._fog_name = fog_name
        self._count = count
        self._submit = submit  # the executor takes admitted frames unopened
        # Activations per sending device (the topic's id): one device replaying or forging frames at us
        # is dropped unchecked over its budget and then shut out for a while; others are unaffected.
        self._act_share = FairShare(ACTIVATION_SHARE)  # under _act_lock: network and executor threads
        self._act_lock = threading.Lock()
        self._act_logs = LogLimit()  # under _act_lock too (network and executor threads)
        # Replayed activation frames (same ticket and hop) are dropped; bounded memory.
        self._seen_frames: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._frames_lock = threading.Lock()
        # Fog clock minus ours, from sealed time hints: applied to every freshness check and seal
        # once it passes _SKEW_APPLY_S (a Pi without an RTC boots in the past).
        self.clock_skew = 0.0
        self.measured_skew: float | None = None
        self._skew_samples: collections.deque[float] = collections.deque(maxlen=8)

    def wall(self) -> float:
        """Wall-clock seconds as the fog counts them (our clock plus the applied skew)."""
        return time.time() + self.clock_skew

    # ------------------------------------------------------------ activations (network, executor threads)

    def on_activation(self, m: Inbound) -> None:
        """A data-plane frame (paho's network thread): charged, then handed to the executor unopened.

        Charged first to the device the topic names (no decode, no signature check over its
        budget); the checks (``open_activation``) run on the executor's thread, so the network
        thread only reads and one thread wake-up per hop is saved (issue 32). The fog's own frames
        (hop 0) are not limited."""
        src = m.topic.rpartition("/")[2]
        if src != self._fog_name():
            with self._act_lock:
                verdict = self._act_share.admit(src, ACT, m.received_at)
            if verdict in (OVER, QUARANTINED):
                self._count(f"limited activation: {verdict}")
                self._act_warn(src, m.received_at, f"activations from {src} {verdict}: dropped unchecked")
                return
        self._submit(m)

    def open_activation(self, m: Inbound) -> Activation | None:
        """Check a frame (executor thread): fog-signed route, sealed by the previous hop, not replayed
        (``runtime.relay``). A frame that fails its checks is charged to the device the topic names,
        so a device that keeps sending bad or replayed frames is shut out."""
        src = m.topic.rpartition("/")[2]
        now = m.received_at
        limited = src != self._fog_name()
        try:
            act = relay.open_relay(m.payload, self.fog_key, self.device_id, self.wall(),
                                   max_size=self.max_bytes, sender=src)
        except RemoteViolation as exc:
            self._count(f"rejected activation: {getattr(exc, 'reason', 'malformed')}")
            if limited:
                with self._act_lock:
                    self._act_share.charge(src, ACT, now)
            self._act_warn(src, now, f"activation from {src} refused: {exc}")
            return None
        tag = act.ticket_sig + act.hop.to_bytes(4, "little")
        with self._frames_lock:
            if tag in self._seen_frames:
                replayed = True
            else:
                replayed = False
                self._seen_frames[tag] = None
                if len(self._seen_frames) > 4096:
                    self._seen_frames.popitem(last=False)
        if replayed:
            self._count("rejected activation: replayed")
            if limited:
                with self._act_lock:
                    self._act_share.charge(src, ACT, now)
            return None
        return act

    def _act_warn(self, src: str, now: float, text: str) -> None:
        """At most about a line a second per sending device (network and executor threads)."""
        with self._act_lock:
            if not self._act_logs.allow(src, now):
                return
            held = self._act_logs.suppressed(src)
        log.warning("%s: %s%s", self.device_id, text, f" ({held} more since the last line)" if held else "")

    # ------------------------------------------------------------ control messages (agent loop)

    def time_hint(self, payload: bytes) -> bool:
        """A sealed ``TimeHint``: forward-only in the fog's (epoch, seq), so an old one cannot be replayed.

        True when the applied clock correction changed (a birth sealed with the old clock may
        have been refused)."""
        env = self._trust_sender(payload) if len(payload) <= 4096 else None
        if env is None:
            self._count("rejected time hint: unsigned")
            return False
        try:
            hint = self.verifier.verify_only(env)
            if not isinstance(hint, TimeHint):
                raise RemoteViolation("not a time hint")
            self.verifier.admit_sequence(env)  # shares the commands' persisted replay window
        except RemoteViolation as exc:
            self._count(f"rejected time hint: {getattr(exc, 'reason', 'malformed')}")
            return False
        # hint.wall - our clock = true skew - delivery delay, so each sample is a lower bound: the
        # largest recent one is the least delayed. Small skews are noise next to a busy broker's
        # delays and harmless next to the +-30 s freshness window; a clock without an RTC is off by
        # hours, and only that is corrected.
        self._skew_samples.append(hint.wall - time.time())
        self.measured_skew = max(self._skew_samples)
        applied = self.measured_skew if abs(self.measured_skew) > _SKEW_APPLY_S else 0.0
        if abs(applied - self.clock_skew) > _SKEW_APPLY_S / 2:
            log.warning("%s: our clock is %+.1f s off the fog's; correcting timestamps by it", self.device_id,
                        -self.measured_skew)
            self.clock_skew = applied
            return True
        return False

    def _trust_sender(self, payload: bytes) -> Envelope | None:
        """The envelope in ``payload``, its sender bound to the pinned fog key (None: not an envelope).

        The fog's key is pinned; its signing name is whatever its envelopes say, so names are
        enrolled with that key on sight (bounded: junk names cannot grow the store).
        """
        try:
            env = codec.decode_envelope(payload, max_size=self.max_bytes)  # nothing trusted yet
        except DecodeError:
            return None
        if env.sender not in self.trust and len(self.trust) < _MAX_FOG_NAMES:
            try:
                self.trust.enroll(env.sender, self.fog_key)
            except RemoteViolation:
                return None
        return env

    def open_fog_state(self, payload: bytes) -> FogState | None:
        """Check a retained fog STATE: an envelope sealed by the pinned key (no freshness); count and drop others."""
        if len(payload) > self.max_bytes:
            self._count("rejected fog state: oversized")
            return None
        env = self._trust_sender(payload)
        if env is None:
            self._count("rejected fog state: unsigned")
            log.warning("%s: ignoring a fog STATE that is not sealed by the fog", self.device_id)
            return None
        try:
            msg = self.verifier.verify_only(env)
        except RemoteViolation as exc:
            self._count(f"rejected fog state: {getattr(exc, 'reason', 'malformed')}")
            log.warning("%s: ignoring fog STATE: %s", self.device_id, exc)
            return None
        if not isinstance(msg, FogState):
            self._count("rejected fog state: not a fog state")
            return None
        return msg

    def open_command(self, payload: bytes) -> Message | None:
        """Verify a signed command envelope against the pinned fog key; count and drop failures."""
        env = self._trust_sender(payload) if len(payload) <= self.max_bytes else None
        try:
            if env is not None:
                msg = self.verifier.check(env, self.wall())  # decoded once (deploys carry artifacts)
            else:
                _, msg = self.verifier.open(payload, self.wall())  # counts oversized / malformed
        except RemoteViolation as exc:
            reason = getattr(exc, "reason", "malformed")
            self._count(f"rejected: {reason}")
            log.warning("%s: command rejected: %s", self.device_id, exc)
            return None
        return msg
