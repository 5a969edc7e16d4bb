"""When a round stops waiting for replies (pure).

Unlike Flower's strategies (which wait for ``min_available_nodes`` forever)
a round ends when everyone replied, when a quorum replied and the grace
period for stragglers passed, or at the deadline. Time is a parameter.
"""
from __future__ import annotations

from enum import Enum

__all__ = ["Wait", "wait_decision"]


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
