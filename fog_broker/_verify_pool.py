"""Envelope verification in worker processes (signature checks are the bulk of advert ingest).

Each worker process owns a ``runtime.security.Verifier`` over an in-memory copy
of the trust store. Devices are sharded over workers by id, so each device's
replay window lives in exactly one process and its messages stay in order.
The parent sends batches ``[("enroll", name, key) | ("open", payload, wall)]``
and gets back, per ``open``, ``("ok", sender, message)`` or ``("rejected",
reason, detail)``; messages come back pickled (trusted: our own child), so the
parent does not decode twice.
"""
from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any, Mapping

__all__ = ["VerifyWorker"]


def _serve(conn: Connection, keys: Mapping[str, bytes], max_skew_s: float, max_size: int) -> None:
    from runtime.errors import SecurityError
    from runtime.security import TrustStore, Verifier
    trust = TrustStore(dict(keys))
    verifier = Verifier(trust, max_skew_s=max_skew_s, max_size=max_size)
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
            try:
                env, msg = verifier.open(item[1], item[2])
                out.append(("ok", env.sender, msg))
            except SecurityError as exc:
                out.append(("rejected", exc.reason, str(exc)[:200]))
            except Exception as exc:  # noqa: BLE001 - a worker must answer every item
                out.append(("rejected", "malformed", f"{type(exc).__name__}: {exc}"[:200]))
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
