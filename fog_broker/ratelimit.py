"""A token bucket: the one rate limit of the fog (rebirths, refusals, enrolment requests)."""
from __future__ import annotations

import math

__all__ = ["RateLimit"]


class RateLimit:
    """``rate`` tokens a second up to ``burst``; ``take(now)`` spends one if there is one.

    Pure: the caller passes its monotonic clock. Not thread-safe: one owner (or a lock around it).
    """

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.level, self.at = burst, -math.inf

    def take(self, now: float) -> bool:
        if math.isfinite(self.at):
            self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level < 1.0:
            return False
        self.level -= 1.0
        return True
