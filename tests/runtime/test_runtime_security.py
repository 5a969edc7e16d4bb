"""runtime.security: identities, the envelope verifier (every rejection reason, counted), artifacts."""
from __future__ import annotations

import dataclasses
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hypothesis import given
from hypothesis import strategies as st

from runtime import codec, security, verify
from runtime.errors import DecodeError, LocalViolation, RemoteViolation, SecurityError
from runtime.messages import CommandAck, DeviceDeath, Envelope
from runtime.security import (
    ArtifactSignature,
    Identity,
    Signer,
    TrustStore,
    Verifier,
    sign_artifact,
    verify_artifact,
)

from runtime_strategies import bounded

NOW = 1_700_000_000.0
DEV = Identity.from_seed("dev-1", b"dev-1")
OTHER = Identity.from_seed("dev-2", b"dev-2")
ACK = CommandAck("c1", "dev-1", True)


def verifier(**kw: Any) -> Verifier:
    return Verifier(TrustStore({DEV.name: DEV.public_key_bytes, OTHER.name: OTHER.public_key_bytes}), **kw)


# ------------------------------------------------------------------ identities


def test_identity_save_is_0600_and_load_round_trips(tmp_path: Path) -> None:
    ident = Identity.generate("fog-1")
    path = tmp_path / "keys" / "fog-1.key"
    ident.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = Identity.load("fog-1", path)
    assert loaded.public_key_bytes == ident.public_key_bytes
    assert loaded.fingerprint == ident.fingerprint
    data = b"hello"  # the loaded key signs verifiably under the original public key
    Ed25519PublicKey.from_public_bytes(ident.public_key_bytes).verify(loaded.sign(data), data)


def test_identity_load_refuses_group_or_world_readable(tmp_path: Path) -> None:
    path = tmp_path / "k"
    Identity.generate("x").save(path)
    os.chmod(path, 0o644)
    with pytest.raises(LocalViolation, match="chmod 600"):
        Identity.load("x", path)


def test_identity_load_refuses_non_ed25519(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path = tmp_path / "ec.key"
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.write_bytes(pem)
    os.chmod(path, 0o600)
    with pytest.raises(LocalViolation, match="Ed25519"):
        Identity.load("x", path)


def test_load_or_create_is_stable(tmp_path: Path) -> None:
    a = Identity.load_or_create("d", tmp_path / "d.key")
    b = Identity.load_or_create("d", tmp_path / "d.key")
    assert a.public_key_bytes == b.public_key_bytes and len(a.public_key_bytes) == 32
    assert Identity.from_seed("d", b"s").public_key_bytes == Identity.from_seed("d", b"s").public_key_bytes
    assert len(a.fingerprint.split(":")) == 8


def test_trust_store_persists(tmp_path: Path) -> None:
    path = tmp_path / "trust.json"
    store = TrustStore(path=path)
    store.enroll("dev-1", DEV.public_key_bytes)
    again = TrustStore(path=path)
    assert "dev-1" in again and len(again) == 1 and again.key_bytes("dev-1") == DEV.public_key_bytes
    with pytest.raises(RemoteViolation):
        store.enroll("bad", b"short")


# ------------------------------------------------------------------ envelopes: acceptance


def test_fresh_envelope_passes_and_counts() -> None:
    v = verifier()
    signer = Signer(DEV, epoch=3)
    env, msg = v.open(signer.seal_bytes(ACK, NOW), NOW)
    assert msg == ACK and env.sender == "dev-1" and env.epoch == 3 and env.seq == 1
    assert v.accepted == 1 and sum(v.rejected.values()) == 0


def test_reordering_within_window_is_accepted_once() -> None:
    v = verifier(window=8)
    signer = Signer(DEV, epoch=1)
    frames = [signer.seal_bytes(ACK, NOW) for _ in range(6)]
    for i in (0, 3, 1, 5, 2, 4):  # QoS1 redelivery and concurrency reorder a little
        v.open(frames[i], NOW)
    assert v.accepted == 6
    for f in frames:
        with pytest.raises(SecurityError, match="replayed"):
            v.open(f, NOW)
    assert v.rejected[security.REPLAYED] == 6


def test_new_epoch_resets_window_and_old_epoch_is_stale() -> None:
    v = verifier()
    old, new = Signer(DEV, epoch=1), Signer(DEV, epoch=2)
    old_frames = [old.seal_bytes(ACK, NOW) for _ in range(3)]
    v.open(old_frames[0], NOW)
    v.open(new.seal_bytes(ACK, NOW), NOW)  # seq 1 of a newer connection: fine
    with pytest.raises(SecurityError) as err:
        v.open(old_frames[1], NOW)
    assert err.value.reason == security.STALE_EPOCH
    v.forget("dev-1")
    v.open(old_frames[2], NOW)  # forgotten: the next envelope starts a new window


# ------------------------------------------------------------------ envelopes: every rejection reason


def _resigned(mutate: Callable[[dict[str, Any]], None], ident: Identity = DEV) -> bytes:
    """An envelope with fields changed and then *validly* signed by ``ident``."""
    f = dict(sender=ident.name, epoch=1, seq=1, timestamp=NOW, payload=codec.encode(ACK))
    mutate(f)
    sig = ident.sign(verify._envelope_bytes(f["sender"], f["epoch"], f["seq"], f["timestamp"], f["payload"]))
    return codec.encode(Envelope(f["sender"], f["epoch"], f["seq"], f["timestamp"], f["payload"], sig))


def _tampered_sig() -> bytes:
    env = codec.decode(Signer(DEV, 1).seal_bytes(ACK, NOW))
    assert isinstance(env, Envelope)
    return codec.encode(dataclasses.replace(env, signature=bytes(64)))


STRANGER = Identity.from_seed("stranger", b"x")

# name -> (frames to feed in order (setup..., attacked), reason of the last one)
REJECTIONS: dict[str, tuple[Callable[[], list[bytes]], str]] = {
    "oversized": (lambda: [b"\x00" * 5000], security.OVERSIZED),
    "garbage bytes": (lambda: [b"not a frame"], security.MALFORMED),
    "not an envelope": (lambda: [codec.encode(ACK)], security.MALFORMED),
    "payload not a message": (lambda: [_resigned(lambda f: f.update(payload=b"junk"))], security.MALFORMED),
    "nested envelope": (lambda: [_resigned(lambda f: f.update(payload=Signer(DEV, 9).seal_bytes(ACK, NOW)))],
                        security.MALFORMED),
    "unknown sender": (lambda: [Signer(STRANGER, 1).seal_bytes(ACK, NOW)], security.UNKNOWN_SENDER),
    "signed by someone else": (lambda: [_resigned(lambda f: None, ident=Identity("dev-1", OTHER._key))],
                               security.BAD_SIGNATURE),
    "zeroed signature": (lambda: [_tampered_sig()], security.BAD_SIGNATURE),
    "replayed": (lambda: [_resigned(lambda f: None)] * 2, security.REPLAYED),
    "older seq outside window": (lambda: [_resigned(lambda f: f.update(seq=100)),
                                          _resigned(lambda f: f.update(seq=100 - 64))], security.REPLAYED),
    "older epoch": (lambda: [_resigned(lambda f: f.update(epoch=5)), _resigned(lambda f: f.update(epoch=4, seq=9))],
                    security.STALE_EPOCH),
    "31 s in the past": (lambda: [_resigned(lambda f: f.update(timestamp=NOW - 31))], security.OUTSIDE_WINDOW),
    "31 s in the future": (lambda: [_resigned(lambda f: f.update(timestamp=NOW + 31))], security.OUTSIDE_WINDOW),
    "NaN timestamp": (lambda: [_resigned(lambda f: f.update(timestamp=math.nan))], security.OUTSIDE_WINDOW),
    "infinite timestamp": (lambda: [_resigned(lambda f: f.update(timestamp=math.inf))], security.OUTSIDE_WINDOW),
}


@pytest.mark.parametrize("name", list(REJECTIONS))
def test_each_rejection_reason_is_raised_and_counted(name: str) -> None:
    make, reason = REJECTIONS[name]
    v = verifier(max_size=4096)
    *setup, attacked = make()
    for frame in setup:
        v.open(frame, NOW)
    before = v.accepted
    with pytest.raises(SecurityError) as err:
        v.open(attacked, NOW)
    assert err.value.reason == reason
    assert isinstance(err.value, RemoteViolation) and isinstance(err.value, ValueError)
    assert v.rejected == {reason: 1}, dict(v.rejected)
    assert v.accepted == before


def test_all_reasons_are_covered_by_the_table() -> None:
    assert {reason for _, reason in REJECTIONS.values()} == set(security.REASONS)


@pytest.mark.parametrize("skew", [-30.0, 0.0, 29.999, 30.0])
def test_timestamp_window_edges_accepted(skew: float) -> None:
    v = verifier()
    v.open(_resigned(lambda f: f.update(timestamp=NOW + skew)), NOW)
    assert v.accepted == 1


# ------------------------------------------------------------------ property: only a valid fresh envelope passes


def _valid_frame() -> tuple[bytes, Envelope]:
    frame = Signer(DEV, epoch=7, seq=41).seal_bytes(ACK, NOW)
    env = codec.decode(frame)
    assert isinstance(env, Envelope)
    return frame, env


def _field_changes() -> st.SearchStrategy[tuple[str, Any]]:
    return st.one_of(
        st.tuples(st.just("sender"), st.sampled_from(["dev-2", "dev-1x", "stranger", "DEV-1"])),
        st.tuples(st.just("epoch"), st.integers(0, 2**63 - 1)),
        st.tuples(st.just("seq"), st.integers(0, 2**63 - 1)),
        st.tuples(st.just("timestamp"), st.floats(NOW - 29, NOW + 29)),
        st.tuples(st.just("payload"), st.sampled_from([codec.encode(CommandAck("c1", "dev-1", False)),
                                                       codec.encode(DeviceDeath("dev-1", 1)), b""])),
        st.tuples(st.just("signature"), st.binary(min_size=64, max_size=64) | st.binary(max_size=80)),
    )


@bounded(250)
@given(change=_field_changes())
def test_any_changed_field_is_rejected(change: tuple[str, Any]) -> None:
    name, value = change
    _, env = _valid_frame()
    if getattr(env, name) == value:
        return
    v = verifier()
    with pytest.raises(SecurityError):
        v.check(dataclasses.replace(env, **{name: value}), NOW)
    assert v.accepted == 0 and sum(v.rejected.values()) == 1


@bounded(300)
@given(data=st.data())
def test_any_mutated_byte_is_rejected_unless_the_envelope_is_unchanged(data: st.DataObject) -> None:
    frame, env = _valid_frame()
    b = bytearray(frame)
    op = data.draw(st.sampled_from(["flip", "set", "truncate", "extend"]))
    if op == "flip":
        i = data.draw(st.integers(0, len(b) - 1))
        b[i] ^= 1 << data.draw(st.integers(0, 7))
    elif op == "set":
        i = data.draw(st.integers(0, len(b) - 1))
        new = data.draw(st.integers(0, 255).filter(lambda x: x != b[i]))
        b[i] = new
    elif op == "truncate":
        del b[data.draw(st.integers(0, len(b) - 1)):]
    else:
        b += data.draw(st.binary(min_size=1, max_size=8))
    v = verifier()
    try:
        got, _ = v.open(bytes(b), NOW)
    except (SecurityError, DecodeError):
        assert v.accepted == 0 and sum(v.rejected.values()) == 1
        return
    # Accepted: only possible when the mutation touched no signed content (e.g. the
    # frame-level version number), so the envelope is exactly the one that was signed.
    assert got == env


@bounded(100)
@given(ts=st.floats(allow_nan=True, allow_infinity=True), now=st.floats(0, 2e9))
def test_window_property(ts: float, now: float) -> None:
    v = verifier()
    frame = _resigned(lambda f: f.update(timestamp=ts))
    if abs(ts - now) <= 30.0:
        v.open(frame, now)
    else:
        with pytest.raises(SecurityError, match="outside window"):
            v.open(frame, now)


# ------------------------------------------------------------------ artifacts


ART = b"\x08\x01onnx-bytes" * 100
META = {"workload": "resnet", "version": "3", "replica": "0", "index": "1"}


def test_artifact_sign_verify_and_dict_round_trip() -> None:
    sig = sign_artifact(DEV, ART, META)
    assert sig.sha256 == security.sha256_hex(ART) and sig.signer == "dev-1"
    verify_artifact(DEV.public_key_bytes, ART, sig)
    verify_artifact(DEV.public_key_bytes, memoryview(ART), ArtifactSignature.from_dict(sig.to_dict()))


@pytest.mark.parametrize("name,attack,reason", [
    ("changed byte", lambda s: (ART[:-1] + b"x", s, DEV.public_key_bytes), "hash mismatch"),
    ("wrong key", lambda s: (ART, s, OTHER.public_key_bytes), security.BAD_SIGNATURE),
    ("changed metadata", lambda s: (ART, dataclasses.replace(s, metadata={**META, "version": "4"}),
                                    DEV.public_key_bytes), security.BAD_SIGNATURE),
    ("changed signer", lambda s: (ART, dataclasses.replace(s, signer="dev-2"), DEV.public_key_bytes),
     security.BAD_SIGNATURE),
    ("hash and data swapped", lambda s: (b"other", dataclasses.replace(s, sha256=security.sha256_hex(b"other")),
                                         DEV.public_key_bytes), security.BAD_SIGNATURE),
    ("garbage key", lambda s: (ART, s, b"\x00" * 5), security.BAD_SIGNATURE),
])
def test_artifact_rejections(name: str, attack: Callable[[ArtifactSignature], Any], reason: str) -> None:
    data, sig, key = attack(sign_artifact(DEV, ART, META))
    with pytest.raises(SecurityError) as err:
        verify_artifact(key, data, sig)
    assert err.value.reason == reason


@pytest.mark.parametrize("bad", [{}, {"sha256": "a", "signer": "s", "signature": "zz"}, {"sha256": "a"}])
def test_malformed_artifact_signature_dict(bad: dict[str, Any]) -> None:
    with pytest.raises(RemoteViolation):
        ArtifactSignature.from_dict(bad)


def test_artifact_metadata_must_be_scalars() -> None:
    with pytest.raises(LocalViolation):
        sign_artifact(DEV, ART, {"x": [1, 2]})


# ------------------------------------------------------------------ order of work: envelope, signature, payload


BOMB = b"\xdd" + (2_000_000).to_bytes(4, "big") + b"\x90" * 2_000_000  # 2M empty arrays as metadata


def _bomb_payload() -> bytes:
    return codec._HEADER.pack(codec.MAGIC, len(BOMB)) + BOMB


@pytest.mark.parametrize("who", ["stranger", "forger"])
def test_payload_is_not_decoded_unless_the_signature_holds(who: str, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = _bomb_payload()
    decoded: list[int] = []
    real = codec.decode
    monkeypatch.setattr(security.codec, "decode", lambda data, **kw: (decoded.append(len(data)), real(data, **kw))[1])
    if who == "stranger":
        frame = _resigned(lambda f: f.update(payload=payload), ident=STRANGER)
        reason = security.UNKNOWN_SENDER
    else:
        env = codec.decode_envelope(_resigned(lambda f: f.update(payload=payload)))
        frame = codec.encode(dataclasses.replace(env, signature=bytes(64)))
        reason = security.BAD_SIGNATURE
    v = verifier()
    with pytest.raises(SecurityError) as err:
        v.open(frame, NOW)
    assert err.value.reason == reason
    assert len(payload) not in decoded  # the envelope was decoded (budgeted), its payload never


def test_a_signed_bomb_payload_is_malformed_not_a_memory_blowup() -> None:
    v = verifier()
    with pytest.raises(SecurityError) as err:
        v.open(_resigned(lambda f: f.update(payload=_bomb_payload())), NOW)
    assert err.value.reason == security.MALFORMED and "object budget exceeded" in str(err.value)


def test_the_envelope_itself_gets_the_tight_budget() -> None:
    import msgpack

    body = {"sender": "dev-1", "epoch": 1, "seq": 1, "timestamp": NOW, "payload": codec.encode(ACK),
            "signature": bytes(64), "x_pad": [[]] * 1000}
    meta = msgpack.packb(["env", 1, body], use_bin_type=True)
    v = verifier()
    with pytest.raises(SecurityError) as err:
        v.open(codec._HEADER.pack(codec.MAGIC, len(meta)) + meta, NOW)
    assert err.value.reason == security.MALFORMED and "object budget exceeded" in str(err.value)


# ------------------------------------------------------------------ verify_only: pre-signed Wills


def test_verify_only_checks_the_signature_but_not_time_or_replay() -> None:
    death = DeviceDeath("dev-1", 7)
    will = codec.decode_envelope(Signer(DEV, epoch=7).seal_bytes(death, NOW - 86_400))  # sealed a day ago
    v = verifier()
    assert v.verify_only(will) == death
    assert v.verify_only(will) == death  # delivered twice (QoS1): no replay window here
    assert v.accepted == 0 and not v.rejected and not v._windows
    v.open(Signer(DEV, epoch=7).seal_bytes(ACK, NOW), NOW)  # and the sender's window is untouched
    with pytest.raises(SecurityError) as err:
        v.verify_only(dataclasses.replace(will, signature=bytes(64)))
    assert err.value.reason == security.BAD_SIGNATURE
    forged = codec.decode_envelope(Signer(Identity("dev-1", OTHER._key), epoch=7).seal_bytes(death, NOW))
    with pytest.raises(SecurityError):
        v.verify_only(forged)
    bad = codec.decode_envelope(_resigned(lambda f: f.update(payload=b"junk")))
    with pytest.raises(SecurityError) as err:
        v.verify_only(bad)
    assert err.value.reason == security.MALFORMED
