"""The batch cost model both ends share (pure): the agent's executor sizes its batches with it and
the fog's router predicts a batching stage's drain with it (issue 33).

``cost(n) = t1 * (1 + slope * (n - 1))``: ``slope`` 1 is no gain (a CPU kernel that already uses
every core), near 0 a device that runs n frames in the time of one. It lives in ``runtime`` so the
fog (and through it the coordinator) never imports device code.
"""
from __future__ import annotations

__all__ = ["batch_cost_s", "drain_s"]


def batch_cost_s(one_s: float, n: int, slope: float) -> float:
    """Predicted run time of a batch of ``n`` frames given one frame's ``one_s``."""
    return one_s * (1.0 + max(0.0, slope) * (max(1, n) - 1))


def drain_s(one_s: float, queued: int, max_batch: int, slope: float) -> float:
    """Time to run ``queued`` frames at a stage that batches up to ``max_batch`` (full batches first)."""
    if queued <= 0 or one_s <= 0:
        return 0.0
    b = max(1, max_batch)
    full, rest = divmod(queued, b)
    return full * batch_cost_s(one_s, b, slope) + (batch_cost_s(one_s, rest, slope) if rest else 0.0)
