"""Envelope verification in worker processes (Ed25519 checks are the bulk of signed-advert ingest).

Each worker process owns a stateless ``runtime.security.Verifier`` over an
in-memory copy of the trust store: it checks signatures and decodes payloads,
nothing else. The parent sends batches ``[("enroll", name, key) | ("verify",
payload) | ("mac", payload, device, epoch, key)]`` and gets back, per ``verify``
or ``mac``, ``("ok", envelope-without-payload, message)`` or ``("rejected",
reason, detail)``; messages come back pickled
(trusted: our own child), so the parent does not decode twice. Everything
stateful stays in the parent's shard thread, in arrival order: the timestamp
window and the per-device (epoch, seq) replay window (``Verifier.admit``), and
the session MAC keys (a "mac" item carries the key of the topic's device for that one check).

``open_session``: an accepted birth that offers an X25519 key combined with
this fog run's key gives the device's connection a session MAC key for its
state adverts (docs/protocol.md, Trust).
"""
from __future__ import annotations

import multiprocessing as mp
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["VerifyWorker", "open_session", "looks_mac"]

# An encoded Envelope ends with its last field: "signature" and a bin8 of 32 bytes (MAC) or 64 (Ed25519).
_MAC_TAIL = b"\xa9signature\xc4\x20"


def looks_mac(frame: bytes) -> bool:
    """Cheap routing hint: does this frame end like a session-MAC envelope? (Never a security decision.)"""
    return frame[-44:-32] == _MAC_TAIL


def open_session(verifier: Any, session: Any, env: Any, msg: Any) -> str:
    """After ``verifier`` accepted ``env`` carrying ``msg``: (re)key the sender's session on a birth.

    Any birth ends the previous session of its device; a new one starts only when the birth
    offers a device key, names this fog run's key, and is for the envelope's own (sender, epoch)
    with the pinned public key. Returns what happened (counted by the caller).
    """
    from runtime.errors import SecurityError
    from runtime.messages import DeviceBirth
    if not isinstance(msg, DeviceBirth):
        return ""
    verifier.drop_session(env.sender)
    if not msg.session_key:
        return "session:none"
    if session is None or msg.fog_session_key != session.public_bytes:
        return "session:stale fog key"
    if (msg.device_id != env.sender or msg.epoch != env.epoch
            or msg.public_key != verifier.trust.key_bytes(env.sender)):
        return "session:mismatch"
    try:
        key = session.derive(msg.session_key, env.sender, env.epoch, msg.session_key, session.public_bytes)
    except SecurityError:
        return "session:bad key"
    verifier.set_session(env.sender, env.epoch, key)
    return "session:opened"


def _serve(conn: Connection, keys: Mapping[str, bytes], max_skew_s: float, max_size: int) -> None:
    from runtime import codec
    from runtime.errors import DecodeError, SecurityError
    from runtime.messages import Envelope
    from runtime.security import (
        BAD_SIGNATURE,
        MAC_KINDS,
        MAC_LEN,
        MALFORMED,
        OVERSIZED,
        TrustStore,
        Verifier,
    )
    trust = TrustStore(dict(keys))
    # Holds at most one session, only while checking the "mac" item it came with.
    verifier = Verifier(trust, max_skew_s=max_skew_s, max_size=max_size, sessions=True)
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        if batch is None:
            return
        out: list[tuple[Any, ...]] = []
        for item in batch:
            if item[0] == "enroll":
                trust.enroll(item[1], item[2])
                continue
            mac = item[0] == "mac"
            if mac:  # ("mac", payload, device, epoch, key): the parent's session for the topic's device
                verifier.set_session(item[2], item[3], item[4])
            try:
                data = item[1]
                if len(data) > max_size:
                    raise SecurityError(OVERSIZED, f"{len(data)} bytes")
                try:
                    env = codec.decode(data, max_size=max_size)
                except DecodeError as exc:
                    raise SecurityError(MALFORMED, str(exc)) from None
                if not isinstance(env, Envelope):
                    raise SecurityError(MALFORMED, f"expected an envelope, got {env.KIND}")
                verifier.verify_signature(env)  # stateless; the parent admits (window, timestamp)
                try:
                    msg = codec.decode(env.payload, max_size=max_size)
                except DecodeError as exc:
                    raise SecurityError(MALFORMED, f"payload: {exc}", out_of_range=exc.out_of_range) from None
                if isinstance(msg, Envelope):
                    raise SecurityError(MALFORMED, "nested envelope")
                if len(env.signature) == MAC_LEN and msg.KIND not in MAC_KINDS:
                    raise SecurityError(BAD_SIGNATURE, f"{msg.KIND} must be signed, not MAC-authenticated")
                out.append(("ok", Envelope(env.sender, env.epoch, env.seq, env.timestamp, b"", b""), msg))
            except SecurityError as exc:
                out.append(("rejected", exc.reason, str(exc)[:200], exc.out_of_range))
            except Exception as exc:  # noqa: BLE001 - a worker must answer every item
                out.append(("rejected", "malformed", f"{type(exc).__name__}: {exc}"[:200], None))
            finally:
                if mac:
                    verifier.drop_session(item[2])
        try:
            conn.send(out)
        except (BrokenPipeError, OSError):
            return


class VerifyWorker:
    """One verify process and its pipe; used by one shard thread of the parent only."""

    def __init__(self, keys: Mapping[str, bytes], *, max_skew_s: float = 30.0,
                 max_size: int = 16 * 1024 * 1024) -> None:
        ctx = mp.get_context("spawn")  # no fork of a process with threads
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, dict(keys), max_skew_s, max_size),
                                name="fog-verify", daemon=True)
        self.proc.start()
        child.close()
        self.accepted = 0

    def run(self, batch: list[tuple[Any, ...]], timeout: float = 30.0) -> list[tuple[Any, ...]]:
        self._conn.send(batch)
        if not self._conn.poll(timeout):
            raise TimeoutError("verify worker did not answer")
        out: list[tuple[Any, ...]] = self._conn.recv()
        return out

    def close(self) -> None:
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=2)
        if self.proc.is_alive():
            self.proc.kill()
