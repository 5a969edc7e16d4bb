"""Signing and verifying: envelopes, replay windows, session MACs, artifact signatures (the pure core).

Nothing is trusted by default: a control message is accepted only as an
``Envelope`` from an enrolled sender, with a valid signature, a fresh
(epoch, seq) and a timestamp inside the window. Everything here is pure (time
is a parameter, keys are passed in, no files, no log, no entropy) so it can be
tested exhaustively and imported by other pure cores (``runtime.relay``,
``edge_agent.commands``); every rejection is a fixed reason phrase, counted.
``runtime.security`` is the adapter around it: key files, the persisted trust
store, the replay state file, fresh keys.

Order of work on untrusted bytes: decode the outer envelope under the tight
envelope budget (``codec.decode_envelope``), check the signature or MAC over
the raw payload bytes, and only then decode the payload.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from . import codec
from .errors import DecodeError, LocalViolation, OutOfRange, RemoteViolation, SecurityError
from .messages import Envelope, Message

__all__ = [
    "KeyPair", "fingerprint", "Signer", "TrustStore", "EnvelopeVerifier", "REASONS",
    "ArtifactSignature", "sign_artifact", "verify_artifact", "sha256_hex", "SecurityError",
    "derive_session_key", "mac_tag", "sign_session_offer", "verify_session_offer",
    "MAC_LEN", "MAC_KINDS", "NO_SESSION",
]

_ENV_DOMAIN = b"fogline-envelope-v2"
_ART_DOMAIN = b"fogline-artifact-v1"
_MAC_DOMAIN = b"fogline-envelope-mac-v1"
_OFFER_DOMAIN = b"fogline-fog-session-v1"
_SESSION_DOMAIN = b"fogline-session-v1"

# Fixed rejection phrases (counted; ids and numbers go in the error detail).
OVERSIZED = "oversized"
MALFORMED = "malformed"
UNKNOWN_SENDER = "unknown sender"
BAD_SIGNATURE = "bad signature"
STALE_EPOCH = "stale epoch"
REPLAYED = "replayed"
OUTSIDE_WINDOW = "timestamp outside window"
REASONS = (OVERSIZED, MALFORMED, UNKNOWN_SENDER, BAD_SIGNATURE, STALE_EPOCH, REPLAYED, OUTSIDE_WINDOW)
NO_SESSION = "no session"  # only from an EnvelopeVerifier(sessions=True): a MAC without a session key

# Session MACs (see docs/protocol.md, Trust): an envelope whose ``signature`` is MAC_LEN bytes
# carries an HMAC-SHA256 tag under the (sender, epoch) session key instead of an Ed25519
# signature (always 64 bytes). Only these payload kinds may be MAC-authenticated; births, acks
# and commands are always Ed25519-signed.
MAC_LEN = 32
MAC_KINDS = frozenset({"dev.state"})

_I = TypeVar("_I", bound="KeyPair")


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(public_key: bytes) -> str:
    """Short human-comparable fingerprint of a public key (SSH style)."""
    digest = hashlib.sha256(public_key).hexdigest()[:32]
    return ":".join(digest[i:i + 4] for i in range(0, 32, 4))


class KeyPair:
    """A named Ed25519 key pair (``runtime.security.Identity`` adds key files and fresh keys)."""

    __slots__ = ("_key", "name", "public_key_bytes")

    def __init__(self, name: str, key: Ed25519PrivateKey) -> None:
        self.name = name
        self._key = key
        self.public_key_bytes = key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def from_seed(cls: type[_I], name: str, seed: bytes) -> _I:
        """Deterministic identity from a 32-byte seed (simulations and tests)."""
        return cls(name, Ed25519PrivateKey.from_private_bytes(hashlib.sha256(seed).digest()))

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key_bytes)


def _signed_bytes(*fields: Any) -> bytes:
    """The bytes a signature (or MAC) covers: the fields, domain tag first, as one msgpack array."""
    packed: bytes = msgpack.packb(list(fields), use_bin_type=True)
    return packed


def _envelope_bytes(sender: str, epoch: int, seq: int, timestamp: float, payload: bytes) -> bytes:
    # The payload's SHA-256, not the payload: an inference result of hundreds of kB would be
    # copied into the msgpack array and hashed twice by Ed25519 (SHA-512) to sign it; one SHA-256
    # binds it as tightly at a fraction of the cost (runtime.relay does the same for activations).
    return _signed_bytes(_ENV_DOMAIN, sender, epoch, seq, timestamp, hashlib.sha256(payload).digest())


class Signer:
    """Seals messages of one connection: fixed (sender, epoch), increasing seq.

    Not thread-safe (``seq``): a caller sealing from several threads serialises the calls.
    """

    __slots__ = ("epoch", "identity", "seq")

    def __init__(self, identity: KeyPair, epoch: int, seq: int = 0) -> None:
        self.identity = identity
        self.epoch = epoch
        self.seq = seq

    def seal(self, msg: Message, now: float) -> Envelope:
        payload = codec.encode(msg)
        self.seq += 1
        sig = self.identity.sign(_envelope_bytes(self.identity.name, self.epoch, self.seq, now, payload))
        return Envelope(self.identity.name, self.epoch, self.seq, now, payload, sig)

    def seal_bytes(self, msg: Message, now: float) -> bytes:
        return codec.encode(self.seal(msg, now))

    def seal_mac(self, msg: Message, now: float, key: bytes) -> Envelope:
        """Like ``seal`` but authenticated with the connection's session key (HMAC-SHA256).

        Same fields, same (epoch, seq) counter as signed envelopes, so one replay window covers both.
        """
        if msg.KIND not in MAC_KINDS:
            raise LocalViolation(f"{msg.KIND} must be signed, not MAC-authenticated")
        payload = codec.encode(msg)
        self.seq += 1
        tag = mac_tag(key, self.identity.name, self.epoch, self.seq, now, payload)
        return Envelope(self.identity.name, self.epoch, self.seq, now, payload, tag)

    def seal_mac_bytes(self, msg: Message, now: float, key: bytes) -> bytes:
        return codec.encode(self.seal_mac(msg, now, key))


class TrustStore:
    """Enrolled public keys by sender name, in memory (``runtime.security.TrustStore`` persists them)."""

    def __init__(self, keys: Mapping[str, bytes] | None = None) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._raw: dict[str, bytes] = {}
        for name, key in (keys or {}).items():
            self._put(name, key)

    def _put(self, name: str, key: bytes) -> None:
        self._keys[name] = Ed25519PublicKey.from_public_bytes(key)
        self._raw[name] = key

    def enroll(self, name: str, key: bytes) -> None:
        if len(key) != 32:
            raise RemoteViolation("Ed25519 public keys are 32 bytes")
        self._put(name, key)

    def remove(self, name: str) -> bool:
        """Forget ``name`` (a revoked identity); True if it was known."""
        if self._raw.pop(name, None) is None:
            return False
        del self._keys[name]
        return True

    def names(self) -> list[str]:
        return list(self._raw)

    def key_bytes(self, name: str) -> bytes | None:
        return self._raw.get(name)

    def public_key(self, name: str) -> Ed25519PublicKey | None:
        return self._keys.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._keys

    def __len__(self) -> int:
        return len(self._keys)


@dataclass
class _Window:
    epoch: int
    top: int
    bitmap: int  # bit i set: seq (top - i) was seen


class EnvelopeVerifier:
    """Checks envelopes: size, sender, signature, (epoch, seq) freshness, timestamp window.

    Replay protection is an IPsec-style sliding window per sender: a newer epoch
    resets it, an older epoch is refused, and within an epoch each seq is taken
    once and only if it is no more than ``window`` behind the highest seen (QoS1
    redelivery and concurrent publishers reorder a little, never a lot).

    ``marks`` (sender -> (epoch, highest seq), as ``marks()`` returns them) restores
    replay protection after a restart: every seq at or below a mark is refused as
    replayed, an older epoch as stale. ``_advanced`` is called whenever a mark
    moves; ``runtime.security.Verifier`` overrides it to persist the marks.
    """

    def __init__(self, trust: TrustStore, *, max_skew_s: float = 30.0, max_size: int = codec.DEFAULT_MAX_SIZE,
                 window: int = 64, sessions: bool = False,
                 marks: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.trust = trust
        self.max_skew_s = max_skew_s
        self.max_size = max_size
        self.window = window
        self.rejected: collections.Counter[str] = collections.Counter()
        self.accepted = 0
        self._windows: dict[str, _Window] = {}
        # sender -> (epoch, HMAC key); None: session MACs are not accepted by this verifier at all
        self._sessions: dict[str, tuple[int, bytes]] | None = {} if sessions else None
        full = (1 << window) - 1  # nothing at or below a stored mark is known unseen
        for sender, (epoch, top) in (marks or {}).items():
            self._windows[sender] = _Window(epoch, top, full)

    def marks(self) -> dict[str, tuple[int, int]]:
        """Every sender's (epoch, highest seq), sorted by sender: what survives a restart."""
        return {s: (w.epoch, w.top) for s, w in sorted(self._windows.items())}

    def _advanced(self) -> None:
        """Hook: a high-water mark moved (or a sender was forgotten). Nothing to do here."""

    def set_session(self, sender: str, epoch: int, key: bytes) -> None:
        """Accept MAC-authenticated envelopes of ``sender`` for this connect ``epoch`` under ``key``."""
        if self._sessions is None:
            raise LocalViolation("this verifier was made without sessions=True")
        if len(key) != 32:
            raise LocalViolation("session keys are 32 bytes")
        self._sessions[sender] = (epoch, bytes(key))

    def drop_session(self, sender: str) -> None:
        if self._sessions is not None:
            self._sessions.pop(sender, None)

    def session(self, sender: str) -> tuple[int, bytes] | None:
        """The (epoch, key) of ``sender``'s session, if any (to hand a MAC check to a worker)."""
        return self._sessions.get(sender) if self._sessions is not None else None

    def has_session(self, sender: str) -> bool:
        return self._sessions is not None and sender in self._sessions

    def _reject(self, reason: str, detail: str = "", out_of_range: OutOfRange | None = None) -> SecurityError:
        self.rejected[reason] += 1
        return SecurityError(reason, detail, out_of_range=out_of_range)

    def open(self, data: bytes | memoryview, now: float) -> tuple[Envelope, Message]:
        """Verify a framed envelope and decode its payload; raise ``SecurityError`` or ``DecodeError``."""
        if len(data) > self.max_size:
            raise self._reject(OVERSIZED, f"{len(data)} bytes")
        try:
            env = codec.decode_envelope(data, max_size=self.max_size)  # tight budget: nothing is trusted yet
        except DecodeError as exc:
            raise self._reject(MALFORMED, str(exc)) from None
        return env, self.check(env, now)

    def check(self, env: Envelope, now: float) -> Message:
        """Signature or MAC, then freshness (timestamp, replay window), then decode the payload."""
        self.verify_signature(env)
        self.admit(env, now)
        msg = self._payload(env)
        self.accepted += 1
        return msg

    def verify_only(self, env: Envelope) -> Message:
        """Signature or MAC, then decode the payload: no timestamp, no replay window, no ``accepted`` count.

        For pre-signed MQTT Wills (a device's DeviceDeath, a fog's offline FogState): sealed at
        connect time and delivered whenever the connection dies, so the timestamp is stale by
        design; the caller checks freshness by epoch.
        """
        self.verify_signature(env)
        return self._payload(env)

    def _payload(self, env: Envelope) -> Message:
        """Decode the payload of an authenticated envelope (never before: see the module doc)."""
        try:
            msg = codec.decode(env.payload, max_size=self.max_size)
        except DecodeError as exc:
            raise self._reject(MALFORMED, f"payload: {exc}", exc.out_of_range) from None
        if isinstance(msg, Envelope):
            raise self._reject(MALFORMED, "nested envelope")
        if self._sessions is not None and len(env.signature) == MAC_LEN and msg.KIND not in MAC_KINDS:
            raise self._reject(BAD_SIGNATURE, f"{msg.KIND} must be signed, not MAC-authenticated")
        return msg

    def verify_signature(self, env: Envelope) -> None:
        """Stateless half of ``check``: known sender, and its Ed25519 signature (or session MAC) holds.

        No freshness here: call ``admit`` (replay window, timestamp) before trusting the envelope.
        """
        key = self.trust.public_key(env.sender)
        if key is None:
            raise self._reject(UNKNOWN_SENDER, env.sender[:64])
        if self._sessions is not None and len(env.signature) == MAC_LEN:
            s = self._sessions.get(env.sender)
            if s is None:
                raise self._reject(NO_SESSION, env.sender)
            if env.epoch != s[0]:
                raise self._reject(STALE_EPOCH if env.epoch < s[0] else NO_SESSION,
                                   f"MAC epoch {env.epoch}, session epoch {s[0]}")
            tag = mac_tag(s[1], env.sender, env.epoch, env.seq, env.timestamp, env.payload)
            if not hmac.compare_digest(tag, env.signature):
                raise self._reject(BAD_SIGNATURE, f"{env.sender} (session MAC)")
            return
        try:
            key.verify(env.signature, _envelope_bytes(env.sender, env.epoch, env.seq, env.timestamp, env.payload))
        except InvalidSignature:
            raise self._reject(BAD_SIGNATURE, env.sender) from None

    def admit(self, env: Envelope, now: float) -> None:
        """Stateful half of ``check``: timestamp window, then the per-sender (epoch, seq) replay window."""
        if not abs(env.timestamp - now) <= self.max_skew_s:  # also catches NaN
            raise self._reject(OUTSIDE_WINDOW, f"{env.timestamp - now:+.1f} s")
        if self._admit(env):
            self._advanced()

    def admit_sequence(self, env: Envelope) -> None:
        """The replay window alone, without the timestamp check: for a verified message that itself
        sets the clock (the fog's time hints), so a device whose clock is wrong can still take it."""
        if self._admit(env):
            self._advanced()

    def _admit(self, env: Envelope) -> bool:
        """Take ``env``'s (epoch, seq) or raise; True when the high-water mark advanced."""
        w = self._windows.get(env.sender)
        if w is None or env.epoch > w.epoch:
            self._windows[env.sender] = _Window(env.epoch, env.seq, 1)
            return True
        if env.epoch < w.epoch:
            raise self._reject(STALE_EPOCH, f"{env.epoch} < {w.epoch}")
        if env.seq > w.top:
            shift = env.seq - w.top
            w.bitmap = ((w.bitmap << shift) | 1) & ((1 << self.window) - 1) if shift < self.window else 1
            w.top = env.seq
            return True
        back = w.top - env.seq
        if back >= self.window or (w.bitmap >> back) & 1:
            raise self._reject(REPLAYED, f"seq {env.seq} (highest {w.top})")
        w.bitmap |= 1 << back
        return False

    def forget(self, sender: str) -> None:
        if self._windows.pop(sender, None) is not None:
            self._advanced()


# ---------------------------------------------------------------- session MACs


def mac_tag(key: bytes, sender: str, epoch: int, seq: int, timestamp: float, payload: bytes) -> bytes:
    """HMAC-SHA256 over the same fields as the envelope signature, under its own domain tag."""
    return hmac.digest(key, msgpack.packb([_MAC_DOMAIN, sender, epoch, seq, timestamp, payload],
                                          use_bin_type=True), "sha256")


def _offer_bytes(fog_id: str, site: str, epoch: int, session_pub: bytes) -> bytes:
    return _signed_bytes(_OFFER_DOMAIN, fog_id, site, epoch, session_pub)


def sign_session_offer(identity: KeyPair, site: str, epoch: int, session_pub: bytes) -> bytes:
    """The fog's signature over its per-run X25519 key (published in the retained ``FogState``)."""
    return identity.sign(_offer_bytes(identity.name, site, epoch, session_pub))


def verify_session_offer(public_key: bytes, signature: bytes, fog_id: str, site: str, epoch: int,
                         session_pub: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(
            signature, _offer_bytes(fog_id, site, epoch, session_pub))
    except (InvalidSignature, ValueError):
        return False
    return len(session_pub) == 32


def derive_session_key(private: X25519PrivateKey, peer_public: bytes, device: str, epoch: int,
                       device_pub: bytes, fog_pub: bytes) -> bytes:
    """HKDF-SHA256(X25519 shared secret), bound to the device, its connect epoch and both public keys.

    Raises ``SecurityError`` for a malformed or low-order peer key.
    """
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
    except ValueError:
        raise SecurityError(BAD_SIGNATURE, "unusable session public key") from None
    if not any(shared):
        raise SecurityError(BAD_SIGNATURE, "low-order session public key")
    info = msgpack.packb([_SESSION_DOMAIN, device, epoch, bytes(device_pub), bytes(fog_pub)], use_bin_type=True)
    return HKDF(algorithm=SHA256(), length=32, salt=None, info=info).derive(shared)


# ---------------------------------------------------------------- artifacts


def _canonical_meta(metadata: Mapping[str, Any]) -> list[list[Any]]:
    out = []
    for k in sorted(metadata):
        v = metadata[k]
        if not isinstance(v, (str, int, float, bool)):
            raise LocalViolation(f"artifact metadata {k!r} must be a scalar, not {type(v).__name__}")
        out.append([k, v])
    return out


@dataclass(frozen=True, slots=True)
class ArtifactSignature:
    """Signature over sha256(bytes) plus metadata: hash then sign."""

    sha256: str
    signer: str
    signature: bytes
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "signer": self.signer, "signature": self.signature.hex(),
                "metadata": dict(self.metadata)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ArtifactSignature:
        try:
            return cls(str(d["sha256"]), str(d["signer"]), bytes.fromhex(d["signature"]),
                       dict(d.get("metadata", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise RemoteViolation(f"malformed artifact signature: {exc}") from None


def _artifact_bytes(sha: str, signer: str, metadata: Mapping[str, Any]) -> bytes:
    return _signed_bytes(_ART_DOMAIN, sha, signer, _canonical_meta(metadata))


def sign_artifact(identity: KeyPair, data: bytes | memoryview,
                  metadata: Mapping[str, Any] | None = None) -> ArtifactSignature:
    meta = dict(metadata or {})
    sha = sha256_hex(data)
    return ArtifactSignature(sha, identity.name, identity.sign(_artifact_bytes(sha, identity.name, meta)), meta)


def verify_artifact(public_key: bytes, data: bytes | memoryview, sig: ArtifactSignature) -> None:
    """Raise ``SecurityError`` unless ``data`` hashes to ``sig.sha256`` and the signature holds."""
    actual = sha256_hex(data)
    if actual != sig.sha256:
        raise SecurityError("hash mismatch", f"got {actual[:12]}, signed {sig.sha256[:12]}")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(
            sig.signature, _artifact_bytes(sig.sha256, sig.signer, sig.metadata))
    except (InvalidSignature, ValueError):
        raise SecurityError(BAD_SIGNATURE, sig.signer) from None
