"""Column blocks run on a few threads, with results that do not depend on the thread count.

The column passes (Gram matrices, weighted sums) split [0, d) into fixed blocks of
whole chunks. Each block is computed sequentially, by whichever worker takes it,
and block results are combined in block order, so the float64 result is bitwise
the same with 1 worker or 8. numpy copies and BLAS calls release the GIL, so two
workers on two cores take about half the time.

Workers: ``FOGLINE_AGG_THREADS`` when set; otherwise the usable cores (at most 4)
divided by BLAS's own thread count (a multi-threaded BLAS called from several
threads at once oversubscribes the cores and runs 2-3x slower), read through
threadpoolctl when it is installed, else from ``OPENBLAS_NUM_THREADS`` /
``OMP_NUM_THREADS`` (unset: BLAS is assumed to use every core, so one worker).
"""
from __future__ import annotations

import contextvars
import itertools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["workers", "blocks", "run_blocks"]

T = TypeVar("T")

MAX_WORKERS = 4
BLOCK_CHUNKS = 8  # chunks per block: 25 blocks for d = 1e6, n = 50 (balanced on 2-4 workers)

_pool: ThreadPoolExecutor | None = None
_pool_key: tuple[int, int] = (0, 0)  # (pid, size): a forked child builds its own pool
_blas: Any = None  # threadpoolctl controllers of the loaded BLAS, found once


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _blas_threads(cores: int) -> int:
    global _blas
    if _blas is None:
        try:
            from threadpoolctl import ThreadpoolController
            _blas = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
        except Exception:  # noqa: BLE001 - optional: fall back to the environment
            _blas = []
    if _blas:
        try:
            return max(1, max(int(c.get_num_threads()) for c in _blas))
        except Exception:  # noqa: BLE001 - unreadable: fall back to the environment
            pass
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        v = os.environ.get(var, "").split(",")[0].strip()
        if v.isdigit() and int(v) >= 1:
            return int(v)
    return cores


def workers() -> int:
    """How many threads the column passes use (see the module docstring)."""
    env = os.environ.get("FOGLINE_AGG_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        return min(int(env), 64)
    cores = min(_cores(), MAX_WORKERS)
    return max(1, cores // _blas_threads(cores))


def blocks(d: int, step: int) -> list[tuple[int, int]]:
    """Column ranges [lo, hi) of ``BLOCK_CHUNKS`` chunks of ``step`` columns (the last shorter)."""
    size = step * BLOCK_CHUNKS
    return [(lo, min(d, lo + size)) for lo in range(0, d, size)] or [(0, 0)]


def _get_pool(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_key
    key = (os.getpid(), size)
    if _pool is None or _pool_key != key:
        _pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="fogline-agg")
        _pool_key = key
    return _pool


def run_blocks(spans: Sequence[tuple[int, int]], make: Callable[[], Callable[[int, int], T]]) -> list[T]:
    """``[work(lo, hi) for (lo, hi) in spans]``, on up to ``workers()`` threads.

    ``make()`` is called once per worker and returns that worker's ``work`` (so each
    worker owns its scratch buffers). Results come back in span order; the first
    exception raised by any block is re-raised. ``work`` must not call ``run_blocks``.
    """
    nw = min(workers(), len(spans))
    if nw <= 1:
        work = make()
        return [work(lo, hi) for lo, hi in spans]
    out: list[Any] = [None] * len(spans)
    ticket = itertools.count()  # next() on a count is atomic under the GIL
    stop: list[bool] = []  # set (appended to) by the first failing worker

    def loop() -> None:
        work = make()
        while not stop:
            i = next(ticket)
            if i >= len(spans):
                return
            try:
                out[i] = work(*spans[i])
            except BaseException:
                stop.append(True)
                raise

    pool = _get_pool(nw - 1)
    # Each worker runs in a copy of the caller's context: numpy's errstate lives there.
    futs = [pool.submit(contextvars.copy_context().run, loop) for _ in range(nw - 1)]
    err: BaseException | None = None
    try:
        loop()  # the calling thread is a worker too
    except BaseException as exc:  # noqa: BLE001 - re-raised once the others have stopped
        err = exc
    for f in futs:
        try:
            f.result()
        except BaseException as exc:  # noqa: BLE001
            err = err or exc
    if err is not None:
        raise err
    return out
