"""The authenticated data plane (runtime.relay): who may hand a device an activation, table-driven.

A frame is accepted only with the pinned fog key's ticket, at the receiver's own hop, signed by
the previous hop named in the ticket (hop 0: the fog); tensors are decoded only after all that.
"""
from __future__ import annotations

import dataclasses
import struct
import time

import numpy as np
import pytest

from runtime import codec, relay
from runtime.messages import Activation, Hop, InferenceResult, Relay, RouteTicket
from runtime.relay import RelayError, Sealer
from runtime.security import Identity, TrustStore, Verifier

FOG = Identity.generate("fog-1")
A, B, C = (Identity.generate(n) for n in ("dev-a", "dev-b", "dev-c"))
ROUTE = (Hop("dev-a", "w", 1, 0, 0), Hop("dev-b", "w", 1, 0, 1))
KEYS = (A.public_key_bytes, B.public_key_bytes)
NOW = 1_800_000_000.0


def _ticketed(deadline: float = NOW + 5, route: tuple[Hop, ...] = ROUTE, keys: tuple[bytes, ...] = KEYS,
              signer: Identity = FOG) -> Activation:
    t = RouteTicket("fog-1", "req-1", "w", route, keys, "fogline/v1/s/reply/fog-1", deadline)
    raw, sig = relay.issue_ticket(signer, t)
    return Activation("req-1", "w", route, 0, t.reply_to, {"x": np.arange(6, dtype=np.float32).reshape(2, 3)},
                      deadline, raw, sig, keys)


def test_a_chain_of_two_hops_is_accepted_and_carries_the_tensors() -> None:
    act = _ticketed()
    got = relay.open_relay(relay.seal(FOG, act), FOG.public_key_bytes, "dev-a", NOW)
    assert got.hop == 0 and got.route == ROUTE and got.keys == KEYS
    np.testing.assert_array_equal(got.tensors["x"], act.tensors["x"])
    fwd = dataclasses.replace(got, hop=1, tensors={"h": np.ones(3, np.float32)})
    got2 = relay.open_relay(relay.seal(A, fwd), FOG.public_key_bytes, "dev-b", NOW)
    assert got2.hop == 1 and got2.request_id == "req-1" and list(got2.tensors) == ["h"]


@pytest.mark.parametrize("case, reason", [
    ("ticket signed by another key", "bad ticket signature"),
    ("hop 0 sent by a device", "wrong sender"),
    ("hop 0 sealed by an impostor under the fog's name", "bad signature"),
    ("hop 1 sent by someone off the route", "wrong sender"),
    ("hop 1 claimed by the right name, wrong key", "bad signature"),
    ("addressed to another device", "not my hop"),
    ("tensors swapped after signing", "bad signature"),
    ("hop number changed after signing", "bad signature"),
    ("past its deadline", "expired"),
    ("route keys rewritten by the sender", "bad ticket signature"),
])
def test_what_a_device_refuses(case: str, reason: str) -> None:
    me, data = "dev-b", b""
    if case == "ticket signed by another key":
        me, data = "dev-a", relay.seal(FOG, _ticketed(signer=Identity.generate("fog-1")))
    elif case == "hop 0 sent by a device":
        me, data = "dev-a", relay.seal(C, _ticketed())
    elif case == "hop 0 sealed by an impostor under the fog's name":
        me, data = "dev-a", relay.seal(Identity.generate("fog-1"), _ticketed())
    elif case == "hop 1 sent by someone off the route":
        data = relay.seal(C, dataclasses.replace(_ticketed(), hop=1))
    elif case == "hop 1 claimed by the right name, wrong key":
        data = relay.seal(Identity.generate("dev-a"), dataclasses.replace(_ticketed(), hop=1))
    elif case == "addressed to another device":
        me, data = "dev-c", relay.seal(A, dataclasses.replace(_ticketed(), hop=1))
    elif case == "tensors swapped after signing":
        frame = codec.decode(relay.seal(A, dataclasses.replace(_ticketed(), hop=1)))
        assert isinstance(frame, Relay)
        other = codec.encode(__import__("runtime.messages", fromlist=["Tensors"]).Tensors({"x": np.zeros(1)}))
        data = codec.encode(dataclasses.replace(frame, tensors=other))
    elif case == "hop number changed after signing":
        me = "dev-a"
        frame = codec.decode(relay.seal(A, dataclasses.replace(_ticketed(), hop=1)))
        data = codec.encode(dataclasses.replace(frame, hop=0, sender="fog-1"))  # type: ignore[type-var]
    elif case == "past its deadline":
        data = relay.seal(A, dataclasses.replace(_ticketed(deadline=NOW - 60), hop=1))
    elif case == "route keys rewritten by the sender":
        frame = codec.decode(relay.seal(C, dataclasses.replace(_ticketed(), hop=1)))
        ticket = codec.decode(frame.ticket)  # type: ignore[attr-defined]
        forged = codec.encode(dataclasses.replace(ticket, keys=(C.public_key_bytes, B.public_key_bytes)))
        data = codec.encode(dataclasses.replace(frame, ticket=forged, sender="dev-a"))  # type: ignore[type-var]
    with pytest.raises(RelayError) as err:
        relay.open_relay(data, FOG.public_key_bytes, me, NOW)
    assert err.value.reason == reason


def test_tensors_are_not_decoded_before_the_checks() -> None:
    """A frame with a bad signature around a tensor bomb is refused without touching the bomb."""
    frame = codec.decode(relay.seal(C, dataclasses.replace(_ticketed(), hop=1)))
    header = struct.pack("<4sI", codec.MAGIC, 5 + (8 << 20))
    bomb = header + b"\x93\xa3inf\x01\xdd" + struct.pack(">I", 8 << 20) + b"\x90" * (8 << 20)
    data = codec.encode(dataclasses.replace(frame, tensors=bomb))  # type: ignore[type-var]
    t0 = time.perf_counter()
    with pytest.raises(RelayError, match="wrong sender"):
        relay.open_relay(data, FOG.public_key_bytes, "dev-b", NOW)
    assert time.perf_counter() - t0 < 1.0


def test_garbage_and_other_messages_are_malformed() -> None:
    for data in (b"", b"FGL\x01garbage", codec.encode(InferenceResult("r", True))):
        with pytest.raises(RelayError) as err:
            relay.open_relay(data, FOG.public_key_bytes, "dev-a", NOW)
        assert err.value.reason == "malformed"


def test_sealer_results_verify_against_the_device_key_only() -> None:
    s = Sealer(A)
    raw = s.result(InferenceResult("req-1", True, {"y": np.ones(2)}), NOW)
    env = codec.decode_envelope(raw)
    assert env.sender == "dev-a"
    assert Verifier(TrustStore({"dev-a": A.public_key_bytes})).verify_only(env).request_id == "req-1"  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="bad signature"):
        Verifier(TrustStore({"dev-a": B.public_key_bytes})).verify_only(env)


# ------------------------------------------------------------------ hop 0 under the ticket's one signature


def _issued(signer: Identity = FOG) -> tuple[Activation, bytes]:
    act = _ticketed()
    t = RouteTicket("fog-1", "req-1", "w", ROUTE, KEYS, act.reply_to, act.deadline)
    return act, relay.issue(signer, t, act)


def test_hop_0_issued_with_one_signature_is_accepted_and_forwarded() -> None:
    act, data = _issued()
    frame = codec.decode(data)
    assert isinstance(frame, Relay) and frame.signature == b""  # the ticket's signature vouches for it
    got = relay.open_relay(data, FOG.public_key_bytes, "dev-a", NOW)
    np.testing.assert_array_equal(got.tensors["x"], act.tensors["x"])
    fwd = dataclasses.replace(got, hop=1, tensors={"h": np.ones(3, np.float32)})
    assert relay.open_relay(relay.seal(A, fwd), FOG.public_key_bytes, "dev-b", NOW).hop == 1


@pytest.mark.parametrize("case, reason", [
    ("tensors swapped", "bad signature"),
    ("ticket signed by another key", "bad ticket signature"),
    ("digest rewritten in the ticket", "bad ticket signature"),
    ("sent to hop 1 as if forwarded", "wrong sender"),
])
def test_hop_0_under_the_ticket_refuses(case: str, reason: str) -> None:
    me = "dev-a"
    if case == "ticket signed by another key":
        data = _issued(Identity.generate("fog-1"))[1]
    else:
        frame = codec.decode(_issued()[1])
        assert isinstance(frame, Relay)
        if case == "tensors swapped":
            frame = dataclasses.replace(frame, tensors=codec.encode(
                codec.decode(frame.tensors).__class__({"x": np.zeros((2, 3), np.float32)})))
        elif case == "digest rewritten in the ticket":
            t = codec.decode(frame.ticket)
            assert isinstance(t, RouteTicket) and len(t.inputs_sha256) == 32
            frame = dataclasses.replace(frame, ticket=codec.encode(dataclasses.replace(t, inputs_sha256=bytes(32))))
        else:
            me, frame = "dev-b", dataclasses.replace(frame, hop=1)
        data = codec.encode(frame)
    with pytest.raises(RelayError) as err:
        relay.open_relay(data, FOG.public_key_bytes, me, NOW)
    assert err.value.reason == reason


def test_a_ticket_digest_that_is_not_sha256_is_refused() -> None:
    with pytest.raises(Exception, match="inputs_sha256"):
        RouteTicket("fog-1", "req-1", "w", ROUTE, KEYS, "r", NOW, b"short")
