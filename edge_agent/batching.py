"""Dynamic batching policy (pure): when a stage runs queued frames of one partition as one batch.

As Triton's dynamic batcher: a worker that takes a frame of a partition whose inputs have an open
leading (batch) dimension gathers the frames of the same partition and shapes already queued, and
waits at most ``max_wait_s`` for more, never past the point where the earliest deadline in the
batch could no longer be met by the batch's predicted run time. Frames whose feeds do not match
(another partition, other trailing shapes or dtypes) are left for later, in order.

The batch cost model is ``cost(n) = t1 * (1 + slope * (n - 1))``: ``slope`` 1 is no gain (a CPU
kernel that already uses every core), near 0 is a device that runs n frames in the time of one
(a GPU not yet saturated). The executor learns ``slope`` per partition from the batches it runs
(``BatchCost``) and reports it, so the fog's router predicts a queue's drain with batching.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.batch_cost import batch_cost_s, drain_s

__all__ = ["BatchPolicy", "BatchCost", "wait_more_s", "signature", "batch_cost_s", "drain_s"]


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """``max_batch`` 1 turns batching off (the default: a CPU here gains ~nothing, see README)."""

    max_batch: int = 1
    max_wait_s: float = 0.002

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if not 0.0 <= self.max_wait_s <= 1.0:
            raise ValueError("max_wait_s must be in [0, 1] seconds")

    @property
    def enabled(self) -> bool:
        return self.max_batch > 1


def wait_more_s(policy: BatchPolicy, collected: int, waited_s: float, earliest_deadline: float,
                now_wall: float, one_s: float, slope: float) -> float:
    """How much longer to wait for another frame before running the batch (0: run now).

    ``earliest_deadline`` is wall-clock seconds (0: none); the batch must still finish by it with
    one frame more than it has (the frame being waited for)."""
    if not policy.enabled or collected >= policy.max_batch:
        return 0.0
    left = policy.max_wait_s - waited_s
    if earliest_deadline > 0:
        left = min(left, earliest_deadline - now_wall - batch_cost_s(one_s, collected + 1, slope))
    return max(0.0, left)


def signature(feeds: Mapping[str, Any], names: Sequence[str]) -> tuple[Any, ...] | None:
    """What frames must share to be stacked on the batch axis (trailing shapes, dtypes); None: not
    batchable (an input without a leading dimension)."""
    sig: list[Any] = []
    for n in names:
        v = feeds.get(n)
        shape = getattr(v, "shape", None)
        if shape is None or len(shape) == 0:
            return None
        sig.append((n, tuple(shape[1:]), str(getattr(v, "dtype", ""))))
    return tuple(sig)


class BatchCost:
    """Learns ``slope`` of ``cost(n)`` from the batches a partition ran (moving averages, bounded).

    Per-frame times of batches of 1 and of larger batches are kept as exponential averages; the
    slope follows from the two. Unknown (no batch > 1 yet): ``prior``."""

    __slots__ = ("_slope", "alpha", "one_s", "prior")

    def __init__(self, prior: float = 1.0, alpha: float = 0.2) -> None:
        self.one_s = 0.0
        self._slope: float | None = None
        self.prior = prior
        self.alpha = alpha

    def add(self, n: int, seconds: float) -> None:
        if n < 1 or not seconds >= 0:
            return
        if n == 1:
            self.one_s = seconds if self.one_s <= 0 else self.one_s + self.alpha * (seconds - self.one_s)
            return
        if self.one_s <= 0:
            return
        s = max(0.0, min(1.5, (seconds / self.one_s - 1.0) / (n - 1)))
        self._slope = s if self._slope is None else self._slope + self.alpha * (s - self._slope)

    @property
    def slope(self) -> float:
        return self.prior if self._slope is None else self._slope
