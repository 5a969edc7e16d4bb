"""When a round stops waiting for replies, and how long it may wait (pure).

Unlike Flower's strategies (which wait for ``min_available_nodes`` forever)
a round ends when everyone replied, when a quorum replied and the grace
period for stragglers passed, or at the deadline. The deadline follows the
machine: a quantile of earlier rounds' reply times times a margin, within the
user's bounds, longer after a starved attempt (``round_deadline``); Flower's
message TTL is never shorter (``message_ttl``). Time is a parameter.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from runtime.errors import LocalViolation

__all__ = ["DeadlinePolicy", "RoundConfig", "Wait", "message_ttl", "round_deadline", "starved_line", "wait_decision"]


class Wait(Enum):
    WAIT = "wait"          # keep polling
    ALL = "all replied"
    QUORUM = "quorum after grace"
    TIMEOUT = "timeout"    # deadline passed; the caller checks whether the quorum replied


def wait_decision(sent: int, answered: int, ok: int, min_replies: int, elapsed_s: float,
                  since_quorum_s: float | None, timeout_s: float, grace_s: float) -> Wait:
    """Whether to stop waiting for replies.

    ``answered`` counts every reply (errors too), ``ok`` the usable ones.
    """
    if answered >= sent:
        return Wait.ALL
    if ok >= min_replies and since_quorum_s is not None and since_quorum_s >= grace_s:
        return Wait.QUORUM
    if elapsed_s >= timeout_s:
        return Wait.TIMEOUT
    return Wait.WAIT


@dataclass(frozen=True, slots=True)
class DeadlinePolicy:
    """How long a training attempt waits for replies, from what earlier replies took.

    ``initial_s`` until a reply was measured; then ``quantile`` of the last ``window``
    reply times x ``margin``; every starved attempt of the round (no quorum in time)
    multiplies by ``backoff``; always within [``min_s``, ``max_s``].
    """

    initial_s: float = 60.0
    min_s: float = 60.0
    max_s: float = 300.0
    margin: float = 3.0
    quantile: float = 0.95
    window: int = 200
    backoff: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.max_s or self.initial_s <= 0:
            raise LocalViolation(f"round deadlines need 0 < min ({self.min_s:g} s) <= max ({self.max_s:g} s) "
                                 f"and an initial deadline > 0 (got {self.initial_s:g} s)")
        if self.margin < 1 or not 0 < self.quantile <= 1 or self.window < 1 or self.backoff < 1:
            raise LocalViolation("round deadlines need margin >= 1, quantile in (0, 1], window >= 1, backoff >= 1")

    @classmethod
    def around(cls, round_timeout: float, max_round_timeout: float | None = None) -> DeadlinePolicy:
        """The default: never below ``round_timeout`` (the user's), up to ``max_round_timeout`` (5x by default)."""
        hi = max_round_timeout if max_round_timeout is not None else 5.0 * round_timeout
        return cls(initial_s=round_timeout, min_s=round_timeout, max_s=hi)


def round_deadline(policy: DeadlinePolicy, reply_s: Sequence[float], starved: int = 0) -> float:
    """The reply deadline (seconds from sending) of an attempt after ``starved`` starved ones this round."""
    recent = [x for x in reply_s[-policy.window:] if math.isfinite(x) and x >= 0]
    base = policy.initial_s if not recent else _quantile(sorted(recent), policy.quantile) * policy.margin
    return min(policy.max_s, max(policy.min_s, base * policy.backoff ** max(0, starved)))


def _quantile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of sorted ``xs`` (the slowest reply when q is 1)."""
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def message_ttl(deadline_s: float, grace_s: float, slack_s: float = 30.0) -> float:
    """Flower's message TTL (counted from the Message's creation, like the deadline): never shorter than
    the deadline plus grace, so a reply that arrives in time is never expired by the SuperLink."""
    return max(deadline_s + grace_s + slack_s, 2.0 * deadline_s, 60.0)


def starved_line(usable: int, sent: int, deadline_s: float) -> str:
    """The one-line reason of a starved attempt (log, progress.json, report.json)."""
    return f"{usable}/{sent} replies within {deadline_s:.3g} s"


@dataclass(frozen=True, slots=True)
class RoundConfig:
    """Who a round asks, how many usable replies count, and how long it waits (``RobustStrategy``).

    Flower's ``FedAvg`` sampling knobs plus the quorum and deadline this module decides with:
    a round counts with ``quorum(rule minimum, min_replies, min_train_nodes)`` replies, waits
    ``grace`` seconds for stragglers once it has them, and an attempt waits ``round_timeout`` at
    first, then what replies took, up to ``max_round_timeout``; ``max_attempts`` per round.
    """

    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_train_nodes: int = 2
    min_evaluate_nodes: int = 2
    min_available_nodes: int = 2
    min_replies: int | None = None
    round_timeout: float = 60.0
    grace: float = 5.0
    max_attempts: int = 3
    max_round_timeout: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction_train <= 1.0 or not 0.0 <= self.fraction_evaluate <= 1.0:
            raise LocalViolation("fraction_train and fraction_evaluate must be in [0, 1]")
        if self.round_timeout <= 0 or self.grace < 0 or self.max_attempts < 1:
            raise LocalViolation("round_timeout must be > 0, grace >= 0, max_attempts >= 1")
        if self.min_replies is not None and self.min_replies < 1:
            raise LocalViolation(f"min_replies must be >= 1, got {self.min_replies}")
