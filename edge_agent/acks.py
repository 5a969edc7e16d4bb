"""Times the broker's acks of QoS1 publishes, for the passive link estimate.

One daemon thread per process (shared by every agent in a fleet process)
polls outstanding publish handles every 2 ms while any is outstanding and
sleeps otherwise; the error of one sample is therefore ~2 ms, small against
the hundreds of milliseconds a large activation takes on a slow link.
"""
from __future__ import annotations

import threading
import time
from typing import Protocol

from .stats import LinkEstimator

__all__ = ["AckWatcher", "watcher"]

_POLL_S = 0.002
_GIVE_UP_S = 30.0


class _Handle(Protocol):
    def is_published(self) -> bool: ...


class AckWatcher:
    def __init__(self) -> None:
        self._pending: list[tuple[_Handle, int, float, LinkEstimator]] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def track(self, handle: _Handle, nbytes: int, sent_at: float, estimator: LinkEstimator) -> None:
        with self._cond:
            self._pending.append((handle, nbytes, sent_at, estimator))
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
            done = []
            for item in pending:
                handle, nbytes, sent_at, est = item
                try:
                    published = handle.is_published()
                except Exception:  # noqa: BLE001 - a handle of a dead connection
                    published = False
                if published:
                    est.observe(nbytes, now - sent_at)
                    done.append(item)
                elif now - sent_at > _GIVE_UP_S:
                    done.append(item)
            if done:
                with self._cond:
                    ids = {id(x) for x in done}
                    self._pending = [x for x in self._pending if id(x) not in ids]
            time.sleep(_POLL_S)


_WATCHER: AckWatcher | None = None
_LOCK = threading.Lock()


def watcher() -> AckWatcher:
    global _WATCHER
    with _LOCK:
        if _WATCHER is None:
            _WATCHER = AckWatcher()
        return _WATCHER
