"""Authenticated activations: a fog-signed route ticket, and each hop's signature over what it sends.

The data plane carries inference inputs between devices. Every ``Relay`` frame
holds the ``RouteTicket`` the fog signed for the attempt (which devices, in
which order, with which keys), the tensors, and the sender's signature over
both. A device accepts a frame only when

1. the ticket carries the pinned fog key's signature,
2. the frame is for one of its own hops, and
3. it is signed by the hop before it in that ticket (hop 0: by the fog, or its tensors are
   the ones whose SHA-256 the fog-signed ticket names: one signature for the ticket and hop 0),

and it decodes the tensors only after all three hold. So no enrolled device can
inject work into another's partition or forge an answer unless it is the
previous hop of a route the fog issued. Replays die at the ticket's deadline.

Pure: no I/O, no clock (``now`` is a parameter); ``RelayError`` reasons are fixed
phrases for counters.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import struct
from dataclasses import replace

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from . import codec
from .errors import DecodeError, SecurityError
from .messages import Activation, InferenceResult, Relay, RouteTicket, Tensors
from .verify import KeyPair, Signer

__all__ = ["RelayError", "Sealer", "issue_ticket", "issue", "seal", "open_relay", "ticket_of"]

_TICKET_DOMAIN = b"fogline-route-v1\x00"
_RELAY_DOMAIN = b"fogline-relay-v2\x00"
_FRAME_OBJECTS = 64        # a Relay is [kind, version, {6 fields}]: 16 objects
_TICKET_OBJECTS = 8192     # 16 objects a hop: routes of several hundred hops at most
_LEN = struct.Struct("<Q")


class RelayError(SecurityError):
    """A frame refused on the data plane; ``reason`` is a fixed phrase."""


def _relay_bytes(hop: int, sender: str, ticket: bytes, ticket_sig: bytes, tensors: bytes) -> bytes:
    # The signature covers the tensors' SHA-256, not the tensors: Ed25519 hashes what it signs
    # twice with SHA-512 (and verifying once more), 15 ms to sign a 1.2 MB frame here against
    # 2 ms for one SHA-256 (SHA extensions); the digest binds the bytes as tightly.
    s = sender.encode()
    return b"".join((_RELAY_DOMAIN, _LEN.pack(hop), _LEN.pack(len(s)), s, _LEN.pack(len(ticket)), ticket,
                     ticket_sig, _LEN.pack(len(tensors)), hashlib.sha256(tensors).digest()))


def issue_ticket(fog: KeyPair, ticket: RouteTicket) -> tuple[bytes, bytes]:
    """Encode and sign a route ticket: (ticket bytes, fog signature)."""
    raw = codec.encode(ticket)
    return raw, fog.sign(_TICKET_DOMAIN + raw)


def issue(fog: KeyPair, ticket: RouteTicket, act: Activation) -> bytes:
    """Hop 0's frame for ``act`` under ``ticket``, with one signature: the ticket names the SHA-256 of
    the encoded tensors, so its signature vouches for both (half the Ed25519 work of a ticket plus
    a sealed frame, at the fog and at hop 0)."""
    tensors = codec.encode(Tensors(act.tensors))
    raw, sig = issue_ticket(fog, replace(ticket, inputs_sha256=hashlib.sha256(tensors).digest()))
    return codec.encode(Relay(0, fog.name, raw, sig, tensors, b""))


def seal(sender: KeyPair, act: Activation) -> bytes:
    """The wire frame carrying ``act`` to hop ``act.hop``, signed by ``sender``."""
    tensors = codec.encode(Tensors(act.tensors))
    sig = sender.sign(_relay_bytes(act.hop, sender.name, act.ticket, act.ticket_sig, tensors))
    return codec.encode(Relay(act.hop, sender.name, act.ticket, act.ticket_sig, tensors, sig))


@functools.lru_cache(maxsize=1024)
def _public_key(key: bytes) -> Ed25519PublicKey:
    """Loaded once per key: every frame is checked against a few (the fog's, the previous hop's)."""
    return Ed25519PublicKey.from_public_bytes(key)


def _verify(key: bytes, sig: bytes, data: bytes, reason: str) -> None:
    try:
        _public_key(bytes(key)).verify(sig, data)
    except (InvalidSignature, ValueError):
        raise RelayError(reason) from None


def ticket_of(ticket: bytes, ticket_sig: bytes, fog_key: bytes) -> RouteTicket:
    """The ticket, once its fog signature holds."""
    _verify(fog_key, ticket_sig, _TICKET_DOMAIN + ticket, "bad ticket signature")
    try:
        t = codec.decode(ticket, max_objects=_TICKET_OBJECTS, max_arrays=0)
    except DecodeError as exc:
        raise RelayError("malformed", str(exc)) from None
    if not isinstance(t, RouteTicket) or len(t.keys) != len(t.route):
        raise RelayError("malformed", "not a route ticket with one key per hop")
    return t


def open_relay(data: bytes | memoryview, fog_key: bytes, me: str, now: float, *,
               max_size: int = codec.DEFAULT_MAX_SIZE, max_skew_s: float = 30.0,
               sender: str | None = None) -> Activation:
    """Check a frame addressed to device ``me`` and return its activation (see the module doc).

    ``sender``: the id of the topic the frame came on (``dev/{me}/ACT/{sender}``, which the ACL
    lets only that identity write); a frame sealed by anyone else is refused before any signature check."""
    try:
        frame = codec.decode(data, max_size=max_size, max_objects=_FRAME_OBJECTS, max_arrays=0)
    except DecodeError as exc:
        raise RelayError("malformed", str(exc)) from None
    if not isinstance(frame, Relay):
        raise RelayError("malformed", f"expected a relay, got {frame.KIND}")
    if sender is not None and frame.sender != sender:
        raise RelayError("wrong sender", "not the topic's sender")
    t = ticket_of(frame.ticket, frame.ticket_sig, fog_key)
    if frame.hop >= len(t.route) or t.route[frame.hop].device_id != me:
        raise RelayError("not my hop")
    if frame.hop == 0:
        if frame.sender != t.fog_id:
            raise RelayError("wrong sender", "hop 0 comes from the fog")
        key = fog_key
    else:
        if frame.sender != t.route[frame.hop - 1].device_id:
            raise RelayError("wrong sender", "not the previous hop")
        key = t.keys[frame.hop - 1]
    if frame.hop == 0 and t.inputs_sha256:  # the fog's ticket signature covers these tensors (issue)
        if not hmac.compare_digest(hashlib.sha256(frame.tensors).digest(), t.inputs_sha256):
            raise RelayError("bad signature", "hop 0's tensors are not the ones the ticket names")
    else:
        _verify(key, frame.signature, _relay_bytes(frame.hop, frame.sender, frame.ticket, frame.ticket_sig,
                                                   frame.tensors), "bad signature")
    if t.deadline and now > t.deadline + max_skew_s:
        raise RelayError("expired")
    try:
        tensors = codec.decode(frame.tensors, max_size=max_size)
    except DecodeError as exc:
        raise RelayError("malformed", f"tensors: {exc}") from None
    if not isinstance(tensors, Tensors):
        raise RelayError("malformed", "tensors expected")
    return Activation(t.request_id, t.workload, t.route, frame.hop, t.reply_to, dict(tensors.tensors),
                      t.deadline, frame.ticket, frame.ticket_sig, t.keys)


class Sealer:
    """What one device sends on the data plane, sealed with its key.

    Forwarded activations become ``Relay`` frames; results (and hop errors) become envelopes the
    fog checks against the device's enrolled key and the attempt's route. ``result`` advances a
    sequence number, so it is not thread-safe: a caller with several workers (the executor)
    serialises its calls; ``relay`` keeps no state.
    """

    def __init__(self, identity: KeyPair) -> None:
        self.identity = identity
        self._signer = Signer(identity, 0)  # results are checked by signature and route, not by window

    def relay(self, act: Activation) -> bytes:
        return seal(self.identity, act)

    def result(self, res: InferenceResult, now: float) -> bytes:
        return self._signer.seal_bytes(res, now)
