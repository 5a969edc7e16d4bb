"""Session MACs for state adverts: key agreement, the signed fog offer, and every rejection reason.

A state advert may carry an HMAC-SHA256 tag (32 bytes) under a per-connection key instead of an
Ed25519 signature (64 bytes); it shares the sender's (epoch, seq) replay window and the timestamp
check with signed envelopes. Births, acks and commands can never be MAC-authenticated.
"""
from __future__ import annotations

import time

import pytest

from fog_broker._verify_pool import open_session
from runtime import codec
from runtime.errors import LocalViolation, SecurityError
from runtime.messages import CommandAck, DeviceBirth, DeviceState, Envelope
from runtime.security import (
    BAD_SIGNATURE,
    MAC_LEN,
    NO_SESSION,
    OUTSIDE_WINDOW,
    REPLAYED,
    STALE_EPOCH,
    UNKNOWN_SENDER,
    Identity,
    SessionKeyPair,
    Signer,
    TrustStore,
    Verifier,
    mac_tag,
    sign_session_offer,
    verify_session_offer,
)

NOW = 1_700_000_000.0
DEV = Identity.from_seed("dev-1", b"dev-1")
KEY = bytes(range(32))


def verifier(epoch: int = 1, key: bytes = KEY) -> Verifier:
    v = Verifier(TrustStore({DEV.name: DEV.public_key_bytes}), sessions=True)
    v.set_session(DEV.name, epoch, key)
    return v


def state(epoch: int = 1) -> DeviceState:
    return DeviceState(DEV.name, epoch, 0, 1000)


def reason(v: Verifier, data: bytes, now: float = NOW) -> str:
    with pytest.raises(SecurityError) as ei:
        v.open(data, now)
    return ei.value.reason


def test_mac_state_is_accepted_and_is_32_bytes() -> None:
    s = Signer(DEV, 1)
    env = s.seal_mac(state(), NOW, KEY)
    assert len(env.signature) == MAC_LEN
    v = verifier()
    got_env, msg = v.open(codec.encode(env), NOW)
    assert isinstance(msg, DeviceState) and got_env.seq == 1 and v.accepted == 1


def test_wrong_key_is_a_bad_signature() -> None:
    data = Signer(DEV, 1).seal_mac_bytes(state(), NOW, bytes(32))
    assert reason(verifier(), data) == BAD_SIGNATURE


def test_tampered_fields_are_a_bad_signature() -> None:
    env = Signer(DEV, 1).seal_mac(state(), NOW, KEY)
    for forged in (Envelope(env.sender, env.epoch, env.seq + 1, env.timestamp, env.payload, env.signature),
                   Envelope(env.sender, env.epoch, env.seq, env.timestamp + 1, env.payload, env.signature),
                   Envelope(env.sender, env.epoch, env.seq, env.timestamp,
                            codec.encode(DeviceState(DEV.name, 1, 0, 999)), env.signature)):
        assert reason(verifier(), codec.encode(forged)) == BAD_SIGNATURE


def test_replay_is_refused_and_the_window_is_shared_with_signatures() -> None:
    s = Signer(DEV, 1)
    v = verifier()
    first = s.seal_mac_bytes(state(), NOW, KEY)
    v.open(first, NOW)
    assert reason(v, first) == REPLAYED
    signed = s.seal_bytes(state(), NOW)           # seq 2, Ed25519
    v.open(signed, NOW)
    s.seq = 1                                       # a MAC reusing a seq a signature took
    assert reason(v, s.seal_mac_bytes(state(), NOW, KEY)) == REPLAYED


def test_stale_epoch_no_session_and_unknown_sender() -> None:
    v = verifier(epoch=2)
    assert reason(v, Signer(DEV, 1).seal_mac_bytes(state(1), NOW, KEY)) == STALE_EPOCH
    assert reason(v, Signer(DEV, 3).seal_mac_bytes(state(3), NOW, KEY)) == NO_SESSION
    v.drop_session(DEV.name)
    assert reason(v, Signer(DEV, 2).seal_mac_bytes(state(2), NOW, KEY)) == NO_SESSION
    other = Identity.from_seed("dev-2", b"x")
    assert reason(v, Signer(other, 1).seal_mac_bytes(DeviceState("dev-2", 1, 0, 1), NOW, KEY)) == UNKNOWN_SENDER
    assert v.rejected[NO_SESSION] == 2 and v.rejected[STALE_EPOCH] == 1


def test_timestamp_window_applies_to_macs() -> None:
    data = Signer(DEV, 1).seal_mac_bytes(state(), NOW - 120, KEY)
    assert reason(verifier(), data) == OUTSIDE_WINDOW


def test_only_states_may_carry_a_mac() -> None:
    s = Signer(DEV, 1)
    with pytest.raises(LocalViolation):
        s.seal_mac(CommandAck("c1", DEV.name, True), NOW, KEY)
    # hand-made: a MAC over an ack is refused even with the right key
    payload = codec.encode(CommandAck("c1", DEV.name, True))
    tag = mac_tag(KEY, DEV.name, 1, 5, NOW, payload)
    assert reason(verifier(), codec.encode(Envelope(DEV.name, 1, 5, NOW, payload, tag))) == BAD_SIGNATURE


def test_verifiers_without_sessions_never_accept_a_mac() -> None:
    v = Verifier(TrustStore({DEV.name: DEV.public_key_bytes}))
    assert reason(v, Signer(DEV, 1).seal_mac_bytes(state(), NOW, KEY)) == BAD_SIGNATURE
    with pytest.raises(LocalViolation):
        v.set_session(DEV.name, 1, KEY)


def test_verify_signature_is_stateless_and_admit_is_the_window() -> None:
    v = Verifier(TrustStore({DEV.name: DEV.public_key_bytes}))
    env = Signer(DEV, 1).seal(state(), NOW)
    v.verify_signature(env)
    v.verify_signature(env)                          # no state: twice is fine
    v.admit(env, NOW)
    with pytest.raises(SecurityError) as ei:
        v.admit(env, NOW)
    assert ei.value.reason == REPLAYED
    bad = Envelope(env.sender, env.epoch, env.seq, env.timestamp, env.payload, bytes(64))
    with pytest.raises(SecurityError) as ei:
        v.verify_signature(bad)
    assert ei.value.reason == BAD_SIGNATURE


def test_key_agreement_matches_and_is_bound_to_device_and_epoch() -> None:
    fog, dev = SessionKeyPair(), SessionKeyPair()
    k_dev = dev.derive(fog.public_bytes, "d", 1, dev.public_bytes, fog.public_bytes)
    k_fog = fog.derive(dev.public_bytes, "d", 1, dev.public_bytes, fog.public_bytes)
    assert k_dev == k_fog and len(k_dev) == 32
    assert fog.derive(dev.public_bytes, "d", 2, dev.public_bytes, fog.public_bytes) != k_fog
    assert fog.derive(dev.public_bytes, "e", 1, dev.public_bytes, fog.public_bytes) != k_fog
    assert SessionKeyPair(fog.private_bytes()).public_bytes == fog.public_bytes
    with pytest.raises(SecurityError):
        fog.derive(bytes(32), "d", 1, bytes(32), fog.public_bytes)   # low-order point


def test_fog_offer_signature() -> None:
    fog_id = Identity.from_seed("fog-x", b"fog")
    pair = SessionKeyPair()
    sig = sign_session_offer(fog_id, "site", 7, pair.public_bytes)
    pub = fog_id.public_key_bytes
    assert verify_session_offer(pub, sig, "fog-x", "site", 7, pair.public_bytes)
    assert not verify_session_offer(pub, sig, "fog-x", "site", 8, pair.public_bytes)
    assert not verify_session_offer(pub, sig, "fog-x", "site", 7, SessionKeyPair().public_bytes)
    assert not verify_session_offer(Identity.generate("y").public_key_bytes, sig, "fog-x", "site", 7,
                                    pair.public_bytes)


def _birth(epoch: int, dev_pair: SessionKeyPair | None, fog_pub: bytes, public_key: bytes | None = None) -> DeviceBirth:
    extra = {"session_key": dev_pair.public_bytes, "fog_session_key": fog_pub} if dev_pair else {}
    return DeviceBirth(DEV.name, epoch, 0, "s", public_key or DEV.public_key_bytes, 1e9, 1, 1.0, 1.0, 0.0, 1.0, 1.0,
                       **extra)


def test_open_session_from_a_birth_end_to_end() -> None:
    fog, dev = SessionKeyPair(), SessionKeyPair()
    v = Verifier(TrustStore({DEV.name: DEV.public_key_bytes}), sessions=True)
    s = Signer(DEV, 3)
    env, msg = v.open(s.seal_bytes(_birth(3, dev, fog.public_bytes), time.time()), time.time())
    assert open_session(v, fog, env, msg) == "session:opened"
    key = dev.derive(fog.public_bytes, DEV.name, 3, dev.public_bytes, fog.public_bytes)
    _, got = v.open(s.seal_mac_bytes(state(3), time.time(), key), time.time())
    assert isinstance(got, DeviceState)
    # a birth naming another fog run's key ends the session: MACs are refused, signatures still work
    env, msg = v.open(s.seal_bytes(_birth(3, dev, SessionKeyPair().public_bytes), time.time()), time.time())
    assert open_session(v, fog, env, msg) == "session:stale fog key"
    assert reason(v, s.seal_mac_bytes(state(3), time.time(), key), time.time()) == NO_SESSION
    v.open(s.seal_bytes(state(3), time.time()), time.time())
    # a birth without an offer: no session either
    env, msg = v.open(s.seal_bytes(_birth(3, None, b""), time.time()), time.time())
    assert open_session(v, fog, env, msg) == "session:none" and not v.has_session(DEV.name)
