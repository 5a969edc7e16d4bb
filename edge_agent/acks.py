"""Times the broker's acks of QoS1 publishes, for the passive link estimate.

One daemon thread per process (shared by every agent in a fleet process)
polls outstanding publish handles every 2 ms while any is outstanding and
sleeps otherwise; the error of one sample is therefore ~2 ms, small against
the hundreds of milliseconds a large activation takes on a slow link.

Completions reach each estimator in send order (the order of ``track``
calls: the agent tracks under the lock it publishes under) with their ack
times, which the estimator needs to tell a queued publish from an idle-link
one; ``on_done`` (acked, or given up after 30 s) releases data-lane bytes.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from .stats import LinkEstimator

__all__ = ["AckWatcher", "watcher"]

log = logging.getLogger(__name__)

_POLL_S = 0.002
_GIVE_UP_S = 30.0


class _Handle(Protocol):
    def is_published(self) -> bool: ...


_Item = tuple[_Handle, int, float, LinkEstimator, "Callable[[bool], None] | None"]


class AckWatcher:
    def __init__(self) -> None:
        self._pending: list[_Item] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def track(self, handle: _Handle, nbytes: int, sent_at: float, estimator: LinkEstimator,
              on_done: Callable[[bool], None] | None = None) -> None:
        """Time ``handle``'s ack; ``on_done(acked)`` runs on the watcher thread when it ends."""
        with self._cond:
            self._pending.append((handle, nbytes, sent_at, estimator, on_done))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ack-watcher", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                pending = list(self._pending)
            now = time.monotonic()
            done: list[tuple[_Item, bool]] = []
            for item in pending:  # send order
                handle, nbytes, sent_at, est, _ = item
                try:
                    published = handle.is_published()
                except Exception:  # noqa: BLE001 - a handle of a dead connection
                    published = False
                if published:
                    est.complete(nbytes, sent_at, now)
                    done.append((item, True))
                elif now - sent_at > _GIVE_UP_S:
                    done.append((item, False))
            if done:
                with self._cond:
                    ids = {id(x) for x, _ in done}
                    self._pending = [x for x in self._pending if id(x) not in ids]
                for (*_, on_done), acked in done:
                    if on_done is not None:
                        try:
                            on_done(acked)
                        except Exception:  # the watcher serves every agent: never die of one
                            log.exception("ack callback failed")
            time.sleep(_POLL_S)


_WATCHER: AckWatcher | None = None
_LOCK = threading.Lock()


def watcher() -> AckWatcher:
    global _WATCHER
    with _LOCK:
        if _WATCHER is None:
            _WATCHER = AckWatcher()
        return _WATCHER
